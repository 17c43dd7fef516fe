"""The CUDA fast path of quantize-append (csrc/quantize.cu): head_dim 64/128/256/512, every bit width, scale rule
and scale dtype, key transform, rings, per-sequence lengths and the non-finite count, in one launch.  Other head
dims, GPUs before sm_80 and machines where the extension cannot be built go to the Triton kernel."""

from __future__ import annotations

from functools import lru_cache

import torch

from ...format import codebook
from ...format.codec import KVCodec
from ...format.layout import CacheLayout
from ...format.rotation import device_signs
from ..cuda_extension import capable, extension
from .triton import quantize_append_triton

CUDA_QUANTIZE_HEAD_DIMS = (64, 128, 256, 512)
_ALIGN = 16   # the kernel reads each lane's 32 values with 16-byte loads


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along D and every row 16-byte aligned (a copy only when it is not)."""
    size = x.element_size()
    if (x.stride(3) == 1 and x.data_ptr() % _ALIGN == 0
            and all(s * size % _ALIGN == 0 for s in x.stride()[:3])):
        return x
    return x.contiguous() if not x.is_contiguous() else x.clone()


# The cell search's uniform grid per bit width, (lo, cells per unit of u, cells): every boundary lies inside
# [lo, -lo), and a cell (1 / scale wide) is narrower than the closest two boundaries (0.258 apart at 4 bits, 0.132 at 5,
# 0.067 at 6, 0.0169 at 8), so one grid read and one boundary compare find a code cell.
_GRIDS = {2: (-4.0, 8, 64), 3: (-4.0, 8, 64), 4: (-4.0, 8, 64), 5: (-4.0, 16, 128), 6: (-4.0, 16, 128),
          8: (-8.0, 64, 1024)}


@lru_cache(maxsize=None)
def cell_grid(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """(centroids, boundaries + [inf], grid [cells] uint8, lo, scale) for the kernel: grid[g] counts the boundaries
    strictly below lo + g / scale, so a coordinate's code is grid[g] + (boundaries[grid[g]] < u)."""
    lo, scale, cells = _GRIDS[bits]
    bounds = codebook.boundaries(bits, torch.float32)
    if float(bounds.abs().max()) >= -lo or float((bounds[1:] - bounds[:-1]).min()) <= 1 / scale:
        raise AssertionError(f"the {bits}-bit grid does not separate the boundaries")
    edges = lo + torch.arange(cells, dtype=torch.float32) / scale
    grid = torch.searchsorted(bounds, edges).to(torch.uint8)
    padded = torch.cat([bounds, torch.tensor([float("inf")])])
    return (codebook.device_centroids(bits, device, torch.float32), padded.to(device), grid.to(device), lo,
            float(scale))


@lru_cache(maxsize=None)
def _tables(k_bits: int, v_bits: int, head_dim: int, device: torch.device) -> tuple:
    """The kernel's read-only tables, in its argument order: each side's cell_grid, then the rotation's signs."""
    return (*cell_grid(k_bits, device), *cell_grid(v_bits, device), device_signs(head_dim, device))


def quantize_append_cuda(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, codec: KVCodec,
                         new_lengths: torch.Tensor | None) -> None:
    """quantize_append_triton's contract; runs the CUDA kernel when it serves the call."""
    d = codec.head_dim
    ext = extension() if d in CUDA_QUANTIZE_HEAD_DIMS and capable(k.device) else None
    if ext is None:
        quantize_append_triton(k, v, layout, codec, new_lengths)
        return
    if k.dtype != v.dtype:
        v = v.to(k.dtype)
    k, v = _aligned(k), _aligned(v)
    transform = layout.has_key_transform
    ext.quantize_append(k, v, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales,
                        *_tables(codec.k_bits, codec.v_bits, d, k.device),
                        layout.key_shift if transform else None, layout.key_gain if transform else None,
                        layout.seen, new_lengths, layout.nonfinite, codec.k_bits, codec.v_bits, codec.scale_rule_id,
                        layout.is_ring)
