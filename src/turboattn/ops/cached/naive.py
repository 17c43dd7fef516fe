"""Attention over the compressed cache in plain PyTorch: the twin of triton.py.

Dequantizes every slot, attaches absolute positions and runs the exact
reference attention; the Triton kernel must agree with it within the float16
rounding of its dot operands.

Non-finite values: a key whose K or V vector is not finite (a NaN-scaled slot,
or a fresh k/v row holding a NaN or infinity) makes the output row of every
query that sees it NaN, and changes nothing for the queries that do not (a
hidden key's value never meets a zero weight: 0 * NaN would leak).

Exact recent window (layout.exact_recent = R > 0): the slots of positions
>= seen - R are replaced by the exact rows of recent_k / recent_v (positions
from layout.recent_positions), so those positions are read in full precision.

Exact first tokens (layout.exact_first = S > 0): the slots of positions
< starts + S are replaced by the rows of first_k / first_v (positions from
layout.first_positions); the window then holds only positions >= starts + S
(recent_positions), so a position among both is read once, from first_k.
"""

from __future__ import annotations

import torch

from ...format.codec import KVCodec
from ...format.layout import (CacheLayout, dequantize_slots, first_positions, recent_positions,
                               slot_positions)
from ..flash.naive import attention_reference, visibility


def cached_attention_naive(q: torch.Tensor, layout: CacheLayout, codec: KVCodec, k: torch.Tensor | None = None,
                           v: torch.Tensor | None = None, scale: float | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           plan=None, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [B, Hq, Tq, D] over the cache (plus fresh k, v [B, Hkv, Tq, D] after it); semantics of
    attention.cached_attention.  `plan` (the kernels' launch plan) is accepted and ignored."""
    tq = q.shape[2]
    k_all, v_all = dequantize_slots(layout, codec, compute_dtype)
    k_pos = slot_positions(layout)
    seen = layout.seen.to(torch.int64)[:, None]
    offsets = torch.arange(tq, device=q.device)[None]
    if layout.exact_recent:
        # Positions [seen - R, seen) come from the exact window instead of their codes.
        r_len = layout.exact_recent
        k_pos = torch.where(k_pos >= seen - r_len, torch.full_like(k_pos, -1), k_pos)
        k_all = torch.cat([k_all, layout.recent_k[:, :, :r_len].to(compute_dtype)], dim=2)
        v_all = torch.cat([v_all, layout.recent_v[:, :, :r_len].to(compute_dtype)], dim=2)
        k_pos = torch.cat([k_pos, recent_positions(layout)], dim=1)
    if layout.exact_first:
        # Positions [starts, starts + S) come from the first-token rows instead of their codes.
        first_end = layout.starts.to(torch.int64)[:, None] + layout.exact_first
        k_pos = torch.where(k_pos < first_end, torch.full_like(k_pos, -1), k_pos)
        k_all = torch.cat([k_all, layout.first_k.to(compute_dtype)], dim=2)
        v_all = torch.cat([v_all, layout.first_v.to(compute_dtype)], dim=2)
        k_pos = torch.cat([k_pos, first_positions(layout)], dim=1)
    if k is not None:
        fresh_pos = seen + offsets
        fresh_pos = torch.where(fresh_pos >= layout.starts.to(torch.int64)[:, None], fresh_pos, -1)
        k_all = torch.cat([k_all, k.to(compute_dtype)], dim=2)
        v_all = torch.cat([v_all, v.to(compute_dtype)], dim=2)
        k_pos = torch.cat([k_pos, fresh_pos], dim=1)
        q_pos = seen + offsets
    else:
        q_pos = seen - tq + offsets
    bad = ~(torch.isfinite(k_all).all(dim=-1) & torch.isfinite(v_all).all(dim=-1))  # [B, Hkv, keys]
    k_all = k_all.masked_fill(bad[..., None], 0.0)
    v_all = v_all.masked_fill(bad[..., None], 0.0)
    out = attention_reference(q, k_all, v_all, causal=True, sliding_window=layout.sliding_window,
                              scale=scale, softcap=softcap, sinks=sinks,
                              q_positions=q_pos, k_positions=k_pos, compute_dtype=compute_dtype)
    seen_by = visibility(q_pos, k_pos, True, layout.sliding_window) & (k_pos >= 0)[:, None, :]  # [B, Tq, keys]
    group = q.shape[1] // layout.num_kv_heads
    hit = (seen_by[:, None] & bad.repeat_interleave(group, dim=1)[:, :, None, :]).any(dim=-1)  # [B, Hq, Tq]
    return out.masked_fill(hit[..., None], float("nan"))
