"""The online-softmax tile update shared by the prefill and decode flash kernels, and the user-mask load.

Scores follow naive.attention_reference: s = q.k * scale -> softcap * tanh(s / softcap)
-> + slope * (j - pos) (ALiBi) -> + additive mask / -inf, all in log2 units.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_lib import LOG2E, dot, online_softmax, tanh


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
    s = dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        s = softcap * tanh(s * qk_scale)
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
    # A row with nothing visible so far keeps m = -inf (only possible on masked tiles).
    p, m_new, alpha, l_i = online_softmax(s, m_i, l_i, MASKED)
    acc = acc * alpha[:, None]
    acc = dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_user_bias(Mask, mask_rows, offs_n, row_ok, Lk, stride_mk, MASK_BOOL: tl.constexpr):
    """User mask tile as an additive log2-domain bias: 0 / -inf for boolean masks."""
    ptrs = Mask + mask_rows[:, None] + offs_n[None, :].to(tl.int64) * stride_mk
    inb = row_ok[:, None] & (offs_n[None, :] < Lk)
    if MASK_BOOL:
        keep = tl.load(ptrs, mask=inb, other=0)
        return tl.where(keep != 0, 0.0, float("-inf"))
    return tl.load(ptrs, mask=inb, other=0.0).to(tl.float32) * LOG2E
