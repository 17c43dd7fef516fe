"""The CUDA decode kernel (ops/cached/cuda.py, the bit pairs of CUDA_BIT_PAIRS at head_dim 64/128/256/512) against the
float64 reference
(pytest -m gpu).

backend="auto" picks it on CUDA tensors; backend="triton" forces the portable kernel, which serves as a
second reference.  Same tolerance as the Triton kernel (test_kernels_gpu.py): fp16 operands and bf16 output.
"""

import itertools

import pytest
import torch

import turboattn as ta
from turboattn.format.key_transform import fit_key_transform
from turboattn.ops import backend
from turboattn.ops.cached import cuda
from turboattn.ops.cuda_extension import extension
from turboattn.ops.launch import sm_count
from turboattn.format.codec import SUPPORTED_BITS
from turboattn.ops.cached.config import (CUDA_BIT_PAIRS, CUDA_COUNTERS_PER_HEAD, CUDA_HEAD_DIMS, DecodePlan,
                                         cuda_ctas_per_sm, plan_decode)
from turboattn.ops.cached.naive import cached_attention_naive

from gpu_decode_inputs import decode_inputs, poison_allocator, rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = 4 * 2.0 ** -11 + 2.0 ** -9


CASES = [
    # B, Hkv, G, length, ring W, Tq, fresh, softcap, sinks, key transform, splits
    (4, 8, 4, 8192 + 37, None, 1, False, None, False, False, None),
    (2, 8, 4, 6000, None, 1, True, None, True, True, None),
    (2, 4, 8, 3000, None, 1, True, 50.0, False, False, 3),
    (2, 4, 8, 3000, None, 2, True, None, False, False, None),   # 16 rows: the Triton kernel serves it
    (2, 4, 1, 4097, 1024, 1, False, None, True, False, None),
    (3, 2, 16, 2000, None, 1, True, None, False, True, 1),
    (1, 8, 4, 100, None, 2, False, None, False, False, None),
    (2, 8, 1, 5000, 2048, 8, True, None, False, True, 7),
    (2, 2, 2, 777, 256, 3, True, 30.0, True, False, 5),
]


def test_the_extension_builds():
    assert extension() is not None
    assert backend.choose("cached_attention", "auto", torch.device("cuda")) == "cuda"


# Other head dims: the kernel's per-dim code paths (fragment words, output tiles, q fragments in shared memory, and
# at D = 512 the warps' dim slices with their partial scores).
HEAD_DIM_CASES = [(d, CASES[i]) for d in (64, 256, 512) for i in (0, 1, 2, 4, 7, 8)]


# Every built bit pair at every head dim: the per-width fragment code (KeyCodes, ValueCodes, CodeTable), the merge
# of two bit planes (3, 5, 6 bits) with each lane's high-plane slice and shift, two tables where the widths differ,
# and the tail load of 2 and 3-bit values at D = 64 (2 bytes per lane and plane).
BIT_PAIRS = sorted(CUDA_BIT_PAIRS - {(4, 4)})
# At D = 256 the pairs whose warps take two tiles per step (decode.cuh's Shape::STEP_TILES) also run long caches,
# where a warp walks pairs of tiles and an odd last one, and 100 keys (at most one tile per warp); case 8's 256 ring
# slots in 5 splits give no warp two tiles.  (D = 512's two-tile steps: HEAD_DIM_CASES, where every warp walks
# every tile of its split.)
TWO_TILE_STEPS_AT_256 = ((2, 2), (4, 2))


# At D = 128 the pairs on skewed steps (Shape::SKEWED: 3 CTAs per SM, but k4v3), where a tile's PV product runs in
# the next step, also run softcap over 3 splits (case 2), 100 keys (6: warps without a tile, whose one product is
# the zero P of the step before the first) and 256 ring slots with softcap and sinks (8).
def _skewed_at_128(bits: tuple) -> bool:
    return cuda_ctas_per_sm(128, *bits) == 3 and bits != (4, 3)


