"""A TurboQuantLayer that scores a chunk of teacher-forced tokens as one-token decode steps would (eval only).

`turboattn eval` scores decode mode (a step reads every earlier token
quantized and its own K/V in full precision) in chunks, which is only exact
through this layer; tests/test_evaluate.py shows it equals real one-token
steps.  It uses the layer's public surface only: `cache`, `store`,
`sliding_window` and `TurboQuantLayer.attend`.
"""

from __future__ import annotations

import torch

from ..ops.flash.naive import attention_reference
from .hf import TurboQuantLayer


class DecodeEmulationLayer(TurboQuantLayer):
    """Scores a chunk of T teacher-forced tokens as T decode steps would, in one call.

    In decode mode, the query at position p reads every earlier token
    quantized and its own K/V in full precision.  Here the cache is
    dequantized once per chunk (the reference path does the same inside
    cached_attention), the chunk is attached twice, through a codec round
    trip and in full precision, and a mask lets query i see the round-trip
    keys of earlier chunk tokens and only its own full-precision one.
    """

    @classmethod
    def from_layer(cls, layer: TurboQuantLayer) -> DecodeEmulationLayer:
        """The same layer (same settings, same cache object) with this class's attend."""
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        return new

    def attend(self, q, k, v, padding_mask, scale, softcap, sinks):
        if self.cache.is_empty or q.shape[2] == 1:
            return super().attend(q, k, v, padding_mask, scale, softcap, sinks)
        t, cache, dev = q.shape[2], self.cache, q.device
        k_past, v_past = cache.dequantize(torch.float32)          # before the chunk: nothing evicted yet
        past_pos = cache.slot_positions()                           # [B, N], -1 = empty
        k_hat, v_hat = (x.float() for x in cache.round_trip(k, v))  # the chunk as the cache will hold it
        q_pos = cache.seen.to(torch.int64)[:, None] + torch.arange(t, device=dev)[None]
        b = q.shape[0]
        earlier = torch.ones(t, t, dtype=torch.bool, device=dev).tril(-1)   # chunk keys before the query
        own = torch.eye(t, dtype=torch.bool, device=dev)                    # the query's own fresh K/V
        keep = torch.cat([torch.ones(b, t, past_pos.shape[1], dtype=torch.bool, device=dev),
                          earlier.expand(b, t, t), own.expand(b, t, t)], dim=2)[:, None]
        out = attention_reference(q, torch.cat([k_past, k_hat, k.float()], 2),
                                  torch.cat([v_past, v_hat, v.float()], 2),
                                  causal=True, sliding_window=self.sliding_window, mask=keep, scale=scale,
                                  softcap=softcap, sinks=sinks, q_positions=q_pos,
                                  k_positions=torch.cat([past_pos, q_pos, q_pos], 1))
        self.store(k, v)
        return out
