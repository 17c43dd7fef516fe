"""Saving and loading caches as safetensors: bit-identical attention after a reload, clear errors on a
version or shape mismatch; copy.deepcopy gives an equal, independent cache."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from safetensors.torch import save_file

import turboattn as ta
from turboattn.cache.persist import cache_state, load_cache, save_cache
from turboattn.format.codec import FORMAT_VERSION

STATE = ("k_codes", "v_codes", "k_scales", "v_scales", "seen", "starts", "nonfinite", "key_shift", "key_gain",
         "key_gain_inv")


def need_backend(backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by `make test`) or a GPU")


def kv(gen, b, hkv, t, d):
    return torch.randn(b, hkv, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN scales compare equal to themselves)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same_cache(got, want):
    assert (got.codec, got.batch_size, got.num_kv_heads, got.capacity, got.sliding_window) == \
        (want.codec, want.batch_size, want.num_kv_heads, want.capacity, want.sliding_window)
    for name in STATE:
        x, y = getattr(got, name), getattr(want, name)
        assert (x is None and y is None) or (x.device == y.device and torch.equal(bits(x), bits(y))), name
    assert (got.max_seen, got.has_key_shift, got.lengths.tolist()) == (want.max_seen, want.has_key_shift,
                                                                       want.lengths.tolist())


def prompt_cache(gen, kind, backend, d=64):
    """A cache after a prompt: contiguous with left padding and a key transform (and a NaN value in
    the padding: counted, seen by no query), or a ring that has wrapped, filled raggedly."""
    codec = ta.KVCodec(d, 4, 3, "lsq")
    if kind in ("contiguous", "static"):
        cache = ta.QuantizedKVCache(codec, 2, 2, capacity=40, static=kind == "static")
        cache.set_left_padding([3, 0])
        shift = torch.randn(2, 2, d, generator=gen)
        cache.set_key_transform(shift, torch.rand(2, 2, d, generator=gen) + 0.5)
        k, v = kv(gen, 2, 2, 19, d)
        v[0, 0, 1, 5] = math.nan  # so that there is a count to save
        cache.append(k, v, backend=backend)
    elif kind == "ring":
        cache = ta.QuantizedKVCache(codec, 2, 2, sliding_window=8)
        for t, n in ((5, [5, 3]), (9, [9, 9]), (2, [1, 2])):
            cache.append(*kv(gen, 2, 2, t, d), new_lengths=n, backend=backend)
        assert min(cache.seen.tolist()) > 8  # wrapped
    else:
        cache = ta.QuantizedKVCache(codec, 1, 2, capacity=4)  # nothing appended yet
    return cache


def attend(gen, cache, backend):
    b, hkv, d = cache.batch_size, cache.num_kv_heads, cache.codec.head_dim
    q = torch.randn(b, 2 * hkv, 3, d, generator=gen)
    fresh = kv(gen, b, hkv, 3, d)
    outs = [ta.cached_attention(q, cache, *fresh, backend=backend)]
    if cache.max_seen >= 3:
        outs.append(ta.cached_attention(q, cache, backend=backend))
    return outs


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["contiguous", "static", "ring", "empty"])
def test_saved_cache_reloads_bit_for_bit(backend, kind, gen, tmp_path):
    need_backend(backend)
    cache = prompt_cache(gen, kind, backend)
    cache.save(tmp_path / "prompt.safetensors")
    loaded = ta.QuantizedKVCache.load(tmp_path / "prompt.safetensors")
    assert_same_cache(loaded, cache)
    assert loaded.received_nonfinite() == (kind in ("contiguous", "static"))
    assert loaded.is_static == cache.is_static
    state = gen.get_state()
    want = attend(gen, cache, backend)
    gen.set_state(state)
    got = attend(gen, loaded, backend)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    # Both go on alike: the reloaded cache is a working cache, not a snapshot.
    more = kv(gen, cache.batch_size, cache.num_kv_heads, 2, cache.codec.head_dim)
    for c in (cache, loaded):
        c.append(*more, backend=backend)
    assert_same_cache(loaded, cache)


@pytest.mark.parametrize("d", [80, 480])
@pytest.mark.parametrize("kind", ["contiguous", "ring"])
def test_other_head_dims_reload_bit_for_bit(d, kind, gen, tmp_path):
    """Head dims that are not powers of two: the file's head_dim determines the rotation and norm blocks."""
    cache = prompt_cache(gen, kind, "torch", d)
    cache.save(tmp_path / "prompt.safetensors")
    loaded = ta.QuantizedKVCache.load(tmp_path / "prompt.safetensors")
    assert_same_cache(loaded, cache)
    assert loaded.codec.head_dim == d and loaded.k_scales.shape[-1] == -(-d // 256)
    state = gen.get_state()
    want = attend(gen, cache, "torch")
    gen.set_state(state)
    for a, b in zip(attend(gen, loaded, "torch"), want):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


def test_save_writes_only_the_slots_in_use(gen, tmp_path):
    cache = ta.QuantizedKVCache(ta.KVCodec(128, 4, 4), 1, 1, capacity=4096)
    cache.append(*kv(gen, 1, 1, 10, 128))
    save_cache(cache, tmp_path / "c.safetensors")
    assert os.path.getsize(tmp_path / "c.safetensors") < 10_000  # 10 slots, not 4096 (~ 1 MB)
    assert_same_cache(load_cache(tmp_path / "c.safetensors", device="cpu"), cache)


def tampered(gen, tmp_path, edit):
    """A file from a small cache after edit(tensors, meta); returns its path."""
    cache = prompt_cache(gen, "contiguous", "torch")
    tensors, meta = cache_state(cache)
    edit(tensors, meta)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, path, metadata=meta)
    return path


