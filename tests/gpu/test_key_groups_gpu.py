"""Keys in channel groups on the GPU (pytest -m gpu): the CUDA decode and quantize-append kernels (for the
groupings they are built for, config.CUDA_KEY_GROUPS) and the Triton kernels (every grouping) against the PyTorch
path (float64 for attention) at real shapes, and tiny models end to end."""

import pytest
import torch

import turboattn as ta
from turboattn.format.key_transform import fit_key_order
from turboattn.ops.backend import choose
from turboattn.ops.cached.naive import cached_attention_naive

from gpu_decode_inputs import decode_inputs, poison_allocator, rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fp16 dot operands and a bf16 output (the plain kernels' GPU bound, test_kernels_gpu.py).
TOL = 4 * 2.0 ** -11 + 2.0 ** -9

CASES = [
    # head_dim, key groups, v_bits, B, Hkv, G, length, ring W, Tq, fresh, exact first, exact recent
    (256, ((112, 6), (144, 4)), 3, 2, 1, 4, 3000, None, 1, True, 4, 8),      # Gemma-3-like, the preset's options
    (256, ((112, 6), (144, 4)), 3, 2, 1, 4, 1100, 512, 1, True, 0, 8),       # its sliding layers' ring
    (128, ((48, 5), (80, 2)), 8, 4, 8, 4, 5000, None, 2, True, 0, 0),
    (64, ((32, 6), (32, 3)), 4, 4, 3, 3, 2000, None, 1, False, 4, 64),
    (512, ((256, 8), (256, 4)), 4, 1, 2, 8, 3000, None, 1, True, 0, 0),
]


def _cache(d, groups, v_bits, b, hkv, length, window, first, recent, scale_dtype=torch.bfloat16):
    codec = ta.KVCodec(d, None, v_bits, key_groups=groups, scale_dtype=scale_dtype)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else length + 8, sliding_window=window,
                                device="cuda", exact_first=first, exact_recent=recent)
    spread = torch.linspace(0.1, 3.0, d, device="cuda")[torch.randperm(d, device="cuda")]
    k = (torch.randn(b, hkv, length, d, device="cuda") * spread + 1.0).bfloat16()
    v = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
    cache.set_key_transform(k[:, :, :512].float().mean(2), torch.ones(b, hkv, d, device="cuda"),
                            fit_key_order(k[:, :, :512]))
    cache.append(k[:, :, :512], v[:, :, :512])
    if length > 512:
        cache.append(k[:, :, 512:], v[:, :, 512:])
    return cache


@pytest.mark.parametrize("case", CASES, ids=[f"d{c[0]}-L{c[6]}" + ("-ring" if c[7] else "") for c in CASES])
def test_triton_serves_grouped_keys_and_matches_float64(case):
    d, groups, v_bits, b, hkv, g, length, window, tq, fresh, first, recent = case
    assert choose("cached_attention", "triton", torch.device("cuda"), d, True) == "triton"
    torch.manual_seed(0)
    cache = _cache(d, groups, v_bits, b, hkv, length, window, first, recent)
    q, kf, vf, _ = decode_inputs(b, hkv, g, tq, d, fresh, False)
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    poison_allocator()
    out = ta.cached_attention(q, cache, kf, vf, backend="triton")
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert rel_error(out, ref) < TOL


CUDA_CASES = [
    # key groups, B, Hkv, G, length, ring W, Tq, fresh, exact first, exact recent, scale dtype
    (((112, 6), (144, 4)), 2, 1, 4, 3000, None, 1, True, 4, 8, torch.bfloat16),   # Gemma-3-like, preset options
    (((112, 6), (144, 4)), 2, 1, 4, 1100, 512, 1, True, 0, 8, torch.bfloat16),    # its sliding layers' ring
    (((112, 6), (144, 4)), 3, 2, 8, 1000, 501, 1, False, 0, 0, torch.bfloat16),   # a ring of odd capacity: clamped
    (((96, 6), (160, 4)), 2, 2, 4, 5000, None, 2, True, 0, 0, torch.float32),     # 8 query rows, float32 scales
    (((96, 6), (160, 4)), 1, 1, 1, 37, None, 1, False, 4, 0, torch.bfloat16),     # short, G = 1, exact first only
    (((96, 6), (160, 4)), 4, 1, 2, 2500, None, 3, True, 0, 64, torch.float32),
]


