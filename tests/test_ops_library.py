"""The torch ops (torch.ops.turboattn.*) and the backend registry behind them.

torch.library.opcheck runs each op for real and through its fake
implementation, checks the schema (which arguments it mutates), and traces it
the way torch.compile does; every implementation registered for the CPU is
checked (Triton under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import pytest
import torch

import turboattn as ta
from turboattn.ops import backend
from turboattn.ops.cached.config import DecodePlan, plan_decode

IMPLS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def _cache(gen, window=None, exact_recent=0, exact_first=0):
    cache = ta.QuantizedKVCache(ta.KVCodec(64, 4, 3), 2, 2, capacity=None if window else 40, sliding_window=window,
                                exact_recent=exact_recent, exact_first=exact_first)
    cache.append(torch.randn(2, 2, 21, 64, generator=gen), torch.randn(2, 2, 21, 64, generator=gen),
                 backend="torch")
    return cache


def _cached_args(cache, q, k, v, impl):
    layout = cache.layout
    plan = plan_decode(q.device, 64, 4, 3, 4, q.shape[2] * 2, 21, num_splits=2)
    return (q, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen, layout.starts, k, v,
            None, None, None, False, None, layout.sliding_window, 4, 3, None, None, plan.to_list(),
            layout.merge_counters, layout.recent_k, layout.recent_v, layout.exact_recent, layout.first_k,
            layout.first_v, layout.exact_first, [], None, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("exact_recent,exact_first", [(0, 0), (5, 0), (0, 4), (5, 4)],
                         ids=["codes", "exact-window", "exact-first", "exact-both"])
def test_opcheck_cached_attention(impl, window, exact_recent, exact_first, gen):
    """The exact buffers are read, not written: opcheck fails on an undeclared mutation."""
    if exact_first and window:
        pytest.skip("exact first tokens need a contiguous cache")
    cache = _cache(gen, window, exact_recent, exact_first)
    q = torch.randn(2, 4, 2, 64, generator=gen).half()
    k, v = (torch.randn(2, 2, 2, 64, generator=gen).half() for _ in range(2))
    torch.library.opcheck(torch.ops.turboattn.cached_attention.default, _cached_args(cache, q, k, v, impl))
    torch.library.opcheck(torch.ops.turboattn.cached_attention.default, _cached_args(cache, q[:, :, :1], None, None,
                                                                                     impl))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("exact_recent,exact_first", [(0, 0), (5, 24)], ids=["codes", "exact-rows"])
def test_opcheck_quantize_append(impl, exact_recent, exact_first, gen):
    """The op writes the codes and the exact rows, and reads `seen`: opcheck fails on an undeclared mutation (24
    first rows: the cache holds 21 tokens, so the appends still write some)."""
    cache = _cache(gen, exact_recent=exact_recent, exact_first=exact_first)
    layout = cache.layout
    k, v = (torch.randn(2, 2, 3, 64, generator=gen) for _ in range(2))
    lengths = torch.tensor([3, 1], dtype=torch.int32)
    for new_lengths in (None, lengths):
        torch.library.opcheck(torch.ops.turboattn.quantize_append.default,
                              (k, v, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen,
                               layout.starts, new_lengths, None, None, None, 4, 3, "corrected", cache.nonfinite,
                               layout.merge_counters, layout.recent_k, layout.recent_v, layout.exact_recent,
                               layout.first_k, layout.first_v, layout.exact_first, [], None, impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_with_key_groups(impl, gen):
    """Keys in channel groups pass through the ops as k_bits 0, the flat groups and the channel order
    (library.op_key_groups): both ops check against their fakes, and they code and read the cache as the eager
    path does."""
    from turboattn.format.key_transform import fit_key_order
    from turboattn.ops.library import op_key_groups

    codec = ta.KVCodec(64, None, 3, key_groups=((32, 6), (32, 3)))
    cache = ta.QuantizedKVCache(codec, 2, 2, capacity=40, exact_recent=5, exact_first=4)
    k, v = (torch.randn(2, 2, 21, 64, generator=gen) for _ in range(2))
    cache.set_key_transform(k.mean(2), torch.ones(2, 2, 64), fit_key_order(k))
    cache.append(k, v, backend="torch")
    layout = cache.layout
    k_bits, groups = op_key_groups(codec)
    assert (k_bits, groups) == (0, [32, 6, 32, 3])
    k3, v3 = (torch.randn(2, 2, 3, 64, generator=gen) for _ in range(2))
    torch.library.opcheck(torch.ops.turboattn.quantize_append.default,
                          (k3, v3, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen,
                           layout.starts, None, layout.key_shift, layout.key_gain, None, k_bits, 3, "corrected",
                           cache.nonfinite, layout.merge_counters, layout.recent_k, layout.recent_v,
                           layout.exact_recent, layout.first_k, layout.first_v, layout.exact_first, groups,
                           layout.key_order, impl))
    q = torch.randn(2, 4, 1, 64, generator=gen)
    plan = plan_decode(q.device, 64, codec.key_code, 3, 4, 2, 21, num_splits=2)
    args = (q, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen, layout.starts, None,
            None, layout.key_shift, layout.key_gain, layout.key_gain_inv, layout.key_shifted, None, None, k_bits, 3,
            None, None, plan.to_list(), layout.merge_counters, layout.recent_k, layout.recent_v,
            layout.exact_recent, layout.first_k, layout.first_v, layout.exact_first, groups, layout.key_order, impl)
    torch.library.opcheck(torch.ops.turboattn.cached_attention.default, args)
    want = ta.cached_attention(q, cache, backend=impl, num_splits=2)
    torch.testing.assert_close(torch.ops.turboattn.cached_attention(*args), want, atol=0, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_append_op_leaves_seen_to_its_caller(impl, gen):
    """The torch op (what torch.compile traces) codes and copies the exact rows but does not advance `seen`: inductor
    miscompiled an op that did (ops/library.py run_quantize_append); the traced path then advances it with an aten
    add, and the eager path in the same call.  Both give the cache of a plain append."""
    from turboattn.ops.library import run_quantize_append

    k, v = (torch.randn(2, 2, 3, 64, generator=gen) for _ in range(2))
    via_op, eager, plain = (_cache(torch.Generator().manual_seed(0), exact_recent=5, exact_first=24) for _ in range(3))
    layout = via_op.layout
    torch.ops.turboattn.quantize_append(k, v, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales,
                                        layout.seen, layout.starts, None, None, None, None, 4, 3, "corrected",
                                        via_op.nonfinite, layout.merge_counters, layout.recent_k, layout.recent_v,
                                        layout.exact_recent, layout.first_k, layout.first_v, layout.exact_first, [],
                                        None, impl)
    assert via_op.seen.tolist() == [21, 21]
    via_op.seen += 3
    run_quantize_append(k, v, eager.layout, None, eager.codec, impl)
    assert eager.seen.tolist() == [24, 24]
    plain.append(k, v, backend=impl)
    for name in ("k_codes", "k_scales", "v_codes", "v_scales", "seen", "recent_k", "recent_v", "first_k", "first_v"):
        assert torch.equal(getattr(via_op, name), getattr(plain, name)), name
        assert torch.equal(getattr(eager, name), getattr(plain, name)), name


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("return_lse", [False, True])
def test_opcheck_flash_attention(impl, return_lse, gen):
    q = torch.randn(1, 4, 5, 64, generator=gen).half()
    k, v = (torch.randn(1, 2, 7, 64, generator=gen).half() for _ in range(2))
    torch.library.opcheck(torch.ops.turboattn.flash_attention.default,
                          (q, k, v, True, None, None, None, None, None, None, return_lse, impl))


def test_public_functions_call_the_ops(gen, monkeypatch):
    """cached_attention / flash_attention / append run the ops' implementations, chosen by the registry."""
    calls = []
    real = backend.load

    def spy(op, name):
        calls.append((op, name))
        return real(op, name)
    monkeypatch.setattr(backend, "load", spy)
    cache = _cache(gen)
    q = torch.randn(2, 4, 1, 64, generator=gen)
    ta.cached_attention(q, cache)
    ta.flash_attention(q, q, q)
    cache.append(q[:, :2], q[:, :2])
    assert calls == [("quantize_append", "torch"), ("cached_attention", "torch"), ("flash_attention", "torch"),
                     ("quantize_append", "torch")]


