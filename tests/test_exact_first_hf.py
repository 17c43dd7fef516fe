"""TurboQuantCache(exact_first=S) in transformers models (alone and with exact_recent), its file format, and
`turboattn eval --exact-first` (its chunked decode emulation is checked in test_evaluate.py)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import random_ids, teacher_forced_logits, tiny_gemma3, tiny_llama  # noqa: E402
from turboattn.cli import eval as ev  # noqa: E402
from turboattn.hf import (TurboQuantCache, load_turboquant_cache, save_turboquant_cache)  # noqa: E402

ATOL = 1e-4   # float32 logits, as in test_hf.py: reduction order only; a wrong token or mask moves them by > 1e-2

COVERING = [
    (tiny_llama, 48, 0),    # the first rows alone hold every token
    (tiny_llama, 8, 36),    # first rows and window meet and overlap (the query at 39 reads [3, 39) from the window)
    (tiny_gemma3, 4, 48),   # sliding layers: no first rows (S = 0), R clamped to W - 1; full layers overlap
]


@pytest.mark.parametrize("case", COVERING, ids=["llama-first", "llama-both", "gemma3-both"])
@pytest.mark.parametrize("max_len", [None, 64], ids=["growing", "static"])
@torch.no_grad()
def test_first_rows_and_window_covering_every_token_give_the_exact_cache(case, max_len):
    """S + R covers every token: decode steps read nothing through codes, so 2-bit codes give DynamicCache's logits
    to float32 rounding; a position in both buffers counted twice would move them by far more."""
    factory, s_len, r_len = case
    model = factory()
    ids = random_ids(40)
    exact = teacher_forced_logits(model, ids, transformers.DynamicCache(config=model.config), 20, step=1)
    cache = TurboQuantCache(model.config, 2, 2, max_cache_len=max_len, exact_first=s_len, exact_recent=r_len)
    got = teacher_forced_logits(model, ids, cache, 20, step=1)
    torch.testing.assert_close(got, exact, atol=ATOL, rtol=0)
    for layer in cache.layers:
        assert layer.cache.exact_first == (0 if layer.is_sliding else s_len)
        assert layer.cache.exact_dtype == torch.float32   # the model's (its config names none)
    if r_len:   # without the first rows the window misses the oldest tokens: the check above has teeth
        window = teacher_forced_logits(model, ids, TurboQuantCache(model.config, 2, 2, max_cache_len=max_len,
                                                                   exact_recent=min(r_len, 36)), 20, step=1)
        assert (window - exact).abs().max() > 1e-2


def test_options_names_and_bits():
    model = tiny_llama()
    with pytest.raises(ValueError, match="exact_first"):
        TurboQuantCache(model.config, exact_first=-1)
    method = ev.turbo_method("k4v4", "corrected", "decode", exact_first=4)
    assert method.name == "k4v4-corrected-decode-center-s4" and method.info["exact_first"] == 4
    both = ev.turbo_method("k4v4", "corrected", "strict", exact_first=4, exact_recent=64)
    assert both.name == "k4v4-corrected-strict-center-s4-r64" and both.step == 1
    # First rows alone do not depend on chunk boundaries: strict mode stays chunked.
    assert ev.turbo_method("k4v4", "corrected", "strict", exact_first=4).step > 1
    cache = TurboQuantCache(model.config, 4, 4, exact_first=4, exact_recent=8)
    with torch.no_grad():
        model(input_ids=random_ids(24), past_key_values=cache, use_cache=True)
    # Per layer and KV head: 24 tokens x (64 code + 8 scale bytes), a 9-row window and 4 first rows in float32.
    per_head = 24 * (64 + 8) + 2 * 9 * 64 * 4 + 2 * 4 * 64 * 4
    assert cache.bits_per_element() == pytest.approx(8 * per_head / (2 * 24 * 64))
    assert cache.nbytes_used() == 2 * 2 * per_head + sum(layer.cache.key_transform_nbytes for layer in cache.layers)


def test_cli_takes_a_list_of_first_token_counts():
    from turboattn.cli.main import build_parser
    args = build_parser().parse_args(["eval", "--exact-first", "0,4", "--exact-recent", "64"])
    assert args.exact_first == [0, 4] and args.exact_recent == [64]
    assert build_parser().parse_args(["eval"]).exact_first == [0]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--exact-first", "4,-1"])


def test_report_labels_first_tokens():
    from turboattn.cli.eval.report import markdown_tables
    row = dict(family="turboattn", preset="k4v4", rule="corrected", mode="decode", fit_keys="center",
               exact_first=4, exact_recent=64, bits_per_element=4.5, ppl_change_pct=0.04,
               ppl_change_ci95_pct=[0.0, 0.1], argmax_disagree_pct=1.0, attn_cos_mean=0.99, attn_cos_p1=0.9)
    report = {"results": {"reference": {"ppl": 10.0}, "k4v4-corrected-decode-center-s4-r64": row},
              "head_dim": 64, "segments": 1, "scored_per_segment": 8}
    assert "| k4v4 + first 4 exact + 64 exact | 4.500 |" in markdown_tables(report)


@torch.no_grad()
def test_saved_cache_keeps_its_first_rows(tmp_path):
    model = tiny_gemma3()
    ids = random_ids(20, seed=3)
    cache = TurboQuantCache(model.config, 4, 4, exact_first=3, exact_recent=6)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    save_turboquant_cache(cache, tmp_path / "c.safetensors")
    loaded = load_turboquant_cache(tmp_path / "c.safetensors", model.config)
    assert loaded.exact_first == 3 and loaded.exact_recent == 6
    for a, b in zip(loaded.layers, cache.layers):
        assert a.cache.exact_first == b.cache.exact_first == (0 if b.is_sliding else 3)
        assert (a.cache.first_k is None) == b.is_sliding
        if not b.is_sliding:
            assert torch.equal(a.cache.first_k, b.cache.first_k) and torch.equal(a.cache.first_v, b.cache.first_v)
    token = torch.tensor([[5]])
    want = model(input_ids=token, past_key_values=cache).logits
    assert torch.equal(model(input_ids=token, past_key_values=loaded).logits, want)
