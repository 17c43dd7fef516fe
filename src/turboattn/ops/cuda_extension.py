"""The CUDA C++ kernels as one torch extension, built with nvcc on first use (torch.utils.cpp_extension), for the
GPUs this process sees: the decode kernel (cached/csrc) and quantize-append (quantize/csrc), bound together in
csrc/binding.cpp.  Without nvcc (or a compiler) the Triton kernels serve every call, after a one-time warning."""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path

import torch

from .cached.config import CUDA_HEAD_DIMS

_OPS = Path(__file__).parent
_INCLUDES = [_OPS / "csrc", _OPS / "cached" / "csrc", _OPS / "quantize" / "csrc"]


def _sources() -> list[Path]:
    # One translation unit per decode head dim and variant (with or without exact rows): ninja builds them in
    # parallel.
    decode = [_OPS / "cached" / "csrc" / f"decode_d{d}{variant}.cu" for d in CUDA_HEAD_DIMS for variant in ("", "_exact")]
    return [_OPS / "csrc" / "binding.cpp", *decode, _OPS / "cached" / "csrc" / "decode_groups.cu",
            _OPS / "quantize" / "csrc" / "quantize.cu"]


@lru_cache(maxsize=None)
def extension():
    """The compiled module, or None (with a one-time warning) when it cannot be built here."""
    try:
        return _build("turboattn_cuda")
    except Exception as e:  # no nvcc, no compiler, unsupported toolkit: the Triton kernels still serve
        warnings.warn(f"turboattn: the CUDA kernels could not be built ({e}); using the Triton path",
                      RuntimeWarning, stacklevel=3)
        return None


@lru_cache(maxsize=None)
def stamped_extension():
    """The same kernels in a profiling build: the decode kernel writes per-CTA phase stamps after its parts
    (nvcc -DTURBOATTN_STAMPS, csrc/decode.cuh).  For `turboattn bench phases` only; a separate name, so torch keeps
    both builds."""
    return _build("turboattn_cuda_stamps", "-DTURBOATTN_STAMPS")


def _build(name: str, *flags: str):
    """The extension `name` built (or loaded from torch's cache) from every source, with extra nvcc flags."""
    from torch.utils.cpp_extension import load
    return load(name=name, sources=[str(x) for x in _sources()], extra_cuda_cflags=nvcc_flags() + list(flags),
                extra_include_paths=[str(x) for x in _INCLUDES], verbose=False)


def nvcc_flags(archs: list[tuple[int, int]] | None = None) -> list[str]:
    """nvcc's flags for the extension: machine code for the sm_80+ architectures `archs` (default: of the GPUs this
    process sees), and nothing else (each architecture is a full build of 90 decode kernels).  Not nvcc's
    -split-compile, which spread a translation unit's kernels over the cores: under it ptxas kept the code table's
    shared-memory base out of the uniform registers in k4v4's two-team kernels (D = 128, and D = 64's exact-row
    build), one more add per lookup of a key code, 46 more loop instructions per tile at D = 128 (nvcc 13.0, sm_90;
    BENCHMARKS.md; tests/test_cuda_sass.py checks it)."""
    if archs is None:
        archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ["-O3"] + [f"-gencode=arch=compute_{a}{b},code=sm_{a}{b}" for a, b in archs if (a, b) >= (8, 0)]


def build_extension() -> bool:
    """Build the kernels now (or load torch's cached build): False, with the warning, when they cannot be built.
    Otherwise the first decode step on a GPU builds them (under a minute of nvcc, once per machine)."""
    return extension() is not None


@lru_cache(maxsize=None)
def capable(device: torch.device) -> bool:
    """Whether `device` is a GPU the kernels run on (sm_80 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


@lru_cache(maxsize=None)
def _counter_buffer(device: torch.device, stream: int, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int32, device=device)


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for a kernel whose last CTA finishes the call (the decode merge: one per
    (sequence, KV head); quantize-append's length update: one per sequence), for calls on a layout that brings none
    (a cache brings its merge_counters).  One buffer per device and stream (kernels in flight on two streams must
    not share them); every kernel leaves its counters at zero again, so kernels on one stream can share a buffer."""
    stream = torch.cuda.current_stream(device).cuda_stream
    size = 1 << max(needed - 1, 0).bit_length()  # powers of two: few buffers as batches vary
    return _counter_buffer(device, stream, max(size, 64))
