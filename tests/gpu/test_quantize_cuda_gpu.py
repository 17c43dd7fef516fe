"""The CUDA quantize-append kernel (ops/quantize/csrc/quantize.cu) against the reference codec, on a GPU.

Both caches start from the same random bytes (poison), so a slot the kernel should not touch must keep them, and
one it should write must hold the reference's codes: the whole tensors are compared (quantize_checks.assert_same:
only cells within float rounding of a boundary may differ)."""

from __future__ import annotations

import pytest
import torch

import turboattn as ta
from turboattn.ops import backend

from quantize_checks import assert_same

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BITS = (2, 3, 4, 5, 6, 8)


def _pair(codec, b, hkv, gen, **kw):
    """A cache for the CUDA kernel and one for the reference, holding the same random bytes."""
    fused = ta.QuantizedKVCache(codec, b, hkv, device="cuda", **kw)
    ref = ta.QuantizedKVCache(codec, b, hkv, device="cuda", **kw)
    for name in ("k_codes", "v_codes"):
        noise = torch.randint(0, 256, getattr(fused, name).shape, generator=gen, dtype=torch.uint8).cuda()
        getattr(fused, name).copy_(noise)
        getattr(ref, name).copy_(noise)
    for name in ("k_scales", "v_scales"):
        noise = torch.randn(getattr(fused, name).shape, generator=gen).cuda()
        getattr(fused, name).copy_(noise)
        getattr(ref, name).copy_(noise)
    return fused, ref


def _append(fused, ref, k, v, **kw):
    fused.append(k, v, **kw)   # auto: the CUDA kernel on a GPU
    ref.append(k, v, backend="torch", **kw)


def test_auto_picks_the_cuda_kernel():
    for d in (64, 128, 256, 512):
        assert backend.choose("quantize_append", "auto", torch.device("cuda"), d) == "cuda"
    assert backend.choose("quantize_append", "auto", torch.device("cuda"), 80) == "triton"


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rule", ["rms", "corrected", "lsq"])
def test_every_width_and_rule(d, bits, rule, gen):
    v_bits = BITS[(BITS.index(bits) + 2) % len(BITS)]   # a different width on the V side
    codec = ta.KVCodec(d, bits, v_bits, rule)
    fused, ref = _pair(codec, 2, 3, gen, capacity=400)
    inputs = []
    for t, dtype in ((1, torch.bfloat16), (37, torch.float16), (300, torch.float32), (5, torch.bfloat16)):
        k = (torch.randn(2, 3, t, d, generator=gen) * 3).to("cuda", dtype)
        v = torch.randn(2, 3, t, d, generator=gen).to("cuda", dtype)
        k[0, 1, 0] = 0   # a zero vector: scale 0
        _append(fused, ref, k, v)
        inputs.append((k, v))
    assert_same(fused, ref, inputs)


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_ring_lengths_transform_and_bf16_scales(d, gen):
    """A ring that wraps (and a chunk longer than it), ragged lengths, the key transform, bfloat16 scales."""
    codec = ta.KVCodec(d, 4, 3, scale_dtype=torch.bfloat16)
    fused, ref = _pair(codec, 3, 2, gen, sliding_window=40)
    shift = torch.randn(3, 2, d, generator=gen).cuda() * 3
    gain = torch.rand(3, 2, d, generator=gen).cuda() + 0.5
    for cache in (fused, ref):
        cache.set_key_transform(shift, gain)
    inputs = []
    for t, lengths in ((30, None), (23, [23, 1, 0]), (97, [97, 60, 2]), (1, None)):
        k = shift[:, :, None] + torch.randn(3, 2, t, d, generator=gen).cuda()
        v = torch.randn(3, 2, t, d, generator=gen).cuda()
        _append(fused, ref, k.bfloat16(), v.bfloat16(), new_lengths=lengths)
        inputs.append((ref.stored_keys(k.bfloat16()), v.bfloat16()))
    assert torch.equal(fused.seen, ref.seen)
    assert_same(fused, ref, inputs)


def test_strided_inputs_and_static_overflow(gen):
    """k, v as transformers makes them ([B, T, H, D] transposed: a row stride of H * D), a misaligned view (copied
    first), and a static cache that runs out of room: only the slots that fit are written."""
    codec = ta.KVCodec(128, 5, 4)
    fused, ref = _pair(codec, 2, 4, gen, capacity=50, static=True)
    inputs = []
    for t in (33, 30):
        k = torch.randn(2, t, 4, 128, generator=gen).cuda().bfloat16().transpose(1, 2)
        v = torch.randn(2, t, 4, 129, generator=gen).cuda().bfloat16()[..., 1:].transpose(1, 2)
        _append(fused, ref, k, v)
        inputs.append((k, v))
    assert bool(fused.overflowed) and bool(ref.overflowed)
    assert_same(fused, ref, inputs)


