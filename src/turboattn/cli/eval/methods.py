"""What `turboattn eval` compares: presets, and the cache configurations (methods) built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...format.codec import KVCodec, parse_key_groups

MAIN_PRESETS = ("k8v8", "k6v6", "k5v5", "k4v4", "k4v3", "k3v3", "k2v2")
# Mixed candidates at <= 4.25 bits/element, counting the float32 scales (per head_dim).
MIXED_CANDIDATES = {64: ("k5v2", "k4v3", "k3v4"), 128: ("k5v3", "k4v3"), 256: ("k4v4", "k5v3", "k3v5")}
RULES = ("rms", "corrected", "lsq")
PEERS = ("quanto-int4", "quanto-int2", "hqq-4", "hqq-2", "turboquant-4", "turboquant-2")
FIT_SUFFIX = {"balance": "", "center": "-center", "off": "-nofit"}   # method names, stable across defaults


def parse_preset(name: str) -> tuple[int | tuple[tuple[int, int], ...], int]:
    """"k4v3" -> (4, 3); keys in channel groups, "k112x6+144x4v3" -> (((112, 6), (144, 4)), 3)."""
    try:
        k, v = name.lower().removeprefix("k").split("v")
        return (parse_key_groups(k) if "x" in k else int(k)), int(v)
    except ValueError:
        raise ValueError(f"preset must look like k4v4 (or, keys in channel groups, k112x6+144x4v3), "
                         f"got {name!r}") from None


def key_options(kb) -> dict:
    """parse_preset's key part as KVCodec / TurboQuantCache keywords."""
    return dict(k_bits=None, key_groups=kb) if isinstance(kb, tuple) else dict(k_bits=kb)


SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}   # --scale-dtype names


def bits_per_element(preset: str, head_dim: int, scale_dtype: str = "float32") -> float:
    kb, vb = parse_preset(preset)
    return KVCodec(head_dim, v_bits=vb, scale_dtype=SCALE_DTYPES[scale_dtype], **key_options(kb)).bits_per_element()


@dataclass
class Method:
    """One cache configuration: a name, how to build its cache, and how to feed it."""

    name: str
    family: str                 # "bf16" | "turboattn" | peer package
    make_cache: object          # callable(model) -> transformers Cache
    step: int = 1               # tokens per decode call (chunks only where exact)
    info: dict = field(default_factory=dict)


def reference_method() -> Method:
    from transformers import DynamicCache
    return Method("reference", "reference", lambda m: DynamicCache(config=m.config), step=256)


def method_name(preset: str, rule: str, mode: str, fit_keys: str, exact_recent: int = 0, exact_first: int = 0,
                scale_dtype: str = "float32", recent_sliding: bool = True) -> str:
    """A turboattn method's name: preset-rule-mode, the key fit's suffix, -s{S} with exact first tokens and -r{R}
    with an exact window (both: -s{S}-r{R}; -r{R}full when sliding layers keep none), -bf16scales with bfloat16
    scales."""
    window = f"-r{exact_recent}" + ("" if recent_sliding else "full") if exact_recent else ""
    return (f"{preset}-{rule}-{mode}" + FIT_SUFFIX[fit_keys] + (f"-s{exact_first}" if exact_first else "")
            + window + ("-bf16scales" if scale_dtype == "bfloat16" else ""))


def turbo_method(preset: str, rule: str, mode: str, chunk: int = 256, exact_decode: bool = False,
                 fit_keys: str | None = None, exact_recent: int = 0, exact_first: int = 0,
                 scale_dtype: str = "float32", recent_sliding: bool = True) -> Method:
    """Our cache.  Strict mode is exact in chunks; decode mode is either stepped token by token
    (exact_decode) or emulated in chunks by DecodeEmulationLayer (tests prove the two agree).
    fit_keys picks the key transform (None: the library default); the name carries FIT_SUFFIX[fit_keys].
    exact_recent=R > 0 keeps the R newest tokens exact (TurboQuantCache(exact_recent=R)); the name ends in -r{R}.
    exact_first=S > 0 keeps the first S tokens exact (TurboQuantCache(exact_first=S)); the name carries -s{S}.
    Their reads do not depend on chunk boundaries, so strict mode with first tokens alone stays chunked.
    scale_dtype "bfloat16" stores the scales in bfloat16 (TurboQuantCache(scale_dtype=)); the name ends in -bf16scales.
    recent_sliding=False keeps the window on full-attention layers only (TurboQuantCache(exact_recent_sliding=)).
    Strict mode with a window is stepped token by token: in a chunk every query would read the window of the
    chunk's last token (one boundary per call), which one-token steps do not."""
    from ...hf import KEY_FIT_DEFAULT, TurboQuantCache
    fit_keys = fit_keys or KEY_FIT_DEFAULT
    kb, vb = parse_preset(preset)
    strict = mode == "strict"

    def make(model):
        cache = TurboQuantCache(model.config, v_bits=vb, scale_rule=rule, quantize_current=strict, fit_keys=fit_keys,
                                exact_recent=exact_recent, exact_first=exact_first,
                                scale_dtype=SCALE_DTYPES[scale_dtype], exact_recent_sliding=recent_sliding,
                                **key_options(kb))
        if not strict and not exact_decode:
            from ...integrations.decode_emulation import DecodeEmulationLayer
            cache.layers = [DecodeEmulationLayer.from_layer(layer) for layer in cache.layers]
        return cache
    name = method_name(preset, rule, mode, fit_keys, exact_recent, exact_first, scale_dtype, recent_sliding)
    stepped = exact_decode or (strict and exact_recent > 0)
    return Method(name, "turboattn", make, step=1 if stepped else chunk,
                  info=dict(preset=preset, rule=rule, mode=mode, fit_keys=fit_keys, exact_recent=exact_recent,
                            exact_first=exact_first, scale_dtype=scale_dtype, recent_sliding=recent_sliding))
