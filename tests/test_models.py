"""Real-model checks (CPU, a few minutes): the offline models, TurboQuantCache inside generate, quality bounds.

The perplexity bounds are 1.5x the changes measured with this exact protocol
(turboattn.evaluate.quick_check: SmolLM2-135M, The Jargon File, one window of
128 prompt + 128 decode tokens, decode mode, scale rule "corrected", the
default key transform "center") on 2026-11-22: k4v4 +6.79% (95% interval +1.3% ..
+12.6%; +10.95% without the key transform).  The computation is
deterministic on a CPU, so a change beyond 1.5x means the codec, the cache or the
attention got worse, not noise.  At 8 bits 1.5x of a number this close to 0 would
be a bound on rounding, so the bound there is 0.3%, and k8v8 is checked over four
windows (512 scored tokens), where the 95% interval's half-width is about 0.3%:
+0.02% [-0.26, +0.31] with the uniform 8-bit levels of format version 2
(-0.07% with version 1's Lloyd-Max levels).  One window's interval is twice as
wide (about +-0.6% with uniform levels), and there it gave -0.69%.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from turboattn.cli import eval as ev  # noqa: E402
from turboattn.cli.corpus import corpus_text  # noqa: E402
from turboattn.hf import TurboQuantCache  # noqa: E402
from turboattn.cli.models import TOKENIZER_CHECKS, check_tokenizer, gguf_path, load_model  # noqa: E402

pytestmark = pytest.mark.slow

MEASURED_K4V4_PCT = 6.79
K8V8_BOUND_PCT = 0.3


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", attn_implementation="turboattn")


def greedy(model, ids, cache, n):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:]


def test_loader_finds_packaged_files():
    for name in ("smollm2", "gemma3"):
        path = gguf_path(name)
        assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    with pytest.raises(ValueError, match="model must be one of"):
        gguf_path("llama-70b")


def test_tokenizers_give_their_known_answers_and_a_wrong_one_stops_the_load():
    """Both GGUF tokenizers as this transformers reads them encode the known answer; a tokenizer that does not (as
    transformers 5.17 read Gemma-3's: no BOS, words in pieces) stops the load with a message that says why."""
    from transformers import AutoTokenizer

    for name in TOKENIZER_CHECKS:
        path = gguf_path(name)
        check_tokenizer(name, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))

    class Pieces:  # the ids transformers 5.17 gave for "The Jargon File"
        def __call__(self, text):
            return type("Encoding", (), {"input_ids": [818, 730, 1187, 498, 633, 755]})()
    with pytest.raises(RuntimeError, match=r"reads gemma3's tokenizer from its GGUF wrongly: 'The Jargon File' "
                                           r"encodes as \[818, 730, 1187, 498, 633, 755\]"):
        check_tokenizer("gemma3", Pieces())


def test_8bit_cache_generates_the_same_32_tokens(smollm2):
    model, tok = smollm2
    chat = [{"role": "user", "content": "What is a hash table? Answer briefly."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True).input_ids
    want = greedy(model, ids, DynamicCache(config=model.config), 32)
    got = greedy(model, ids, TurboQuantCache(model.config, 8, 8), 32)
    assert torch.equal(got, want), (tok.decode(got), tok.decode(want))


def test_perplexity_change_within_measured_bounds(smollm2):
    model, tok = smollm2
    k4 = ev.quick_check(model, tok, "k4v4")
    k8 = ev.quick_check(model, tok, "k8v8", segments=4)
    assert k4["scored_tokens"] == 128 and k8["scored_tokens"] == 512
    assert k4["ppl_change_pct"] <= 1.5 * MEASURED_K4V4_PCT, k4
    assert abs(k8["ppl_change_pct"]) <= K8V8_BOUND_PCT, k8
    assert k8["attn_cos_p1"] > k4["attn_cos_p1"]  # more bits, closer attention outputs


# A next-token choice whose top-2 logits differ by less than this is a tie that any rounding can flip.
NEAR_TIE = 0.05


def test_gemma3_ring_caches_keep_8bit_tokens():
    """A 600-token prompt wraps Gemma-3's 512-token ring caches before decoding starts.

    The 8-bit cache is fed the exact cache's 16 greedy tokens (teacher forcing) and must pick the
    same next token at every step, except where the exact cache itself faces a near-tie: this
    prompt has one (2nd step: " shell" 15.4624 vs " operating" 15.4609), which a free-running
    greedy comparison turns into a coin flip.
    """
    model, tok = load_model("gemma3", attn_implementation="turboattn")
    text = corpus_text()[100_000:104_000]
    ids = tok(text, return_tensors="pt").input_ids[:, :600]
    cache = TurboQuantCache(model.config, 8, 8)
    with torch.no_grad():
        exact = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(config=model.config),
                               max_new_tokens=16, min_new_tokens=16, do_sample=False, output_scores=True,
                               return_dict_in_generate=True)
        want_logits = torch.stack([x[0] for x in exact.scores])               # [16, vocab]
        fed = exact.sequences[:, 600:]
        logits = [model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]]
        for t in range(15):
            logits.append(model(input_ids=fed[:, t:t + 1], past_key_values=cache).logits[0, -1])
    got = torch.stack(logits).argmax(-1)
    top2 = want_logits.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
    assert int(decided.sum()) >= 12
    assert torch.equal(got[decided], fed[0][decided]), (tok.decode(got), tok.decode(fed[0]))
    rings = [layer.cache.capacity for layer in cache.layers if layer.is_sliding]
    assert rings and set(rings) == {512}


def test_demo_answers_with_both_caches(capsys, monkeypatch):
    from turboattn.cli import main as cli
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["demo", "--max-new-tokens", "8", "--eval-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "float32 cache" in out and "k4v4 cache" in out
    # 4-bit codes + one float32 scale per 64-dim vector: 36 bytes/vector vs 256 in float32, 128 in
    # bf16 (7.11x, 3.56x); the key transform's fixed 3 x 64 floats per layer and KV head lower that
    # noticeably for a short chat (the demo's: 5.82x, 2.91x).
    ratios = re.search(r"(\d+\.\d+)x smaller \((\d+\.\d+)x vs bf16\)", out)
    assert ratios, out
    assert 5.0 < float(ratios.group(1)) <= 7.11 and 2.5 < float(ratios.group(2)) <= 3.56  # measured 5.82x, 2.91x
    assert "perplexity" in out and "argmax" in out
