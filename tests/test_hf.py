"""TurboQuantCache and the "turboattn" attention function inside transformers models.

Tiny random models (built from configs, no download) run the integration
against an exact reference: the same model with eager attention and a cache
that stores codec.dequantize(codec.quantize(k)).  Both compute in float32, so
logits agree to float32 rounding (observed ~1e-6; the bound 1e-4 leaves room
for reduction order and still catches any wrong token, scale or mask, which
moves logits by >1e-2 at these sizes).
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from hf_models import (fake_quant_cache, key_transform, random_ids, teacher_forced_logits,  # noqa: E402
                       tiny_gemma2, tiny_gemma3, tiny_llama)
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402
from turboattn import KVCodec, flash_attention  # noqa: E402
from turboattn.hf import TurboQuantCache, turboattn_attention, turboattn_mask  # noqa: E402
from turboattn.integrations.hf import _grown_capacity  # noqa: E402
from turboattn.format.key_transform import MIN_FIT_TOKENS  # noqa: E402

ATOL = 1e-4
# The growing cache, and the static one (max_cache_len: lengths on the device, fixed storage) that compiled
# decoding uses (tests/test_compile.py): both must give the same results everywhere.
CACHE_KINDS = pytest.mark.parametrize("max_len", [None, 320], ids=["growing", "static"])


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3, tiny_gemma2], ids=["llama", "gemma3", "gemma2"])
@pytest.mark.parametrize("bits", [(4, 4), (3, 2)])
@pytest.mark.parametrize("strict", [False, True], ids=["decode", "strict"])
@pytest.mark.parametrize("prefill", [10, 20], ids=["short-prompt", "fitted"])
@CACHE_KINDS
@torch.no_grad()
def test_cache_matches_fake_quant_reference(factory, bits, strict, prefill, max_len):
    """Prefill + decode steps to 30 tokens (past the Gemma window of 8: the ring wraps) against the
    eager reference.  A prompt of 20 tokens fits the key transform, one of 10 is too short for it."""
    model, ref_model = factory(), factory("eager")
    ids = random_ids(30)
    cache = TurboQuantCache(model.config, *bits, quantize_current=strict, max_cache_len=max_len)
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


@CACHE_KINDS
@torch.no_grad()
def test_later_chunk_reads_compressed_prefix(max_len):
    """A second multi-token chunk attends to the compressed prefix plus its own fresh K/V in full precision."""
    model, ref_model = tiny_llama(), tiny_llama("eager")
    ids = random_ids(24)
    got = teacher_forced_logits(model, ids, TurboQuantCache(model.config, 4, 4, max_cache_len=max_len), 12, step=12)
    want = teacher_forced_logits(ref_model, ids, fake_quant_cache(ref_model, (4, 4)), 12, step=12)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@CACHE_KINDS
@torch.no_grad()
def test_left_padded_batch_generates_like_one_by_one(factory, max_len):
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
    batch = model.generate(ids, attention_mask=mask,
                           past_key_values=TurboQuantCache(model.config, 4, 4, max_cache_len=max_len), **kw)
    for i, p in enumerate(prompts):
        one = model.generate(p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                             past_key_values=TurboQuantCache(model.config, 4, 4), **kw)
        assert torch.equal(batch.sequences[i, width:], one.sequences[0, p.numel():])
        torch.testing.assert_close(torch.stack([s[i] for s in batch.scores]), torch.cat(one.scores),
                                   atol=ATOL, rtol=0)


@CACHE_KINDS
@torch.no_grad()
def test_right_padding_is_rejected(max_len):
    model = tiny_llama()
    ids = random_ids(6, batch=2)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with pytest.raises(ValueError, match="left padding"):
        model(input_ids=ids, attention_mask=mask,
              past_key_values=TurboQuantCache(model.config, 4, 4, max_cache_len=max_len))


@CACHE_KINDS
@torch.no_grad()
def test_padding_after_the_first_chunk_is_rejected(max_len):
    """A later chunk's mask columns are its positions (a static cache's mask is right-padded beyond them)."""
    model = tiny_llama()
    ids = random_ids(12, batch=2)
    cache = TurboQuantCache(model.config, 4, 4, max_cache_len=max_len)
    mask = torch.ones_like(ids)
    model(input_ids=ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache)
    model(input_ids=ids[:, 6:9], attention_mask=mask[:, :9], past_key_values=cache)  # all real: accepted
    mask[0, 10] = 0
    with pytest.raises(ValueError, match="padding after the first chunk"):
        model(input_ids=ids[:, 9:], attention_mask=mask, past_key_values=cache)


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


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 22), st.integers(1, 1 << 14))
def test_growth_keeps_the_spare_room_a_quarter(capacity, extra):
    """A growing layer reserves room for what it needs plus at most a quarter of its capacity (or the initial
    capacity, for small caches), and grows by at least that much, so that copies stay amortized."""
    need = capacity + extra
    grown = _grown_capacity(capacity, need)
    assert grown >= need
    assert grown - capacity >= max(capacity // 4, 256)
    assert grown - need <= max(capacity // 4, 256)   # the spare room


@torch.no_grad()
def test_a_long_prompt_grows_by_a_quarter_on_its_first_decoded_token():
    model = tiny_llama()
    cache = TurboQuantCache(model.config, 4, 4)
    ids = random_ids(1001)
    model(input_ids=ids[:, :1000], past_key_values=cache)
    assert cache.layers[0].cache.capacity == 1000
    model(input_ids=ids[:, 1000:], past_key_values=cache)
    assert cache.layers[0].cache.capacity == 1256   # 1000 + 256 (a quarter, 250, is under the initial 256)
    assert cache.get_seq_length() == 1001


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


# -- generate strategies that edit the cache: beam search (reorder), assisted decoding (crop) ----------

NEW_TOKENS = 16


class Record(LogitsProcessor):
    """Keeps what each step's choice saw: the running sequences and their (processed) next-token scores."""

    def __init__(self):
        self.steps = []

    def __call__(self, input_ids, scores):
        self.steps.append((input_ids.clone(), scores.clone()))
        return scores


