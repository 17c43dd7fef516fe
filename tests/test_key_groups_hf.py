"""TurboQuantCache(key_groups=...): keys in channel groups inside transformers models, against the exact reference
cache of tests/hf_models.py coding each layer's keys with the order the cache fitted."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import (fake_quant_cache, random_ids, teacher_forced_logits, tiny_gemma2,  # noqa: E402
                       tiny_gemma3, tiny_llama)
from turboattn.cli import eval as ev  # noqa: E402
from turboattn.hf import TurboQuantCache, load_turboquant_cache, save_turboquant_cache  # noqa: E402

ATOL = 1e-4   # float32 rounding of the same computation (tests/test_hf.py says why this bound has teeth)
GROUPS = ((32, 6), (32, 3))   # the tiny models' head_dim 64


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3, tiny_gemma2], ids=["llama", "gemma3", "gemma2"])
@torch.no_grad()
def test_cache_matches_fake_quant_reference(factory):
    """Prefill of 20 (fitted) and decode steps to 30 tokens (Gemma-3's ring of 8 wraps).  Gemma-2's softcap takes
    no shift: the order alone is fitted there, and it changes no score."""
    model, ref_model = factory(), factory("eager")
    ids = random_ids(30)
    cache = TurboQuantCache(model.config, v_bits=4, key_groups=GROUPS)
    got = teacher_forced_logits(model, ids, cache, 20)
    for layer in cache.layers:
        order = layer.cache.key_order
        assert order is not None and order.dtype == torch.int16
        assert layer.cache.has_key_shift == (factory is not tiny_gemma2)
        assert not torch.equal(order[0, 0].long(), torch.arange(64))   # fitted: not the model's order
    want = teacher_forced_logits(ref_model, ids, fake_quant_cache(ref_model, (GROUPS, 4), fitted=cache), 20)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # The order matters: the same reference without it moves the logits by far more than the bound.
    for layer in cache.layers:
        layer.cache.key_order = None
    unordered = teacher_forced_logits(ref_model, ids, fake_quant_cache(ref_model, (GROUPS, 4), fitted=cache), 20)
    assert (unordered - want).abs().max() > 100 * ATOL


@torch.no_grad()
def test_options():
    model = tiny_llama()
    with pytest.raises(ValueError, match="leave k_bits None"):
        TurboQuantCache(model.config, k_bits=4, v_bits=4, key_groups=GROUPS)
    with pytest.raises(ValueError, match="cover 96 channels"):
        TurboQuantCache(model.config, key_groups=((32, 6), (64, 3)))
    # Without v_bits: the default preset's other options (head_dim 64: v3, first 4 and 64 recent exact, bf16 scales).
    cache = TurboQuantCache(model.config, key_groups=GROUPS)
    assert (cache.k_bits, cache.v_bits, cache.exact_first, cache.exact_recent) == (None, 3, 4, 64)
    assert cache.scale_dtype == torch.bfloat16 and cache.key_groups == GROUPS
    model(input_ids=random_ids(24), past_key_values=cache, use_cache=True)
    assert cache.layers[0].cache.codec.name == "k32x6+32x3v3"


@torch.no_grad()
def test_saved_cache_keeps_its_groups_and_order(tmp_path):
    model = tiny_gemma3()
    cache = TurboQuantCache(model.config, v_bits=4, key_groups=GROUPS, exact_recent=4)
    model(input_ids=random_ids(20, seed=3), past_key_values=cache, use_cache=True)
    save_turboquant_cache(cache, tmp_path / "c.safetensors")
    loaded = load_turboquant_cache(tmp_path / "c.safetensors", model.config)
    assert loaded.key_groups == GROUPS and loaded.k_bits is None
    for a, b in zip(loaded.layers, cache.layers):
        assert torch.equal(a.cache.key_order, b.cache.key_order) and torch.equal(a.cache.k_codes, b.cache.k_codes)
    token = torch.tensor([[5]])
    want = model(input_ids=token, past_key_values=cache).logits
    assert torch.equal(model(input_ids=token, past_key_values=loaded).logits, want)


def test_eval_names_and_bits():
    assert ev.parse_preset("k32x6+32x3v4") == (GROUPS, 4)
    method = ev.turbo_method("k32x6+32x3v4", "corrected", "decode")
    assert method.name.startswith("k32x6+32x3v4-corrected-decode")
    # 32 x 6 + 32 x 3 + 64 x 4 code bits and three float32 scales per token, over 128 elements.
    assert ev.bits_per_element("k32x6+32x3v4", 64) == pytest.approx((32 * 6 + 32 * 3 + 64 * 4 + 3 * 32) / 128)
    with pytest.raises(ValueError, match="k112x6"):
        ev.parse_preset("k32x6+v4")