def _bits_cases(d: int, bits: tuple) -> tuple:
    if d == 128:
        return (1, 2, 6, 7, 8) if _skewed_at_128(bits) else (1, 7)
    return (1, 6, 7, 8) if d == 256 and bits in TWO_TILE_STEPS_AT_256 else (8,)


BITS_CASES = [(d, bits, CASES[i]) for d in CUDA_HEAD_DIMS for bits in BIT_PAIRS for i in _bits_cases(d, bits)]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_cuda_decode_matches_reference(case):
    _check_against_reference(case, 128)


@pytest.mark.parametrize("d,case", HEAD_DIM_CASES, ids=[f"D{d}-{c}" for d, c in HEAD_DIM_CASES])
def test_cuda_decode_other_head_dims(d, case):
    _check_against_reference(case, d)


@pytest.mark.parametrize("d,bits,case", BITS_CASES, ids=[f"D{d}-k{b[0]}v{b[1]}-{c}" for d, b, c in BITS_CASES])
def test_cuda_decode_other_bit_widths(d, bits, case):
    _check_against_reference(case, d, bits)


# Grids of more than two parts per SM run k4v4's plain kernel at D = 128 and its exact-row build at D = 64 as CTAs of
# two teams of warps (decode.cuh: Shape::TEAMS); smaller ones run D = 128's small-grid build (Shape::SMALL_GRID) and
# D = 64's build as one part per CTA (launch), which is what the other tests' grids take.  Here 3 sequences x 1 KV
# head take enough splits of 64 keys (CUDA_CHUNK_ALIGN; the last one 58) for an odd number of parts past twice the
# SMs, so the last CTA's second team has none, also where the plan's exact CTA follows each head's splits (two split
# counts: one of the two grids is odd).  (d, scale dtype, cache options, splits past the least)
TEAM_CASES = [
    (128, torch.float32, dict(), 0),
    (64, torch.bfloat16, dict(exact_recent=64), 0),
    (64, torch.bfloat16, dict(exact_recent=64), 1),
]


def _splits_past_two_per_sm(sequences_x_heads: int, extra: int = 0) -> int:
    """Splits per (sequence, KV head) that make the grid more than two parts per SM."""
    return 2 * sm_count(torch.device("cuda")) // sequences_x_heads + 1 + extra


@pytest.mark.parametrize("d,scale_dtype,options,extra", TEAM_CASES,
                         ids=[f"D{c[0]}-{str(c[1])[6:]}-{c[2]}-{c[3]}" for c in TEAM_CASES])
def test_cuda_decode_teams_with_an_odd_number_of_parts(d, scale_dtype, options, extra):
    splits = _splits_past_two_per_sm(3, extra)
    if not options and splits % 2 == 0:
        splits += 1   # 3 x splits parts: odd
    case = (3, 1, 4 if d == 128 else 3, 64 * splits - 6, None, 1, True, None, False, False, splits)
    _check_against_reference(case, d, (4, 4), scale_dtype, options)


# CASES (rings, windows, several query rows, fresh tokens, softcap, sinks, key transforms) on k4v4's plain kernel at
# D = 128 in a grid of more than two parts per SM, where CASES themselves take its small-grid build (some splits
# of a ring's few slots hold no keys).
@pytest.mark.parametrize("index", [0, 1, 4, 7, 8], ids=lambda i: str(CASES[i]))
def test_cuda_decode_matches_reference_on_large_grids(index):
    case = CASES[index]
    splits = _splits_past_two_per_sm(case[0] * case[1])
    _check_against_reference(case[:-1] + (splits,), 128)


