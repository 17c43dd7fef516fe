"""Hugging Face transformers integration: a compressed KV cache and its attention function.

    from turboattn.hf import TurboQuantCache, register
    register()   # done by importing turboattn.hf; idempotent
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="turboattn")
    model.generate(ids, past_key_values=TurboQuantCache(model.config))   # the default preset (DEFAULT_PRESETS)

How the pieces meet.  A transformers attention module calls
`past_key_values.update(k, v, layer_idx)` and then the registered attention
function with whatever update returned.  A quantized cache cannot hand back
full K/V without dequantizing all of it, so `TurboQuantLayer.update` returns
the fresh k, v untouched and hands itself to the attention function through a
per-thread slot (`_handoff`; update and attention run back to back in every
attention module, and a thread-local keeps two threads running models apart;
torch.compile traces it, so a compiled step has no graph break there); the
attention function (`turboattn_attention`) takes the layer from the slot and
lets it attend:

- first chunk of a sequence (prefill): `flash_attention` on the fresh K/V;
  then, unless `fit_keys="off"`, the key transform is fitted to the chunk's
  queries and keys (key_transform.py: centering, and channel balance with
  "balance"; invisible to attention; QUALITY.md measures what it buys), and
  the chunk is quantized into the cache;
- later steps: `cached_attention` on the compressed cache.  By default the
  step's own new K/V take part in full precision (`cached_attention(q, cache,
  k=new, v=new)`, then `append`), which is what a decode step holds anyway;
  `quantize_current=True` appends first so that every token, the current one
  included, is seen only through its quantized form.

The cache is never dequantized into a full-precision copy on this path (the
PyTorch reference used on CPU dequantizes internally; the Triton kernels do not).

Masks: the "turboattn" mask function hands the 2-D padding mask through, and
the layer turns it into per-sequence left padding (`set_left_padding`).  Only
left padding is supported, as produced by tokenizers with padding_side="left".

Static mode (`max_cache_len=N`), for torch.compile and CUDA graphs: every full
layer holds a `QuantizedKVCache(static=True)` of N slots, allocated once
(sliding layers keep their rings); lengths live on the device,
`get_seq_length` returns a device tensor and `get_mask_sizes` a fixed width,
so a decode step reads nothing on the host and compiles once
(`is_compileable`: transformers' `generate(compile_config=...)` compiles it).
Prefill runs eagerly, as in transformers' own static caches.

Exact recent window (`exact_recent=R`): every layer's QuantizedKVCache also
keeps its R newest tokens in the model's dtype (the config's; when it names
none, the dtype of the K/V the layer is first given; bfloat16 for any other
dtype) and attention reads them exactly (cache/dynamic.py).  A sliding
layer's window W bounds what it can see: its R is clamped to W - 1 (every past
token its window shows is then exact).

Exact first tokens (`exact_first=S`): every full-attention layer's cache
also keeps the first S real tokens of each sequence (after its left padding;
the attention sink) in the same dtype and reads them exactly; sliding layers
get none (S = 0: their rings lose the first tokens).  With both options, a
position among the first S and in the window is read once (the first rows win).
"""

from __future__ import annotations

import threading

import torch

from ..attention import cached_attention, flash_attention
from ..cache import QuantizedKVCache
from ..format.codec import KVCodec, check_coding_options, check_key_groups
from ..format.key_transform import KEY_FITS, MIN_FIT_TOKENS, fit_key_order, fit_key_transform, to_stored_keys

ATTN_NAME = "turboattn"
KEY_FIT_DEFAULT = "center"   # QUALITY.md: "balance" costs long-context retrieval