@pytest.mark.parametrize("case", CUDA_CASES, ids=[f"a{c[0][0][0]}-L{c[4]}" + ("-ring" if c[5] else "") + f"-{i}"
                                                  for i, c in enumerate(CUDA_CASES)])
def test_cuda_kernel_serves_its_key_groups_and_matches_float64(case, monkeypatch):
    from turboattn.ops.cached import cuda as cuda_path
    groups, b, hkv, g, length, window, tq, fresh, first, recent, scale_dtype = case
    d = 256
    assert choose("cached_attention", "auto", torch.device("cuda"), d, True) == "cuda"

    def no_fallback(*args):
        raise AssertionError("the CUDA kernel handed the call to Triton")
    monkeypatch.setattr(cuda_path, "cached_attention_triton", no_fallback)
    torch.manual_seed(0)
    cache = _cache(d, groups, 3, b, hkv, length, window, first, recent, scale_dtype)
    q, kf, vf, _ = decode_inputs(b, hkv, g, tq, d, fresh, False)
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    poison_allocator()
    out = ta.cached_attention(q, cache, kf, vf)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert rel_error(out, ref) < TOL
    # The decode step's launcher (attention.py's fast path) gives the same output.
    again = ta.cached_attention(q, cache, kf, vf)
    assert torch.equal(again, out)


def test_cuda_key_group_builds_agree_with_the_planner():
    from turboattn.ops.cached.config import CUDA_KEY_GROUPS, cuda_ctas_per_sm
    from turboattn.ops.cuda_extension import extension
    ext = extension()
    for d, groups, v_bits in CUDA_KEY_GROUPS:
        for exact in (False, True):
            built = ext.ctas_per_sm(d, groups[0][1], v_bits, exact, groups[0][0], groups[1][1])
            assert built == cuda_ctas_per_sm(d, groups, v_bits, exact), (d, groups, v_bits, exact)
    assert ext.ctas_per_sm(256, 6, 3, False, 128, 4) == -1


def test_cuda_key_groups_poison_checked_nonfinite_keys():
    """A non-finite key (both group scales NaN) gives NaN where it is seen, as the reference does."""
    torch.manual_seed(3)
    groups = ((112, 6), (144, 4))
    codec = ta.KVCodec(256, None, 3, key_groups=groups, scale_dtype=torch.bfloat16)
    cache = ta.QuantizedKVCache(codec, 2, 1, capacity=700, device="cuda")
    k = torch.randn(2, 1, 600, 256, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1, 600, 256, device="cuda", dtype=torch.bfloat16)
    cache.set_key_transform(k.float().mean(2), torch.ones(2, 1, 256, device="cuda"), fit_key_order(k))
    k[1, 0, 300, 5] = float("inf")
    cache.append(k, v)
    q = torch.randn(2, 4, 1, 256, device="cuda", dtype=torch.bfloat16)
    out = ta.cached_attention(q, cache)
    ref = cached_attention_naive(q, cache.layout, cache.codec, compute_dtype=torch.float64)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all() and torch.isnan(ref[1]).all()
    assert rel_error(out[0], ref[0]) < TOL


def test_triton_append_codes_like_the_pytorch_path():
    """The same tokens appended through the Triton kernels and through the PyTorch path decode alike: only cells
    decided by float rounding may differ (tests/test_key_groups.py checks them one by one under the interpreter)."""
    torch.manual_seed(1)
    caches = []
    for backend in ("triton", "torch"):
        codec = ta.KVCodec(256, None, 3, key_groups=((112, 6), (144, 4)), scale_dtype=torch.bfloat16)
        cache = ta.QuantizedKVCache(codec, 2, 1, capacity=2100, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(2)
        k = torch.randn(2, 1, 2048, 256, device="cuda", generator=gen) * 2 + 0.5
        v = torch.randn(2, 1, 2048, 256, device="cuda", generator=gen)
        cache.set_key_transform(k.mean(2), torch.ones(2, 1, 256, device="cuda"), fit_key_order(k))
        cache.append(k[:, :, :2000], v[:, :, :2000], backend=backend)
        for t in range(2000, 2048):   # decode steps
            cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1], backend=backend)
        caches.append(cache.dequantize())
    for got, want in zip(*caches):
        assert rel_error(got, want) < 1e-3


