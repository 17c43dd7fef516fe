"""Which implementation serves a call: a registry of (op, implementation) with capability checks.

Each op's package registers its implementations in one line each
(`register("cached_attention", "triton", "turboattn.ops.cached.triton:cached_attention_triton",
priority=10, devices=("cuda",))`); the module is imported only when the implementation runs, so
the PyTorch path never imports Triton.  `backend="auto"` picks the highest-priority
implementation whose check accepts the tensors' device and head_dim (and, for a codec with keys in
channel groups, reads those: the PyTorch and Triton paths, and the CUDA decode and quantize-append for the
groupings they are built for, passing the others to Triton); naming one forces it (a head_dim or a format it does not serve is
a ValueError, never a wrong result).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Implementation:
    op: str
    name: str                      # what backend= names ("torch", "triton", ...)
    target: str                    # "package.module:function", imported on first use
    priority: int                  # "auto" prefers the highest that supports the device
    devices: tuple[str, ...]       # device types "auto" may send to it ("*": any); forcing ignores this
    requires: tuple[str, ...] = ()  # importable modules it needs
    head_dims: tuple[int, ...] | None = None  # the head dims it serves (None: every one the format has)
    grouped_keys: bool = False     # whether it reads keys coded in channel groups (codec.key_groups)

    def serves(self, head_dim: int | None, grouped_keys: bool = False) -> bool:
        return ((head_dim is None or self.head_dims is None or head_dim in self.head_dims)
                and (self.grouped_keys or not grouped_keys))


_REGISTRY: dict[str, dict[str, Implementation]] = {}

# Counts register() calls: a choice remembered past one call (a cache's decode step, attention.py) is stale once it
# changes.
generation = 0


def register(op: str, name: str, target: str, *, priority: int, devices: tuple[str, ...],
             requires: tuple[str, ...] = (), head_dims: tuple[int, ...] | None = None,
             grouped_keys: bool = False) -> None:
    global generation
    _REGISTRY.setdefault(op, {})[name] = Implementation(op, name, target, priority, devices, requires, head_dims,
                                                        grouped_keys)
    _auto.cache_clear()
    generation += 1


def implementations(op: str) -> list[Implementation]:
    """Registered implementations of `op`, best first."""
    return sorted(_REGISTRY[op].values(), key=lambda impl: -impl.priority)


@lru_cache(maxsize=None)
def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# torch.compile calls this while tracing and keeps the name as a constant (it reads no tensor; tracing it
# would step into importlib through the lru_cache).
@torch.compiler.assume_constant_result
def choose(op: str, backend: str, device: torch.device, head_dim: int | None = None,
           grouped_keys: bool = False) -> str:
    """The implementation name that serves `op` for tensors on `device` with this head_dim (None: any) and a
    codec with keys in channel groups or not (host only: no tensor is read)."""
    if backend == "auto":
        name = _auto(op, device, head_dim, grouped_keys)
        if name is None:  # torch covers every device and head dim
            raise RuntimeError(f"no implementation of {op} supports device {device} with head_dim={head_dim}")
        return name
    check_backend(backend)
    impl = _REGISTRY[op].get(backend)
    if impl is None:
        raise ValueError(f"{op} has no {backend!r} implementation; registered: {sorted(_REGISTRY[op])}")
    if not impl.serves(None, grouped_keys):
        raise ValueError(f"backend={backend!r} for {op} does not read keys coded in channel groups "
                         "(codec.key_groups) yet; use backend='torch' (or 'auto')")
    if not impl.serves(head_dim):
        raise ValueError(f"backend={backend!r} for {op} serves head_dim in {impl.head_dims}, got "
                         f"head_dim={head_dim}; use backend='torch' (or 'auto')")
    missing = [m for m in impl.requires if not importable(m)]
    if missing:
        raise RuntimeError(f"backend={backend!r} needs the {', '.join(missing)} package; install it or use "
                           "backend='torch'")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return impl.name


# Every layer of every decode step asks (register() clears it).  Keyed by the device itself: a torch.device hashes
# in a few dozen ns, where device.type builds a new string each call.
@lru_cache(maxsize=None)
def _auto(op: str, device: torch.device, head_dim: int | None, grouped_keys: bool = False) -> str | None:
    """The name of the best implementation of `op` that "auto" may send this device's type, head_dim and key
    format to."""
    device_type = device.type
    for impl in implementations(op):
        if ((device_type in impl.devices or "*" in impl.devices) and impl.serves(head_dim, grouped_keys)
                and all(importable(m) for m in impl.requires)):
            return impl.name
    return None


@lru_cache(maxsize=None)
def load(op: str, name: str) -> Callable:
    """The function behind (op, implementation), imported on first use."""
    module, function = _REGISTRY[op][name].target.split(":")
    return getattr(importlib.import_module(module), function)
