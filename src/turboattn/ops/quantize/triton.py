"""Fused rotate + norm + quantize + pack + code write, one launch per append (the exact rows and the lengths
are torch ops around it: naive.py).

Grid: (token blocks, B * Hkv, 2); the last axis picks K or V.  Each program
rotates BLOCK_T vectors on tensor cores (common.hadamard_rows), computes the
per-block scale, finds codebook cells by a branch-free binary search over the
boundaries, bit-packs the planes exactly as codec.pack_codes does, and writes
codes and scales into the cache slots (ring slots wrap modulo the window).
Like codec.quantize, each vector is first scaled by a power of two (exact) so
its norms cannot overflow or underflow, and a vector holding a NaN or infinity
is stored as codes 0 and NaN scales and counted in the cache's counter.

Head dims that are not powers of two (D = P * m, m odd) are held in the padded
layout (triton_lib.padded_factor: next_power_of_2(D) columns, coordinate
p * m + r in column p * next_power_of_2(m) + r, zeros elsewhere), where the
rotation H_P ⊗ Q_m is a product with a small dense factor and butterflies
(triton_lib.kron_rows), and where the codec's planar packing is still a
reshape: a plane's slot is the top bits of p.  Loads and stores go through
the column -> coordinate map; for powers of two (M = 1) every step compiles
to the plain layout's code.

Keys in channel groups (codec.key_groups): the host applies the key transform and the channel order
(to_stored_keys) and marks a key holding a NaN or infinity as NaN in full, then one launch of
`_encode_kernel` codes each group as a key of its own width into its bytes and scale of the cache's rows,
and a third codes the values.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ...format.codec import KVCodec
from ...format.key_transform import to_stored_keys
from ...format.layout import CacheLayout
from ...format.rotation import device_signs
from ..triton_lib import hadamard_tile, kron_rows, kron_tile, load_padded_vector, padded_columns, padded_factor, padded_mask
from ..cached.config import check_kernel_head_dim
from ..launch import cdiv
from .config import boundary_grid, plan_quantize
from .naive import advance_lengths, store_exact_rows


# Cell search by a uniform grid over u in [GRID_LO, -GRID_LO): grid cell g holds the
# number of boundaries below its left edge, and (checked in cell_tables) no grid cell holds more
# than one boundary, so one table read plus one boundary compare finds the exact cell.
GRID_LO = tl.constexpr(-8.0)
GRID_SIZE = tl.constexpr(4096)


@triton.jit
def _cell_index(u, bounds_ptr, grid_ptr, cb_ptr, NEED_CENTROID: tl.constexpr):
    """(number of boundaries strictly below u, its centroid or 0): ties go to the lower cell."""
    g = ((u - GRID_LO) * (GRID_SIZE / (-2.0 * GRID_LO))).to(tl.int32)
    g = tl.minimum(tl.maximum(g, 0), GRID_SIZE - 1)
    below = tl.load(grid_ptr + g).to(tl.int32)
    # bounds carries a +inf sentinel, so the last cell compares safely.
    idx = below + (tl.load(bounds_ptr + below) < u).to(tl.int32)
    c = 0.0
    if NEED_CENTROID:
        c = tl.load(cb_ptr + idx)
    return idx, c


@triton.jit
def _pow2(n):
    """2**n as float32 built from its bits; n int32 in the normal range (codec.pow2)."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _times_pow2(x, n):
    """x * 2**n with two normal factors, in codec.times_pow2's order (exact unless it over/underflows)."""
    n = tl.minimum(tl.maximum(n, -252), 252)
    half = n >> 1  # arithmetic shift: floor(n / 2), like the reference
    return x * _pow2(half) * _pow2(n - half)


@triton.jit
def _magnitude_exponent(amax):
    """frexp's exponent of each amax >= 0 (amax in [2^(e-1), 2^e)), 0 for 0: codec.magnitude_exponent."""
    sub = amax < 1.1754943508222875e-38  # subnormal: its exponent bits read 0, so scale it up by 2^64 first
    a = tl.where(sub, tl.minimum(amax, 1.0) * 18446744073709551616.0, amax)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 126 - tl.where(sub, 64, 0)
    return tl.where(amax > 0, e, 0)


