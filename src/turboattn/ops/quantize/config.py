"""Launch plan of the quantize-append kernel."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
