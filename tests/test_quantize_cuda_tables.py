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


# The tile loop's search (csrc/quantize.cu build_tile_grid / tile_cells): round-to-nearest cells over |u| <= sqrt(D),
# cell c = RN(u * scale + half) (an FMA into a float whose mantissa holds it), entries counting the boundaries strictly
# below the cell's left edge, a table of tile_grid_cells<D>() entries indexed by the float's low bits.
_TILE_GRID_CELLS = {64: 2048, 128: 2048, 256: 4096}
_ROUND_MAGIC = 12582912.0   # 1.5 * 2^23


def _tile_grid(bits: int, d: int):
    _, bounds, _, _, scale = cell_grid(bits, torch.device("cpu"))
    half = int(torch.ceil(torch.tensor((d ** 0.5 + 1.0) * scale, dtype=torch.float32)))
    left = ((torch.arange(2 * half + 1, dtype=torch.float32) - half) - 0.5) / scale
    finite = bounds[:-1]
    cells = torch.searchsorted(finite, left, side="left")   # boundaries strictly below each left edge
    return bounds, cells, half, scale


def _tile_search(u: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    bounds, cells, half, scale = _tile_grid(bits, d)
    v = (u.double() * scale + (half + _ROUND_MAGIC)).float()   # one rounding, as the FMA's (u * scale is exact)
    c = (v.view(torch.int32) & (_TILE_GRID_CELLS[d] - 1)).long()
    below = cells[c]
    return below + (bounds[below] < u).long()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_tile_grid_search_finds_the_reference_cell(bits, d, gen):
    bounds = codebook.boundaries(bits, torch.float32)
    r = float(d) ** 0.5
    edges = (torch.arange(-int(r * 64) - 1, int(r * 64) + 2, dtype=torch.float32) + 0.5) / 64   # cell edges at every scale
    u = torch.cat([torch.randn(100_000, generator=gen) * 1.5, (torch.rand(20_000, generator=gen) * 2 - 1) * r,
                   bounds[:-1], torch.nextafter(bounds[:-1], torch.full_like(bounds[:-1], -1e9)),
                   torch.nextafter(bounds[:-1], torch.full_like(bounds[:-1], 1e9)), edges, -edges,
                   torch.tensor([0.0, -0.0, r, -r, r * 1.0000005, -r * 1.0000005])])
    bounds, cells, half, _ = _tile_grid(bits, d)
    assert 2 * half + 1 <= _TILE_GRID_CELLS[d] and bool((cells <= 2 ** bits - 1).all())
    assert torch.equal(_tile_search(u, bits, d), cell_index(u, bits))
