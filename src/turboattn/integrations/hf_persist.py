"""A TurboQuantCache as one safetensors file (no pickle): each layer's QuantizedKVCache and the options.

    from turboattn.hf import save_turboquant_cache, load_turboquant_cache
    save_turboquant_cache(cache, "prompt.safetensors")            # after a prefill
    cache = load_turboquant_cache("prompt.safetensors", model.config, device="cuda")

Layer i's cache is stored under the key prefix "layers.<i>." in cache/persist.py's format; the
header adds `kind`, `file_version`, `num_layers`, the constructor's options (k_bits, v_bits,
scale_rule, fit_keys, quantize_current, max_cache_len, exact_recent and exact_first: "0" when absent, scale_dtype:
float32 when absent, exact_recent_sliding: "0" when False, absent when True, key_groups: "112x6+144x4", absent
without them, k_bits then "None") and, per layer, its sliding window, the
dtype of the K/V it was given, or "empty" for a layer that holds nothing yet.  Loading rebuilds
the cache from the model config (as the constructor does) and checks that its layers match the file.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from ..cache.persist import cache_from_state, cache_state, read_file
from ..format.codec import SCALE_DTYPES, key_groups_name, parse_key_groups
from .hf import TurboQuantCache

KIND = "turboattn.TurboQuantCache"
FILE_VERSION = 1
_DTYPES = {str(t): t for t in (torch.float16, torch.bfloat16, torch.float32)}


def _scale_dtype(name: str, source: str) -> torch.dtype:
    if name not in _DTYPES or _DTYPES[name] not in SCALE_DTYPES:
        raise ValueError(f"{source}: scale_dtype {name!r} is not one of {[str(t) for t in SCALE_DTYPES]}")
    return _DTYPES[name]


def save_turboquant_cache(cache: TurboQuantCache, path: str | os.PathLike) -> None:
    """Write every layer of `cache` to a safetensors file at `path`."""
    if not isinstance(cache, TurboQuantCache):
        raise TypeError(f"cache must be a turboattn.hf.TurboQuantCache, got {type(cache).__name__}")
    first = cache.layers[0]
    meta = {"kind": KIND, "file_version": str(FILE_VERSION), "num_layers": str(len(cache.layers)),
            "k_bits": str(cache.k_bits), "v_bits": str(cache.v_bits), "scale_rule": cache.scale_rule,
            "fit_keys": first.fit_keys, "quantize_current": str(int(first.quantize_current)),
            "max_cache_len": str(first.max_cache_len or "none")}
    if cache.exact_recent:
        meta["exact_recent"] = str(cache.exact_recent)
    if cache.scale_dtype != torch.float32:
        meta["scale_dtype"] = str(cache.scale_dtype)
    if not cache.exact_recent_sliding:
        meta["exact_recent_sliding"] = "0"
    if cache.exact_first:   # the layers' files then have file_version 3: older readers refuse them
        meta["exact_first"] = str(cache.exact_first)
    if cache.key_groups:    # the layers' files then have file_version 4: older readers refuse them
        meta["key_groups"] = key_groups_name(cache.key_groups)
    tensors = {}
    for i, layer in enumerate(cache.layers):
        prefix = f"layers.{i}."
        meta[prefix + "layer_window"] = str(layer.sliding_window or "none")
        if layer.cache is None:
            meta[prefix + "layer_dtype"] = "empty"
            continue
        meta[prefix + "layer_dtype"] = str(layer.dtype)
        layer_tensors, layer_meta = cache_state(layer.cache, prefix)
        tensors.update(layer_tensors)
        meta.update(layer_meta)
    save_file(tensors, os.fspath(path), metadata=meta)


def load_turboquant_cache(path: str | os.PathLike, config, device=None) -> TurboQuantCache:
    """The TurboQuantCache save_turboquant_cache wrote to `path`, for the model `config` (the one the
    constructor takes), on `device` (default: the CPU).  ValueError when the file does not match."""
    source = os.fspath(path)
    tensors, meta = read_file(path)
    if meta.get("kind") != KIND:
        raise ValueError(f"{source}: holds a {meta.get('kind')!r}, not a {KIND}")
    if meta.get("file_version") != str(FILE_VERSION):
        raise ValueError(f"{source}: file_version {meta.get('file_version')} differs from this turboattn's "
                         f"{FILE_VERSION}; the file was written by another version and cannot be read")
    max_len = meta["max_cache_len"]
    key_groups = meta.get("key_groups")
    try:
        key_groups = None if key_groups is None else parse_key_groups(key_groups)
        k_bits = None if key_groups is not None else int(meta["k_bits"])
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    cache = TurboQuantCache(config, k_bits, int(meta["v_bits"]), meta["scale_rule"], key_groups=key_groups,
                            quantize_current=meta["quantize_current"] == "1",
                            max_cache_len=None if max_len == "none" else int(max_len), fit_keys=meta["fit_keys"],
                            exact_recent=int(meta.get("exact_recent", "0")),
                            exact_first=int(meta.get("exact_first", "0")),
                            scale_dtype=_scale_dtype(meta.get("scale_dtype", "torch.float32"), source),
                            exact_recent_sliding=meta.get("exact_recent_sliding", "1") != "0")
    if len(cache.layers) != int(meta["num_layers"]):
        raise ValueError(f"{source}: holds {meta['num_layers']} layers, the model config has {len(cache.layers)}")
    for i, layer in enumerate(cache.layers):
        prefix = f"layers.{i}."
        window = str(layer.sliding_window or "none")
        if meta[prefix + "layer_window"] != window:
            raise ValueError(f"{source}: layer {i} was saved with sliding_window={meta[prefix + 'layer_window']}, "
                             f"the model config gives {window}")
        dtype = meta[prefix + "layer_dtype"]
        if dtype == "empty":
            continue
        if dtype not in _DTYPES:
            raise ValueError(f"{source}: layer {i} has dtype {dtype!r}, expected one of {list(_DTYPES)}")
        layer.cache = cache_from_state(tensors, meta, prefix, device=device or "cpu", source=source)
        # What lazy_initialization would have set on the first update.
        layer.dtype, layer.device, layer.is_initialized = _DTYPES[dtype], layer.cache.device, True
    return cache
