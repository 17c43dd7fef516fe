"""TurboQuant coding of K/V vectors: the exact PyTorch reference of the format.

Per vector x of length D: y = R x (randomized Hadamard, times a fixed Hartley
factor when D is not a power of two), split y into ceil(D/256) equal norm
blocks (min(D, 256) coordinates for a power of two), store one float32 scale per block and the
codebook cell index (Lloyd–Max below 8 bits, uniform levels at 8: codebook.py) of every coordinate of
u = y / rms(y_block), bit-packed with no wasted bits.  DESIGN.md describes the format; this module is its
definition, and the fused kernels must reproduce it.

Keys in channel groups (`key_groups`, e.g. ((112, 6), (144, 4))): the key's channels, in the order the cache
stores them (the key transform's `order` puts the highest-variance channels first), are cut into two consecutive
groups, and each group is coded as a vector of its own width at its own bits (its own rotation and scale).  A
key's codes are the groups' codes one after the other, its scales one per group.  More bits where the keys'
energy is lowers the scores' error at the same bytes (QUALITY.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from numbers import Integral
from typing import Literal

import torch

from . import codebook, rotation

# Version of the stored format (rotation signs, codebooks, norm blocks, scale rules, packing, the
# meaning of a NaN scale): saved caches carry it, and loading refuses another.  Bump it with any
# change that alters what stored codes and scales mean.  2: 8-bit codes mean uniform levels (codebook.py), where
# version 1 stored Lloyd–Max cells.
FORMAT_VERSION = 2

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SCALE_RULES = ("rms", "corrected", "lsq")
# How scales are stored: float32, or bfloat16 (float32's range, 8 significant bits: a relative rounding of at
# most 2^-8, far below a 2-8-bit code's error; QUALITY.md measured no perplexity change) at half the bytes.
SCALE_DTYPES = (torch.float32, torch.bfloat16)
NORM_BLOCK = 256
# KVCodec.quantize codes these (float64 too: the reference format, exact tests); the cache and the attention
# entry points take ATTENTION_DTYPES, the kernels' dtypes, and check them with check_attention_dtype.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A tensor's device on meta is always this one (no index): the hot paths' checks compare with it, where
# device.type builds a string.
META_DEVICE = torch.device("meta")
Kind = Literal["k", "v"]

# Bit planes per width: a b-bit code is split into planes of 4, 2 and 1 bits
# (widest plane holds the low bits) so that every plane packs whole bytes and
# a kernel loads each plane with contiguous, aligned accesses.
_PLANES = {8: (8,), 6: (4, 2), 5: (4, 1), 4: (4,), 3: (2, 1), 2: (2,)}


def plane_widths(bits: int) -> tuple[int, ...]:
    return _PLANES[bits]


@dataclass(frozen=True)
class CodeSpec:
    """What a kernel needs to know about one side's (K or V) packed rows, as plain ints."""

    bits: int
    low_plane: int      # width of the first bit plane (it holds the low bits)
    high_plane: int     # width of the second plane, 0 when there is one
    row_bytes: int      # packed code bytes per vector: D * bits / 8
    vector_bytes: int   # widest aligned access that divides a row (<= 16 bytes)


@lru_cache(maxsize=None)
def code_spec(head_dim: int, bits: int) -> CodeSpec:
    widths = plane_widths(bits)
    row_bytes = head_dim * bits // 8
    vector_bytes = 16
    while row_bytes % vector_bytes:
        vector_bytes //= 2
    return CodeSpec(bits, widths[0], widths[1] if len(widths) > 1 else 0, row_bytes, vector_bytes)


@dataclass(frozen=True, eq=False)  # tensors have no single truth value
class Packed:
    """Compressed vectors: codes [..., D*bits/8] uint8 and scales [..., D/block] (float32, or the codec's scale_dtype)."""

    codes: torch.Tensor
    scales: torch.Tensor


# Exact power-of-two scaling.  A vector is coded as x * 2^-e with e its largest magnitude's
# exponent, and its scales are multiplied by 2^e afterwards: both are exact in float arithmetic, so
# codes and scales are those of a vector of ordinary size, and norms cannot overflow (1e30) or
# underflow (1e-30, subnormals).  The quantize kernel does the same, in the same order.
_FLOAT_BITS = {torch.float32: (23, 127, torch.int32), torch.float64: (52, 1023, torch.int64)}


