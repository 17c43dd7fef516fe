"""TurboQuantCache(exact_recent=R) in transformers models, its file format, and `turboattn eval --exact-recent`
(its chunked decode emulation is checked in test_evaluate.py)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import random_ids, teacher_forced_logits, tiny_gemma3, tiny_llama  # noqa: E402
from turboattn.cli import eval as ev  # noqa: E402
from turboattn.hf import (TurboQuantCache, load_turboquant_cache, save_turboquant_cache)  # noqa: E402

ATOL = 1e-4   # float32 logits, as in test_hf.py: reduction order only; a wrong token or mask moves them by > 1e-2


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("max_len", [None, 64], ids=["growing", "static"])
@torch.no_grad()
def test_a_window_covering_every_token_gives_the_exact_cache(factory, max_len):
    """R = 48 >= every token (Gemma-3's sliding layers clamp it to W - 1 = 7, all their window shows): decode steps
    read nothing through codes, so 2-bit codes give DynamicCache's logits to float32 rounding."""
    model = factory()
    ids = random_ids(40)
    exact = teacher_forced_logits(model, ids, transformers.DynamicCache(config=model.config), 20, step=1)
    cache = TurboQuantCache(model.config, 2, 2, max_cache_len=max_len, exact_recent=48)
    got = teacher_forced_logits(model, ids, cache, 20, step=1)
    torch.testing.assert_close(got, exact, atol=ATOL, rtol=0)
    for layer in cache.layers:
        assert layer.cache.exact_recent == (7 if layer.is_sliding else 48)
        assert layer.cache.exact_dtype == torch.float32   # the model's (its config names none)
    coarse = teacher_forced_logits(model, ids, TurboQuantCache(model.config, 2, 2, max_cache_len=max_len), 20)
    assert (coarse - exact).abs().max() > 1e-2   # without the window the codes show: the check above has teeth


def test_options_names_and_bits():
    model = tiny_llama()
    with pytest.raises(ValueError, match="exact_recent"):
        TurboQuantCache(model.config, exact_recent=-1)
    method = ev.turbo_method("k4v4", "corrected", "decode", exact_recent=32)
    assert method.name == "k4v4-corrected-decode-center-r32" and method.info["exact_recent"] == 32
    assert ev.turbo_method("k4v4", "corrected", "decode").name == "k4v4-corrected-decode-center"
    # Strict mode in chunks shares one window boundary per call: with a window it steps token by token.
    assert ev.turbo_method("k4v4", "corrected", "strict", exact_recent=32).step == 1
    assert ev.turbo_method("k4v4", "corrected", "strict").step > 1 and method.step > 1
    cache = TurboQuantCache(model.config, 4, 4, exact_recent=8)
    with torch.no_grad():
        model(input_ids=random_ids(24), past_key_values=cache, use_cache=True)
    # Per layer: 24 held tokens x (64 x 8 / 8 code bytes + 8 scale bytes) + 2 x 9 rows x 64 float32 per KV head.
    per_head = 24 * (64 + 8) + 2 * 9 * 64 * 4
    assert cache.bits_per_element() == pytest.approx(8 * per_head / (2 * 24 * 64))
    assert cache.nbytes_used() == 2 * 2 * per_head + sum(layer.cache.key_transform_nbytes for layer in cache.layers)


def test_cli_takes_a_list_of_windows():
    from turboattn.cli.main import build_parser
    args = build_parser().parse_args(["eval", "--exact-recent", "0,32,64"])
    assert args.exact_recent == [0, 32, 64]
    assert build_parser().parse_args(["eval"]).exact_recent == [0]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--exact-recent", "32,-1"])


@torch.no_grad()
def test_saved_cache_keeps_its_window(tmp_path):
    model = tiny_gemma3()
    ids = random_ids(20, seed=3)
    cache = TurboQuantCache(model.config, 4, 4, exact_recent=6)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    save_turboquant_cache(cache, tmp_path / "c.safetensors")
    loaded = load_turboquant_cache(tmp_path / "c.safetensors", model.config)
    assert loaded.exact_recent == 6
    for a, b in zip(loaded.layers, cache.layers):
        assert a.cache.exact_recent == b.cache.exact_recent and torch.equal(a.cache.recent_k, b.cache.recent_k)
    token = torch.tensor([[5]])
    want = model(input_ids=token, past_key_values=cache).logits
    assert torch.equal(model(input_ids=token, past_key_values=loaded).logits, want)


@torch.no_grad()
def test_window_on_full_layers_only(tmp_path):
    """exact_recent_sliding=False: the sliding layers keep no window (their rings are short), the full layers
    keep theirs; the option survives a save and load, and eval names such methods ...-r{R}full."""
    model = tiny_gemma3()
    with pytest.raises(TypeError, match="exact_recent_sliding"):
        TurboQuantCache(model.config, exact_recent=4, exact_recent_sliding=0)
    cache = TurboQuantCache(model.config, 4, 4, exact_recent=4, exact_recent_sliding=False)
    model(input_ids=random_ids(20, seed=3), past_key_values=cache, use_cache=True)
    windows = {layer.is_sliding: layer.cache.exact_recent for layer in cache.layers}
    assert windows == {True: 0, False: 4}
    save_turboquant_cache(cache, tmp_path / "c.safetensors")
    loaded = load_turboquant_cache(tmp_path / "c.safetensors", model.config)
    assert not loaded.exact_recent_sliding
    assert [layer.cache.exact_recent for layer in loaded.layers] == [layer.cache.exact_recent for layer in cache.layers]
    method = ev.turbo_method("k4v4", "corrected", "decode", exact_recent=64, recent_sliding=False)
    assert method.name == "k4v4-corrected-decode-center-r64full"