def test_auto_picks_by_device_and_forcing_checks():
    cpu = torch.device("cpu")
    for op in ("quantize_append", "cached_attention", "flash_attention"):
        assert backend.choose(op, "auto", cpu) == "torch"
        assert backend.choose(op, "torch", cpu) == "torch"
        names = [impl.name for impl in backend.implementations(op)]
        assert names[-1] == "torch" and "triton" in names  # best first; torch is the fallback
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\)"):
        backend.choose("cached_attention", "cuda", cpu)


def test_kernels_are_chosen_only_for_the_head_dims_they_serve():
    """The Triton kernels of the compressed cache serve every head dim of the format (multiples of 16 from 32 to
    512), the CUDA decode and quantize-append kernels 64, 128, 256 and 512: "auto" sends the other head dims to
    Triton on a GPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for d in (64, 128, 256, 512):
        assert backend.choose("cached_attention", "auto", cuda, d) == "cuda"
        assert backend.choose("quantize_append", "auto", cuda, d) == "cuda"
    for d in (32, 48, 80, 96, 112, 160, 192, 480):
        for op in ("cached_attention", "quantize_append"):
            assert backend.choose(op, "auto", cuda, d) == "triton"
            assert backend.choose(op, "torch", cpu, d) == "torch"
            assert backend.choose(op, "triton", cuda, d) == "triton"
    # The dense flash kernels mask a padded head-dim tile: every head dim.
    assert backend.choose("flash_attention", "auto", cuda, 80) == "triton"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set by `make test`)")
@pytest.mark.parametrize("d", [80, 96])
def test_cache_ops_at_other_head_dims_run_on_triton(d):
    """Forced Triton at a head dim that is not a power of two: the same codes as the PyTorch path, and attention
    within the kernels' float16 tolerance (tests/test_kernels_cached.py)."""
    x = torch.randn(1, 1, 2, d, generator=torch.Generator().manual_seed(0))
    caches = [ta.QuantizedKVCache(ta.KVCodec(d, 8, 8), batch_size=1, num_kv_heads=1, capacity=8) for _ in range(2)]
    caches[0].append(x, x, backend="triton")
    caches[1].append(x, x, backend="torch")
    assert torch.equal(caches[0].k_codes, caches[1].k_codes) and torch.equal(caches[0].v_codes, caches[1].v_codes)
    got, want = (ta.cached_attention(x, caches[1], backend=name) for name in ("triton", "torch"))
    assert float((got - want).norm() / want.norm()) < 5 * 2.0**-11


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set by `make test`)")
def test_triton_kernels_refuse_other_head_dims_when_called_directly():
    """The torch ops take the implementation by name: one that bypasses backend.choose and the codec's check still
    gets an error, never a kernel run at a head dim it does not tile."""
    from turboattn.ops.cached.config import check_kernel_head_dim
    for d in (16, 72, 528):
        for op in ("quantize_append", "cached_attention"):
            with pytest.raises(ValueError, match=rf"Triton {op} kernel serves head_dim a multiple of 16 from 32 to "
                                                 rf"512, got head_dim={d}"):
                check_kernel_head_dim(op, d)
    for d in (32, 80, 496, 512):
        check_kernel_head_dim("cached_attention", d)


