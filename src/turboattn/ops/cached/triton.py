"""Split-K attention over the compressed cache (decode and extend), and its reduce.

Main kernel, grid (splits [+1 for fresh k/v], B * Hkv, row blocks): each
program serves a whole GQA group (rows = Tq x G query heads), so every code
byte is read once per group.  Work stays in the rotated domain: scores are
(q_rot . centroids) * k_scale and values enter as (p * v_scale) . centroids,
so no dequantized copy exists anywhere.  Norm blocks line up with the two
halves of the head dim (D = 512: one block per half), which is why codes are
unpacked into a low and a high half.  Each program writes its partial output
(normalized) and log2-sum-exp; the reduce kernel merges the parts by LSE, adds
the sinks, rotates back (x = s * H y / sqrt(D)) and casts.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ...format import codebook
from ...format.key_transform import to_stored_queries
from ..triton_lib import (device_centroids, device_signs, hadamard_any, hadamard_tile, plane_pair,
                     rotate_on_device, row_vector_bytes)

LOG2E = 1.4426950408889634


@triton.jit
def _plane_values(row_ptr, coord, mask, W: tl.constexpr, P: tl.constexpr, OFFSET: tl.constexpr,
                  VEC: tl.constexpr):
    """Bits of one plane (width W, P bytes, starting OFFSET bytes into the row) for coordinates `coord`."""
    if W == 8:
        return tl.load(tl.max_contiguous(tl.multiple_of(row_ptr + OFFSET + coord, [1, VEC]), [1, VEC]), mask=mask, other=0).to(tl.int32)
    byte = tl.load(tl.max_contiguous(tl.multiple_of(row_ptr + OFFSET + coord % P, [1, VEC]), [1, VEC]), mask=mask, other=0).to(tl.int32)
    return (byte >> (W * (coord // P))) & ((1 << W) - 1)


@triton.jit
def _load_centroids(codes_ptr, rows, valid, cb_ptr, D: tl.constexpr, BITS: tl.constexpr,
                    W0: tl.constexpr, W1: tl.constexpr, VEC: tl.constexpr):
    """Centroid values (float16) of code rows `rows` [BLOCK_N] as two halves [BLOCK_N, D/2]."""
    HALF: tl.constexpr = D // 2
    CB: tl.constexpr = D * BITS // 8
    row_ptr = codes_ptr + rows[:, None].to(tl.int64) * CB
    offs = tl.arange(0, HALF)[None, :]
    mask = valid[:, None]
    if W0 == 4:
        # One byte load serves both halves: low nibble = coordinate c, high = c + D/2.
        byte = tl.load(tl.max_contiguous(tl.multiple_of(row_ptr + offs, [1, VEC]), [1, VEC]), mask=mask, other=0).to(tl.int32)
        idx_lo = byte & 15
        idx_hi = byte >> 4
    else:
        P0: tl.constexpr = D * W0 // 8
        idx_lo = _plane_values(row_ptr, offs, mask, W0, P0, 0, VEC)
        idx_hi = _plane_values(row_ptr, offs + HALF, mask, W0, P0, 0, VEC)
    if W1 > 0:
        P0b: tl.constexpr = D * W0 // 8
        P1: tl.constexpr = D * W1 // 8
        idx_lo = idx_lo | (_plane_values(row_ptr, offs, mask, W1, P1, P0b, VEC) << W0)
        idx_hi = idx_hi | (_plane_values(row_ptr, offs + HALF, mask, W1, P1, P0b, VEC) << W0)
    return tl.load(cb_ptr + idx_lo), tl.load(cb_ptr + idx_hi)


@triton.jit
def _load_centroids_lut4(codes_ptr, rows, valid, lut_asm: tl.constexpr, D: tl.constexpr):
    """4-bit fast path (GPU only): byte-permute lookups in registers instead of memory gathers."""
    HALF: tl.constexpr = D // 2
    row_ptr = codes_ptr + rows[:, None].to(tl.int64) * HALF
    byte = tl.load(tl.max_contiguous(tl.multiple_of(row_ptr + tl.arange(0, HALF)[None, :], [1, 16]), [1, 16]), mask=valid[:, None], other=0)
    return tl.inline_asm_elementwise(lut_asm, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=4)


@triton.jit
def _centroid_halves(codes_ptr, rows, valid, cb_ptr, D: tl.constexpr, BITS: tl.constexpr,
                     W0: tl.constexpr, W1: tl.constexpr, LUT_ASM: tl.constexpr, VEC: tl.constexpr):
    """LUT_ASM == "": gather from the table (any width, interpreter); else the register LUT."""
    if LUT_ASM == "":
        return _load_centroids(codes_ptr, rows, valid, cb_ptr, D, BITS, W0, W1, VEC)
    return _load_centroids_lut4(codes_ptr, rows, valid, LUT_ASM, D)


@triton.jit
def _rotate_halves(row_ptr, row_ok, signs_ptr, had_ptr, factor, D: tl.constexpr, PRE_ROTATED: tl.constexpr,
                   sub_ptr, mul_ptr, AFFINE: tl.constexpr, SUB: tl.constexpr):
    """Rows x [R, D] at row_ptr -> R x' * factor as float16 halves, R = H (s * .) / sqrt(D).

    x' = (x - sub) * mul with per-channel vectors [D] (the key transform) when AFFINE (sub only
    when SUB), else x' = x.  H_D = [[H, H], [H, -H]] with H = H_{D/2}: one butterfly, then two
    H_{D/2} products.  PRE_ROTATED: the host already stored R x' * factor (D = 512, see
    cached_attention_triton).
    """
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF)[None, :]
    x_lo = tl.load(row_ptr[:, None] + offs, mask=row_ok[:, None], other=0.0)
    x_hi = tl.load(row_ptr[:, None] + HALF + offs, mask=row_ok[:, None], other=0.0)
    if PRE_ROTATED:
        return x_lo.to(tl.float16), x_hi.to(tl.float16)
    x_lo = x_lo.to(tl.float32)
    x_hi = x_hi.to(tl.float32)
    if AFFINE:
        if SUB:
            x_lo = x_lo - tl.load(sub_ptr + offs)
            x_hi = x_hi - tl.load(sub_ptr + HALF + offs)
        x_lo = x_lo * tl.load(mul_ptr + offs)
        x_hi = x_hi * tl.load(mul_ptr + HALF + offs)
    x_lo = x_lo * tl.load(signs_ptr + offs)
    x_hi = x_hi * tl.load(signs_ptr + HALF + offs)
    factor = factor / tl.sqrt(D * 1.0)
    y_lo = hadamard_any(x_lo + x_hi, had_ptr, HALF) * factor
    y_hi = hadamard_any(x_lo - x_hi, had_ptr, HALF) * factor
    return y_lo.to(tl.float16), y_hi.to(tl.float16)


@triton.jit
def _group_rows(bh, row_block, num_kv_heads, Tq, G: tl.constexpr, BLOCK: tl.constexpr):
    """A program's rows of one GQA group: row r is query token r // G of query head kvh * G + r % G."""
    b = bh // num_kv_heads
    kvh = bh % num_kv_heads
    rows_total = Tq * G
    row = row_block * BLOCK + tl.arange(0, BLOCK)
    return b, kvh, rows_total, row, row < rows_total, row // G, row % G


