"""Shared by the kernel families: Hadamard rotation on tensor cores and device-cached tables."""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ..format import codebook
from ..format.codec import plane_widths
from ..format.rotation import signs, walsh_hadamard


def plane_pair(bits: int) -> tuple[int, int]:
    """(low plane width, high plane width or 0): the kernels' view of codec.plane_widths."""
    widths = plane_widths(bits)
    return widths[0], (widths[1] if len(widths) > 1 else 0)


@lru_cache(maxsize=None)
def _hadamard_cpu(n: int) -> torch.Tensor:
    return walsh_hadamard(torch.eye(n, dtype=torch.float32)).to(torch.float16)


@lru_cache(maxsize=None)
def device_centroids(bits: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Codebook centroids on `device`, cached so that launches copy nothing (CUDA-graph safe)."""
    return codebook.centroids(bits, dtype).to(device)


@lru_cache(maxsize=None)
def device_signs(head_dim: int, device: torch.device) -> torch.Tensor:
    """Read-only float32 sign vector on `device`, cached (the kernels never write it)."""
    return signs(head_dim, device)


def rotate_on_device(x: torch.Tensor) -> torch.Tensor:
    """rotation.rotate without a host-to-device copy per call (usable inside CUDA-graph capture)."""
    d = x.shape[-1]
    return walsh_hadamard(x * device_signs(d, x.device).to(x.dtype)) * (d ** -0.5)


@triton.jit
def hadamard_rows(x, h_ptr, N: tl.constexpr):
    """H_N @ each row of x [R, N] (float32 in, float32 out), on tensor cores.

    Rows are first scaled by a power of two (exact) so they fit float16, then
    split into hi + lo float16 parts: two float16 products with float32
    accumulation give ~22 significant bits, like float32 for our purposes.
    """
    amax = tl.max(tl.abs(x), axis=1)
    expo = tl.where(amax > 0, tl.ceil(tl.log2(tl.where(amax > 0, amax, 1.0))), 0.0)
    norm = tl.exp2(-expo)
    xn = x * norm[:, None]
    hi = xn.to(tl.float16)
    lo = (xn - hi.to(tl.float32)).to(tl.float16)
    offs = tl.arange(0, N)
    h = tl.load(h_ptr + offs[:, None] * N + offs[None, :])
    y = tl.dot(hi, h, out_dtype=tl.float32)
    y = tl.dot(lo, h, acc=y, out_dtype=tl.float32)
    return y / norm[:, None]


@triton.jit
def hadamard_any(x, had_ptr, N: tl.constexpr):
    """H_N @ each row of x [R, N]; had_ptr holds H_min(N, 128).

    For N = 256, H_N = [[H, H], [H, -H]] with H = H_128: one butterfly in
    registers keeps the H tile (shared memory) at 32 KB instead of 128 KB.
    """
    if N <= 128:
        return hadamard_rows(x, had_ptr, N)
    R: tl.constexpr = x.shape[0]
    x0, x1 = tl.split(tl.permute(tl.reshape(x, (R, 2, N // 2)), (0, 2, 1)))
    y0 = hadamard_rows(x0 + x1, had_ptr, N // 2)
    y1 = hadamard_rows(x0 - x1, had_ptr, N // 2)
    return tl.reshape(tl.permute(tl.join(y0, y1), (0, 2, 1)), (R, N))


@lru_cache(maxsize=None)
def hadamard_tile(n: int, device: torch.device) -> torch.Tensor:
    """The H matrix that hadamard_any(., ., n) expects: unnormalized H_min(n, 128) in float16
    (entries ±1 are exact), cached per device."""
    return _hadamard_cpu(min(n, 128)).to(device)


def row_vector_bytes(row_bytes: int) -> int:
    """Largest power of two <= 16 dividing a packed row: the widest safe vector access."""
    vec = 16
    while row_bytes % vec:
        vec //= 2
    return vec
