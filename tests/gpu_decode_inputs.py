"""Shared pieces of the GPU decode tests (tests/gpu/): random decode-step inputs, allocator poisoning, error."""

from __future__ import annotations

import torch


def decode_inputs(b: int, hkv: int, g: int, tq: int, d: int, fresh: bool, with_sinks: bool):
    """(q [B, Hkv G, Tq, D], fresh k, v [B, Hkv, Tq, D] or None, sinks [Hkv G] or None), bf16 on the GPU."""
    q = torch.randn(b, hkv * g, tq, d, device="cuda", dtype=torch.bfloat16)
    kf = vf = None
    if fresh:
        kf = torch.randn(b, hkv, tq, d, device="cuda", dtype=torch.bfloat16)
        vf = torch.randn_like(kf)
    sinks = torch.randn(hkv * g, device="cuda") if with_sinks else None
    return q, kf, vf, sinks


def poison_allocator() -> None:
    """Fill free allocator blocks with NaN so that any output element a kernel fails to write shows up."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
