"""A per-channel affine map of the keys, fitted to the prompt, that attention does not see.

The cache stores k' = (k - shift) * gain instead of k, and attention uses
q' = q / gain, so that

    q . k = q' . k' + q . shift.

The last term is the same for every key of one query, and softmax ignores a
constant added to all of a query's scores: the result is unchanged (exactly,
up to rounding).  Only the quantization error changes, and it shrinks:

- shift (the mean key of the prompt) removes the component every key shares.
  The codec's error is proportional to each vector's norm, and keys carry a
  large common offset (QK-norm models such as Gemma-3 most of all), so
  centered keys quantize with a fraction of the absolute error.
- gain balances the channels between q and k.  A score's error is about
  ||q'|| * ||k'|| * (codec error per unit norm); over the prompt's queries
  and keys, sum_c E[q_c^2]/g_c^2 * sum_c Var[k_c] g_c^2 is smallest at
  g_c = (E[q_c^2] / Var[k_c])^(1/4) (Cauchy-Schwarz).

With keys in channel groups (codec.py), the transform also orders the channels: the stored key is
((k - shift) * gain)[order] and attention reads (q / gain)[order], a permutation that changes no score.  The
order puts the channels of largest variance (over the prompt's keys) first, so that the first group, the one
with the most bits, takes them.

A constant score offset is not invisible to softcap (tanh is not
shift-invariant) or to attention sinks (the sink logit does not move with the
keys), so there the fit keeps shift = 0 (gain alone is exact for any model).
Values are left alone: centering them moved the large error onto the
attention-sink token and cost quality.

Measured (QUALITY.md): the shift alone ("center", the default) halves the
4-bit perplexity loss and keeps passkey retrieval; the gain ("balance") cuts
perplexity further but lost long-context retrievals, so it is opt-in.
"""

from __future__ import annotations

import torch

# Below this many prompt tokens per sequence the statistics are too noisy to trust: no transform.
MIN_FIT_TOKENS = 16
# Channel variances below this fraction of the mean are floored, so that a channel the
# model never uses (variance 0) gets a large but finite gain.
_VARIANCE_FLOOR = 1e-4


# TurboQuantCache(fit_keys=...): "off", "center" (shift only), "balance" (shift and gain).
KEY_FITS = ("off", "center", "balance")


def fit_key_transform(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor | None = None,
                      center: bool = True, balance: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, gain), each [B, Hkv, D] float32, fitted to a prompt's q [B, Hq, T, D] and k [B, Hkv, T, D].

    `valid` [B, T] (bool) marks real tokens (False: padding, ignored).  A
    sequence with fewer than MIN_FIT_TOKENS real tokens gets the identity
    (shift 0, gain 1); center=False fits the gain alone (shift 0), balance=False the
    shift alone (gain 1).
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    if valid is not None and valid.shape != (b, t):
        raise ValueError(f"valid must be [B={b}, T={t}], got {tuple(valid.shape)}")
    # float32 (float64 inputs stay float64): the sums below are tree reductions, so their relative error grows
    # with log T, not T; the variance is taken about the mean (two passes), which keeps a large common offset
    # (QK-norm keys) from cancelling it away.  Unweighted sums when nothing is padded, and the query pass only
    # when the gain is wanted: the fit stays a small fraction of the prefill (BENCHMARKS.md).
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    if valid is None:
        n = torch.full((b, 1, 1, 1), float(t), dtype=work, device=k.device)
        w = None
    else:
        w = valid.to(work)[:, None, :, None]                            # [B, 1, T, 1]
        n = w.sum(dim=2, keepdim=True)                                  # [B, 1, 1, 1]

    def masked_sum(x):  # sum over tokens, padding excluded
        return (x if w is None else x * w).sum(dim=2, keepdim=True)

    kd = k.to(work)
    shift = masked_sum(kd) / n.clamp_min(1) if center else torch.zeros_like(kd[:, :, :1])
    if balance:
        var_k = masked_sum((kd - shift).pow_(2))[:, :, 0] / n[:, :, 0].clamp_min(1)   # [B, Hkv, D]
        group = hq // hkv
        qd = q.to(work).reshape(b, hkv, group * t, d)
        wq = None if w is None else w.repeat(1, 1, group, 1)
        q_sq = qd.pow(2)
        q_energy = (q_sq if wq is None else q_sq * wq).sum(dim=2) / (n[:, :, 0] * group).clamp_min(1)
        var_k = var_k.clamp_min(_VARIANCE_FLOOR * var_k.mean(dim=-1, keepdim=True))
        q_energy = q_energy.clamp_min(_VARIANCE_FLOOR * q_energy.mean(dim=-1, keepdim=True))
        gain = (q_energy / var_k).pow(0.25)
        gain = gain / gain.log().mean(dim=-1, keepdim=True).exp()       # geometric mean 1: magnitudes stay put
    else:
        gain = torch.ones(b, hkv, d, dtype=work, device=k.device)
    shift = shift[:, :, 0]
    usable = (n[:, 0, 0, 0] >= MIN_FIT_TOKENS)[:, None, None] & torch.isfinite(gain) & (gain > 0)
    usable = usable & torch.isfinite(shift)
    gain = torch.where(usable, gain, torch.ones_like(gain))
    shift = torch.where(usable, shift, torch.zeros_like(shift))
    return shift.to(torch.float32), gain.to(torch.float32)


