"""Dense flash-attention forward in Triton: prefill, split-K decode, and the mask tile pre-pass.

Semantics are reference.attention_reference's: query row i sits at position
i + Lk - Lq (bottom-right causal), key j is visible iff kv_start[b] <= j < Lk,
j <= pos (causal), pos - j < window (sliding window) and the user mask keeps it.
Scores: s = q.k * scale -> softcap * tanh(s / softcap) -> + slope * (j - pos)
-> + additive mask / -inf.  Sinks join the softmax denominator.  Rows that see
no key give zeros and LSE -inf.

Everything runs in the log2 domain (exp2 is one instruction); LSE is converted
back to natural log on store.

Three kernels share one tile update (`_tile_update`):
  * `_flash_fwd`: one program per (query tile, batch, query head).  Without a
    user mask the key range of a query tile is split analytically into
    [masked edge | unmasked interior | masked edge], so interior tiles pay for
    no mask arithmetic and tiles outside the causal / window band are never
    visited.  With a user mask, `_classify_tiles` first tags every
    (query tile, key tile) as skipped / mixed / plain and the kernel walks a
    compacted list of the visited tiles.
  * `_flash_decode`: few query rows (Lq * group <= 32), long keys: the keys
    are split across programs (flash-decoding); each program handles all query
    heads of one KV head, so K/V are read once per KV head.
  * `_decode_reduce`: merges the per-split partials by their log-sum-exp.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Tile classes written by the pre-pass (the seed's convention).
TILE_SKIP, TILE_MIXED, TILE_PLAIN = 0, 1, 2


# ----------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------

@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact limits at +-inf and no libdevice dependency (works interpreted).
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                 qk_scale, softcap, bias,
                 MASKED: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a key tile.  k, v: [BLOCK_N, BLOCK_D]; q: [rows, BLOCK_D].

    Scores are in log2 units: qk_scale = scale*log2(e) (or scale/softcap with
    softcap pre-multiplied by log2(e)); slope and bias are pre-multiplied too.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        s = softcap * _tanh(s * qk_scale)
    else:
        s = s * qk_scale
    if HAS_ALIBI:
        s += slope[:, None] * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
    if HAS_BIAS:
        s += bias
    if MASKED:
        valid = (offs_n[None, :] < Lk) & (offs_n[None, :] >= kv_lo)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            valid = valid & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_user_bias(Mask, mask_rows, offs_n, row_ok, Lk, stride_mk, MASK_BOOL: tl.constexpr):
    """User mask tile as an additive log2-domain bias: 0 / -inf for boolean masks."""
    ptrs = Mask + mask_rows[:, None] + offs_n[None, :].to(tl.int64) * stride_mk
    inb = row_ok[:, None] & (offs_n[None, :] < Lk)
    if MASK_BOOL:
        keep = tl.load(ptrs, mask=inb, other=0)
        return tl.where(keep != 0, 0.0, float("-inf"))
    return tl.load(ptrs, mask=inb, other=0.0).to(tl.float32) * 1.4426950408889634


# ----------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------

@triton.jit
def _load_kv_tile(K, V, k_desc, v_desc, b, hk, k_base, v_base, offs_n, offs_d, start_n, Lk, D,
                  stride_kn, stride_vn, BOUNDED: tl.constexpr, EVEN_D: tl.constexpr,
                  USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    if USE_TMA:
        # The 4-D descriptor zero-fills past Lk and past D, per (batch, head).
        k = k_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        k_ptrs = K + k_base + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :]
        v_ptrs = V + v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :]
        if BOUNDED:
            inb = (offs_n[:, None] < Lk) & (offs_d[None, :] < D)
            k = tl.load(k_ptrs, mask=inb, other=0.0)
            v = tl.load(v_ptrs, mask=inb, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
            v = tl.load(v_ptrs, mask=offs_d[None, :] < D, other=0.0)
    return k, v


# Lengths and counts stay generic so one compiled kernel serves every shape.
@triton.jit(do_not_specialize=["Hq", "group", "Lq", "Lk", "D", "window", "n_q_tiles", "n_k_tiles"])
def _flash_fwd(Q, K, V, Out, Lse, Sinks, Slopes, KvStart, Mask, TileOrder, TileCount, TileClass,
               q_desc, k_desc, v_desc, o_desc,
               stride_qb, stride_qh, stride_qm,
               stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn,
               stride_ob, stride_oh, stride_om,
               stride_mb, stride_mh, stride_mq, stride_mk,
               cls_sb, cls_sh,
               Hq, group, Lq, Lk, D, window, n_q_tiles, n_k_tiles,
               qk_scale, softcap,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
               HAS_KV_START: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
               USE_LIST: tl.constexpr, RETURN_LSE: tl.constexpr, USE_TMA: tl.constexpr,
               WARP_SPEC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Heaviest (last, for causal) query tiles first, so the tail of the grid is short.
    pid_m = n_q_tiles - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // group
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    q_pos = offs_m + (Lk - Lq)

    if USE_TMA:
        q = q_desc.load([b, h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q_ptrs = (Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                  + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :])
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    k_base = b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    kv_lo = b * 0
    if HAS_KV_START:
        kv_lo = tl.load(KvStart + b)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope += tl.load(Slopes + h).to(tl.float32) * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    arange_n = tl.arange(0, BLOCK_N)
    no_bias = 0.0

    if USE_LIST:
        mask_rows = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + offs_m.to(tl.int64) * stride_mq
        tile_row = (b * cls_sb + h * cls_sh + pid_m).to(tl.int64)
        count = tl.load(TileCount + tile_row)
        for it in range(0, count):
            kt = tl.load(TileOrder + tile_row * n_k_tiles + it)
            cls = tl.load(TileClass + tile_row * n_k_tiles + kt)
            start_n = kt * BLOCK_N
            offs_n = start_n + arange_n
            k, v = _load_kv_tile(K, V, k_desc, v_desc, b, hk, k_base, v_base, offs_n, offs_d, start_n,
                                 Lk, D, stride_kn, stride_vn, True, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
            if cls == 2:
                acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                                             qk_scale, softcap, no_bias, False, False, CAUSAL, HAS_WINDOW,
                                             HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
            else:
                bias = no_bias
                if HAS_MASK:
                    bias = _load_user_bias(Mask, mask_rows, offs_n, row_ok, Lk, stride_mk, MASK_BOOL)
                acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                                             qk_scale, softcap, bias, True, HAS_MASK, CAUSAL, HAS_WINDOW,
                                             HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
    else:
        # Key range seen by some row of this tile, and the range seen by every row (no mask needed).
        off = Lk - Lq
        p_first = m0 + off
        p_last = tl.minimum(m0 + BLOCK_M, Lq) - 1 + off
        k_lo = kv_lo
        f_lo = kv_lo
        k_hi = Lk
        f_hi = Lk
        if HAS_WINDOW:
            k_lo = tl.maximum(k_lo, p_first - window + 1)
            f_lo = tl.maximum(f_lo, p_last - window + 1)
        if CAUSAL:
            k_hi = tl.minimum(k_hi, p_last + 1)
            f_hi = tl.minimum(f_hi, p_first + 1)
        # Clamp at 0 before dividing: integer division of negatives differs between GPU and interpreter.
        k_lo = tl.maximum(k_lo, 0)
        k_hi = tl.maximum(k_hi, k_lo)
        f_lo = tl.maximum(f_lo, 0)
        f_hi = tl.maximum(f_hi, 0)
        t_lo = k_lo // BLOCK_N
        t_hi = (k_hi + BLOCK_N - 1) // BLOCK_N
        t_hi = tl.where(k_hi > k_lo, t_hi, t_lo)
        a_end = tl.minimum(tl.maximum((f_lo + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi)
        b_end = tl.minimum(tl.maximum(f_hi // BLOCK_N, a_end), t_hi)
        for start_n in range(t_lo * BLOCK_N, a_end * BLOCK_N, BLOCK_N):
            offs_n = start_n + arange_n
            k, v = _load_kv_tile(K, V, k_desc, v_desc, b, hk, k_base, v_base, offs_n, offs_d, start_n,
                                 Lk, D, stride_kn, stride_vn, True, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
            acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                                         qk_scale, softcap, no_bias, True, False, CAUSAL, HAS_WINDOW,
                                         HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
        for start_n in tl.range(a_end * BLOCK_N, b_end * BLOCK_N, BLOCK_N, warp_specialize=WARP_SPEC):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + arange_n
            k, v = _load_kv_tile(K, V, k_desc, v_desc, b, hk, k_base, v_base, offs_n, offs_d, start_n,
                                 Lk, D, stride_kn, stride_vn, False, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
            acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                                         qk_scale, softcap, no_bias, False, False, CAUSAL, HAS_WINDOW,
                                         HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
        for start_n in range(b_end * BLOCK_N, t_hi * BLOCK_N, BLOCK_N):
            offs_n = start_n + arange_n
            k, v = _load_kv_tile(K, V, k_desc, v_desc, b, hk, k_base, v_base, offs_n, offs_d, start_n,
                                 Lk, D, stride_kn, stride_vn, True, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
            acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                                         qk_scale, softcap, no_bias, True, False, CAUSAL, HAS_WINDOW,
                                         HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)

    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    # l = 0 only for rows that saw nothing; their acc is 0, so dividing by 1 writes zeros.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = (acc / l_safe[:, None]).to(Out.dtype.element_ty)
    if USE_TMA:
        o_desc.store([b, h, m0, 0], out.reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :])
        tl.store(o_ptrs, out, mask=row_ok[:, None] & (offs_d[None, :] < D))
    if RETURN_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + pid_bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


@triton.jit(do_not_specialize=["Hc", "Lq", "Lk", "window", "n_k_tiles"])
def _classify_tiles(Mask, KvStart, TileClass,
                    stride_mb, stride_mh, stride_mq, stride_mk,
                    Hc, Lq, Lk, window, n_k_tiles,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
                    MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_KV_START: tl.constexpr, FORCE_MIXED: tl.constexpr):
    """Tag a (query tile, key tile): 0 nothing visible (skip), 1 needs masking, 2 no mask at all."""
    kt = tl.program_id(0)
    qt = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // Hc
    h = bh % Hc
    rows = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < Lq
    q_pos = rows + (Lk - Lq)
    kv_lo = 0
    if HAS_KV_START:
        kv_lo = tl.load(KvStart + b)
    struct = (cols[None, :] < Lk) & (cols[None, :] >= kv_lo) & row_ok[:, None]
    if CAUSAL:
        struct = struct & (cols[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        struct = struct & (cols[None, :] > q_pos[:, None] - window)
    visible = struct
    plain = struct
    if HAS_MASK:
        ptrs = (Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
                + rows[:, None].to(tl.int64) * stride_mq + cols[None, :].to(tl.int64) * stride_mk)
        inb = row_ok[:, None] & (cols[None, :] < Lk)
        if MASK_BOOL:
            keep = tl.load(ptrs, mask=inb, other=0) != 0
            visible = visible & keep
            plain = plain & keep
        else:
            val = tl.load(ptrs, mask=inb, other=0.0).to(tl.float32)
            visible = visible & (val != float("-inf"))
            plain = plain & (val == 0.0)
    any_visible = tl.max(visible.to(tl.int32))
    all_plain = tl.min((plain | ~row_ok[:, None]).to(tl.int32))
    cls = tl.where(any_visible > 0, tl.where(all_plain > 0, 2, 1), 0)
    if FORCE_MIXED:
        cls = 1
    tl.store(TileClass + (bh.to(tl.int64) * tl.num_programs(1) + qt) * n_k_tiles + kt, cls.to(tl.int8))


# ----------------------------------------------------------------------------
# Decode (split-K)
# ----------------------------------------------------------------------------

@triton.jit(do_not_specialize=["Hkv", "group", "Lq", "Lk", "D", "window", "split_len", "n_splits"])
def _flash_decode(Q, K, V, Mask, KvStart, Slopes, Opart, Mpart, Lpart,
                  stride_qb, stride_qh, stride_qm,
                  stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  stride_mb, stride_mh, stride_mq, stride_mk,
                  Hkv, group, Lq, Lk, D, window, split_len, n_splits,
                  qk_scale, softcap,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_MASK: tl.constexpr,
                  MASK_BOOL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Partial attention of all query rows of one KV head over one split of the keys.

    Rows are (query head in the group, query token) pairs, so each K/V tile is
    loaded once for the whole GQA group.
    """
    pid_s = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    n_rows = group * Lq
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    g = rows // Lq
    t = rows % Lq
    h = hk * group + g
    q_pos = t + (Lk - Lq)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh
              + t[:, None].to(tl.int64) * stride_qm + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    kv_lo = b * 0
    if HAS_KV_START:
        kv_lo = tl.load(KvStart + b)
    slope = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_ALIBI:
        slope += tl.load(Slopes + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    mask_rows = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + t.to(tl.int64) * stride_mq

    # This split's keys, narrowed to what some row can see (tiles stay inside the split).
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, Lk)
    first = tl.maximum(kv_lo, 0)
    if HAS_WINDOW:
        first = tl.maximum(first, Lk - Lq - window + 1)
    lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        bias = 0.0
        inb = (offs_n[:, None] < hi) & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=inb, other=0.0)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :], mask=inb, other=0.0)
        if HAS_MASK:
            bias = _load_user_bias(Mask, mask_rows, offs_n, row_ok, Lk, stride_mk, MASK_BOOL)
        acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                                     qk_scale, softcap, bias, True, HAS_MASK, CAUSAL, HAS_WINDOW,
                                     HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)

    part = (pid_bk * n_splits + pid_s).to(tl.int64) * n_rows
    tl.store(Mpart + part + rows, m_i, mask=row_ok)
    tl.store(Lpart + part + rows, l_i, mask=row_ok)
    o_ptrs = Opart + (part + rows[:, None]) * D + offs_d[None, :]
    tl.store(o_ptrs, acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["Hkv", "group", "Lq", "D", "n_splits"])