def test_non_finite_vectors_are_stored_as_nan_and_counted(gen):
    codec = ta.KVCodec(128, 4, 4)
    fused, ref = _pair(codec, 2, 2, gen, capacity=20)
    k = torch.randn(2, 2, 9, 128, generator=gen).cuda()
    v = torch.randn(2, 2, 9, 128, generator=gen).cuda()
    k[0, 1, 3, 7] = float("nan")
    v[1, 0, 8, 100] = float("inf")
    k[1, 1, 0] = 1e30   # finite: coded at its own scale
    _append(fused, ref, k, v)
    assert fused.nonfinite.tolist() == ref.nonfinite.tolist() == [1, 1]
    assert torch.isnan(fused.k_scales[0, 1, 3]).all() and torch.isnan(fused.v_scales[1, 0, 8]).all()
    assert int(fused.k_codes[0, 1, 3].count_nonzero()) == 0
    finite = ~torch.isnan(ref.k_scales)
    assert torch.equal(torch.isnan(fused.k_scales), torch.isnan(ref.k_scales))
    rel = (fused.k_scales[finite] - ref.k_scales[finite]).abs() / ref.k_scales[finite].abs().clamp_min(1e-30)
    assert float(rel.max()) < 0.05


# Appends of at least 8192 tokens x KV heads x sequences of 16-bit vectors take the tile loop (quantize.cu
# TILE_MIN_TOKENS): at B = 2 and 2 KV heads, 2048 tokens.
TILE_TOKENS = 2048


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rule", ["rms", "corrected", "lsq"])
def test_long_appends_every_width_and_rule(d, bits, rule, gen):
    """The tile loop (a long append of 16-bit vectors), every width and rule, then a short append behind it."""
    v_bits = BITS[(BITS.index(bits) + 2) % len(BITS)]
    codec = ta.KVCodec(d, bits, v_bits, rule)
    fused, ref = _pair(codec, 2, 2, gen, capacity=TILE_TOKENS + 20)
    dtype = torch.float16 if bits % 2 else torch.bfloat16
    inputs = []
    for t in (TILE_TOKENS + 3, 5):
        k = (torch.randn(2, 2, t, d, generator=gen) * 3).to("cuda", dtype)
        v = torch.randn(2, 2, t, d, generator=gen).to("cuda", dtype)
        _append(fused, ref, k, v)
        inputs.append((k, v))
    assert_same(fused, ref, inputs)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_long_appends_into_a_ring_with_ragged_lengths(d, gen):
    """The tile loop into a ring shorter than the chunk (only its last N tokens stay), with ragged lengths and
    bfloat16 scales; then keys with a transform (the tile loop's three-part rotation up to D = 128, the scalar loop
    at 256)."""
    codec = ta.KVCodec(d, 4, 3, scale_dtype=torch.bfloat16)
    fused, ref = _pair(codec, 2, 2, gen, sliding_window=300)
    inputs = []
    for t, lengths in ((TILE_TOKENS, None), (TILE_TOKENS + 9, [TILE_TOKENS + 9, 700]), (TILE_TOKENS, [17, TILE_TOKENS])):
        k = torch.randn(2, 2, t, d, generator=gen).cuda().bfloat16()
        v = torch.randn(2, 2, t, d, generator=gen).cuda().bfloat16()
        _append(fused, ref, k, v, new_lengths=lengths)
        inputs.append((k, v))
    assert torch.equal(fused.seen, ref.seen)
    assert_same(fused, ref, inputs)
    fused, ref = _pair(codec, 2, 2, gen, sliding_window=300)
    shift = torch.randn(2, 2, d, generator=gen).cuda() * 3
    gain = torch.rand(2, 2, d, generator=gen).cuda() + 0.5
    for cache in (fused, ref):
        cache.set_key_transform(shift, gain)
    k = (shift[:, :, None] + torch.randn(2, 2, TILE_TOKENS, d, generator=gen).cuda()).bfloat16()
    v = torch.randn(2, 2, TILE_TOKENS, d, generator=gen).cuda().bfloat16()
    _append(fused, ref, k, v)
    assert_same(fused, ref, [(ref.stored_keys(k), v)])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [(4, 3), (8, 2)])
