"""Dense flash attention on the GPU (or the interpreter): picks SDPA, split-K decode or prefill and launches it.

Semantics are naive.attention_reference's: query row i sits at position
i + Lk - Lq (bottom-right causal), key j is visible iff kv_start[b] <= j < Lk,
j <= pos (causal), pos - j < window (sliding window) and the user mask keeps it.
Scores: s = q.k * scale -> softcap * tanh(s / softcap) -> + slope * (j - pos)
-> + additive mask / -inf.  Sinks join the softmax denominator.  Rows that see
no key give zeros and LSE -inf.  The kernels work in the log2 domain; LSE is
returned in natural log.
"""

from __future__ import annotations

import math

import torch

from ..triton_lib import LOG2E
from .config import flash_path
from .decode import launch_decode
from .prefill import launch_prefill


def _check_kv_start(kv_start, b: int, device) -> None:
    if not isinstance(kv_start, torch.Tensor):
        raise TypeError(f"kv_start must be an int32 tensor of shape [{b}], got {type(kv_start).__name__}")
    if kv_start.shape != (b,) or kv_start.dtype != torch.int32:
        raise ValueError(f"kv_start must be int32 of shape [{b}], got {kv_start.dtype} {tuple(kv_start.shape)}")
    if kv_start.device != device:
        raise ValueError(f"kv_start is on {kv_start.device} but q is on {device}")


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
        qk_scale, softcap_l2 = scale / softcap, softcap * LOG2E.value
    else:
        qk_scale, softcap_l2 = scale * LOG2E.value, 1.0
    window = int(sliding_window) if sliding_window is not None else 0
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if mask is not None:
        mask_x = mask.expand(b, hq, lq, lk)
        mask_bool = mask.dtype == torch.bool
        if mask_bool:
            mask_x = mask_x.view(torch.uint8)
        m_strides = mask_x.stride()
    else:
        mask_x, mask_bool, m_strides = q, False, (0, 0, 0, 0)
    flags = dict(CAUSAL=bool(causal), HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
                 HAS_ALIBI=alibi_slopes is not None, HAS_KV_START=kv_start is not None,
                 HAS_MASK=mask is not None, MASK_BOOL=mask_bool, DOT_PRECISION=dot_precision)

    if path == "decode":
        launch_decode(q, k, v, out, lse, mask_x, m_strides, kv_start, alibi_slopes, sinks, window, qk_scale,
                      softcap_l2, flags, return_lse, config)
    else:
        launch_prefill(q, k, v, out, lse, mask, mask_x, mask_bool, m_strides, kv_start, alibi_slopes, sinks,
                       causal, sliding_window, window, qk_scale, softcap_l2, flags, return_lse, skip_tiles, config)
    return (out, lse) if return_lse else out
