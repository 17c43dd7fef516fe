"""Launch plan of the compressed-cache attention kernel: tiles, warps, split count and lookup.

The plan is chosen once per call on the host from shapes and host-known lengths
(nothing is read from the device), and it is an explicit argument of the op,
so a captured CUDA graph or a static cache can fix it (a static cache plans
for its capacity rather than the current length).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ...format.codebook import UNIFORM_BITS
from ...format.rotation import HEAD_DIM_STEP, SUPPORTED_HEAD_DIMS
from ..launch import num_splits_for, sm_count

LOOKUPS = ("gather", "lut")

# The kernel is latency-bound with 2 programs resident per SM (255 registers); more, shorter
# splits measured faster at B=8 (402 -> 334 us at 8 per SM), until splits get too short (B=1).
PROGRAMS_PER_SM = 8
MIN_KEYS_PER_SPLIT = 1024

# The CUDA kernel (cuda.py): the (K bits, V bits) pairs of CUDA_BIT_PAIRS at these head dims, at most 8 query rows
# per KV head (the MMA's N side), at most CUDA_MAX_PARTS parts (its merge's scratch).  Its split rule
# (cuda_num_splits) is fitted to split-count sweeps on an H100; on an H200 no other count beat its plans
# (BENCHMARKS.md).
CUDA_HEAD_DIMS = (64, 128, 256, 512)
# The Triton kernels of the compressed cache (cached attention, quantize-append) serve every head dim of the
# format: powers of two in the plain layout, the others (D = P * m, m odd) in the padded layout of
# triton_lib.padded_factor (next_power_of_2(D) columns, the Hartley factor as a small dense product).
TRITON_HEAD_DIMS = SUPPORTED_HEAD_DIMS


def check_kernel_head_dim(op: str, head_dim: int) -> None:
    """ValueError naming head_dim unless the Triton kernels of `op` serve it (for callers of the torch op that
    bypass backend.choose)."""
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"the Triton {op} kernel serves head_dim a multiple of {HEAD_DIM_STEP} from "
                         f"{TRITON_HEAD_DIMS[0]} to {TRITON_HEAD_DIMS[-1]}, got head_dim={head_dim}; "
                         "use backend='torch' (or 'auto')")


# Every preset of the format (csrc/decode.h's TURBOATTN_BIT_PAIRS; a GPU test compares the two): each pair is one
# more kernel per head dim and variant to build, so not every one of the 36 pairs is built.
CUDA_BIT_PAIRS = frozenset({(2, 2), (2, 4), (2, 8), (3, 3), (4, 2), (4, 3), (4, 4), (4, 8), (5, 3), (5, 4), (5, 5),
                            (6, 6), (8, 2), (8, 4), (8, 8)})
# Keys in two channel groups on the CUDA kernel (csrc/decode.h: TURBOATTN_KEY_GROUPS, the same builds; a GPU test
# compares them): (head_dim, key_groups, v_bits).  Other groupings go to the Triton kernel.
CUDA_KEY_GROUPS = frozenset({(256, ((112, 6), (144, 4)), 3), (256, ((96, 6), (160, 4)), 3)})
CUDA_MAX_ROWS = 8
CUDA_MAX_PARTS = 1024
# q fragments stay in registers at head_dim 256 for pairs of at most this many bits in all (csrc/decode.cuh:
# Q_REGISTER_BITS); wider pairs keep them in shared memory, which the residency counts.
CUDA_Q_REGISTER_BITS = 6
CUDA_MIN_KEYS_PER_SPLIT = 256
CUDA_MAX_SPLITS = 128
CUDA_MAX_SPLITS_D64 = 64   # D = 64: 128 measured 3% slower (one sequence x 1 KV head at 32K, H100)
CUDA_SHORT_SPLIT = 1024
# A wave that fills fewer than CUDA_MIN_WAVE_FILL of the resident slots (32 x 8 KV heads on 396 slots: 65%) takes
# more splits over up to CUDA_MAX_WAVES waves instead (cuda_num_splits).
CUDA_MIN_WAVE_FILL = 0.9
CUDA_MAX_WAVES = 2
CUDA_EXACT_TAIL_KEYS = 512
# The exact rows spread over several CTAs per (sequence, KV head) only while the whole grid stays within this many
# waves (cuda_exact_ctas).
CUDA_EXACT_SPREAD_WAVES = 1.5
# Exact rows per exact CTA, by head dim (cuda_exact_parts): at D = 128 a CTA of 32 rows or fewer gives each row 4
# threads and each thread one round of loads; at D = 64 two CTAs for the presets' 68 rows (H100, one sequence x 3 KV
# heads at L=32K: 19.2 against 23.5 µs with one; B=32 L=8K 47.8 against 51.7).
CUDA_EXACT_ROWS_PER_CTA = {64: 64, 128: 32, 256: 16, 512: 16}
CUDA_CHUNK_ALIGN = 64   # split boundaries, in keys: a multiple of the kernel's 16-key tile and a power of two (a mask)
# The merge: on the kernel's tail, the last CTA of each (sequence, KV head) to finish reads every part (rows x D
# floats each), counted in by one arrival counter per (sequence, KV head) (csrc/decode.h's COUNTERS_PER_HEAD; a GPU
# test compares them).  From CUDA_MERGE_APART floats of parts per (sequence, KV head) a second launch merges them
# instead, one CTA per output row (csrc/decode.cuh: merge_rows; at D = 512 one per slice of a row,
# cuda_merge_slices), so that a head's parts stream through as many SMs as it has rows.  The bound comes from both
# merges on 19 shapes (H200, k4v4, benchmarks/decode_merge_apart_h200.json): apart, one sequence x 2 KV heads x 8
# rows x 128 parts at D = 512 took 38.9 against 45.2 us, 4 rows x 128 parts at D = 256 15.9 against 21.3, 4 rows x
# 64 parts at D = 128 17.9 against 19.8; at 16K floats 0.97-1.00 of the fused time; below, slower (8 sequences x 3
# KV heads x 3 rows x 22 parts at D = 64: 22.0 against 20.1; 32 x 8 heads x 2 parts at D = 128: 125.7 against 99.7),
# the second launch costing more than the tail's merges.  At 16K floats on B = 1's small-grid twin (one sequence x 8
# KV heads x 4 rows x 32 parts at D = 128) the tail's merge took 1.016-1.036 of the launch's time (H200).
CUDA_COUNTERS_PER_HEAD = 1
CUDA_MERGE_APART = 16 * 1024
# At D = 512 the merge launch gives each output row up to head_dim / CUDA_MERGE_SLICE_DIMS CTAs, each a slice of its
# dims, while the launch stays within one CTA per SM (cuda_merge_slices).  Each CTA computes the row's weights
# itself, so more, smaller CTAs pay that again: H100, k4v4, 8 sequences x 2 KV heads x 8 rows x 16 parts at D = 512
# took 56.7 us with 8 slices (1,024 CTAs) against 50.1 with one (BENCHMARKS.md).
CUDA_MERGE_SLICE_DIMS = 64   # csrc/decode.h: MERGE_SLICE_DIMS


def cuda_num_splits(resident: int, batch_kv_heads: int, head_dim: int, max_tokens: int,
                    max_waves: int = CUDA_MAX_WAVES) -> int:
    """Splits per (sequence, KV head) for the CUDA kernel, given the CTAs resident at once.

    One wave at most (a second measured slower: each CTA builds its tables and rotates q) unless one wave would
    fill under CUDA_MIN_WAVE_FILL of the slots (then the fullest of up to max_waves), splits of at least
    CUDA_MIN_KEYS_PER_SPLIT keys (8 x 8 heads at L=1024: 4 splits 16.4 us, 2 splits 17.3), at most
    CUDA_MAX_SPLITS (CUDA_MAX_SPLITS_D64 at D = 64; the merge on the kernel's tail reads every part, and since its
    loads stay in flight across a thread's outputs 128 splits beat 64 where few (sequence, KV head) pairs would
    leave SMs idle: H100, k4v4, one sequence x 1 KV head at L=32K, D = 128: 16.2 against 20.5 us; 2 KV heads 18.4
    against 21.0; D = 256 x 1 head 21.1 against 23.3; D = 512 x 2 heads 54.2 against 61.5), and half a wave where a
    full one would cut splits shorter than CUDA_SHORT_SPLIT keys at D = 128 and 256 (one sequence x 8 heads at
    L=32K: 28.2 us at 32 splits, 30.7 at 64; 2 x 8 at 16K: 27.3 vs 28.6).  D = 64 keeps the full wave (8 x 3 heads
    at 16K: 23.5 us at 22, 26.6 at 11), and so does D = 512 (measured on 3 CTAs per SM, one sequence x 2 heads at
    32K: k3v3 41.7 us at 128 splits, 48.2 at half a wave's 86; k4v4 46.1 at 128, 49.3 at 64).
    """
    most = min(CUDA_MAX_SPLITS_D64 if head_dim <= 64 else CUDA_MAX_SPLITS, max_tokens // CUDA_MIN_KEYS_PER_SPLIT)
    splits = max(1, min(resident // batch_kv_heads, most))
    if wave_fill(splits * batch_kv_heads, resident) < CUDA_MIN_WAVE_FILL:
        # Few splits per (sequence, KV head) leave slots idle (k4v3 at B=32 x 8 KV heads, 3 CTAs x 132 SMs: one split
        # fills 65% of one wave, 195 us with the default preset's exact rows; three in two waves, 155 us): the
        # fullest waves up to CUDA_MAX_WAVES, the fewest splits among equals.  (On an H200 the three splits beat 1, 2,
        # 4 and 6 for k4v2, k5v4, k6v6 and k8v8 at B=32 x 8K: the others 1.017-1.214 of the time.)
        most_in_waves = min(most, max_waves * resident // batch_kv_heads)
        splits = max(range(splits, max(splits, most_in_waves) + 1),
                     key=lambda s: (wave_fill(s * batch_kv_heads, resident), -s))
    if 128 <= head_dim <= 256 and splits * batch_kv_heads > resident // 2 and max_tokens < splits * CUDA_SHORT_SPLIT:
        splits = max(1, min(splits, resident // 2 // batch_kv_heads))
    return cuda_filled_splits(splits, max_tokens)


def wave_fill(ctas: int, resident: int) -> float:
    """The share of the resident slots that `ctas` CTAs keep busy over the waves they take."""
    return ctas / (-(-ctas // resident) * resident)


def cuda_filled_splits(splits: int, tokens: int) -> int:
    """The splits that hold keys when the kernel cuts `tokens` into `splits` chunks: it rounds each chunk up to
    CUDA_CHUNK_ALIGN keys, so the last ones can be empty (one sequence x 8 KV heads at 32K: 33 splits of 1024 keys,
    the 33rd empty; a CTA and a part to merge for nothing)."""
    chunk = -(-tokens // splits)
    chunk = -(-chunk // CUDA_CHUNK_ALIGN) * CUDA_CHUNK_ALIGN
    return max(1, -(-tokens // chunk))


def cuda_exact_parts(head_dim: int, exact_rows: int) -> int:
    """CTAs per (sequence, KV head) that attend a cache's exact rows (first tokens and recent window together), each
    a part of the merge, with at most CUDA_EXACT_ROWS_PER_CTA rows each (the kernel splits the rows evenly).
    Beside the splits' streams every dependent step of an exact CTA is slow: one CTA for 68 rows at D = 128 took
    30 µs and ended a B=1 call (ncu: about 5,800 instructions per warp, a warp issuing one cycle in ten)."""
    if exact_rows <= 0:
        return 0
    return -(-exact_rows // CUDA_EXACT_ROWS_PER_CTA[head_dim])


def cuda_exact_ctas(exact_parts: int, splits: int, resident: int, batch_kv_heads: int) -> int:
    """Exact CTAs per (sequence, KV head) for a launch of `splits` splits: the rows' cuda_exact_parts while the grid
    stays within CUDA_EXACT_SPREAD_WAVES waves, else one.  Spread, each exact CTA ends sooner, which matters where
    the splits are short (B=1 D=128 L=32K: 68 rows on one CTA took 30 µs beside 15 µs splits); in a grid of several
    waves the extra CTAs only queue behind the splits (H100, k4v3 + first 4 + recent 64, D=128: B=8 L=32K 1.4
    waves, three CTAs 136.6 µs against one 139.2; B=16 L=16K 1.9 waves, 145.3 against 140.2; B=32 L=8K, three
    splits, 168.5 against 155.1)."""
    if exact_parts <= 1 or (splits + exact_parts) * batch_kv_heads <= CUDA_EXACT_SPREAD_WAVES * resident:
        return exact_parts
    return 1


def cuda_exact_splits(splits: int, resident: int, batch_kv_heads: int, head_dim: int, max_tokens: int) -> int:
    """Splits for a cache with exact rows, given the plain plan's, with room for one exact CTA per (sequence, KV
    head) launched after the splits' CTAs (plan_decode: further exact CTAs of a spread are short and take the
    wave's slack).  The plan for the residency less those slots keeps them in the splits' wave; the plain plan takes
    those slots for splits and makes them a tail (a few µs: the exact CTA reads its rows and rotates its output).
    The tail is taken where it shortens each split by CUDA_EXACT_TAIL_KEYS or more (H100, BENCHMARKS.md: B=8 D=128
    L=32K 6 splits against 5 gained 13%, D=256 L=8K 4 against 3 9%; B=8 D=64 L=16K 16 against 15 lost 22%, B=1
    D=128 33 against 32 lost 5%)."""
    if (splits + 1) * batch_kv_heads <= resident:
        return splits   # one wave with them already
    in_wave = cuda_num_splits(max(resident - batch_kv_heads, batch_kv_heads), batch_kv_heads, head_dim, max_tokens, 1)
    return splits if max_tokens / in_wave - max_tokens / splits >= CUDA_EXACT_TAIL_KEYS else in_wave


def cuda_merge_apart(num_parts: int, rows: int, head_dim: int) -> bool:
    """Whether a call's parts are merged in a launch of their own (else on the decode kernel's tail): from
    CUDA_MERGE_APART floats of parts per (sequence, KV head)."""
    return num_parts * rows * head_dim >= CUDA_MERGE_APART


def cuda_merge_slices(num_parts: int, rows: int, batch_kv_heads: int, head_dim: int, sms: int) -> int:
    """CTAs per output row of the merge launch, each a slice of the row's dims (csrc/decode.cuh: merge_rows), or 0
    where the merge runs on the decode kernel's tail (cuda_merge_apart).  At D = 512, whose decode kernel writes its
    parts rotated back into the model's domain for it, the most, in powers of two up to head_dim /
    CUDA_MERGE_SLICE_DIMS, that keep the launch within one CTA per SM: the rows' parts then stream through that many
    more SMs (H100, k4v4, one sequence x 2 KV heads x 8 rows x 128 parts: 8 slices, 31.7 against 38.2 us for one
    CTA per row rotating its row back).  Below D = 512 the parts stay in the codes' domain (rotating them back in
    the decode kernel measured slower there, BENCHMARKS.md) and a row takes one CTA."""
    if not cuda_merge_apart(num_parts, rows, head_dim):
        return 0
    most = head_dim // CUDA_MERGE_SLICE_DIMS if head_dim >= 512 else 1
    slices = 1
    while 2 * slices <= most and batch_kv_heads * rows * 2 * slices <= sms:
        slices *= 2
    return slices


def cuda_kernel_serves(head_dim: int, k_bits: int | tuple, v_bits: int, query_rows: int) -> bool:
    """Whether the CUDA kernel covers a call of this shape (the device check is cuda.py's).  k_bits: the keys'
    code, bits or key groups (KVCodec.key_code)."""
    if isinstance(k_bits, tuple):
        return (head_dim, k_bits, v_bits) in CUDA_KEY_GROUPS and query_rows <= CUDA_MAX_ROWS
    return head_dim in CUDA_HEAD_DIMS and (k_bits, v_bits) in CUDA_BIT_PAIRS and query_rows <= CUDA_MAX_ROWS


@lru_cache(maxsize=None)
def cuda_ctas_per_sm(head_dim: int, k_bits: int | tuple, v_bits: int, exact: bool = False) -> int:
    """CTAs per SM the CUDA kernel of this shape (k_bits: bits or key groups, as cuda_kernel_serves) is built for
    (exact: the build for caches with exact rows): ctas_per_sm in csrc/decode.cuh, which is the truth (its launch
    bound); a GPU test checks that the two agree. Shared memory, out of 228 KB: the byte -> fp16 tables (one per
    distinct bit width below 8, whose levels are computed; 32 columns of 4-byte entries, of 8-byte entries for 2 bits,
    16 of them where the 2-bit table is one of two or at head_dim <= 128 unless teams share it; 256 rows, 96 for 3
    bits, 2^bits for 5 and 6; tables of 3 to 6 bits wide where the CTAs that the registers allow still fit: a row
    for every byte, rows 256 bytes apart, two such tables in one 64 KB (CodeTable's WIDE, Shape::INTERLEAVED);
    where they would not, k4v4's CTAs hold two teams of 4 warps that share one wide table, each team one part with
    its own 16 KB of scratch and static arrays, and so do k3v3's and k2v2's plain kernels at head_dim 128, with a
    full 2-bit table: Shape::TEAMS),
    at least the 32 KB the same space holds after the main loop, the static arrays (with the q fragments at D = 256
    unless k_bits + v_bits <= CUDA_Q_REGISTER_BITS) and 1 KB reserved. D = 512 splits each row's dims over the 4 warps
    ("sliced"): no per-warp outputs to combine, q fragments in registers, 8 KB of partial scores (two buffers of a
    two-tile step's). Registers: 4 CTAs (128 per thread) for k4v4, k2v2 and k3v3's plain build at D = 128, k4v4's and
    k2v2's exact-row builds there, and every pair's exact-row build at D = 64; 3 for other pairs (among them the plain D
    = 64 kernels of codes up to 4 bits or 8, whose two-tile steps hold two tiles in 168 registers); 2 at D = 256 and in
    D = 512's exact-row builds (where they hold a second tile in flight); D = 512's plain kernels run 1 CTA of two key
    streams (8 warps) per SM, one part each (Shape::STREAMS) (why: decode.cuh; BENCHMARKS.md). The plan counts these
    CTAs even where the launcher runs k4v4's small-grid twin at D = 128 (2 CTAs per SM, for grids of at most two parts
    per SM: decode.cuh's Shape::SMALL_GRID), whose grid the same plan's parts fill."""
    team_pair = head_dim == 128 and not exact and (k_bits, v_bits) in ((3, 3), (2, 2))
    half_rows = (3, 4, 5, 6)   # bit widths whose wide tables fill half of each 256-byte row

    def table(bits: int, wide: bool = False) -> int:
        if bits in UNIFORM_BITS:   # levels computed from the code byte: no table
            return 0
        if wide and bits in half_rows:   # a row for every byte
            return 256 * 256
        rows = 0x60 if bits == 3 else 1 << bits if bits in (5, 6) else 256
        return rows * (256 if bits == 2 and k_bits == v_bits and (head_dim > 128 or team_pair) else 128)
    sliced = head_dim >= 512
    streams = 2 if sliced and not exact else 1   # key streams per CTA (decode.cuh: Shape::STREAMS)
    scratch = 4 * max(0 if sliced else 4 * CUDA_MAX_ROWS * head_dim, CUDA_MAX_ROWS * CUDA_MAX_PARTS)
    q_in_smem = head_dim == 256 and (isinstance(k_bits, tuple) or k_bits + v_bits > CUDA_Q_REGISTER_BITS)
    static = (4 * CUDA_MAX_ROWS * head_dim + (head_dim // 16 * 256 if q_in_smem else 0) + 2048
              + (2 * 2 * 4 * 32 * 16 * streams + 4 * head_dim if sliced else 0))

    def by_smem(dynamic: int, teams: int = 1) -> int:   # CTAs of `teams` teams, each with its static arrays
        return teams * (228 * 1024 // (dynamic + teams * static + 1024))
    if head_dim in (256, 512):
        by_regs = 2 // streams   # one CTA of two key streams at D = 512 (8 warps), where two of one ran
    elif head_dim == 64:
        by_regs = 4 if exact else 3
    else:
        four = (k_bits, v_bits) in ((4, 4), (2, 2)) or (head_dim == 128 and (k_bits, v_bits) == (3, 3) and not exact)
        by_regs = 4 if four else 3
    if isinstance(k_bits, tuple):   # key groups: a table per distinct group width of codes, and V's own
        tables = sum(table(bits) for bits in {bits for _, bits in k_bits}) + table(v_bits)
    else:
        def tables_of(wide: bool) -> int:
            # One table's space: one codebook, or two interleaved (each fills half of every row).
            if k_bits == v_bits or (wide and k_bits in half_rows and v_bits in half_rows):
                return table(k_bits, wide)
            return table(k_bits, wide) + table(v_bits, wide)
        wide_gains = 8 not in (k_bits, v_bits) and (k_bits, v_bits) != (4, 2)   # measured: decode.cuh's Shape
        wide_fits = wide_gains and by_smem(max(tables_of(True), scratch)) >= by_regs
        four_teams = (not wide_fits and not sliced and (k_bits, v_bits) == (4, 4)
                      and not (head_dim == 128 and exact))
        if team_pair or four_teams:
            # Two teams per CTA share one wide table, each with its own scratch and static arrays.
            team_scratch = 4 * max(4 * CUDA_MAX_ROWS * head_dim, CUDA_MAX_ROWS * CUDA_MAX_PARTS // 2)
            return min(by_smem(tables_of(True) + 2 * team_scratch, teams=2), by_regs)
        tables = tables_of(wide_fits)   # tables of 3 to 6 bits wide where the CTAs still fit
    return min(by_smem(max(tables, scratch)), by_regs)


@dataclass(frozen=True)
class DecodePlan:
    block_m: int       # query rows (Tq x GQA group) per program
    block_n: int       # keys per tile
    num_warps: int
    num_stages: int
    num_splits: int    # split-K programs per (sequence, KV head); the fresh-token part is extra
    lookup: str        # "lut": 4-bit sides decode through a register LUT (CUDA); "gather": table loads
    # CUDA kernel, caches with exact rows: CTAs per (sequence, KV head) that attend them, at most the rows'
    # cuda_exact_parts (None: that many; plan_decode picks by cuda_exact_ctas).  The Triton kernels ignore it.
    exact_parts: int | None = None

    def __post_init__(self):
        if self.lookup not in LOOKUPS:
            raise ValueError(f"lookup must be one of {LOOKUPS}, got {self.lookup!r}")
        for name in ("block_m", "block_n", "num_warps", "num_stages", "num_splits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodePlan.{name} must be a positive int, got {value!r}")
        if self.exact_parts is not None and (not isinstance(self.exact_parts, int) or self.exact_parts < 1):
            raise ValueError(f"DecodePlan.exact_parts must be None or a positive int, got {self.exact_parts!r}")

    def to_list(self) -> list[int]:
        """The plan as the op's int list (lookup as its index in LOOKUPS, exact_parts None as 0)."""
        return [self.block_m, self.block_n, self.num_warps, self.num_stages, self.num_splits,
                LOOKUPS.index(self.lookup), self.exact_parts or 0]

    @classmethod
    def from_list(cls, values) -> DecodePlan:
        return _plan_from_tuple(tuple(int(x) for x in values))


@lru_cache(maxsize=4096)
def _plan_from_tuple(values: tuple[int, ...]) -> DecodePlan:
    *ints, lookup = values[:6]
    return DecodePlan(*ints, LOOKUPS[lookup], (values[6] or None) if len(values) > 6 else None)


def _tile(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): D > 256 (512 columns) needs smaller key tiles to fit shared memory, and
    D = 256 two stages (three asked for 232 KB of an H100's 227 with fresh tokens, sinks and a key transform)."""
    if head_dim > 256:
        return 32, 4, 2
    if head_dim > 128:
        return 64, 4, 2
    return 64, 4, 3


@lru_cache(maxsize=4096)  # a decode loop asks the same question every step: host time matters
def plan_decode(device: torch.device, head_dim: int, k_bits: int, v_bits: int, batch_kv_heads: int,
                query_rows: int, max_tokens: int, num_splits: int | None = None,
                programs_per_sm: int | None = None, kernel: str = "triton", exact_rows: int = 0) -> DecodePlan:
    """The plan for query_rows = Tq x GQA group rows per KV head over up to max_tokens cached keys.

    kernel: the implementation that will run it ("cuda" plans the CUDA kernel's splits where it serves).
    exact_rows: the cache's exact rows per (sequence, KV head) (first tokens and recent window); the CUDA kernel
    then adds exact_parts CTAs per (sequence, KV head) (cuda_exact_ctas), launched after the splits
    (cuda_exact_splits).
    """
    block_m = 16 if query_rows <= 16 else 64
    block_n, num_warps, num_stages = _tile(head_dim)
    exact_parts = None
    if num_splits is None and kernel == "cuda" and cuda_kernel_serves(head_dim, k_bits, v_bits, query_rows):
        resident = (programs_per_sm or cuda_ctas_per_sm(head_dim, k_bits, v_bits, exact_rows > 0)) * sm_count(device)
        num_splits = cuda_num_splits(resident, batch_kv_heads, head_dim, max_tokens)
        if exact_rows:
            # The splits leave room for one exact CTA per (sequence, KV head) (cuda_exact_splits), as the tail rule
            # was measured; the further CTAs of a spread are short and take what slack the wave has (at D = 64, B=8
            # and B=16, planning room for two cost a split and 1-8%).
            exact_parts = cuda_exact_ctas(cuda_exact_parts(head_dim, exact_rows), num_splits, resident,
                                          batch_kv_heads)
            num_splits = cuda_exact_splits(num_splits, resident, batch_kv_heads, head_dim, max_tokens)
    if num_splits is None:
        row_blocks = -(-query_rows // block_m)
        num_splits = num_splits_for(device, batch_kv_heads * row_blocks, max_tokens,
                                    programs_per_sm or PROGRAMS_PER_SM, max(MIN_KEYS_PER_SPLIT, 4 * block_n))
    # The LUT is inline PTX (no interpreter) over the plain layout's contiguous bytes (powers of two only).
    lookup = "lut" if device.type == "cuda" and head_dim & (head_dim - 1) == 0 else "gather"
    if head_dim == 64 and block_m == 64 and (k_bits == 4) != (v_bits == 4):
        # Triton 3.6 miscompiles this mix (one side through the asm LUT, the other through the
        # gather) at D = 64 with 64-row tiles: illegal shared-memory reads or NaN on an H200
        # (BENCHMARKS.md).  Both sides gather instead: slower, correct.
        lookup = "gather"
    if torch.compiler.is_compiling():   # traced: a plan built in the graph, not a cache lookup traced through
        return DecodePlan(block_m, block_n, num_warps, num_stages, num_splits, lookup, exact_parts)
    # A growing cache asks with a new max_tokens every step (a miss above) for one of a few plans: the plan
    # objects are shared, so a miss builds and validates none.
    return _plan_from_tuple((block_m, block_n, num_warps, num_stages, num_splits, LOOKUPS.index(lookup),
                             exact_parts or 0))