def _decode_reduce(Opart, Mpart, Lpart, Sinks, Out, Lse,
                   stride_ob, stride_oh, stride_om,
                   Hkv, group, Lq, D, n_splits,
                   BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr,
                   HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr):
    """Merge the splits of one query row (one chunk of D per program) by log-sum-exp."""
    row_glob = tl.program_id(0)
    pid_d = tl.program_id(1)
    n_rows = group * Lq
    bk = row_glob // n_rows
    r = row_glob % n_rows
    b = bk // Hkv
    h = (bk % Hkv) * group + r // Lq
    t = r % Lq
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < n_splits
    idx = (bk * n_splits + splits).to(tl.int64) * n_rows + r
    m_s = tl.load(Mpart + idx, mask=s_ok, other=float("-inf"))
    l_s = tl.load(Lpart + idx, mask=s_ok, other=0.0)
    m = tl.max(m_s, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(m_s - m_use)
    denom = tl.sum(w * l_s, 0)
    if HAS_SINKS:
        denom += tl.math.exp2(sink - m_use)
    offs_d = pid_d * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = offs_d < D
    o = tl.load(Opart + idx[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.sum(o * w[:, None], 0)
    denom_safe = tl.where(denom > 0, denom, 1.0)  # denom = 0: no key and no sink, acc is 0
    out = acc / denom_safe
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + t.to(tl.int64) * stride_om
              + offs_d)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)
    if RETURN_LSE:
        if pid_d == 0:
            lse = tl.where(denom > 0, (m_use + tl.math.log2(denom_safe)) * 0.6931471805599453, float("-inf"))
            tl.store(Lse + (b * (Hkv * group) + h).to(tl.int64) * Lq + t, lse)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------

def prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Block sizes for the prefill kernel (measured on H200; see BENCHMARKS.md)."""
    if device.type != "cuda":
        # Interpreter: small tiles are fast to simulate and exercise every multi-tile code path.
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, tma=False)
    # TMA loads (tensor descriptors) beat pointer loads at every head dim on H200 (scripts/flash_gpu.py):
    # D=512 240 vs 182 TFLOP/s, D=256 508 vs 416, D=128 462 vs 388 (causal, L=8192).
    bd = triton.next_power_of_2(head_dim)
    if bd <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, tma=True)
    if bd <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True)
    if bd <= 256:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, tma=True)
    # D=512: a 64x512 fp32 accumulator already takes half the register file, and K+V tiles of
    # 64 keys fill shared memory, so one stage: wider key tiles beat deeper pipelining here.
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, tma=True)


def decode_config(head_dim: int, device: torch.device) -> dict:
    if device.type != "cuda":
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    bd = triton.next_power_of_2(head_dim)
    # D=512, 32K keys, 16 q / 2 KV heads on H200 (CUDA-graph time): 32-key tiles 83.5 us (2 or 3
    # stages), 16-key tiles x4 stages 91.4 us; ~128 splits, i.e. two programs per SM.
    if bd >= 512:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64 if bd <= 128 else 32, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _decode_splits(batch_kv_heads: int, lk: int, block_n: int, device: torch.device) -> int:
    """Enough programs for about two waves over the SMs, each with at least 4 key tiles."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    tiles = triton.cdiv(lk, block_n)
    want = triton.cdiv(2 * sms, batch_kv_heads)
    return max(1, min(want, triton.cdiv(tiles, 4)))


# Lq * group at or below this goes to the split-K decode kernel.
DECODE_MAX_ROWS = 32


def _check_kv_start(kv_start, b: int, device) -> None:
    if not isinstance(kv_start, torch.Tensor):
        raise TypeError(f"kv_start must be an int32 tensor of shape [{b}], got {type(kv_start).__name__}")
    if kv_start.shape != (b,) or kv_start.dtype != torch.int32:
        raise ValueError(f"kv_start must be int32 of shape [{b}], got {kv_start.dtype} {tuple(kv_start.shape)}")
    if kv_start.device != device:
        raise ValueError(f"kv_start is on {kv_start.device} but q is on {device}")


def _sdpa_serves(q, k, causal, sliding_window, mask, softcap, sinks, alibi_slopes, kv_start, return_lse) -> bool:
    """torch SDPA computes exactly this and is at least as fast (measured: BENCHMARKS.md)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if mask is not None or sliding_window is not None or softcap is not None or sinks is not None:
        return False
    if alibi_slopes is not None or kv_start is not None or return_lse:
        return False
    lq, lk, d = q.shape[2], k.shape[2], q.shape[3]
    if causal and lq != lk:  # SDPA's is_causal is top-left aligned
        return False
    if q.shape[1] != k.shape[1]:  # GQA: measured separately (SDPA_GQA)
        return SDPA_GQA and d <= SDPA_MAX_HEAD_DIM and lq > DECODE_MAX_ROWS
    return d <= SDPA_MAX_HEAD_DIM and d % 8 == 0 and lq > DECODE_MAX_ROWS


# Up to this head dim torch SDPA has its flash / cuDNN kernels, measured 1.1-1.2x ahead of ours
# for plain causal prefill on H200 (BENCHMARKS.md); above it SDPA falls back to slower kernels.
SDPA_MAX_HEAD_DIM = 256
# GQA through SDPA's enable_gqa (torch >= 2.5): 532-552 vs our 443-465 TFLOP/s (D=128, 32 q / 8 KV heads).
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def flash_path(q, k, causal=False, sliding_window=None, mask=None, softcap=None, sinks=None,
               alibi_slopes=None, kv_start=None, return_lse=False, allow_sdpa=True) -> str:
    """Which implementation flash_attention_triton runs for these arguments: 'sdpa', 'decode' or 'prefill'."""
    if allow_sdpa and _sdpa_serves(q, k, causal, sliding_window, mask, softcap, sinks, alibi_slopes,
                                   kv_start, return_lse):
        return "sdpa"
    group = q.shape[1] // k.shape[1]
    return "decode" if q.shape[2] * group <= DECODE_MAX_ROWS else "prefill"


def _kv_descriptors_ok(*tensors) -> bool:
    """TMA needs 16-byte aligned bases and strides (last dim contiguous)."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def flash_attention_triton(q, k, v, *, causal=False, sliding_window=None, mask=None, scale=None,
                           softcap=None, sinks=None, alibi_slopes=None, return_lse=False,
                           kv_start=None, allow_sdpa=True, skip_tiles=True, path=None, config=None):
    """Launch the dense attention kernels.  Inputs are validated by attention.flash_attention.

    Internal keywords: kv_start (int32 [B]) masks keys j < kv_start[b] (left padding);
    allow_sdpa lets the plain causal / full cases run through torch SDPA where that
    was measured faster; skip_tiles=False visits every tile through the masked path
    (tests use it to show skipping changes nothing); path forces 'prefill' / 'decode';
    config overrides block sizes.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    if kv_start is not None:
        _check_kv_start(kv_start, b, q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if path is None:
        path = flash_path(q, k, causal, sliding_window, mask, softcap, sinks, alibi_slopes, kv_start,
                          return_lse, allow_sdpa)
    if path == "sdpa":
        gqa = {"enable_gqa": True} if group > 1 else {}  # the keyword exists from torch 2.5
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **gqa)

    # Kernels index the last dim with stride 1.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device) if return_lse else out
    if softcap is not None:
        qk_scale, softcap_l2 = scale / softcap, softcap * LOG2E
    else:
        qk_scale, softcap_l2 = scale * LOG2E, 1.0
    window = int(sliding_window) if sliding_window is not None else 0
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_d = max(16, triton.next_power_of_2(d))
    if mask is not None:
        mask_x = mask.expand(b, hq, lq, lk)
        mask_bool = mask.dtype == torch.bool
        if mask_bool:
            mask_x = mask_x.view(torch.uint8)
        m_strides = mask_x.stride()
    else:
        mask_x, mask_bool, m_strides = q, False, (0, 0, 0, 0)
    dummy = q  # stands in for absent optional pointers (never read)
    flags = dict(CAUSAL=bool(causal), HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
                 HAS_ALIBI=alibi_slopes is not None, HAS_KV_START=kv_start is not None,
                 HAS_MASK=mask is not None, MASK_BOOL=mask_bool, DOT_PRECISION=dot_precision)

    if path == "decode":
        cfg = dict(decode_config(d, q.device), **(config or {}))
        block_n = cfg["BLOCK_N"]
        n_splits = cfg.get("splits") or _decode_splits(b * hkv, lk, block_n, q.device)
        split_len = triton.cdiv(triton.cdiv(lk, n_splits), block_n) * block_n
        n_splits = triton.cdiv(lk, split_len)
        n_rows = group * lq
        o_part = torch.empty((b * hkv, n_splits, n_rows, d), dtype=torch.float32, device=q.device)
        m_part, l_part = torch.empty((2, b * hkv, n_splits, n_rows), dtype=torch.float32, device=q.device)
        _flash_decode[(n_splits, b * hkv)](
            q, k, v, mask_x, kv_start if kv_start is not None else dummy,
            alibi_slopes if alibi_slopes is not None else dummy, o_part, m_part, l_part,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            *m_strides,
            hkv, group, lq, lk, d, window, split_len, n_splits,
            qk_scale, softcap_l2,
            BLOCK_R=max(16, triton.next_power_of_2(n_rows)), BLOCK_N=block_n, BLOCK_D=block_d,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags)
        block_s = max(2, triton.next_power_of_2(n_splits))
        block_dc = min(block_d, max(16, 8192 // block_s))
        _decode_reduce[(b * hkv * n_rows, triton.cdiv(d, block_dc))](
            o_part, m_part, l_part, sinks if sinks is not None else dummy, out, lse,
            out.stride(0), out.stride(1), out.stride(2),
            hkv, group, lq, d, n_splits,
            BLOCK_S=block_s, BLOCK_DC=block_dc, HAS_SINKS=sinks is not None, RETURN_LSE=return_lse,
            num_warps=4)
        return (out, lse) if return_lse else out

    cfg = dict(prefill_config(d, q.dtype, q.device), **(config or {}))
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    n_q_tiles, n_k_tiles = triton.cdiv(lq, block_m), triton.cdiv(lk, block_n)
    use_list = mask is not None or not skip_tiles
    if use_list:
        # Class per (batch or 1, head or 1, q tile, k tile): batch-wide when the mask or kv_start varies by batch.
        bc = b if (mask is not None and m_strides[0] != 0) or kv_start is not None else 1
        hc = hq if mask is not None and m_strides[1] != 0 else 1
        tile_class = torch.empty((bc, hc, n_q_tiles, n_k_tiles), dtype=torch.int8, device=q.device)
        _classify_tiles[(n_k_tiles, n_q_tiles, bc * hc)](
            mask_x, kv_start if kv_start is not None else dummy, tile_class,
            *m_strides, hc, lq, lk, window, n_k_tiles,
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_MASK=mask is not None, MASK_BOOL=mask_bool,
            CAUSAL=bool(causal), HAS_WINDOW=sliding_window is not None, HAS_KV_START=kv_start is not None,
            FORCE_MIXED=not skip_tiles, num_warps=4)
        visited = tile_class != TILE_SKIP
        # Visited tiles first, in key order (stable sort); the kernel loops over the first `count`.
        tile_order = torch.argsort((~visited).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        tile_count = visited.sum(-1, dtype=torch.int32)
        cls_sb = hc * n_q_tiles if bc > 1 else 0
        cls_sh = n_q_tiles if hc > 1 else 0
    else:
        tile_class = tile_order = tile_count = dummy
        cls_sb = cls_sh = 0

    launch_extra = dict(flags)
    if q.is_cuda and cfg.get("num_ctas", 1) > 1:
        launch_extra["num_ctas"] = cfg["num_ctas"]
    use_tma = bool(cfg.get("tma")) and q.is_cuda and _kv_descriptors_ok(q, k, v)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        q_desc = TensorDescriptor.from_tensor(q, [1, 1, block_m, block_d])
        k_desc = TensorDescriptor.from_tensor(k, [1, 1, block_n, block_d])
        v_desc = TensorDescriptor.from_tensor(v, [1, 1, block_n, block_d])
        o_desc = TensorDescriptor.from_tensor(out, [1, 1, block_m, block_d])
    else:
        q_desc = k_desc = v_desc = o_desc = dummy

    _flash_fwd[(n_q_tiles, b * hq)](
        q, k, v, out, lse, sinks if sinks is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        kv_start if kv_start is not None else dummy, mask_x, tile_order, tile_count, tile_class,
        q_desc, k_desc, v_desc, o_desc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *m_strides, cls_sb, cls_sh,
        hq, group, lq, lk, d, window, n_q_tiles, n_k_tiles,
        qk_scale, softcap_l2,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, EVEN_D=block_d == d,
        HAS_SINKS=sinks is not None, USE_LIST=use_list, RETURN_LSE=return_lse, USE_TMA=use_tma,
        WARP_SPEC=bool(cfg.get("warp_specialize")) and q.is_cuda,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_extra)
    return (out, lse) if return_lse else out
