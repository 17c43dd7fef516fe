"""Launch facts shared by every op's config: the device's SM count, the one split-K rule, and grid arithmetic."""

from __future__ import annotations

from functools import lru_cache

import torch

# What the interpreter pretends to have: small enough that CPU tests exercise several splits.
INTERPRETER_SMS = 4


@lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints.  The decode step's launchers use this rather than triton.cdiv, which is a
    constexpr function in Triton 3.9 (about 2 µs a call on the host, a few calls per layer and step)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1): triton.next_power_of_2 without its host cost (see cdiv)."""
    return 1 << (n - 1).bit_length()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRETER_SMS for CPU tensors run under the interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def num_splits_for(device: torch.device, programs: int, tokens: int, programs_per_sm: int,
                   min_tokens_per_split: int) -> int:
    """Split-K count: enough programs for `programs_per_sm` per SM, but no split shorter than
    `min_tokens_per_split` keys (short splits pay their merge and prologue for little work).

    `programs` is the grid without splits (batch x KV heads x row blocks); `tokens` the longest
    key range.  Each op's config says its two constants and why.
    """
    want = max(1, -(-programs_per_sm * sm_count(device) // max(programs, 1)))
    most = max(1, tokens // max(min_tokens_per_split, 1))
    return min(want, most)
