"""The CUDA fast path of cached attention: the bit pairs of config.CUDA_BIT_PAIRS (every preset: 2 to 8-bit K and V)
at head_dim 64/128/256/512 and the key groups of config.CUDA_KEY_GROUPS on tensor cores (csrc/decode.cuh), float32
or bfloat16 scales.

One launch covers the cache splits and, while the parts are small, their merge: with exact rows (an exact recent
window, exact first tokens), the plan's exact_parts more CTAs per (sequence, KV head) attend them in full precision
(at most config.cuda_exact_parts), each one more part; the last CTA of each sequence x KV head attends the fresh k/v
tokens (when given) in full precision, merges them with the parts, adds the sinks, rotates back and casts.  Larger
parts (config.cuda_merge_apart) are written rotated back and merged the same way by a second launch, one CTA per
slice of an output row's dims (config.cuda_merge_slices).  Calls the kernel does not serve (other bit pairs or head
dims, key groups other than config.CUDA_KEY_GROUPS, more than 8 query rows per KV head, GPUs before sm_80) go to
the Triton path, under the device guard (ops/guard.py), which the extension's launches do without: they guard
themselves.  The extension is built with nvcc on first use (ops/cuda_extension.py), for the GPUs this process sees.
"""

from __future__ import annotations

import torch

from ...format.codec import KVCodec
from ...format.layout import CacheLayout
from ...format.rotation import device_signs
from ..cuda_extension import arrival_counters, capable, extension
from ..device_tables import key_group_hartley
from ..guard import device_guard
from ..launch import sm_count
from .config import (CUDA_CHUNK_ALIGN, CUDA_COUNTERS_PER_HEAD, CUDA_MAX_PARTS, CUDA_MAX_ROWS, DecodePlan,
                     cuda_exact_parts, cuda_kernel_serves, cuda_merge_slices, plan_decode)
from .triton import cached_attention_triton, query_scale


