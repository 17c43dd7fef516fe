"""The compressed cache's tensors as one view: what every op reads and writes, and nothing else.

A cache object (cache/) owns these tensors and the Python-side bookkeeping
(host length copies, growth, validation); the ops take this view, so that no
kernel file knows about a cache class and nothing below cache/ calls back up.

Layout: codes [B, Hkv, N, D*bits/8] uint8 and scales [B, Hkv, N, D/block]
float32 for K and for V, N = slots.  The token at absolute position p of
sequence b lives in slot p (contiguous) or p mod W (ring of W = sliding
window slots).  `seen[b]` counts tokens appended to sequence b (its next
absolute position); positions < `starts[b]` are left padding, never attended.
With a key transform (key_transform.py), keys are stored as (k - shift) * gain
and attention multiplies q by gain_inv = 1 / gain; with keys in channel groups
(codec.key_groups) their channels are stored in `key_order`.  `nonfinite[b]` counts the
K/V vectors of sequence b stored with a NaN or infinity (NaN scales, see
codec.quantize); quantize-append adds to it on the device.

Exact recent window (`exact_recent` = R > 0): besides its codes, every token
is kept in full precision (`exact_dtype`, the model's domain: before any key
transform) in `recent_k`, `recent_v` [B, Hkv, R + 1, D] while it is one of
the R newest of its sequence: position p lives in row p mod R; row R is a
scratch row that masked writes go to (appends are scatters without a host
sync).  Attention reads positions [seen - R, seen) from these rows and only
older positions from the codes (`recent_positions`).

Exact first tokens (`exact_first` = S > 0, contiguous caches only): the
first S tokens of each sequence, positions starts[b] .. starts[b] + S - 1
(after the left padding), are also kept in full precision (`exact_dtype`,
the model's domain) in `first_k`, `first_v` [B, Hkv, S, D]: position
starts[b] + j lives in row j, visible once stored (starts[b] + j < seen[b]).
Attention reads those positions from these rows, never from their codes
(`first_positions`).  Where they meet the recent window, the first-token rows
win: the window reads only positions >= starts + S, so every position is
attended exactly once.  The rows are tied to `starts`: left padding must be
set before the first append (the cache enforces it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import KVCodec, Packed
from .key_transform import from_stored_keys


# eq=False: tensors have no single truth value.  Not frozen, though nothing assigns to a layout it did not build
# (dataclasses.replace makes another; a cache hands one object out until its tensors change): a frozen dataclass's
# __init__ sets each field through object.__setattr__, ~1.8 µs more per layout than plain stores.
@dataclass(eq=False)
class CacheLayout:
    k_codes: torch.Tensor
    k_scales: torch.Tensor
    v_codes: torch.Tensor
    v_scales: torch.Tensor
    seen: torch.Tensor                       # [B] int32, on the cache's device
    starts: torch.Tensor                     # [B] int32
    sliding_window: int | None = None        # a ring of exactly this many slots when set
    key_shift: torch.Tensor | None = None    # [B, Hkv, D] float32, or None without a key transform
    key_gain: torch.Tensor | None = None
    key_gain_inv: torch.Tensor | None = None
    key_shifted: bool = False                # whether key_shift is non-zero (a host flag: no sync to read it)
    nonfinite: torch.Tensor | None = None    # [B] int32 counter, or None: quantize-append does not count
    # [B, Hkv, 1] int32, zero between launches: the CUDA kernel's fused-merge arrival counters
    # (ops/cached/config.py: CUDA_COUNTERS_PER_HEAD per (sequence, KV head)).  Owned by the
    # cache, so that they are allocated before any CUDA graph is captured (None: the kernel keeps its own).
    merge_counters: torch.Tensor | None = None
    # The exact recent window (module docstring): [B, Hkv, R + 1, D] in the exact dtype, or None with R = 0.
    recent_k: torch.Tensor | None = None
    recent_v: torch.Tensor | None = None
    exact_recent: int = 0
    # The exact first tokens (module docstring): [B, Hkv, S, D] in the exact dtype, or None with S = 0.
    first_k: torch.Tensor | None = None
    first_v: torch.Tensor | None = None
    exact_first: int = 0
    # Keys in channel groups (codec.key_groups): the key transform's channel order [B, Hkv, D] int16 (stored
    # channel j is the model's channel key_order[b, h, j]), or None (the model's order).
    key_order: torch.Tensor | None = None

    def __post_init__(self):
        # What an op derives from the layout alone (the CUDA wrappers: their launches' fixed arguments), by the op's
        # key.  A cache hands out one layout until its tensors change, so a decode step derives it once.  Not a field:
        # the fields are the cache's tensors and flags (dataclasses.replace makes a layout that starts empty).
        self.derived: dict = {}

    def derived_for(self, key: str, codec: KVCodec, make):
        """make(self, codec), kept in `derived` under `key` while the codec is the same object (the result's `codec`)."""
        fixed = self.derived.get(key)
        if fixed is None or fixed.codec is not codec:
            fixed = self.derived[key] = make(self, codec)
        return fixed

    @property
    def batch_size(self) -> int:
        return self.k_codes.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def capacity(self) -> int:
        return self.k_codes.shape[2]

    @property
    def is_ring(self) -> bool:
        return self.sliding_window is not None

    @property
    def exact_row_count(self) -> int:
        """Full-precision rows per (sequence, KV head): the exact recent window's and the exact first tokens'."""
        return self.exact_recent + self.exact_first

    @property
    def has_exact_rows(self) -> bool:
        """Whether some positions are read from full-precision rows (an exact recent window, exact first tokens)."""
        return self.exact_row_count > 0

    @property
    def has_key_transform(self) -> bool:
        return self.key_gain is not None

    @property
    def device(self) -> torch.device:
        return self.k_codes.device


def slot_positions(layout: CacheLayout) -> torch.Tensor:
    """Absolute position held by each slot [B, N] (int64); -1 for empty or padding slots."""
    n = layout.capacity
    slot = torch.arange(n, device=layout.device)[None, :]
    seen = layout.seen.to(torch.int64)[:, None]
    if layout.is_ring:
        # Largest p < seen with p = slot (mod W).
        pos = slot + n * torch.div(seen - 1 - slot, n, rounding_mode="floor")
    else:
        pos = slot.expand(layout.batch_size, -1)
    valid = (pos >= 0) & (pos < seen) & (pos >= layout.starts.to(torch.int64)[:, None])
    return torch.where(valid, pos, torch.full_like(pos, -1))


def recent_positions(layout: CacheLayout) -> torch.Tensor:
    """Absolute position held by each row of the exact window [B, R] (int64): row r holds the p in
    [seen - R, seen) with p = r (mod R); -1 where p < 0, p is padding (p < starts) or p is one of the exact
    first tokens (p < starts + exact_first: those rows win, so no position is read twice)."""
    r_len = layout.exact_recent
    row = torch.arange(r_len, device=layout.device)[None, :]
    seen = layout.seen.to(torch.int64)[:, None]
    pos = seen - r_len + torch.remainder(row - seen, r_len)
    valid = (pos >= 0) & (pos >= layout.starts.to(torch.int64)[:, None] + layout.exact_first)
    return torch.where(valid, pos, torch.full_like(pos, -1))


def first_positions(layout: CacheLayout) -> torch.Tensor:
    """Absolute position held by each row of the exact first tokens [B, S] (int64): row j holds
    starts + j; -1 where that position is not stored yet (starts + j >= seen)."""
    row = torch.arange(layout.exact_first, device=layout.device)[None, :]
    pos = layout.starts.to(torch.int64)[:, None] + row
    return torch.where(pos < layout.seen.to(torch.int64)[:, None], pos, torch.full_like(pos, -1))


def dequantize_slots(layout: CacheLayout, codec: KVCodec,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot as K, V [B, Hkv, N, D] in the model's domain (key transform undone); pair with
    slot_positions().  `codec` is the KVCodec the slots were written with."""
    k = codec.dequantize(Packed(layout.k_codes, layout.k_scales), "k", dtype)
    v = codec.dequantize(Packed(layout.v_codes, layout.v_scales), "v", dtype)
    if layout.has_key_transform:
        k = from_stored_keys(k, layout.key_shift, layout.key_gain, layout.key_order)
    return k, v
