"""Triton compressed-cache kernels (under TRITON_INTERPRET=1 on CPU) vs their PyTorch twins."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import turboattn as ta
from turboattn.ops.cached.naive import cached_attention_naive

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 (set by `make test`) or a GPU")

# The kernels take float16 dot operands (rotated q, softmax weights, centroids):
# each rounding is at most 2^-11 relative; a handful of them add up.
FP16_TOL = 4 * 2.0**-11
BITS = (2, 3, 4, 5, 6, 8)
# Shrinking re-runs interpreted kernels hundreds of times; the failing example is printed either way.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _filled_cache(gen, codec, b, hkv, chunks, window=None, capacity=None, pad=None):
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=capacity, sliding_window=window)
    for t in chunks:
        k = torch.randn(b, hkv, t, codec.head_dim, generator=gen) * 2
        cache.append(k, torch.randn(b, hkv, t, codec.head_dim, generator=gen), backend="torch")
    if pad is not None:
        cache.set_left_padding(pad)
    return cache


@settings(max_examples=12, phases=NO_SHRINK)
@given(d=st.sampled_from([64, 128]), k_bits=st.sampled_from(BITS), v_bits=st.sampled_from(BITS),
       group=st.integers(1, 8), tq=st.integers(1, 5), fresh=st.booleans(), window=st.sampled_from([None, 5, 16]),
       softcap=st.sampled_from([None, 20.0]), sinks=st.booleans(), splits=st.sampled_from([None, 1, 3]),
       seed=st.integers(0, 2**31))
def test_cached_attention_kernel_matches_reference(d, k_bits, v_bits, group, tq, fresh, window, softcap, sinks,
                                                  splits, seed):
    # Chunk sizes straddle the 64-key block and, for rings, wrap around several times.
    _check_random_call(seed, d, k_bits, v_bits, group, tq, fresh, window, softcap, sinks, splits, (37, 30))


def _check_random_call(seed, d, k_bits, v_bits, group, tq, fresh, window, softcap, sinks, splits, chunks):
    """The Triton kernel against the float64 reference on a cache filled with `chunks` random tokens (B = 2,
    Hkv = 2, left padding [0, 3]) and random q, fresh k/v and sinks."""
    gen = torch.Generator().manual_seed(seed)
    codec = ta.KVCodec(d, k_bits, v_bits)
    b, hkv = 2, 2
    cache = _filled_cache(gen, codec, b, hkv, chunks, window=window,
                          capacity=None if window else sum(chunks) + tq, pad=[0, 3])
    q = torch.randn(b, hkv * group, tq, d, generator=gen).half()
    kf = vf = None
    if fresh:
        kf = torch.randn(b, hkv, tq, d, generator=gen).half()
        vf = torch.randn(b, hkv, tq, d, generator=gen).half()
    sink = torch.randn(hkv * group, generator=gen) if sinks else None
    out = ta.cached_attention(q, cache, kf, vf, softcap=softcap, sinks=sink, backend="triton", num_splits=splits)
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, softcap=softcap, sinks=sink,
                                 compute_dtype=torch.float64)
    assert out.dtype == q.dtype and out.shape == q.shape
    # fp16 output adds one more rounding.
    assert _rel(out, ref) < FP16_TOL + 2.0**-11


@pytest.mark.parametrize("d", [256, 512])
def test_cached_attention_kernel_large_head_dims(gen, d):
    codec = ta.KVCodec(d, 4, 5)
    cache = _filled_cache(gen, codec, 1, 2, (70,), capacity=80)
    q = torch.randn(1, 4, 2, d, generator=gen).half()
    kf = torch.randn(1, 2, 2, d, generator=gen).half()
    vf = torch.randn(1, 2, 2, d, generator=gen).half()
    out = ta.cached_attention(q, cache, kf, vf, backend="triton")
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    assert _rel(out, ref) < FP16_TOL + 2.0**-11


# Head dims that are not powers of two (D = P * m, m odd: the padded layout, the Hartley factor in the rotation).
OTHER_HEAD_DIMS = (48, 80, 96, 160)


@settings(max_examples=12, phases=NO_SHRINK)
@given(d=st.sampled_from(OTHER_HEAD_DIMS), k_bits=st.sampled_from(BITS), v_bits=st.sampled_from(BITS),
       group=st.integers(1, 4), tq=st.integers(1, 3), fresh=st.booleans(), window=st.sampled_from([None, 5, 16]),
       softcap=st.sampled_from([None, 20.0]), sinks=st.booleans(), splits=st.sampled_from([None, 1, 3]),
       seed=st.integers(0, 2**31))
def test_cached_attention_kernel_matches_reference_at_other_head_dims(d, k_bits, v_bits, group, tq, fresh, window,
                                                                      softcap, sinks, splits, seed):
    """As test_cached_attention_kernel_matches_reference, at head dims that are not powers of two (GQA groups,
    rings that wrap, fresh k/v, left padding), with fewer tokens: the same tolerance."""
    _check_random_call(seed, d, k_bits, v_bits, group, tq, fresh, window, softcap, sinks, splits, (13, 11))


@pytest.mark.parametrize("d", [32, 320, 384, 496])
def test_cached_attention_kernel_smallest_and_large_other_head_dims(gen, d):
    """D = 32 (the smallest power of two); above 256 two norm blocks of D / 2 and q, fresh k/v rotated on the
    host like D = 512 (320 = 64 * 5, 384 = 128 * 3, 496 = 16 * 31: the largest Hartley factor)."""
    codec = ta.KVCodec(d, 4, 5)
    cache = _filled_cache(gen, codec, 1, 2, (21,), capacity=24)
    q = torch.randn(1, 4, 2, d, generator=gen).half()
    kf = torch.randn(1, 2, 2, d, generator=gen).half()
    vf = torch.randn(1, 2, 2, d, generator=gen).half()
    out = ta.cached_attention(q, cache, kf, vf, backend="triton", num_splits=2)
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    assert _rel(out, ref) < FP16_TOL + 2.0**-11


def test_cached_attention_kernel_key_transform_at_other_head_dims(gen):
    """A shifted key transform (q / gain against (k - shift) * gain, fresh keys transformed in the kernel) at
    D = 80, where its vectors are read through the padded layout's map."""
    d = 80
    codec = ta.KVCodec(d, 4, 3)
    cache = ta.QuantizedKVCache(codec, 2, 2, capacity=30)
    shift = torch.randn(2, 2, d, generator=gen) * 3
    cache.set_key_transform(shift, torch.rand(2, 2, d, generator=gen) + 0.5)
    cache.append(shift[:, :, None] + torch.randn(2, 2, 17, d, generator=gen), torch.randn(2, 2, 17, d, generator=gen),
                 backend="torch")
    q = torch.randn(2, 6, 2, d, generator=gen).half()
    kf = (shift[:, :, None] + torch.randn(2, 2, 2, d, generator=gen)).half()
    vf = torch.randn(2, 2, 2, d, generator=gen).half()
    out = ta.cached_attention(q, cache, kf, vf, backend="triton")
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    assert _rel(out, ref) < FP16_TOL + 2.0**-11


