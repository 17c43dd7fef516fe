"""Tiny random transformers models (built from configs, no download) and the exact reference cache.

Shared by tests/test_hf.py, tests/test_evaluate.py and tests/gpu/test_hf_gpu.py.  The reference
runs the same model with eager attention over a cache that stores codec.dequantize(codec.quantize(k)).
"""

from __future__ import annotations

import torch
import transformers
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig
from transformers.cache_utils import Cache, DynamicLayer

from turboattn import KVCodec

VOCAB = 96


def tiny_llama(attn="turboattn", head_dim=64):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512)
    return _build(transformers.LlamaForCausalLM, cfg, attn)


def tiny_gemma3(attn="turboattn", head_dim=64):
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           query_pre_attn_scalar=24, max_position_embeddings=512)
    return _build(transformers.Gemma3ForCausalLM, cfg, attn)


def tiny_gemma2(attn="turboattn"):
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=16,
                       attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=64,
                       max_position_embeddings=512)
    return _build(transformers.Gemma2ForCausalLM, cfg, attn)


def _build(cls, cfg, attn):
    torch.manual_seed(0)
    cfg._attn_implementation = attn
    model = cls(cfg).eval()
    # Random init gives near-uniform attention; larger q/k weights make scores (and quantization errors) matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


class FakeQuantLayer(DynamicLayer):
    """Reference: stores dequantize(quantize(k, v)); returns full-precision fresh K/V after the first chunk
    only in decode mode (strict mode returns them quantized too).  With a key transform (shift, gain
    [B, Hkv, D], and a channel order or None) the keys are coded as ((k - shift) * gain)[order] and mapped back
    after decoding."""

    def __init__(self, codec: KVCodec, strict: bool, transform=None):
        super().__init__()
        self.codec, self.strict, self.calls, self.transform = codec, strict, 0, transform

    def _round_trip(self, x, kind):
        if kind == "k" and self.transform is not None:
            shift, gain, order = self.transform
            stored = (x - shift[:, :, None]) * gain[:, :, None]
            if order is not None:
                index = order.long()[:, :, None, :].expand(stored.shape)
                stored = stored.gather(-1, index)
            decoded = self.codec.dequantize(self.codec.quantize(stored, kind), kind)
            if order is not None:
                decoded = torch.empty_like(decoded).scatter_(-1, index, decoded)
            return (decoded / gain[:, :, None] + shift[:, :, None]).to(x.dtype)
        return self.codec.dequantize(self.codec.quantize(x, kind), kind, x.dtype)

    def update(self, k, v, *args, **kwargs):
        fq = [self._round_trip(x, kind) for x, kind in ((k, "k"), (v, "v"))]
        first = self.calls == 0
        self.calls += 1
        past_k, past_v = (self.keys, self.values) if self.is_initialized else (None, None)
        super().update(*fq)
        if first:
            return k, v
        if self.strict:
            return self.keys, self.values
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)


def fake_quant_cache(model, bits, strict=False, fitted=None):
    """The reference cache; `fitted` (a TurboQuantCache that has run) lends each layer its key transform."""
    head_dim = model.config.head_dim
    if isinstance(bits[0], tuple):   # keys in channel groups
        codec = KVCodec(head_dim, None, bits[1], key_groups=bits[0])
    else:
        codec = KVCodec(head_dim, bits[0], bits[1])
    n = model.config.num_hidden_layers
    transforms = [None] * n if fitted is None else [key_transform(layer) for layer in fitted.layers]
    return Cache(layers=[FakeQuantLayer(codec, strict, transforms[i]) for i in range(n)])


def key_transform(layer):
    c = layer.cache
    return None if c.key_gain is None else (c.key_shift, c.key_gain, c.key_order)


def teacher_forced_logits(model, ids, cache, prefill, step=1):
    """Logits for every position: one prefill chunk, then `step` tokens per call."""
    out = [model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
    for s in range(prefill, ids.shape[1], step):
        out.append(model(input_ids=ids[:, s:s + step], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def random_ids(n, batch=1, seed=1):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))
