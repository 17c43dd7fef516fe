"""Hugging Face transformers integration: a compressed KV cache and its attention function.

    from turboattn.hf import TurboQuantCache, register
    register()   # done by importing turboattn.hf; idempotent
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="turboattn")
    model.generate(ids, past_key_values=TurboQuantCache(model.config, k_bits=4, v_bits=4))

How the pieces meet.  A transformers attention module calls
`past_key_values.update(k, v, layer_idx)` and then the registered attention
function with whatever update returned.  A quantized cache cannot hand back
full K/V without dequantizing all of it, so `TurboQuantLayer.update` returns
the fresh k, v untouched and hands itself to the attention function through a
per-thread slot (`_handoff`; update and attention run back to back in every
attention module); the attention function (`turboattn_attention`) takes the
layer from the slot and lets it attend:

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
"""

from __future__ import annotations

import threading

import torch

from ..attention import cached_attention, flash_attention
from ..cache import QuantizedKVCache
from ..format.codec import KVCodec, check_coding_options
from ..format.key_transform import KEY_FITS, MIN_FIT_TOKENS, fit_key_transform

ATTN_NAME = "turboattn"
KEY_FIT_DEFAULT = "center"   # QUALITY.md: "balance" costs long-context retrieval
SUPPORTED_TRANSFORMERS = ">=5.0"   # the CacheLayerMixin / AttentionInterface API; CI tests the current release
_INITIAL_CAPACITY = 256

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # pragma: no cover - exercised only without the hf extra
    raise ImportError("turboattn.hf needs transformers>=5.0: pip install 'turboattn[hf]'") from e

# The layer whose update() ran last and whose attention call is still due, per thread.
_handoff = threading.local()


def _take_pending_layer():
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    return layer