def fit_key_order(k: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """order [B, Hkv, D] int16: each (sequence, KV head)'s channels by the variance of the prompt's keys k
    [B, Hkv, T, D], largest first (ties by channel index).  `valid` [B, T] marks real tokens; a sequence with
    fewer than MIN_FIT_TOKENS of them keeps the identity."""
    b, hkv, t, d = k.shape
    if valid is not None and valid.shape != (b, t):
        raise ValueError(f"valid must be [B={b}, T={t}], got {tuple(valid.shape)}")
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    w = torch.ones(b, 1, t, 1, dtype=work, device=k.device) if valid is None else valid.to(work)[:, None, :, None]
    n = w.sum(dim=2, keepdim=True).clamp_min(1)
    kd = k.to(work)
    mean = (kd * w).sum(dim=2, keepdim=True) / n
    var = ((kd - mean).pow_(2) * w).sum(dim=2) / n[:, :, 0]                   # [B, Hkv, D]
    # A non-finite key makes its channels' variances NaN: they sort last, as if unused.
    var = torch.where(torch.isfinite(var), var, torch.full_like(var, -1.0))
    order = torch.sort(var, dim=-1, descending=True, stable=True).indices
    usable = (n[:, 0, 0, 0] >= MIN_FIT_TOKENS)[:, None, None]
    identity = torch.arange(d, device=k.device).expand(b, hkv, d)
    return torch.where(usable, order, identity).to(torch.int16)


def check_key_order(order: torch.Tensor, shape: tuple[int, int, int], device) -> None:
    """ValueError unless order is an int16 [B, Hkv, D] permutation of the channels on `device` per row."""
    if not isinstance(order, torch.Tensor):
        raise TypeError(f"key order must be a torch.Tensor, got {type(order).__name__}")
    if tuple(order.shape) != shape or order.dtype != torch.int16:
        raise ValueError(f"key order must be int16 of shape {list(shape)} ([B, Hkv, D]), "
                         f"got {order.dtype} {tuple(order.shape)}")
    if order.device != device:
        raise ValueError(f"key order is on {order.device} but the cache is on {device}")
    want = torch.arange(shape[-1], device=device)
    if not bool((order.to(torch.int64).sort(dim=-1).values == want).all()):
        raise ValueError("key order must hold a permutation of the channels in every [b, h] row")


def check_key_transform(shift: torch.Tensor, gain: torch.Tensor, shape: tuple[int, int, int], device) -> None:
    for name, t in (("shift", shift), ("gain", gain)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"key {name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"key {name} must have shape {list(shape)} ([B, Hkv, D]), got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"key {name} is on {t.device} but the cache is on {device}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"key {name} must be finite")
    if not bool((gain > 0).all()):
        raise ValueError("key gain must be positive")


def _channel_index(order: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """order [B, H, D] as a gather index for x [B, H, T, D]."""
    return order.to(torch.int64)[:, :, None, :].expand(x.shape)


def to_stored_keys(k: torch.Tensor, shift: torch.Tensor, gain: torch.Tensor,
                   order: torch.Tensor | None = None) -> torch.Tensor:
    """k [B, Hkv, T, D] -> (k - shift) * gain in float32 (float64 stays float64), as the kernels compute it; its
    channels taken in `order` [B, Hkv, D] when given."""
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    stored = (k.to(work) - shift[:, :, None]) * gain[:, :, None]
    return stored if order is None else stored.gather(-1, _channel_index(order, stored))


def from_stored_keys(k: torch.Tensor, shift: torch.Tensor, gain: torch.Tensor,
                     order: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of to_stored_keys, in k's dtype (float32 or wider for the reference)."""
    if order is not None:
        k = torch.empty_like(k).scatter_(-1, _channel_index(order, k), k)
    return (k / gain[:, :, None].to(k.dtype) + shift[:, :, None].to(k.dtype))


def to_stored_queries(q: torch.Tensor, gain: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] -> q / gain of its KV head (its channels in `order` of that head when given), in q's
    dtype."""
    b, hq, t, d = q.shape
    hkv = gain.shape[1]
    q5 = q.to(torch.float32).reshape(b, hkv, hq // hkv, t, d) / gain[:, :, None, None]
    if order is not None:
        index = order.to(torch.int64)[:, :, None, None, :].expand(q5.shape)
        q5 = q5.gather(-1, index)
    return q5.reshape(b, hq, t, d).to(q.dtype)
