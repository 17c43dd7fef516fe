"""Randomized Hadamard rotation R x = H (s * x) / sqrt(D).

H is the Sylvester Hadamard matrix and s a fixed ±1 sign vector, so R is
orthogonal and R^-1 y = s * (H y) / sqrt(D).  The fast Walsh–Hadamard transform
costs D log2 D additions instead of a D x D product.
"""

from __future__ import annotations

from functools import lru_cache
from numbers import Integral

import torch

SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)

# 512 sign bits, least significant bit first within each byte; bit j set means s_j = -1.
_SIGN_TABLE = bytes.fromhex(
    "a73b91f46dc2580eb37f24d68945ea1c63afd852970be13d"
    "76c419fe4a852cdbd34ea8179c5be63172b90df5438a6ec7"
    "582f94e1b63d0a7cc561d84fa3971e85"
)


def check_head_dim(head_dim: int) -> None:
    # `128.0 in SUPPORTED_HEAD_DIMS` is True; a float head_dim breaks every shape computation.
    if isinstance(head_dim, bool) or not isinstance(head_dim, Integral) or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim!r}")


@lru_cache(maxsize=None)
def _signs_cpu(head_dim: int) -> torch.Tensor:
    bits = [(_SIGN_TABLE[j // 8] >> (j % 8)) & 1 for j in range(head_dim)]
    return 1.0 - 2.0 * torch.tensor(bits, dtype=torch.float32)


def signs(head_dim: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ±1 sign vector s of length head_dim."""
    check_head_dim(head_dim)
    # copy=True: a caller writing into the result must not corrupt the cached table.
    return _signs_cpu(head_dim).to(device=device, dtype=dtype, copy=True)


@lru_cache(maxsize=None)
def device_signs(head_dim: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """signs(head_dim) on `device`, cached and read-only: rotations copy nothing from the host per call."""
    return signs(head_dim, device, dtype)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized H x along the last dim (length a power of two), natural (Sylvester) order."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """R x along the last dim, computed in x's dtype (pass float32/float64 for accuracy)."""
    d = x.shape[-1]
    return walsh_hadamard(x * device_signs(d, x.device, x.dtype)) * (d ** -0.5)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """R^-1 y = R^T y along the last dim."""
    d = y.shape[-1]
    return walsh_hadamard(y) * (d ** -0.5) * device_signs(d, y.device, y.dtype)


def rotation_matrix(head_dim: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense R (rows = outputs), for tests and for folding into matrix products."""
    return rotate(torch.eye(head_dim, dtype=dtype)).T