@pytest.mark.parametrize("edit,message", [
    (lambda t, m: m.update(format_version=str(FORMAT_VERSION + 1)), f"format_version {FORMAT_VERSION + 1} differs"),
    (lambda t, m: m.update(file_version="0"), "file_version 0 differs"),
    (lambda t, m: m.update(kind="something else"), "holds a 'something else'"),
    (lambda t, m: m.pop("head_dim"), "metadata 'head_dim' is missing"),
    (lambda t, m: m.update(k_bits="7"), "k_bits must be one of"),
    (lambda t, m: m.update(batch_size="3"), r"tensor 'seen' must be torch.int32 \[3\]"),
    (lambda t, m: m.update(num_kv_heads="1"), r"tensor 'k_codes' must be torch.uint8 \[2, 1, 19, 32\]"),
    (lambda t, m: m.update(head_dim="128"), r"'k_codes' must be torch.uint8 \[2, 2, 19, 64\]"),
    (lambda t, m: t.update(v_scales=t["v_scales"][:, :, :5].contiguous()), r"'v_scales' must be .* got .*\[2, 2, 5, 1\]"),
    (lambda t, m: t.update(k_scales=t["k_scales"].double()), "'k_scales' must be torch.float32"),
    (lambda t, m: m.update(capacity="10"), "do not fit capacity=10"),
    (lambda t, m: t.pop("key_gain_inv"), "a key transform needs all of"),
    (lambda t, m: t.pop("starts"), "tensor 'starts' is missing"),
])
def test_mismatched_files_raise(edit, message, gen, tmp_path):
    path = tampered(gen, tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_cache(path)


def test_deepcopy_is_equal_and_independent(gen):
    cache = prompt_cache(gen, "contiguous", "torch")
    twin = copy.deepcopy(cache)
    assert_same_cache(twin, cache)
    before = {name: bits(getattr(cache, name)).clone() for name in STATE}
    twin.append(*kv(gen, 2, 2, 1, 64))
    twin.batch_select_indices([1])
    assert all(torch.equal(bits(getattr(cache, name)), t) for name, t in before.items())
    assert cache.max_seen == 19 and cache.batch_size == 2


# -- TurboQuantCache --------------------------------------------------------------------------------

transformers_missing = pytest.mark.skipif(not __import__("importlib").util.find_spec("transformers"),
                                          reason="needs transformers")


def _prefilled(model, ids, mask, max_cache_len=None):
    from turboattn.hf import TurboQuantCache

    cache = TurboQuantCache(model.config, 4, 3, max_cache_len=max_cache_len)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    return cache


def _step(model, cache, ids, mask, token):
    with torch.no_grad():
        return model(input_ids=token, attention_mask=mask, past_key_values=cache).logits


@transformers_missing
@pytest.mark.parametrize("model_name", ["llama", "gemma3"])
@pytest.mark.parametrize("max_cache_len", [None, 32], ids=["growing", "static"])
def test_turboquant_cache_reloads_and_copies_bit_for_bit(model_name, max_cache_len, tmp_path):
    """A left-padded batch of 20-token prompts: the key transform is fitted, Gemma-3's ring layers (W = 8)
    have wrapped.  The reloaded cache and a deep copy continue exactly like the original."""
    from hf_models import random_ids, tiny_gemma3, tiny_llama
    from turboattn.hf import load_turboquant_cache, save_turboquant_cache

    model = {"llama": tiny_llama, "gemma3": tiny_gemma3}[model_name]()
    ids = random_ids(20, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cache = _prefilled(model, ids, mask, max_cache_len)
    assert all(layer.cache.key_gain is not None for layer in cache.layers)
    save_turboquant_cache(cache, tmp_path / "prompt.safetensors")
    loaded = load_turboquant_cache(tmp_path / "prompt.safetensors", model.config)
    twin = copy.deepcopy(cache)
    for layer, other in zip(loaded.layers, cache.layers):
        assert_same_cache(layer.cache, other.cache)
        assert layer.cache.is_static == other.cache.is_static == (max_cache_len is not None)
        assert (layer.dtype, layer.device, layer.sliding_window) == (other.dtype, other.device, other.sliding_window)
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    for token in (torch.tensor([[5], [7]]), torch.tensor([[11], [2]])):
        want = _step(model, cache, ids, mask, token)
        assert torch.equal(_step(model, loaded, ids, mask, token), want)
        assert torch.equal(_step(model, twin, ids, mask, token), want)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    twin.batch_select_indices(torch.tensor([0]))  # the copy is independent
    assert cache.layers[0].cache.batch_size == 2 and loaded.get_seq_length() == cache.get_seq_length() == 22


@transformers_missing
def test_turboquant_cache_load_checks_the_model(tmp_path):
    from hf_models import random_ids, tiny_gemma3, tiny_llama
    from turboattn.hf import TurboQuantCache, load_turboquant_cache, save_turboquant_cache

    gemma = tiny_gemma3()
    ids = random_ids(10)
    save_turboquant_cache(_prefilled(gemma, ids, torch.ones_like(ids)), tmp_path / "g.safetensors")
    with pytest.raises(ValueError, match="holds 3 layers, the model config has 2"):
        load_turboquant_cache(tmp_path / "g.safetensors", tiny_llama().config)
    gemma.config.sliding_window = 16
    with pytest.raises(ValueError, match="layer 0 was saved with sliding_window=8, the model config gives 16"):
        load_turboquant_cache(tmp_path / "g.safetensors", gemma.config)
    empty = TurboQuantCache(tiny_llama().config)  # never used: every layer empty
    save_turboquant_cache(empty, tmp_path / "e.safetensors")
    loaded = load_turboquant_cache(tmp_path / "e.safetensors", tiny_llama().config)
    assert [layer.cache for layer in loaded.layers] == [None, None] and loaded.get_seq_length() == 0
    save_cache(ta.QuantizedKVCache(ta.KVCodec(64), 1, 1, capacity=2), tmp_path / "single.safetensors")
    with pytest.raises(ValueError, match="not a turboattn.TurboQuantCache"):
        load_turboquant_cache(tmp_path / "single.safetensors", tiny_llama().config)