def _forbid_triton_appends(monkeypatch):
    """Make the CUDA quantize-append's hand-over to Triton an error (it must serve the call itself)."""
    from turboattn.ops.quantize import cuda as quantize_cuda

    def no_fallback(*args, **kwargs):
        raise AssertionError("the CUDA quantize-append handed the call to Triton")
    monkeypatch.setattr(quantize_cuda, "quantize_append_triton", no_fallback)


def _append_pair(codec, window, chunks, order_and_gain):
    """(CUDA cache, PyTorch-path cache) after the same appends: chunks of (k, v, new_lengths)."""
    caches = []
    for backend in ("auto", "torch"):
        cache = ta.QuantizedKVCache(codec, 2, 2, capacity=None if window else 400, sliding_window=window,
                                    device="cuda", exact_first=0 if window else 3, exact_recent=5)
        if order_and_gain is not None:
            cache.set_key_transform(*order_and_gain)
        for k, v, lengths in chunks:
            cache.append(k, v, new_lengths=lengths, backend=backend)
        caches.append(cache)
    return caches


@pytest.mark.parametrize("groups", [((112, 6), (144, 4)), ((96, 6), (160, 4))], ids=["a112", "a96"])
@pytest.mark.parametrize("rule, scale_dtype, transform", [("rms", torch.bfloat16, True),
                                                          ("lsq", torch.float32, True),
                                                          ("corrected", torch.bfloat16, False)])
def test_cuda_append_codes_like_the_pytorch_path(groups, rule, scale_dtype, transform, monkeypatch):
    """A prompt (a long chunk), a ragged chunk and decode steps of bf16, fp16 and fp32 keys through the CUDA
    kernel and through the PyTorch path: cells equal but where float rounding decides (quantize_checks), exact rows
    and lengths equal, a NaN key stored as NaN in both groups and counted once, a zero key (no transform) as
    scales 0."""
    _forbid_triton_appends(monkeypatch)
    assert choose("quantize_append", "auto", torch.device("cuda"), 256, True) == "cuda"
    from quantize_checks import assert_grouped_codes_agree
    gen = torch.Generator(device="cuda").manual_seed(5)
    d = 256
    spread = torch.linspace(0.1, 3.0, d, device="cuda")[torch.randperm(d, device="cuda", generator=gen)]
    k = torch.randn(2, 2, 330, d, device="cuda", generator=gen) * spread + 0.7
    v = torch.randn(2, 2, 330, d, device="cuda", generator=gen)
    fit = None
    if transform:
        gain = torch.rand(2, 2, d, device="cuda", generator=gen) + 0.5
        fit = (k[:, :, :300].mean(2), gain, fit_key_order(k[:, :, :300] * gain[:, :, None]))
    else:
        k[0, 1, 11] = 0
    k[1, 0, 150, 7] = float("nan")
    codec = ta.KVCodec(d, None, 3, rule, key_groups=groups, scale_dtype=scale_dtype)
    chunks = [(k[:, :, :300].bfloat16(), v[:, :, :300].bfloat16(), None),
              (k[:, :, 300:320].half(), v[:, :, 300:320].half(), [20, 13])]
    chunks += [(k[:, :, t:t + 1], v[:, :, t:t + 1], None) for t in range(320, 330)]
    fused, ref = _append_pair(codec, None, chunks, fit)
    assert torch.equal(fused.seen, ref.seen) and fused.seen.tolist() == [330, 323]
    assert torch.equal(fused.nonfinite, ref.nonfinite) and fused.nonfinite.tolist() == [0, 1]
    for name in ("recent_k", "recent_v", "first_k", "first_v"):
        assert torch.equal(getattr(fused, name), getattr(ref, name)), name
    # The tokens each sequence's slots hold, as the caches saw them (rounded to each chunk's dtype).
    seen = [torch.cat([c[0][:, :, :n] for c, n in zip(chunks, lengths)], 2).float()
            for lengths in ([300, 20] + [1] * 10, [300, 13] + [1] * 10)]
    seen_v = [torch.cat([c[1][:, :, :n] for c, n in zip(chunks, lengths)], 2).float()
              for lengths in ([300, 20] + [1] * 10, [300, 13] + [1] * 10)]
    assert_grouped_codes_agree(fused, ref, seen[0][:1], seen_v[0][:1], 0)
    finite = torch.isfinite(seen[1][1:]).all(-1)
    assert not bool(finite[0, 0, 150])
    kept = torch.where(finite[..., None], seen[1][1:], 0)   # the NaN key: codes 0 in both (checked here)
    assert_grouped_codes_agree(fused, ref, kept, seen_v[1][1:], 1)
    assert bool(fused.k_scales[1, 0, 150].isnan().all())
    if not transform:
        assert float(fused.k_scales[0, 1, 11].float().abs().sum()) == 0