def test_a_new_implementation_is_one_registration(monkeypatch):
    """A registered implementation with a higher priority serves "auto" on its devices, imported lazily."""
    monkeypatch.setitem(backend._REGISTRY, "flash_attention", dict(backend._REGISTRY["flash_attention"]))
    backend.register("flash_attention", "triton", "turboattn.ops.flash.naive:flash_attention_naive",
                     priority=20, devices=("cpu",))
    backend.load.cache_clear()
    try:
        assert backend.choose("flash_attention", "auto", torch.device("cpu")) == "triton"
        q = torch.randn(1, 2, 3, 64)
        assert torch.equal(ta.flash_attention(q, q, q), ta.flash_attention(q, q, q, backend="torch"))
    finally:
        backend.load.cache_clear()
        backend._auto.cache_clear()   # "auto" decisions are cached; monkeypatch restores the registry behind them


def test_decode_plan_round_trips_and_validates():
    plan = DecodePlan(16, 64, 4, 3, 5, "lut")
    assert DecodePlan.from_list(plan.to_list()) == plan
    with_exact = DecodePlan(16, 64, 4, 3, 5, "lut", exact_parts=2)
    assert DecodePlan.from_list(with_exact.to_list()) == with_exact
    assert DecodePlan.from_list(plan.to_list()[:6]) == plan   # a list from before exact_parts
    with pytest.raises(ValueError, match="lookup must be one of"):
        DecodePlan(16, 64, 4, 3, 5, "table")
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        DecodePlan(16, 64, 4, 3, 0, "lut")
    with pytest.raises(ValueError, match="exact_parts must be None or a positive int"):
        DecodePlan(16, 64, 4, 3, 5, "lut", exact_parts=0)


