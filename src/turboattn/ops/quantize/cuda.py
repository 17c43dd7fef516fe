"""The CUDA fast path of quantize-append (csrc/quantize.cu): head_dim 64/128/256/512, every bit width, scale rule
and scale dtype, key transform, rings, per-sequence lengths, the non-finite count, the exact rows and the lengths'
advance, in one launch; keys in the channel groups the decode kernel reads (cached/config.py CUDA_KEY_GROUPS).
Other head dims and groupings, GPUs before sm_80 and machines where the extension cannot be built go to the Triton
kernel."""

from __future__ import annotations

from functools import lru_cache

import torch

from ...format.codec import KVCodec
from ...format.layout import CacheLayout
from ...format.rotation import device_signs
from ..cached.config import CUDA_KEY_GROUPS
from ..cuda_extension import arrival_counters, capable, extension
from ..device_tables import key_group_hartley
from ..guard import device_guard
from .config import boundary_grid
from .triton import quantize_append_triton

CUDA_QUANTIZE_HEAD_DIMS = (64, 128, 256, 512)
# (head_dim, key groups) the kernel codes (csrc/decode.h's TURBOATTN_KEY_GROUPS, with the decode kernel's builds;
# any value width).
CUDA_QUANTIZE_KEY_GROUPS = frozenset((d, groups) for d, groups, _ in CUDA_KEY_GROUPS)
_ALIGN = 16   # the kernel reads each lane's 32 values with 16-byte loads