@triton.jit
def _online_softmax(s, m, l):
    """One step of the streaming softmax in the log2 domain; rows with no finite score stay empty."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, m_new, alpha, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _finish_scores(s, SOFTCAP: tl.constexpr, softcap):
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly for large |x|.
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * 1.4426950408889634
    return s


@triton.jit
def _cached_attention_kernel(
    q_ptr, sq_b, sq_h, sq_t, k_codes, k_scales, v_codes, v_scales, k_cb, v_cb,
    kf_ptr, vf_ptr, sf_b, sf_h, sf_t, seen_ptr, starts_ptr, o_part, lse_part, signs_ptr, had_ptr,
    key_shift_ptr, key_gain_ptr, key_gain_inv_ptr,
    q_scale, softcap, Tq, N, window, num_kv_heads, num_splits,
    D: tl.constexpr, G: tl.constexpr, K_BITS: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr,
    V_BITS: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RING: tl.constexpr, HAS_FRESH: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, K_LUT: tl.constexpr, V_LUT: tl.constexpr,
    K_VEC: tl.constexpr, V_VEC: tl.constexpr, PRE_ROTATED: tl.constexpr,
    KEY_XFORM: tl.constexpr, KEY_SHIFT: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    NB: tl.constexpr = 2 if D == 512 else 1
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b, kvh, rows_total, row, row_ok, t, g = _group_rows(bh, tl.program_id(2), num_kv_heads, Tq, G, BLOCK_M)

    seen = tl.load(seen_ptr + b)
    start = tl.load(starts_ptr + b)
    if HAS_FRESH:
        qpos = seen + t
    else:
        qpos = seen - Tq + t

    offs_h = tl.arange(0, HALF)
    q_row = q_ptr + (b * sq_b + (kvh * G + g) * sq_h + t * sq_t)
    # Key transform (key_transform.py): scores are taken in the stored domain, q / gain against
    # (k - shift) * gain; a per-query constant apart from q . k, which softmax ignores.
    xf = (b * num_kv_heads + kvh) * D
    q_lo, q_hi = _rotate_halves(q_row, row_ok, signs_ptr, had_ptr, q_scale, D, PRE_ROTATED,
                                key_shift_ptr + xf, key_gain_inv_ptr + xf, KEY_XFORM, False)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    qpos_max = tl.max(tl.where(row_ok, qpos, 0))

    if split < num_splits:
        held = tl.minimum(seen, N)
        chunk = tl.cdiv(tl.cdiv(held, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, held)
        if not RING:
            hi = tl.minimum(hi, qpos_max + 1)
        cache_row0 = (b * num_kv_heads + kvh).to(tl.int64) * N
        for n0 in range(lo, hi, BLOCK_N):
            slot = n0 + offs_n
            valid = slot < hi
            if RING:
                pos = slot + N * ((seen - 1 - slot) // N)
            else:
                pos = slot
            rows = cache_row0 + slot
            k_lo, k_hi = _centroid_halves(k_codes, rows, valid, k_cb, D, K_BITS, K_W0, K_W1, K_LUT, K_VEC)
            if NB == 1:
                ks = tl.load(k_scales + rows, mask=valid, other=0.0)
                s = tl.dot(q_lo, tl.trans(k_lo))
                s = tl.dot(q_hi, tl.trans(k_hi), acc=s) * ks[None, :]
            else:
                ks0 = tl.load(k_scales + rows * 2, mask=valid, other=0.0)
                ks1 = tl.load(k_scales + rows * 2 + 1, mask=valid, other=0.0)
                s = tl.dot(q_lo, tl.trans(k_lo)) * ks0[None, :] + tl.dot(q_hi, tl.trans(k_hi)) * ks1[None, :]
            s = _finish_scores(s, SOFTCAP, softcap)
            keep = valid[None, :] & (pos[None, :] >= start) & (pos[None, :] <= qpos[:, None]) & row_ok[:, None]
            if HAS_WINDOW:
                keep = keep & (qpos[:, None] - pos[None, :] < window)
            s = tl.where(keep, s, float("-inf"))
            p, m, alpha, l = _online_softmax(s, m, l)
            v_lo, v_hi = _centroid_halves(v_codes, rows, valid, v_cb, D, V_BITS, V_W0, V_W1, V_LUT, V_VEC)
            if NB == 1:
                vs = tl.load(v_scales + rows, mask=valid, other=0.0)
                pv = (p * vs[None, :]).to(tl.float16)
                acc_lo = tl.dot(pv, v_lo, acc=acc_lo * alpha[:, None])
                acc_hi = tl.dot(pv, v_hi, acc=acc_hi * alpha[:, None])
            else:
                vs0 = tl.load(v_scales + rows * 2, mask=valid, other=0.0)
                vs1 = tl.load(v_scales + rows * 2 + 1, mask=valid, other=0.0)
                acc_lo = tl.dot((p * vs0[None, :]).to(tl.float16), v_lo, acc=acc_lo * alpha[:, None])
                acc_hi = tl.dot((p * vs1[None, :]).to(tl.float16), v_hi, acc=acc_hi * alpha[:, None])
    else:
        # Fresh full-precision keys (rotated on the host) at positions seen + j, causal among themselves.
        t_max = tl.minimum((tl.program_id(2) * BLOCK_M + BLOCK_M - 1) // G, Tq - 1)
        fresh_base = b * sf_b + kvh * sf_h
        for n0 in range(0, t_max + 1, BLOCK_N):
            j = n0 + offs_n
            valid = j <= t_max
            k_lo, k_hi = _rotate_halves(kf_ptr + fresh_base + j * sf_t, valid, signs_ptr, had_ptr, 1.0, D, PRE_ROTATED,
                                        key_shift_ptr + xf, key_gain_ptr + xf, KEY_XFORM, KEY_SHIFT)
            s = tl.dot(q_lo, tl.trans(k_lo))
            s = tl.dot(q_hi, tl.trans(k_hi), acc=s)
            s = _finish_scores(s, SOFTCAP, softcap)
            pos = seen + j
            keep = valid[None, :] & (pos[None, :] >= start) & (j[None, :] <= t[:, None]) & row_ok[:, None]
            if HAS_WINDOW:
                keep = keep & (qpos[:, None] - pos[None, :] < window)
            s = tl.where(keep, s, float("-inf"))
            p, m, alpha, l = _online_softmax(s, m, l)
            v_lo, v_hi = _rotate_halves(vf_ptr + fresh_base + j * sf_t, valid, signs_ptr, had_ptr, 1.0, D, PRE_ROTATED,
                                        key_shift_ptr, key_gain_ptr, False, False)
            pv = p.to(tl.float16)
            acc_lo = tl.dot(pv, v_lo, acc=acc_lo * alpha[:, None])
            acc_hi = tl.dot(pv, v_hi, acc=acc_hi * alpha[:, None])

    inv = tl.where(l > 0, 1.0 / l, 0.0)
    lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    part = (bh * tl.num_programs(0) + split).to(tl.int64) * rows_total + row
    tl.store(lse_part + part, lse, mask=row_ok)
    o_ptr = o_part + part[:, None] * D + offs_h[None, :]
    tl.store(o_ptr, acc_lo * inv[:, None], mask=row_ok[:, None])
    tl.store(o_ptr + HALF, acc_hi * inv[:, None], mask=row_ok[:, None])


@triton.jit
def _merge_reduce_kernel(
    o_part, lse_part, sinks_ptr, signs_ptr, had_ptr, out_ptr, Tq, num_kv_heads, num_parts,
    D: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    bh = tl.program_id(0)
    b, kvh, rows_total, row, row_ok, t, g = _group_rows(bh, tl.program_id(1), num_kv_heads, Tq, G, BLOCK_R)
    head = kvh * G + g
    offs_h = tl.arange(0, HALF)

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    if HAS_SINKS:
        m = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    for part in range(num_parts):
        idx = (bh * num_parts + part).to(tl.int64) * rows_total + row
        m = tl.maximum(m, tl.load(lse_part + idx, mask=row_ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_R], tl.float32)
    if HAS_SINKS:
        denom = tl.exp2(tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * 1.4426950408889634 - m_use)
    y_lo = tl.zeros([BLOCK_R, HALF], tl.float32)
    y_hi = tl.zeros([BLOCK_R, HALF], tl.float32)
    for part in range(num_parts):
        idx = (bh * num_parts + part).to(tl.int64) * rows_total + row
        w = tl.exp2(tl.load(lse_part + idx, mask=row_ok, other=float("-inf")) - m_use)
        denom += w
        ptr = o_part + idx[:, None] * D + offs_h[None, :]
        y_lo += w[:, None] * tl.load(ptr, mask=row_ok[:, None], other=0.0)
        y_hi += w[:, None] * tl.load(ptr + HALF, mask=row_ok[:, None], other=0.0)
    inv = tl.where(denom > 0, 1.0 / denom, 0.0)
    y_lo = y_lo * inv[:, None]
    y_hi = y_hi * inv[:, None]

    # Rotate back: x = s * (H y) / sqrt(D), with H_D = [[H, H], [H, -H]] for H = H_{D/2}.
    x_lo = hadamard_any(y_lo + y_hi, had_ptr, HALF)
    x_hi = hadamard_any(y_lo - y_hi, had_ptr, HALF)
    norm = 1.0 / tl.sqrt(D * 1.0)
    x_lo = x_lo * tl.load(signs_ptr + offs_h)[None, :] * norm
    x_hi = x_hi * tl.load(signs_ptr + HALF + offs_h)[None, :] * norm
    out_row = out_ptr + ((b * num_kv_heads * G + head).to(tl.int64) * Tq + t) * D
    o_ptr = out_row[:, None] + offs_h[None, :]
    tl.store(o_ptr, x_lo.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(o_ptr + HALF, x_hi.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _lut4_asm(table: list[float]) -> str:
    """PTX mapping 4 packed code bytes (low nibble: coordinate c, high: c + D/2) to 8 float16 centroids.

    Each nibble i selects a byte from two 8-entry byte tables (prmt picks from 8
    bytes with a 3-bit selector): entries 0-7 with selector i, entries 8-15 with
    i ^ 8.  prmt's sign-replicate mode (selector bit 3) fills the wrong table's
    pick with junk, so a full-byte mask (0xFF where i < 8) chooses between them;
    the mask itself comes from prmt on a 0x7F table, whose replicate byte is 0.
    """
    bits = torch.tensor(table, dtype=torch.float16).view(torch.int16).tolist()
    lo = [b & 0xFF for b in bits]
    hi = [(b >> 8) & 0xFF for b in bits]

    def word(bytes4):
        return "0x%08X" % sum(v << (8 * k) for k, v in enumerate(bytes4))

    tables = {"al0": word(lo[0:4]), "al1": word(lo[4:8]), "bl0": word(lo[8:12]), "bl1": word(lo[12:16]),
              "ah0": word(hi[0:4]), "ah1": word(hi[4:8]), "bh0": word(hi[8:12]), "bh1": word(hi[12:16])}
    lines = ["{", ".reg .b32 n, t, s, s8, m, f, al, bl, ah, bh, l, h, c7;"]
    lines += [f".reg .b32 {name};" for name in tables]
    lines += [f"mov.b32 {name}, {value};" for name, value in tables.items()]
    lines.append("mov.b32 c7, 0x7F7F7F7F;")
    for half, (out0, out1) in enumerate((("$0", "$1"), ("$2", "$3"))):
        # Nibbles of the 4 bytes -> 4 selector nibbles, in element order 0, 2, 1, 3.
        lines.append("and.b32 n, $4, 0x0F0F0F0F;" if half == 0 else "shr.b32 n, $4, 4;\nand.b32 n, n, 0x0F0F0F0F;")
        lines += ["shr.b32 t, n, 12;", "or.b32 s, n, t;", "xor.b32 s8, s, 0x8888;",
                  "prmt.b32 m, c7, c7, s;", "shl.b32 t, m, 1;", "or.b32 f, m, t;",
                  "prmt.b32 al, al0, al1, s;", "prmt.b32 bl, bl0, bl1, s8;",
                  "prmt.b32 ah, ah0, ah1, s;", "prmt.b32 bh, bh0, bh1, s8;",
                  "lop3.b32 l, al, bl, f, 0xE4;", "lop3.b32 h, ah, bh, f, 0xE4;",
                  f"prmt.b32 {out0}, l, h, 0x6240;", f"prmt.b32 {out1}, l, h, 0x7351;"]
    lines.append("}")
    return "\n".join(lines)


def lut_asm(bits: int, device: torch.device) -> str:
    """The register-LUT lookup for 4-bit codes on CUDA; "" selects the gather path (other widths, interpreter)."""
    if bits != 4 or device.type != "cuda" or os.environ.get("TURBOATTN_LOOKUP") == "gather":
        return ""
    return _lut4_asm_for_codebook()


@lru_cache(maxsize=None)
def _lut4_asm_for_codebook() -> str:
    return _lut4_asm(codebook.centroids(4, torch.float64).tolist())


def decode_config(d: int) -> dict:
    """Tile and launch parameters; TURBOATTN_DECODE_CONFIG="BLOCK_N,num_warps,num_stages" overrides (benchmarks)."""
    forced = os.environ.get("TURBOATTN_DECODE_CONFIG")
    if forced:
        values = [int(x) for x in forced.split(",")]
        config = dict(zip(("BLOCK_N", "num_warps", "num_stages", "maxnreg"), values))
        return config
    if d == 512:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


# The kernel is latency-bound with 2 programs resident per SM (255 registers); more, shorter
# splits measured faster at B=8 (402 -> 334 us at 8 per SM), until splits get too short (B=1).
PROGRAMS_PER_SM = 8
MIN_KEYS_PER_SPLIT = 1024


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(device, programs: int, max_tokens: int, block_n: int) -> int:
    """Splits so that every SM gets several programs (latency hiding), each split >= 1024 keys.

    TURBOATTN_PROGRAMS_PER_SM overrides the programs-per-SM target (benchmarks).
    """
    per_sm = int(os.environ.get("TURBOATTN_PROGRAMS_PER_SM", str(PROGRAMS_PER_SM)))
    want = max(1, -(-per_sm * _sm_count(device) // max(programs, 1)))
    most = max(1, max_tokens // max(MIN_KEYS_PER_SPLIT, 4 * block_n))
    return min(want, most)


def cached_attention_triton(q, cache, k=None, v=None, scale=None, softcap=None, sinks=None,
                            num_splits=None) -> torch.Tensor:
    codec = cache.codec
    b, hq, tq, d = q.shape
    hkv = cache.num_kv_heads
    group = hq // hkv
    dev = q.device
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    # The softmax runs in base 2: fold log2(e) into q unless softcap needs the raw scores.
    q_scale = scale if softcap is not None else scale * LOG2E
    has_fresh = k is not None
    out_dtype = q.dtype  # q may be replaced by its rotated float16 copy below
    # D = 512 rotates on the host: the in-kernel path for it (an H_256 split into H_128
    # halves) gave wrong results on the GPU with 64-row query tiles, not yet understood.
    pre_rotated = d == 512
    key_xform = cache.key_gain is not None
    if pre_rotated:
        if key_xform:  # the host rotates, so it applies the key transform too
            q = to_stored_queries(q.to(torch.float32), cache.key_gain)
            k = None if k is None else cache.stored_keys(k)
            key_xform = False
        q = (rotate_on_device(q.to(torch.float32)) * q_scale).to(torch.float16)
        if has_fresh:
            k = rotate_on_device(k.to(torch.float32)).to(torch.float16)
            v = rotate_on_device(v.to(torch.float32)).to(torch.float16)
    if q.stride(3) != 1:
        q = q.contiguous()
    if has_fresh:
        # k and v share strides so that the kernel takes one set.
        k = k.contiguous()
        v = v.contiguous()
    kf, vf = (k, v) if has_fresh else (q, q)  # unused without fresh tokens

    rows = tq * group
    block_m = 16 if rows <= 16 else 64
    row_blocks = triton.cdiv(rows, block_m)
    config = decode_config(d)
    block_n = config["BLOCK_N"]
    held = min(cache.max_seen, cache.capacity)
    if num_splits is None:
        num_splits = choose_num_splits(dev, b * hkv * row_blocks, held, block_n)
    parts = num_splits + int(has_fresh)
    o_part = torch.empty(b * hkv * parts * rows * d, dtype=torch.float32, device=dev)
    lse_part = torch.empty(b * hkv * parts * rows, dtype=torch.float32, device=dev)
    k_cb = device_centroids(codec.k_bits, dev, torch.float16)
    v_cb = device_centroids(codec.v_bits, dev, torch.float16)
    kw0, kw1 = plane_pair(codec.k_bits)
    vw0, vw1 = plane_pair(codec.v_bits)
    window = cache.sliding_window or 0
    k_lut, v_lut = lut_asm(codec.k_bits, dev), lut_asm(codec.v_bits, dev)
    if d == 64 and block_m == 64 and bool(k_lut) != bool(v_lut):
        # Triton 3.6 miscompiles this mix (one side through the asm LUT, the other through the
        # gather) at D = 64 with 64-row tiles: illegal shared-memory reads or NaN on an H200
        # (BENCHMARKS.md).  Both sides gather instead: slower, correct.
        k_lut = v_lut = ""
    _cached_attention_kernel[(parts, b * hkv, row_blocks)](
        q, q.stride(0), q.stride(1), q.stride(2), cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales,
        k_cb, v_cb, kf, vf, kf.stride(0), kf.stride(1), kf.stride(2), cache.seen, cache.starts, o_part, lse_part,
        device_signs(d, dev), hadamard_tile(d // 2, dev),
        *(cache.key_shift, cache.key_gain, cache.key_gain_inv) if key_xform else (o_part,) * 3,
        float(q_scale), float(softcap or 0.0), tq, cache.capacity, window, hkv, num_splits,
        D=d, G=group, K_BITS=codec.k_bits, K_W0=kw0, K_W1=kw1, V_BITS=codec.v_bits, V_W0=vw0, V_W1=vw1,
        BLOCK_M=block_m, BLOCK_N=block_n, RING=cache.is_ring, HAS_FRESH=has_fresh,
        HAS_WINDOW=window > 0, SOFTCAP=softcap is not None,
        K_LUT=k_lut, V_LUT=v_lut,
        K_VEC=row_vector_bytes(codec.code_bytes("k")), V_VEC=row_vector_bytes(codec.code_bytes("v")),
        PRE_ROTATED=pre_rotated, KEY_XFORM=key_xform, KEY_SHIFT=key_xform and cache.has_key_shift,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
        **({"maxnreg": config["maxnreg"]} if "maxnreg" in config else {}),
    )
    out = torch.empty(b, hq, tq, d, dtype=out_dtype, device=dev)
    block_r = 16
    _merge_reduce_kernel[(b * hkv, triton.cdiv(rows, block_r))](
        o_part, lse_part, sinks if sinks is not None else lse_part, device_signs(d, dev),
        hadamard_tile(d // 2, dev), out, tq, hkv, parts,
        D=d, G=group, BLOCK_R=block_r, HAS_SINKS=sinks is not None, num_warps=4,
    )
    return out
