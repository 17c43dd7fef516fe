"""The format's scalar codebooks of the standard normal distribution: Lloyd–Max below 8 bits, uniform at 8.

A b-bit codebook has 2**b centroids c_0 < ... < c_{n-1} and n-1 decision
boundaries t_i = (c_i + c_{i+1}) / 2.  It is MSE-optimal when every centroid is
the conditional mean of N(0,1) on its cell (the Lloyd conditions).  Plain Lloyd
iteration converges linearly and very slowly at 6–8 bits, so we polish its
result with Newton's method on the fixed-point equations, whose Jacobian is
tridiagonal and known in closed form.  Tables are computed in float64 on first
use (a few milliseconds) and cached.

8-bit codes take uniform levels instead (UNIFORM_BITS): c_i = (i - 128) / 32.  A
step of 1/32 gives an MSE 0.4% above the best uniform step's (8.80e-5 against
8.77e-5 at 0.0308); Lloyd–Max's 8-bit table would halve it (4.12e-5, 3.3 dB),
but every one of its codes costs the decode kernel a table lookup, while a
uniform level is the float16 number (1024 + i) / 32 - 36, which a byte-permute
and one fused multiply-add make exactly from the code byte.  The levels stay
below 7-bit Lloyd–Max's MSE (1.63e-4) by 1.9x.
"""

from __future__ import annotations

import math
from functools import lru_cache
from numbers import Integral

import torch

MIN_BITS, MAX_BITS = 1, 8
# Widths whose codebook is uniform levels (module docstring): (i - 2^(b-1)) * UNIFORM_STEP, i < 2^b.
UNIFORM_BITS = (8,)
UNIFORM_STEP = 1.0 / 32.0
# Float64 evaluation noise of the Lloyd conditions is ~1e-11 at 8 bits.
CONVERGED_RESIDUAL = 1e-10
_SQRT_2PI = math.sqrt(2.0 * math.pi)


def _pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / _SQRT_2PI


def _cell_stats(centroids: torch.Tensor):
    """Boundaries (with ±inf ends), cell probabilities and first moments."""
    inner = 0.5 * (centroids[1:] + centroids[:-1])
    inf = torch.tensor([math.inf], dtype=torch.float64)
    edges = torch.cat([-inf, inner, inf])
    lo, hi = edges[:-1], edges[1:]
    # Difference the tail nearer to the cell, so tail cells keep full precision.
    right = torch.special.ndtr(-lo) - torch.special.ndtr(-hi)
    left = torch.special.ndtr(hi) - torch.special.ndtr(lo)
    prob = torch.where(lo >= 0, right, left)
    moment = _pdf(lo) - _pdf(hi)
    return edges, prob, moment


def lloyd_residual(centroids: torch.Tensor) -> float:
    """max_i |c_i - E[X | X in cell i]|: zero exactly at a Lloyd–Max fixed point."""
    _, prob, moment = _cell_stats(centroids.to(torch.float64))
    return float((centroids.to(torch.float64) - moment / prob).abs().max())


def _newton_step(c: torch.Tensor) -> torch.Tensor:
    edges, prob, moment = _cell_stats(c)
    target = moment / prob
    residual = c - target
    n = c.numel()
    lo, hi = edges[:-1], edges[1:]
    # d target_i / d lo_i and d target_i / d hi_i (pdf at ±inf is 0).
    d_lo = torch.where(torch.isfinite(lo), _pdf(lo) * (target - lo) / prob, torch.zeros_like(lo))
    d_hi = torch.where(torch.isfinite(hi), _pdf(hi) * (hi - target) / prob, torch.zeros_like(hi))
    # lo_i = (c_{i-1} + c_i)/2, hi_i = (c_i + c_{i+1})/2.
    jac = torch.eye(n, dtype=torch.float64)
    idx = torch.arange(n)
    jac[idx, idx] -= 0.5 * (d_lo + d_hi)
    jac[idx[1:], idx[1:] - 1] -= 0.5 * d_lo[1:]
    jac[idx[:-1], idx[:-1] + 1] -= 0.5 * d_hi[:-1]
    return c - torch.linalg.solve(jac, residual)


@lru_cache(maxsize=None)
def _solve(bits: int) -> torch.Tensor:
    n = 1 << bits
    # Start at the normal quantiles of the cell midpoints, then let Lloyd settle
    # the shape before Newton (which wants a good start) finishes the job.
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    c = math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)
    for _ in range(50):
        _, prob, moment = _cell_stats(c)
        c = moment / prob
    # Newton converges quadratically (step 1e-4 -> 1e-9 -> float64 noise) in a
    # handful of steps; a fixed count keeps it deterministic.
    for _ in range(8):
        c = _newton_step(c)
    c = 0.5 * (c - c.flip(0))  # exact symmetry
    if lloyd_residual(c) > CONVERGED_RESIDUAL:
        raise RuntimeError(f"Lloyd–Max solver did not converge for {bits} bits")
    return c


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, Integral) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")


