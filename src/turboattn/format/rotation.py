"""Randomized Hadamard rotation R x = (H ⊗ Q) (s * x) / sqrt(P), for D = P * m, P a power of two, m odd.

H is the P x P Sylvester Hadamard matrix, s a fixed ±1 sign vector and Q a fixed m x m orthogonal
matrix (the orthonormal discrete Hartley transform, Q[k, n] = cas(2 pi k n / m) / sqrt(m) with
cas t = cos t + sin t; Q = Q^T = Q^-1).  R is orthogonal, so R^-1 y = s * ((H ⊗ Q) y) / sqrt(P).
For a power-of-two D, m = 1 and Q = [1]: the plain randomized Hadamard rotation, computed by the
fast Walsh–Hadamard transform in D log2 D additions.  For other D the Hartley factor (m <= 31 for
every supported D) is a small dense product; coordinate i = p * m + r of the Kronecker product
pairs Hadamard index p with Hartley index r, so every output mixes every input.
"""

from __future__ import annotations

import math
from functools import lru_cache
from numbers import Integral

import torch

MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 32, 512, 16
SUPPORTED_HEAD_DIMS = tuple(range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, HEAD_DIM_STEP))
POWER_OF_TWO_HEAD_DIMS = tuple(d for d in SUPPORTED_HEAD_DIMS if d & (d - 1) == 0)

# 512 sign bits, least significant bit first within each byte; bit j set means s_j = -1.
_SIGN_TABLE = bytes.fromhex(
    "a73b91f46dc2580eb37f24d68945ea1c63afd852970be13d"
    "76c419fe4a852cdbd34ea8179c5be63172b90df5438a6ec7"
    "582f94e1b63d0a7cc561d84fa3971e85"
)


def check_head_dim(head_dim: int) -> None:
    # `128.0 in SUPPORTED_HEAD_DIMS` is True; a float head_dim breaks every shape computation.
    if isinstance(head_dim, bool) or not isinstance(head_dim, Integral) or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be a multiple of {HEAD_DIM_STEP} from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, "
                         f"got {head_dim!r}")


def odd_factor(head_dim: int) -> int:
    """m, the odd part of head_dim = P * m (1 for a power of two)."""
    return head_dim // (head_dim & -head_dim)


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


@lru_cache(maxsize=None)
def _hartley_cpu(m: int) -> torch.Tensor:
    # k * n reduced mod m first: the angle is then < 2 pi, so float64 cos/sin are accurate to an ulp.
    q = [[(math.cos(2 * math.pi * (k * n % m) / m) + math.sin(2 * math.pi * (k * n % m) / m)) / math.sqrt(m)
          for n in range(m)] for k in range(m)]
    return torch.tensor(q, dtype=torch.float64)


def hartley(m: int, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal discrete Hartley matrix of size m (symmetric and its own inverse), a copy."""
    if isinstance(m, bool) or not isinstance(m, Integral) or m < 1:
        raise ValueError(f"m must be a positive int, got {m!r}")
    return _hartley_cpu(m).to(device=device, dtype=dtype, copy=True)


@lru_cache(maxsize=None)
def device_hartley(m: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """hartley(m) on `device` in `dtype` (rounded once from float64), cached and read-only."""
    return hartley(m, device, dtype)


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


def _kron_transform(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized (H_P ⊗ Q_m) x along the last dim (D = P * m); symmetric, (H ⊗ Q)^2 = P * I."""
    d = x.shape[-1]
    m = odd_factor(d)
    if m == 1:
        return walsh_hadamard(x)
    lead = x.shape[:-1]
    z = x.reshape(*lead, d // m, m) @ device_hartley(m, x.device, x.dtype)  # Q symmetric: row-vector form
    return walsh_hadamard(z.transpose(-1, -2)).transpose(-1, -2).reshape(*lead, d)


def _norm(d: int) -> float:
    """1/sqrt(P), P = D's power-of-two factor: the normalization of H_P ⊗ Q_m (Q is orthonormal)."""
    check_head_dim(d)
    return (d // odd_factor(d)) ** -0.5


def rotate(x: torch.Tensor) -> torch.Tensor:
    """R x along the last dim, computed in x's dtype (pass float32/float64 for accuracy)."""
    d = x.shape[-1]
    norm = _norm(d)
    return _kron_transform(x * device_signs(d, x.device, x.dtype)) * norm


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """R^-1 y = R^T y along the last dim."""
    d = y.shape[-1]
    norm = _norm(d)
    return _kron_transform(y) * norm * device_signs(d, y.device, y.dtype)


def rotation_matrix(head_dim: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense R (rows = outputs), for tests and for folding into matrix products."""
    return rotate(torch.eye(head_dim, dtype=dtype)).T
