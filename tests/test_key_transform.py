"""The key transform: its fit, how the cache stores keys with it, and attention's invariance to it."""

from __future__ import annotations

import os

import pytest
import torch

import turboattn as ta
from turboattn.ops.cached.naive import cached_attention_naive
from turboattn.format.key_transform import MIN_FIT_TOKENS, fit_key_transform
from turboattn.ops.flash.naive import attention_reference

needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 (set by `make test`) or a GPU")
# Kernel operands are float16 (see test_kernels_cached.py), plus the roundings of q / gain and of
# the transformed fresh keys.
FP16_TOL = 6 * 2.0**-11


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _offset_keys(gen, b, hkv, t, d):
    """Keys with a large shared offset and unequal channels, as real models have."""
    offset = torch.randn(b, hkv, 1, d, generator=gen) * 4
    spread = torch.linspace(0.2, 3.0, d)
    return offset + torch.randn(b, hkv, t, d, generator=gen) * spread


def test_fit_matches_its_definition(gen):
    """shift = mean key; gain_c proportional to (E[q_c^2] / Var[k_c])^(1/4), geometric mean 1."""
    b, hkv, g, t, d = 2, 2, 3, 40, 64
    q = torch.randn(b, hkv * g, t, d, generator=gen) * torch.linspace(0.5, 2.0, d)
    k = _offset_keys(gen, b, hkv, t, d)
    shift, gain = fit_key_transform(q, k)
    kd, qd = k.double(), q.double().reshape(b, hkv, g * t, d)
    torch.testing.assert_close(shift.double(), kd.mean(2), rtol=1e-6, atol=1e-6)
    want = (qd.pow(2).mean(2) / kd.var(2, unbiased=False)).pow(0.25)
    want = want / want.log().mean(-1, keepdim=True).exp()
    torch.testing.assert_close(gain.double(), want, rtol=1e-5, atol=0)
    assert shift.dtype == gain.dtype == torch.float32


def test_fit_ignores_padding_and_short_sequences(gen):
    """Padded tokens do not count; a sequence with too few real tokens gets the identity."""
    d, t = 64, 30
    q, k = torch.randn(2, 2, t, d, generator=gen), _offset_keys(gen, 2, 1, t, d)
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[0, :7] = False                           # 23 real tokens: fitted on those alone
    valid[1, :t - MIN_FIT_TOKENS + 1] = False      # one token short of the minimum
    shift, gain = fit_key_transform(q, k, valid)
    alone_shift, alone_gain = fit_key_transform(q[:1, :, 7:], k[:1, :, 7:])
    torch.testing.assert_close(shift[0], alone_shift[0])
    torch.testing.assert_close(gain[0], alone_gain[0])
    assert torch.equal(shift[1], torch.zeros_like(shift[1])) and torch.equal(gain[1], torch.ones_like(gain[1]))


def test_float32_fit_of_a_long_prompt_matches_float64(gen):
    """The fit runs in float32 (what a GPU prefill feeds it): over a long prompt with a large common key offset,
    its shift and gain agree with a float64 fit to within a tree reduction's error, c * log2(T) * eps32 with
    c = 4 (each reduction, the mean subtraction, the square and the quarter power add rounding)."""
    b, hkv, g, t, d = 1, 1, 2, 16384, 64
    q = torch.randn(b, hkv * g, t, d, generator=gen) * torch.linspace(0.5, 2.0, d)
    k = _offset_keys(gen, b, hkv, t, d) + 40.0   # an offset ten times the spread: cancellation would show
    tol = 4 * torch.finfo(torch.float32).eps * (t.bit_length())
    shift32, gain32 = fit_key_transform(q, k)
    shift64, gain64 = fit_key_transform(q.double(), k.double())
    torch.testing.assert_close(shift32.double(), shift64.double(), rtol=tol, atol=0)
    torch.testing.assert_close(gain32.double(), gain64.double(), rtol=tol, atol=0)
    # center only: no query pass, gain exactly 1
    shift_c, gain_c = fit_key_transform(q, k, balance=False)
    assert torch.equal(gain_c, torch.ones_like(gain_c)) and torch.equal(shift_c, shift32)


