"""The device guard of a launch: a Triton launch takes its device and stream from torch's *current* device
(triton.runtime.jit: driver.active.get_current_device()), not from its arguments, so a call on cuda:1 tensors
while cuda:0 is current would otherwise launch on cuda:0's stream with cuda:1 pointers."""

from __future__ import annotations

import contextlib

import torch

_NO_GUARD = contextlib.nullcontext()


def device_guard(device: torch.device):
    """A guard that makes `device` torch's current CUDA device for the block (nothing for other devices):
    Triton and torch.cuda.current_stream() then see the tensors' device and its current stream."""
    return torch.cuda.device(device) if device.type == "cuda" else _NO_GUARD
