"""Split-K flash decoding: few query rows (Lq x group <= DECODE_MAX_ROWS), long keys.

The keys are split across programs; each program serves all query rows of one
KV head (rows are (query head in the group, query token) pairs), so K/V are
read once per KV head.  Each split writes its normalized partial output and
log2-sum-exp, and `_decode_reduce` merges them (triton_lib.merge_splits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_lib import LN2, LOG2E, finish_split, merge_splits_at_once
from .config import decode_config, decode_num_splits
from .tile import _load_user_bias, _tile_update


# Lengths, and the mask strides that grow with them, stay generic (a mask's row pitch is the key count: its
# divisibility by 16 would otherwise compile a new kernel in the middle of a generation).
@triton.jit(do_not_specialize=["Hkv", "group", "Lq", "Lk", "D", "window", "split_len", "n_splits",
                               "stride_mb", "stride_mh", "stride_mq"],
            do_not_specialize_on_alignment=["Mask"])
def _flash_decode(Q, K, V, Mask, KvStart, Slopes, Opart, LsePart,
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
        slope += tl.load(Slopes + h, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
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

    out, lse = finish_split(acc, m_i, l_i)
    part = (pid_bk * n_splits + pid_s).to(tl.int64) * n_rows
    tl.store(LsePart + part + rows, lse, mask=row_ok)
    o_ptrs = Opart + (part + rows[:, None]) * D + offs_d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["Hkv", "group", "Lq", "D", "n_splits"])
def _decode_reduce(Opart, LsePart, Sinks, Out, Lse,
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
    sink = float("-inf")
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * LOG2E
    offs_d = pid_d * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = offs_d < D
    parts = (bk * n_splits + splits).to(tl.int64) * n_rows + r
    out, lse = merge_splits_at_once(Opart, LsePart, parts, splits < n_splits, offs_d, d_ok, sink, D)
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + t.to(tl.int64) * stride_om
              + offs_d)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)
    if RETURN_LSE:
        if pid_d == 0:
            tl.store(Lse + (b * (Hkv * group) + h).to(tl.int64) * Lq + t, lse * LN2)


def launch_decode(q, k, v, out, lse, mask_x, m_strides, kv_start, alibi_slopes, sinks, window, qk_scale,
                  softcap_l2, flags, return_lse, config=None):
    """Split-K decode of q over k, v into out (and lse); arguments prepared by flash_attention_triton."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    cfg = dict(decode_config(d, q.device), **(config or {}))
    block_n = cfg["BLOCK_N"]
    n_splits = cfg.get("splits") or decode_num_splits(b * hkv, lk, block_n, q.device)
    split_len = triton.cdiv(triton.cdiv(lk, n_splits), block_n) * block_n
    n_splits = triton.cdiv(lk, split_len)
    n_rows = group * lq
    o_part = torch.empty((b * hkv, n_splits, n_rows, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((b * hkv, n_splits, n_rows), dtype=torch.float32, device=q.device)
    dummy = q  # stands in for absent optional pointers (never read)
    _flash_decode[(n_splits, b * hkv)](
        q, k, v, mask_x, kv_start if kv_start is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *m_strides,
        hkv, group, lq, lk, d, window, split_len, n_splits,
        qk_scale, softcap_l2,
        BLOCK_R=max(16, triton.next_power_of_2(n_rows)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags)
    # Sized for the most splits this batch shape reaches at any length, so that the merge does not recompile
    # as a generation grows.
    block_s = max(2, triton.next_power_of_2(max(n_splits, decode_num_splits(b * hkv, 1 << 30, block_n, q.device))))
    block_dc = min(block_d, max(16, 8192 // block_s))
    _decode_reduce[(b * hkv * n_rows, triton.cdiv(d, block_dc))](
        o_part, lse_part, sinks if sinks is not None else dummy, out, lse,
        out.stride(0), out.stride(1), out.stride(2),
        hkv, group, lq, d, n_splits,
        BLOCK_S=block_s, BLOCK_DC=block_dc, HAS_SINKS=sinks is not None, RETURN_LSE=return_lse,
        num_warps=4)
