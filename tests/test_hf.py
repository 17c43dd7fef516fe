"""TurboQuantCache and the "turboattn" attention function inside transformers models.

Tiny random models (built from configs, no download) run the integration
against an exact reference: the same model with eager attention and a cache
that stores codec.dequantize(codec.quantize(k)).  Both compute in float32, so
logits agree to float32 rounding (observed ~1e-6; the bound 1e-4 leaves room
for reduction order and still catches any wrong token, scale or mask, which
moves logits by >1e-2 at these sizes).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

from turboattn import KVCodec, flash_attention  # noqa: E402
from turboattn.hf import TurboQuantCache, turboattn_attention  # noqa: E402
from turboattn.format.key_transform import MIN_FIT_TOKENS  # noqa: E402

ATOL = 1e-4
VOCAB = 96


def tiny_llama(attn="turboattn"):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    return _build(transformers.LlamaForCausalLM, cfg, attn)


def tiny_gemma3(attn="turboattn"):
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=8,
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
    [B, Hkv, D]) the keys are coded as (k - shift) * gain and mapped back after decoding."""

    def __init__(self, codec: KVCodec, strict: bool, transform=None):
        super().__init__()
        self.codec, self.strict, self.calls, self.transform = codec, strict, 0, transform

    def _round_trip(self, x, kind):
        if kind == "k" and self.transform is not None:
            shift, gain = (t[:, :, None] for t in self.transform)
            coded = self.codec.quantize((x - shift) * gain, kind)
            return (self.codec.dequantize(coded, kind) / gain + shift).to(x.dtype)
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
    codec = KVCodec(head_dim, bits[0], bits[1])
    n = model.config.num_hidden_layers
    transforms = [None] * n if fitted is None else [key_transform(layer) for layer in fitted.layers]
    return Cache(layers=[FakeQuantLayer(codec, strict, transforms[i]) for i in range(n)])


def key_transform(layer):
    c = layer.cache
    return None if c.key_gain is None else (c.key_shift, c.key_gain)


def teacher_forced_logits(model, ids, cache, prefill, step=1):
    """Logits for every position: one prefill chunk, then `step` tokens per call."""
    out = [model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
    for s in range(prefill, ids.shape[1], step):
        out.append(model(input_ids=ids[:, s:s + step], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def random_ids(n, batch=1, seed=1):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3, tiny_gemma2], ids=["llama", "gemma3", "gemma2"])
@pytest.mark.parametrize("bits", [(4, 4), (3, 2)])
@pytest.mark.parametrize("strict", [False, True], ids=["decode", "strict"])
@pytest.mark.parametrize("prefill", [10, 20], ids=["short-prompt", "fitted"])
@torch.no_grad()
def test_cache_matches_fake_quant_reference(factory, bits, strict, prefill):
    """Prefill + decode steps to 30 tokens (past the Gemma window of 8: the ring wraps) against the
    eager reference.  A prompt of 20 tokens fits the key transform, one of 10 is too short for it."""
    model, ref_model = factory(), factory("eager")
    ids = random_ids(30)
    cache = TurboQuantCache(model.config, *bits, quantize_current=strict)
    got = teacher_forced_logits(model, ids, cache, prefill)
    # The default fit centers keys; Gemma-2 has softcap, which a shift would reach: no transform there.
    fitted = [key_transform(layer) is not None for layer in cache.layers]
    assert fitted == [prefill >= MIN_FIT_TOKENS and factory is not tiny_gemma2] * len(cache.layers)
    want = teacher_forced_logits(ref_model, ids, fake_quant_cache(ref_model, bits, strict, fitted=cache), prefill)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # Quantization must matter here, or the comparison above proves nothing.
    exact = ref_model(input_ids=ids).logits
    assert (got - exact).abs().max() > 100 * ATOL


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma2], ids=["llama", "gemma2"])
@pytest.mark.parametrize("fit", ["balance", "center", "off"])
@torch.no_grad()
def test_each_key_fit_matches_fake_quant_reference(factory, fit):
    """fit_keys="balance" adds channel gains (alone under Gemma-2's softcap); "off" stores keys as they come."""
    model, ref_model = factory(), factory("eager")
    ids = random_ids(30)
    cache = TurboQuantCache(model.config, 4, 3, fit_keys=fit)
    got = teacher_forced_logits(model, ids, cache, 20)
    for layer in cache.layers:
        c = layer.cache
        assert (c.key_gain is not None) == (fit == "balance" or (fit == "center" and factory is tiny_llama))
        assert c.has_key_shift == (fit != "off" and factory is tiny_llama)
        if fit == "center" and c.key_gain is not None:
            assert torch.equal(c.key_gain, torch.ones_like(c.key_gain))
    want = teacher_forced_logits(ref_model, ids, fake_quant_cache(ref_model, (4, 3), fitted=cache), 20)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@torch.no_grad()
def test_strict_mode_is_exact_in_chunks(factory):
    """In strict mode chunks of 5 equal single steps, also when a chunk wraps Gemma's 8-slot ring."""
    model = factory()
    ids = random_ids(30)
    one = teacher_forced_logits(model, ids, TurboQuantCache(model.config, 4, 3, quantize_current=True), 10, 1)
    five = teacher_forced_logits(model, ids, TurboQuantCache(model.config, 4, 3, quantize_current=True), 10, 5)
    torch.testing.assert_close(one, five, atol=ATOL, rtol=0)


