"""Launch plan of the quantize-append kernel."""

from __future__ import annotations

from dataclasses import dataclass

# Tokens per program: the rotation tile is BLOCK_T x min(D, 256) float32 in registers.
_BLOCK_T = {64: 64, 128: 64, 256: 32, 512: 16}


@dataclass(frozen=True)
class QuantizePlan:
    block_t: int
    num_warps: int = 4


def plan_quantize(head_dim: int) -> QuantizePlan:
    return QuantizePlan(block_t=_BLOCK_T[head_dim])