# The quality presets' storage options on the CUDA kernel: bfloat16 scales, an exact recent window (one chunk,
# several, longer than the cache), exact first tokens, every exact dtype, with rings, fresh tokens, key transforms,
# softcap, sinks and several query rows.  (d, bits, scale dtype, cache options, case of CASES)
OPTION_CASES = [
    (128, (4, 4), torch.float32, dict(exact_recent=64), 0),
    (128, (4, 4), torch.bfloat16, dict(exact_recent=64, exact_first=4), 1),
    (64, (4, 2), torch.bfloat16, dict(exact_recent=8, exact_first=4, exact_dtype=torch.float32), 2),
    (128, (8, 8), torch.float32, dict(exact_recent=16, exact_dtype=torch.float16), 4),
    (256, (4, 4), torch.bfloat16, dict(exact_recent=130, exact_first=4), 6),   # the window holds every token
    (64, (2, 2), torch.bfloat16, dict(exact_recent=100), 8),                   # ring, window of 100 > 64 rows
    (128, (4, 4), torch.float32, dict(exact_first=4), 2),
    (128, (4, 8), torch.bfloat16, dict(exact_recent=24), 7),   # ring (exact first tokens need a contiguous cache)
    # The quality presets (QUALITY.md): SmolLM2's k4v3 at D = 64, Gemma-3's k5v3 at D = 256.
    (64, (4, 3), torch.bfloat16, dict(exact_recent=64, exact_first=4), 1),
    (256, (5, 3), torch.bfloat16, dict(exact_recent=8, exact_first=4), 0),
    (128, (6, 6), torch.bfloat16, dict(exact_recent=32), 4),
    # k2v2's exact-row build at D = 128: its compact table on 4 CTAs per SM.
    (128, (2, 2), torch.bfloat16, dict(exact_recent=32, exact_first=4), 1),
    # D = 512: the exact part's threads take two pairs of dims each.
    (512, (4, 4), torch.bfloat16, dict(exact_recent=64, exact_first=4), 1),
    (512, (4, 3), torch.float32, dict(exact_recent=24), 7),
    # Few exact rows: several threads per row (a whole warp at D = 512 with 4 rows; 4 threads for float32 rows).
    (512, (5, 3), torch.bfloat16, dict(exact_first=4), 1),
    (128, (4, 4), torch.float32, dict(exact_first=4, exact_recent=4, exact_dtype=torch.float32), 1),
    # Several exact CTAs per (sequence, KV head) (config.cuda_exact_parts): first tokens spread over three of them
    # (16 rows each at D = 256), and an uneven last share (70 rows at D = 128: 24, 24 and 22).
    (256, (4, 4), torch.bfloat16, dict(exact_first=40, exact_recent=8), 1),
    (128, (4, 3), torch.bfloat16, dict(exact_first=6, exact_recent=64), 1),
    # bfloat16 scales are read as the aligned words that hold them: odd capacities (3,001 and 2,001 slots) put a
    # lane's scales in either half of a word, and the last tile, past the capacity, takes the clamped loads.
    (128, (3, 3), torch.bfloat16, dict(), 2),
    (128, (5, 4), torch.bfloat16, dict(), 5),   # skewed steps (Shape::SKEWED)
    (256, (6, 6), torch.bfloat16, dict(), 5),
    (512, (2, 2), torch.bfloat16, dict(), 2),
    (64, (5, 4), torch.bfloat16, dict(), 5),
]


@pytest.mark.parametrize("d,bits,scale_dtype,options,i", OPTION_CASES,
                         ids=[f"D{c[0]}-k{c[1][0]}v{c[1][1]}-{str(c[2])[6:]}-{c[3]}-{c[4]}" for c in OPTION_CASES])
def test_cuda_decode_cache_options(d, bits, scale_dtype, options, i):
    _check_against_reference(CASES[i], d, bits, scale_dtype, options)


