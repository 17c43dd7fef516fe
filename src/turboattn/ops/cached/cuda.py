"""The CUDA fast path of cached attention: 4-bit K and V at head_dim 128 on tensor cores (csrc/decode_k4.cu).

The kernel fills the cache splits' partials; the fresh tokens' part and the merge (sinks, rotation back)
stay with the Triton kernels (triton.py), so the two paths share every piece but the hot loop.  Calls the
kernel does not serve (other bit widths or head dims, more than 8 query rows per KV head, GPUs before
sm_80) go to the Triton path.  The extension is built with nvcc on first use (torch.utils.cpp_extension).
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path

import torch

from ...format.codebook import device_centroids
from ...format.codec import KVCodec
from ...format.layout import CacheLayout
from ...format.rotation import device_signs
from .config import DecodePlan, plan_decode
from .triton import cached_attention_triton

CSRC = Path(__file__).with_name("csrc")
MAX_ROWS = 8         # query rows (Tq x GQA group) per KV head: the N = 8 side of the MMA
CHUNK_ALIGN = 64     # split boundaries, in keys (a multiple of the kernel's 16-key tile)
MIN_BLOCKS = 4       # CTAs per SM the kernel's registers allow (127 registers; BENCHMARKS.md)


@lru_cache(maxsize=None)
def _extension():
    """The compiled kernel module, or None (with a one-time warning) when it cannot be built here."""
    from torch.utils.cpp_extension import load
    try:
        return load(name="turboattn_decode_k4", sources=[str(CSRC / "binding.cpp"), str(CSRC / "decode_k4.cu")],
                    extra_cuda_cflags=["-O3", "-gencode=arch=compute_80,code=sm_80",
                                       "-gencode=arch=compute_90,code=sm_90"],
                    extra_include_paths=[str(CSRC)], verbose=False)
    except Exception as e:  # no nvcc, no compiler, unsupported toolkit: the Triton kernels still serve
        warnings.warn(f"turboattn: the CUDA decode kernel could not be built ({e}); using the Triton path",
                      RuntimeWarning, stacklevel=3)
        return None


@lru_cache(maxsize=None)
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def supports(q: torch.Tensor, codec: KVCodec, num_kv_heads: int) -> bool:
    """Whether the CUDA kernel serves this call (the rest goes to the Triton kernels)."""
    rows = q.shape[2] * (q.shape[1] // num_kv_heads)
    return (q.is_cuda and codec.head_dim == 128 and codec.k_bits == 4 and codec.v_bits == 4 and rows <= MAX_ROWS
            and _capable(q.device))


def cached_attention_cuda(q: torch.Tensor, layout: CacheLayout, codec: KVCodec, k: torch.Tensor | None = None,
                          v: torch.Tensor | None = None, scale: float | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None,
                          plan: DecodePlan | None = None) -> torch.Tensor:
    """cached_attention_triton's contract; the cache splits run in the CUDA kernel when it serves the call."""
    b, hq, tq, d = q.shape
    rows = tq * (hq // layout.num_kv_heads)
    ext = _extension() if supports(q, codec, layout.num_kv_heads) else None
    if ext is None:
        return cached_attention_triton(q, layout, codec, k, v, scale, softcap, sinks, plan)
    if plan is None:
        plan = plan_decode(q.device, d, codec.k_bits, codec.v_bits, b * layout.num_kv_heads, rows, layout.capacity)
    dev = q.device
    if q.stride(3) != 1:
        q = q.contiguous()
    gain_inv = layout.key_gain_inv if layout.has_key_transform else None

    def cache_splits(o_part, lse_part, q_scale, num_parts):
        ext.decode_k4(q, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen,
                      layout.starts, gain_inv, device_signs(d, dev), device_centroids(4, dev, torch.float32),
                      o_part, lse_part, float(q_scale), float(softcap or 0.0), layout.sliding_window or 0,
                      plan.num_splits, num_parts, layout.is_ring, k is not None, CHUNK_ALIGN, MIN_BLOCKS)

    return cached_attention_triton(q, layout, codec, k, v, scale, softcap, sinks, plan, cache_splits=cache_splits)
