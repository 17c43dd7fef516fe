"""The CUDA decode kernel's residency, split and merge rules (ops/cached/config.cuda_ctas_per_sm, cuda_num_splits,
cuda_exact_parts, cuda_exact_ctas, cuda_exact_splits, cuda_merge_apart, cuda_merge_slices): the properties their
docstrings state, over random residencies, batch x KV-head counts and lengths (the measured timings behind it are
in BENCHMARKS.md; the rule runs on the host, so no GPU is needed)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from turboattn.ops.cached.config import (CUDA_CHUNK_ALIGN, CUDA_EXACT_ROWS_PER_CTA, CUDA_EXACT_SPREAD_WAVES,
                                         CUDA_EXACT_TAIL_KEYS, CUDA_MAX_PARTS, CUDA_MAX_SPLITS, CUDA_MAX_SPLITS_D64,
                                         CUDA_MAX_WAVES, CUDA_MERGE_APART, CUDA_MERGE_SLICE_DIMS,
                                         CUDA_MIN_KEYS_PER_SPLIT, CUDA_MIN_WAVE_FILL, CUDA_SHORT_SPLIT,
                                         cuda_ctas_per_sm, cuda_exact_ctas, cuda_exact_parts, cuda_exact_splits,
                                         cuda_filled_splits, cuda_merge_apart, cuda_merge_slices, cuda_num_splits,
                                         wave_fill)

RESIDENT = st.integers(1, 8 * 200)          # CTAs per SM x SMs
BATCH_KV_HEADS = st.integers(1, 4096)
TOKENS = st.integers(1, 1 << 20)


@settings(max_examples=500, deadline=None)
@given(RESIDENT, BATCH_KV_HEADS, st.sampled_from([64, 128, 256, 512]), TOKENS)
def test_split_rule_bounds(resident, bkv, d, tokens):
    splits = cuda_num_splits(resident, bkv, d, tokens)
    most = CUDA_MAX_SPLITS_D64 if d == 64 else CUDA_MAX_SPLITS
    assert 1 <= splits <= most
    # At most CUDA_MAX_WAVES waves of resident CTAs (a single split when even one per (sequence, KV head) is more),
    # and more than one only where one wave would fill less than CUDA_MIN_WAVE_FILL of the slots.
    assert splits == 1 or splits * bkv <= CUDA_MAX_WAVES * resident
    if splits > 1 and splits * bkv > resident:
        one_wave = max(1, min(resident // bkv, tokens // CUDA_MIN_KEYS_PER_SPLIT, most))
        assert wave_fill(one_wave * bkv, resident) < CUDA_MIN_WAVE_FILL
    # Splits of at least CUDA_MIN_KEYS_PER_SPLIT keys.
    assert splits == 1 or tokens >= splits * CUDA_MIN_KEYS_PER_SPLIT


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 1600))
def test_wave_fill_is_a_share_of_the_slots(ctas, resident):
    fill = wave_fill(ctas, resident)
    assert 0 < fill <= 1
    assert (fill == 1) == (ctas % resident == 0)


def test_chunk_alignment_is_whole_tiles_and_a_power_of_two():
    # The kernel rounds chunks up with a mask, and the binding rejects other alignments (csrc/decode.cuh, binding.cpp).
    assert CUDA_CHUNK_ALIGN % 16 == 0 and CUDA_CHUNK_ALIGN & (CUDA_CHUNK_ALIGN - 1) == 0


def _chunk(tokens: int, splits: int) -> int:
    """Keys per split as the kernel cuts them (csrc/decode.cuh: ceil(held / splits), rounded up to the alignment)."""
    return -(-(-(-tokens // splits)) // CUDA_CHUNK_ALIGN) * CUDA_CHUNK_ALIGN


@settings(max_examples=500, deadline=None)
@given(RESIDENT, BATCH_KV_HEADS, st.sampled_from([64, 128, 256, 512]), TOKENS)
def test_no_split_of_a_full_cache_is_empty(resident, bkv, d, tokens):
    splits = cuda_num_splits(resident, bkv, d, tokens)
    assert (splits - 1) * _chunk(tokens, splits) < tokens


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 1024), TOKENS)
def test_filled_splits_cut_the_same_chunks(splits, tokens):
    """Dropping the empty splits keeps every chunk as long as it was (the work per CTA does not grow)."""
    filled = cuda_filled_splits(splits, tokens)
    assert 1 <= filled <= splits
    assert _chunk(tokens, filled) == _chunk(tokens, splits) or filled == 1
    assert (filled - 1) * _chunk(tokens, filled) < tokens


@settings(max_examples=500, deadline=None)
@given(RESIDENT, BATCH_KV_HEADS, st.sampled_from([128, 256]), TOKENS)
def test_short_splits_use_half_a_wave_at_wide_heads(resident, bkv, d, tokens):
    splits = cuda_num_splits(resident, bkv, d, tokens)
    if splits > 1 and splits * bkv > resident // 2:
        assert tokens >= splits * CUDA_SHORT_SPLIT


@settings(max_examples=300, deadline=None)
@given(RESIDENT, BATCH_KV_HEADS, st.sampled_from([64, 512]), TOKENS)
def test_head_dims_64_and_512_keep_the_full_wave(resident, bkv, d, tokens):
    """No half wave at D = 64 and D = 512: at least the full wave's splits (more only where that wave is
    underfilled)."""
    cap = CUDA_MAX_SPLITS_D64 if d == 64 else CUDA_MAX_SPLITS
    full = max(1, min(resident // bkv, tokens // CUDA_MIN_KEYS_PER_SPLIT, cap))
    splits = cuda_num_splits(resident, bkv, d, tokens)
    assert splits >= cuda_filled_splits(full, tokens)
    assert splits == cuda_filled_splits(full, tokens) or wave_fill(full * bkv, resident) < CUDA_MIN_WAVE_FILL


def test_residency_at_the_measured_pairs():
    """CTAs per SM of the timed kernels (BENCHMARKS.md, H100; a GPU test checks that the launch bounds agree)."""
    # A 2-bit table beside a second one is compact (16 columns, 32 KB), which makes room for a third CTA at
    # D <= 128 (those pairs were 4-15% faster there); k2v2's own table is compact at D <= 128 (a fourth CTA: 7%
    # faster at D = 64, 2-30% at D = 128), 64 KB above.  D = 512's plain kernels run one CTA of two key streams
    # (8 warps) per SM for every pair, where two CTAs of 4 warps ran; its exact-row builds keep those two.
    for kb, vb in [(4, 2), (2, 4), (8, 2), (2, 8)]:
        assert [cuda_ctas_per_sm(d, kb, vb) for d in (64, 128, 256, 512)] == [3, 3, 2, 1], (kb, vb)
        assert cuda_ctas_per_sm(512, kb, vb, exact=True) == 2
    # The plain D = 64 kernels of codes up to 4 bits walk two-tile steps on 3 CTAs (0.91-0.96 of one-tile steps on
    # 4 for k2v2, k3v3 and k4v4, H200); their exact-row builds keep one-tile steps on 4.
    assert [cuda_ctas_per_sm(d, 2, 2) for d in (64, 128, 256, 512)] == [3, 4, 2, 1]
    assert cuda_ctas_per_sm(128, 2, 2, exact=True) == 4
    # k3v3 at D = 128 on 4 CTAs (8 bytes spilled since the lane pointers are pinned; its exact-row build and k4v3
    # stay at 3).  D = 512's registers hold a second tile in flight: 8 warps per SM for every pair.
    assert [cuda_ctas_per_sm(d, 3, 3) for d in (64, 128, 256, 512)] == [3, 4, 2, 1]
    assert cuda_ctas_per_sm(128, 3, 3, exact=True) == 3
    assert [cuda_ctas_per_sm(d, 4, 4) for d in (64, 128, 256, 512)] == [3, 4, 2, 1]
    assert [cuda_ctas_per_sm(d, 4, 3) for d in (64, 128, 256, 512)] == [3, 3, 2, 1]
    assert [cuda_ctas_per_sm(512, kb, vb, exact=True) for kb, vb in [(4, 4), (5, 3), (3, 3)]] == [2] * 3
    assert [cuda_ctas_per_sm(64, kb, vb, exact=True) for kb, vb in [(4, 3), (5, 3), (8, 8), (2, 2), (4, 4)]] == [4] * 5


def test_split_rule_at_the_measured_shapes():
    # H100: 132 SMs x 4 CTAs (k4v4 at D <= 128), x 2 at D = 256; the sweep winners of BENCHMARKS.md.
    assert cuda_num_splits(528, 8, 128, 32768) == 32      # B=1, 8 KV heads: half a wave (33) less the empty split
    assert cuda_num_splits(528, 1, 128, 32768) == 128     # B=1, 1 KV head: the cap
    assert cuda_num_splits(528, 2, 128, 32768) == 128     # B=1, 2 KV heads
    assert cuda_num_splits(264, 2, 256, 32768) == 64      # D=256, 2 KV heads: half a wave (66, 64 filled)
    assert cuda_num_splits(528, 16, 128, 16384) == 16     # B=2
    assert cuda_num_splits(528, 64, 128, 32768) == 8      # B=8: long splits keep the full wave
    assert cuda_num_splits(528, 64, 128, 1024) == 4       # short context: 256-key splits
    assert cuda_num_splits(528, 24, 64, 16384) == 22      # D=64 keeps the full wave (4 CTAs: exact-row builds)
    assert cuda_num_splits(396, 24, 64, 16384) == 16      # (3 CTAs: the plain builds of codes up to 4 bits)
    assert cuda_num_splits(264, 64, 256, 8192) == 4
    assert cuda_num_splits(528, 2, 512, 32768) == 128     # D=512, one sequence x 2 KV heads: the cap
    # D = 512 keeps the full wave, here on 3 CTAs x 132 SMs (where it was measured; it now runs 2): the cap at B=1
    # (half a wave would be 86), 64 at B=2, 16 at B=8.
    assert cuda_num_splits(396, 2, 512, 32768) == 128
    assert cuda_num_splits(396, 4, 512, 16384) == 64
    assert cuda_num_splits(396, 16, 512, 4096) == 16
    # An underfilled wave: 32 x 8 KV heads on 3 CTAs x 132 SMs (k4v3) take three splits in two waves (one split:
    # 65% of one wave); on 4 CTAs (k4v4) two splits fill one wave.
    assert cuda_num_splits(396, 256, 128, 8192) == 3
    assert cuda_num_splits(528, 256, 128, 8192) == 2
    assert cuda_num_splits(396, 64, 128, 32768) == 6      # B=8 on 3 CTAs: one full wave


@settings(max_examples=500, deadline=None)
@given(st.integers(1, CUDA_MAX_PARTS), st.integers(1, 8), st.sampled_from([64, 128, 256, 512]))
def test_merge_apart_exactly_from_the_bound(parts, rows, d):
    """The parts merge in a launch of their own exactly when they hold CUDA_MERGE_APART floats or more, and a call
    with more parts or rows (the same head dim) never goes back to the fused merge."""
    apart = cuda_merge_apart(parts, rows, d)
    assert apart == (parts * rows * d >= CUDA_MERGE_APART)
    if apart:
        assert cuda_merge_apart(parts + 1, rows, d) and cuda_merge_apart(parts, min(rows + 1, 8), d)


def test_merge_rule_at_the_measured_shapes():
    # H200 (benchmarks/decode_merge_apart_h200.json): fused up to 8K floats (22 parts x 3 rows at D=64, 16 x 4 at
    # D=128, 2 x 2 at D=256), apart from 16K (64 x 4 at D=64, 32 x 4 and 64 x 2 at D=128) and past it (128 x 8
    # at D=512, 128 x 4 at D=256).
    assert not cuda_merge_apart(22, 3, 64)
    assert not cuda_merge_apart(16, 4, 128)
    assert not cuda_merge_apart(4, 2, 256)
    assert cuda_merge_apart(64, 4, 64)
    assert cuda_merge_apart(32, 4, 128) and cuda_merge_apart(64, 2, 128)
    assert cuda_merge_apart(128, 8, 512) and cuda_merge_apart(128, 4, 256)


@settings(max_examples=500, deadline=None)
@given(st.integers(1, CUDA_MAX_PARTS), st.integers(1, 8), st.integers(1, 4096), st.sampled_from([64, 128, 256, 512]),
       st.integers(1, 200))
def test_merge_slices_fill_the_sms_once(parts, rows, bkv, d, sms):
    """0 exactly for the fused merge; else 1 below D = 512 (parts in the codes' domain), and at D = 512 a power of
    two that divides the row into slices of at least CUDA_MERGE_SLICE_DIMS dims, keeps the launch within one CTA per
    SM unless a row gets one CTA, and is the most that does both."""
    slices = cuda_merge_slices(parts, rows, bkv, d, sms)
    assert (slices == 0) == (not cuda_merge_apart(parts, rows, d))
    if slices and d < 512:
        assert slices == 1
    elif slices:
        assert slices & (slices - 1) == 0 and d // slices >= CUDA_MERGE_SLICE_DIMS
        assert slices == 1 or bkv * rows * slices <= sms
        assert d // (2 * slices) < CUDA_MERGE_SLICE_DIMS or bkv * rows * 2 * slices > sms


def test_merge_slices_at_the_measured_shapes():
    # H100 (132 SMs), k4v4 (BENCHMARKS.md): one sequence x 2 KV heads x 8 rows x 128 parts at D = 512 takes 8 slices
    # (128 CTAs), two sequences 4; 8 sequences x 2 KV heads x 8 rows x 16 parts, where 8 measured slower, one; and
    # one at D <= 256, where slices measured slower.
    assert cuda_merge_slices(128, 8, 2, 512, 132) == 8
    assert cuda_merge_slices(64, 8, 4, 512, 132) == 4
    assert cuda_merge_slices(16, 8, 16, 512, 132) == 1
    assert cuda_merge_slices(128, 8, 1, 256, 132) == 1
    assert cuda_merge_slices(32, 4, 8, 128, 132) == 1


@settings(max_examples=500, deadline=None)
@given(RESIDENT, BATCH_KV_HEADS, st.sampled_from([64, 128, 256]), TOKENS)
def test_exact_rows_share_the_wave_or_take_a_worthwhile_tail(resident, bkv, d, tokens):
    """With exact rows the splits either leave one slot per (sequence, KV head) for an exact CTA (one wave with
    them), or are the plain plan's where that shortens each split by CUDA_EXACT_TAIL_KEYS or more; a plain plan
    that leaves the slots already is kept."""
    plain = cuda_num_splits(resident, bkv, d, tokens)
    splits = cuda_exact_splits(plain, resident, bkv, d, tokens)
    fits = splits == 1 or (splits + 1) * bkv <= resident
    if (plain + 1) * bkv <= resident:
        assert splits == plain
    if splits != plain:
        assert fits
    elif not fits:
        in_wave = cuda_num_splits(max(resident - bkv, bkv), bkv, d, tokens, 1)
        assert tokens / in_wave - tokens / plain >= CUDA_EXACT_TAIL_KEYS


@settings(max_examples=500, deadline=None)
@given(st.sampled_from([64, 128, 256, 512]), st.integers(0, 5000))
def test_exact_parts_share_the_rows(d, rows):
    """Exact CTAs of at most CUDA_EXACT_ROWS_PER_CTA rows each, as few as that allows, and the kernel's even split
    (shares of ceil(rows / parts), the last one shorter) leaves none of them empty."""
    parts = cuda_exact_parts(d, rows)
    if rows == 0:
        assert parts == 0
        return
    share = -(-rows // parts)
    assert share <= CUDA_EXACT_ROWS_PER_CTA[d]
    assert parts == 1 or rows > (parts - 1) * CUDA_EXACT_ROWS_PER_CTA[d]
    assert (parts - 1) * share < rows


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 40), st.integers(1, 128), RESIDENT, BATCH_KV_HEADS)
def test_exact_rows_spread_only_within_the_waves_bound(exact_parts, splits, resident, bkv):
    """All of the rows' exact CTAs while the grid stays within CUDA_EXACT_SPREAD_WAVES waves, else one."""
    ctas = cuda_exact_ctas(exact_parts, splits, resident, bkv)
    if (splits + exact_parts) * bkv <= CUDA_EXACT_SPREAD_WAVES * resident:
        assert ctas == exact_parts
    else:
        assert ctas == 1


def test_exact_ctas_at_the_measured_shapes():
    # H100, k4v3 + first 4 + recent 64 at D = 128 (3 CTAs x 132 SMs; BENCHMARKS.md).
    assert cuda_exact_ctas(3, 32, 396, 8) == 3     # B=1: three exact CTAs (30 -> 12.6 µs each)
    assert cuda_exact_ctas(3, 6, 396, 64) == 3     # B=8 L=32K: 136.6 µs against 139.2 with one
    assert cuda_exact_ctas(3, 3, 396, 128) == 1    # B=16 L=16K: 140.2 against 145.3 with three
    assert cuda_exact_ctas(3, 3, 396, 256) == 1    # B=32 L=8K: 155.1 against 168.5


def test_exact_parts_of_the_presets():
    # The default presets' first 4 + recent 64 at D <= 128 (68 rows: two CTAs of 34 at D = 64, three of 23 / 23 /
    # 22 rows at D = 128) and first 4 + recent 8 above (one CTA).
    assert [cuda_exact_parts(d, 68) for d in (64, 128)] == [2, 3]
    assert [cuda_exact_parts(d, 12) for d in (256, 512)] == [1, 1]


def test_exact_split_rule_at_the_measured_shapes():
    # H100, the shapes timed both ways in BENCHMARKS.md (exact first 4 + recent window, bf16 scales).
    assert cuda_exact_splits(6, 396, 64, 128, 32768) == 6     # k4v3 B=8 D=128: 152 us against 175 with 5
    assert cuda_exact_splits(4, 264, 64, 256, 8192) == 4      # k5v3 B=8 D=256: 118 against 130 with 3
    assert cuda_exact_splits(16, 396, 24, 64, 16384) == 15    # k4v3 B=8 D=64: 31 against 38 with 16
    assert cuda_exact_splits(32, 528, 8, 128, 32768) == 32    # k4v4 B=1: 39.7 against 41.8 with 33