def test_fit_without_center_and_with_dead_channels(gen):
    d = 64
    q, k = torch.randn(1, 1, 32, d, generator=gen), _offset_keys(gen, 1, 1, 32, d)
    k[..., 5] = 1.5       # a channel that never varies: gain must stay finite
    q[..., 9] = 0.0       # a channel no query uses
    shift, gain = fit_key_transform(q, k, center=False)
    assert torch.equal(shift, torch.zeros_like(shift))
    assert torch.isfinite(gain).all() and (gain > 0).all()


def test_cache_stores_transformed_keys_and_reads_them_back(gen):
    """The stored codes are the codec's coding of (k - shift) * gain; dequantize returns the model's domain."""
    codec = ta.KVCodec(64, 4, 4)
    cache = ta.QuantizedKVCache(codec, 1, 2, capacity=8)
    k, v = _offset_keys(gen, 1, 2, 5, 64), torch.randn(1, 2, 5, 64, generator=gen)
    shift = torch.randn(1, 2, 64, generator=gen)
    gain = torch.rand(1, 2, 64, generator=gen) + 0.5
    cache.set_key_transform(shift, gain)
    cache.append(k, v)
    stored = codec.quantize((k - shift[:, :, None]) * gain[:, :, None], "k")
    assert torch.equal(cache.k_codes[:, :, :5], stored.codes)
    k_hat, v_hat = cache.dequantize(torch.float64)
    want = codec.dequantize(stored, "k", torch.float64) / gain[:, :, None].double() + shift[:, :, None].double()
    torch.testing.assert_close(k_hat[:, :, :5], want)
    torch.testing.assert_close(cache.round_trip(k, v)[0].double(), want, rtol=0, atol=1e-5)
    assert "key transform" in repr(cache)
    assert cache.nbytes == 2 * 8 * codec.bytes_per_token() + 3 * shift.numel() * 4  # shift, gain, 1/gain
    cache.reset()
    assert cache.key_gain is None and cache.key_shift is None


def test_set_key_transform_validates(gen):
    cache = ta.QuantizedKVCache(ta.KVCodec(64), 1, 2, capacity=4)
    ones = torch.ones(1, 2, 64)
    with pytest.raises(ValueError, match="shape"):
        cache.set_key_transform(torch.zeros(1, 64), ones)
    with pytest.raises(ValueError, match="positive"):
        cache.set_key_transform(torch.zeros(1, 2, 64), -ones)
    with pytest.raises(ValueError, match="finite"):
        cache.set_key_transform(torch.full((1, 2, 64), float("nan")), ones)
    with pytest.raises(TypeError):
        cache.set_key_transform(None, ones)
    cache.append(*(torch.randn(1, 2, 1, 64, generator=gen) for _ in range(2)))
    with pytest.raises(ValueError, match="empty cache"):
        cache.set_key_transform(torch.zeros(1, 2, 64), ones)


def _cache_with_transform(gen, codec, center, window=None):
    b, hkv, t = 2, 2, 45
    q_fit = torch.randn(b, 4, t, codec.head_dim, generator=gen)
    k, v = _offset_keys(gen, b, hkv, t, codec.head_dim), torch.randn(b, hkv, t, codec.head_dim, generator=gen)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else 64, sliding_window=window)
    cache.set_key_transform(*fit_key_transform(q_fit, k, center=center))
    cache.append(k, v, backend="torch")
    cache.set_left_padding([0, 3])
    return cache