class TurboQuantLayer(CacheLayerMixin):
    """One attention layer's compressed K/V (a transformers cache layer)."""

    is_compileable = False

    def __init__(self, k_bits: int = 4, v_bits: int = 4, scale_rule: str = "corrected",
                 sliding_window: int | None = None, quantize_current: bool = False,
                 max_cache_len: int | None = None, fit_keys: str = KEY_FIT_DEFAULT):
        super().__init__()
        self.k_bits, self.v_bits, self.scale_rule = k_bits, v_bits, scale_rule
        self.fit_keys = fit_keys
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.quantize_current = quantize_current
        self.max_cache_len = max_cache_len
        self.cache: QuantizedKVCache | None = None

    def __repr__(self):
        return f"TurboQuantLayer({self.cache!r})"

    # -- transformers' layer interface ------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hkv, t, d = key_states.shape
        codec = KVCodec(d, self.k_bits, self.v_bits, self.scale_rule)
        capacity = None
        if not self.is_sliding:
            capacity = self.max_cache_len or max(_INITIAL_CAPACITY, t)
        self.cache = QuantizedKVCache(codec, b, hkv, capacity=capacity, sliding_window=self.sliding_window,
                                      device=key_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or (self.cache.max_seen == 0 and not self._fits(key_states)):
            self.lazy_initialization(key_states, value_states)  # an empty (reset) cache takes any batch shape
        if getattr(_handoff, "layer", None) is not None:
            _handoff.layer = None
            raise RuntimeError("TurboQuantCache was updated twice without attending: load the model with "
                               f"attn_implementation={ATTN_NAME!r} (import turboattn.hf registers it)")
        _handoff.layer = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.cache is None else self.cache.max_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

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

    # -- attention -----------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None,
               scale: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [B, Hq, T, D] over this layer's past plus the fresh k, v; then store k, v."""
        cache, t = self.cache, q.shape[2]
        past = cache.max_seen
        if past == 0:
            keep = self._start_sequences(padding_mask, t)
            out = flash_attention(q, k, v, causal=True, sliding_window=self.sliding_window, mask=keep,
                                  scale=scale, softcap=softcap, sinks=sinks)
            # A shift would reach softcap's tanh and the sink logit (key_transform.py).
            center = self.fit_keys != "off" and softcap is None and sinks is None
            balance = self.fit_keys == "balance"
            if (center or balance) and t >= MIN_FIT_TOKENS:
                valid = None if keep is None else keep[:, 0, 0, :]
                cache.set_key_transform(*fit_key_transform(q, k, valid, center=center, balance=balance))
            self.store(k, v)
            return out
        if t > 1:
            self._check_no_new_padding(padding_mask, t)
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
        out = cached_attention(q, cache, k, v, scale=scale, softcap=softcap, sinks=sinks)
        self.store(k, v)
        return out

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize k, v [B, Hkv, T, D] into this layer's cache, growing it when it has no fixed size."""
        cache = self.cache
        need = cache.max_seen + k.shape[2]
        if not cache.is_ring and need > cache.capacity:
            if self.max_cache_len is not None:
                raise ValueError(f"TurboQuantCache(max_cache_len={self.max_cache_len}) cannot hold {need} tokens")
            cache.reserve(max(need, 2 * cache.capacity))  # doubling keeps the copies amortized O(1) per token
        cache.append(k, v)

    def _start_sequences(self, padding_mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
        """Read left padding from the first chunk's 2-D mask; return the keep-mask for flash_attention."""
        if padding_mask is None:
            return None
        if padding_mask.dim() != 2 or padding_mask.shape[1] != t:
            raise ValueError(f"expected a 2-D padding mask [B, {t}] for the first chunk, got {tuple(padding_mask.shape)}")
        keep = padding_mask.to(torch.bool)
        num_pad = (~keep).to(torch.int32).cumprod(dim=1).sum(dim=1)
        positions = torch.arange(t, device=keep.device)[None]
        if not torch.equal(keep, positions >= num_pad[:, None]):
            raise ValueError("TurboQuantCache supports left padding only (tokenizer padding_side='left')")
        self.cache.set_left_padding(num_pad)
        return keep[:, None, None, :]

    @staticmethod
    def _check_no_new_padding(padding_mask: torch.Tensor | None, t: int) -> None:
        if padding_mask is not None and padding_mask.dim() == 2 and not bool(padding_mask[:, -t:].all()):
            raise ValueError("padding after the first chunk is not supported by TurboQuantCache")


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
    exactly `sliding_window` tokens.  `max_cache_len` preallocates the full
    layers; without it they start small and double as they fill.
    `fit_keys` picks the key transform fitted to the prompt (key_transform.py): "balance" (shift
    and channel gain), "center" (shift only) or "off" (keys stored as they come).
    """

    def __init__(self, config, k_bits: int = 4, v_bits: int = 4, scale_rule: str = "corrected",
                 quantize_current: bool = False, max_cache_len: int | None = None,
                 fit_keys: str = KEY_FIT_DEFAULT):
        check_coding_options(k_bits, v_bits, scale_rule)
        if fit_keys not in KEY_FITS:
            raise ValueError(f"fit_keys must be one of {KEY_FITS}, got {fit_keys!r}")
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and impl != ATTN_NAME:
            raise ValueError(f"TurboQuantCache needs the model loaded with attn_implementation={ATTN_NAME!r}, "
                             f"this config uses {impl!r}")
        layers = [TurboQuantLayer(k_bits, v_bits, scale_rule, window, quantize_current, max_cache_len, fit_keys)
                  for _, window in _layer_types(config)]
        super().__init__(layers=layers)
        self.k_bits, self.v_bits, self.scale_rule = k_bits, v_bits, scale_rule

    def crop(self, max_length: int) -> None:
        """TurboQuantLayer.crop on every layer, or on none: a ring that cannot drop as much raises first."""
        for layer in self.layers:
            if layer.cache is not None and max_length != 0:
                layer.cache.cropped_lengths(max_length)
        super().crop(max_length)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for codes and scales over all layers."""
        return sum(layer.nbytes for layer in self.layers)

    def nbytes_used(self) -> int:
        """Bytes that the tokens held now occupy, key transforms included (allocation slack excluded)."""
        total = 0
        for layer in self.layers:
            c = layer.cache
            if c is not None:
                held = min(c.max_seen, c.capacity)
                total += c.batch_size * c.num_kv_heads * held * c.codec.bytes_per_token()
                total += c.key_transform_nbytes
        return total


def turboattn_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        sliding_window: int | None = None, softcap: float | None = None,
                        s_aux: torch.Tensor | None = None, **kwargs):
    """transformers attention function: q [B, Hq, T, D], k/v [B, Hkv, T, D] -> ([B, T, Hq, D], None)."""
    if dropout:
        raise ValueError(f"turboattn attention is inference-only, got dropout={dropout}")
    sinks = None if s_aux is None else s_aux.to(torch.float32)
    layer = _take_pending_layer()
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
        out = flash_attention(query, key, value, causal=getattr(module, "is_causal", True),
                              sliding_window=sliding_window, mask=mask, scale=scaling, softcap=softcap,
                              sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def turboattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask interface: pass the 2-D padding mask through (None when nothing is padded).

    Causality and sliding windows are applied by turboattn itself from token
    positions, so only the padding needs to reach the attention function.
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


def register() -> None:
    """Register "turboattn" with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, turboattn_attention)
    AttentionMaskInterface.register(ATTN_NAME, turboattn_mask)


register()