def test_plan_and_num_splits_reach_the_kernel(gen):
    """An explicit plan or num_splits changes only how the work is split, not the result."""
    cache = _cache(gen)
    q = torch.randn(2, 4, 1, 64, generator=gen).half()
    base = ta.cached_attention(q, cache, backend="torch")
    if "triton" not in IMPLS:
        pytest.skip("needs TRITON_INTERPRET=1")
    for kwargs in ({"num_splits": 1}, {"num_splits": 3}, {"plan": DecodePlan(16, 16, 4, 1, 2, "gather")}):
        out = ta.cached_attention(q, cache, backend="triton", **kwargs)
        # float16 dot operands: each rounding is at most 2^-11 relative (as in test_kernels_cached.py).
        assert float((out.double() - base.double()).norm() / base.double().norm()) < 4 * 2.0**-11
    with pytest.raises(TypeError, match="plan must be a turboattn.ops.cached.config.DecodePlan"):
        ta.cached_attention(q, cache, plan=[16, 16, 4, 1, 2, 0])


def test_compiled_calls_trace_to_the_ops(gen):
    """Under torch.compile the public functions are single op calls: fullgraph traces, results match eager."""
    cache = _cache(gen)
    q = torch.randn(2, 4, 1, 64, generator=gen)
    k, v = (torch.randn(2, 2, 1, 64, generator=gen) for _ in range(2))

    def step(q, k, v):
        return ta.cached_attention(q, cache, k, v), ta.flash_attention(q, k, v)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=capture)
    got = compiled(q, k, v)
    want = step(q, k, v)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    called = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert "turboattn.cached_attention" in called and "turboattn.flash_attention" in called


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels need the interpreter here")
@pytest.mark.parametrize("d, bits", [(64, (4, 3)), (128, (4, 4)), (256, (8, 2))])
def test_allocated_device_tables_cover_every_kernel_table(d, bits, gen):
    """After allocate_device_tables, a Triton append and decode step (fresh k/v, sinks) and the CUDA quantize
    kernel's tables make no new table: none would be allocated inside a CUDA graph's warm-up
    (ops/device_tables.py).  The tables' caches are keyed by device, so the check runs on the CPU with the
    interpreter."""
    from turboattn.format import codebook, rotation
    from turboattn.ops import triton_lib
    from turboattn.ops.device_tables import allocate_device_tables
    from turboattn.ops.quantize import cuda as quantize_cuda
    from turboattn.ops.quantize import triton as quantize_triton

    codec = ta.KVCodec(d, *bits)
    caches = (codebook.device_centroids, rotation.device_signs, triton_lib.hadamard_tile, quantize_triton.cell_tables,
              quantize_cuda.cell_grid)
    for f in caches:
        f.cache_clear()   # else tables made by earlier tests would hide a missing one
    allocate_device_tables(codec, torch.device("cpu"))
    before = [f.cache_info().currsize for f in caches]
    cache = ta.QuantizedKVCache(codec, 1, 1, capacity=20)
    k, v = (torch.randn(1, 1, 5, d, generator=gen) for _ in range(2))
    cache.append(k, v, backend="triton")
    q = torch.randn(1, 2, 1, d, generator=gen)
    ta.cached_attention(q, cache, k[:, :, :1], v[:, :, :1], sinks=torch.zeros(2), backend="triton")
    quantize_cuda._tables(*bits, d, torch.device("cpu"))   # what the CUDA quantize wrapper reads before its launch
    assert [f.cache_info().currsize for f in caches] == before


def test_every_op_body_runs_under_its_tensors_device_guard(gen, monkeypatch):
    """Triton launches on torch's current device, not on its arguments' (triton.runtime.jit takes
    driver.active.get_current_device()): each op's body enters library._on(tensor device) around the kernel,
    which for a GPU is torch.cuda.device(that GPU) (tests/gpu/test_multi_gpu.py runs it on cuda:1)."""
    from turboattn.ops import library

    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(library, "_on", Recorder)
    cache = _cache(gen)                                  # quantize_append
    q = torch.randn(2, 4, 1, 64, generator=gen)
    ta.cached_attention(q, cache)                        # cached_attention
    ta.flash_attention(q, q[:, :2], q[:, :2])            # flash_attention
    assert entered == [torch.device("cpu")] * 3
    monkeypatch.undo()
    guard = library._on(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    with library._on(torch.device("cpu")):
        pass