@triton.jit
def _load_finite(base, offs_d, valid, cols_ok, sub_ptr, mul_ptr, AFFINE: tl.constexpr, M: tl.constexpr):
    """Rows of BLK inputs (key transform applied when AFFINE) with non-finite entries zeroed, and
    whether each row had one.  offs_d: the columns' coordinates (padded layout when M > 1)."""
    x = tl.load(base + offs_d[None, :], mask=padded_mask(valid, cols_ok, M), other=0.0).to(tl.float32)
    if AFFINE:  # the key transform: (x - shift) * gain
        x = (x - load_padded_vector(sub_ptr, offs_d[None, :], cols_ok, M)) * load_padded_vector(mul_ptr, offs_d[None, :], cols_ok, M)
    ok = tl.abs(x) < float("inf")  # False for NaN too
    return tl.where(ok, x, 0.0), tl.min(ok.to(tl.int32), axis=1) == 0


@triton.jit
def _encode_block(y, cols_ok, cb_ptr, bounds_ptr, grid_ptr, BITS: tl.constexpr, RULE: tl.constexpr,
                  BLK: tl.constexpr, M: tl.constexpr):
    """y [R, BLK_P] (rotated, up to a common factor; BLK coordinates, padded layout when M > 1, whose padded
    columns hold zeros) -> (cell indices, scale per row in y's units)."""
    sumsq = tl.sum(y * y, axis=1)
    rms = tl.sqrt(sumsq / BLK)
    safe = tl.where(rms > 0, rms, 1.0)
    idx, c = _cell_index(y / safe[:, None], bounds_ptr, grid_ptr, cb_ptr, RULE != 0)
    if M > 1:
        if RULE != 0:   # a padded column's cell (that of 0) is no centroid of the block
            c = tl.where(cols_ok[None, :], c, 0.0)
    if RULE == 0:
        scale = rms
    else:
        csq = tl.sum(c * c, axis=1)
        if RULE == 1:
            scale = tl.sqrt(sumsq) / tl.sqrt(csq)
        else:
            scale = tl.sum(y * c, axis=1) / csq
        scale = tl.where(rms > 0, scale, 0.0)
    return idx, scale


@triton.jit
def _plane_bytes(idx, SHIFT: tl.constexpr, W: tl.constexpr, FIRST_SLOT: tl.constexpr,
                 R: tl.constexpr, BLK: tl.constexpr, P: tl.constexpr):
    """This block's share of a plane of width W: byte j gets coordinate j + k*P at bit k*W."""
    PER_BLOCK: tl.constexpr = BLK // P
    part = tl.reshape((idx >> SHIFT) & ((1 << W) - 1), (R, PER_BLOCK, P))
    shifts = (FIRST_SLOT + tl.arange(0, PER_BLOCK)) * W
    return tl.sum(part << shifts[None, :, None], axis=1)


@triton.jit
def _store_bytes(ptrs, values, mask, cols_ok, VEC: tl.constexpr, M: tl.constexpr):
    """Store a tile of code bytes; M > 1: ptrs follow the padded layout's map, so neither aligned nor contiguous."""
    if M == 1:
        tl.store(tl.max_contiguous(tl.multiple_of(ptrs, [1, VEC]), [1, VEC]), values.to(tl.uint8), mask=mask[:, None])
    else:
        tl.store(ptrs, values.to(tl.uint8), mask=mask[:, None] & cols_ok[None, :])


