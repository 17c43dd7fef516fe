"""Independent float64 attention, one query row at a time: the ground truth of the attention tests.

Written from the semantics in the issue and in reference.py's docstring, not
from its code: query i of Lq sits at absolute position p_i = i + Lk - Lq
(bottom-right) unless positions are given; key j at position j.  For each row:
  s_j = scale * q.k_j; s_j = softcap * tanh(s_j / softcap); s_j += slope * (pos_j - p_i);
  s_j += additive mask; key j hidden where a boolean mask is False, where
  pos_j < 0 (padding), where causal and pos_j > p_i, and where p_i - pos_j >= window;
  out = sum_j softmax_j * v_j, the softmax denominator including exp(sink) when given.
A row with no visible key outputs zeros; its LSE is the sink, or -inf.
"""

from __future__ import annotations

import math

import torch

# Unit roundoff of each input / compute dtype.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def naive_attention(q, k, v, *, causal=False, sliding_window=None, mask=None, scale=None,
                    softcap=None, sinks=None, alibi_slopes=None, q_positions=None,
                    k_positions=None):
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] -> (out [B, Hq, Lq, D] float64, lse [B, Hq, Lq] float64)."""
    q, k, v = q.double(), k.double(), v.double()
    b_, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if scale is None:
        scale = d ** -0.5
    if mask is not None:
        mask = torch.broadcast_to(mask, (b_, hq, lq, lk))
    out = torch.zeros(b_, hq, lq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b_, hq, lq), -math.inf, dtype=torch.float64)
    for b in range(b_):
        kpos = (torch.arange(lk) if k_positions is None else k_positions[b].cpu()).double()
        for h in range(hq):
            kv = h * hkv // hq  # query heads are grouped in consecutive runs per KV head
            for i in range(lq):
                p = float(i + lk - lq) if q_positions is None else float(q_positions[b][i])
                s = (k[b, kv] @ q[b, h, i]) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if alibi_slopes is not None:
                    s = s + float(alibi_slopes[h]) * (kpos - p)
                visible = kpos >= 0
                if mask is not None:
                    if mask.dtype == torch.bool:
                        visible &= mask[b, h, i].cpu()
                    else:
                        s = s + mask[b, h, i].double().cpu()
                if causal:
                    visible &= kpos <= p
                if sliding_window is not None:
                    visible &= (p - kpos) < sliding_window
                logits = s[visible]
                vals = v[b, kv][visible]
                terms = [logits]
                if sinks is not None:
                    terms.append(torch.tensor([float(sinks[h])], dtype=torch.float64))
                all_logits = torch.cat(terms)
                if all_logits.numel() == 0 or not torch.isfinite(all_logits).any():
                    continue
                m = all_logits[torch.isfinite(all_logits)].max()
                denom = torch.exp(all_logits - m).sum()
                weights = torch.exp(logits - m) / denom
                out[b, h, i] = weights @ vals
                lse[b, h, i] = torch.log(denom) + m
    return out, lse


def float32_attention_tolerance(q, k, v, scale=None, extra_logit=0.0, kv_rel_error=0.0) -> float:
    """Worst-case absolute error bound of float32 attention on these inputs.

    A float32 dot product of length D errs by at most gamma_D * sum_i |q_i k_i|
    (gamma_n = n u / (1 - n u)); softcap, ALiBi and mask terms of size up to
    `extra_logit` add a few roundings each.  A score error delta changes each
    softmax weight by a factor within exp(+-2 delta); summing Lk weighted values
    adds gamma_Lk * max|v|.  So |out - exact| <= max|v| * (exp(2 delta) - 1 + 2 gamma_Lk).
    `kv_rel_error` bounds ||k_used - k|| / ||k|| and the same for v, when the path computes its
    own copy of k and v (a float32 dequantization): it adds |q| |k| scale to delta and |v| to out.
    """
    u = UNIT_ROUNDOFF[torch.float32]
    d, lk = q.shape[-1], k.shape[-2]
    if scale is None:
        scale = d ** -0.5
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    qa = q.double().abs().reshape(-1, d)
    ka = k.double().abs().reshape(-1, d)
    dot_bound = float((qa @ ka.T).amax()) * scale
    qn = float(q.double().norm(dim=-1).amax())
    kn = float(k.double().norm(dim=-1).amax())
    delta = gamma(d + 2) * dot_bound + 8 * u * (dot_bound + extra_logit) + kv_rel_error * qn * kn * scale
    vmax = float(v.double().abs().amax())
    vn = float(v.double().norm(dim=-1).amax())
    return vmax * (math.expm1(2 * delta) + 2 * gamma(lk + 2)) + kv_rel_error * vn + 1e-30
