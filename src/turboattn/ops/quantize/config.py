"""Launch plan of the quantize-append kernels, and the tables of their cell search."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ...format import codebook

# Tokens per program for long chunks (prefill), by the padded head dim next_power_of_2(D) (the columns a
# kernel holds): the rotation tile is BLOCK_T x min(padded D, 256) float32 in registers.
_BLOCK_T = {32: 64, 64: 64, 128: 64, 256: 32, 512: 16}
# The smallest tile tl.dot takes: a decode step's few tokens get this many rows, not 64 mostly masked ones.
_MIN_BLOCK_T = 16


@dataclass(frozen=True)
class QuantizePlan:
    block_t: int
    num_warps: int = 4


@lru_cache(maxsize=1024)  # asked by every append: a decode step's are all alike
def plan_quantize(head_dim: int, tokens: int | None = None) -> QuantizePlan:
    """The plan for appending `tokens` tokens per sequence (None: a long chunk)."""
    block_t = _BLOCK_T[1 << (head_dim - 1).bit_length()]
    if tokens is not None:
        block_t = min(block_t, max(_MIN_BLOCK_T, 1 << max(tokens - 1, 0).bit_length()))
    return QuantizePlan(block_t=block_t)


def boundary_grid(bits: int, lo: float, cells: int, grid_dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centroids, boundaries + [inf], grid) float32 / float32 / grid_dtype on `device`: the tables of the kernels'
    cell search.  The grid splits [lo, -lo) into `cells` equal cells and cell g holds the number of boundaries
    strictly below its left edge; every boundary lies inside the range and no cell holds two (checked), so a
    coordinate's code is grid[g] + (boundaries[grid[g]] < u), ties going to the lower cell."""
    bounds = codebook.boundaries(bits, torch.float32)
    step = -2.0 * lo / cells
    if float(bounds.abs().max()) >= -lo or float((bounds[1:] - bounds[:-1]).min()) <= step:
        raise AssertionError(f"a grid of {cells} cells over [{lo}, {-lo}) does not separate the {bits}-bit boundaries")
    edges = lo + step * torch.arange(cells, dtype=torch.float32)
    grid = torch.searchsorted(bounds, edges).to(grid_dtype)
    padded = torch.cat([bounds, torch.tensor([float("inf")])])
    return codebook.device_centroids(bits, device, torch.float32), padded.to(device), grid.to(device)