def supports(q: torch.Tensor, codec: KVCodec, num_kv_heads: int) -> bool:
    """Whether the CUDA kernel serves this call (the rest goes to the Triton kernels): its shape
    (config.cuda_kernel_serves) and the GPU.  Every storage option of the format is read (either scale dtype,
    exact rows)."""
    rows = q.shape[2] * (q.shape[1] // num_kv_heads)
    return _serves(codec, rows, q.device)


def _serves(codec: KVCodec, rows: int, device: torch.device) -> bool:
    return cuda_kernel_serves(codec.head_dim, codec.key_code, codec.v_bits, rows) and capable(device)


def cached_attention_cuda(q: torch.Tensor, layout: CacheLayout, codec: KVCodec, k: torch.Tensor | None = None,
                          v: torch.Tensor | None = None, scale: float | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None,
                          plan: DecodePlan | None = None) -> torch.Tensor:
    """cached_attention_triton's contract; runs the CUDA kernel when it serves the call."""
    # What comes from the layout and codec alone is derived once per layout (a decode step's launcher skips the rest).
    fixed = _layout_args(layout, codec)
    b, hq, tq, d = q.shape
    hkv = fixed.num_kv_heads
    rows = tq * (hq // hkv)
    # cuda_kernel_serves and the GPU: the head dim, bits and device in fixed.serves, the rows here.
    ext = extension() if fixed.serves and rows <= CUDA_MAX_ROWS else None
    if ext is not None and plan is None:
        plan = plan_decode(q.device, d, codec.key_code, codec.v_bits, b * hkv, rows, fixed.capacity, None, None, "cuda",
                           fixed.exact_row_count)
    num_parts = plan.num_splits + _exact_ctas(plan, fixed) if ext is not None else 0   # exact CTAs after the splits
    if ext is None or num_parts > CUDA_MAX_PARTS:
        with device_guard(q.device):   # the ops' guard is this implementation's own (library.SELF_GUARDED)
            return cached_attention_triton(q, layout, codec, k, v, scale, softcap, sinks, plan)
    if not q.is_contiguous() and q.stride(3) != 1:   # a contiguous q (D > 1) has unit stride along D
        q = q.contiguous()
    q_scale = query_scale(d, scale, softcap)
    has_fresh = k is not None
    if has_fresh:
        # The kernel reads fresh k and v in q's dtype (attention.py requires it: no copy then) with one set of
        # strides (unit stride along D).  Two contiguous ones of one shape (attention.py) pass as they are: their
        # strides can differ only along size-1 dims, which no index reaches, and .contiguous() would keep them.
        if k.dtype != q.dtype or v.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        if not (k.is_contiguous() and v.is_contiguous()):
            strides = k.stride()
            if strides != v.stride() or strides[3] != 1:
                k, v = k.contiguous(), v.contiguous()
    exact_rows = fixed.exact_rows if fixed.exact_rows is not None else _exact_rows(layout)
    counters = fixed.counters
    if counters is None:
        counters = arrival_counters(q.device, b * hkv * CUDA_COUNTERS_PER_HEAD)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    # The binding allocates the parts' scratch and the output ([B, Hq, Tq, D] in q's dtype) and returns the output.
    return ext.decode(q, *fixed.head, *part_scratch(q, hkv, num_parts), float(q_scale), float(softcap or 0.0),
                      fixed.window, plan.num_splits, num_parts, fixed.ring, has_fresh, CUDA_CHUNK_ALIGN, counters,
                      None, sinks, k, v, fixed.fresh_key_shift if has_fresh else fixed.key_shift, *exact_rows,
                      cuda_merge_slices(num_parts, rows, b * hkv, d, sm_count(q.device)), *fixed.groups)


def decode_launcher(q: torch.Tensor, layout: CacheLayout, codec: KVCodec, scale: float | None,
                    softcap: float | None):
    """A decode step's launch, launch(q, k, v, plan) = cached_attention_cuda(q, layout, codec, k, v, scale, softcap,
    None, plan), for calls whose q, k, v have the shapes, dtype and device of this q and of its fresh k, v
    (attention.py's _DecodeStep checks them): everything else is derived here, once.  None where the kernel does not
    serve them."""
    b, hq, tq, d = q.shape
    fixed = _layout_args(layout, codec)
    hkv = fixed.num_kv_heads
    rows = tq * (hq // hkv)
    ext = extension() if fixed.serves and rows <= CUDA_MAX_ROWS else None
    if ext is None or fixed.exact_rows is None or fixed.counters is None:
        return None   # the Triton path, or the rows or counters of each call: cached_attention_cuda's work
    head, most_exact, key_shift, exact_rows = fixed.head, fixed.exact_parts, fixed.fresh_key_shift, fixed.exact_rows
    q_scale, kernel_softcap = float(query_scale(d, scale, softcap)), float(softcap or 0.0)
    window, ring, counters, groups = fixed.window, fixed.ring, fixed.counters, fixed.groups
    sms = sm_count(q.device)

    def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        # The exact CTAs' parts after the splits (_exact_ctas, inline: this is the decode step's host path).
        exact = plan.exact_parts
        num_parts = plan.num_splits + (most_exact if exact is None or most_exact == 0 else min(exact, most_exact))
        # The kernel reads contiguous q, k, v as they are (a decode step's); anything else, and more parts than it
        # merges, go the general way.
        if num_parts > CUDA_MAX_PARTS or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            return cached_attention_cuda(q, layout, codec, k, v, scale, softcap, None, plan)
        return ext.decode(q, *head, *part_scratch(q, hkv, num_parts), q_scale, kernel_softcap, window,
                          plan.num_splits, num_parts, ring, True, CUDA_CHUNK_ALIGN, counters, None, None, k, v,
                          key_shift, *exact_rows, cuda_merge_slices(num_parts, rows, b * hkv, d, sms), *groups)
    return launch


def _exact_ctas(plan: DecodePlan, fixed: _LayoutArgs) -> int:
    """The plan's exact CTAs per (sequence, KV head), within what the layout's exact rows allow (none without)."""
    most = fixed.exact_parts
    return most if plan.exact_parts is None or most == 0 else min(plan.exact_parts, most)


def _layout_args(layout: CacheLayout, codec: KVCodec) -> _LayoutArgs:
    return layout.derived_for(_LAYOUT_ARGS, codec, _LayoutArgs)


_LAYOUT_ARGS = "cuda decode"   # CacheLayout.derived's key


class _LayoutArgs:
    """The decode launch's arguments that come from a layout and its codec alone, derived once per layout (a decode
    step's layout is the same object every step until the cache's tensors change: CacheLayout.derived)."""

    __slots__ = ("codec", "num_kv_heads", "capacity", "serves", "exact_row_count", "exact_parts", "head", "groups",
                 "window", "ring", "counters", "key_shift", "fresh_key_shift", "exact_rows")

    def __init__(self, layout: CacheLayout, codec: KVCodec):
        k_codes = layout.k_codes
        d, dev = codec.head_dim, k_codes.device
        self.codec = codec
        self.num_kv_heads, self.capacity = k_codes.shape[1], k_codes.shape[2]
        # rows: the call's.  The kernel reads scales as aligned 32-bit words (the cache allocates them so).
        self.serves = (cuda_kernel_serves(d, codec.key_code, codec.v_bits, 1) and capable(dev)
                       and layout.k_scales.data_ptr() % 4 == 0 and layout.v_scales.data_ptr() % 4 == 0)
        self.exact_row_count = layout.exact_row_count
        # The most exact CTAs per (sequence, KV head) (the plan may take fewer: _exact_ctas).
        self.exact_parts = cuda_exact_parts(d, self.exact_row_count) if self.serves else 0
        transform = layout.key_gain is not None
        # Key groups: the kernel takes group a's width and both groups' bits, the channel order and the groups'
        # Hartley factors, and puts q into the groups' domain itself.
        groups = codec.key_groups
        if groups and self.serves:
            order = layout.key_order if transform else None
            self.groups = (groups[0][0], groups[1][1], None if order is None else order.contiguous(),
                           *key_group_hartley(groups, dev))
        else:
            self.groups = (0, 0, None, None, None)
        self.head = (k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen, layout.starts,
                     layout.key_gain_inv if transform else None, device_signs(d, dev),
                     groups[0][1] if groups else codec.k_bits, codec.v_bits) if self.serves else None
        # Fresh tokens and exact rows are scored in the model's domain, against k - key_shift.
        shift = layout.key_shift if transform and layout.key_shifted else None
        self.fresh_key_shift = shift                               # calls with fresh k, v
        self.key_shift = shift if self.exact_row_count else None   # calls without
        window = layout.sliding_window
        self.window, self.ring = window or 0, window is not None
        self.counters = layout.merge_counters   # None: the shared arrival counters of the call's stream
        # The exact rows as the kernel reads them; None where that takes a copy (made per call: the rows change).
        self.exact_rows = _exact_rows(layout) if _rows_as_read(layout) else None


def _exact_rows(layout: CacheLayout) -> tuple:
    """recent_k, recent_v, first_k, first_v as the kernel reads them (None for rows the layout has not)."""
    recent = _row_pair(layout.recent_k, layout.recent_v) if layout.exact_recent else _NO_ROWS
    first = _row_pair(layout.first_k, layout.first_v) if layout.exact_first else _NO_ROWS
    return (*recent, *first)


def _rows_as_read(layout: CacheLayout) -> bool:
    """Whether the kernel reads the layout's exact rows as they are (_row_pair copies none)."""
    return ((not layout.exact_recent or _pair_as_read(layout.recent_k, layout.recent_v))
            and (not layout.exact_first or _pair_as_read(layout.first_k, layout.first_v)))


def part_scratch(q: torch.Tensor, num_kv_heads: int, num_parts: int) -> tuple[None, None]:
    """The parts' buffers handed to the kernel: none, so the binding allocates them (one allocation in C++, cheaper
    on a decode step's host path than two torch.empty calls here).  `turboattn bench phases` replaces this to hand
    its own, with room for its stamps."""
    return None, None


_NO_ROWS = (None, None)


def _row_pair(rows_k: torch.Tensor, rows_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An exact-row pair as the kernel reads it: one set of strides, unit stride along D (the cache allocates
    them so; a copy otherwise)."""
    return (rows_k, rows_v) if _pair_as_read(rows_k, rows_v) else (rows_k.contiguous(), rows_v.contiguous())


def _pair_as_read(rows_k: torch.Tensor, rows_v: torch.Tensor) -> bool:
    """Whether the kernel reads an exact-row pair as it is: one set of strides, unit stride along D."""
    # Two contiguous ones, as the cache allocates them, pass without reading strides (.contiguous() would keep them).
    return (rows_k.is_contiguous() and rows_v.is_contiguous()
            or rows_k.stride() == rows_v.stride() and rows_k.stride(3) == 1)