def _force_merge(monkeypatch, slices):
    """Calls merge in a launch of their own with `slices` CTAs per output row ("most": 8 at D = 512, else 1; 0:
    fused) instead of what config.cuda_merge_slices picks."""
    monkeypatch.setattr(cuda, "cuda_merge_slices",
                        lambda parts, rows, batch_kv_heads, d, sms: (d // 64 if d >= 512 else 1) if slices == "most"
                        else slices)


# The merge in a launch of its own (config.cuda_merge_slices, csrc/decode.cuh's merge_rows) forced onto small calls,
# one CTA per row and the most slices: fresh tokens, sinks, key transforms, a ring, exact rows, every head dim.
# (d, options, case)
MERGE_CASES = [(128, dict(), 1), (128, dict(), 3), (128, dict(exact_recent=64, exact_first=4), 1), (64, dict(), 8),
               (256, dict(), 2), (512, dict(), 0)]


@pytest.mark.parametrize("slices", [1, "most"], ids=lambda s: f"slices-{s}")
@pytest.mark.parametrize("d,options,i", MERGE_CASES, ids=[f"D{c[0]}-{c[1]}-{c[2]}" for c in MERGE_CASES])
def test_cuda_merge_apart(d, options, i, slices, monkeypatch):
    _force_merge(monkeypatch, slices)
    _check_against_reference(CASES[i], d, (4, 4), torch.bfloat16 if options else torch.float32, options)


# Every slice count of the merge launch at D = 512, and one CTA per row below, on parts that take a thread more than
# one batch of loads (MERGE_BATCH x sets: 64 parts at D = 512 in one slice, 512 at 64 dims a slice or at D = 64),
# with fresh tokens, sinks, softcap and a key transform; None: the slices config.cuda_merge_slices picks (8 for one
# sequence x 2 KV heads x 8 rows on 128 SMs or more).  (d, case, slices)
SLICE_CASES = [(512, (1, 2, 8, 130 * 64, None, 1, True, None, True, False, 130), s) for s in (None, 1, 2, 4)] + [
    (512, (1, 1, 4, 600 * 64, None, 1, False, None, False, False, 600), 8),
    (256, (1, 2, 4, 67 * 64, None, 2, True, 30.0, False, True, 67), 1),
    (128, (2, 2, 4, 40 * 256, None, 1, True, None, True, False, 40), 1),
    (64, (1, 3, 3, 600 * 64, None, 1, True, None, True, False, 600), 1),
]


@pytest.mark.parametrize("d,case,slices", SLICE_CASES, ids=[f"D{c[0]}-{c[1]}-slices-{c[2]}" for c in SLICE_CASES])
def test_cuda_merge_slices(d, case, slices, monkeypatch):
    if slices is None:
        b, hkv, g, tq, parts = case[0], case[1], case[2], case[5], case[10]
        assert cuda.cuda_merge_slices(parts, tq * g, b * hkv, d, sm_count(torch.device("cuda"))) >= 2
    else:
        _force_merge(monkeypatch, slices)
    _check_against_reference(case, d)


# Merges of more parts than a thread's register batch (16), both ways.  Fused: the parts past it are staged in the
# dead table space with cp.async, and those past the staging slots go through the batch loop; the weights sit in
# the centroids' space (rows x parts <= 256 floats) or at the end of the table space (fewer staging slots); with
# fewer outputs than threads (D = 64, 4 rows) two threads share each output's parts.  Apart: a thread's parts past
# its first batch go through the batch loop.  Splits of 256 keys each (none empty).  (d, case, options)
MANY_PARTS_CASES = [
    (128, (1, 2, 4, 40 * 256, None, 1, True, None, True, False, 40), {}),                 # 16 + 16 staged + 8
    (128, (1, 2, 8, 48 * 256, None, 1, False, None, False, True, 48), {}),               # weights in the table space
    (64, (2, 1, 4, 33 * 256, None, 1, True, 30.0, False, False, 33), {}),                # two threads per output
    (128, (1, 2, 4, 40 * 256, None, 1, True, None, False, False, 40), dict(exact_recent=64, exact_first=4)),
]


@pytest.mark.parametrize("apart", [False, True], ids=["fused", "apart"])
@pytest.mark.parametrize("d,case,options", MANY_PARTS_CASES,
                         ids=[f"D{c[0]}-{c[1]}-{c[2]}" for c in MANY_PARTS_CASES])
def test_cuda_merge_of_many_parts(d, case, options, apart, monkeypatch):
    _force_merge(monkeypatch, "most" if apart else 0)
    _check_against_reference(case, d, (4, 4), torch.bfloat16 if options else torch.float32, options)


# The fused merge of few parts and rows, a warp per row with every part in its lanes' registers (csrc/decode.cuh:
# merge_rows_by_warps, where merges_by_row_warps holds, in the builds of Shape::ROW_WARP_MERGE): up to 16 parts at
# D = 64, 8 at 128, 4 at 256, and fewer, with fresh tokens, sinks, softcap, key transforms, a ring, several query
# tokens, k2v2's and k3v3's builds beside k4v4's.  k4v4 at D = 128 takes grids of more than two parts per SM: smaller
# ones run its small-grid build, which keeps the general merge.  (d, case, bits)
ROW_WARP_MERGE_CASES = [
    (64, (2, 3, 3, 3000, None, 1, True, None, True, True, 16), (4, 4)),
    (64, (1, 2, 2, 1000, 256, 2, True, 30.0, False, False, 5), (4, 4)),
    (64, (2, 3, 3, 2000, None, 1, True, None, True, False, 11), (3, 3)),
    (128, (9, 4, 4, 1000, None, 1, True, None, True, False, 8), (4, 4)),     # 288 parts
    (128, (12, 4, 1, 768, None, 3, True, 50.0, False, True, 6), (4, 4)),     # 288 parts
    (128, (2, 2, 4, 3000, None, 1, True, None, False, True, 7), (2, 2)),
    (256, (2, 2, 4, 3000, None, 1, True, None, True, True, 4), (4, 4)),
]


def _merges_by_row_warps(d: int, bits: tuple, rows: int, parts: int, grid: int) -> bool:
    """decode.cuh's Shape::ROW_WARP_MERGE (the plain builds it serves; launch: k4v4 at D = 128 runs the small-grid
    build for grids of at most two parts per SM) and merges_by_row_warps: rows (Tq x group) <= its 4 warps, parts
    <= 1,024 / head_dim (32 floats per lane)."""
    built = bits in ({(4, 4), (2, 2), (3, 3)} if d == 64 else {(4, 4), (2, 2)} if d == 128 else {(4, 4)})
    small_grid = d == 128 and bits == (4, 4) and grid <= 2 * sm_count(torch.device("cuda"))
    return d <= 256 and built and not small_grid and rows <= 4 and parts <= 1024 // d


@pytest.mark.parametrize("d,case,bits", ROW_WARP_MERGE_CASES,
                         ids=[f"D{c[0]}-k{c[2][0]}v{c[2][1]}-{c[1]}" for c in ROW_WARP_MERGE_CASES])
def test_cuda_merge_by_row_warps(d, case, bits):
    b, hkv, g, length, window, tq, fresh, softcap, with_sinks, fit, splits = case
    assert _merges_by_row_warps(d, bits, tq * g, splits, splits * b * hkv) and not cuda.cuda_merge_slices(
        splits, tq * g, b * hkv, d, sm_count(torch.device("cuda")))
    _check_against_reference(case, d, bits)


def test_planned_residency_matches_the_launch_bound():
    """config.cuda_ctas_per_sm (which plans the splits) restates csrc/decode.cuh's ctas_per_sm (the launch bound)
    of both builds (with and without exact rows), and config.CUDA_BIT_PAIRS the pairs csrc/decode.h builds
    (ctas_per_sm is -1 for the others)."""
    ext = extension()
    for d, kb, vb, exact in itertools.product(CUDA_HEAD_DIMS, SUPPORTED_BITS, SUPPORTED_BITS, (False, True)):
        built = ext.ctas_per_sm(d, kb, vb, exact)
        assert (built != -1) == ((kb, vb) in CUDA_BIT_PAIRS), (d, kb, vb, exact)
        if built != -1:
            assert cuda_ctas_per_sm(d, kb, vb, exact) == built, (d, kb, vb, exact)
    assert ext.COUNTERS_PER_HEAD == CUDA_COUNTERS_PER_HEAD


def _check_against_reference(case, d, bits=(4, 4), scale_dtype=torch.float32, options=None):
    b, hkv, g, length, window, tq, fresh, softcap, with_sinks, fit, splits = case
    options = options or {}
    torch.manual_seed(hash((case, d, bits, str(scale_dtype), str(options))) % 2**31)
    codec = ta.KVCodec(d, *bits, scale_dtype=scale_dtype)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else length + tq, sliding_window=window,
                                device="cuda", **options)
    if options.get("exact_first"):   # exact first tokens follow the padding: it is set before any append
        cache.set_left_padding(torch.arange(b) * 5)
    first = torch.randn(b, hkv, length // 3, d, device="cuda", dtype=torch.bfloat16) + 0.5
    if fit:
        qf = torch.randn(b, hkv * g, length // 3, d, device="cuda", dtype=torch.bfloat16)
        cache.set_key_transform(*fit_key_transform(qf, first, center=softcap is None and not with_sinks))
    cache.append(first, torch.randn_like(first))
    rest = torch.randn(b, hkv, length - length // 3, d, device="cuda", dtype=torch.bfloat16) + 0.5
    cache.append(rest, torch.randn_like(rest))
    if not options.get("exact_first"):
        cache.set_left_padding(torch.arange(b) * 5)
    q, kf, vf, sinks = decode_inputs(b, hkv, g, tq, d, fresh, with_sinks)
    poison_allocator()
    # The cases are meant for the CUDA kernel.
    assert cuda.supports(q, codec, hkv) == (tq * g <= 8)
    out = ta.cached_attention(q, cache, kf, vf, softcap=softcap, sinks=sinks, num_splits=splits)
    assert not out.isnan().any()
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, softcap=softcap, sinks=sinks,
                                 compute_dtype=torch.float64)
    err = rel_error(out, ref)
    assert err < TOL, f"relative error {err:.3g}"
    portable = ta.cached_attention(q, cache, kf, vf, softcap=softcap, sinks=sinks, num_splits=splits, backend="triton")
    assert rel_error(portable, ref) < TOL


# The plan's exact CTAs per (sequence, KV head): one for all 68 rows (what config.cuda_exact_ctas picks in grids
# of several waves), two of 34 rows, the rows' own three (23, 23, 22), and more than the rows allow (capped to
# three).  Five splits.
@pytest.mark.parametrize("exact_parts", [1, 2, None, 7], ids=lambda e: f"E{e}")
def test_cuda_decode_exact_ctas_of_the_plan(exact_parts):
    torch.manual_seed(11)
    b, hkv, g, d, length = 2, 2, 4, 128, 900
    codec = ta.KVCodec(d, 4, 3, scale_dtype=torch.bfloat16)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=length + 1, device="cuda", exact_first=4, exact_recent=64)
    k = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16) + 0.5
    cache.append(k, torch.randn_like(k))
    q, kf, vf, sinks = decode_inputs(b, hkv, g, 1, d, True, True)
    poison_allocator()
    plan = plan_decode(q.device, d, 4, 3, b * hkv, g, cache.layout.capacity, 5, kernel="cuda")
    plan = DecodePlan(plan.block_m, plan.block_n, plan.num_warps, plan.num_stages, 5, plan.lookup, exact_parts)
    assert cuda.supports(q, codec, hkv)
    out = ta.cached_attention(q, cache, kf, vf, sinks=sinks, plan=plan)
    ref = cached_attention_naive(q, cache.layout, codec, kf, vf, sinks=sinks, compute_dtype=torch.float64)
    err = rel_error(out, ref)
    assert err < TOL, f"relative error {err:.3g}"


