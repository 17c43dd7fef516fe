"""QuantizedKVCache: compressed K/V storage, contiguous or ring (sliding window), growing or static.

The tensors (format/layout.py says what each holds) live on the device, so
decode steps need no host synchronization.  The ops take `cache.layout`, a
view of those tensors, never the cache itself.

Two ways to know the lengths:

- growing (default): a host copy of the lengths makes overflow checks free
  and lets the cache grow (`reserve`); but it is a Python value that changes
  every step, which torch.compile specializes on (a recompile per step);
- static (`static=True`): the lengths live on the device only, so append and
  attention read nothing on the host and a compiled or CUDA-graph-captured
  decode step is the same every step.  The capacity is fixed.  An append that
  runs past it cannot be refused without a sync: it stores the tokens that fit
  (the kernels never write past the last slot), `seen` still counts every
  token, and `overflowed` turns True; attention then misses the dropped
  tokens.  Edits (crop, batch selection) and `max_seen` read the lengths back
  (a sync): they are not decode-step work.

An optional key transform (key_transform.py: shift and gain [B, Hkv, D]) is
set while the cache is empty; keys are then stored as (k - shift) * gain, and
`dequantize` undoes it, so every reader sees keys in the model's domain.  With
keys in channel groups (codec.key_groups) the transform also carries the
channel order the groups take (`key_order`).

A K or V vector holding a NaN or infinity is stored as NaN (codec.quantize), so it reaches the
outputs of exactly the queries that see it; `nonfinite` counts such vectors per sequence on the
device, and `received_nonfinite()` reads it (the only host sync).

Exact recent window (`exact_recent=R`, default 0 = off): every token is still coded as above, and the
R newest of each sequence are also kept in full precision (`exact_dtype`, the model's domain) in a
small ring, `recent_k` / `recent_v` [B, Hkv, R + 1, D] (layout.py); attention reads positions
[seen - R, seen) from it and older ones from the codes.  An append writes its last min(T, R) real
tokens there (positions from the device `seen`: no host sync), in the same op that codes them (one launch
on the CUDA path).  A crop that drops tokens
whose exact copies were overwritten refills those rows from the codes (crop's docstring).

Exact first tokens (`exact_first=S`, default 0 = off; contiguous caches only, a ring raises ValueError:
its first tokens leave the window): the first S real tokens of each sequence (positions starts[b] + j,
j < S) are also kept in `first_k` / `first_v` [B, Hkv, S, D] (exact_dtype, row j), written by the append
that brings them (positions from the device `seen`: no host sync), and
attention reads them from there, never from their codes.  The first-token rows win over the recent window
(which then reads only positions >= starts + S).  Left padding must be set while the cache is empty
(set_left_padding raises otherwise): the rows are indexed from `starts`.  A crop below starts + S zeroes the
rows it drops; they are invisible by the position rule (starts + j >= seen) until appended again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from numbers import Integral
from operator import add

import torch

from ..format.codec import ATTENTION_DTYPES, META_DEVICE, KVCodec, check_attention_dtype
from ..format.key_transform import check_key_order, check_key_transform, from_stored_keys, to_stored_keys
from ..format.layout import CacheLayout, dequantize_slots, recent_positions, slot_positions
from ..ops import backend as registry
from ..ops.backend import check_backend, choose
from ..ops.cached.config import CUDA_COUNTERS_PER_HEAD
from ..ops.device_tables import allocate_device_tables
from ..ops.library import append_launcher, run_quantize_append


def _is_int(x) -> bool:
    """A Python int that is not a bool (True is no size)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _host_ints(values) -> list[int] | None:
    """A sequence or integer tensor of ints as a flat host list; None for anything else (1.5 is no length)."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            return None
        return values.reshape(-1).tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        return None
    if not all(isinstance(x, Integral) and not isinstance(x, bool) for x in values):
        return None
    return [int(x) for x in values]


class QuantizedKVCache:
    def __init__(self, codec: KVCodec, batch_size: int, num_kv_heads: int, capacity: int | None = None,
                 sliding_window: int | None = None, device=None, static: bool = False, exact_recent: int = 0,
                 exact_dtype: torch.dtype = torch.bfloat16, exact_first: int = 0):
        if not isinstance(codec, KVCodec):
            raise TypeError(f"codec must be a turboattn.KVCodec, got {type(codec).__name__}")
        for name, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if sliding_window is not None:
            if not _is_int(sliding_window) or sliding_window < 1:
                raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
            if capacity not in (None, sliding_window):
                raise ValueError(f"a ring cache holds exactly sliding_window={sliding_window} tokens; "
                                 f"pass capacity=None or {sliding_window}, got {capacity!r}")
            capacity = sliding_window
        if not _is_int(capacity) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if not isinstance(static, bool):
            raise TypeError(f"static must be a bool, got {type(static).__name__}")
        if not _is_int(exact_recent) or exact_recent < 0:
            raise ValueError(f"exact_recent must be a non-negative int (0: off), got {exact_recent!r}")
        if sliding_window is not None and exact_recent >= sliding_window:
            raise ValueError(f"exact_recent={exact_recent} must be smaller than sliding_window={sliding_window} "
                             "(a ring cache's window bounds what attention sees)")
        if not _is_int(exact_first) or exact_first < 0:
            raise ValueError(f"exact_first must be a non-negative int (0: off), got {exact_first!r}")
        if sliding_window is not None and exact_first:
            raise ValueError(f"exact_first={exact_first} needs a contiguous cache: a ring cache "
                             f"(sliding_window={sliding_window}) loses its first tokens")
        if exact_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"exact_dtype must be torch.float16, torch.bfloat16 or torch.float32, got {exact_dtype!r}")
        try:
            device = torch.device(device) if device is not None else torch.device("cpu")
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be a torch.device or a device string such as 'cpu' or 'cuda:0', "
                             f"got {device!r}") from None
        self.codec = codec
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.capacity = capacity
        self.sliding_window = sliding_window

        shape = (batch_size, num_kv_heads, capacity)
        self.k_codes = torch.zeros(*shape, codec.code_bytes("k"), dtype=torch.uint8, device=device)
        # The device tensors report ("cuda:0" for "cuda", "cpu" for "cpu:0"), so that
        # comparisons with the inputs' devices succeed.
        self.device = self.k_codes.device
        self.v_codes = torch.zeros(*shape, codec.code_bytes("v"), dtype=torch.uint8, device=self.device)
        self.k_scales = torch.zeros(*shape, codec.scale_count("k"), dtype=codec.scale_dtype, device=self.device)
        self.v_scales = torch.zeros(*shape, codec.scale_count("v"), dtype=codec.scale_dtype, device=self.device)
        self.seen = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        self.starts = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        # Vectors stored with a NaN or infinity, per sequence: counted by the quantize kernel, so that
        # checking costs nothing until someone asks (received_nonfinite).
        self.nonfinite = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        self.merge_counters = torch.zeros(batch_size, num_kv_heads, CUDA_COUNTERS_PER_HEAD, dtype=torch.int32,
                                          device=self.device)
        # The exact recent window: position p in row p % R, row R a scratch row for masked writes.
        self.exact_recent = exact_recent
        self.exact_dtype = exact_dtype
        self.recent_k = self.recent_v = None
        if exact_recent:
            window_shape = (batch_size, num_kv_heads, exact_recent + 1, codec.head_dim)
            self.recent_k = torch.zeros(window_shape, dtype=exact_dtype, device=self.device)
            self.recent_v = torch.zeros(window_shape, dtype=exact_dtype, device=self.device)
        # The exact first tokens: position starts[b] + j in row j.
        self.exact_first = exact_first
        self.first_k = self.first_v = None
        if exact_first:
            first_shape = (batch_size, num_kv_heads, exact_first, codec.head_dim)
            self.first_k = torch.zeros(first_shape, dtype=exact_dtype, device=self.device)
            self.first_v = torch.zeros(first_shape, dtype=exact_dtype, device=self.device)
        # The host copy of `seen` (growing mode only).  `_empty` is is_empty: a growing cache's max(_seen_host) == 0,
        # kept by every change of _seen_host (a decode step asks twice per layer); a static cache's, whether anything
        # was appended (a flag that stays put during decoding, so compiled code need not re-specialize).
        self._seen_host: list[int] | None = None if static else [0] * batch_size
        self._empty = True
        # A host bound on `starts` (every edit of starts raises it or keeps it valid): once each sequence of a growing
        # cache holds its first exact_first real tokens, an append can write no first-token row, and skips the copy.
        self._starts_bound = 0
        self.key_shift: torch.Tensor | None = None
        self.key_gain: torch.Tensor | None = None
        self.key_gain_inv: torch.Tensor | None = None   # 1 / gain, what the kernels multiply q by
        self.key_order: torch.Tensor | None = None      # keys in channel groups: their channel order (layout.py)
        self._key_shifted = False
        self._key_buffers: tuple[torch.Tensor, ...] | None = None   # static: the transform's fixed storage
        self._layouts: tuple[CacheLayout, CacheLayout | None] | None = None   # `layout`'s, see _layout_views
        # What a decode step derives once (eager only; dropped when the tensors change): attention.py's _DecodeStep for
        # the next call of cached_attention, and _append_validated's launchers (_new_append_launches).
        self._attention_step = None
        self._append_launches: tuple | None = None
        self._mark_static()
        if self.device.type == "cuda":
            allocate_device_tables(codec, self.device)   # before any CUDA graph (ops/device_tables.py)

    # -- state ---------------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        """The tensors as the ops take them (a view: writes through it land in this cache).  Eagerly one object
        until the cache's tensors change (read-only: assign nothing to it), as a decode step asks in every layer."""
        if torch.compiler.is_compiling():
            return self._new_layout()   # traced: built in the graph, no cached object to guard on
        return (self._layouts or self._layout_views())[0]

    def _new_layout(self) -> CacheLayout:
        return CacheLayout(self.k_codes, self.k_scales, self.v_codes, self.v_scales, self.seen, self.starts,
                           self.sliding_window, self.key_shift, self.key_gain, self.key_gain_inv, self._key_shifted,
                           self.nonfinite, self.merge_counters, self.recent_k, self.recent_v, self.exact_recent,
                           self.first_k, self.first_v, self.exact_first, self.key_order)

    def _layout_views(self) -> tuple[CacheLayout, CacheLayout | None]:
        """(layout, the same without the exact first rows: what an append takes once every first row is written;
        None without exact first tokens), built once after each change of the tensors (_tensors_changed)."""
        if torch.compiler.is_compiling():
            return self._new_layout_views()   # traced: built in the graph, no cached object to guard on
        if self._layouts is None:
            self._layouts = self._new_layout_views()
        return self._layouts

    def _new_layout_views(self) -> tuple[CacheLayout, CacheLayout | None]:
        without_first = None
        if self.exact_first:
            without_first = self._new_layout()
            without_first.first_k, without_first.first_v, without_first.exact_first = None, None, 0
        return self._new_layout(), without_first

    def _tensors_changed(self) -> None:
        """Called by every method that assigns a field of the layout (a tensor, the key transform's flag) or changes a
        fact that cached_attention checks (the batch size, the key shift)."""
        self._layouts = None
        self._attention_step = None
        self._append_launches = None

    @property
    def is_ring(self) -> bool:
        return self.sliding_window is not None

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens held per sequence [B] (a ring holds at most its window)."""
        return self.seen.clamp(max=self.capacity)

    @property
    def is_static(self) -> bool:
        """Lengths on the device only, fixed capacity (see the module docstring)."""
        return self._seen_host is None

    @property
    def is_empty(self) -> bool:
        """Whether no token is held: read on the host without a sync in both modes (a static cache
        tracks whether anything was appended since creation, reset or a crop to zero)."""
        return self._empty

    @property
    def max_seen(self) -> int:
        """The longest sequence's token count.  A static cache reads it from the device (a sync)."""
        seen_host = self._seen_host
        return int(self.seen.max()) if seen_host is None else max(seen_host)

    @property
    def overflowed(self) -> torch.Tensor:
        """Whether an append ran past the capacity, as a device bool (reading it is a sync).

        Only a static contiguous cache can overflow (the growing one raises, a ring wraps); its
        overflowing tokens were not stored, so attention since then missed them."""
        if self.is_ring:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        return (self.seen > self.capacity).any()

    def _host_lengths(self) -> list[int]:
        return self.seen.tolist() if self.is_static else list(self._seen_host)

    def _mark_static(self, tensors=None) -> None:
        """Tell torch.compile that a static cache's tensors keep their addresses, so that CUDA graphs
        (mode="reduce-overhead") update them in place rather than copying them each replay.  Not while
        compiling (a compiled prefill allocates them): that marking is for the next compile."""
        if self.is_static and not torch.compiler.is_compiling():
            for t in tensors or (self.k_codes, self.v_codes, self.k_scales, self.v_scales, self.seen, self.starts,
                                 self.nonfinite, self.merge_counters, *self._recent_buffers,
                                 *self._first_buffers):
                torch._dynamo.mark_static_address(t)

    @property
    def _recent_buffers(self) -> tuple[torch.Tensor, ...]:
        return () if self.recent_k is None else (self.recent_k, self.recent_v)

    @property
    def _first_buffers(self) -> tuple[torch.Tensor, ...]:
        return () if self.first_k is None else (self.first_k, self.first_v)

    @property
    def nbytes(self) -> int:
        codes = sum(t.numel() * t.element_size() for t in (self.k_codes, self.v_codes, self.k_scales, self.v_scales))
        return codes + self.key_transform_nbytes + self.exact_recent_nbytes + self.exact_first_nbytes

    @property
    def exact_recent_nbytes(self) -> int:
        """Bytes of the exact recent window (recent_k, recent_v, scratch rows included), a fixed cost."""
        return sum(t.numel() * t.element_size() for t in self._recent_buffers)

    @property
    def exact_first_nbytes(self) -> int:
        """Bytes of the exact first tokens (first_k, first_v), a fixed cost."""
        return sum(t.numel() * t.element_size() for t in self._first_buffers)

    @property
    def key_transform_nbytes(self) -> int:
        """Bytes of the key transform (shift, gain, 1/gain, channel order), a fixed cost independent of length."""
        return sum(t.numel() * t.element_size()
                   for t in (self.key_shift, self.key_gain, self.key_gain_inv, self.key_order) if t is not None)

    def reset(self) -> None:
        """Empty the cache for new sequences (the key transform goes too: it was fitted to the old ones).

        Codes and scales are zeroed as well, so a reset cache equals a fresh one of its capacity.
        """
        for t in (self.k_codes, self.v_codes, self.k_scales, self.v_scales, *self._recent_buffers,
                  *self._first_buffers):
            t.zero_()
        self.seen.zero_()
        self.starts.zero_()
        self._starts_bound = 0
        self.nonfinite.zero_()
        if not self.is_static:
            self._seen_host = [0] * self.batch_size
        self._empty = True
        self.key_shift = self.key_gain = self.key_gain_inv = self.key_order = None
        self._key_shifted = False
        self._tensors_changed()

    def received_nonfinite(self) -> bool:
        """Whether any K/V vector appended since creation (or reset) held a NaN or infinity.

        Reads the device counter `nonfinite` [B] (int32, vectors per sequence), so it waits for the
        device: call it when the answer is wanted, not every step.  Crop and batch edits keep the
        counts of the sequences that stay.
        """
        return bool(self.nonfinite.any())

    @property
    def has_key_shift(self) -> bool:
        """Whether the key transform shifts keys (a host flag: decode steps stay free of syncs)."""
        return self._key_shifted

    def set_key_transform(self, shift: torch.Tensor, gain: torch.Tensor, order: torch.Tensor | None = None) -> None:
        """Store keys as (k - shift) * gain from now on; shift, gain [B, Hkv, D] (key_transform.py).  With keys in
        channel groups, `order` (int16 [B, Hkv, D], key_transform.fit_key_order) sets which channels each group
        takes (None: the model's order).

        Only an empty cache accepts one: keys already stored were coded without it.  A static cache
        copies it into storage of its own, so that its address stays fixed across reset() and prompts.
        """
        if not self.is_empty:
            raise ValueError("set_key_transform needs an empty cache: "
                             f"it already holds up to {self.max_seen} tokens per sequence")
        shape = (self.batch_size, self.num_kv_heads, self.codec.head_dim)
        check_key_transform(shift, gain, shape, self.device)
        if order is not None:
            if not self.codec.grouped_keys:
                raise ValueError("a key order is for keys in channel groups (KVCodec(key_groups=...)); this "
                                 f"cache codes keys at k_bits={self.codec.k_bits}")
            check_key_order(order, shape, self.device)
            order = order.clone(memory_format=torch.contiguous_format)   # batch edits write into it
        self.key_order = order
        shift, gain = shift.to(torch.float32), gain.to(torch.float32)
        if self.is_static:
            if self._key_buffers is None:
                self._key_buffers = tuple(torch.empty_like(shift, memory_format=torch.contiguous_format)
                                          for _ in range(3))
                self._mark_static(self._key_buffers)
            self.key_shift, self.key_gain, self.key_gain_inv = self._key_buffers
            self.key_shift.copy_(shift)
            self.key_gain.copy_(gain)
            torch.reciprocal(self.key_gain, out=self.key_gain_inv)
        else:
            self.key_shift = shift.contiguous()
            self.key_gain = gain.contiguous()
            self.key_gain_inv = 1.0 / self.key_gain
        self._key_shifted = bool(self.key_shift.any())
        self._tensors_changed()

    def stored_keys(self, k: torch.Tensor) -> torch.Tensor:
        """k [B, Hkv, T, D] as the cache codes it: (k - shift) * gain in float32, or k without a transform."""
        return k if self.key_gain is None else to_stored_keys(k, self.key_shift, self.key_gain, self.key_order)

    def set_left_padding(self, num_padding: Sequence[int] | torch.Tensor) -> None:
        """Mark the first num_padding[b] positions of sequence b as padding (never attended).

        With exact first tokens (exact_first > 0) only while the cache is empty: their rows are indexed from
        the padding (position starts + j in row j), so padding set after them would misplace them."""
        pad = _host_ints(num_padding)
        if pad is None or len(pad) != self.batch_size or min(pad) < 0:
            raise ValueError(f"num_padding must hold {self.batch_size} non-negative ints, got {num_padding!r}")
        if self.exact_first and not self.is_empty:
            raise ValueError("set_left_padding on a cache with exact_first needs an empty cache (reset() first): "
                             "the exact first-token rows are indexed from the padding")
        self.starts.copy_(torch.tensor(pad, dtype=torch.int32, device=self.device))
        self._starts_bound = max(pad)

    def slot_positions(self) -> torch.Tensor:
        """Absolute position held by each slot [B, N] (int64); -1 for empty or padding slots."""
        return slot_positions(self.layout)

    def reserve(self, capacity: int) -> None:
        """Grow a contiguous cache to hold `capacity` tokens per sequence, keeping its contents.

        One reallocation and copy; callers that grow token by token should
        reserve geometrically (the Hugging Face cache adds a quarter).  A ring cache
        has a fixed size and rejects this.
        """
        if self.is_ring:
            raise ValueError(f"a ring cache holds exactly sliding_window={self.sliding_window} tokens; "
                             f"it cannot reserve {capacity!r}")
        if self.is_static:
            raise ValueError(f"a static cache has a fixed capacity ({self.capacity}); it cannot reserve {capacity!r}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if capacity <= self.capacity:
            return
        for name in ("k_codes", "v_codes", "k_scales", "v_scales"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :self.capacity] = old
            setattr(self, name, new)
        self.capacity = capacity
        self._tensors_changed()

    # -- edits: speculative decoding (crop), beam and contrastive search (batch) ---------
    def crop(self, max_length: int) -> None:
        """Drop the newest tokens: keep the first `max_length` positions of each sequence, or, with a
        negative value, drop that many tokens from each (transformers' convention).

        Dropped slots are zeroed, so a cropped contiguous cache (or ring that has not wrapped) equals
        one only ever given the kept tokens.  A wrapped ring (seen > W) has overwritten its oldest
        positions with the ones being dropped: it can drop 1 token (its spare slot: the next query's
        window needs the W - 1 tokens before it) and raises ValueError for more.  The key transform
        stays: it was fitted to the prompt.

        With an exact recent window of R tokens, the rows of positions [new - R, new) that an append
        after them overwrote (positions below old - R) no longer hold those tokens exactly: they are
        refilled from the codes (their decoded values, cast to exact_dtype), so up to min(dropped, R)
        window positions are read through their codes until they age out of the window.
        """
        old = self._host_lengths()
        new = self._cropped(old, max_length)
        new_dev = torch.tensor(new, dtype=torch.int32, device=self.device)
        if self.exact_recent:
            self._refill_recent(old, new_dev)
        if self.exact_first:
            # Rows of positions at or past the new length go (they are invisible by the position rule anyway).
            gone = self.starts.to(torch.int64)[:, None] + torch.arange(self.exact_first, device=self.device)
            gone = (gone >= new_dev.to(torch.int64)[:, None])[:, None, :, None]
            for rows in self._first_buffers:
                rows.masked_fill_(gone, 0)
        # Every slot's position, padding included (starts=0): the slots at or past the new length go.
        held = slot_positions(replace(self.layout, starts=torch.zeros_like(self.starts)))
        drop = (held >= new_dev[:, None].to(torch.int64))[:, None, :, None]
        for t in (self.k_codes, self.v_codes, self.k_scales, self.v_scales):
            t.masked_fill_(drop, 0)
        if self.is_ring:
            # A wrapped ring that dropped a token now maps that slot to position new - W, which it no
            # longer holds (overwritten): mark it as padding.  No query from `new` on can see it anyway.
            floor = [s_new - self.sliding_window + 1 if s > self.sliding_window and s_new < s else 0
                     for s, s_new in zip(old, new)]
            self.starts.clamp_(min=torch.tensor(floor, dtype=torch.int32, device=self.device))
            self._starts_bound = max(self._starts_bound, *floor)
        self.seen.copy_(new_dev)
        if not self.is_static:
            self._seen_host = new
        self._empty = max(new) == 0

    def _refill_recent(self, old: list[int], new_dev: torch.Tensor) -> None:
        """Before a crop to new_dev: rows whose position in the new window [new - R, new) was overwritten
        (it lies below old - R) take the decoded codes of that position; rows without a position are zeroed."""
        r_len = self.exact_recent
        pos = recent_positions(replace(self.layout, seen=new_dev, starts=torch.zeros_like(self.starts),
                                         exact_first=0))  # [B, R]: every window row, first rows aside
        old_dev = torch.tensor(old, dtype=torch.int64, device=self.device)[:, None]
        lost = (pos >= 0) & (pos < old_dev - r_len)
        stored = lost & ((pos < self.capacity) | self.is_ring)                      # an overflowed position has no codes
        rows_k, rows_v = self.recent_k[:, :, :r_len], self.recent_v[:, :, :r_len]
        if bool(stored.any()):
            k_all, v_all = self.dequantize(torch.float32)                          # [B, Hkv, N, D]
            slot = pos.clamp(min=0) % self.capacity if self.is_ring else pos.clamp(min=0, max=self.capacity - 1)
            index = slot[:, None, :, None].expand(-1, self.num_kv_heads, -1, self.codec.head_dim)
            for rows, decoded in ((rows_k, k_all), (rows_v, v_all)):
                rows.copy_(torch.where(stored[:, None, :, None], decoded.gather(2, index).to(self.exact_dtype), rows))
        for rows in (rows_k, rows_v):
            rows.masked_fill_(((pos < 0) | (lost & ~stored))[:, None, :, None], 0)

    def cropped_lengths(self, max_length: int) -> list[int]:
        """The lengths crop(max_length) would leave per sequence, or its ValueError (nothing changes)."""
        return self._cropped(self._host_lengths(), max_length)

    def _cropped(self, old: list[int], max_length: int) -> list[int]:
        if not isinstance(max_length, int) or isinstance(max_length, bool):
            raise ValueError(f"max_length must be an int, got {max_length!r}")
        new = [min(s, max_length) if max_length >= 0 else s + max_length for s in old]
        if min(new) < 0:
            raise ValueError(f"crop({max_length}) drops {-max_length} tokens but a sequence holds only {min(old)}")
        w = self.sliding_window
        for b, (s, s_new) in enumerate(zip(old, new)):
            if self.is_ring and s > w and s - s_new > 1:
                raise ValueError(f"cannot crop sequence {b} from {s} to {s_new} tokens: its ring of "
                                 f"sliding_window={w} slots no longer holds positions {max(0, s_new - w + 1)}.."
                                 f"{s - w - 1}, which the window would need again (a wrapped ring can drop 1 token)")
        return new

    def batch_select_indices(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep the sequences `indices` (1-D ints in [0, B), repeats allowed), in that order; B becomes len(indices)."""
        idx = self._batch_indices(indices, "indices")
        idx_dev = torch.tensor(idx, dtype=torch.int64, device=self.device)
        # A static cache keeps its storage (addresses included, for CUDA graphs) while B stays, as in beam search.
        in_place = self.is_static and len(idx) == self.batch_size
        for name in ("k_codes", "v_codes", "k_scales", "v_scales", "seen", "starts", "nonfinite", "merge_counters",
                     "key_shift", "key_gain", "key_gain_inv", "key_order", "recent_k", "recent_v", "first_k",
                     "first_v"):
            t = getattr(self, name)
            if t is not None:
                picked = t.index_select(0, idx_dev)
                if in_place:
                    t.copy_(picked)
                else:
                    setattr(self, name, picked)
        if not self.is_static:
            self._seen_host = [self._seen_host[i] for i in idx]
            self._empty = max(self._seen_host) == 0
        if not in_place:
            self.batch_size = len(idx)
            self._key_buffers = None   # sized for the old batch; a static cache allocates new ones on demand
            self._mark_static()
        # The host flag may turn off when no shifted sequence is left (indices were read on the host anyway).
        self._key_shifted = self._key_shifted and bool(self.key_shift.any())
        self._tensors_changed()

    def reorder_cache(self, beam_idx: Sequence[int] | torch.Tensor) -> None:
        """Beam search: sequence b becomes the old sequence beam_idx[b] (B entries, repeats allowed)."""
        n = len(beam_idx) if not isinstance(beam_idx, torch.Tensor) else beam_idx.numel()
        if n != self.batch_size:
            raise ValueError(f"beam_idx must hold batch_size={self.batch_size} indices, got {n}")
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each sequence `repeats` times in place (b -> rows b*repeats .. b*repeats + repeats - 1)."""
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        self.batch_select_indices([b for b in range(self.batch_size) for _ in range(repeats)])

    def _batch_indices(self, indices, name: str) -> list[int]:
        """indices as a host list of ints in [0, B), or ValueError."""
        if isinstance(indices, torch.Tensor):
            if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
                raise ValueError(f"{name} must hold integers, got dtype {indices.dtype}")
            if indices.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
            idx = indices.tolist()
        else:
            idx = list(indices)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in idx):
                raise ValueError(f"{name} must hold ints, got {indices!r}")
        if not idx or min(idx) < 0 or max(idx) >= self.batch_size:
            raise ValueError(f"{name} must hold at least one index in [0, {self.batch_size}), got {idx}")
        return idx

    # -- writes --------------------------------------------------------------
    def check_kv(self, k: torch.Tensor, v: torch.Tensor, name: str = "k/v") -> None:
        """Validate fresh k, v [B, Hkv, T, D] against this cache."""
        # Every layer of every decode step checks its new tokens: valid ones pass in one expression (each
        # condition below is one of _check_kv_in_order's), anything else gets that method's error.
        device = self.device
        if (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dtype in ATTENTION_DTYPES
                and v.dtype == k.dtype and k.device == device and v.device == device and device != META_DEVICE):
            shape = k.shape
            if (len(shape) == 4 and shape[0] == self.batch_size and shape[1] == self.num_kv_heads
                    and shape[3] == self.codec.head_dim and shape[2] >= 1 and v.shape == shape):
                return
        self._check_kv_in_order(k, v, name)

    def _check_kv_in_order(self, k: torch.Tensor, v: torch.Tensor, name: str) -> None:
        """check_kv's checks one by one, each with its own error."""
        for label, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
            check_attention_dtype(label, t)
            device = t.device
            if device != self.device:
                raise ValueError(f"{label} is on {device} but the cache is on {self.device}")
            if device.type == "meta":
                raise ValueError(f"{label} is a meta tensor (a shape without data): the cache stores values")
        shape, b, hkv, d = k.shape, self.batch_size, self.num_kv_heads, self.codec.head_dim
        if len(shape) != 4 or shape[0] != b or shape[1] != hkv or shape[3] != d or shape[2] < 1:
            raise ValueError(f"{name}: k must be [B={b}, Hkv={hkv}, T>=1, D={d}], "
                             f"got {tuple(shape)}")
        if v.shape != k.shape:
            raise ValueError(f"{name}: v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")
        if v.dtype != k.dtype:
            raise TypeError(f"{name}: v dtype {v.dtype} differs from k dtype {k.dtype}")

    def _new_lengths(self, new_lengths, t: int) -> list[int]:
        if new_lengths is None:
            return [t] * self.batch_size
        n = _host_ints(new_lengths)
        if n is None or len(n) != self.batch_size or any(x < 0 or x > t for x in n):
            raise ValueError(f"new_lengths must hold {self.batch_size} ints in [0, {t}], got {new_lengths!r}")
        return n

    def append(self, k: torch.Tensor, v: torch.Tensor, new_lengths=None, backend: str = "auto") -> None:
        """Quantize and store k, v [B, Hkv, T, D].

        `new_lengths[b]` (default T) says how many of the T tokens are real for
        sequence b; the rest (right padding of the chunk) are not stored.  A
        ring cache keeps the last W tokens; a growing contiguous cache raises
        ValueError instead of overflowing; a static one stores what fits and
        flags the rest (`overflowed`).  A vector with a NaN or infinity is
        stored as NaN and counted in `nonfinite` (no error: checking would sync).
        """
        check_backend(backend)
        self.check_kv(k, v, "append")
        n = None if new_lengths is None else self._new_lengths(new_lengths, k.shape[2])
        self._append(k, v, new_lengths, n, backend)

    def _append(self, k: torch.Tensor, v: torch.Tensor, new_lengths=None, n: list[int] | None = None,
                backend: str = "auto") -> None:
        """append's work, its arguments checked; n: new_lengths as host ints (None: all T, new_lengths None)."""
        t = k.shape[2]
        codec = self.codec
        seen_host = self._seen_host   # None: static
        if seen_host is not None and self.sliding_window is None:
            worst = max(seen_host) + t if n is None else max(map(add, seen_host, n))
            if worst > self.capacity:
                raise ValueError(f"append of {t} tokens would overflow the cache: a sequence would hold "
                                 f"{worst} tokens, capacity is {self.capacity}")
        impl = choose("quantize_append", backend, k.device, codec.head_dim, codec.grouped_keys)
        # One op stores the codes (a static cache that runs out of room: only the tokens that fit), the exact rows,
        # and advances `seen` on the device (no host-to-device copy: decode steps stay capturable in a CUDA graph).
        n_dev = None if new_lengths is None else torch.tensor(n, dtype=torch.int32, device=self.device)
        layout, without_first = self._layout_views()
        if without_first is not None and self._first_rows_full():
            layout = without_first   # every first row is written: the op has none to copy
        run_quantize_append(k, v, layout, n_dev, codec, impl)
        if seen_host is None:
            self._empty = False
        elif n is None:
            self._seen_host = [s + t for s in seen_host]
            self._empty = False   # t >= 1 (check_kv)
        else:
            self._seen_host = list(map(add, seen_host, n))
            self._empty = max(self._seen_host) == 0

    def _append_validated(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """append(k, v) of k, v that cached_attention(q, self, k, v) has just accepted (check_kv): a decode step of the
        transformers integration checks its new tokens once.  Eagerly, _append's work for all T tokens real, through
        the launchers of the implementation "auto" chooses (library.append_launcher), made once per layout."""
        if torch.compiler.is_compiling():
            self._append(k, v)
            return
        t = k.shape[2]
        seen_host = self._seen_host   # None: static
        if seen_host is not None and self.sliding_window is None and max(seen_host) + t > self.capacity:
            self._append(k, v)   # its ValueError, before anything is written
            return
        launches = self._append_launches
        if launches is None or launches[0] != registry.generation:
            launches = self._new_append_launches(k.device)
        launch, without_first = launches[1], launches[2]
        if without_first is not None and self._first_rows_full():
            launch = without_first   # every first row is written: the op has none to copy
        launch(k, v)   # codes, exact rows and seen (the device's)
        if seen_host is not None:
            self._seen_host = [s + t for s in seen_host]
        self._empty = False   # t >= 1 (check_kv)

    def _new_append_launches(self, device: torch.device) -> tuple:
        """(registry generation, the launcher for the layout, the one for the layout without the first rows or None),
        for _append_validated until the tensors change (_tensors_changed) or the registry does."""
        codec = self.codec
        impl = choose("quantize_append", "auto", device, codec.head_dim, codec.grouped_keys)
        layout, without_first = self._layout_views()
        launches = self._append_launches = (
            registry.generation, append_launcher(layout, codec, impl),
            None if without_first is None else append_launcher(without_first, codec, impl))
        return launches

    def _first_rows_full(self) -> bool:
        """Whether no append can write a first-token row: every sequence of a growing cache holds positions up to
        starts + exact_first already (row j takes position starts + j only while it is >= seen).  A static cache
        cannot tell without a sync: its appends always make the (masked) copy."""
        return not self.is_static and min(self._seen_host) >= self._starts_bound + self.exact_first

    # -- persistence (persist.py: a safetensors file, no pickle) ----------------------
    def save(self, path) -> None:
        """Write this cache to a safetensors file; `QuantizedKVCache.load(path)` gives it back bit for bit."""
        from .persist import save_cache  # persist.py builds caches of this class: imported on use

        save_cache(self, path)

    @classmethod
    def load(cls, path, device=None) -> QuantizedKVCache:
        """The cache `save` wrote to `path`, on `device` (default: the CPU); ValueError on a version or
        shape mismatch."""
        from .persist import load_cache

        return load_cache(path, device)

    # -- reads (reference path) ------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot as K, V [B, Hkv, N, D] (pair with slot_positions()); for tests and the reference."""
        return dequantize_slots(self.layout, self.codec, dtype)

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh k, v [B, Hkv, T, D] as this cache would give them back (coded, then decoded), in their dtype."""
        codec = self.codec
        k_hat = codec.dequantize(codec.quantize(self.stored_keys(k), "k"), "k", torch.float32)
        if self.key_gain is not None:
            k_hat = from_stored_keys(k_hat, self.key_shift, self.key_gain, self.key_order)
        return k_hat.to(k.dtype), codec.dequantize(codec.quantize(v, "v"), "v", v.dtype)

    def __repr__(self) -> str:
        kind = f"ring W={self.sliding_window}" if self.is_ring else f"capacity={self.capacity}"
        kind += ", static" if self.is_static else ""
        if self.exact_recent:
            kind += f", exact_recent={self.exact_recent}"
        if self.exact_first:
            kind += f", exact_first={self.exact_first}"
        if self.exact_recent or self.exact_first:
            kind += f" ({str(self.exact_dtype).removeprefix('torch.')})"
        return (f"QuantizedKVCache(B={self.batch_size}, Hkv={self.num_kv_heads}, {kind}, "
                f"{self.codec.name}, D={self.codec.head_dim}, "
                f"{'key transform, ' if self.key_gain is not None else ''}"
                f"{self.nbytes / 2**20:.2f} MiB)")