@triton.jit
def _store_planes(idx0, idx1, row_ptr, mask, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                  BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, VEC: tl.constexpr,
                  M: tl.constexpr, MP: tl.constexpr):
    """Pack up to two planes (W0 low bits, W1 high bits) from one or two norm blocks and store them.

    M > 1: idx0, idx1 are in the padded layout (BLK_P columns for BLK coordinates).  A plane of P bytes holds
    coordinate i in byte i % P, slot i // P; with i = p * M + r and P = P_h * M, the slot is p // P_h and the
    byte's padded column is (p % P_h) * MP + r: the same reshape as for powers of two, at padded widths."""
    BLK: tl.constexpr = D // NB
    BLK_P: tl.constexpr = BLK // M * MP
    if W0 == 8:
        offs, ok = padded_columns(BLK_P, M, MP)
        _store_bytes(row_ptr[:, None] + offs[None, :], idx0, mask, ok, VEC, M)
        if NB == 2:
            _store_bytes(row_ptr[:, None] + BLK + offs[None, :], idx1, mask, ok, VEC, M)
    else:
        P0: tl.constexpr = D * W0 // 8
        P0_P: tl.constexpr = P0 // M * MP
        b0 = _plane_bytes(idx0, 0, W0, 0, R, BLK_P, P0_P)
        if NB == 2:
            b0 = b0 | _plane_bytes(idx1, 0, W0, BLK // P0, R, BLK_P, P0_P)
        offs0, ok0 = padded_columns(P0_P, M, MP)
        _store_bytes(row_ptr[:, None] + offs0[None, :], b0, mask, ok0, VEC, M)
        if W1 > 0:
            P1: tl.constexpr = D * W1 // 8
            P1_P: tl.constexpr = P1 // M * MP
            b1 = _plane_bytes(idx0, W0, W1, 0, R, BLK_P, P1_P)
            if NB == 2:
                b1 = b1 | _plane_bytes(idx1, W0, W1, BLK // P1, R, BLK_P, P1_P)
            offs1, ok1 = padded_columns(P1_P, M, MP)
            _store_bytes(row_ptr[:, None] + P0 + offs1[None, :], b1, mask, ok1, VEC, M)


@triton.jit
def _store_scale(ptr, s, bad, valid, BF16: tl.constexpr):
    """Store scales s (float32; NaN where bad).  BF16: ptr is the bfloat16 scales' int16 view, and s is rounded
    to nearest-even in integer arithmetic (float32 bits + 0x7FFF + the kept lsb, top 16 bits), so the GPU and
    the interpreter (whose float casts truncate) store the same value as torch's .to(torch.bfloat16)."""
    s = tl.where(bad, float("nan"), s)
    if BF16:
        bits = s.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(s == s, rounded, 0x7FC0)   # a NaN stays a (quiet) NaN
        tl.store(ptr, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=valid)
    else:
        tl.store(ptr, s, mask=valid)


@triton.jit
def _encode_tile(x_ptr, sx_b, sx_h, sx_t, b, h, t0, n_new, first, slot0, N, num_kv_heads,
                 codes_ptr, scales_ptr, cb_ptr, bounds_ptr, grid_ptr, signs_ptr, had_ptr, kron_ptr, sub_ptr,
                 mul_ptr, count_ptr, D: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                 RULE: tl.constexpr, BLOCK_T: tl.constexpr, RING: tl.constexpr, VEC: tl.constexpr,
                 AFFINE: tl.constexpr, COUNT: tl.constexpr, BF16_SCALES: tl.constexpr,
                 M: tl.constexpr, MP: tl.constexpr, ROW_BYTES: tl.constexpr, SCALE_STRIDE: tl.constexpr):
    """Code BLOCK_T vectors of D coordinates into rows of ROW_BYTES code bytes and SCALE_STRIDE scales (a key
    group's share of its cache row: codes_ptr and scales_ptr then point at the group's first byte and scale)."""
    # Norm blocks: the whole row up to 256 coordinates, else its two halves (codec.KVCodec.num_blocks).
    NB: tl.constexpr = 2 if D > 256 else 1
    BLK: tl.constexpr = D // NB
    BLK_P: tl.constexpr = BLK // M * MP   # the block's columns (padded layout when M > 1)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    valid = (offs_t < n_new) & (offs_t >= first)
    offs_d, cols_ok = padded_columns(BLK_P, M, MP)
    base = x_ptr + b * sx_b + h * sx_h + offs_t[:, None] * sx_t
    xf = (b * num_kv_heads + h) * D
    x0, bad = _load_finite(base, offs_d, valid, cols_ok, sub_ptr + xf, mul_ptr + xf, AFFINE, M)
    amax = tl.max(tl.abs(x0), axis=1)
    if NB == 2:
        x1, bad1 = _load_finite(base + BLK, offs_d, valid, cols_ok, sub_ptr + xf + BLK, mul_ptr + xf + BLK,
                                AFFINE, M)
        bad = bad | bad1
        amax = tl.maximum(amax, tl.max(tl.abs(x1), axis=1))
    e = _magnitude_exponent(amax)
    x0 = _times_pow2(x0, -e[:, None]) * load_padded_vector(signs_ptr, offs_d[None, :], cols_ok, M)
    if NB == 2:
        # H_P ⊗ Q = [[H', H'], [H', -H']] with H' = H_{P/2} ⊗ Q: one butterfly, then two products of half size.
        x1 = _times_pow2(x1, -e[:, None]) * load_padded_vector(signs_ptr + BLK, offs_d[None, :], cols_ok, M)
        y0 = kron_rows(x0 + x1, had_ptr, kron_ptr, BLK_P, M, MP)
        y1 = kron_rows(x0 - x1, had_ptr, kron_ptr, BLK_P, M, MP)
    else:
        y0 = kron_rows(x0, had_ptr, kron_ptr, BLK_P, M, MP)
        y1 = y0
    idx0, s0 = _encode_block(y0, cols_ok, cb_ptr, bounds_ptr, grid_ptr, BITS, RULE, BLK, M)
    idx0 = tl.where(bad[:, None], 0, idx0)
    idx1 = idx0
    if NB == 2:
        idx1, s1 = _encode_block(y1, cols_ok, cb_ptr, bounds_ptr, grid_ptr, BITS, RULE, BLK, M)
        idx1 = tl.where(bad[:, None], 0, idx1)

    slot = slot0 + offs_t
    if RING:
        slot = slot % N
    else:
        valid = valid & (slot < N)  # a full static cache stores what fits (QuantizedKVCache.append)
    row = (b * num_kv_heads + h).to(tl.int64) * N + slot
    _store_planes(idx0, idx1, codes_ptr + row * ROW_BYTES, valid, BLOCK_T, D, NB, BITS, W0, W1, VEC, M, MP)
    norm = 1.0 / tl.sqrt((D // M) * 1.0)  # kron_rows is unnormalized: 1 / sqrt(P), Q is orthonormal
    _store_scale(scales_ptr + row * SCALE_STRIDE, _times_pow2(s0 * norm, e), bad, valid, BF16_SCALES)
    if NB == 2:
        _store_scale(scales_ptr + row * SCALE_STRIDE + 1, _times_pow2(s1 * norm, e), bad, valid, BF16_SCALES)
    if COUNT:
        n_bad = tl.sum((bad & valid).to(tl.int32), axis=0)
        tl.atomic_add(count_ptr + b, n_bad, mask=n_bad > 0)


@triton.jit
def _program_tokens(seen_ptr, new_len_ptr, T, N, num_kv_heads, BLOCK_T: tl.constexpr, RING: tl.constexpr,
                    HAS_LENGTHS: tl.constexpr):
    """(first token t0, sequence b, KV head h, real tokens n_new, first token kept, slot of token 0) of this
    program (grid axis 0: token blocks, axis 1: B * Hkv)."""
    t0 = tl.program_id(0) * BLOCK_T
    bh = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    n_new = T
    if HAS_LENGTHS:
        n_new = tl.load(new_len_ptr + b)
    first = 0
    if RING:
        first = tl.maximum(n_new - N, 0)  # a ring keeps only the last N tokens of a long chunk
    slot0 = tl.load(seen_ptr + b)
    return t0, b, h, n_new, first, slot0


@triton.jit
def _quantize_append_kernel(
    k_ptr, v_ptr, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
    k_codes, k_scales, v_codes, v_scales,
    k_cb, k_bounds, k_grid, v_cb, v_bounds, v_grid, signs_ptr, had_ptr, kron_ptr, key_shift_ptr, key_gain_ptr,
    seen_ptr, new_len_ptr, count_ptr, T, N, num_kv_heads,
    D: tl.constexpr, K_BITS: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr,
    V_BITS: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr,
    RULE: tl.constexpr, BLOCK_T: tl.constexpr, RING: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    K_VEC: tl.constexpr, V_VEC: tl.constexpr, KEY_XFORM: tl.constexpr, COUNT: tl.constexpr,
    BF16_SCALES: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
):
    t0, b, h, n_new, first, slot0 = _program_tokens(seen_ptr, new_len_ptr, T, N, num_kv_heads, BLOCK_T, RING,
                                                    HAS_LENGTHS)
    if tl.program_id(2) == 0:
        _encode_tile(k_ptr, sk_b, sk_h, sk_t, b, h, t0, n_new, first, slot0, N, num_kv_heads,
                     k_codes, k_scales, k_cb, k_bounds, k_grid, signs_ptr, had_ptr, kron_ptr, key_shift_ptr,
                     key_gain_ptr, count_ptr, D, K_BITS, K_W0, K_W1, RULE, BLOCK_T, RING, K_VEC, KEY_XFORM, COUNT,
                     BF16_SCALES, M, MP, D * K_BITS // 8, 2 if D > 256 else 1)
    else:
        _encode_tile(v_ptr, sv_b, sv_h, sv_t, b, h, t0, n_new, first, slot0, N, num_kv_heads,
                     v_codes, v_scales, v_cb, v_bounds, v_grid, signs_ptr, had_ptr, kron_ptr, key_shift_ptr,
                     key_gain_ptr, count_ptr, D, V_BITS, V_W0, V_W1, RULE, BLOCK_T, RING, V_VEC, False, COUNT,
                     BF16_SCALES, M, MP, D * V_BITS // 8, 2 if D > 256 else 1)


@triton.jit
def _encode_kernel(
    x_ptr, sx_b, sx_h, sx_t, codes_ptr, scales_ptr, cb_ptr, bounds_ptr, grid_ptr, signs_ptr, had_ptr, kron_ptr,
    seen_ptr, new_len_ptr, count_ptr, T, N, num_kv_heads,
    D: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, RULE: tl.constexpr,
    BLOCK_T: tl.constexpr, RING: tl.constexpr, HAS_LENGTHS: tl.constexpr, VEC: tl.constexpr, COUNT: tl.constexpr,
    BF16_SCALES: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, ROW_BYTES: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
):
    """One side's vectors (a key group, or the values of a cache with key groups) into the cache: grid (token
    blocks, B * Hkv), the slots as in _quantize_append_kernel."""
    t0, b, h, n_new, first, slot0 = _program_tokens(seen_ptr, new_len_ptr, T, N, num_kv_heads, BLOCK_T, RING,
                                                    HAS_LENGTHS)
    _encode_tile(x_ptr, sx_b, sx_h, sx_t, b, h, t0, n_new, first, slot0, N, num_kv_heads, codes_ptr, scales_ptr,
                 cb_ptr, bounds_ptr, grid_ptr, signs_ptr, had_ptr, kron_ptr, cb_ptr, cb_ptr, count_ptr, D, BITS,
                 W0, W1, RULE, BLOCK_T, RING, VEC, False, COUNT, BF16_SCALES, M, MP, ROW_BYTES, SCALE_STRIDE)


@lru_cache(maxsize=None)
def cell_tables(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centroids, boundaries + [inf], grid of boundary counts) float32/float32/int16 on `device`."""
    return boundary_grid(bits, GRID_LO.value, GRID_SIZE.value, torch.int16, device)


def quantize_append_triton(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, codec: KVCodec,
                           new_lengths: torch.Tensor | None, advance: bool = True) -> None:
    """Append k, v [B, Hkv, T, D] to the cache (naive.quantize_append_naive's contract): the kernel codes the
    tokens, torch ops copy the exact rows and advance the lengths.

    k is in the model's domain: the kernel applies the key transform, if any."""
    check_kernel_head_dim("quantize_append", codec.head_dim)
    store_exact_rows(k, v, layout, new_lengths)   # reads seen before the append, as the kernel does
    if codec.grouped_keys:
        _append_grouped(k, v, layout, codec, new_lengths)
        if advance:
            advance_lengths(layout, new_lengths, k.shape[2])
        return
    key_xform = layout.has_key_transform
    d = codec.head_dim
    m, m_pad = padded_factor(d)
    b, hkv, t, _ = k.shape
    if k.stride(3) != 1:
        k = k.contiguous()
    if v.stride(3) != 1:
        v = v.contiguous()
    dev = k.device
    k_spec, v_spec = codec.kernel_spec("k"), codec.kernel_spec("v")
    k_cb, k_bounds, k_grid = cell_tables(codec.k_bits, dev)
    v_cb, v_bounds, v_grid = cell_tables(codec.v_bits, dev)
    plan = plan_quantize(d, t)
    grid = (cdiv(t, plan.block_t), b * hkv, 2)
    bf16_scales = layout.k_scales.dtype == torch.bfloat16
    k_scales, v_scales = ((x.view(torch.int16) if bf16_scales else x) for x in (layout.k_scales, layout.v_scales))
    sk, sv = k.stride(), v.stride()
    _quantize_append_kernel[grid](
        k, v, sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
        layout.k_codes, k_scales, layout.v_codes, v_scales,
        k_cb, k_bounds, k_grid, v_cb, v_bounds, v_grid, device_signs(d, dev),
        hadamard_tile(min(d, 256) if m == 1 else 16, dev), kron_tile(m, dev),
        *(layout.key_shift, layout.key_gain) if key_xform else (k_cb, k_cb),
        layout.seen, new_lengths if new_lengths is not None else layout.seen,
        layout.nonfinite if layout.nonfinite is not None else layout.seen, t, layout.capacity, hkv,
        D=d, K_BITS=k_spec.bits, K_W0=k_spec.low_plane, K_W1=k_spec.high_plane,
        V_BITS=v_spec.bits, V_W0=v_spec.low_plane, V_W1=v_spec.high_plane,
        RULE=codec.scale_rule_id, BLOCK_T=plan.block_t, RING=layout.is_ring,
        HAS_LENGTHS=new_lengths is not None, K_VEC=k_spec.vector_bytes, V_VEC=v_spec.vector_bytes,
        KEY_XFORM=key_xform, COUNT=layout.nonfinite is not None, BF16_SCALES=bf16_scales, M=m, MP=m_pad,
        num_warps=plan.num_warps,
    )
    if advance:
        advance_lengths(layout, new_lengths, t)


def _append_grouped(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, codec: KVCodec,
                    new_lengths: torch.Tensor | None) -> None:
    """The codes of a cache with keys in channel groups: three launches of _encode_kernel (module docstring)."""
    b, hkv, t, d = k.shape
    stored = to_stored_keys(k, layout.key_shift, layout.key_gain, layout.key_order) if layout.has_key_transform \
        else k.to(torch.float32)
    # One NaN marks the whole key (codec.quantize): each group's launch sees only its own coordinates.
    finite = torch.isfinite(stored).all(dim=-1, keepdim=True)
    stored = torch.where(finite, stored, torch.full_like(stored, float("nan"))).contiguous()
    if v.stride(3) != 1:
        v = v.contiguous()
    bf16_scales = layout.k_scales.dtype == torch.bfloat16
    k_scales, v_scales = ((x.view(torch.int16) if bf16_scales else x) for x in (layout.k_scales, layout.v_scales))
    row_bytes = codec.code_bytes("k")
    group_a, group_b = codec.key_group_codecs
    offset = group_a.code_bytes("k")
    count = layout.nonfinite is not None
    # (input, its codec, kind, codes, scales, code bytes per row, scales per row, counts non-finite vectors): the two
    # key groups (a group's bytes and scale start inside the row), then the values.
    sides = ((stored[..., :group_a.head_dim], group_a, "k", layout.k_codes, k_scales, row_bytes, 2, count),
             (stored[..., group_a.head_dim:], group_b, "k", layout.k_codes[..., offset:], k_scales[..., 1:],
              row_bytes, 2, False),
             (v, codec, "v", layout.v_codes, v_scales, codec.code_bytes("v"), codec.scale_count("v"), count))
    for x, side, kind, codes, scales, row, scale_stride, counts in sides:
        width = side.head_dim
        m, m_pad = padded_factor(width)
        spec = side.kernel_spec(kind)
        cb, bounds, grid_table = cell_tables(spec.bits, k.device)
        plan = plan_quantize(width, t)
        sx = x.stride()
        _encode_kernel[(cdiv(t, plan.block_t), b * hkv)](
            x, sx[0], sx[1], sx[2], codes, scales, cb, bounds, grid_table, device_signs(width, k.device),
            hadamard_tile(min(width, 256) if m == 1 else 16, k.device), kron_tile(m, k.device),
            layout.seen, new_lengths if new_lengths is not None else layout.seen,
            layout.nonfinite if counts else layout.seen, t, layout.capacity, hkv,
            D=width, BITS=spec.bits, W0=spec.low_plane, W1=spec.high_plane, RULE=codec.scale_rule_id,
            BLOCK_T=plan.block_t, RING=layout.is_ring, HAS_LENGTHS=new_lengths is not None,
            VEC=1 if kind == "k" else spec.vector_bytes, COUNT=counts, BF16_SCALES=bf16_scales, M=m, MP=m_pad,
            ROW_BYTES=row, SCALE_STRIDE=scale_stride, num_warps=plan.num_warps,
        )
