"""Fused rotate + norm + quantize + pack + cache write, one launch per append.

Grid: (token blocks, B * Hkv, 2); the last axis picks K or V.  Each program
rotates BLOCK_T vectors on tensor cores (common.hadamard_rows), computes the
per-block scale, finds Lloyd–Max cells by a branch-free binary search over the
boundaries, bit-packs the planes exactly as codec.pack_codes does, and writes
codes and scales into the cache slots (ring slots wrap modulo the window).
Like codec.quantize, each vector is first scaled by a power of two (exact) so
its norms cannot overflow or underflow, and a vector holding a NaN or infinity
is stored as codes 0 and NaN scales and counted in the cache's counter.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ...format import codebook
from ...format.codec import KVCodec
from ...format.layout import CacheLayout
from ...format.rotation import device_signs
from ..triton_lib import hadamard_any, hadamard_tile
from ..cached.config import check_kernel_head_dim
from .config import plan_quantize


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
def _load_finite(base, offs_d, valid, sub_ptr, mul_ptr, AFFINE: tl.constexpr):
    """Rows of BLK inputs (key transform applied when AFFINE) with non-finite entries zeroed, and
    whether each row had one."""
    x = tl.load(base + offs_d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    if AFFINE:  # the key transform: (x - shift) * gain
        x = (x - tl.load(sub_ptr + offs_d)[None, :]) * tl.load(mul_ptr + offs_d)[None, :]
    ok = tl.abs(x) < float("inf")  # False for NaN too
    return tl.where(ok, x, 0.0), tl.min(ok.to(tl.int32), axis=1) == 0


@triton.jit
def _encode_block(y, cb_ptr, bounds_ptr, grid_ptr, BITS: tl.constexpr, RULE: tl.constexpr, BLK: tl.constexpr):
    """y [R, BLK] (rotated, up to a common factor) -> (cell indices, scale per row in y's units)."""
    sumsq = tl.sum(y * y, axis=1)
    rms = tl.sqrt(sumsq / BLK)
    safe = tl.where(rms > 0, rms, 1.0)
    idx, c = _cell_index(y / safe[:, None], bounds_ptr, grid_ptr, cb_ptr, RULE != 0)
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
def _store_planes(idx0, idx1, row_ptr, mask, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                  BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, VEC: tl.constexpr):
    """Pack up to two planes (W0 low bits, W1 high bits) from one or two norm blocks and store them."""
    BLK: tl.constexpr = D // NB
    if W0 == 8:
        offs = tl.arange(0, BLK)
        tl.store(tl.max_contiguous(tl.multiple_of(row_ptr[:, None] + offs[None, :], [1, VEC]), [1, VEC]), idx0.to(tl.uint8), mask=mask[:, None])
        if NB == 2:
            tl.store(tl.max_contiguous(tl.multiple_of(row_ptr[:, None] + BLK + offs[None, :], [1, VEC]), [1, VEC]), idx1.to(tl.uint8), mask=mask[:, None])
    else:
        P0: tl.constexpr = D * W0 // 8
        b0 = _plane_bytes(idx0, 0, W0, 0, R, BLK, P0)
        if NB == 2:
            b0 = b0 | _plane_bytes(idx1, 0, W0, BLK // P0, R, BLK, P0)
        offs0 = tl.arange(0, P0)
        tl.store(tl.max_contiguous(tl.multiple_of(row_ptr[:, None] + offs0[None, :], [1, VEC]), [1, VEC]), b0.to(tl.uint8), mask=mask[:, None])
        if W1 > 0:
            P1: tl.constexpr = D * W1 // 8
            b1 = _plane_bytes(idx0, W0, W1, 0, R, BLK, P1)
            if NB == 2:
                b1 = b1 | _plane_bytes(idx1, W0, W1, BLK // P1, R, BLK, P1)
            offs1 = tl.arange(0, P1)
            tl.store(tl.max_contiguous(tl.multiple_of(row_ptr[:, None] + P0 + offs1[None, :], [1, VEC]), [1, VEC]), b1.to(tl.uint8), mask=mask[:, None])


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
                 codes_ptr, scales_ptr, cb_ptr, bounds_ptr, grid_ptr, signs_ptr, had_ptr, sub_ptr, mul_ptr,
                 count_ptr, D: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                 RULE: tl.constexpr, BLOCK_T: tl.constexpr, RING: tl.constexpr, VEC: tl.constexpr,
                 AFFINE: tl.constexpr, COUNT: tl.constexpr, BF16_SCALES: tl.constexpr):
    NB: tl.constexpr = 2 if D == 512 else 1
    BLK: tl.constexpr = D // NB
    CB: tl.constexpr = D * BITS // 8
    offs_t = t0 + tl.arange(0, BLOCK_T)
    valid = (offs_t < n_new) & (offs_t >= first)
    offs_d = tl.arange(0, BLK)
    base = x_ptr + b * sx_b + h * sx_h + offs_t[:, None] * sx_t
    xf = (b * num_kv_heads + h) * D
    x0, bad = _load_finite(base, offs_d, valid, sub_ptr + xf, mul_ptr + xf, AFFINE)
    amax = tl.max(tl.abs(x0), axis=1)
    if NB == 2:
        x1, bad1 = _load_finite(base + BLK, offs_d, valid, sub_ptr + xf + BLK, mul_ptr + xf + BLK, AFFINE)
        bad = bad | bad1
        amax = tl.maximum(amax, tl.max(tl.abs(x1), axis=1))
    e = _magnitude_exponent(amax)
    x0 = _times_pow2(x0, -e[:, None]) * tl.load(signs_ptr + offs_d)[None, :]
    if NB == 2:
        # H_512 = [[H, H], [H, -H]] with H = H_256: one butterfly, then two H_256 products.
        x1 = _times_pow2(x1, -e[:, None]) * tl.load(signs_ptr + BLK + offs_d)[None, :]
        y0 = hadamard_any(x0 + x1, had_ptr, BLK)
        y1 = hadamard_any(x0 - x1, had_ptr, BLK)
    else:
        y0 = hadamard_any(x0, had_ptr, BLK)
        y1 = y0
    idx0, s0 = _encode_block(y0, cb_ptr, bounds_ptr, grid_ptr, BITS, RULE, BLK)
    idx0 = tl.where(bad[:, None], 0, idx0)
    idx1 = idx0
    if NB == 2:
        idx1, s1 = _encode_block(y1, cb_ptr, bounds_ptr, grid_ptr, BITS, RULE, BLK)
        idx1 = tl.where(bad[:, None], 0, idx1)

    slot = slot0 + offs_t
    if RING:
        slot = slot % N
    row = (b * num_kv_heads + h).to(tl.int64) * N + slot
    _store_planes(idx0, idx1, codes_ptr + row * CB, valid, BLOCK_T, D, NB, BITS, W0, W1, VEC)
    norm = 1.0 / tl.sqrt(D * 1.0)  # hadamard_rows is unnormalized
    _store_scale(scales_ptr + row * NB, _times_pow2(s0 * norm, e), bad, valid, BF16_SCALES)
    if NB == 2:
        _store_scale(scales_ptr + row * NB + 1, _times_pow2(s1 * norm, e), bad, valid, BF16_SCALES)
    if COUNT:
        n_bad = tl.sum((bad & valid).to(tl.int32), axis=0)
        tl.atomic_add(count_ptr + b, n_bad, mask=n_bad > 0)


@triton.jit
def _quantize_append_kernel(
    k_ptr, v_ptr, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
    k_codes, k_scales, v_codes, v_scales,
    k_cb, k_bounds, k_grid, v_cb, v_bounds, v_grid, signs_ptr, had_ptr, key_shift_ptr, key_gain_ptr,
    seen_ptr, new_len_ptr, count_ptr, T, N, num_kv_heads,
    D: tl.constexpr, K_BITS: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr,
    V_BITS: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr,
    RULE: tl.constexpr, BLOCK_T: tl.constexpr, RING: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    K_VEC: tl.constexpr, V_VEC: tl.constexpr, KEY_XFORM: tl.constexpr, COUNT: tl.constexpr,
    BF16_SCALES: tl.constexpr,
):
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
    if tl.program_id(2) == 0:
        _encode_tile(k_ptr, sk_b, sk_h, sk_t, b, h, t0, n_new, first, slot0, N, num_kv_heads,
                     k_codes, k_scales, k_cb, k_bounds, k_grid, signs_ptr, had_ptr, key_shift_ptr, key_gain_ptr,
                     count_ptr, D, K_BITS, K_W0, K_W1, RULE, BLOCK_T, RING, K_VEC, KEY_XFORM, COUNT, BF16_SCALES)
    else:
        _encode_tile(v_ptr, sv_b, sv_h, sv_t, b, h, t0, n_new, first, slot0, N, num_kv_heads,
                     v_codes, v_scales, v_cb, v_bounds, v_grid, signs_ptr, had_ptr, key_shift_ptr, key_gain_ptr,
                     count_ptr, D, V_BITS, V_W0, V_W1, RULE, BLOCK_T, RING, V_VEC, False, COUNT, BF16_SCALES)


@lru_cache(maxsize=None)
def cell_tables(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centroids, boundaries + [inf], grid of boundary counts) float32/float32/int16 on `device`."""
    bounds = codebook.boundaries(bits, torch.float32)
    lo, size = GRID_LO.value, GRID_SIZE.value
    step = -2.0 * lo / size
    if float((bounds[1:] - bounds[:-1]).min()) <= step:
        raise AssertionError(f"grid step {step} is not finer than the {bits}-bit boundary spacing")
    edges = lo + step * torch.arange(size, dtype=torch.float32)
    grid = torch.searchsorted(bounds, edges).to(torch.int16)  # boundaries strictly below each edge
    padded = torch.cat([bounds, torch.tensor([float("inf")])])
    return codebook.device_centroids(bits, device, torch.float32), padded.to(device), grid.to(device)


def quantize_append_triton(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, codec: KVCodec,
                           new_lengths: torch.Tensor | None) -> None:
    """Write k, v [B, Hkv, T, D] into each sequence's next slots (layout.seen is not advanced here).

    k is in the model's domain: the kernel applies the key transform, if any."""
    check_kernel_head_dim("quantize_append", codec.head_dim)
    key_xform = layout.has_key_transform
    d = codec.head_dim
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
    grid = (triton.cdiv(t, plan.block_t), b * hkv, 2)
    bf16_scales = layout.k_scales.dtype == torch.bfloat16
    k_scales, v_scales = ((x.view(torch.int16) if bf16_scales else x) for x in (layout.k_scales, layout.v_scales))
    _quantize_append_kernel[grid](
        k, v, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        layout.k_codes, k_scales, layout.v_codes, v_scales,
        k_cb, k_bounds, k_grid, v_cb, v_bounds, v_grid, device_signs(d, dev), hadamard_tile(min(d, 256), dev),
        *(layout.key_shift, layout.key_gain) if key_xform else (k_cb, k_cb),
        layout.seen, new_lengths if new_lengths is not None else layout.seen,
        layout.nonfinite if layout.nonfinite is not None else layout.seen, t, layout.capacity, hkv,
        D=d, K_BITS=k_spec.bits, K_W0=k_spec.low_plane, K_W1=k_spec.high_plane,
        V_BITS=v_spec.bits, V_W0=v_spec.low_plane, V_W1=v_spec.high_plane,
        RULE=codec.scale_rule_id, BLOCK_T=plan.block_t, RING=layout.is_ring,
        HAS_LENGTHS=new_lengths is not None, K_VEC=k_spec.vector_bytes, V_VEC=v_spec.vector_bytes,
        KEY_XFORM=key_xform, COUNT=layout.nonfinite is not None, BF16_SCALES=bf16_scales, num_warps=plan.num_warps,
    )
