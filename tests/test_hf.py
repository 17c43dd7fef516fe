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

from hf_models import (fake_quant_cache, key_transform, random_ids, teacher_forced_logits,  # noqa: E402
                       tiny_gemma2, tiny_gemma3, tiny_llama)
from turboattn import KVCodec, flash_attention  # noqa: E402
from turboattn.hf import TurboQuantCache, turboattn_attention  # noqa: E402
from turboattn.format.key_transform import MIN_FIT_TOKENS  # noqa: E402

ATOL = 1e-4


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
