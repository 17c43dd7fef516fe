"""Quantize-append in plain PyTorch: the twin of triton.py and cuda.py, built on the codec's reference coding.

An append does three things, in this order (each reads the lengths as they were before it): code the real tokens
into the slots after seen[b]; copy the ones the exact rows keep (format/layout.py) into them; advance seen[b] by the
real tokens (unless the caller does: `advance=False`).  `store_exact_rows` and `advance_lengths` are also the Triton path's (its kernel codes only)."""

from __future__ import annotations

import torch

from ...format.codec import KVCodec
from ...format.key_transform import to_stored_keys
from ...format.layout import CacheLayout


def quantize_append_naive(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, codec: KVCodec,
                          new_lengths: torch.Tensor | None, advance: bool = True) -> None:
    """Append k, v [B, Hkv, T, D] to the cache: codes, exact rows, and (advance) the lengths.

    new_lengths [B] (None: all T) counts the real tokens of each sequence; a ring keeps the
    last W of a longer chunk, a contiguous cache the tokens that fit in its capacity (the exact rows
    take theirs whether or not the codes had room).  Keys go through the key transform first, as the
    cache codes them.  layout.nonfinite (when set) counts the stored vectors that held a NaN or infinity.
    advance=False leaves seen to the caller (the torch op, ops/library.py, says why).
    """
    t = k.shape[2]
    seen = layout.seen.tolist()
    n = [t] * layout.batch_size if new_lengths is None else new_lengths.tolist()
    store_exact_rows(k, v, layout, new_lengths)
    coded = to_stored_keys(k, layout.key_shift, layout.key_gain, layout.key_order) if layout.has_key_transform else k
    for b in range(layout.batch_size):
        count = n[b] if layout.is_ring else min(n[b], max(layout.capacity - seen[b], 0))  # what fits
        first = max(0, count - layout.capacity)  # a ring keeps only the last W of a long chunk
        if count <= first:
            continue
        slots = torch.arange(seen[b] + first, seen[b] + count, device=layout.device) % layout.capacity
        for kind, x, codes, scales in (("k", coded, layout.k_codes, layout.k_scales),
                                       ("v", v, layout.v_codes, layout.v_scales)):
            packed = codec.quantize(x[b, :, first:count], kind)
            codes[b, :, slots] = packed.codes
            scales[b, :, slots] = packed.scales
            if layout.nonfinite is not None:  # a NaN scale marks a vector that held a NaN or infinity
                layout.nonfinite[b] += packed.scales.isnan().any(dim=-1).sum().to(torch.int32)
    if advance:
        advance_lengths(layout, new_lengths, t)


def advance_lengths(layout: CacheLayout, new_lengths: torch.Tensor | None, t: int) -> None:
    """seen[b] += the real tokens of the append, on the device (no host copy: capturable in a CUDA graph)."""
    if new_lengths is None:
        layout.seen += t
    else:
        layout.seen += new_lengths.to(layout.seen.dtype)


def store_exact_rows(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, new_lengths: torch.Tensor | None) -> None:
    """Copy the real tokens that the exact rows keep into them (raw: the model's domain), positions from the device
    `seen` before the append (no sync)."""
    if layout.exact_recent:
        _store_recent(k, v, layout, new_lengths)
    if layout.exact_first:
        _store_first(k, v, layout, new_lengths)


def _store_recent(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, new_lengths: torch.Tensor | None) -> None:
    """Token j of sequence b (position seen[b] + j) goes to row (seen[b] + j) % R when it is among the last R of the
    n[b] real ones, else to the scratch row R: one scatter per tensor (and a gather with ragged lengths).  The real
    writes of a sequence are at most R consecutive positions, so no two share a row."""
    r_len, t = layout.exact_recent, k.shape[2]
    b, hkv, d = layout.batch_size, layout.num_kv_heads, k.shape[3]
    width = min(t, r_len)
    dtype = layout.recent_k.dtype
    if new_lengths is None:
        # All real (a decode step): the chunk's last `width` tokens, rows (seen + j) % R, j in [t - width, t);
        # no gather, no masking: the same writes in a third of the small ops (each a launch on a GPU).
        pos = layout.seen.to(torch.int64).view(-1, 1)
        if t > 1:
            pos = pos + torch.arange(t - width, t, device=pos.device)
        put = torch.remainder(pos, r_len).view(b, 1, width, 1).expand(-1, hkv, -1, d)
        for ring, x in ((layout.recent_k, k), (layout.recent_v, v)):
            x = x[:, :, t - width:] if width < t else x
            ring.scatter_(2, put, x if x.dtype == dtype else x.to(dtype))
        return
    i = torch.arange(width, device=k.device)[None, :]                         # [1, width]
    j = new_lengths.to(torch.int64)[:, None] - width + i                      # [B, width]
    real = j >= 0
    row = torch.where(real, torch.remainder(layout.seen.to(torch.int64)[:, None] + j, r_len),
                      torch.full_like(j, r_len))
    take = j.clamp(min=0)[:, None, :, None].expand(-1, hkv, -1, d)
    put = row[:, None, :, None].expand(-1, hkv, -1, d)
    for ring, x in ((layout.recent_k, k), (layout.recent_v, v)):
        ring.scatter_(2, put, x.gather(2, take).to(dtype))


def _store_first(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, new_lengths: torch.Tensor | None) -> None:
    """Row j takes token i = starts + j - seen of the chunk when 0 <= i < n[b] (a real token of this append), else
    keeps what it holds: one gather and one masked copy per tensor."""
    t, hkv, d = k.shape[2], layout.num_kv_heads, k.shape[3]
    j = torch.arange(layout.exact_first, device=k.device)[None, :]
    i = layout.starts.to(torch.int64)[:, None] + j - layout.seen.to(torch.int64)[:, None]     # [B, S]
    count = t if new_lengths is None else new_lengths.to(torch.int64)[:, None]
    write = ((i >= 0) & (i < count))[:, None, :, None]
    take = i.clamp(min=0, max=t - 1)[:, None, :, None].expand(-1, hkv, -1, d)
    for rows, x in ((layout.first_k, k), (layout.first_v, v)):
        rows.copy_(torch.where(write, x.gather(2, take).to(rows.dtype), rows))