# q, the fresh tokens and the output in each attention dtype, q and the fresh tokens as the strided views a model
# passes ([B, T, H, D] storage seen as [B, H, T, D]; k and v halves of one projection): the set-up, the fresh
# tokens' scores and values and the store read and write them in their own dtype through their strides.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [64, 512])
def test_cuda_decode_query_dtypes_and_views(dtype, d):
    torch.manual_seed(d)
    b, hkv, g, tq, length = 2, 2, 2, 2, 700
    codec = ta.KVCodec(d, 4, 4)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=length + tq, device="cuda")
    k = torch.randn(b, hkv, length, d, device="cuda", dtype=dtype)
    cache.append(k, torch.randn_like(k))
    q = torch.randn(b, tq, hkv * g, d, device="cuda", dtype=dtype).transpose(1, 2)
    kv = torch.randn(b, tq, 2 * hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    kf, vf = kv[:, :hkv], kv[:, hkv:]
    sinks = torch.randn(hkv * g, device="cuda")
    poison_allocator()
    assert cuda.supports(q, codec, hkv)
    out = ta.cached_attention(q, cache, kf, vf, sinks=sinks, num_splits=3)
    assert out.dtype == dtype and not out.isnan().any()
    ref = cached_attention_naive(q, cache.layout, codec, kf, vf, sinks=sinks, compute_dtype=torch.float64)
    err = rel_error(out, ref)
    assert err < TOL, f"relative error {err:.3g}"


# Query rows that start off a 16-byte boundary (views one element into a wider buffer) at D = 512, whose lanes read 16
# elements of a row each: the set-up must not read q's rows in wide or asynchronous copies that assume alignment.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_decode_query_rows_off_16_byte_boundaries(dtype):
    torch.manual_seed(5)
    b, hkv, g, tq, length, d = 2, 2, 4, 1, 900, 512
    codec = ta.KVCodec(d, 4, 4)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=length + tq, device="cuda")
    k = torch.randn(b, hkv, length, d, device="cuda", dtype=dtype)
    cache.append(k, torch.randn_like(k))
    q = torch.randn(b, hkv * g, tq, d + 8, device="cuda", dtype=dtype)[..., 1:d + 1]   # rows 16-byte strided
    assert q.stride(3) == 1 and all(q[i, h, 0].data_ptr() % 16 for i in range(b) for h in range(hkv * g))
    sinks = torch.randn(hkv * g, device="cuda")
    poison_allocator()
    assert cuda.supports(q, codec, hkv)
    out = ta.cached_attention(q, cache, sinks=sinks, num_splits=3)
    ref = cached_attention_naive(q, cache.layout, codec, sinks=sinks, compute_dtype=torch.float64)
    err = rel_error(out, ref)
    assert err < TOL, f"relative error {err:.3g}"


