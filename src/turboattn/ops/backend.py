"""Which path runs: Triton kernels or the PyTorch reference."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(backend: str, tensor: torch.Tensor) -> bool:
    """auto: Triton on CUDA tensors, PyTorch elsewhere.  triton: always (CPU tensors need TRITON_INTERPRET=1)."""
    check_backend(backend)
    if backend == "torch":
        return False
    if backend == "auto":
        return tensor.is_cuda and triton_available()
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package; install it or use backend='torch'")
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return True
