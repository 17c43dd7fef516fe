"""A TurboQuantLayer that scores a chunk of teacher-forced tokens as one-token decode steps would (eval only).

`turboattn eval` scores decode mode (a step reads every earlier token
quantized and its own K/V in full precision) in chunks, which is only exact
through this layer; tests/test_evaluate.py shows it equals real one-token
steps.  It uses the layer's public surface only: `cache`, `store`,
`sliding_window` and `TurboQuantLayer.attend`.
"""

from __future__ import annotations

import torch

from ..format.layout import first_positions, recent_positions
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

    With an exact recent window of R tokens, a decode step at position p reads
    positions [p - R, p) exactly and older ones through their codes; here the
    past window (recent_k / recent_v) and the chunk cast to the window's dtype
    join the keys, and the mask picks, per query, the exact copy of the R
    positions before it and the coded copy of the older ones.

    With exact first tokens (S), a decode step at p reads positions [starts, starts + S) below p exactly
    and never through their codes or the window (the first rows win); here the stored first rows
    (first_k / first_v) and the chunk's copies of first positions (in the exact dtype) join the keys,
    and every coded or window key below starts + S is masked out.
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
        r_len = cache.exact_recent
        earlier = torch.ones(t, t, dtype=torch.bool, device=dev).tril(-1 - r_len)   # coded chunk keys
        own = torch.eye(t, dtype=torch.bool, device=dev)                    # the query's own fresh K/V
        keys, values = [k_past, k_hat, k.float()], [v_past, v_hat, v.float()]
        positions = [past_pos, q_pos, q_pos]
        masks = [torch.ones(b, t, past_pos.shape[1], dtype=torch.bool, device=dev), earlier.expand(b, t, t),
                 own.expand(b, t, t)]
        if r_len:
            # Coded past keys only below p - R; the window's exact rows and the chunk's exact copies
            # (in the window's dtype, as append stores them) for positions [p - R, p).
            masks[0] = past_pos[:, None, :] < q_pos[:, :, None] - r_len
            ring_pos = recent_positions(cache.layout)
            in_window = torch.ones(t, t, dtype=torch.bool, device=dev).tril(-1) & ~earlier
            keys += [cache.recent_k[:, :, :r_len].float(), k.to(cache.exact_dtype).float()]
            values += [cache.recent_v[:, :, :r_len].float(), v.to(cache.exact_dtype).float()]
            positions += [ring_pos, q_pos]
            masks += [ring_pos[:, None, :] >= q_pos[:, :, None] - r_len, in_window.expand(b, t, t)]
        s_len = cache.exact_first
        if s_len:
            first_end = cache.starts.to(torch.int64)[:, None] + s_len                 # [B, 1]
            masks[0] = masks[0] & (past_pos >= first_end)[:, None, :]
            later = (q_pos >= first_end)[:, None, :]                                   # chunk keys past them
            masks[1] = masks[1] & later
            if r_len:
                masks[4] = masks[4] & later
            first_pos = first_positions(cache.layout)
            keys += [cache.first_k.float(), k.to(cache.exact_dtype).float()]
            values += [cache.first_v.float(), v.to(cache.exact_dtype).float()]
            positions += [first_pos, q_pos]
            before = torch.ones(t, t, dtype=torch.bool, device=dev).tril(-1)
            masks += [(first_pos >= 0)[:, None, :].expand(b, t, s_len), before & ~later]
        out = attention_reference(q, torch.cat(keys, 2), torch.cat(values, 2),
                                  causal=True, sliding_window=self.sliding_window, mask=torch.cat(masks, 2)[:, None],
                                  scale=scale, softcap=softcap, sinks=sinks, q_positions=q_pos,
                                  k_positions=torch.cat(positions, 1))
        self.store(k, v)
        return out