def test_cuda_decode_is_graph_capturable():
    codec = ta.KVCodec(128, 4, 4)
    cache = ta.QuantizedKVCache(codec, 2, 8, capacity=4096, device="cuda")
    k = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    cache.append(k, torch.randn_like(k))
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    out = ta.cached_attention(q, cache, kn, kn, num_splits=4)
    cache.append(kn, kn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.cached_attention(q, cache, kn, kn, num_splits=4)
        cache.append(kn, kn)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    # The graph's attention ran before its own append: the reference sees the cache one token shorter.
    cache.seen -= 1
    ref = cached_attention_naive(q, cache.layout, cache.codec, kn, kn, compute_dtype=torch.float64)
    assert rel_error(out, ref) < TOL


# -- non-finite inputs (the rule of tests/test_nonfinite.py, on the CUDA kernel) ---------------------------------

BAD = [float("nan"), float("inf"), -float("inf")]


def _cuda_pair(codec, b, hkv, k, v, capacity=None, sliding_window=None, padding=None, pieces=(None,), **options):
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=capacity, sliding_window=sliding_window, device="cuda",
                                **options)
    if padding is not None:
        cache.set_left_padding(padding)
    start = 0
    for end in pieces:
        cache.append(k[:, :, start:end].cuda(), v[:, :, start:end].cuda())
        start = end
    return cache


