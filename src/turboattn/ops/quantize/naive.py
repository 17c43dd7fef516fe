"""Quantize-append in plain PyTorch: the twin of triton.py, built on the codec's reference coding."""

from __future__ import annotations

import torch

from ...format.codec import KVCodec
from ...format.key_transform import to_stored_keys
from ...format.layout import CacheLayout


def quantize_append_naive(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, codec: KVCodec,
                          new_lengths: torch.Tensor | None) -> None:
    """Write k, v [B, Hkv, T, D] into each sequence's next slots (layout.seen is not advanced here).

    new_lengths [B] (None: all T) counts the real tokens of each sequence; a ring keeps the
    last W of a longer chunk, a contiguous cache the tokens that fit in its capacity.  Keys go through the key transform first, as the cache codes them.
    layout.nonfinite (when set) counts the stored vectors that held a NaN or infinity.
    """
    t = k.shape[2]
    seen = layout.seen.tolist()
    n = [t] * layout.batch_size if new_lengths is None else new_lengths.tolist()
    if layout.has_key_transform:
        k = to_stored_keys(k, layout.key_shift, layout.key_gain)
    for b in range(layout.batch_size):
        if not layout.is_ring:
            n[b] = min(n[b], max(layout.capacity - seen[b], 0))  # a full static cache stores what fits
        first = max(0, n[b] - layout.capacity)  # a ring keeps only the last W of a long chunk
        if n[b] <= first:
            continue
        slots = torch.arange(seen[b] + first, seen[b] + n[b], device=layout.device) % layout.capacity
        for kind, x, codes, scales in (("k", k, layout.k_codes, layout.k_scales),
                                       ("v", v, layout.v_codes, layout.v_scales)):
            packed = codec.quantize(x[b, :, first:n[b]], kind)
            codes[b, :, slots] = packed.codes
            scales[b, :, slots] = packed.scales
            if layout.nonfinite is not None:  # a NaN scale marks a vector that held a NaN or infinity
                layout.nonfinite[b] += packed.scales.isnan().any(dim=-1).sum().to(torch.int32)