def generate(model, ids, cache, **kw):
    """Greedy strategies on one prompt; min_new_tokens keeps EOS out, so every run makes NEW_TOKENS choices."""
    record = Record()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True, logits_processor=LogitsProcessorList([record]), **kw)
    out.steps = record.steps
    return out


def k8v8_logit_error(model, sequences, prompt):
    """Largest logit error of a k8v8 cache along `sequences` (teacher-forced against the exact model), reading
    the continuation one token at a time (all of it compressed) and as one chunk (all of it fresh); a
    verification chunk of assisted decoding reads some of each."""
    exact = model(input_ids=sequences).logits
    steps = (1, sequences.shape[1] - prompt)
    return max(float((teacher_forced_logits(model, sequences, TurboQuantCache(model.config, 8, 8), prompt, s)
                      - exact)[:, prompt - 1:-1].abs().max()) for s in steps)


def assert_matches_fake_quant(model_factory, ids, got, cache, **kw):
    """The eager model over the fake-quant cache (transformers' own DynamicLayer reorder / crop) must make
    the same choices from the same scores, to float32 rounding: the compressed cache was edited exactly."""
    ref_model = model_factory("eager")
    want = generate(ref_model, ids, fake_quant_cache(ref_model, (8, 8), fitted=cache), **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=ATOL, rtol=0)


def beam_margins(steps, num_beams):
    """Per step of a beam search over one prompt, how far the choice was from flipping: the last kept
    candidate's cumulative log-prob minus the first dropped one's; at the last step, the best minus the
    second (only the best is returned).  Cumulative scores are rebuilt from each row's parent row."""
    margins, acc, prev = [], None, None
    for t, (ids, logp) in enumerate(steps):
        if t == 0:  # generate starts with one live beam (row 0): the others at -1e9
            base = torch.tensor([0.0] + [-1e9] * (num_beams - 1), dtype=torch.float64)
        else:  # the prompt rows of step 0 are all alike: the first one is the live parent
            parent = {tuple(row): i for i, row in reversed(list(enumerate(prev.tolist())))}
            base = torch.stack([acc[parent[tuple(row[:-1].tolist())], row[-1]] for row in ids])
        acc = base[:, None] + logp.double()
        top = acc.flatten().topk(num_beams + 1).values
        margins.append(float(top[0] - top[1] if t == len(steps) - 1 else top[num_beams - 1] - top[num_beams]))
        prev = ids
    return margins


