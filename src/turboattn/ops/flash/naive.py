"""Exact attention in plain PyTorch: the reference every kernel is tested against.

Score of query i (absolute position p_i = i + Lk - Lq, "bottom-right" aligned)
against key j, in this order:
  s = q.k * scale; s = softcap * tanh(s / softcap); s += slope * (j - p_i) (ALiBi);
  s += mask (additive) or s = -inf where a boolean mask is False;
  s = -inf where causal and j > p_i, or where p_i - j >= sliding_window.
Softmax over the keys, plus exp(sink) in the denominator when sinks are given
(gpt-oss).  A row with no visible key outputs zeros and LSE -inf (or the sink's
logit).  The LSE returned is log of the full denominator, sink included.
"""

from __future__ import annotations

import math

import torch


def visibility(q_positions: torch.Tensor, k_positions: torch.Tensor, causal: bool,
               sliding_window: int | None) -> torch.Tensor:
    """Boolean [..., Lq, Lk]: key position visible from query position."""
    diff = q_positions[..., :, None] - k_positions[..., None, :]
    keep = torch.ones_like(diff, dtype=torch.bool)
    if causal:
        keep &= diff >= 0
    if sliding_window is not None:
        keep &= diff < sliding_window
    return keep


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False, sliding_window: int | None = None,
                        mask: torch.Tensor | None = None, scale: float | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None,
                        alibi_slopes: torch.Tensor | None = None,
                        q_positions: torch.Tensor | None = None,
                        k_positions: torch.Tensor | None = None,
                        return_lse: bool = False, compute_dtype: torch.dtype = torch.float32):
    """q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] -> out [B, Hq, Lq, Dv] (q.dtype).

    GQA: query head h reads KV head h // (Hq // Hkv).  `mask` broadcasts to
    [B, Hq, Lq, Lk].  `q_positions` [B, Lq] / `k_positions` [B, Lk] override the
    default bottom-right positions (used for caches); key positions < 0 are
    treated as padding and never attended.  Computes in `compute_dtype`.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    dt = compute_dtype
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    kx = k.to(dt).repeat_interleave(group, dim=1)
    vx = v.to(dt).repeat_interleave(group, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(dt), kx) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)

    if q_positions is None:
        q_positions = torch.arange(lq, device=q.device)[None] + (lk - lq)
    if k_positions is None:
        k_positions = torch.arange(lk, device=q.device)[None]
    q_positions = q_positions.to(q.device).expand(b, lq)
    k_positions = k_positions.to(q.device).expand(b, lk)
    keep = visibility(q_positions, k_positions, causal, sliding_window)
    keep &= (k_positions >= 0)[:, None, :]
    keep = keep[:, None]  # [B, 1, Lq, Lk]

    if alibi_slopes is not None:
        rel = (k_positions[:, None, :] - q_positions[:, :, None]).to(dt)  # [B, Lq, Lk]
        s = s + alibi_slopes.to(dt).reshape(-1, hq, 1, 1) * rel[:, None]
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.to(dt)
    s = s.masked_fill(~keep, -math.inf)

    m = s.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(dt).reshape(1, hq, 1, 1)
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    out = torch.einsum("bhqk,bhkd->bhqd", p, vx) / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = out.to(q.dtype)
    if return_lse:
        lse = (torch.log(denom) + m).squeeze(-1)
        return out, lse
    return out


def flash_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                          sliding_window: int | None = None, mask: torch.Tensor | None = None,
                          scale: float | None = None, softcap: float | None = None,
                          sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                          return_lse: bool = False):
    """The twin of triton.flash_attention_triton, with its signature: attention_reference in float32."""
    return attention_reference(q, k, v, causal=causal, sliding_window=sliding_window, mask=mask, scale=scale,
                               softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, return_lse=return_lse)