@torch.no_grad()
def test_later_chunk_reads_compressed_prefix():
    """A second multi-token chunk attends to the compressed prefix plus its own fresh K/V in full precision."""
    model, ref_model = tiny_llama(), tiny_llama("eager")
    ids = random_ids(24)
    got = teacher_forced_logits(model, ids, TurboQuantCache(model.config, 4, 4), 12, step=12)
    want = teacher_forced_logits(ref_model, ids, fake_quant_cache(ref_model, (4, 4)), 12, step=12)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@torch.no_grad()
def test_left_padded_batch_generates_like_one_by_one(factory):
    """Also the key transform: fitted per sequence on its real tokens (the third is too short for one)."""
    model = factory()
    prompts = [random_ids(24, seed=2)[0], random_ids(18, seed=3)[0], random_ids(8, seed=4)[0]]
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():] = p
        mask[i, width - p.numel():] = 1
    kw = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=mask, past_key_values=TurboQuantCache(model.config, 4, 4), **kw)
    for i, p in enumerate(prompts):
        one = model.generate(p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                             past_key_values=TurboQuantCache(model.config, 4, 4), **kw)
        assert torch.equal(batch.sequences[i, width:], one.sequences[0, p.numel():])
        torch.testing.assert_close(torch.stack([s[i] for s in batch.scores]), torch.cat(one.scores),
                                   atol=ATOL, rtol=0)


@torch.no_grad()
def test_right_padding_is_rejected():
    model = tiny_llama()
    ids = random_ids(6, batch=2)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with pytest.raises(ValueError, match="left padding"):
        model(input_ids=ids, attention_mask=mask, past_key_values=TurboQuantCache(model.config, 4, 4))


@torch.no_grad()
def test_no_cache_forward_matches_eager():
    """use_cache=False goes through flash_attention on the fresh K/V (padding mask included)."""
    model, ref_model = tiny_gemma3(), tiny_gemma3("eager")
    ids = random_ids(20, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    want = ref_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1, 6:], want[1, 6:], atol=ATOL, rtol=0)


@torch.no_grad()
def test_cache_grows_and_reports_memory():
    model = tiny_llama()
    cache = TurboQuantCache(model.config, 4, 3)
    ids = random_ids(300)
    model(input_ids=ids[:, :250], past_key_values=cache)
    assert cache.layers[0].cache.capacity == 256
    for s in range(250, 300, 10):
        model(input_ids=ids[:, s:s + 10], past_key_values=cache)
    assert cache.get_seq_length() == 300
    assert cache.layers[0].cache.capacity == 512
    per_token = KVCodec(64, 4, 3).bytes_per_token()  # 32 + 24 code bytes + 2 * 4 scale bytes
    assert per_token == 64
    transform = 2 * 3 * 2 * 64 * 4  # layers x (shift, gain, 1/gain) x KV heads x D x float32
    assert cache.nbytes_used() == 2 * 2 * 300 * per_token + transform  # layers x KV heads x tokens
    assert cache.nbytes == 2 * 2 * 512 * per_token + transform


@torch.no_grad()
def test_sliding_layers_hold_a_ring_of_the_window():
    model = tiny_gemma3()
    cache = TurboQuantCache(model.config, 4, 4)
    model(input_ids=random_ids(40), past_key_values=cache)
    rings = [layer.cache.capacity for layer in cache.layers if layer.is_sliding]
    assert rings == [8, 8] and not cache.layers[1].is_sliding
    assert cache.is_sliding == [True, False, True]


def test_constructor_validation():
    model = tiny_llama()
    with pytest.raises(ValueError, match="k_bits"):
        TurboQuantCache(model.config, 7, 4)
    with pytest.raises(ValueError, match="scale_rule"):
        TurboQuantCache(model.config, 4, 4, scale_rule="max")
    with pytest.raises(ValueError, match="fit_keys"):
        TurboQuantCache(model.config, 4, 4, fit_keys=True)
    with pytest.raises(ValueError, match="attn_implementation"):
        TurboQuantCache(tiny_llama("eager").config, 4, 4)


@torch.no_grad()
def test_attention_function_passes_scale_softcap_sinks():
    """Direct call without a cache: must equal flash_attention with the same options."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 7, 64), torch.randn(1, 2, 7, 64), torch.randn(1, 2, 7, 64)
    sinks = torch.randn(4)
    module = torch.nn.Module()
    module.is_causal = True
    got, weights = turboattn_attention(module, q, k, v, None, scaling=0.3, sliding_window=4, softcap=5.0, s_aux=sinks)
    want = flash_attention(q, k, v, causal=True, sliding_window=4, scale=0.3, softcap=5.0, sinks=sinks)
    assert weights is None
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-6, rtol=0)
    plain = flash_attention(q, k, v, causal=True, scale=0.3)
    assert (want - plain).abs().max() > 1e-2  # each option changed the result


@torch.no_grad()
def test_transformers_caches_still_work_with_turboattn_attention():
    """With a DynamicCache (full-precision K/V, sliding layers trimmed to the window) the attention
    function must equal eager attention, padding included: the evaluation's reference runs this way."""
    model, ref_model = tiny_gemma3(), tiny_gemma3("eager")
    ids = random_ids(12, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    got = model.generate(ids, past_key_values=transformers.DynamicCache(config=model.config), **kw)
    want = ref_model.generate(ids, past_key_values=transformers.DynamicCache(config=ref_model.config), **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=ATOL, rtol=0)