@pytest.mark.parametrize("num_beams", [2, 3])
@CACHE_KINDS
@torch.no_grad()
def test_beam_search_matches_exact_cache(num_beams, max_len):
    """reorder_cache every step.  The best beam equals DynamicCache's, except after a near-tie: the first
    choice where the two searches part must have had an exact margin below what k8v8 can move it.  A
    candidate's cumulative score after t + 1 steps sums t + 1 log-probs, each within 2E of exact (E: the
    logit error, measured along the returned beams), so a margin flips only below 2 (t + 1) 2E."""
    model = tiny_llama()
    ids = random_ids(20, seed=4)
    kw = dict(num_beams=num_beams, num_return_sequences=num_beams)
    exact = generate(model, ids, transformers.DynamicCache(config=model.config), **kw)
    cache = TurboQuantCache(model.config, 8, 8, max_cache_len=max_len)
    got = generate(model, ids, cache, **kw)
    assert cache.layers[0].cache.batch_size == num_beams and key_transform(cache.layers[0]) is not None
    assert_matches_fake_quant(tiny_llama, ids, got, cache, **kw)
    if not torch.equal(got.sequences[0], exact.sequences[0]):
        parted = next((t - 1 for t, ((a, _), (b, _)) in enumerate(zip(got.steps, exact.steps))
                       if sorted(a.tolist()) != sorted(b.tolist())), len(exact.steps) - 1)
        err = k8v8_logit_error(model, exact.sequences, ids.shape[1])
        assert beam_margins(exact.steps, num_beams)[parted] < 4 * (parted + 1) * err, parted


def assert_same_tokens_but_near_ties(model, prompt, got, exact):
    """Greedy tokens equal the exact cache's up to the first difference, which must be a near-tie: there both
    runs saw the same tokens, so the choice flipped only if the exact top-2 gap is below twice the logit error."""
    p = prompt.shape[1]
    differ = (got.sequences[0, p:] != exact.sequences[0, p:]).nonzero()
    if len(differ):
        i = int(differ[0])
        top2 = exact.scores[i][0].topk(2).values
        assert float(top2[0] - top2[1]) < 2 * k8v8_logit_error(model, exact.sequences, p), i


@pytest.mark.parametrize("head_dim", [80, 96])
@CACHE_KINDS
@torch.no_grad()
def test_head_dims_not_powers_of_two_generate_like_exact_cache(head_dim, max_len):
    """Phi / StableLM head dims (80, 96: rotation with a Hartley factor, served by the PyTorch path): k8v8
    greedy tokens equal DynamicCache's but near-ties, and the fake-quant reference's exactly."""
    model = tiny_llama(head_dim=head_dim)
    ids = random_ids(20, seed=5)
    exact = generate(model, ids, transformers.DynamicCache(config=model.config))
    cache = TurboQuantCache(model.config, 8, 8, max_cache_len=max_len)
    got = generate(model, ids, cache)
    assert cache.layers[0].cache.codec.head_dim == head_dim
    assert_matches_fake_quant(partial(tiny_llama, head_dim=head_dim), ids, got, cache)
    assert_same_tokens_but_near_ties(model, ids, got, exact)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set by `make test`)")
@torch.no_grad()
def test_head_dim_80_through_the_triton_kernels(monkeypatch):
    """The model path through the compressed cache's Triton kernels (forced on the CPU, as "auto" picks them on a
    GPU) at D = 80: greedy tokens equal DynamicCache's but near-ties, as on the PyTorch path."""
    import turboattn.attention
    import turboattn.cache.dynamic
    from turboattn.ops import backend

    def triton_for_the_cache(op, name, device, head_dim=None, grouped_keys=False):
        forced = "triton" if name == "auto" and op in ("cached_attention", "quantize_append") else name
        return backend.choose(op, forced, device, head_dim, grouped_keys)

    monkeypatch.setattr(turboattn.attention, "choose", triton_for_the_cache)
    monkeypatch.setattr(turboattn.cache.dynamic, "choose", triton_for_the_cache)
    model = tiny_llama(head_dim=80)
    ids = random_ids(12, seed=5)
    exact = generate(model, ids, transformers.DynamicCache(config=model.config))
    got = generate(model, ids, TurboQuantCache(model.config, 8, 8))
    assert_same_tokens_but_near_ties(model, ids, got, exact)