# TurboQuantCache's default preset, by the largest head_dim a row serves: the best cache measured at <= 4.25 bits
# per element, everything counted, on SmolLM2-135M (head_dim 64) and Gemma-3-270M (256) with the bf16 model on an
# H100 (QUALITY.md, "Choosing the default"): SmolLM2 +0.17% perplexity at 8K-token prompts (3.89 bits), Gemma-3
# +0.17% at 8K (4.12 bits) and +0.30% at 2K (4.22 bits).  Key bits matter more than value bits on both; at
# head_dim 256 the scales cost a quarter as much, which buys more key bits, spent where the keys' variance is
# (key_groups: the 112 highest-variance channels at 6 bits, the other 144 at 4), and the window stays short
# because a sliding layer's ring holds 512 tokens (Gemma-3), where each exact token costs 16 / 512 bits per
# element.  Other head dims above 128 keep k5v3 (+0.77% at 2K on Gemma-3): the CUDA kernels read key groups at
# head_dim 256 only (ops/cached/config.py CUDA_KEY_GROUPS).  head_dim 128 takes the first row: no model of that
# size was measured (k5v3 would be 4.26 bits with the exact rows at 8K).
_LONG_HEAD_EXTRAS = dict(v_bits=3, exact_first=4, exact_recent=8, scale_dtype=torch.bfloat16)
DEFAULT_PRESETS = (
    (128, dict(k_bits=4, v_bits=3, exact_first=4, exact_recent=64, scale_dtype=torch.bfloat16)),
    (240, dict(k_bits=5, **_LONG_HEAD_EXTRAS)),
    (256, dict(k_bits=None, key_groups=((112, 6), (144, 4)), **_LONG_HEAD_EXTRAS)),
    (512, dict(k_bits=5, **_LONG_HEAD_EXTRAS)),
)
# With bit widths given, the other coding options default to none of the preset's extras.
PLAIN_OPTIONS = dict(exact_first=0, exact_recent=0, scale_dtype=torch.float32)


def default_preset(head_dim: int) -> dict:
    """TurboQuantCache's options when no bit widths are given: DEFAULT_PRESETS' row for head_dim (k_bits None
    with key_groups: keys in channel groups)."""
    for largest, options in DEFAULT_PRESETS:
        if head_dim <= largest:
            return dict(options)
    raise ValueError(f"no default preset for head_dim {head_dim} (at most {DEFAULT_PRESETS[-1][0]}); "
                     "pass k_bits and v_bits")
SUPPORTED_TRANSFORMERS = ">=5.0"   # the CacheLayerMixin / AttentionInterface API; CI tests the current release
_INITIAL_CAPACITY = 256

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.configuration_utils import PretrainedConfig
except ImportError as e:  # pragma: no cover - exercised only without the hf extra
    raise ImportError("turboattn.hf needs transformers>=5.0: pip install 'turboattn[hf]'") from e

# The layer whose update() ran last in this thread and whose attention call is still due.  torch.compile
# traces a threading.local (dynamo special-cases it): a compiled step guards on the slot being empty and
# replays its writes; a thread's first compiled call compiles once more (the slot does not exist there yet).
# A module-level object would trace the same but mix up two threads running models at once.  Keep it a plain
# threading.local: a subclass with a class-level default tripped an internal dynamo guard check (torch 2.13).
_handoff = threading.local()