def pow2(n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**n as `dtype` (float32/float64), built from its bits; n must lie in the normal range (|n| < 126)."""
    mantissa_bits, bias, int_dtype = _FLOAT_BITS[dtype]
    return ((n.to(int_dtype) + bias) << mantissa_bits).view(dtype)


def times_pow2(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """x * 2**n (n int [...] broadcast over x's last dim), exact unless the result over- or underflows.

    Two factors 2**(n//2) and 2**(n - n//2), so that each stays a normal float; n beyond twice the
    exponent range is clamped (the result over- or underflows either way).
    """
    limit = 2 * (_FLOAT_BITS[x.dtype][1] - 1)
    n = n.clamp(-limit, limit)
    half = torch.div(n, 2, rounding_mode="floor")
    return x * pow2(half, x.dtype)[..., None] * pow2(n - half, x.dtype)[..., None]


def magnitude_exponent(x: torch.Tensor) -> torch.Tensor:
    """e [...] with max|x| over the last dim in [2^(e-1), 2^e) (frexp's exponent); 0 for zero rows.
    Non-finite entries are ignored."""
    amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=-1)
    return torch.frexp(amax).exponent.to(torch.int32)


def cell_index(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Index of the codebook cell holding each normalized coordinate u (int64).

    Counts the float32 decision boundaries strictly below u, so a tie goes to
    the lower cell and values beyond the ends saturate at 0 and 2**bits - 1.
    """
    bounds = codebook.device_boundaries(bits, u.device)
    return torch.searchsorted(bounds, u.to(torch.float32).contiguous())


def pack_codes(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack indices [..., D] (values < 2**bits) into [..., D*bits/8] uint8.

    Plane of width w: byte j holds, at bit offset k*w, the w bits of coordinate
    j + k*P, where P = D*w/8 is the plane's byte count ("planar" order: a 4-bit
    plane's low nibbles are coordinates 0..D/2-1, high nibbles D/2..D-1).
    """
    d = idx.shape[-1]
    lead = idx.shape[:-1]
    idx = idx.to(torch.int32)
    out, shift = [], 0
    for w in plane_widths(bits):
        per = 8 // w
        part = ((idx >> shift) & ((1 << w) - 1)).reshape(*lead, per, d // per)
        byte = torch.zeros_like(part[..., 0, :])
        for k in range(per):
            byte |= part[..., k, :] << (k * w)
        out.append(byte)
        shift += w
    return torch.cat(out, dim=-1).to(torch.uint8)


def unpack_codes(codes: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of pack_codes: [..., D*bits/8] uint8 -> [..., D] int64."""
    lead = codes.shape[:-1]
    codes = codes.to(torch.int64)
    idx = torch.zeros(*lead, head_dim, dtype=torch.int64, device=codes.device)
    offset, shift = 0, 0
    for w in plane_widths(bits):
        per = 8 // w
        n = head_dim // per
        plane = codes[..., offset:offset + n]
        parts = [(plane >> (k * w)) & ((1 << w) - 1) for k in range(per)]
        idx |= torch.cat(parts, dim=-1) << shift
        offset += n
        shift += w
    return idx


def _check_bits(name: str, bits) -> None:
    # `4.0 in SUPPORTED_BITS` is True, and a float width breaks every size computation.
    if isinstance(bits, bool) or not isinstance(bits, Integral) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits!r}")


def check_coding_options(k_bits, v_bits, scale_rule, scale_dtype=torch.float32) -> None:
    """ValueError unless the bit widths, scale rule and scale dtype are ones the format has (head_dim aside).
    k_bits None: keys coded in groups (check_key_groups checks those)."""
    if k_bits is not None:
        _check_bits("k_bits", k_bits)
    _check_bits("v_bits", v_bits)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if scale_dtype not in SCALE_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in SCALE_DTYPES)
        raise ValueError(f"scale_dtype must be one of {allowed}, got {scale_dtype!r}")


def check_key_groups(key_groups, head_dim: int) -> tuple[tuple[int, int], ...]:
    """key_groups as a tuple of (channels, bits) pairs, or ValueError: two groups (the high-variance channels and
    the rest, as TurboQuant's paper splits them; the kernels take two), each a width the format codes with one
    scale (a multiple of 16 from 32 to NORM_BLOCK) at a supported width, adding up to head_dim."""
    try:
        groups = tuple((channels, bits) for channels, bits in key_groups)
    except (TypeError, ValueError):
        raise ValueError(f"key_groups must be (channels, bits) pairs, got {key_groups!r}") from None
    if len(groups) != 2:
        raise ValueError(f"key_groups takes two groups (one group is k_bits), got {key_groups!r}")
    for channels, bits in groups:
        if (isinstance(channels, bool) or not isinstance(channels, Integral) or channels > NORM_BLOCK
                or channels not in rotation.SUPPORTED_HEAD_DIMS):
            raise ValueError(f"a key group's channels must be a multiple of {rotation.HEAD_DIM_STEP} from "
                             f"{rotation.MIN_HEAD_DIM} to {NORM_BLOCK}, got {channels!r} in {key_groups!r}")
        _check_bits("a key group's bits", bits)
    if sum(channels for channels, _ in groups) != head_dim:
        raise ValueError(f"key_groups {key_groups!r} cover {sum(c for c, _ in groups)} channels, head_dim is "
                         f"{head_dim}")
    return tuple((int(channels), int(bits)) for channels, bits in groups)


def key_groups_name(key_groups) -> str:
    """The groups as the CLI and preset names write them: ((112, 6), (144, 4)) -> "112x6+144x4"."""
    return "+".join(f"{channels}x{bits}" for channels, bits in key_groups)


def parse_key_groups(text: str) -> tuple[tuple[int, int], ...]:
    """key_groups_name's inverse ("112x6+144x4"); ValueError for anything else (head_dim unchecked)."""
    try:
        return tuple((int(c), int(b)) for c, b in (part.split("x") for part in text.split("+")))
    except ValueError:
        raise ValueError(f"key groups are written CHANNELSxBITS+CHANNELSxBITS (e.g. 112x6+144x4), "
                         f"got {text!r}") from None


def check_attention_dtype(name: str, t: torch.Tensor) -> None:
    """TypeError naming the argument unless t's dtype is one the cache and attention take (ATTENTION_DTYPES)."""
    if t.dtype not in ATTENTION_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in ATTENTION_DTYPES)
        raise TypeError(f"{name} dtype must be one of {allowed}, got {str(t.dtype).removeprefix('torch.')}")


@dataclass(frozen=True)
class KVCodec:
    """Frozen description of the compressed K/V format for one head_dim."""

    head_dim: int
    k_bits: int | None = 4                      # None with key_groups
    v_bits: int = 4
    scale_rule: str = "corrected"
    scale_dtype: torch.dtype = torch.float32    # how scales are stored (SCALE_DTYPES)
    # Keys in channel groups (module docstring): ((channels, bits), ...), or () for one width (k_bits).
    key_groups: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        rotation.check_head_dim(self.head_dim)
        if self.key_groups:
            object.__setattr__(self, "key_groups", check_key_groups(self.key_groups, self.head_dim))
            if self.k_bits is not None:
                raise ValueError(f"key_groups set the keys' widths: pass k_bits=None, got k_bits={self.k_bits!r}")
        elif self.k_bits is None:
            raise ValueError("k_bits=None needs key_groups (the keys' widths)")
        check_coding_options(self.k_bits, self.v_bits, self.scale_rule, self.scale_dtype)

    @property
    def grouped_keys(self) -> bool:
        """Whether keys are coded in channel groups (which kernels read them: ops/backend.py)."""
        return bool(self.key_groups)

    @property
    def key_code(self) -> int | tuple[tuple[int, int], ...]:
        """The keys' code as the decode plans and kernel builds tell them apart: k_bits, or the key groups."""
        return self.key_groups if self.key_groups else self.k_bits

    @cached_property
    def key_group_codecs(self) -> tuple[KVCodec, ...]:
        """One codec per key group (its width, its bits for K and V, this codec's scale rule and dtype): a group
        is coded exactly as a key of that head_dim."""
        return tuple(KVCodec(channels, bits, bits, self.scale_rule, self.scale_dtype)
                     for channels, bits in self.key_groups)

    @property
    def name(self) -> str:
        """"k4v3", or with key groups "k112x6+144x4v3"."""
        keys = key_groups_name(self.key_groups) if self.key_groups else str(self.k_bits)
        return f"k{keys}v{self.v_bits}"

    # -- format geometry -------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """ceil(D / 256) equal norm blocks: min(D, 256) coordinates each for a power of two, and D / 2
        (a multiple of 8) for the other head dims above 256."""
        return -(-self.head_dim // NORM_BLOCK)

    @property
    def block_size(self) -> int:
        return self.head_dim // self.num_blocks

    def bits(self, kind: Kind) -> int:
        if kind == "k":
            if self.key_groups:
                raise ValueError(f"keys coded in groups ({key_groups_name(self.key_groups)}) have no single width")
            return self.k_bits
        if kind == "v":
            return self.v_bits
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")

    def code_bytes(self, kind: Kind) -> int:
        """Packed code bytes per vector."""
        if kind == "k" and self.key_groups:
            return sum(channels * bits // 8 for channels, bits in self.key_groups)
        return self.head_dim * self.bits(kind) // 8

    def scale_count(self, kind: Kind) -> int:
        """Scales per vector: one per norm block, or one per key group."""
        if kind == "k" and self.key_groups:
            return len(self.key_groups)
        self.bits(kind)  # validates kind
        return self.num_blocks

    def bytes_per_token(self) -> int:
        """K+V bytes (codes and scales) for one token of one KV head."""
        scale_bytes = self.scale_dtype.itemsize * (self.scale_count("k") + self.scale_count("v"))
        return self.code_bytes("k") + self.code_bytes("v") + scale_bytes

    def bits_per_element(self) -> float:
        """Average stored bits per K/V element, scales included."""
        return 8 * self.bytes_per_token() / (2 * self.head_dim)

    def kernel_spec(self, kind: Kind) -> CodeSpec:
        """The packed-row facts the kernels take for K or V (bits, planes, row bytes, vector width)."""
        return code_spec(self.head_dim, self.bits(kind))

    @cached_property   # once per codec (frozen): every layer of every decode step reads it
    def scale_rule_id(self) -> int:
        """The scale rule as the quantize kernel's constant (its index in SCALE_RULES)."""
        return SCALE_RULES.index(self.scale_rule)

    def centroids(self, kind: Kind, device=None, dtype=torch.float32) -> torch.Tensor:
        return codebook.centroids(self.bits(kind), dtype).to(device)  # a copy the caller may write

    # -- rotated-domain coding (what the kernels compute on) --------------
    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
            raise TypeError(f"x dtype must be one of {allowed}, got {str(x.dtype).removeprefix('torch.')}")
        if x.dim() < 1 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x: last dim must be head_dim={self.head_dim}, got shape {tuple(x.shape)}")

    def quantize_rotated(self, y: torch.Tensor, kind: Kind) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated vectors y [..., D] -> (indices [..., D] int64, scales [..., nb] float32)."""
        bits = self.bits(kind)
        lead = y.shape[:-1]
        yb = y.to(torch.float32).reshape(*lead, self.num_blocks, self.block_size)
        rms = yb.pow(2).mean(dim=-1, keepdim=True).sqrt()
        safe = torch.where(rms > 0, rms, torch.ones_like(rms))
        idx = cell_index(yb / safe, bits)
        scale = rms
        if self.scale_rule != "rms":
            c = codebook.device_centroids(bits, y.device)[idx]
            if self.scale_rule == "corrected":
                scale = yb.norm(dim=-1, keepdim=True) / c.norm(dim=-1, keepdim=True)
            else:  # least squares: argmin_s ||y_b - s c||
                scale = (yb * c).sum(dim=-1, keepdim=True) / c.pow(2).sum(dim=-1, keepdim=True)
            scale = torch.where(rms > 0, scale, torch.zeros_like(scale))
        return idx.reshape(*lead, self.head_dim), scale.reshape(*lead, self.num_blocks)

    def dequantize_rotated(self, idx: torch.Tensor, scales: torch.Tensor, kind: Kind,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(indices, scales) -> rotated-domain vectors ŷ = c[idx] * scale."""
        lead = idx.shape[:-1]
        c = codebook.device_centroids(self.bits(kind), idx.device, dtype)[idx]
        c = c.reshape(*lead, self.num_blocks, self.block_size) * scales.to(dtype)[..., None]
        return c.reshape(*lead, self.head_dim)

    # -- public coding ----------------------------------------------------
    def quantize(self, x: torch.Tensor, kind: Kind = "k") -> Packed:
        """x [..., D] float -> Packed(codes [..., D*bits/8] uint8, scales [..., nb] in scale_dtype).

        Any finite x is coded at its own scale (see times_pow2).  A vector holding a NaN or an
        infinity is stored as codes 0 and NaN scales, so it decodes to NaN: never to a finite value.
        """
        self._check_input(x)
        if kind == "k" and self.key_groups:
            return self._quantize_key_groups(x)
        self.bits(kind)  # validates kind before any work
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        # Contiguous: a reduction over a strided view may add in another order, and a transposed or sliced
        # input must code exactly like its contiguous copy.
        x = x.to(work).contiguous()
        finite = torch.isfinite(x).all(dim=-1)
        e = magnitude_exponent(x)
        x = times_pow2(torch.where(finite[..., None], x, torch.zeros_like(x)), -e)
        idx, scales = self.quantize_rotated(rotation.rotate(x), kind)
        idx = torch.where(finite[..., None], idx, torch.zeros_like(idx))
        scales = torch.where(finite[..., None], times_pow2(scales, e), torch.full_like(scales, float("nan")))
        if self.scale_dtype != torch.float32:
            scales = scales.to(self.scale_dtype)   # rounded to nearest, as the kernels store them
        return Packed(pack_codes(idx, self.bits(kind)), scales)

    def _quantize_key_groups(self, x: torch.Tensor) -> Packed:
        """Keys in channel groups: each group coded as a key of its own width, codes and scales side by side.  A
        key holding a NaN or an infinity anywhere is stored as codes 0 and NaN scales in every group."""
        finite = torch.isfinite(x).all(dim=-1, keepdim=True)
        codes, scales = [], []
        for group, (lo, hi) in zip(self.key_group_codecs, self._key_group_bounds()):
            packed = group.quantize(x[..., lo:hi], "k")
            codes.append(packed.codes)
            scales.append(packed.scales)
        codes, scales = torch.cat(codes, dim=-1), torch.cat(scales, dim=-1)
        return Packed(torch.where(finite, codes, torch.zeros_like(codes)),
                      torch.where(finite, scales, torch.full_like(scales, float("nan"))))

    def _key_group_bounds(self) -> list[tuple[int, int]]:
        """Each key group's channels [lo, hi) of the stored key."""
        bounds, lo = [], 0
        for channels, _ in self.key_groups:
            bounds.append((lo, lo + channels))
            lo += channels
        return bounds

    def _key_group_packed(self, packed: Packed):
        """(group codec, its Packed) for each key group of a grouped key's Packed."""
        code_lo, scale = 0, 0
        for group in self.key_group_codecs:
            code_hi = code_lo + group.code_bytes("k")
            yield group, Packed(packed.codes[..., code_lo:code_hi], packed.scales[..., scale:scale + 1])
            code_lo, scale = code_hi, scale + 1

    def unpack(self, packed: Packed, kind: Kind) -> torch.Tensor:
        """Packed -> indices [..., D] int64, validating the packed shapes (key groups: each group's own widths,
        side by side)."""
        self.check_packed(packed, kind)
        if kind == "k" and self.key_groups:
            return torch.cat([group.unpack(part, "k") for group, part in self._key_group_packed(packed)], dim=-1)
        return unpack_codes(packed.codes, self.bits(kind), self.head_dim)

    def check_packed(self, packed: Packed, kind: Kind) -> None:
        if not isinstance(packed, Packed):
            raise TypeError(f"packed must be a turboattn.Packed (what quantize returns), got {type(packed).__name__}")
        want = self.code_bytes(kind)
        if packed.codes.dtype != torch.uint8 or packed.codes.shape[-1] != want:
            width = key_groups_name(self.key_groups) if kind == "k" and self.key_groups else self.bits(kind)
            raise ValueError(f"codes must be uint8 [..., {want}] for {kind}_bits={width}, "
                             f"got {packed.codes.dtype} {tuple(packed.codes.shape)}")
        scales = (*packed.codes.shape[:-1], self.scale_count(kind))
        if packed.scales.shape != scales:
            raise ValueError(f"scales must have shape {scales}, got {tuple(packed.scales.shape)}")

    def dequantize(self, packed: Packed, kind: Kind = "k", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed -> x̂ [..., D] in the original (unrotated) domain (NaN rows for NaN scales).

        Decoded at the scales' own magnitude, like quantize codes (times_pow2): scales near the
        float32 limits neither overflow nor lose bits in the inverse rotation.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.check_packed(packed, kind)
        if kind == "k" and self.key_groups:
            return torch.cat([group.dequantize(part, "k", dtype) for group, part in self._key_group_packed(packed)],
                             dim=-1)
        work = torch.float64 if dtype == torch.float64 else torch.float32
        scales = packed.scales.to(work)
        e = magnitude_exponent(scales)
        y = self.dequantize_rotated(self.unpack(packed, kind), times_pow2(scales, -e), kind, work)
        return times_pow2(rotation.unrotate(y), e).to(dtype)