def test_long_chunks_rows_out_of_range(d, dtype, bits, gen):
    """A long chunk of 16-bit vectors takes the tile path (the rotation on tensor cores, no prescale); rows whose
    sum of squares leaves its safe range or is not finite are coded again in the reference's order, and exact zero
    vectors (signed zeros too) stay on the tile path.  Both must match the reference."""
    codec = ta.KVCodec(d, *bits)
    fused, ref = _pair(codec, 2, 2, gen, capacity=TILE_TOKENS + 100)
    big, tiny = (1e30, 1e-30) if dtype == torch.bfloat16 else (3e3, 1e-4)   # float16: finite up to 65504
    k = torch.randn(2, 2, TILE_TOKENS, d, generator=gen).cuda()
    v = torch.randn(2, 2, TILE_TOKENS, d, generator=gen).cuda()
    k[0, 0, 3] = 0.0
    k[0, 0, 4] = -0.0
    k[0, 1, 9, 5] = float("nan")
    v[1, 0, 17, 40] = float("inf")
    k[1, 1, 20] *= big          # finite; in bfloat16 its sum of squares overflows float32
    v[0, 1, 33] *= tiny
    k[1, 0, 50] = 0.0
    k[1, 0, 50, d // 3] = 2.5   # one coordinate: every rotated value has the same magnitude
    k, v = k.to(dtype), v.to(dtype)
    _append(fused, ref, k, v)
    assert fused.nonfinite.tolist() == ref.nonfinite.tolist() == [1, 1]
    finite = ~(torch.isnan(ref.k_scales) | torch.isnan(ref.v_scales))
    assert torch.equal(torch.isnan(fused.k_scales), torch.isnan(ref.k_scales))
    assert torch.equal(torch.isnan(fused.v_scales), torch.isnan(ref.v_scales))
    for name in ("k_scales", "v_scales"):
        getattr(fused, name)[~finite] = 0
        getattr(ref, name)[~finite] = 0
    assert_same(fused, ref, [(k, v)])


EXACT_ROWS = ("recent_k", "recent_v", "first_k", "first_v")


def _poison_exact_rows(fused, ref, gen):
    for name in EXACT_ROWS:
        if getattr(fused, name) is not None:
            noise = torch.randn(getattr(fused, name).shape, generator=gen).to(getattr(fused, name))
            getattr(fused, name).copy_(noise)
            getattr(ref, name).copy_(noise)


def _assert_same_exact_rows(fused, ref):
    """Every exact row alike; not the recent window's scratch row R, which the reference's masked scatter writes to
    and the kernel never needs."""
    for name in EXACT_ROWS:
        if getattr(fused, name) is not None:
            rows = fused.exact_recent if name.startswith("recent") else None
            assert torch.equal(getattr(fused, name)[:, :, :rows], getattr(ref, name)[:, :, :rows]), name


def _misalign_exact_rows(cache):
    """The cache's exact rows as views whose rows are not 16-byte aligned (row stride D + 1): the kernel's element
    loop instead of its 16-byte copies."""
    for name in EXACT_ROWS:
        rows = getattr(cache, name)
        if rows is not None:
            wide = torch.zeros(*rows.shape[:-1], rows.shape[-1] + 1, dtype=rows.dtype, device=rows.device)
            setattr(cache, name, wide[..., 1:])
    cache._tensors_changed()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("exact_dtype, in_dtype, aligned", [
    (torch.bfloat16, torch.float32, True), (torch.float32, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True), (torch.float16, torch.float16, True),
    (torch.float32, torch.bfloat16, True), (torch.bfloat16, torch.float16, True),
    (torch.float16, torch.float32, True), (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.float16, False)])
def test_exact_rows_and_lengths_in_the_kernel(static, exact_dtype, in_dtype, aligned, gen):
    """The kernel writes the exact recent window and first rows (raw, rounded to the exact dtype) and advances seen:
    ragged lengths (a sequence with none), left padding, chunks longer than the window, decode steps, and a static
    cache that runs out of room (its exact rows still take the tokens), on poisoned rows; every input and exact
    dtype pair the copies convert between, and exact rows that are views with unaligned rows."""
    codec = ta.KVCodec(128, 4, 3, scale_dtype=torch.bfloat16)
    fused, ref = _pair(codec, 3, 2, gen, capacity=60 if static else 90, static=static, exact_recent=8,
                       exact_first=4, exact_dtype=exact_dtype)
    if not aligned:
        _misalign_exact_rows(fused)
    for cache in (fused, ref):
        cache.set_left_padding([0, 3, 7])
    _poison_exact_rows(fused, ref, gen)
    inputs = []
    for t, lengths in ((5, [5, 2, 0]), (30, None), (1, None), (20, [20, 9, 3]), (1, None), (16, None), (1, None)):
        k = torch.randn(3, 2, t, 128, generator=gen).cuda().to(in_dtype)
        v = torch.randn(3, 2, t, 128, generator=gen).cuda().to(in_dtype)
        _append(fused, ref, k, v, new_lengths=lengths)
        inputs.append((k, v))
        assert torch.equal(fused.seen, ref.seen)
        _assert_same_exact_rows(fused, ref)
    assert bool(fused.overflowed) == static
    assert_same(fused, ref, inputs)


def test_each_sequence_advances_on_its_own_counter(gen):
    """The last CTA of each sequence advances that sequence's length: ragged lengths (one sequence with none) over
    a cache's merge counters and over the shared counters a layout without them takes (arrival_counters, one per
    sequence), each left at zero for the next launch."""
    import dataclasses

    from turboattn.ops.cuda_extension import arrival_counters
    from turboattn.ops.quantize.cuda import quantize_append_cuda
    codec = ta.KVCodec(128, 4, 4)
    lengths = [3, 0, 5, 1, 2]
    for own_counters in (True, False):
        fused, ref = _pair(codec, 5, 3, gen, capacity=64)
        for step in range(3):
            k = torch.randn(5, 3, 5, 128, generator=gen).cuda()
            v = torch.randn(5, 3, 5, 128, generator=gen).cuda()
            layout = fused.layout if own_counters else dataclasses.replace(fused.layout, merge_counters=None)
            quantize_append_cuda(k, v, layout, codec, torch.tensor(lengths, dtype=torch.int32, device="cuda"))
            ref.append(k, v, new_lengths=lengths, backend="torch")
            assert fused.seen.tolist() == ref.seen.tolist() == [(step + 1) * n for n in lengths]
        counters = fused.merge_counters if own_counters else arrival_counters(torch.device("cuda"), 5)
        assert not counters.any()


@pytest.mark.parametrize("exact", [False, True], ids=["codes", "exact-rows"])
@pytest.mark.parametrize("static", [False, True])
def test_a_decode_append_is_one_launch(exact, static):
    """Codes, exact rows and the lengths' advance: one kernel, no other GPU work (the profiler's count)."""
    codec = ta.KVCodec(128, 4, 3, scale_dtype=torch.bfloat16)
    cache = ta.QuantizedKVCache(codec, 4, 8, capacity=64, static=static, exact_recent=16 if exact else 0,
                                exact_first=4 if exact else 0, exact_dtype=torch.bfloat16, device="cuda")
    k = torch.randn(4, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cache.append(k, v)   # built and warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cache.append(k, v)
        torch.cuda.synchronize()
    gpu_work = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(gpu_work) == 1 and "quantize_append" in gpu_work[0], gpu_work
    assert cache.seen.tolist() == [2] * 4


@pytest.mark.parametrize("exact", [False, True], ids=["codes", "exact-rows"])
def test_decode_step_is_graph_capturable(exact, gen):
    """One token per step, replayed as a CUDA graph: the kernel reads the slot from the device lengths, writes the
    exact rows and advances the lengths."""
    codec = ta.KVCodec(128, 4, 4)
    options = dict(exact_recent=3, exact_first=2, exact_dtype=torch.bfloat16) if exact else {}
    fused, ref = _pair(codec, 2, 8, gen, capacity=64, static=True, **options)
    k_in = torch.zeros(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    v_in = torch.zeros_like(k_in)
    fused.append(k_in, v_in)   # warm up outside the capture
    ref.append(k_in, v_in, backend="torch")
    inputs = [(k_in.clone(), v_in.clone())]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.append(k_in, v_in)
    for _ in range(5):
        k_in.copy_(torch.randn(2, 8, 1, 128, generator=gen).cuda())
        v_in.copy_(torch.randn(2, 8, 1, 128, generator=gen).cuda())
        graph.replay()
        ref.append(k_in, v_in, backend="torch")
        inputs.append((k_in.clone(), v_in.clone()))
        _assert_same_exact_rows(fused, ref)
    assert_same(fused, ref, inputs)
