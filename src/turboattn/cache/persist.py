"""A QuantizedKVCache as a safetensors file (no pickle): save a prompt's cache, load it back bit for bit.

File contents.  Tensors: `k_codes`, `k_scales`, `v_codes`, `v_scales` [B, Hkv, held, ...], where
held = min(longest sequence, capacity) is the number of slots in use (the slots after it are zeros
in any cache, so they are not written); `seen`, `starts`, `nonfinite` [B] int32; and, when the
cache has a key transform, `key_shift`, `key_gain`, `key_gain_inv` [B, Hkv, D] float32.  Header
metadata (strings): `kind`, `file_version` (this layout), `format_version` (codec.FORMAT_VERSION:
what codes and scales mean), `head_dim`, `k_bits`, `v_bits`, `scale_rule`, `batch_size`,
`num_kv_heads`, `capacity`, `sliding_window` ("none" or an int), `static` ("True" / "False").

A cache with an exact recent window (exact_recent = R > 0) adds `recent_k`, `recent_v`
[B, Hkv, R + 1, D] in its exact dtype and the metadata `exact_recent`, `exact_dtype`; such a file has
file_version 2, so that a reader without the window refuses it rather than silently dropping it.  A
cache without one is written exactly as before (file_version 1), and files of either version load.
Scales in bfloat16 (KVCodec(scale_dtype=torch.bfloat16)) are stored as such, with the metadata
`scale_dtype`; a reader that knows only float32 scales refuses them by dtype.
A cache with exact first tokens (exact_first = S > 0) adds `first_k`, `first_v` [B, Hkv, S, D] in the
exact dtype and the metadata `exact_first`, `exact_dtype`; such a file has file_version 3 (a reader
that knows only the window refuses it); files of versions 1, 2 and 3 load.
A cache with keys in channel groups (KVCodec(key_groups=...)) has the metadata `key_groups` ("112x6+144x4")
and `k_bits` "none", adds `key_order` [B, Hkv, D] int16 to its key transform, and has file_version 4.

Loading checks the kind and both versions, then every tensor's dtype and shape against the header,
and raises ValueError naming what differs.  `cache_state` / `cache_from_state` take a key prefix, so
that a file can hold several caches (integrations/hf_persist.py: one per model layer).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..format.codec import FORMAT_VERSION, SCALE_DTYPES, KVCodec, key_groups_name, parse_key_groups
from .dynamic import QuantizedKVCache

KIND = "turboattn.QuantizedKVCache"
FILE_VERSION = 2          # the version a cache with an exact recent window is written with
FIRST_FILE_VERSION = 3    # the version a cache with exact first tokens is written with (a window or not)
GROUPS_FILE_VERSION = 4  # the version a cache with keys in channel groups is written with
FILE_VERSIONS = (1, 2, 3, 4)  # what loads: 1 is a file without exact buffers (what caches without them still write)
_EXACT_DTYPES = {str(t): t for t in (torch.float16, torch.bfloat16, torch.float32)}
_SCALE_DTYPES = {str(t): t for t in SCALE_DTYPES}
_SLOTS = ("k_codes", "k_scales", "v_codes", "v_scales")
_PER_SEQUENCE = ("seen", "starts", "nonfinite")
_KEY_TRANSFORM = ("key_shift", "key_gain", "key_gain_inv")


def cache_state(cache: QuantizedKVCache, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header metadata) describing `cache` completely, every key starting with `prefix`."""
    if not isinstance(cache, QuantizedKVCache):
        raise TypeError(f"cache must be a turboattn.QuantizedKVCache, got {type(cache).__name__}")
    held = min(cache.max_seen, cache.capacity)
    tensors = {name: getattr(cache, name)[:, :, :held] for name in _SLOTS}
    tensors.update({name: getattr(cache, name) for name in _PER_SEQUENCE})
    if cache.key_gain is not None:
        tensors.update({name: getattr(cache, name) for name in _KEY_TRANSFORM})
    if cache.key_order is not None:
        tensors.update(key_order=cache.key_order)
    if cache.exact_recent:
        tensors.update(recent_k=cache.recent_k, recent_v=cache.recent_v)
    if cache.exact_first:
        tensors.update(first_k=cache.first_k, first_v=cache.first_v)
    codec = cache.codec
    version = FIRST_FILE_VERSION if cache.exact_first else FILE_VERSION if cache.exact_recent else 1
    if codec.grouped_keys:
        version = GROUPS_FILE_VERSION
    meta = {"kind": KIND, "file_version": version, "format_version": FORMAT_VERSION,
            "head_dim": codec.head_dim, "k_bits": "none" if codec.k_bits is None else codec.k_bits,
            "v_bits": codec.v_bits,
            "scale_rule": codec.scale_rule, "batch_size": cache.batch_size, "num_kv_heads": cache.num_kv_heads,
            "capacity": cache.capacity, "sliding_window": "none" if cache.sliding_window is None
            else cache.sliding_window, "static": cache.is_static}
    if cache.exact_recent:
        meta.update(exact_recent=cache.exact_recent, exact_dtype=str(cache.exact_dtype))
    if codec.scale_dtype != torch.float32:   # float32 files stay as before; older readers refuse these by dtype
        meta.update(scale_dtype=str(codec.scale_dtype))
    if cache.exact_first:
        meta.update(exact_first=cache.exact_first, exact_dtype=str(cache.exact_dtype))
    if codec.grouped_keys:
        meta.update(key_groups=key_groups_name(codec.key_groups))
    # safetensors wants contiguous tensors that share no storage; the file is written from the host.
    return ({prefix + k: t.detach().contiguous().cpu() for k, t in tensors.items()},
            {prefix + k: str(v) for k, v in meta.items()})