class TurboQuantLayer(CacheLayerMixin):
    """One attention layer's compressed K/V (a transformers cache layer); static with max_cache_len."""

    def __init__(self, k_bits: int = 4, v_bits: int = 4, scale_rule: str = "corrected",
                 sliding_window: int | None = None, quantize_current: bool = False,
                 max_cache_len: int | None = None, fit_keys: str = KEY_FIT_DEFAULT, exact_recent: int = 0,
                 exact_dtype: torch.dtype | None = None, exact_first: int = 0,
                 scale_dtype: torch.dtype = torch.float32, key_groups: tuple[tuple[int, int], ...] = ()):
        super().__init__()
        self.k_bits, self.v_bits, self.scale_rule, self.scale_dtype = k_bits, v_bits, scale_rule, scale_dtype
        self.key_groups = key_groups   # keys in channel groups (k_bits None), or ()
        self.fit_keys = fit_keys
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.quantize_current = quantize_current
        self.max_cache_len = max_cache_len
        # A sliding layer sees at most W - 1 past tokens: a longer exact window would hold nothing more.
        self.exact_recent = exact_recent if sliding_window is None else min(exact_recent, sliding_window - 1)
        self.exact_dtype = exact_dtype   # None: the dtype of the first K/V (the model's)
        # A ring (sliding layer) loses its first tokens: exact first tokens only on full-attention layers.
        self.exact_first = exact_first if sliding_window is None else 0
        self.is_compileable = max_cache_len is not None   # static: nothing in a step depends on host lengths
        self.cache: QuantizedKVCache | None = None

    def __repr__(self):
        return f"TurboQuantLayer({self.cache!r})"

    # -- transformers' layer interface ------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hkv, t, d = key_states.shape
        codec = KVCodec(d, self.k_bits, self.v_bits, self.scale_rule, self.scale_dtype, self.key_groups)
        capacity = None
        if not self.is_sliding:
            capacity = self.max_cache_len or max(_INITIAL_CAPACITY, t)
        self.cache = QuantizedKVCache(codec, b, hkv, capacity=capacity, sliding_window=self.sliding_window,
                                      device=key_states.device, static=self.is_compileable,
                                      exact_recent=self.exact_recent, exact_first=self.exact_first,
                                      exact_dtype=self.exact_dtype or _exact_dtype(key_states.dtype))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or (self.cache.is_empty and not self._fits(key_states)):
            self.lazy_initialization(key_states, value_states)  # an empty (reset) cache takes any batch shape
        if getattr(_handoff, "layer", None) is not None:
            _handoff.layer = None
            raise RuntimeError("TurboQuantCache was updated twice without attending: load the model with "
                               f"attn_implementation={ATTN_NAME!r} (import turboattn.hf registers it)")
        _handoff.layer = self
        return key_states, value_states

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens seen (the longest sequence).  Static: a 0-d int64 device tensor, as transformers' StaticLayer
        returns, so that positions computed from it do not turn into a new constant every step."""
        if self.cache is None:
            return 0
        return self.cache.seen.max().to(torch.int64) if self.is_compileable else self.cache.max_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Static: one width for every step (the mask function pads the 2-D mask to it), so that the mask
        # handed to a compiled step keeps its shape; a mask column is a token position.
        if self.is_compileable:
            return self.max_cache_len, 0
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        if self.is_sliding:
            return self.sliding_window
        return self.max_cache_len if self.is_compileable else -1

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()
        _handoff.layer = None

    @property
    def is_croppable(self) -> bool:
        """Whether crop() can always roll back (transformers' meaning): not a ring, which overwrites."""
        return not self.is_sliding

    def crop(self, max_length: int) -> None:
        """Drop -max_length tokens when negative, as transformers 5 calls it (0: none); keep the first
        max_length when positive (the older absolute form).  QuantizedKVCache.crop says what a ring allows."""
        if self.cache is not None and max_length != 0:
            self.cache.crop(max_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.cache is not None:
            self.cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.cache is not None:
            self.cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.batch_select_indices(indices)

    def _fits(self, key_states: torch.Tensor) -> bool:
        c = self.cache
        b, hkv, _, d = key_states.shape
        return (b, hkv, d, key_states.device) == (c.batch_size, c.num_kv_heads, c.codec.head_dim, c.device)

    @property
    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    @property
    def overflowed(self) -> torch.Tensor | bool:
        """Static: whether max_cache_len was exceeded (a device bool; QuantizedKVCache.overflowed)."""
        return False if self.cache is None else self.cache.overflowed

    # -- attention -----------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None,
               scale: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [B, Hq, T, D] over this layer's past plus the fresh k, v; then store k, v."""
        cache, t = self.cache, q.shape[2]
        if cache.is_empty:
            keep = self._start_sequences(padding_mask, t)
            out = flash_attention(q, k, v, causal=True, sliding_window=self.sliding_window, mask=keep,
                                  scale=scale, softcap=softcap, sinks=sinks)
            # A shift would reach softcap's tanh and the sink logit (key_transform.py).
            center = self.fit_keys != "off" and softcap is None and sinks is None
            balance = self.fit_keys == "balance"
            grouped = cache.codec.grouped_keys   # key groups always fit their channel order
            if (center or balance or grouped) and t >= MIN_FIT_TOKENS:
                valid = None if keep is None else keep[:, 0, 0, :]
                shift, gain = fit_key_transform(q, k, valid, center=center, balance=balance)
                order = fit_key_order(to_stored_keys(k, shift, gain), valid) if grouped else None
                cache.set_key_transform(shift, gain, order)
            self.store(k, v)
            return out
        if t > 1:
            self._check_no_new_padding(padding_mask, t)  # a single decode token reads no mask: no sync
        if self.quantize_current:
            if cache.is_ring and t > 1:
                # Appending first could evict keys that the chunk's earlier queries still see:
                # read the chunk through a codec round trip (what the cache will store) instead.
                k_hat, v_hat = cache.round_trip(k, v)
                out = cached_attention(q, cache, k_hat, v_hat, scale=scale, softcap=softcap, sinks=sinks)
                self.store(k, v)
                return out
            self.store(k, v)
            return cached_attention(q, cache, scale=scale, softcap=softcap, sinks=sinks)
        out = cached_attention(q, cache, k, v, scale, softcap, sinks)   # positional: a decode step's call
        self.store(k, v, validated=True)
        return out

    def store(self, k: torch.Tensor, v: torch.Tensor, validated: bool = False) -> None:
        """Quantize k, v [B, Hkv, T, D] into this layer's cache, growing it unless it is static (a static
        cache stores what fits and flags the rest: QuantizedKVCache.overflowed).  validated: cached_attention
        has just checked k, v against this cache."""
        cache = self.cache
        if not self.is_compileable and not self.is_sliding:   # the cache's is_static and is_ring
            need = cache.max_seen + k.shape[2]
            if need > cache.capacity:
                cache.reserve(_grown_capacity(cache.capacity, need))
        if validated:
            cache._append_validated(k, v)
        else:
            cache.append(k, v)

    def _start_sequences(self, padding_mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
        """Read left padding from the first chunk's 2-D mask; return the keep-mask for flash_attention (None
        when nothing is padded).  The chunk is positions 0..t-1: a static cache's wider mask is cut to it."""
        if padding_mask is None:
            return None
        if padding_mask.dim() != 2 or padding_mask.shape[1] < t:
            raise ValueError(f"expected a 2-D padding mask [B, {t}] for the first chunk, got {tuple(padding_mask.shape)}")
        keep = padding_mask[:, :t].to(torch.bool)
        num_pad = (~keep).to(torch.int32).cumprod(dim=1).sum(dim=1)
        positions = torch.arange(t, device=keep.device)[None]
        if not torch.equal(keep, positions >= num_pad[:, None]):
            raise ValueError("TurboQuantCache supports left padding only (tokenizer padding_side='left')")
        self.cache.set_left_padding(num_pad)
        if not bool(num_pad.any()):
            return None  # nothing padded: flash_attention's mask-free path
        return keep[:, None, None, :]

    def _check_no_new_padding(self, padding_mask: torch.Tensor | None, t: int) -> None:
        """A later chunk must be all real tokens.  Column p of the 2-D mask is position p (a static cache's
        mask is padded on the right to max_cache_len), so the chunk's columns start at seen[b]."""
        if padding_mask is None or padding_mask.dim() != 2:
            return
        cols = self.cache.seen.to(torch.int64)[:, None] + torch.arange(t, device=padding_mask.device)
        inside = cols < padding_mask.shape[1]
        chunk = padding_mask.gather(1, cols.clamp(max=padding_mask.shape[1] - 1)).to(torch.bool)
        if not bool((chunk | ~inside).all()):
            raise ValueError("padding after the first chunk is not supported by TurboQuantCache")


_EXACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _grown_capacity(capacity: int, need: int) -> int:
    """The capacity a growing layer reserves when `need` tokens pass its `capacity`: a quarter more (at least
    _INITIAL_CAPACITY tokens more), so that the copies stay amortized O(1) per token (each token is copied about four
    times on average) while the spare room stays under a quarter of the cache.  Doubling left a long prompt's cache
    twice its size from the first decoded token on: 8B shape, B=32, 32K tokens, 68 GiB instead of 34."""
    return max(need, capacity + max(capacity // 4, _INITIAL_CAPACITY))


def _exact_dtype(dtype) -> torch.dtype:
    """The exact window's dtype for a model of this dtype: itself when the window can hold it, else bfloat16."""
    return dtype if dtype in _EXACT_DTYPES else torch.bfloat16


def _model_dtype(config) -> torch.dtype | None:
    """The model's dtype as its config names it (a torch.dtype or its name), for the exact window; None when the
    config names none (a config built by hand): the layers then take the dtype of their first K/V."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for cfg in (text, config):
        dtype = getattr(cfg, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return _exact_dtype(dtype)
    return None


def _head_dim(config) -> int:
    """Per-head dimension of a transformers config (head_dim, else hidden_size / num_attention_heads)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    return int(head_dim) if head_dim else text.hidden_size // text.num_attention_heads


def _layer_types(config) -> list[tuple[str, int | None]]:
    """(kind, sliding_window) per decoder layer, from a transformers config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = text.num_hidden_layers
    types = getattr(text, "layer_types", None) or ["full_attention"] * n
    out = []
    for kind in types:
        if kind in ("sliding_attention", "chunked_attention"):
            if kind == "chunked_attention":
                raise ValueError("chunked attention layers are not supported by TurboQuantCache")
            out.append((kind, text.sliding_window))
        elif kind == "full_attention":
            out.append((kind, None))
        else:
            raise ValueError(f"layer type {kind!r} is not supported by TurboQuantCache")
    return out


class TurboQuantCache(Cache):
    """A transformers `Cache` holding K/V in TurboQuant form, one `TurboQuantLayer` per decoder layer.

    Sliding-window layers (e.g. Gemma-3's local layers) get ring caches of
    exactly `sliding_window` tokens.  Without `max_cache_len` the full layers
    start small and double as they fill.  With it the cache is static, for
    torch.compile and CUDA graphs: the full layers hold max_cache_len tokens
    per sequence (prompt plus generated), allocated once; lengths stay on the
    device; tokens past max_cache_len are not stored and set `overflowed`.
    Reuse one static cache with `reset()`: the compiled step stays valid.
    `fit_keys` picks the key transform fitted to the prompt (key_transform.py): "balance" (shift
    and channel gain), "center" (shift only) or "off" (keys stored as they come).
    `exact_recent=R` keeps each layer's R newest tokens in full precision (the model's dtype) beside their
    codes and reads them exactly (QuantizedKVCache; a sliding layer clamps R to its window - 1).
    `scale_dtype=torch.bfloat16` stores the scales in half the bytes (KVCodec; 0.25 bits per element less
    at head_dim 64; QUALITY.md measured no perplexity change).
    `exact_first=S` keeps the first S real tokens of each sequence (the attention sink) in full precision on
    every full-attention layer (sliding layers: none) and reads them exactly.
    `exact_recent_sliding=False` keeps the exact recent window on full-attention layers only: a sliding layer's
    ring is short (Gemma-3: 512 tokens), so a window there costs a large share of its bytes.
    `key_groups=((112, 6), (144, 4))` codes the keys in channel groups instead of at k_bits (KVCodec; leave
    k_bits None): each layer orders its channels by the prompt keys' variance (key_transform.fit_key_order),
    and the first group, with the most bits, takes the largest.  Without v_bits it keeps the default preset's
    other options.  The PyTorch path, the Triton kernels and (for the groupings of
    ops/cached/config.CUDA_KEY_GROUPS) the CUDA decode and quantize-append kernels read such caches (BENCHMARKS.md).

    Without `k_bits` and `v_bits` the cache takes the default preset for the model's head_dim
    (`default_preset`, DEFAULT_PRESETS: k4v3 with the first 4 and 64 newest tokens exact up to head_dim 128; at
    head_dim 256 keys in groups of 112 channels at 6 bits and 144 at 4, other head dims above 128 k5v3; there 3-bit
    values with the first 4 and 8 newest tokens exact; bfloat16 scales); `exact_first`, `exact_recent` and
    `scale_dtype`, when given, replace its values.  With bit widths given those three default to none
    (no exact tokens, float32 scales).
    """

    def __init__(self, config, k_bits: int | None = None, v_bits: int | None = None,
                 scale_rule: str = "corrected", quantize_current: bool = False, max_cache_len: int | None = None,
                 fit_keys: str = KEY_FIT_DEFAULT, exact_recent: int | None = None, exact_first: int | None = None,
                 scale_dtype: torch.dtype | None = None, exact_recent_sliding: bool = True,
                 key_groups: tuple[tuple[int, int], ...] | None = None):
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be a transformers PretrainedConfig (model.config), "
                            f"got {type(config).__name__}")
        if key_groups is not None:
            if k_bits is not None:
                raise ValueError(f"key_groups set the keys' widths: leave k_bits None, got k_bits={k_bits!r}")
            key_groups = check_key_groups(key_groups, _head_dim(config))
            base = default_preset(_head_dim(config)) if v_bits is None else dict(PLAIN_OPTIONS, v_bits=v_bits)
            base["k_bits"] = None
        else:
            if (k_bits is None) != (v_bits is None):
                raise ValueError(f"give both k_bits and v_bits, or neither (the default preset), got "
                                 f"k_bits={k_bits!r}, v_bits={v_bits!r}")
            base = default_preset(_head_dim(config)) if k_bits is None else dict(PLAIN_OPTIONS, k_bits=k_bits,
                                                                                  v_bits=v_bits)
            key_groups = base.get("key_groups", ())   # the default preset's at head_dim 256
        k_bits, v_bits = base["k_bits"], base["v_bits"]
        exact_recent = base["exact_recent"] if exact_recent is None else exact_recent
        exact_first = base["exact_first"] if exact_first is None else exact_first
        scale_dtype = base["scale_dtype"] if scale_dtype is None else scale_dtype
        check_coding_options(k_bits, v_bits, scale_rule, scale_dtype)
        if not isinstance(exact_recent_sliding, bool):
            raise TypeError(f"exact_recent_sliding must be a bool, got {exact_recent_sliding!r}")
        for name, value in (("exact_recent", exact_recent), ("exact_first", exact_first)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int (0: off), got {value!r}")
        if fit_keys not in KEY_FITS:
            raise ValueError(f"fit_keys must be one of {KEY_FITS}, got {fit_keys!r}")
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        if not isinstance(quantize_current, bool):
            raise TypeError(f"quantize_current must be a bool, got {quantize_current!r}")
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and impl != ATTN_NAME:
            raise ValueError(f"TurboQuantCache needs the model loaded with attn_implementation={ATTN_NAME!r}, "
                             f"this config uses {impl!r}")
        exact_dtype = _model_dtype(config)
        layers = [TurboQuantLayer(k_bits, v_bits, scale_rule, window, quantize_current, max_cache_len, fit_keys,
                                  exact_recent if window is None or exact_recent_sliding else 0, exact_dtype,
                                  exact_first, scale_dtype, key_groups)
                  for _, window in _layer_types(config)]
        super().__init__(layers=layers)
        self.k_bits, self.v_bits, self.scale_rule, self.scale_dtype = k_bits, v_bits, scale_rule, scale_dtype
        self.key_groups = key_groups
        self.exact_recent = exact_recent
        self.exact_first = exact_first
        self.exact_recent_sliding = exact_recent_sliding

    def crop(self, max_length: int) -> None:
        """TurboQuantLayer.crop on every layer, or on none: a ring that cannot drop as much raises first."""
        for layer in self.layers:
            if layer.cache is not None and max_length != 0:
                layer.cache.cropped_lengths(max_length)
        super().crop(max_length)

    @property
    def nbytes(self) -> int:
        """Bytes allocated over all layers (codes and scales, key transforms, exact windows and first tokens)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def overflowed(self) -> torch.Tensor | bool:
        """Static: whether a sequence outgrew max_cache_len (a device bool: reading it is a sync).  The
        tokens past it were not stored and attention missed them; the growing cache never overflows."""
        flags = [layer.cache.overflowed for layer in self.layers if layer.cache is not None]
        return torch.stack(flags).any() if flags else False

    def nbytes_used(self) -> int:
        """Bytes that the tokens held now occupy, key transforms included (allocation slack excluded)."""
        total = 0
        for layer in self.layers:
            c = layer.cache
            if c is not None:
                held = min(c.max_seen, c.capacity)
                total += c.batch_size * c.num_kv_heads * held * c.codec.bytes_per_token()
                total += c.key_transform_nbytes + c.exact_recent_nbytes + c.exact_first_nbytes
        return total

    def bits_per_element(self) -> float:
        """Bits per stored K/V element at the lengths held now: codes, scales, the exact windows (scratch
        rows included) and exact first tokens over all layers, per element of the held tokens (key transforms excluded, as in
        KVCodec.bits_per_element)."""
        bits = elements = 0
        for layer in self.layers:
            c = layer.cache
            if c is not None:
                held = c.batch_size * c.num_kv_heads * min(c.max_seen, c.capacity)
                bits += 8 * (held * c.codec.bytes_per_token() + c.exact_recent_nbytes + c.exact_first_nbytes)
                elements += 2 * held * c.codec.head_dim
        return bits / elements if elements else float("nan")


def turboattn_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        sliding_window: int | None = None, softcap: float | None = None,
                        s_aux: torch.Tensor | None = None, **kwargs):
    """transformers attention function: q [B, Hq, T, D], k/v [B, Hkv, T, D] -> ([B, T, Hq, D], None)."""
    if dropout:
        raise ValueError(f"turboattn attention is inference-only, got dropout={dropout}")
    sinks = None if s_aux is None else s_aux.to(torch.float32)
    layer = getattr(_handoff, "layer", None)   # the pending layer, taken
    _handoff.layer = None
    if layer is not None:
        if layer.sliding_window != sliding_window:
            raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: the cache was built for "
                             f"sliding_window={layer.sliding_window}, the model uses {sliding_window}")
        out = layer.attend(query, key, value, attention_mask, scaling, softcap, sinks)
    else:
        # Not our cache (none, or a transformers cache that returns full-precision K/V): dense
        # attention.  A sliding-window DynamicCache returns only the last keys, so the 2-D
        # padding mask is cut to them (keys and mask columns both end at the newest token).
        mask = attention_mask
        if mask is not None and mask.dim() == 2:
            mask = mask[:, -key.shape[2]:].to(torch.bool)[:, None, None, :]
        out = flash_attention(query, key, value, causal=bool(getattr(module, "is_causal", True)),
                              sliding_window=sliding_window, mask=mask, scale=scaling, softcap=softcap,
                              sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def turboattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask interface: pass the 2-D padding mask through, right-padded to the cache's mask width.

    Causality and sliding windows are applied by turboattn itself from token
    positions, so only the padding needs to reach the attention function.
    Nothing is read on the host (a decode step stays free of syncs); the
    padding to kv_length keeps one shape across steps for a static cache
    (get_mask_sizes), as transformers' own mask functions do.
    """
    if attention_mask is None:
        return None
    missing = kv_length + kv_offset - attention_mask.shape[-1]
    return torch.nn.functional.pad(attention_mask, (0, missing)) if missing > 0 else attention_mask


def register() -> None:
    """Register "turboattn" with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, turboattn_attention)
    AttentionMaskInterface.register(ATTN_NAME, turboattn_mask)


register()