def _aligned(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v (one dtype) with unit stride along D and every row 16-byte aligned (a copy of one that is not)."""
    if _pair_aligned(k, v):
        return k, v
    return _aligned_one(k), _aligned_one(v)


def _pair_aligned(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether k and v (one dtype, a head dim of CUDA_QUANTIZE_HEAD_DIMS) have unit stride along D and every row
    16-byte aligned."""
    if k.is_contiguous() and v.is_contiguous():
        # A decode step's: rows lie a multiple of D elements from the first (the stride of a size-1 dim, which
        # contiguity leaves free, only ever meets index 0), so the addresses decide.  Reading the strides took
        # microseconds more of a decode step on the host (three more torch entry points to run from a cold cache).
        return (k.data_ptr() | v.data_ptr()) % _ALIGN == 0
    k0, k1, k2, k3 = k.stride()
    v0, v1, v2, v3 = v.stride()
    # Strides are non-negative: the OR of the addresses and the byte strides is a multiple of 16 when each is (one
    # test where a generator per tensor took microseconds: this runs in every layer of every decode step).
    return k3 == 1 and v3 == 1 and (k.data_ptr() | v.data_ptr()
                                    | (k0 | k1 | k2 | v0 | v1 | v2) * k.element_size()) % _ALIGN == 0


def _aligned_one(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy of it with unit stride along D and every row 16-byte aligned."""
    size = x.element_size()
    s0, s1, s2, s3 = x.stride()
    if s3 == 1 and (x.data_ptr() | (s0 | s1 | s2) * size) % _ALIGN == 0:
        return x
    return x.contiguous() if not x.is_contiguous() else x.clone()


# The cell search's uniform grid per bit width, (lo, cells): [lo, -lo) holds every boundary, and a cell is narrower
# than the closest two boundaries (0.258 apart at 4 bits, 0.132 at 5, 0.067 at 6, 0.0169 at 8).  The grids are small
# (64 to 1024 one-byte cells) so that the lanes of a warp seldom read two words of one shared-memory bank.
_GRIDS = {2: (-4.0, 64), 3: (-4.0, 64), 4: (-4.0, 64), 5: (-4.0, 128), 6: (-4.0, 128), 8: (-8.0, 1024)}


@lru_cache(maxsize=None)
def cell_grid(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """(centroids, boundaries + [inf], grid [cells] uint8, lo, scale) for the kernel (config.boundary_grid): grid[g]
    counts the boundaries strictly below lo + g / scale."""
    lo, cells = _GRIDS[bits]
    return (*boundary_grid(bits, lo, cells, torch.uint8, device), lo, cells / (-2.0 * lo))


@lru_cache(maxsize=None)
def _tables(k_bits: int, v_bits: int, head_dim: int, device: torch.device) -> tuple:
    """The kernel's read-only tables, in its argument order: each side's cell_grid, then the rotation's signs."""
    return (*cell_grid(k_bits, device), *cell_grid(v_bits, device), device_signs(head_dim, device))


@lru_cache(maxsize=None)
def group_tables(key_groups: tuple[tuple[int, int], ...], device: torch.device) -> tuple:
    """Keys in groups: group b's cell_grid (centroids, boundaries, grid, lo, scale) and both groups' Hartley factors
    (device_tables.key_group_hartley), in the kernel's argument order."""
    return (*cell_grid(key_groups[1][1], device), *key_group_hartley(key_groups, device))


_NO_ROWS = (None, None)


def _unit_d_stride(*rows: torch.Tensor | None) -> bool:
    """Whether the exact rows given (None: none) have unit stride along D, as the kernel reads them."""
    for x in rows:   # is_contiguous() first: cheaper than stride(3), and a contiguous row (D > 1) has unit stride
        if x is not None and not x.is_contiguous() and x.stride(3) != 1:
            return False
    return True


def quantize_append_cuda(k: torch.Tensor, v: torch.Tensor, layout: CacheLayout, codec: KVCodec,
                         new_lengths: torch.Tensor | None, advance: bool = True) -> None:
    """quantize_append_naive's contract in one launch (codes, exact rows, lengths) when the kernel serves the call;
    the Triton path otherwise."""
    # What comes from the layout and codec alone is derived once per layout (a decode step's launcher skips the rest).
    fixed = _layout_args(layout, codec)
    dev = k.device
    ext = extension() if fixed.serves else None
    if ext is None:
        with device_guard(dev):   # the ops' guard is this implementation's own (library.SELF_GUARDED)
            quantize_append_triton(k, v, layout, codec, new_lengths, advance)
        return
    if k.dtype != v.dtype:
        v = v.to(k.dtype)
    k, v = _aligned(k, v)
    # The arrival counters of the lengths' advance, one per sequence (None: the kernel leaves seen alone).
    counters = None if not advance else fixed.counters if fixed.counters is not None else \
        arrival_counters(dev, k.shape[0])
    ext.quantize_append(k, v, *fixed.head, counters, new_lengths, *fixed.tail)


def append_launcher(layout: CacheLayout, codec: KVCodec):
    """A decode step's append, launch(k, v) = quantize_append_cuda(k, v, layout, codec, None), for k, v that the cache
    has checked (QuantizedKVCache.check_kv: one dtype, the layout's device and shape): everything else is derived
    here, once.  None where the kernel does not serve the layout."""
    fixed = _layout_args(layout, codec)
    ext = extension() if fixed.serves else None
    if ext is None or fixed.counters is None:
        return None   # the Triton path, or the counters of each call's stream: quantize_append_cuda's work
    head, counters, tail = fixed.head, fixed.counters, fixed.tail

    def launch(k: torch.Tensor, v: torch.Tensor) -> None:
        if _pair_aligned(k, v):   # a decode step's fresh k, v; others (copies) go the general way
            ext.quantize_append(k, v, *head, counters, None, *tail)
        else:
            quantize_append_cuda(k, v, layout, codec, None)
    return launch


def _layout_args(layout: CacheLayout, codec: KVCodec) -> _LayoutArgs:
    return layout.derived_for(_LAYOUT_ARGS, codec, _LayoutArgs)


_LAYOUT_ARGS = "cuda quantize-append"   # CacheLayout.derived's key


class _LayoutArgs:
    """The launch's arguments that come from a layout and its codec alone, derived once per layout (a decode step's
    layout is the same object every step until the cache's tensors change: CacheLayout.derived)."""

    __slots__ = ("codec", "serves", "head", "counters", "tail")

    def __init__(self, layout: CacheLayout, codec: KVCodec):
        d, dev = codec.head_dim, layout.k_codes.device
        recent = (layout.recent_k, layout.recent_v) if layout.exact_recent else _NO_ROWS
        first = (layout.first_k, layout.first_v) if layout.exact_first else _NO_ROWS
        self.codec = codec
        groups = codec.key_groups
        # The head dims, key groupings and GPUs the kernel serves, with exact rows (if any) of unit stride along D as
        # it writes them.
        self.serves = (d in CUDA_QUANTIZE_HEAD_DIMS and (not groups or (d, groups) in CUDA_QUANTIZE_KEY_GROUPS)
                       and capable(dev) and _unit_d_stride(*recent, *first))
        key_gain = layout.key_gain   # None without a key transform
        k_bits = groups[0][1] if groups else codec.k_bits   # key groups: group a's, group b's in the tail
        self.head = (layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales,
                     *_tables(k_bits, codec.v_bits, d, dev), layout.key_shift if key_gain is not None else None,
                     key_gain, layout.seen, layout.starts) if self.serves else None
        self.counters = layout.merge_counters   # None: the shared arrival counters of the call's stream
        if groups and self.serves:   # group a's width, group b's bits, the channel order, group b's tables
            order = layout.key_order if key_gain is not None else None   # the kernel reads it as [B, Hkv, D]
            grouped = (groups[0][0], groups[1][1], None if order is None else order.contiguous(),
                       *group_tables(groups, dev))
        else:
            grouped = (0, 0, None, None, None, None, 0.0, 0.0, None, None)
        self.tail = (layout.nonfinite, *recent, *first, k_bits, codec.v_bits, codec.scale_rule_id,
                     layout.sliding_window is not None, *grouped)
