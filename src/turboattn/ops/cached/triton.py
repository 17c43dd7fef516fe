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

Non-finite keys (naive.py's rule): a slot whose V scale is NaN gets a NaN
score and a zero V scale, a fresh k/v row holding a NaN or infinity gets a
NaN score and a zero value row; the position masks then turn the NaN into
-inf for every query that does not see the key, and into a NaN output row for
every query that does.

Exact recent window (layout.exact_recent = R > 0): the split programs skip
positions >= seen - R, and the extra program (split index num_splits, which
also serves fresh k/v) first attends the window's rows (positions
seen - R .. seen - 1, in the model's domain like fresh k/v), then the fresh
tokens, through one helper (`_attend_exact`).

Exact first tokens (layout.exact_first = S > 0, contiguous caches only): the
split programs skip positions < starts + S, and the extra program attends the
rows of first_k / first_v (position starts + j in row j, visible once
starts + j < seen) before the window, whose rows below starts + S it skips
(the first-token rows win), then the fresh tokens.

Keys in channel groups (codec.key_groups, GROUPED): the host hands the kernel q and the exact rows' keys
already in the groups' domain (key transform and channel order applied, each group rotated by its own
rotation, q_scale folded into q; `grouped_key_rows`), so the kernel scores a tile as
(q_a . c_a) * s_a + (q_b . c_b) * s_b over each group's centroids, gathered coordinate by coordinate from
the group's planes (each group's columns padded to a power of two, zeros in q).  Values, the merge and
everything else are as without groups.

Head dims that are not powers of two (D = P * m, m odd): each half is held in
the padded layout (triton_lib.padded_factor: next_power_of_2(D / 2) columns,
half-coordinate p * m + r in column p * next_power_of_2(m) + r, zeros in the
rest), so the rotation H_P ⊗ Q_m keeps the butterfly into halves and runs as
triton_lib.kron_rows on each; code bytes, signs and rows are read through the
column -> coordinate map, and the parts (o_part) are stored padded, which the
merge reads back before rotating and storing the real columns.  M = 1 (powers
of two) compiles to the plain layout's code.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ...format.codebook import device_centroids
from ...format.codec import KVCodec
from ...format.key_transform import to_stored_keys, to_stored_queries
from ...format.layout import CacheLayout
from ...format.rotation import device_signs, rotate, rotation_matrix
from ..triton_lib import (LOG2E, finish_split, hadamard_tile, key_transform_rows, kron_rows, kron_tile,
                          load_padded_vector, merge_splits, online_softmax, padded_columns, padded_factor,
                          padded_mask, tanh)
from ..launch import cdiv, next_power_of_2
from .config import DecodePlan, check_kernel_head_dim, plan_decode
from .lut import lut4_asm


@triton.jit
def _load_bytes(ptrs, mask, VEC: tl.constexpr, M: tl.constexpr):
    """Code bytes at ptrs: aligned, contiguous runs of VEC in the plain layout (M == 1); gathers through the
    padded layout's map otherwise."""
    if M == 1:
        x = tl.load(tl.max_contiguous(tl.multiple_of(ptrs, [1, VEC]), [1, VEC]), mask=mask, other=0)
    else:
        x = tl.load(ptrs, mask=mask, other=0)
    return x