def cache_from_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], prefix: str = "",
                     device=None, source: str = "cache file") -> QuantizedKVCache:
    """Rebuild the cache that cache_state described (on `device`, default: where the tensors are).

    `source` names the file in error messages."""
    def header(name: str) -> str:
        if prefix + name not in meta:
            raise ValueError(f"{source}: metadata {prefix + name!r} is missing: not a turboattn cache file")
        return meta[prefix + name]

    def integer(name: str) -> int:
        value = header(name)
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{source}: metadata {prefix + name!r} must be an int, got {value!r}") from None

    if header("kind") != KIND:
        raise ValueError(f"{source}: holds a {header('kind')!r}, not a {KIND}")
    for name, accepted in (("file_version", FILE_VERSIONS), ("format_version", (FORMAT_VERSION,))):
        if integer(name) not in accepted:
            raise ValueError(f"{source}: {name} {integer(name)} differs from this turboattn's {accepted[-1]}; "
                             "the file was written by another version and cannot be read")
    scale_dtype = meta.get(prefix + "scale_dtype", "torch.float32")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"{source}: metadata {prefix + 'scale_dtype'!r} must be one of {sorted(_SCALE_DTYPES)}, "
                         f"got {scale_dtype!r}")
    try:
        key_groups = meta.get(prefix + "key_groups")   # files before version 4 have none
        if key_groups is None:
            codec = KVCodec(integer("head_dim"), integer("k_bits"), integer("v_bits"), header("scale_rule"),
                            _SCALE_DTYPES[scale_dtype])
        else:
            if header("k_bits") != "none":
                raise ValueError(f"metadata {prefix + 'k_bits'!r} must be 'none' with key_groups, "
                                 f"got {header('k_bits')!r}")
            codec = KVCodec(integer("head_dim"), None, integer("v_bits"), header("scale_rule"),
                            _SCALE_DTYPES[scale_dtype], parse_key_groups(key_groups))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    window = None if header("sliding_window") == "none" else integer("sliding_window")
    b, hkv, capacity = integer("batch_size"), integer("num_kv_heads"), integer("capacity")
    if header("static") not in ("True", "False"):
        raise ValueError(f"{source}: metadata {prefix + 'static'!r} must be True or False, got {header('static')!r}")
    static = header("static") == "True"
    exact_recent, exact_first, exact_dtype = 0, 0, torch.bfloat16
    if prefix + "exact_recent" in meta:   # files without it (version 1) have no window
        exact_recent = integer("exact_recent")
    if prefix + "exact_first" in meta:    # files without it (versions 1, 2) have no exact first tokens
        exact_first = integer("exact_first")
    if exact_recent or exact_first:
        if header("exact_dtype") not in _EXACT_DTYPES:
            raise ValueError(f"{source}: metadata {prefix + 'exact_dtype'!r} must be one of {list(_EXACT_DTYPES)}, "
                             f"got {header('exact_dtype')!r}")
        exact_dtype = _EXACT_DTYPES[header("exact_dtype")]

    def tensor(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if prefix + name not in tensors:
            raise ValueError(f"{source}: tensor {prefix + name!r} is missing")
        t = tensors[prefix + name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{source}: tensor {prefix + name!r} must be {dtype} {list(shape)} for the cache "
                             f"its metadata describes, got {t.dtype} {list(t.shape)}")
        return t

    seen = tensor("seen", torch.int32, (b,))
    held = min(int(seen.max()), capacity)
    if int(seen.min()) < 0 or (window is None and held < int(seen.max())):
        raise ValueError(f"{source}: lengths {seen.tolist()} do not fit capacity={capacity}")
    device = torch.device(device) if device is not None else seen.device
    try:
        cache = QuantizedKVCache(codec, b, hkv, capacity=None if window else capacity, sliding_window=window,
                                 device=device, static=static, exact_recent=exact_recent, exact_dtype=exact_dtype,
                                 exact_first=exact_first)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if cache.capacity != capacity:
        raise ValueError(f"{source}: capacity {capacity} differs from sliding_window={window}")
    for name, dtype, last in (("k_codes", torch.uint8, codec.code_bytes("k")),
                              ("k_scales", codec.scale_dtype, codec.scale_count("k")),
                              ("v_codes", torch.uint8, codec.code_bytes("v")),
                              ("v_scales", codec.scale_dtype, codec.scale_count("v"))):
        getattr(cache, name)[:, :, :held] = tensor(name, dtype, (b, hkv, held, last)).to(device)
    present = [prefix + name in tensors for name in _KEY_TRANSFORM]
    if any(present) and not all(present):
        raise ValueError(f"{source}: a key transform needs all of {[prefix + n for n in _KEY_TRANSFORM]}")
    if all(present):  # set while the cache is still empty; 1 / gain as saved: bit for bit
        shift, gain, gain_inv = (tensor(n, torch.float32, (b, hkv, codec.head_dim)).to(device)
                                 for n in _KEY_TRANSFORM)
        order = None
        if prefix + "key_order" in tensors:
            order = tensor("key_order", torch.int16, (b, hkv, codec.head_dim)).to(device)
        try:
            cache.set_key_transform(shift, gain, order)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        cache.key_gain_inv.copy_(gain_inv)
    for name in ("recent_k", "recent_v") if exact_recent else ():
        getattr(cache, name).copy_(tensor(name, exact_dtype, (b, hkv, exact_recent + 1, codec.head_dim)))
    for name in ("first_k", "first_v") if exact_first else ():
        getattr(cache, name).copy_(tensor(name, exact_dtype, (b, hkv, exact_first, codec.head_dim)))
    for name in _PER_SEQUENCE:
        getattr(cache, name).copy_(tensor(name, torch.int32, (b,)))
    cache._starts_bound = int(cache.starts.max())   # the host bound on starts that appends rely on (dynamic.py)
    cache._empty = int(seen.max()) == 0
    if not static:
        cache._seen_host = seen.tolist()
    return cache


def save_cache(cache: QuantizedKVCache, path: str | os.PathLike) -> None:
    """Write `cache` to a safetensors file at `path` (the format is in this module's docstring)."""
    tensors, meta = cache_state(cache)
    save_file(tensors, os.fspath(path), metadata=meta)


def read_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors on the CPU, header metadata) of a safetensors file."""
    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def load_cache(path: str | os.PathLike, device=None) -> QuantizedKVCache:
    """The cache save_cache wrote to `path`, on `device` (default: the CPU)."""
    tensors, meta = read_file(path)
    return cache_from_state(tensors, meta, device=device, source=os.fspath(path))
