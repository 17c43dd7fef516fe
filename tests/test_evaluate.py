"""The evaluation harness: its metrics, its chunked emulation of decode steps, the corpus, cache growth."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from turboattn import KVCodec, QuantizedKVCache  # noqa: E402
from turboattn import hf  # noqa: E402,F401  (registers attn_implementation="turboattn" for this file alone)
from turboattn.cli import eval as ev  # noqa: E402
from turboattn.cli.corpus import CORPUS_INFO, corpus_text  # noqa: E402

from hf_models import random_ids, teacher_forced_logits, tiny_gemma3, tiny_llama  # noqa: E402


def test_bits_per_element_counts_scales():
    # D=64: one float32 scale per vector adds 32/64 = 0.5 bits per element.
    assert ev.bits_per_element("k4v4", 64) == 4.5
    assert ev.bits_per_element("k4v3", 64) == 4.0
    assert ev.bits_per_element("k4v4", 256) == 4.125
    for d, names in ev.MIXED_CANDIDATES.items():
        assert all(ev.bits_per_element(n, d) <= 4.25 for n in names)
    with pytest.raises(ValueError, match="k4v4"):
        ev.parse_preset("int4")


def test_compare_metrics():
    g = torch.Generator().manual_seed(0)
    nll = torch.rand(200, generator=g) * 5
    attn = [torch.randn(200, 16, generator=g) for _ in range(3)]
    ref = {"nll": nll, "top": torch.arange(200), "attn": attn}
    same = ev.compare(ref, ref)
    assert same["ppl_change_pct"] == 0 and same["argmax_disagree_pct"] == 0
    assert same["attn_cos_mean"] == pytest.approx(1, abs=1e-6)
    # NLL up by exactly 0.01 nat per token: perplexity x exp(0.01), a zero-width interval.
    shifted = {"nll": nll + 0.01, "top": torch.arange(200).roll(1), "attn": [-a for a in attn]}
    m = ev.compare(ref, shifted)
    assert m["ppl_change_pct"] == pytest.approx(100 * (math.exp(0.01) - 1), rel=1e-4)
    assert m["ppl_change_ci95_pct"][0] == pytest.approx(m["ppl_change_ci95_pct"][1], rel=1e-3)
    assert m["argmax_disagree_pct"] == 100 and m["attn_cos_mean"] == pytest.approx(-1, abs=1e-6)


def test_compare_paired_cancels_the_tokens_noise():
    """Two methods whose NLLs share each token's difficulty: against the reference their intervals overlap, paired
    they do not, and the paired change is exp(mean difference) - 1 (float64 twin below)."""
    g = torch.Generator().manual_seed(1)
    n = 4000
    ref_nll = torch.rand(n, generator=g) * 5
    shared = torch.randn(n, generator=g) * 0.3         # the tokens' noise, the same for both methods
    a = {"nll": ref_nll + shared}
    b = {"nll": ref_nll + shared + 0.01 + torch.randn(n, generator=g) * 0.01}
    ref = {"nll": ref_nll, "top": torch.zeros(n), "attn": [torch.ones(n, 4)]}
    got_a = ev.compare(ref, a | {"top": torch.zeros(n), "attn": [torch.ones(n, 4)]})
    got_b = ev.compare(ref, b | {"top": torch.zeros(n), "attn": [torch.ones(n, 4)]})
    assert got_b["ppl_change_ci95_pct"][0] < got_a["ppl_change_ci95_pct"][1]   # unpaired: they overlap
    paired = ev.compare_paired("a", a, b)
    d = (b["nll"] - a["nll"]).double()
    mean, se = d.mean().item(), d.std().item() / math.sqrt(n)
    assert paired["paired_against"] == "a"
    assert paired["ppl_vs_paired_pct"] == pytest.approx(100 * math.expm1(mean), rel=1e-5)
    lo, hi = paired["ppl_vs_paired_ci95_pct"]
    assert lo == pytest.approx(100 * math.expm1(mean - 2 * se), rel=1e-4)
    assert hi == pytest.approx(100 * math.expm1(mean + 2 * se), rel=1e-4)
    assert lo > 0   # paired, b is worse than a beyond noise


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("prefill", [3, 12, 20], ids=["tiny-prompt", "short-prompt", "fitted"])
@pytest.mark.parametrize("exact_recent,exact_first", [(0, 0), (5, 0), (0, 4), (5, 4)],
                         ids=["codes", "exact-window", "exact-first", "exact-both"])
@torch.no_grad()
def test_decode_emulation_equals_token_by_token(factory, prefill, exact_recent, exact_first):
    """The eval scores decode mode in chunks; that must equal real one-token decode steps
    (with and without a key transform: a 20-token prompt fits one; with an exact window of the 5 newest
    tokens: the query at p reads [p - 5, p) exactly; with the first 4 tokens exact, alone and beside the window:
    a 3-token prompt puts a first-token position inside the first decode chunk)."""
    if prefill == 3 and not exact_first:
        pytest.skip("the tiny prompt is for the first-token rows")
    model = factory()
    ids = random_ids(40)
    exact = teacher_forced_logits(model, ids, ev.turbo_method("k4v3", "corrected", "decode", exact_decode=True,
                                                              exact_recent=exact_recent,
                                                              exact_first=exact_first).make_cache(model),
                                  prefill, step=1)
    chunked = teacher_forced_logits(model, ids, ev.turbo_method("k4v3", "corrected", "decode",
                                                                exact_recent=exact_recent,
                                                                exact_first=exact_first).make_cache(model),
                                    prefill, step=14)
    torch.testing.assert_close(chunked, exact, atol=1e-4, rtol=0)
    strict = teacher_forced_logits(model, ids, ev.turbo_method("k4v3", "corrected", "strict").make_cache(model),
                                   prefill, step=14)
    assert (strict - exact).abs().max() > 1e-2  # the modes differ, so the check above has teeth
    if exact_recent or exact_first:
        plain = teacher_forced_logits(model, ids, ev.turbo_method("k4v3", "corrected", "decode").make_cache(model),
                                      prefill, step=14)
        assert (plain - exact).abs().max() > 1e-2   # the exact rows matter: the check above reads them


def test_corpus_is_the_jargon_file():
    text = corpus_text()
    assert len(text) > 1_000_000
    assert "hacker" in text and "{" not in text
    assert "public domain" in CORPUS_INFO["license"]


def test_reserve_grows_a_contiguous_cache_and_keeps_its_contents():
    g = torch.Generator().manual_seed(0)
    cache = QuantizedKVCache(KVCodec(64, 4, 3), batch_size=2, num_kv_heads=3, capacity=8)
    k, v = torch.randn(2, 3, 6, 64, generator=g), torch.randn(2, 3, 6, 64, generator=g)
    cache.append(k, v)
    before = cache.dequantize()
    cache.reserve(20)
    assert cache.capacity == 20 and cache.k_codes.shape[2] == 20
    after = cache.dequantize()
    for a, b in zip(before, after):
        assert torch.equal(a, b[:, :, :8])
    cache.append(k, v)  # 12 tokens: fits now, would have overflowed 8
    assert cache.max_seen == 12
    cache.reserve(4)  # never shrinks
    assert cache.capacity == 20
    ring = QuantizedKVCache(KVCodec(64, 4, 4), 1, 1, sliding_window=4)
    with pytest.raises(ValueError, match="ring"):
        ring.reserve(8)


def test_passkey_caches_carry_the_cache_options():
    """The passkey rows measure the caches the perplexity rows do: exact first tokens, exact window and scale dtype
    reach the passkey caches, one per combination, named like the perplexity methods."""
    from turboattn.cli import main as cli

    args = cli.build_parser().parse_args(["eval", "--passkey-lengths", "512", "--passkey-presets", "k4v3,k8v8",
                                          "--exact-first", "0,4", "--exact-recent", "64",
                                          "--scale-dtype", "bfloat16"])
    caches = ev.passkey_caches(args, head_dim=64)
    assert sorted(caches) == ["k4v3-center-r64-bf16scales", "k4v3-center-s4-r64-bf16scales",
                              "k8v8-center-r64-bf16scales", "k8v8-center-s4-r64-bf16scales"]
    cache = caches["k4v3-center-s4-r64-bf16scales"](tiny_llama())
    assert (cache.k_bits, cache.v_bits, cache.exact_first, cache.exact_recent) == (4, 3, 4, 64)
    assert cache.scale_dtype == torch.bfloat16
    plain = cli.build_parser().parse_args(["eval", "--passkey-lengths", "512", "--passkey-presets", "k4v4"])
    assert list(ev.passkey_caches(plain, head_dim=64)) == ["k4v4-center"]  # the names of earlier results


def test_peer_cache_on_a_sliding_window_model_applies_the_window(monkeypatch):
    """transformers' QuantizedCache refuses Gemma-3; the eval builds the peer's layers by hand, full length, and
    relies on the attention's mask for the sliding window.  With the peer's quantization made exact, its cache must
    give the exact cache's logits over a sequence several windows long (a window not applied would change them)."""
    pytest.importorskip("optimum.quanto")
    from transformers import DynamicCache
    from transformers.cache_utils import QuantoQuantizedLayer

    from turboattn.cli.eval.peers import peer_default_method
    model = tiny_gemma3()
    assert model.config.sliding_window == 8
    cache = peer_default_method("quanto-int4", residual=4).make_cache(model)
    assert all(isinstance(layer, QuantoQuantizedLayer) for layer in cache.layers)
    ids = random_ids(40)
    monkeypatch.setattr(QuantoQuantizedLayer, "_quantize", lambda self, x, axis: x.clone())
    monkeypatch.setattr(QuantoQuantizedLayer, "_dequantize", lambda self, x: x)
    with torch.no_grad():
        ref = teacher_forced_logits(model, ids, DynamicCache(config=model.config), prefill=12).double()
        got = teacher_forced_logits(model, ids, cache, prefill=12).double()
    # float32 attention over the same keys in another order of operations: rounding only.
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
