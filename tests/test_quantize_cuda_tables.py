"""The CUDA quantize kernel's cell search tables (ops/quantize/cuda.py cell_grid), checked on the CPU: the kernel's
search (one grid read, one boundary compare) emulated in torch must give the reference codec's cell for every u."""

from __future__ import annotations

import pytest
import torch

from turboattn.format import codebook
from turboattn.format.codec import SUPPORTED_BITS, cell_index
from turboattn.ops.quantize.cuda import cell_grid


def _kernel_search(u: torch.Tensor, bits: int) -> torch.Tensor:
    """find_cells in csrc/quantize.cu: g = clamp(trunc((u - lo) * scale)), code = grid[g] + (bounds[grid[g]] < u)."""
    centroids, bounds, grid, lo, scale = cell_grid(bits, torch.device("cpu"))
    # fmaf, then the GPU's saturating truncation to int32
    g = torch.clamp((u * scale + (-lo * scale)).clamp(-2.0**31, 2.0**31 - 128).to(torch.int32), 0, grid.numel() - 1)
    below = grid[g.long()].long()
    return below + (bounds[below] < u).long()


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_grid_search_finds_the_reference_cell(bits, gen):
    bounds = codebook.boundaries(bits, torch.float32)
    u = torch.cat([torch.randn(200_000, generator=gen, dtype=torch.float32) * 1.5,
                   torch.rand(20_000, generator=gen) * 40 - 20,                  # far past the outer boundaries
                   bounds, torch.nextafter(bounds, torch.full_like(bounds, -1e9)),  # on and just below each boundary
                   torch.nextafter(bounds, torch.full_like(bounds, 1e9)),
                   torch.tensor([0.0, -0.0, 16.0, -16.0, 3.999999, -4.0, 7.99, -8.0])])  # |u| <= sqrt(256)
    assert torch.equal(_kernel_search(u, bits), cell_index(u, bits))


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_grid_tables_fit_the_kernel(bits):
    centroids, bounds, grid, lo, scale = cell_grid(bits, torch.device("cpu"))
    assert grid.dtype == torch.uint8 and grid.numel() % 16 == 0 and grid.numel() <= 1024   # 16-byte staged, MAX_GRID
    assert bounds.numel() == centroids.numel() == 2 ** bits and bounds[-1] == float("inf")
    assert lo + grid.numel() / scale == -lo                                                # the grid spans [lo, -lo)
