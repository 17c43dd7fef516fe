"""The kernels' read-only per-device tables (codebooks, signs, Hadamard and Hartley tiles), made ahead of time.

Each table is cached per device on first use.  Made for the first time inside torch.compile's CUDA-graph
warm-up (mode="reduce-overhead"), a table is allocated from the graph's private memory pool and outlives
the graph, which inductor refuses ("tensor(s) in the cudagraph pool not tracked as outputs").  A cache on
a GPU therefore makes every table its kernels will read when it is created, in eager code.
"""

from __future__ import annotations

import torch

from ..format.codebook import device_centroids
from ..format.codec import KVCodec
from ..format.rotation import device_hartley, device_signs, odd_factor
from .backend import importable


def key_group_hartley(key_groups: tuple[tuple[int, int], ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each key group's Hartley factor as the CUDA kernels read it (float32, rounded once from float64, as
    format/rotation.py's float32 path rounds it), group a's first; cached per device (device_hartley)."""
    return tuple(device_hartley(odd_factor(width), device, torch.float32) for width, _ in key_groups)


def allocate_device_tables(codec: KVCodec, device: torch.device) -> None:
    """Make (or find cached) every table the quantize and attention kernels read for this codec."""
    if codec.grouped_keys:   # each key group's tables as a key of its width, and the values'
        for part in (*codec.key_group_codecs, KVCodec(codec.head_dim, codec.v_bits, codec.v_bits)):
            allocate_device_tables(part, device)
        if importable("triton"):   # the groups' block-diagonal rotation, which the kernels' hosts apply to q
            from .cached.triton import group_rotation
            from .quantize.cuda import CUDA_QUANTIZE_KEY_GROUPS
            group_rotation(codec.key_groups, device)
            if (codec.head_dim, codec.key_groups) in CUDA_QUANTIZE_KEY_GROUPS:   # the CUDA kernels' Hartley factors
                key_group_hartley(codec.key_groups, device)
        return
    d = codec.head_dim
    device_signs(d, device)
    for bits in {codec.k_bits, codec.v_bits, 4}:
        for dtype in (torch.float32, torch.float16):
            device_centroids(bits, device, dtype)
    if not importable("triton"):
        return
    from .quantize.cuda import cell_grid
    from .quantize.triton import cell_tables
    from .triton_lib import hadamard_tile, kron_tile, padded_factor
    m, _ = padded_factor(d)
    # The Hadamard tiles of both kernels' rotations (a placeholder of 16 where the Hartley factor's tile serves).
    for n in ({d // 2, min(d, 256)} if m == 1 else {16}):
        hadamard_tile(n, device)
    kron_tile(m, device)
    for bits in {codec.k_bits, codec.v_bits}:
        cell_tables(bits, device)
        cell_grid(bits, device)   # the CUDA quantize kernel's
