"""Flash-attention prefill: one program per (query tile, batch, query head), and the mask tile pre-pass.

Without a user mask the key range of a query tile is split analytically into
[masked edge | unmasked interior | masked edge], so interior tiles pay for no
mask arithmetic and tiles outside the causal / window band are never visited.
With a user mask, `_classify_tiles` first tags every (query tile, key tile) as
skipped / mixed / plain and the kernel walks a compacted list of the visited tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_lib import LN2, LOG2E
from .config import prefill_config
from .tile import _load_user_bias, _tile_update

# Tile classes written by the pre-pass (the seed's convention).
TILE_SKIP, TILE_MIXED, TILE_PLAIN = 0, 1, 2


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



@triton.jit
def _masked_edge(acc, m_i, l_i, q, lo, hi, K, V, k_desc, v_desc, b, hk, k_base, v_base, offs_d, q_pos, slope,
                 kv_lo, Lk, D, window, stride_kn, stride_vn, qk_scale, softcap,
                 EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Key tiles [lo, hi) that some row of the query tile sees only in part: bounded loads, masked scores."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv_tile(K, V, k_desc, v_desc, b, hk, k_base, v_base, offs_n, offs_d, start_n,
                             Lk, D, stride_kn, stride_vn, True, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
        acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                                     qk_scale, softcap, 0.0, True, False, CAUSAL, HAS_WINDOW,
                                     HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
    return acc, m_i, l_i


# Lengths and counts stay generic so one compiled kernel serves every shape; so do the mask and tile-class
# strides, which are products of lengths.  (The q/k/v/out strides keep their divisibility: it proves the
# alignment of vector loads, and with D a multiple of 16 it does not change with the length.)
@triton.jit(do_not_specialize=["Hq", "group", "Lq", "Lk", "D", "window", "n_q_tiles", "n_k_tiles",
                               "stride_mb", "stride_mh", "stride_mq", "cls_sb", "cls_sh"],
            do_not_specialize_on_alignment=["Mask"])
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
        slope += tl.load(Slopes + h).to(tl.float32) * LOG2E
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
        acc, m_i, l_i = _masked_edge(acc, m_i, l_i, q, t_lo * BLOCK_N, a_end * BLOCK_N, K, V, k_desc, v_desc, b, hk, k_base, v_base,
                                     offs_d, q_pos, slope, kv_lo, Lk, D, window, stride_kn, stride_vn, qk_scale,
                                     softcap, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                     HAS_ALIBI, DOT_PRECISION)
        for start_n in tl.range(a_end * BLOCK_N, b_end * BLOCK_N, BLOCK_N, warp_specialize=WARP_SPEC):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + arange_n
            k, v = _load_kv_tile(K, V, k_desc, v_desc, b, hk, k_base, v_base, offs_n, offs_d, start_n,
                                 Lk, D, stride_kn, stride_vn, False, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
            acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k, v, offs_n, q_pos, slope, kv_lo, Lk, window,
                                         qk_scale, softcap, no_bias, False, False, CAUSAL, HAS_WINDOW,
                                         HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
        acc, m_i, l_i = _masked_edge(acc, m_i, l_i, q, b_end * BLOCK_N, t_hi * BLOCK_N, K, V, k_desc, v_desc, b, hk, k_base, v_base,
                                     offs_d, q_pos, slope, kv_lo, Lk, D, window, stride_kn, stride_vn, qk_scale,
                                     softcap, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                     HAS_ALIBI, DOT_PRECISION)

    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * LOG2E
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
        lse = tl.where(l_i > 0, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
        tl.store(Lse + pid_bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)



@triton.jit(do_not_specialize=["Hc", "Lq", "Lk", "window", "n_k_tiles", "stride_mb", "stride_mh", "stride_mq"],
            do_not_specialize_on_alignment=["Mask"])
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


def _kv_descriptors_ok(*tensors) -> bool:
    """TMA needs 16-byte aligned bases and strides (last dim contiguous)."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def launch_prefill(q, k, v, out, lse, mask, mask_x, mask_bool, m_strides, kv_start, alibi_slopes, sinks,
                   causal, sliding_window, window, qk_scale, softcap_l2, flags, return_lse, skip_tiles,
                   config=None):
    """Prefill of q over k, v into out (and lse); arguments prepared by flash_attention_triton."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    dummy = q  # stands in for absent optional pointers (never read)
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