@needs_triton
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("fresh", [False, True])
def test_kernel_with_key_transform_matches_reference(gen, window, fresh):
    """The kernel scores in the stored domain (q / gain against centered keys): same softmax as the reference."""
    codec = ta.KVCodec(64, 4, 3)
    cache = _cache_with_transform(gen, codec, center=True, window=window)
    assert cache.has_key_shift
    q = torch.randn(2, 4, 3, 64, generator=gen).half()
    kf = vf = None
    if fresh:
        kf, vf = _offset_keys(gen, 2, 2, 3, 64).half(), torch.randn(2, 2, 3, 64, generator=gen).half()
    out = ta.cached_attention(q, cache, kf, vf, backend="triton")
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    assert _rel(out, ref) < FP16_TOL


@needs_triton
def test_gain_only_transform_serves_softcap_and_sinks(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache_with_transform(gen, codec, center=False)
    assert not cache.has_key_shift
    q = torch.randn(2, 4, 1, 64, generator=gen).half()
    sinks = torch.randn(4, generator=gen)
    out = ta.cached_attention(q, cache, softcap=5.0, sinks=sinks, backend="triton")
    ref = cached_attention_naive(q, cache.layout, cache.codec, softcap=5.0, sinks=sinks, compute_dtype=torch.float64)
    assert _rel(out, ref) < FP16_TOL


@pytest.mark.parametrize("option", ["softcap", "sinks"])
def test_centered_cache_refuses_softcap_and_sinks(gen, option):
    cache = _cache_with_transform(gen, ta.KVCodec(64, 4, 4), center=True)
    q = torch.randn(2, 4, 1, 64, generator=gen)
    kwargs = {"softcap": 5.0} if option == "softcap" else {"sinks": torch.zeros(4)}
    with pytest.raises(ValueError, match="center=False"):
        ta.cached_attention(q, cache, backend="torch", **kwargs)


def test_transform_changes_nothing_but_the_coding_error(gen):
    """The transform only changes what is quantized: on keys with a shared offset it cuts the attention
    error against the exact result (float64, every query of a causal prompt) at 4 and at 8 bits.
    The centered keys' norm is about half the raw one here, and the error follows it (observed
    ratios 0.38-0.58 over 40 seeds)."""
    b, hkv, t, d = 1, 2, 48, 64
    q = torch.randn(b, 4, t, d, generator=gen) * torch.linspace(0.3, 3, d)
    k, v = _offset_keys(gen, b, hkv, t, d), torch.randn(b, hkv, t, d, generator=gen)
    exact = attention_reference(q.double(), k.double(), v.double(), causal=True)
    errors = {}
    for fit in (False, True):
        for bits in (8, 4):
            cache = ta.QuantizedKVCache(ta.KVCodec(d, bits, 8), b, hkv, capacity=t)
            if fit:
                cache.set_key_transform(*fit_key_transform(q, k))
            cache.append(k, v)
            errors[fit, bits] = _rel(ta.cached_attention(q, cache, backend="torch"), exact)
    assert errors[True, 8] < 0.75 * errors[False, 8], errors
    assert errors[True, 4] < 0.75 * errors[False, 4], errors


@needs_triton
def test_head_dim_512_applies_the_transform_on_the_host(gen):
    """D = 512 rotates q and fresh keys on the host, so the transform is applied there too."""
    d = 512
    codec = ta.KVCodec(d, 4, 4)
    cache = ta.QuantizedKVCache(codec, 1, 1, capacity=24)
    k = _offset_keys(gen, 1, 1, 20, d)
    cache.set_key_transform(*fit_key_transform(torch.randn(1, 2, 20, d, generator=gen), k))
    cache.append(k, torch.randn(1, 1, 20, d, generator=gen), backend="torch")
    q = torch.randn(1, 2, 1, d, generator=gen).half()
    kf, vf = _offset_keys(gen, 1, 1, 1, d).half(), torch.randn(1, 1, 1, d, generator=gen).half()
    out = ta.cached_attention(q, cache, kf, vf, backend="triton")
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    assert _rel(out, ref) < FP16_TOL
