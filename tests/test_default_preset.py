"""TurboQuantCache's default preset (DEFAULT_PRESETS): chosen by head_dim, overridable option by option."""
import pytest
import torch
from transformers import LlamaConfig

from hf_models import tiny_gemma3, tiny_llama
from turboattn.hf import DEFAULT_PRESETS, TurboQuantCache, default_preset


def _config(head_dim):
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    cfg._attn_implementation = "turboattn"
    return cfg


def _settings(layer):
    return (layer.k_bits, layer.v_bits, layer.exact_first, layer.exact_recent, layer.scale_dtype)


GEMMA3_KEYS = ((112, 6), (144, 4))   # QUALITY.md: the best <= 4.25-bit cache on Gemma-3-270M (head_dim 256)


@pytest.mark.parametrize("head_dim, want, groups", [
    (64, (4, 3, 4, 64, torch.bfloat16), ()), (128, (4, 3, 4, 64, torch.bfloat16), ()),
    (192, (5, 3, 4, 8, torch.bfloat16), ()), (256, (None, 3, 4, 8, torch.bfloat16), GEMMA3_KEYS),
    (512, (5, 3, 4, 8, torch.bfloat16), ())])
def test_default_follows_head_dim(head_dim, want, groups):
    cache = TurboQuantCache(_config(head_dim))
    assert all(_settings(layer) == want and layer.key_groups == groups for layer in cache.layers)
    assert (cache.k_bits, cache.v_bits, cache.exact_first, cache.exact_recent, cache.scale_dtype) == want
    assert cache.key_groups == groups


def test_head_dim_256_default_is_at_most_4_25_bits_per_element():
    """The key groups' codes cost 16 bits less per key than k5v3's (156 bytes against 160), so the preset's bits
    per element stay at or under k5v3's."""
    from turboattn import KVCodec
    grouped = KVCodec(256, None, 3, key_groups=GEMMA3_KEYS, scale_dtype=torch.bfloat16)
    plain = KVCodec(256, 5, 3, scale_dtype=torch.bfloat16)
    assert grouped.bits_per_element() < plain.bits_per_element() <= 4.25


def test_explicit_groups_with_the_default_values_and_extras():
    cache = TurboQuantCache(_config(256), key_groups=((96, 6), (160, 4)))
    assert cache.key_groups == ((96, 6), (160, 4)) and _settings(cache.layers[0]) == (None, 3, 4, 8, torch.bfloat16)


def test_head_dim_from_hidden_size_when_the_config_names_none():
    cfg = _config(64)
    cfg.head_dim = None   # hidden_size 128 / 4 heads = 32
    assert _settings(TurboQuantCache(cfg).layers[0]) == (4, 3, 4, 64, torch.bfloat16)


def test_given_options_replace_the_presets():
    cache = TurboQuantCache(_config(64), exact_recent=0, scale_dtype=torch.float32)
    assert _settings(cache.layers[0]) == (4, 3, 4, 0, torch.float32)


def test_given_bits_take_no_extras():
    """With bit widths the options default to none: no exact tokens, float32 scales (as before the preset)."""
    assert _settings(TurboQuantCache(_config(64), 4, 4).layers[0]) == (4, 4, 0, 0, torch.float32)
    assert _settings(TurboQuantCache(_config(256), 8, 8, exact_first=2).layers[0]) == (8, 8, 2, 0, torch.float32)


def test_bad_calls_say_why():
    with pytest.raises(ValueError, match="both k_bits and v_bits"):
        TurboQuantCache(_config(64), 4)
    with pytest.raises(ValueError, match="both k_bits and v_bits"):
        TurboQuantCache(_config(64), v_bits=3)
    with pytest.raises(ValueError, match="no default preset for head_dim 1024"):
        default_preset(1024)
    assert default_preset(64) is not default_preset(64)   # a copy: callers may edit theirs
    assert [largest for largest, _ in DEFAULT_PRESETS] == sorted(largest for largest, _ in DEFAULT_PRESETS)


def test_a_sliding_layer_keeps_its_clamped_window_and_no_first_tokens():
    """Gemma-3's rings (8 tokens here) clamp the preset's window to 7 and keep no first tokens."""
    model = tiny_gemma3()
    cache = TurboQuantCache(model.config)
    kinds = model.config.layer_types
    for kind, layer in zip(kinds, cache.layers):
        want = (4, 3, 0, 7) if kind == "sliding_attention" else (4, 3, 4, 64)
        assert _settings(layer)[:4] == want


@torch.no_grad()
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_default_cache_generates_as_its_explicit_options(make):
    """generate with TurboQuantCache(config) gives the tokens of the same options spelled out."""
    model = make()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    explicit = dict(default_preset(model.config.head_dim), exact_recent_sliding=True)
    mask = torch.ones_like(ids)   # random ids may hold the pad id; nothing is padded
    outs = [model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False)
            for cache in (TurboQuantCache(model.config), TurboQuantCache(model.config, **explicit))]
    assert torch.equal(outs[0], outs[1])
