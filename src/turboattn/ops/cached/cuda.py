"""The CUDA fast path of cached attention: the bit pairs of config.CUDA_BIT_PAIRS (every preset: 2 to 8-bit K and V)
at head_dim 64/128/256/512 on tensor cores (csrc/decode.cuh), float32 or bfloat16 scales.

One launch covers the cache splits and their merge: with exact rows (an exact recent window, exact first
tokens), one more CTA attends them in full precision as one more part; the last CTA of each sequence x KV
head attends the fresh k/v tokens (when given) in full precision, merges them with the parts, adds the
sinks, rotates back and casts.  Calls the kernel does not serve (other bit pairs or head dims, more than 8
query rows per KV head, GPUs before sm_80) go to the Triton path, under the device guard (ops/guard.py), which
the extension's launches do without: they guard themselves.  The extension is built with nvcc on first use
(ops/cuda_extension.py), for the GPUs this process sees.
"""

from __future__ import annotations

import torch

from ...format.codec import KVCodec
from ...format.layout import CacheLayout
from ...format.rotation import device_signs
from ..cuda_extension import arrival_counters, capable, extension
from ..guard import device_guard
from .config import (CUDA_CHUNK_ALIGN, CUDA_COUNTERS_PER_HEAD, CUDA_MAX_PARTS, DecodePlan, cuda_kernel_serves,
                     cuda_merge_group, plan_decode)
from .triton import cached_attention_triton, query_scale


def supports(q: torch.Tensor, codec: KVCodec, num_kv_heads: int) -> bool:
    """Whether the CUDA kernel serves this call (the rest goes to the Triton kernels): its shape
    (config.cuda_kernel_serves) and the GPU.  Every storage option of the format is read (either scale dtype,
    exact rows)."""
    rows = q.shape[2] * (q.shape[1] // num_kv_heads)
    return _serves(codec, rows, q.device)


def _serves(codec: KVCodec, rows: int, device: torch.device) -> bool:
    return cuda_kernel_serves(codec.head_dim, codec.k_bits, codec.v_bits, rows) and capable(device)


def cached_attention_cuda(q: torch.Tensor, layout: CacheLayout, codec: KVCodec, k: torch.Tensor | None = None,
                          v: torch.Tensor | None = None, scale: float | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None,
                          plan: DecodePlan | None = None) -> torch.Tensor:
    """cached_attention_triton's contract; runs the CUDA kernel when it serves the call."""
    # Every layer of every decode step runs this up to the launch: layout fields are read directly rather than
    # through the layout's properties, each once.
    b, hq, tq, d = q.shape
    k_codes = layout.k_codes
    hkv = k_codes.shape[1]
    rows = tq * (hq // hkv)
    dev = q.device
    serves = cuda_kernel_serves(d, codec.k_bits, codec.v_bits, rows) and capable(dev)   # _serves, inline
    ext = extension() if serves else None
    exact_recent, exact_first = layout.exact_recent, layout.exact_first
    exact = exact_recent > 0 or exact_first > 0
    if ext is not None and plan is None:
        plan = plan_decode(dev, d, codec.k_bits, codec.v_bits, b * hkv, rows, k_codes.shape[2], None, None, "cuda",
                           exact)
    num_parts = plan.num_splits + exact if ext is not None else 0   # the exact part is one more
    if ext is None or num_parts > CUDA_MAX_PARTS:
        with device_guard(dev):   # the ops' guard is this implementation's own (library.SELF_GUARDED)
            return cached_attention_triton(q, layout, codec, k, v, scale, softcap, sinks, plan)
    if not q.is_contiguous() and q.stride(3) != 1:   # a contiguous q (D > 1) has unit stride along D
        q = q.contiguous()
    q_scale = query_scale(d, scale, softcap)
    if k is not None:
        # The kernel reads fresh k and v in q's dtype (attention.py requires it: no copy then) with one set of
        # strides (unit stride along D).  Two contiguous ones of one shape (attention.py) pass as they are: their
        # strides can differ only along size-1 dims, which no index reaches, and .contiguous() would keep them.
        if k.dtype != q.dtype or v.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        if not (k.is_contiguous() and v.is_contiguous()):
            strides = k.stride()
            if strides != v.stride() or strides[3] != 1:
                k, v = k.contiguous(), v.contiguous()
    # Fresh tokens and exact rows are scored in the model's domain, against k - key_shift.
    transform = layout.key_gain is not None
    key_shift = layout.key_shift if (k is not None or exact) and transform and layout.key_shifted else None
    recent = _row_pair(layout.recent_k, layout.recent_v) if exact_recent else _NO_ROWS
    first = _row_pair(layout.first_k, layout.first_v) if exact_first else _NO_ROWS
    counters = layout.merge_counters
    if counters is None:
        counters = arrival_counters(dev, b * hkv * CUDA_COUNTERS_PER_HEAD)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    window = layout.sliding_window
    # The binding allocates the parts' scratch and the output ([B, Hq, Tq, D] in q's dtype) and returns the output.
    return ext.decode(q, k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen, layout.starts,
                      layout.key_gain_inv if transform else None, device_signs(d, dev), codec.k_bits, codec.v_bits,
                      *part_scratch(q, hkv, num_parts), float(q_scale), float(softcap or 0.0), window or 0,
                      plan.num_splits, num_parts, window is not None, k is not None, CUDA_CHUNK_ALIGN, counters, None,
                      sinks, k, v, key_shift, *recent, *first, cuda_merge_group(num_parts, rows, d))


def part_scratch(q: torch.Tensor, num_kv_heads: int, num_parts: int) -> tuple[None, None]:
    """The parts' buffers handed to the kernel: none, so the binding allocates them (one allocation in C++, cheaper
    on a decode step's host path than two torch.empty calls here).  `turboattn bench phases` replaces this to hand
    its own, with room for its stamps."""
    return None, None


_NO_ROWS = (None, None)


def _row_pair(rows_k: torch.Tensor, rows_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An exact-row pair as the kernel reads it: one set of strides, unit stride along D (the cache allocates
    them so; a copy otherwise)."""
    if rows_k.is_contiguous() and rows_v.is_contiguous():   # as the cache allocates them: .contiguous() keeps them
        return rows_k, rows_v
    if rows_k.stride() != rows_v.stride() or rows_k.stride(3) != 1:
        rows_k, rows_v = rows_k.contiguous(), rows_v.contiguous()
    return rows_k, rows_v
