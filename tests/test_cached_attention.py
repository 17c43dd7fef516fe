"""cached_attention (PyTorch path) against float64 attention over the tokens the cache holds.

The truth for a cached token is the codec's float64 decoding of its own coding
(the cache codes each token independently); fresh k, v enter exactly.  The path
under test decodes in float32, which the tolerance accounts for.
"""

from __future__ import annotations

import math

import pytest
import torch
from naive import UNIT_ROUNDOFF, float32_attention_tolerance, naive_attention

import turboattn as ta
from turboattn.format import rotation

U32 = UNIT_ROUNDOFF[torch.float32]


def decoded(codec, x, kind):
    """float64 decoding of the codec's coding of x (what a cache slot holding x stands for)."""
    return codec.dequantize(codec.quantize(x, kind), kind, torch.float64)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def tolerance(codec, q, k, v, scale=None, softcap=None):
    """float32 attention bound, plus the float32 decoding's rounding (log2 D + 2 roundings per rotation;
    log2 P + m + 2 for D = P * m, m > 1 odd: the m-term Hartley sums)."""
    d = codec.head_dim
    m = rotation.odd_factor(d)
    roundings = math.log2(d) + 2 if m == 1 else math.log2(d // m) + m + 2
    return float32_attention_tolerance(q, k, v, scale, extra_logit=softcap or 0.0,
                                       kv_rel_error=2 * roundings * U32)


def assert_close_to(out, ref, tol):
    err = float((out.double() - ref).abs().max())
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("options", [{}, {"scale": 0.2}, {"softcap": 5.0}, {"sinks": True}])
@pytest.mark.parametrize("d", [64, 256, 80, 96, 480])
def test_fresh_kv_equals_exact_attention_over_the_concatenation(options, d, gen):
    codec = ta.KVCodec(d, 4, 3)
    b, hq, hkv, tq = 2, 4, 2, 3
    cache = ta.QuantizedKVCache(codec, batch_size=b, num_kv_heads=hkv, capacity=32)
    lengths = [5, 11]
    k_hist, v_hist = randn(gen, b, hkv, 11, d), randn(gen, b, hkv, 11, d)
    cache.append(k_hist, v_hist, new_lengths=lengths)
    q, k, v = randn(gen, b, hq, tq, d), randn(gen, b, hkv, tq, d), randn(gen, b, hkv, tq, d)
    kw = dict(options)
    if kw.pop("sinks", False):
        kw["sinks"] = randn(gen, hq)
    out = ta.cached_attention(q, cache, k=k, v=v, backend="torch", **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    for s in range(b):
        n = lengths[s]
        keys = torch.cat([decoded(codec, k_hist[s:s + 1, :, :n], "k"), k[s:s + 1].double()], 2)
        vals = torch.cat([decoded(codec, v_hist[s:s + 1, :, :n], "v"), v[s:s + 1].double()], 2)
        # Bottom-right causal over [cache, fresh]: every cached token visible, fresh ones causal.
        ref, _ = naive_attention(q[s:s + 1], keys, vals, causal=True, **kw)
        assert_close_to(out[s:s + 1], ref, tolerance(codec, q[s:s + 1], keys, vals, kw.get("scale"), kw.get("softcap")))


def test_empty_cache_with_fresh_kv_is_dense_causal_attention(gen):
    cache = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=1, num_kv_heads=1, capacity=4)
    q, k, v = randn(gen, 1, 2, 6, 64), randn(gen, 1, 1, 6, 64), randn(gen, 1, 1, 6, 64)
    out = ta.cached_attention(q, cache, k=k, v=v)
    ref, _ = naive_attention(q, k, v, causal=True)
    assert_close_to(out, ref, float32_attention_tolerance(q, k, v))


def test_queries_without_fresh_kv_end_at_the_last_cached_token(gen):
    codec = ta.KVCodec(128, 5, 4)
    cache = ta.QuantizedKVCache(codec, batch_size=1, num_kv_heads=2, capacity=16)
    k_hist, v_hist = randn(gen, 1, 2, 9, 128), randn(gen, 1, 2, 9, 128)
    cache.append(k_hist, v_hist)
    q = randn(gen, 1, 4, 3, 128)
    out = ta.cached_attention(q, cache)
    keys, vals = decoded(codec, k_hist, "k"), decoded(codec, v_hist, "v")
    ref, _ = naive_attention(q, keys, vals, causal=True)  # queries at positions 6, 7, 8
    assert_close_to(out, ref, tolerance(codec, q, keys, vals))


@pytest.mark.parametrize("window", [1, 6])
@pytest.mark.parametrize("d", [64, 96])
def test_ring_equals_attention_over_the_last_w_tokens_at_every_step(window, d, gen):
    """Chunks of varied T (some > W) wrap the ring several times.  At each step: the chunk's queries
    with the chunk as fresh k/v equal causal sliding-window attention over the whole history; after
    appending, a decode query equals plain attention over the last W tokens."""
    codec = ta.KVCodec(d, 4, 4)
    b, hq, hkv = 2, 2, 1
    ring = ta.QuantizedKVCache(codec, batch_size=b, num_kv_heads=hkv, sliding_window=window)
    hist_k = torch.zeros(b, hkv, 0, d, dtype=torch.float64)
    hist_v = torch.zeros_like(hist_k)
    for t in (1, 2, 7, 1, 3, 9, 1, 1, 4, 6):
        q, k, v = randn(gen, b, hq, t, d), randn(gen, b, hkv, t, d), randn(gen, b, hkv, t, d)
        out = ta.cached_attention(q, ring, k=k, v=v)
        keys, vals = torch.cat([hist_k, k.double()], 2), torch.cat([hist_v, v.double()], 2)
        ref, _ = naive_attention(q, keys, vals, causal=True, sliding_window=window)
        assert_close_to(out, ref, tolerance(codec, q, keys, vals))

        ring.append(k, v)
        hist_k = torch.cat([hist_k, decoded(codec, k, "k")], 2)
        hist_v = torch.cat([hist_v, decoded(codec, v, "v")], 2)
        q1 = randn(gen, b, hq, 1, d)
        out1 = ta.cached_attention(q1, ring)
        last_k, last_v = hist_k[:, :, -window:], hist_v[:, :, -window:]
        ref1, _ = naive_attention(q1, last_k, last_v)
        assert_close_to(out1, ref1, tolerance(codec, q1, last_k, last_v))
    assert hist_k.shape[2] >= 4 * window


def test_ragged_sequences_attend_to_their_own_tokens(gen):
    codec = ta.KVCodec(64, 4, 4)
    b, hkv = 3, 2
    cache = ta.QuantizedKVCache(codec, batch_size=b, num_kv_heads=hkv, capacity=24)
    held = [[] for _ in range(b)]
    for new in ([4, 1, 0], [2, 6, 3], [6, 0, 1]):
        k, v = randn(gen, b, hkv, 6, 64), randn(gen, b, hkv, 6, 64)
        cache.append(k, v, new_lengths=new)
        for s, n in enumerate(new):
            held[s].append((k[s:s + 1, :, :n], v[s:s + 1, :, :n]))
    q = randn(gen, b, 4, 1, 64)
    out = ta.cached_attention(q, cache)
    for s in range(b):
        keys = decoded(codec, torch.cat([x for x, _ in held[s]], 2), "k")
        vals = decoded(codec, torch.cat([y for _, y in held[s]], 2), "v")
        ref, _ = naive_attention(q[s:s + 1], keys, vals)
        assert_close_to(out[s:s + 1], ref, tolerance(codec, q[s:s + 1], keys, vals))


def test_left_padding_in_the_cache_and_in_the_fresh_chunk(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = ta.QuantizedKVCache(codec, batch_size=2, num_kv_heads=1, capacity=16)
    cache.set_left_padding([3, 0])
    # Prefill: the prompt (3 padding tokens first in sequence 0) arrives as fresh k/v.
    q, k, v = randn(gen, 2, 2, 5, 64), randn(gen, 2, 1, 5, 64), randn(gen, 2, 1, 5, 64)
    out = ta.cached_attention(q, cache, k=k, v=v)
    k_pos = torch.tensor([[-1, -1, -1, 3, 4], [0, 1, 2, 3, 4]])
    ref, _ = naive_attention(q, k, v, causal=True, k_positions=k_pos)
    assert_close_to(out, ref, float32_attention_tolerance(q, k, v))
    assert torch.equal(out[0, :, :3], torch.zeros(2, 3, 64))  # padding queries see nothing
    # Decode: the padding is in the cache now.
    cache.append(k, v)
    q1, k1, v1 = randn(gen, 2, 2, 1, 64), randn(gen, 2, 1, 1, 64), randn(gen, 2, 1, 1, 64)
    out1 = ta.cached_attention(q1, cache, k=k1, v=v1)
    keys = torch.cat([decoded(codec, k, "k"), k1.double()], 2)
    vals = torch.cat([decoded(codec, v, "v"), v1.double()], 2)
    ref1, _ = naive_attention(q1, keys, vals, causal=True, k_positions=torch.tensor([[-1, -1, -1, 3, 4, 5], [0, 1, 2, 3, 4, 5]]))
    assert_close_to(out1, ref1, tolerance(codec, q1, keys, vals))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_queries_within_their_rounding(dtype, gen):
    """Exact attention on the rounded inputs, then one rounding of the output to q.dtype."""
    codec = ta.KVCodec(128, 4, 4)
    cache = ta.QuantizedKVCache(codec, batch_size=1, num_kv_heads=2, capacity=8)
    k_hist, v_hist = randn(gen, 1, 2, 6, 128, dtype=dtype), randn(gen, 1, 2, 6, 128, dtype=dtype)
    cache.append(k_hist, v_hist)
    q, k, v = (randn(gen, 1, h, 2, 128, dtype=dtype) for h in (4, 2, 2))
    out = ta.cached_attention(q, cache, k=k, v=v)
    assert out.dtype == dtype
    keys = torch.cat([decoded(codec, k_hist.float(), "k"), k.double()], 2)
    vals = torch.cat([decoded(codec, v_hist.float(), "v"), v.double()], 2)
    ref, _ = naive_attention(q, keys, vals, causal=True)
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + tolerance(codec, q, keys, vals) * (1 + UNIT_ROUNDOFF[dtype])
    assert bool(((out.double() - ref).abs() <= bound).all())


def test_attention_does_not_modify_the_cache(gen):
    cache = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=1, num_kv_heads=1, capacity=8)
    cache.append(randn(gen, 1, 1, 3, 64), randn(gen, 1, 1, 3, 64))
    before = [t.clone() for t in (cache.k_codes, cache.v_codes, cache.k_scales, cache.v_scales, cache.seen)]
    ta.cached_attention(randn(gen, 1, 2, 2, 64), cache, k=randn(gen, 1, 1, 2, 64), v=randn(gen, 1, 1, 2, 64))
    after = (cache.k_codes, cache.v_codes, cache.k_scales, cache.v_scales, cache.seen)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