def test_fully_masked_rows_give_zeros_and_sinks_alone(gen):
    """Sequence 1 is all left padding: its rows see nothing, so out = 0 (also with a sink)."""
    codec = ta.KVCodec(64, 4, 4)
    cache = _filled_cache(gen, codec, 2, 1, (10,), capacity=16, pad=[0, 10])
    q = torch.randn(2, 2, 1, 64, generator=gen).half()
    for sinks in (None, torch.randn(2, generator=gen)):
        out = ta.cached_attention(q, cache, sinks=sinks, backend="triton")
        assert torch.isfinite(out).all()
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = cached_attention_naive(q, cache.layout, cache.codec, sinks=sinks, compute_dtype=torch.float64)
        assert _rel(out[0], ref[0]) < FP16_TOL + 2.0**-11


def test_decode_of_length_one_cache(gen):
    codec = ta.KVCodec(64, 8, 8)
    cache = _filled_cache(gen, codec, 1, 1, (1,), capacity=4)
    q = torch.randn(1, 3, 1, 64, generator=gen).half()
    out = ta.cached_attention(q, cache, backend="triton")
    k, v = cache.dequantize(torch.float64)
    # One visible key: the output is exactly its value.
    assert _rel(out[0, :, 0], v[0, 0, 0].expand(3, -1)) < 2 * 2.0**-11


def test_cache_is_not_modified(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = _filled_cache(gen, codec, 1, 1, (9,), capacity=16)
    before = [t.clone() for t in (cache.k_codes, cache.v_codes, cache.k_scales, cache.v_scales, cache.seen)]
    q = torch.randn(1, 2, 2, 64, generator=gen).half()
    kf = torch.randn(1, 1, 2, 64, generator=gen).half()
    ta.cached_attention(q, cache, kf, kf.clone(), backend="triton")
    after = (cache.k_codes, cache.v_codes, cache.k_scales, cache.v_scales, cache.seen)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_head_dim_512_keeps_the_query_dtype(gen):
    """D = 512 rotates q on the host into float16; the output must still come back in q's dtype."""
    codec = ta.KVCodec(512, 4, 4)
    cache = _filled_cache(gen, codec, 1, 1, (20,), capacity=24)
    q = torch.randn(1, 2, 1, 512, generator=gen).to(torch.bfloat16)
    out = ta.cached_attention(q, cache, backend="triton")
    assert out.dtype == torch.bfloat16
    ref = cached_attention_naive(q.float(), cache.layout, cache.codec, compute_dtype=torch.float64)  # float32 out: no rounding
    # One bf16 rounding of the output on top of the fp16 operand error. The interpreter casts
    # float32 -> bf16 by truncation (up to one ulp, 2^-7 relative), the GPU rounds to nearest.
    assert _rel(out, ref) < FP16_TOL + 2.0**-7