def _check_nan_rows(got, want_nan, clean):
    assert torch.equal(got.isnan().any(-1).cpu(), want_nan)
    assert bool(got[want_nan.cuda()].isnan().all())
    assert torch.equal(got[~want_nan.cuda()], clean[~want_nan.cuda()])


@pytest.mark.parametrize("apart", [False, True], ids=["fused", "apart"])
@pytest.mark.parametrize("options", [{}, dict(exact_recent=16)], ids=["codes", "exact-window"])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("value", BAD, ids=["nan", "inf", "-inf"])
def test_cuda_cached_nonfinite_reaches_only_the_queries_that_see_it(kind, value, options, apart, monkeypatch):
    """The last cached position of sequence 0, KV head 0 is poisoned; of two queries ending there, the first
    does not see it.  3 splits: the NaN must cross the merge (fused, or in its own launch) to exactly its rows.
    With an exact window the position is read from the exact rows (the exact part), not from its codes."""
    _force_merge(monkeypatch, "most" if apart else 0)
    gen = torch.Generator().manual_seed(7)
    codec = ta.KVCodec(128, 4, 4)
    b, hkv, g, t, tq = 2, 2, 4, 300, 2
    k, v = (torch.randn(b, hkv, t, 128, generator=gen, dtype=torch.float32) for _ in range(2))
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if kind == "k" else bad_v)[0, 0, t - 1, 5] = value
    q = torch.randn(b, hkv * g, tq, 128, generator=gen).to("cuda", torch.bfloat16)
    assert cuda.supports(q, codec, hkv)
    clean = ta.cached_attention(q, _cuda_pair(codec, b, hkv, k, v, capacity=t, **options), num_splits=3)
    got = ta.cached_attention(q, _cuda_pair(codec, b, hkv, bad_k, bad_v, capacity=t, **options), num_splits=3)
    want_nan = torch.zeros(b, hkv * g, tq, dtype=torch.bool)
    want_nan[0, :g, 1] = True
    _check_nan_rows(got, want_nan, clean)
    assert bool(torch.isfinite(clean).all())


