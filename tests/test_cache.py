"""QuantizedKVCache storage: contiguous and ring layouts, ragged appends, padding, sizes."""

from __future__ import annotations

import pytest
import torch

import turboattn as ta


def kv(gen, b, hkv, t, d, dtype=torch.float32):
    return (torch.randn(b, hkv, t, d, generator=gen).to(dtype), torch.randn(b, hkv, t, d, generator=gen).to(dtype))


def assert_slot_holds(cache, b, slot, k_token, v_token):
    """Slot `slot` of sequence b holds exactly the codec's coding of k_token, v_token [Hkv, D]."""
    pk, pv = cache.codec.quantize(k_token, "k"), cache.codec.quantize(v_token, "v")
    assert torch.equal(cache.k_codes[b, :, slot], pk.codes) and torch.equal(cache.k_scales[b, :, slot], pk.scales)
    assert torch.equal(cache.v_codes[b, :, slot], pv.codes) and torch.equal(cache.v_scales[b, :, slot], pv.scales)


def test_contiguous_appends_store_every_token(gen):
    codec = ta.KVCodec(64, 5, 3)
    b, hkv, cap = 2, 3, 20
    cache = ta.QuantizedKVCache(codec, batch_size=b, num_kv_heads=hkv, capacity=cap)
    ks, vs = [], []
    for t in (1, 4, 2, 7, 6):  # Hkv != T for most chunks: a transposed write would show
        k, v = kv(gen, b, hkv, t, 64)
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
        total = sum(x.shape[2] for x in ks)
        assert cache.lengths.tolist() == [total] * b
        all_k, all_v = torch.cat(ks, 2), torch.cat(vs, 2)
        pk, pv = codec.quantize(all_k, "k"), codec.quantize(all_v, "v")
        assert torch.equal(cache.k_codes[:, :, :total], pk.codes) and torch.equal(cache.k_scales[:, :, :total], pk.scales)
        assert torch.equal(cache.v_codes[:, :, :total], pv.codes) and torch.equal(cache.v_scales[:, :, :total], pv.scales)
        assert bool((cache.k_codes[:, :, total:] == 0).all())
        expected_pos = torch.where(torch.arange(cap) < total, torch.arange(cap), -1)
        assert torch.equal(cache.slot_positions(), expected_pos.expand(b, cap))
    k_hat, v_hat = cache.dequantize()
    assert torch.equal(k_hat[:, :, :total], codec.dequantize(pk, "k")) and torch.equal(v_hat[:, :, :total], codec.dequantize(pv, "v"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_append_accepts_each_input_dtype(dtype, gen):
    codec = ta.KVCodec(128, 4, 4)
    cache = ta.QuantizedKVCache(codec, batch_size=1, num_kv_heads=2, capacity=8)
    k, v = kv(gen, 1, 2, 3, 128, dtype)
    cache.append(k, v)
    for t in range(3):
        assert_slot_holds(cache, 0, t, k[0, :, t].float(), v[0, :, t].float())


def test_ragged_appends(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = ta.QuantizedKVCache(codec, batch_size=3, num_kv_heads=2, capacity=16)
    history = [[] for _ in range(3)]
    for new in ([3, 0, 5], [5, 2, 0], [1, 1, 1], torch.tensor([0, 5, 2])):
        k, v = kv(gen, 3, 2, 5, 64)
        cache.append(k, v, new_lengths=new)
        for b, n in enumerate(list(map(int, new))):
            history[b] += [(k[b, :, t], v[b, :, t]) for t in range(n)]  # the first n are real
    assert cache.lengths.tolist() == [len(h) for h in history] == [9, 8, 8]
    for b, h in enumerate(history):
        for slot, (k_t, v_t) in enumerate(h):
            assert_slot_holds(cache, b, slot, k_t, v_t)
        assert cache.slot_positions()[b].tolist() == list(range(len(h))) + [-1] * (16 - len(h))
        assert bool((cache.k_codes[b, :, len(h):] == 0).all())  # padding tokens were not written


@pytest.mark.parametrize("window", [1, 5])
def test_ring_holds_the_last_w_tokens_in_order(window, gen):
    codec = ta.KVCodec(64, 3, 2)
    b, hkv = 2, 2
    cache = ta.QuantizedKVCache(codec, batch_size=b, num_kv_heads=hkv, sliding_window=window)
    assert cache.capacity == window and cache.is_ring
    history = [[] for _ in range(b)]
    for t, new in ((1, None), (3, [3, 2]), (7, None), (2, [0, 2]), (5, [5, 1]), (11, [11, 9]), (1, None)):
        k, v = kv(gen, b, hkv, t, 64)
        cache.append(k, v, new_lengths=new)
        for s in range(b):
            n = t if new is None else new[s]
            history[s] += [(k[s, :, i], v[s, :, i]) for i in range(n)]
        for s in range(b):
            seen = len(history[s])
            assert int(cache.seen[s]) == seen and int(cache.lengths[s]) == min(seen, window)
            pos = cache.slot_positions()[s]
            held = sorted(p for p in pos.tolist() if p >= 0)
            assert held == list(range(max(0, seen - window), seen))  # the last W, no gaps
            for slot, p in enumerate(pos.tolist()):
                if p >= 0:
                    assert slot == p % window
                    assert_slot_holds(cache, s, slot, *history[s][p])
    assert max(len(h) for h in history) >= 4 * window  # several wrap-arounds happened


def test_left_padding_marks_positions(gen):
    cache = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=2, num_kv_heads=1, capacity=8)
    cache.set_left_padding([3, 0])
    cache.append(*kv(gen, 2, 1, 5, 64))
    assert cache.slot_positions().tolist() == [[-1, -1, -1, 3, 4, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1, -1]]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0] and bool((cache.slot_positions() == -1).all())
    cache.append(*kv(gen, 2, 1, 2, 64))
    assert cache.slot_positions()[0].tolist()[:2] == [0, 1]  # reset also clears the padding


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("k_bits,v_bits", [(8, 8), (5, 4), (4, 4), (3, 2), (2, 2)])
@pytest.mark.parametrize("window", [None, 7])
def test_nbytes(d, k_bits, v_bits, window):
    codec = ta.KVCodec(d, k_bits, v_bits)
    cache = ta.QuantizedKVCache(codec, batch_size=3, num_kv_heads=2, capacity=None if window else 40,
                                sliding_window=window)
    slots = window or 40
    assert cache.nbytes == 3 * 2 * slots * codec.bytes_per_token()
    assert cache.nbytes == 3 * 2 * slots * (d * (k_bits + v_bits) // 8 + 8 * max(1, d // 256))
    # Compared with bf16 K and V:
    assert 3 * 2 * slots * 2 * 2 * d / cache.nbytes == pytest.approx(32 / (k_bits + v_bits + 64 / min(d, 256)))


def test_device_names_are_normalized(gen):
    # "cpu:0" names the same device as tensors created on the CPU ("cpu"); likewise "cuda" vs "cuda:0".
    cache = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=1, num_kv_heads=1, capacity=4, device="cpu:0")
    k, v = kv(gen, 1, 1, 2, 64)
    cache.append(k, v)
    out = ta.cached_attention(torch.randn(1, 2, 1, 64, generator=gen), cache)
    assert out.shape == (1, 2, 1, 64) and cache.device == k.device


def test_repr_names_the_format():
    cache = ta.QuantizedKVCache(ta.KVCodec(128, 5, 4), batch_size=2, num_kv_heads=4, sliding_window=16)
    assert "ring W=16" in repr(cache) and "k5v4" in repr(cache) and "D=128" in repr(cache)