def lloyd_max(bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2**bits Lloyd–Max centroids of N(0,1), ascending (the format's codebook below 8 bits)."""
    _check_bits(bits)
    # copy=True: a caller writing into the result must not corrupt the cached table.
    return _solve(bits).to(dtype, copy=True)


def centroids(bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The format's 2**bits centroids, ascending: Lloyd–Max, or uniform levels at UNIFORM_BITS."""
    _check_bits(bits)
    if bits in UNIFORM_BITS:
        levels = torch.arange(1 << bits, dtype=torch.float64) - (1 << (bits - 1))
        return (levels * UNIFORM_STEP).to(dtype)   # exact in float16 and up
    return lloyd_max(bits, dtype)


def boundaries(bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2**bits - 1 decision boundaries: value u maps to the number of boundaries < u."""
    c = centroids(bits, torch.float64)
    return (0.5 * (c[1:] + c[:-1])).to(dtype)


@lru_cache(maxsize=None)
def device_centroids(bits: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """centroids(bits) on `device`, cached: read-only, so calls copy nothing from the host (CUDA-graph safe)."""
    return centroids(bits, dtype).to(device)


@lru_cache(maxsize=None)
def device_boundaries(bits: int, device: torch.device) -> torch.Tensor:
    """boundaries(bits) in float32 on `device`, cached and read-only like device_centroids."""
    return boundaries(bits, torch.float32).to(device)


def quantizer_mse(table: torch.Tensor) -> float:
    """E[(X - Q(X))^2], X ~ N(0,1), for nearest-centroid quantization with any sorted table."""
    c = table.to(torch.float64)
    _, prob, moment = _cell_stats(c)
    # E[X^2 on cell] = prob + lo*pdf(lo) - hi*pdf(hi); the ends contribute 0.
    edges = torch.cat([torch.tensor([-math.inf], dtype=torch.float64),
                       0.5 * (c[1:] + c[:-1]), torch.tensor([math.inf], dtype=torch.float64)])
    x_pdf = torch.nan_to_num(edges * _pdf(edges), nan=0.0)
    second = prob + x_pdf[:-1] - x_pdf[1:]
    return float((second - 2.0 * c * moment + c * c * prob).sum())


def expected_mse(bits: int) -> float:
    """MSE of the format's b-bit quantizer (centroids) on N(0,1)."""
    return quantizer_mse(centroids(bits, torch.float64))


# The CUDA decode kernel builds its byte -> centroid tables from these codebooks as compile-time constants
# (ops/cached/csrc/codebooks.h), so that the table build waits on no load.  8-bit levels need no table: the kernel
# computes them from the code byte (decode.cuh: CodeTable<8>).
CUDA_HEADER_BITS = (2, 3, 4, 5, 6)


def cuda_header() -> str:
    """The text of ops/cached/csrc/codebooks.h: every codebook the CUDA kernel is built for, as the float16 bit
    patterns of its float32 centroids rounded to nearest (what the kernel computed from the device tables before).
    tests/test_codebook.py checks that the file matches; regenerate it with
    `python -c "from turboattn.format.codebook import cuda_header; print(cuda_header(), end='')" > <the file>`."""
    lines = ["// Generated by turboattn.format.codebook.cuda_header() (tests/test_codebook.py checks it): the Lloyd-Max",
             "// centroids of N(0,1) for each width the CUDA decode kernel looks up in tables, as float16 bit patterns",
             "// (float32 centroids rounded to nearest), ascending.  The kernel's table build reads them as immediates.",
             "#pragma once", "", "namespace turboattn {", "", "template <int BITS>", "struct Codebook;"]
    for bits in CUDA_HEADER_BITS:
        halves = centroids(bits, torch.float32).to(torch.float16).view(torch.int16).tolist()
        words = [f"0x{h & 0xFFFF:04x}" for h in halves]
        body = [", ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
        lines += ["", "template <>", f"struct Codebook<{bits}> {{",
                  f"  static constexpr unsigned short HALF[{len(words)}] = {{"]
        lines += [f"      {row}," for row in body]
        lines += ["  };", "};"]
    lines += ["", "}  // namespace turboattn", ""]
    return "\n".join(lines)