@pytest.mark.parametrize("kind", ["k", "v"])
def test_cuda_hidden_nonfinite_keys_change_nothing(kind):
    """A left-padding position (sequence 1) and the oldest slot of a wrapped ring (sequence 0, out of the next
    query's window) hold NaN / inf: every output stays finite and bit-identical."""
    gen = torch.Generator().manual_seed(8)
    codec = ta.KVCodec(128, 4, 4)
    w, b, hkv, t = 64, 2, 2, 100
    k, v = (torch.randn(b, hkv, t, 128, generator=gen) for _ in range(2))
    fresh = [x.to("cuda", torch.bfloat16) for x in (torch.randn(b, hkv, 1, 128, generator=gen) for _ in range(2))]
    q = torch.randn(b, hkv * 4, 1, 128, generator=gen).to("cuda", torch.bfloat16)
    bad_k, bad_v = k.clone(), v.clone()
    for index in [(0, 1, 36, 0), (1, 0, 2, 9)]:   # sequence 0: position 36 < 100 + 1 - 64; sequence 1: padding
        (bad_k if kind == "k" else bad_v)[index] = float("nan") if kind == "k" else float("inf")
    outs = []
    for kk, vv in ((k, v), (bad_k, bad_v)):
        cache = _cuda_pair(codec, b, hkv, kk, vv, sliding_window=w, padding=[0, 5], pieces=(40, None))
        outs.append(ta.cached_attention(q, cache, *fresh, num_splits=2))
    assert bool(torch.isfinite(outs[1]).all()) and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("value", BAD, ids=["nan", "inf", "-inf"])
def test_cuda_fresh_nonfinite_reaches_only_later_queries(kind, value):
    """Fresh token 1 of sequence 1, KV head 1 is poisoned: that head group's query 1 sees it, query 0 does not."""
    gen = torch.Generator().manual_seed(9)
    codec = ta.KVCodec(128, 4, 4)
    b, hkv, g, tq = 2, 2, 4, 2
    k, v = (torch.randn(b, hkv, 200, 128, generator=gen) for _ in range(2))
    cache = _cuda_pair(codec, b, hkv, k, v, capacity=256)
    kn, vn = (torch.randn(b, hkv, tq, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    q = torch.randn(b, hkv * g, tq, 128, generator=gen).to("cuda", torch.bfloat16)
    bad_k, bad_v = kn.clone(), vn.clone()
    (bad_k if kind == "k" else bad_v)[1, 1, 1, 2] = value
    clean = ta.cached_attention(q, cache, kn, vn, num_splits=2)
    got = ta.cached_attention(q, cache, bad_k, bad_v, num_splits=2)
    want_nan = torch.zeros(b, hkv * g, tq, dtype=torch.bool)
    want_nan[1, g:, 1] = True
    _check_nan_rows(got, want_nan, clean)
