"""Fused quantize-and-append kernel (under TRITON_INTERPRET=1 on CPU) vs the reference codec."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import turboattn as ta

from quantize_checks import assert_same

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 (set by `make test`) or a GPU")

BITS = (2, 3, 4, 5, 6, 8)
# Shrinking re-runs interpreted kernels hundreds of times; the failing example is printed either way.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
STATE = ("k_codes", "v_codes", "k_scales", "v_scales")


def _pair(codec, b, hkv, **kw):
    return (ta.QuantizedKVCache(codec, b, hkv, **kw), ta.QuantizedKVCache(codec, b, hkv, **kw))


@settings(max_examples=10, phases=NO_SHRINK)
@given(d=st.sampled_from([64, 128, 256]), k_bits=st.sampled_from(BITS), v_bits=st.sampled_from(BITS),
       rule=st.sampled_from(["rms", "corrected", "lsq"]), t=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 2**31))
def test_quantize_append_matches_codec(d, k_bits, v_bits, rule, t, dtype, seed):
    _check_matches_codec(d, k_bits, v_bits, rule, t, dtype, seed)


def _check_matches_codec(d, k_bits, v_bits, rule, t, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    codec = ta.KVCodec(d, k_bits, v_bits, rule)
    fused, ref = _pair(codec, 2, 2, capacity=t + 5)
    k = (torch.randn(2, 2, t, d, generator=gen) * 3).to(dtype)
    v = torch.randn(2, 2, t, d, generator=gen).to(dtype)
    k[0, 1, 0] = 0  # zero vector: scale 0
    fused.append(k, v, backend="triton")
    ref.append(k, v, backend="torch")
    assert_same(fused, ref, [(k, v)])


@settings(max_examples=10, phases=NO_SHRINK)
@given(d=st.sampled_from([32, 48, 80, 96, 160]), k_bits=st.sampled_from(BITS), v_bits=st.sampled_from(BITS),
       rule=st.sampled_from(["rms", "corrected", "lsq"]), t=st.integers(1, 20),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 2**31))
def test_quantize_append_matches_codec_at_other_head_dims(d, k_bits, v_bits, rule, t, dtype, seed):
    """Head dims that are not powers of two (the padded layout, the Hartley factor) and D = 32, fewer tokens."""
    _check_matches_codec(d, k_bits, v_bits, rule, t, dtype, seed)


@pytest.mark.parametrize("d", [80, 320])
def test_quantize_append_ring_wraps_at_other_head_dims(gen, d):
    """A ring at D = 80 and at D = 320 (two norm blocks of 160 coordinates): wraps and a chunk longer than W."""
    codec = ta.KVCodec(d, 3, 6, "lsq")
    fused, ref = _pair(codec, 2, 1, sliding_window=6)
    inputs = []
    for t in (4, 9, 1):
        k = torch.randn(2, 1, t, d, generator=gen)
        v = torch.randn(2, 1, t, d, generator=gen)
        fused.append(k, v, backend="triton")
        ref.append(k, v, backend="torch")
        inputs.append((k, v))
        assert_same(fused, ref, inputs)


@pytest.mark.parametrize("d", [384, 496])
def test_quantize_append_large_other_head_dims(gen, d):
    codec = ta.KVCodec(d, 5, 4, "corrected")
    fused, ref = _pair(codec, 1, 1, capacity=8)
    k = torch.randn(1, 1, 5, d, generator=gen)
    v = torch.randn(1, 1, 5, d, generator=gen)
    fused.append(k, v, backend="triton")
    ref.append(k, v, backend="torch")
    assert_same(fused, ref, [(k, v)])


def test_quantize_append_ring_wraps_and_long_chunks(gen):
    codec = ta.KVCodec(64, 4, 3)
    fused, ref = _pair(codec, 2, 1, sliding_window=8)
    inputs = []
    for t in (5, 6, 19, 1, 3):  # wraps several times; 19 > W keeps only its last 8
        k = torch.randn(2, 1, t, 64, generator=gen)
        v = torch.randn(2, 1, t, 64, generator=gen)
        fused.append(k, v, backend="triton")
        ref.append(k, v, backend="torch")
        inputs.append((k, v))
        assert_same(fused, ref, inputs)


def test_quantize_append_ragged_lengths(gen):
    codec = ta.KVCodec(64, 8, 2)
    fused, ref = _pair(codec, 3, 2, capacity=30)
    inputs = []
    for t, lengths in ((7, [7, 2, 0]), (4, [1, 4, 3])):
        k = torch.randn(3, 2, t, 64, generator=gen)
        v = torch.randn(3, 2, t, 64, generator=gen)
        fused.append(k, v, new_lengths=lengths, backend="triton")
        ref.append(k, v, new_lengths=lengths, backend="torch")
        inputs.append((k, v))
    assert fused.seen.tolist() == [8, 6, 3]
    assert_same(fused, ref, inputs)


def test_quantize_append_head_dim_512(gen):
    codec = ta.KVCodec(512, 5, 4, "corrected")
    fused, ref = _pair(codec, 1, 1, capacity=20)
    k = torch.randn(1, 1, 17, 512, generator=gen)
    v = torch.randn(1, 1, 17, 512, generator=gen)
    fused.append(k, v, backend="triton")
    ref.append(k, v, backend="torch")
    assert_same(fused, ref, [(k, v)])


@pytest.mark.parametrize("d", [64, 512, 96, 288])
def test_quantize_append_applies_the_key_transform(gen, d):
    """The kernel codes (k - shift) * gain, like the reference path (D = 512 covers the two-block rows, 96 and 288
    the padded layout's map with one and two blocks)."""
    codec = ta.KVCodec(d, 4, 3)
    fused, ref = _pair(codec, 2, 2, sliding_window=12)
    shift = torch.randn(2, 2, d, generator=gen) * 3
    gain = torch.rand(2, 2, d, generator=gen) + 0.5
    for cache in (fused, ref):
        cache.set_key_transform(shift, gain)
    inputs = []
    for t in (9, 7):  # the second chunk wraps the ring
        k = shift[:, :, None] + torch.randn(2, 2, t, d, generator=gen)
        v = torch.randn(2, 2, t, d, generator=gen)
        fused.append(k, v, backend="triton")
        ref.append(k, v, backend="torch")
        inputs.append((ref.stored_keys(k), v))
    assert_same(fused, ref, inputs)


@pytest.mark.parametrize("d", [64, 512, 112])
@pytest.mark.parametrize("dtype,exponents", [(torch.float16, (-10, 12)), (torch.bfloat16, (-120, 120)),
                                             (torch.float32, (-140, -120, 100, 120))],
                         ids=["float16", "bfloat16", "float32"])
def test_quantize_append_is_magnitude_invariant(d, dtype, exponents, gen):
    """Like the codec (test_codec.test_magnitude_does_not_change_the_coding): x * 2^e, exactly
    representable, gets x's codes and scales * 2^e (one subnormal rounding at e = -140), so 1e30 and
    1e-30 neither overflow nor underflow the kernel's norms; and the kernel agrees with the reference."""
    codec = ta.KVCodec(d, 4, 3)
    x = (torch.randn(2, 2, 2, 5, d, generator=gen) * 16).round().clamp(-127, 127) / 16
    x[0, 1, 0, 2] = 0
    base = ta.QuantizedKVCache(codec, 2, 2, capacity=5)
    base.append(x[0].to(dtype), x[1].to(dtype), backend="triton")
    for e in exponents:
        k, v = (t.double() * 2.0**e for t in x)
        fused, ref = _pair(codec, 2, 2, capacity=5)
        fused.append(k.to(dtype), v.to(dtype), backend="triton")
        ref.append(k.to(dtype), v.to(dtype), backend="torch")
        assert_same(fused, ref, [(k, v)])
        for kind in ("k", "v"):
            assert torch.equal(getattr(fused, f"{kind}_codes"), getattr(base, f"{kind}_codes"))
            got, want = getattr(fused, f"{kind}_scales").double(), getattr(base, f"{kind}_scales").double() * 2.0**e
            assert torch.equal(got, want) if e >= -120 else float((got - want).abs().max()) <= 2.0**-150