@triton.jit
def _plane_values(row_ptr, coord, mask, W: tl.constexpr, P: tl.constexpr, OFFSET: tl.constexpr,
                  VEC: tl.constexpr, M: tl.constexpr):
    """Bits of one plane (width W, P bytes, starting OFFSET bytes into the row) for coordinates `coord`."""
    if W == 8:
        bits = _load_bytes(row_ptr + OFFSET + coord, mask, VEC, M).to(tl.int32)
    else:
        byte = _load_bytes(row_ptr + OFFSET + coord % P, mask, VEC, M).to(tl.int32)
        bits = (byte >> (W * (coord // P))) & ((1 << W) - 1)
    return bits


@triton.jit
def _load_centroids(codes_ptr, rows, valid, cb_ptr, D: tl.constexpr, BITS: tl.constexpr,
                    W0: tl.constexpr, W1: tl.constexpr, VEC: tl.constexpr, M: tl.constexpr, MP: tl.constexpr):
    """Centroid values (float16) of code rows `rows` [BLOCK_N] as two halves [BLOCK_N, HP] (HP = D/2 columns,
    the padded layout's when M > 1: its padded columns get centroid 0's value, which meets only zeros of q and
    columns the merge drops)."""
    HALF: tl.constexpr = D // 2
    HP: tl.constexpr = HALF // M * MP
    CB: tl.constexpr = D * BITS // 8
    row_ptr = codes_ptr + rows[:, None].to(tl.int64) * CB
    coord, cols_ok = padded_columns(HP, M, MP)
    offs = coord[None, :]
    mask = padded_mask(valid, cols_ok, M)
    if W0 == 4:
        # One byte load serves both halves: low nibble = coordinate c, high = c + D/2.
        byte = _load_bytes(row_ptr + offs, mask, VEC, M).to(tl.int32)
        idx_lo = byte & 15
        idx_hi = byte >> 4
    else:
        P0: tl.constexpr = D * W0 // 8
        idx_lo = _plane_values(row_ptr, offs, mask, W0, P0, 0, VEC, M)
        idx_hi = _plane_values(row_ptr, offs + HALF, mask, W0, P0, 0, VEC, M)
    if W1 > 0:
        P0b: tl.constexpr = D * W0 // 8
        P1: tl.constexpr = D * W1 // 8
        idx_lo = idx_lo | (_plane_values(row_ptr, offs, mask, W1, P1, P0b, VEC, M) << W0)
        idx_hi = idx_hi | (_plane_values(row_ptr, offs + HALF, mask, W1, P1, P0b, VEC, M) << W0)
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
                     W0: tl.constexpr, W1: tl.constexpr, LUT_ASM: tl.constexpr, VEC: tl.constexpr,
                     M: tl.constexpr, MP: tl.constexpr):
    """LUT_ASM == "": gather from the table (any width, interpreter, padded layouts); else the register LUT."""
    if LUT_ASM == "":
        lo, hi = _load_centroids(codes_ptr, rows, valid, cb_ptr, D, BITS, W0, W1, VEC, M, MP)
    else:
        lo, hi = _load_centroids_lut4(codes_ptr, rows, valid, LUT_ASM, D)
    return lo, hi


@triton.jit
def _group_columns(row_ptr, row_ok, LO: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Columns LO .. LO + W - 1 of the rows at row_ptr [R] as a tile [R, WP] (zeros past W): one key group of
    rows the host prepared (grouped_key_rows)."""
    c = tl.arange(0, WP)
    return tl.load(row_ptr[:, None] + LO + c[None, :], mask=row_ok[:, None] & (c < W)[None, :], other=0.0)


@triton.jit
def _group_centroids(codes_ptr, rows, valid, cb_ptr, ROW_BYTES: tl.constexpr, OFFSET: tl.constexpr,
                     W: tl.constexpr, WP: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """Centroid values (float16) [BLOCK_N, WP] of one key group: W coordinates coded in planes of W0 (and W1)
    bits from byte OFFSET of each row of ROW_BYTES; the columns past W get centroid 0's value, which meets
    only q's zeros."""
    row_ptr = codes_ptr + rows[:, None].to(tl.int64) * ROW_BYTES + OFFSET
    coord = tl.arange(0, WP)[None, :]
    mask = valid[:, None] & (coord < W)
    P0: tl.constexpr = W * W0 // 8
    idx = _plane_values(row_ptr, coord, mask, W0, P0, 0, 1, 2)   # VEC 1, M 2: masked gathers
    if W1 > 0:
        P1: tl.constexpr = W * W1 // 8
        idx = idx | (_plane_values(row_ptr, coord, mask, W1, P1, P0, 1, 2) << W0)
    return tl.load(cb_ptr + idx)


@triton.jit
def _rotate_halves(row_ptr, row_ok, signs_ptr, had_ptr, kron_ptr, factor, D: tl.constexpr,
                   PRE_ROTATED: tl.constexpr, sub_ptr, mul_ptr, AFFINE: tl.constexpr, SUB: tl.constexpr,
                   M: tl.constexpr, MP: tl.constexpr):
    """Rows x [R, D] at row_ptr -> R x' * factor as float16 halves, R = (H_P ⊗ Q_M) (s * .) / sqrt(P).

    x' = (x - sub) * mul with per-channel vectors [D] (the key transform) when AFFINE (sub only
    when SUB), else x' = x.  H_P ⊗ Q = [[H, H], [H, -H]] with H = H_{P/2} ⊗ Q: one butterfly, then
    two half-size products (kron_rows; H_{D/2} for M == 1).  PRE_ROTATED: the host already stored
    R x' * factor (D > 256, see launch_parts).  M > 1: the halves come back in the padded layout.
    """
    HALF: tl.constexpr = D // 2
    HP: tl.constexpr = HALF // M * MP
    coord, cols_ok = padded_columns(HP, M, MP)
    offs = coord[None, :]
    mask = padded_mask(row_ok, cols_ok, M)
    x_lo = tl.load(row_ptr[:, None] + offs, mask=mask, other=0.0)
    x_hi = tl.load(row_ptr[:, None] + HALF + offs, mask=mask, other=0.0)
    if PRE_ROTATED:
        y_lo, y_hi = x_lo, x_hi
    else:
        x_lo = x_lo.to(tl.float32)
        x_hi = x_hi.to(tl.float32)
        if AFFINE:
            if M == 1:
                x_lo = key_transform_rows(x_lo, sub_ptr, mul_ptr, offs, SUB)
                x_hi = key_transform_rows(x_hi, sub_ptr, mul_ptr, HALF + offs, SUB)
            else:
                if SUB:
                    x_lo = x_lo - load_padded_vector(sub_ptr, offs, cols_ok, M)
                    x_hi = x_hi - load_padded_vector(sub_ptr + HALF, offs, cols_ok, M)
                x_lo = x_lo * load_padded_vector(mul_ptr, offs, cols_ok, M)
                x_hi = x_hi * load_padded_vector(mul_ptr + HALF, offs, cols_ok, M)
        x_lo = x_lo * load_padded_vector(signs_ptr, offs, cols_ok, M)
        x_hi = x_hi * load_padded_vector(signs_ptr + HALF, offs, cols_ok, M)
        factor = factor / tl.sqrt((D // M) * 1.0)
        y_lo = kron_rows(x_lo + x_hi, had_ptr, kron_ptr, HP, M, MP) * factor
        y_hi = kron_rows(x_lo - x_hi, had_ptr, kron_ptr, HP, M, MP) * factor
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
def _nonfinite_rows(lo, hi):
    """Rows [N] of the halves lo, hi [N, D/2] that hold a NaN or an infinity."""
    ok = (tl.abs(lo) < float("inf")).to(tl.int32)
    ok_hi = (tl.abs(hi) < float("inf")).to(tl.int32)
    return tl.minimum(tl.min(ok, axis=1), tl.min(ok_hi, axis=1)) == 0


@triton.jit
def _finish_scores(s, SOFTCAP: tl.constexpr, softcap):
    """Scores (already scaled, natural units when SOFTCAP) -> log2-domain logits, softcapped if asked."""
    if SOFTCAP:
        s = softcap * tanh(s / softcap) * LOG2E
    return s


@triton.jit
def _attend_exact(k_rows, v_rows, valid, pos, qpos, start, row_ok, window, q_lo, q_hi, m, l, acc_lo, acc_hi,
                  signs_ptr, had_ptr, kron_ptr, key_sub_ptr, key_mul_ptr, softcap, D: tl.constexpr,
                  PRE_ROTATED: tl.constexpr, KEY_XFORM: tl.constexpr, KEY_SHIFT: tl.constexpr, SOFTCAP: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, GROUPED: tl.constexpr,
                  KA_D: tl.constexpr, KA_DP: tl.constexpr, KB_D: tl.constexpr, KB_DP: tl.constexpr):
    """One tile of full-precision keys (fresh k/v or the exact window) at row pointers k_rows, v_rows
    [BLOCK_N] and positions pos: rotated (and key-transformed) here unless PRE_ROTATED, then an online
    softmax step.  A key is seen by query row i when valid, pos >= start, pos <= qpos[i] and, with a
    window, qpos[i] - pos < window.  GROUPED: the key rows are in the groups' domain already, and q_lo, q_hi
    are the two groups' q."""
    if GROUPED:
        k_lo = _group_columns(k_rows, valid, 0, KA_D, KA_DP)
        k_hi = _group_columns(k_rows, valid, KA_D, KB_D, KB_DP)
    else:
        k_lo, k_hi = _rotate_halves(k_rows, valid, signs_ptr, had_ptr, kron_ptr, 1.0, D, PRE_ROTATED,
                                    key_sub_ptr, key_mul_ptr, KEY_XFORM, KEY_SHIFT, M, MP)
    v_lo, v_hi = _rotate_halves(v_rows, valid, signs_ptr, had_ptr, kron_ptr, 1.0, D, PRE_ROTATED,
                                key_sub_ptr, key_mul_ptr, False, False, M, MP)
    # A non-finite k or v row: NaN score (for the queries that see it), zero value row (for the rest).
    bad = _nonfinite_rows(k_lo, k_hi) | _nonfinite_rows(v_lo, v_hi)
    v_lo = tl.where(bad[:, None], 0.0, v_lo)
    v_hi = tl.where(bad[:, None], 0.0, v_hi)
    s = tl.dot(q_lo, tl.trans(k_lo))
    s = tl.dot(q_hi, tl.trans(k_hi), acc=s)
    s = tl.where(bad[None, :], float("nan"), _finish_scores(s, SOFTCAP, softcap))
    keep = valid[None, :] & (pos[None, :] >= start) & (pos[None, :] <= qpos[:, None]) & row_ok[:, None]
    if HAS_WINDOW:
        keep = keep & (qpos[:, None] - pos[None, :] < window)
    s = tl.where(keep, s, float("-inf"))
    p, m, alpha, l = online_softmax(s, m, l, True)
    pv = p.to(tl.float16)
    acc_lo = tl.dot(pv, v_lo, acc=acc_lo * alpha[:, None])
    acc_hi = tl.dot(pv, v_hi, acc=acc_hi * alpha[:, None])
    return m, l, acc_lo, acc_hi


@triton.jit
def _cached_attention_kernel(
    q_ptr, sq_b, sq_h, sq_t, k_codes, k_scales, v_codes, v_scales, k_cb, v_cb,
    kf_ptr, vf_ptr, sf_b, sf_h, sf_t, seen_ptr, starts_ptr, o_part, lse_part, signs_ptr, had_ptr, kron_ptr,
    key_shift_ptr, key_gain_ptr, key_gain_inv_ptr, rk_ptr, rv_ptr, sr_b, sr_h, sr_t, exact_recent,
    fk_ptr, fv_ptr, si_b, si_h, si_t, exact_first,
    q_scale, softcap, Tq, N, window, num_kv_heads, num_splits, num_parts,
    D: tl.constexpr, G: tl.constexpr, K_BITS: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr,
    V_BITS: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RING: tl.constexpr, HAS_FRESH: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, K_LUT: tl.constexpr, V_LUT: tl.constexpr,
    K_VEC: tl.constexpr, V_VEC: tl.constexpr, PRE_ROTATED: tl.constexpr,
    KEY_XFORM: tl.constexpr, KEY_SHIFT: tl.constexpr, EXACT: tl.constexpr, FIRST: tl.constexpr,
    M: tl.constexpr, MP: tl.constexpr, ka_cb, kb_cb, GROUPED: tl.constexpr, K_ROW: tl.constexpr,
    KA_D: tl.constexpr, KA_DP: tl.constexpr, KA_W0: tl.constexpr, KA_W1: tl.constexpr,
    KB_D: tl.constexpr, KB_DP: tl.constexpr, KB_W0: tl.constexpr, KB_W1: tl.constexpr,
):
    HP: tl.constexpr = D // 2 // M * MP   # a half's columns (D / 2 for M == 1)
    NB: tl.constexpr = 2 if D > 256 else 1   # norm blocks: the halves above 256 coordinates
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b, kvh, rows_total, row, row_ok, t, g = _group_rows(bh, tl.program_id(2), num_kv_heads, Tq, G, BLOCK_M)

    seen = tl.load(seen_ptr + b)
    start = tl.load(starts_ptr + b)
    if HAS_FRESH:
        qpos = seen + t
    else:
        qpos = seen - Tq + t

    offs_h = tl.arange(0, HP)
    q_row = q_ptr + (b * sq_b + (kvh * G + g) * sq_h + t * sq_t)
    # Key transform (key_transform.py): scores are taken in the stored domain, q / gain against
    # (k - shift) * gain; a per-query constant apart from q . k, which softmax ignores.
    xf = (b * num_kv_heads + kvh) * D
    if GROUPED:   # the two key groups' q, prepared by the host (grouped_key_rows)
        q_lo = _group_columns(q_row, row_ok, 0, KA_D, KA_DP)
        q_hi = _group_columns(q_row, row_ok, KA_D, KB_D, KB_DP)
    else:
        q_lo, q_hi = _rotate_halves(q_row, row_ok, signs_ptr, had_ptr, kron_ptr, q_scale, D, PRE_ROTATED,
                                    key_shift_ptr + xf, key_gain_inv_ptr + xf, KEY_XFORM, False, M, MP)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HP], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HP], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    qpos_max = tl.max(tl.where(row_ok, qpos, 0))

    if split < num_splits:
        held = tl.minimum(seen, N)
        chunk = tl.cdiv(tl.cdiv(held, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, held)
        if not RING:
            hi = tl.minimum(hi, qpos_max + 1)
            if EXACT:
                hi = tl.minimum(hi, seen - exact_recent)   # the window's positions are read exactly
            if FIRST:
                lo = tl.maximum(lo, start + exact_first)   # so are the first tokens'
        cache_row0 = (b * num_kv_heads + kvh).to(tl.int64) * N
        for n0 in range(lo, hi, BLOCK_N):
            slot = n0 + offs_n
            valid = slot < hi
            if RING:
                pos = slot + N * ((seen - 1 - slot) // N)
            else:
                pos = slot
            rows = cache_row0 + slot
            if GROUPED:
                k_lo = _group_centroids(k_codes, rows, valid, ka_cb, K_ROW, 0, KA_D, KA_DP, KA_W0, KA_W1)
                k_hi = _group_centroids(k_codes, rows, valid, kb_cb, K_ROW, KA_D * (KA_W0 + KA_W1) // 8, KB_D, KB_DP,
                                        KB_W0, KB_W1)
                ks_a = tl.load(k_scales + rows * 2, mask=valid, other=0.0).to(tl.float32)
                ks_b = tl.load(k_scales + rows * 2 + 1, mask=valid, other=0.0).to(tl.float32)
                s = tl.dot(q_lo, tl.trans(k_lo)) * ks_a[None, :] + tl.dot(q_hi, tl.trans(k_hi)) * ks_b[None, :]
                # A non-finite value: a NaN score, as below.
                if NB == 1:
                    vs = tl.load(v_scales + rows, mask=valid, other=0.0).to(tl.float32)
                    s = tl.where((vs == vs)[None, :], s, float("nan"))
                    vs = tl.where(vs == vs, vs, 0.0)
                else:
                    vs0 = tl.load(v_scales + rows * 2, mask=valid, other=0.0).to(tl.float32)
                    vs1 = tl.load(v_scales + rows * 2 + 1, mask=valid, other=0.0).to(tl.float32)
                    s = tl.where(((vs0 == vs0) & (vs1 == vs1))[None, :], s, float("nan"))
                    vs0 = tl.where(vs0 == vs0, vs0, 0.0)
                    vs1 = tl.where(vs1 == vs1, vs1, 0.0)
            else:
                k_lo, k_hi = _centroid_halves(k_codes, rows, valid, k_cb, D, K_BITS, K_W0, K_W1, K_LUT, K_VEC, M,
                                              MP)
                # A NaN V scale (non-finite value) moves to the K scale: the score carries it to the
                # queries that see the key, and p = 0 of the others never meets it.
                if NB == 1:
                    vs = tl.load(v_scales + rows, mask=valid, other=0.0).to(tl.float32)
                    ks = tl.where(vs == vs, tl.load(k_scales + rows, mask=valid, other=0.0).to(tl.float32),
                                  float("nan"))
                    vs = tl.where(vs == vs, vs, 0.0)
                    s = tl.dot(q_lo, tl.trans(k_lo))
                    s = tl.dot(q_hi, tl.trans(k_hi), acc=s) * ks[None, :]
                else:
                    vs0 = tl.load(v_scales + rows * 2, mask=valid, other=0.0).to(tl.float32)
                    vs1 = tl.load(v_scales + rows * 2 + 1, mask=valid, other=0.0).to(tl.float32)
                    ks0 = tl.where((vs0 == vs0) & (vs1 == vs1),
                                   tl.load(k_scales + rows * 2, mask=valid, other=0.0).to(tl.float32),
                                   float("nan"))
                    ks1 = tl.load(k_scales + rows * 2 + 1, mask=valid, other=0.0).to(tl.float32)
                    vs0 = tl.where(vs0 == vs0, vs0, 0.0)
                    vs1 = tl.where(vs1 == vs1, vs1, 0.0)
                    s = tl.dot(q_lo, tl.trans(k_lo)) * ks0[None, :] + tl.dot(q_hi, tl.trans(k_hi)) * ks1[None, :]
            s = _finish_scores(s, SOFTCAP, softcap)
            keep = valid[None, :] & (pos[None, :] >= start) & (pos[None, :] <= qpos[:, None]) & row_ok[:, None]
            if HAS_WINDOW:
                keep = keep & (qpos[:, None] - pos[None, :] < window)
            if EXACT and RING:
                keep = keep & (pos[None, :] < seen - exact_recent)
            s = tl.where(keep, s, float("-inf"))
            p, m, alpha, l = online_softmax(s, m, l, True)
            v_lo, v_hi = _centroid_halves(v_codes, rows, valid, v_cb, D, V_BITS, V_W0, V_W1, V_LUT, V_VEC, M, MP)
            if NB == 1:
                pv = (p * vs[None, :]).to(tl.float16)
                acc_lo = tl.dot(pv, v_lo, acc=acc_lo * alpha[:, None])
                acc_hi = tl.dot(pv, v_hi, acc=acc_hi * alpha[:, None])
            else:
                acc_lo = tl.dot((p * vs0[None, :]).to(tl.float16), v_lo, acc=acc_lo * alpha[:, None])
                acc_hi = tl.dot((p * vs1[None, :]).to(tl.float16), v_hi, acc=acc_hi * alpha[:, None])
    else:
        if FIRST:
            # The exact first tokens: row j holds position start + j, stored once start + j < seen.
            first_base = b * si_b + kvh * si_h
            for n0 in range(0, exact_first, BLOCK_N):
                j = n0 + offs_n
                pos = start + j
                m, l, acc_lo, acc_hi = _attend_exact(
                    fk_ptr + first_base + j * si_t, fv_ptr + first_base + j * si_t, (j < exact_first) & (pos < seen),
                    pos, qpos, start, row_ok, window, q_lo, q_hi, m, l, acc_lo, acc_hi, signs_ptr, had_ptr,
                    kron_ptr, key_shift_ptr + xf, key_gain_ptr + xf, softcap, D, PRE_ROTATED, KEY_XFORM, KEY_SHIFT,
                    SOFTCAP, HAS_WINDOW, M, MP, GROUPED, KA_D, KA_DP, KB_D, KB_DP)
        if EXACT:
            # The exact window: row r holds the position p in [seen - R, seen) with p = r (mod R).
            ring_base = b * sr_b + kvh * sr_h
            phase = seen % exact_recent
            for n0 in range(0, exact_recent, BLOCK_N):
                r = n0 + offs_n
                pos = seen - exact_recent + (r - phase + exact_recent) % exact_recent
                valid = (r < exact_recent) & (pos >= 0)
                if FIRST:
                    valid = valid & (pos >= start + exact_first)   # the first-token rows win
                m, l, acc_lo, acc_hi = _attend_exact(
                    rk_ptr + ring_base + r * sr_t, rv_ptr + ring_base + r * sr_t, valid, pos, qpos, start, row_ok,
                    window, q_lo, q_hi, m, l, acc_lo, acc_hi, signs_ptr, had_ptr, kron_ptr, key_shift_ptr + xf,
                    key_gain_ptr + xf, softcap, D, PRE_ROTATED, KEY_XFORM, KEY_SHIFT, SOFTCAP, HAS_WINDOW, M, MP,
                    GROUPED, KA_D, KA_DP, KB_D, KB_DP)
        if HAS_FRESH:
            # Fresh full-precision keys at positions seen + j, causal among themselves.
            t_max = tl.minimum((tl.program_id(2) * BLOCK_M + BLOCK_M - 1) // G, Tq - 1)
            fresh_base = b * sf_b + kvh * sf_h
            for n0 in range(0, t_max + 1, BLOCK_N):
                j = n0 + offs_n
                m, l, acc_lo, acc_hi = _attend_exact(
                    kf_ptr + fresh_base + j * sf_t, vf_ptr + fresh_base + j * sf_t, j <= t_max, seen + j, qpos,
                    start, row_ok, window, q_lo, q_hi, m, l, acc_lo, acc_hi, signs_ptr, had_ptr,
                    kron_ptr, key_shift_ptr + xf, key_gain_ptr + xf, softcap, D, PRE_ROTATED, KEY_XFORM, KEY_SHIFT,
                    SOFTCAP, HAS_WINDOW, M, MP, GROUPED, KA_D, KA_DP, KB_D, KB_DP)

    out_lo, lse = finish_split(acc_lo, m, l)
    out_hi, lse = finish_split(acc_hi, m, l)
    part = (bh * num_parts + split).to(tl.int64) * rows_total + row
    tl.store(lse_part + part, lse, mask=row_ok)
    o_ptr = o_part + part[:, None] * (2 * HP) + offs_h[None, :]   # rows of 2 * HP floats: D for M == 1
    tl.store(o_ptr, out_lo, mask=row_ok[:, None])
    tl.store(o_ptr + HP, out_hi, mask=row_ok[:, None])


@triton.jit
def _merge_reduce_kernel(
    o_part, lse_part, sinks_ptr, signs_ptr, had_ptr, kron_ptr, out_ptr, Tq, num_kv_heads, num_parts,
    D: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr,
    M: tl.constexpr, MP: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    HP: tl.constexpr = HALF // M * MP   # a half's columns in the parts (D / 2 for M == 1)
    DP: tl.constexpr = 2 * HP
    bh = tl.program_id(0)
    b, kvh, rows_total, row, row_ok, t, g = _group_rows(bh, tl.program_id(1), num_kv_heads, Tq, G, BLOCK_R)
    head = kvh * G + g
    offs_h, cols_ok = padded_columns(HP, M, MP)

    sink = tl.full([BLOCK_R], float("-inf"), tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * LOG2E
    first = (bh * num_parts).to(tl.int64) * rows_total + row
    offs_d = tl.arange(0, DP)
    y, lse = merge_splits(o_part, lse_part, first, rows_total, num_parts, offs_d, row_ok, offs_d < DP, sink,
                          BLOCK_R, DP, DP)
    y_lo, y_hi = tl.split(tl.permute(tl.reshape(y, (BLOCK_R, 2, HP)), (0, 2, 1)))
    if M > 1:   # the padded columns hold centroid values of no coordinate: drop them before the rotation
        y_lo = tl.where(cols_ok[None, :], y_lo, 0.0)
        y_hi = tl.where(cols_ok[None, :], y_hi, 0.0)

    # Rotate back: x = s * ((H_P ⊗ Q) y) / sqrt(P), with H_P ⊗ Q = [[H, H], [H, -H]] for H = H_{P/2} ⊗ Q.
    x_lo = kron_rows(y_lo + y_hi, had_ptr, kron_ptr, HP, M, MP)
    x_hi = kron_rows(y_lo - y_hi, had_ptr, kron_ptr, HP, M, MP)
    norm = 1.0 / tl.sqrt((D // M) * 1.0)
    x_lo = x_lo * load_padded_vector(signs_ptr, offs_h[None, :], cols_ok, M) * norm
    x_hi = x_hi * load_padded_vector(signs_ptr + HALF, offs_h[None, :], cols_ok, M) * norm
    out_row = out_ptr + ((b * num_kv_heads * G + head).to(tl.int64) * Tq + t) * D
    o_ptr = out_row[:, None] + offs_h[None, :]
    mask = padded_mask(row_ok, cols_ok, M)
    tl.store(o_ptr, x_lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, x_hi.to(out_ptr.dtype.element_ty), mask=mask)


def rotation_tables(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(had_ptr, kron_ptr) of the kernels' half-size rotations: H_{D/2}'s tile for a power of two, the
    Hartley factor's (triton_lib.kron_tile) otherwise; the other one is a placeholder the kernel never reads."""
    m, _ = padded_factor(d)
    return hadamard_tile(d // 2 if m == 1 else 16, device), kron_tile(m, device)


def query_scale(d: int, scale: float | None, softcap: float | None) -> float:
    """The factor the kernels apply to q: the softmax runs in base 2, so log2(e) joins it unless softcap
    needs the raw scores."""
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    return scale if softcap is not None else scale * LOG2E.value


@lru_cache(maxsize=None)
def group_rotation(key_groups: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """G [D, D] float32 with x @ G = each key group of x rotated as its codec rotates it (block diagonal: one
    product where the rotations' butterflies take a few dozen small ops); cached, read-only."""
    width = key_groups[0][0]
    rest = sum(c for c, _ in key_groups) - width
    return torch.block_diag(rotation_matrix(width).T, rotation_matrix(rest).T).to(device, torch.float32)


def grouped_key_rows(k: torch.Tensor, layout: CacheLayout, codec: KVCodec) -> torch.Tensor:
    """Keys k [B, Hkv, T, D] in the model's domain -> the key groups' domain as the kernel's GROUPED path reads
    them, float16: the key transform and channel order applied (to_stored_keys), then each group rotated as its
    codec rotates it (codec.key_groups)."""
    if layout.has_key_transform:
        k = to_stored_keys(k, layout.key_shift, layout.key_gain, layout.key_order)
    return (k.to(torch.float32) @ group_rotation(codec.key_groups, k.device)).to(torch.float16)


def queries_in_groups(q: torch.Tensor, layout: CacheLayout, codec: KVCodec) -> torch.Tensor:
    """q [B, Hq, T, D] in the key groups' domain, float32 [B, Hq, T, D] contiguous, as this kernel's grouped path
    reads it (the CUDA kernel does the same in its set-up): (q / gain)[order] (key_transform.to_stored_queries) as
    one gather and one product with the gains' inverses in that order, then one product with the groups'
    block-diagonal rotation.  The index, gains and rotation are derived once per layout (a decode step's is the
    same object every step)."""
    derived = layout.derived_for(_QUERY_GROUPS, codec, _QueryGroups)
    b, hq, tq, d = q.shape
    x = q.reshape(b, layout.num_kv_heads, hq // layout.num_kv_heads, tq, d)
    if derived.index is not None:
        x = x.gather(-1, derived.index.expand(x.shape))
    x = x * derived.gain_inv if derived.gain_inv is not None else x.to(torch.float32)
    return x.reshape(b, hq, tq, d) @ derived.rotation


_QUERY_GROUPS = "query groups"   # CacheLayout.derived's key


class _QueryGroups:
    """queries_in_groups' tensors for one layout: the channel order as a gather index and the gains' inverses in
    that order, [B, Hkv, 1, 1, D] (None without a key transform), and the groups' rotation."""

    __slots__ = ("codec", "index", "gain_inv", "rotation")

    def __init__(self, layout: CacheLayout, codec: KVCodec):
        self.codec = codec
        self.index = self.gain_inv = None
        if layout.has_key_transform:
            gain_inv = layout.key_gain_inv
            if layout.key_order is not None:
                order = layout.key_order.to(torch.int64)
                gain_inv = gain_inv.gather(-1, order)
                self.index = order[:, :, None, None]
            self.gain_inv = gain_inv[:, :, None, None].to(torch.float32)
        self.rotation = group_rotation(codec.key_groups, layout.k_codes.device)


def part_buffers(q: torch.Tensor, num_kv_heads: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_part, lse_part): every part's normalized output [B * Hkv * parts * rows, next_power_of_2(D)] (the
    padded layout's columns: D for a power of two) and log2-sum-exp."""
    b, hq, tq, d = q.shape
    rows = tq * (hq // num_kv_heads)
    width = next_power_of_2(d)
    o_part = torch.empty(b * num_kv_heads * parts * rows * width, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b * num_kv_heads * parts * rows, dtype=torch.float32, device=q.device)
    return o_part, lse_part


def launch_parts(q: torch.Tensor, layout: CacheLayout, codec: KVCodec, k: torch.Tensor | None,
                 v: torch.Tensor | None, q_scale: float, softcap: float | None, plan: DecodePlan,
                 o_part: torch.Tensor, lse_part: torch.Tensor) -> None:
    """Run the split-K kernel: the cache splits, then the fresh k/v part if any."""
    b, hq, tq, d = q.shape
    hkv = layout.num_kv_heads
    group = hq // hkv
    dev = q.device
    has_fresh = k is not None
    exact = layout.exact_recent > 0
    first = layout.exact_first > 0
    rk, rv = layout.recent_k, layout.recent_v
    fk, fv = layout.first_k, layout.first_v
    parts = plan.num_splits + int(has_fresh or exact or first)
    # D = 512 rotates on the host: with q rotated in the kernel, Triton 3.6 addresses shared memory out of
    # range in the score dot at 64-row tiles, whose [64, 256] q operands then come from registers (memcheck;
    # the rotation itself is exact: BENCHMARKS.md).  The other head dims above 256 have halves of 256 columns
    # too, and do the same.
    pre_rotated = d > 256
    key_xform = layout.has_key_transform
    grouped = codec.grouped_keys
    if grouped:   # q and the exact rows' keys in the key groups' domain; values as below
        q = (queries_in_groups(q, layout, codec) * q_scale).to(torch.float16)
        k = None if k is None else grouped_key_rows(k, layout, codec)
        rk = None if rk is None else grouped_key_rows(rk, layout, codec)
        fk = None if fk is None else grouped_key_rows(fk, layout, codec)
        key_xform = False
        if pre_rotated:
            v = None if v is None else rotate(v.to(torch.float32)).to(torch.float16)
            rv = None if rv is None else rotate(rv.to(torch.float32)).to(torch.float16)
            fv = None if fv is None else rotate(fv.to(torch.float32)).to(torch.float16)
    elif pre_rotated:
        if key_xform:  # the host rotates, so it applies the key transform too
            q = to_stored_queries(q.to(torch.float32), layout.key_gain)
            k = None if k is None else to_stored_keys(k, layout.key_shift, layout.key_gain)
            rk = None if rk is None else to_stored_keys(rk, layout.key_shift, layout.key_gain)
            fk = None if fk is None else to_stored_keys(fk, layout.key_shift, layout.key_gain)
            key_xform = False
        q = (rotate(q.to(torch.float32)) * q_scale).to(torch.float16)
        if has_fresh:
            k = rotate(k.to(torch.float32)).to(torch.float16)
            v = rotate(v.to(torch.float32)).to(torch.float16)
        if exact:  # the exact window like fresh k/v
            rk = rotate(rk.to(torch.float32)).to(torch.float16)
            rv = rotate(rv.to(torch.float32)).to(torch.float16)
        if first:  # the first tokens too
            fk = rotate(fk.to(torch.float32)).to(torch.float16)
            fv = rotate(fv.to(torch.float32)).to(torch.float16)
    if q.stride(3) != 1:
        q = q.contiguous()
    if has_fresh:
        # k and v share strides so that the kernel takes one set.
        k = k.contiguous()
        v = v.contiguous()
    kf, vf = (k, v) if has_fresh else (q, q)  # unused without fresh tokens
    if exact:
        rk, rv = rk.contiguous(), rv.contiguous()   # one set of strides for both
    else:
        rk = rv = q   # unused without an exact window
    if first:
        fk, fv = fk.contiguous(), fv.contiguous()
    else:
        fk = fv = q   # unused without exact first tokens

    rows = tq * group
    row_blocks = cdiv(rows, plan.block_m)
    v_spec = codec.kernel_spec("v")
    # Keys in groups: the group codecs' facts (the K_* constants of the plain path then go unread).
    k_spec = v_spec if grouped else codec.kernel_spec("k")
    group_a, group_b = codec.key_group_codecs if grouped else (codec, codec)
    spec_a, spec_b = group_a.kernel_spec("k"), group_b.kernel_spec("k")
    m, m_pad = padded_factor(d)
    use_lut = plan.lookup == "lut" and m == 1   # the LUT reads the plain layout's contiguous bytes
    k_lut = lut4_asm() if use_lut and k_spec.bits == 4 and not grouped else ""
    v_lut = lut4_asm() if use_lut and codec.v_bits == 4 else ""
    window = layout.sliding_window or 0
    _cached_attention_kernel[(parts, b * hkv, row_blocks)](
        q, q.stride(0), q.stride(1), q.stride(2), layout.k_codes, layout.k_scales, layout.v_codes,
        layout.v_scales, device_centroids(k_spec.bits, dev, torch.float16),
        device_centroids(codec.v_bits, dev, torch.float16),
        kf, vf, kf.stride(0), kf.stride(1), kf.stride(2), layout.seen, layout.starts, o_part, lse_part,
        device_signs(d, dev), *rotation_tables(d, dev),
        *(layout.key_shift, layout.key_gain, layout.key_gain_inv) if key_xform else (o_part,) * 3,
        rk, rv, rk.stride(0), rk.stride(1), rk.stride(2), layout.exact_recent,
        fk, fv, fk.stride(0), fk.stride(1), fk.stride(2), layout.exact_first,
        float(q_scale), float(softcap or 0.0), tq, layout.capacity, window, hkv, plan.num_splits,
        parts,
        D=d, G=group, K_BITS=k_spec.bits, K_W0=k_spec.low_plane, K_W1=k_spec.high_plane,
        V_BITS=v_spec.bits, V_W0=v_spec.low_plane, V_W1=v_spec.high_plane,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, RING=layout.is_ring, HAS_FRESH=has_fresh,
        HAS_WINDOW=window > 0, SOFTCAP=softcap is not None, K_LUT=k_lut, V_LUT=v_lut,
        K_VEC=k_spec.vector_bytes, V_VEC=v_spec.vector_bytes,
        PRE_ROTATED=pre_rotated, KEY_XFORM=key_xform, KEY_SHIFT=key_xform and layout.key_shifted, EXACT=exact,
        FIRST=first, M=m, MP=m_pad,
        ka_cb=device_centroids(spec_a.bits, dev, torch.float16),
        kb_cb=device_centroids(spec_b.bits, dev, torch.float16), GROUPED=grouped, K_ROW=codec.code_bytes("k"),
        KA_D=group_a.head_dim, KA_DP=next_power_of_2(group_a.head_dim), KA_W0=spec_a.low_plane,
        KA_W1=spec_a.high_plane, KB_D=group_b.head_dim, KB_DP=next_power_of_2(group_b.head_dim),
        KB_W0=spec_b.low_plane, KB_W1=spec_b.high_plane,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )


def launch_merge(o_part: torch.Tensor, lse_part: torch.Tensor, sinks: torch.Tensor | None, out: torch.Tensor,
                 num_kv_heads: int, parts: int) -> None:
    """Merge the parts by LSE, add the sinks, rotate back and cast into out [B, Hq, Tq, D]."""
    b, hq, tq, d = out.shape
    group = hq // num_kv_heads
    block_r = 16
    m, m_pad = padded_factor(d)
    _merge_reduce_kernel[(b * num_kv_heads, cdiv(tq * group, block_r))](
        o_part, lse_part, sinks if sinks is not None else lse_part, device_signs(d, out.device),
        *rotation_tables(d, out.device), out, tq, num_kv_heads, parts,
        D=d, G=group, BLOCK_R=block_r, HAS_SINKS=sinks is not None, M=m, MP=m_pad, num_warps=4,
    )


def cached_attention_triton(q: torch.Tensor, layout: CacheLayout, codec: KVCodec, k: torch.Tensor | None = None,
                            v: torch.Tensor | None = None, scale: float | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None,
                            plan: DecodePlan | None = None) -> torch.Tensor:
    """Launch the split-K kernel and the merge.  Inputs are validated by attention.cached_attention.

    plan: the launch plan (config.plan_decode); None plans for a full cache (layout.capacity keys).
    """
    check_kernel_head_dim("cached_attention", codec.head_dim)
    b, hq, tq, d = q.shape
    hkv = layout.num_kv_heads
    if plan is None:
        plan = plan_decode(q.device, d, codec.k_bits, codec.v_bits, b * hkv, tq * (hq // hkv), layout.capacity)
    parts = plan.num_splits + int(k is not None or layout.has_exact_rows)
    o_part, lse_part = part_buffers(q, hkv, parts)
    launch_parts(q, layout, codec, k, v, query_scale(d, scale, softcap), softcap, plan, o_part, lse_part)
    out = torch.empty(b, hq, tq, d, dtype=q.dtype, device=q.device)
    launch_merge(o_part, lse_part, sinks, out, hkv, parts)
    return out