def test_cuda_append_into_a_ring(monkeypatch):
    """A sliding-window ring that wraps within a chunk and across decode steps: the dequantized caches agree to
    rounding (a cell decided by float rounding moves a value by one cell width, so not exactly)."""
    _forbid_triton_appends(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(6)
    d = 256
    k = torch.randn(2, 2, 200, d, device="cuda", generator=gen) * 2 + 0.5
    v = torch.randn(2, 2, 200, d, device="cuda", generator=gen)
    codec = ta.KVCodec(d, None, 3, key_groups=((112, 6), (144, 4)), scale_dtype=torch.bfloat16)
    fit = (k[:, :, :150].mean(2), torch.ones(2, 2, d, device="cuda"), fit_key_order(k[:, :, :150]))
    chunks = [(k[:, :, :150], v[:, :, :150], [150, 97])]
    chunks += [(k[:, :, t:t + 1], v[:, :, t:t + 1], None) for t in range(150, 200)]
    fused, ref = _append_pair(codec, 64, chunks, fit)
    assert torch.equal(fused.seen, ref.seen)
    for got, want in zip(fused.dequantize(), ref.dequantize()):
        assert rel_error(got, want) < 1e-3
    for name in ("recent_k", "recent_v"):
        assert torch.equal(getattr(fused, name), getattr(ref, name)), name


def test_cuda_decode_step_append_replays_in_a_cuda_graph(monkeypatch):
    """A decode step's grouped append captured in a CUDA graph and replayed writes what eager calls write: the slot
    from the device lengths, the exact rows, the lengths' advance."""
    _forbid_triton_appends(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(7)
    codec = ta.KVCodec(256, None, 3, key_groups=((112, 6), (144, 4)), scale_dtype=torch.bfloat16)
    k = torch.randn(1, 2, 40, 256, device="cuda", generator=gen).bfloat16()
    v = torch.randn(1, 2, 40, 256, device="cuda", generator=gen).bfloat16()
    caches = [ta.QuantizedKVCache(codec, 1, 2, capacity=64, device="cuda", exact_recent=8, static=True)
              for _ in range(2)]
    for cache in caches:   # the prompt and one step eagerly (the capture's warm-up)
        cache.set_key_transform(k[:, :, :32].float().mean(2), torch.ones(1, 2, 256, device="cuda"),
                                fit_key_order(k[:, :, :32]))
        cache.append(k[:, :, :32], v[:, :, :32])
        cache.append(k[:, :, 32:33], v[:, :, 32:33])
    step_k, step_v = k[:, :, 33:34].clone(), v[:, :, 33:34].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        caches[0].append(step_k, step_v)
    for t in range(33, 40):
        step_k.copy_(k[:, :, t:t + 1])
        step_v.copy_(v[:, :, t:t + 1])
        graph.replay()
        caches[1].append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    torch.cuda.synchronize()
    assert caches[0].seen.tolist() == [40]
    for name in ("seen", "k_codes", "k_scales", "v_codes", "v_scales", "recent_k", "recent_v"):
        assert torch.equal(getattr(caches[0], name), getattr(caches[1], name)), name


@torch.no_grad()
def test_tiny_head_dim_256_model_runs_the_cuda_kernels(monkeypatch):
    """A tiny Gemma-3 of head_dim 256 (sliding layers: rings of 8) with 112 x 6 + 144 x 4 keys: decode and appends
    on the CUDA kernels (no Triton hand-over).  Its first layer's cache holds what the PyTorch path's holds (to
    cells decided by rounding), and its logits differ from the PyTorch path's by no more than the Triton kernels'
    (float16 operands in both, against float32 there) do."""
    pytest.importorskip("transformers")
    from hf_models import random_ids, teacher_forced_logits, tiny_gemma3
    from turboattn.hf import TurboQuantCache
    from turboattn.ops import backend as registry
    from turboattn.ops.cached import cuda as cuda_path

    model = tiny_gemma3(head_dim=256).to("cuda", torch.bfloat16)
    ids = random_ids(40).cuda()
    groups = ((112, 6), (144, 4))

    def run(names):
        """(logits, cache) with the implementations `names` alone registered (None: all)."""
        with monkeypatch.context() as patch:
            if names is None:
                _forbid_triton_appends(patch)
                patch.setattr(cuda_path, "cached_attention_triton", lambda *a: (_ for _ in ()).throw(
                    AssertionError("the CUDA decode kernel handed the call to Triton")))
            else:
                for op in ("cached_attention", "quantize_append"):
                    patch.setitem(registry._REGISTRY, op, {n: registry._REGISTRY[op][n] for n in names})
            registry._auto.cache_clear()   # "auto" decisions are cached
            cache = TurboQuantCache(model.config, v_bits=3, key_groups=groups)
            logits = teacher_forced_logits(model, ids, cache, 24)
        registry._auto.cache_clear()
        return logits.float(), cache

    got, cuda_cache = run(None)
    triton, _ = run(("torch", "triton"))
    want, torch_cache = run(("torch",))
    # The first layer's keys and values come from the embeddings alone, the same in both runs (later layers' from
    # hidden states that the attention outputs' rounding moved).
    for x, y in zip(cuda_cache.layers[0].cache.dequantize(), torch_cache.layers[0].cache.dequantize()):
        assert rel_error(x, y) < 1e-3
    assert rel_error(got, want) <= 1.5 * rel_error(triton, want), (rel_error(got, want), rel_error(triton, want))


@torch.no_grad()
def test_tiny_model_matches_the_pytorch_path(monkeypatch):
    """A tiny Gemma-3 (sliding and full layers) in bf16 through the Triton kernels against the same cache on the
    PyTorch path: logits within bf16 rounding of a decode step."""
    pytest.importorskip("transformers")
    from hf_models import random_ids, teacher_forced_logits, tiny_gemma3
    from turboattn.hf import TurboQuantCache
    from turboattn.ops import backend as registry

    model = tiny_gemma3().to("cuda", torch.bfloat16)
    ids = random_ids(40).cuda()
    groups = ((32, 6), (32, 3))
    got = teacher_forced_logits(model, ids, TurboQuantCache(model.config, v_bits=4, key_groups=groups), 24)
    for op in ("cached_attention", "quantize_append"):   # the PyTorch path alone serves the same cache
        monkeypatch.setitem(registry._REGISTRY, op, {"torch": registry._REGISTRY[op]["torch"]})
    registry._auto.cache_clear()
    try:
        want = teacher_forced_logits(model, ids, TurboQuantCache(model.config, v_bits=4, key_groups=groups), 24)
    finally:
        monkeypatch.undo()
        registry._auto.cache_clear()   # "auto" decisions are cached: drop the ones made without Triton
    # The paths differ only in each attention output, by float16 operand rounding and the bf16 cast (TOL, ~4e-3
    # relative); through three residual layers that moves bf16 logits by a few times as much: 2e-2, about 5x TOL.
    assert rel_error(got.float(), want.float()) < 2e-2