def assistant():
    """A second tiny model: the first with perturbed weights, so that it proposes 4 tokens a round and the
    main model rejects some of them (crops of 1 to 4 tokens)."""
    model = tiny_llama("eager")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    model.generation_config.update(num_assistant_tokens=4, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    return model


@pytest.mark.parametrize("strategy", ["assistant", "prompt_lookup"])
@CACHE_KINDS
@torch.no_grad()
def test_assisted_decoding_matches_exact_cache(strategy, max_len, monkeypatch):
    """Each round verifies a chunk of candidates against the compressed cache, then crops the rejected ones."""
    model = tiny_llama()
    ids = random_ids(20, seed=4)
    kw = dict(assistant_model=assistant()) if strategy == "assistant" else dict(prompt_lookup_num_tokens=3)
    crops = []
    crop = TurboQuantCache.crop
    monkeypatch.setattr(TurboQuantCache, "crop", lambda self, n: (crops.append(n), crop(self, n))[1])
    exact = generate(model, ids, transformers.DynamicCache(config=model.config))
    cache = TurboQuantCache(model.config, 8, 8, max_cache_len=max_len)
    got = generate(model, ids, cache, **kw)
    assert min(crops) <= -2 and len(crops) >= 4  # several rounds dropped rejected candidates
    assert_matches_fake_quant(tiny_llama, ids, got, cache, **kw)
    assert_same_tokens_but_near_ties(model, ids, got, exact)


@CACHE_KINDS
@torch.no_grad()
def test_batch_repeat_and_select_follow_the_chosen_rows(max_len):
    """Contrastive search's cache edits (transformers 5 moved the strategy itself to a hub repo that needs
    trust_remote_code): repeat the prompt's cache for 3 candidates, step each, keep one; the chosen row
    must continue exactly as a single sequence fed the same tokens."""
    model = tiny_llama()
    ids = random_ids(20, seed=4)
    cache = TurboQuantCache(model.config, 4, 4, max_cache_len=max_len)
    model(input_ids=ids, past_key_values=cache)
    cache.batch_repeat_interleave(3)
    candidates = torch.tensor([[5], [17], [40]])
    model(input_ids=candidates, past_key_values=cache)
    cache.batch_select_indices(torch.tensor([1]))
    got = model(input_ids=torch.tensor([[33]]), past_key_values=cache).logits
    one = TurboQuantCache(model.config, 4, 4)
    want = teacher_forced_logits(model, torch.cat([ids, torch.tensor([[17, 33]])], 1), one, 20)[:, -1:]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert cache.layers[0].cache.batch_size == 1 and cache.get_seq_length() == 22


@CACHE_KINDS
@torch.no_grad()
def test_reset_cache_generates_like_a_fresh_one(max_len):
    """Reused after reset(): the same batch size, then another one (an empty cache takes the new shape)."""
    model = tiny_llama()
    cache = TurboQuantCache(model.config, 4, 4, max_cache_len=max_len)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    model.generate(random_ids(300), attention_mask=torch.ones(1, 300, dtype=torch.long), past_key_values=cache, **kw)
    for batch, seed in ((1, 5), (2, 6)):
        ids = random_ids(24, batch=batch, seed=seed)
        cache.reset()
        assert cache.get_seq_length() == 0
        got = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **kw)
        want = model.generate(ids, attention_mask=torch.ones_like(ids),
                              past_key_values=TurboQuantCache(model.config, 4, 4), **kw)
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=ATOL, rtol=0)


@CACHE_KINDS
@torch.no_grad()
def test_crop_on_sliding_layers(max_len):
    """Gemma-3's ring layers (W = 8) crop like the full layer until they wrap; after that only one token can
    go (the ring overwrote the rest), and more raises instead of attending to the wrong keys."""
    model = tiny_gemma3()
    ids = random_ids(14)
    cache = TurboQuantCache(model.config, 4, 4, max_cache_len=max_len)
    assert not cache.is_croppable
    model(input_ids=ids[:, :7], past_key_values=cache)
    cache.crop(-3)
    cache.crop(0)  # transformers 5: nothing to drop
    assert [layer.cache.max_seen for layer in cache.layers] == [4, 4, 4]
    got = teacher_forced_logits(model, ids[:, 4:], cache, 1)  # one token a step from position 4 on
    want = teacher_forced_logits(model, ids, TurboQuantCache(model.config, 4, 4), 4)[:, 4:]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="sliding_window=8"):
        cache.crop(-2)
    assert [layer.cache.max_seen for layer in cache.layers] == [14, 14, 14]  # all layers or none
    cache.crop(-1)  # the spare slot
    got = model(input_ids=ids[:, 13:], past_key_values=cache).logits
    torch.testing.assert_close(got, want[:, -1:], atol=ATOL, rtol=0)


def test_mask_function_pads_without_reading_the_mask():
    """The mask reaches the attention function right-padded to the cache's mask width (fixed for a static
    cache), values unread: no host sync, one shape every step."""
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    got = turboattn_mask(2, 1, kv_length=5, attention_mask=mask)
    assert torch.equal(got, torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool))
    assert turboattn_mask(2, 1, kv_length=3, attention_mask=mask) is mask
    assert turboattn_mask(2, 1, kv_length=3, attention_mask=None) is None
    model = tiny_llama()
    cache = TurboQuantCache(model.config, max_cache_len=32)
    model(input_ids=random_ids(4), past_key_values=cache)
    assert cache.get_mask_sizes(1, 0) == (32, 0) and cache.get_max_length() == 32
