"""Reference attention (reference.py, and flash_attention's torch path) against tests/naive.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import UNIT_ROUNDOFF, float32_attention_tolerance, naive_attention

import turboattn as ta
from turboattn.ops.flash.naive import attention_reference

F64_TOL = dict(rtol=1e-10, atol=1e-12)


def rand(gen, *shape, dtype=torch.float64, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


@st.composite
def attention_cases(draw):
    hkv = draw(st.integers(1, 2))
    case = dict(
        b=draw(st.integers(1, 2)), hkv=hkv, hq=hkv * draw(st.sampled_from([1, 2, 3])),
        lq=draw(st.integers(1, 6)), lk=draw(st.integers(1, 9)), d=draw(st.sampled_from([8, 16, 64])),
        causal=draw(st.booleans()), window=draw(st.one_of(st.none(), st.integers(1, 6))),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 30))),
        mask=draw(st.sampled_from([None, "bool", "additive", "bool-rows"])),
        sinks=draw(st.booleans()), alibi=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        seed=draw(st.integers(0, 2**31)),
    )
    return case


def build(case, dtype=torch.float32):
    g = torch.Generator().manual_seed(case["seed"])
    b, hq, hkv, lq, lk, d = (case[k] for k in ("b", "hq", "hkv", "lq", "lk", "d"))
    q, k, v = rand(g, b, hq, lq, d, dtype=dtype), rand(g, b, hkv, lk, d, dtype=dtype), rand(g, b, hkv, lk, d, dtype=dtype)
    kw = dict(causal=case["causal"], sliding_window=case["window"], softcap=case["softcap"], scale=case["scale"])
    if case["mask"] == "bool":
        kw["mask"] = torch.rand(b, hq, lq, lk, generator=g) < 0.7
    elif case["mask"] == "bool-rows":  # broadcast over batch and heads, some rows fully hidden
        kw["mask"] = torch.rand(lq, lk, generator=g) < 0.4
    elif case["mask"] == "additive":
        m = torch.randn(b, 1, lq, lk, generator=g)
        kw["mask"] = torch.where(torch.rand(b, 1, lq, lk, generator=g) < 0.2, -math.inf, m)
    if case["sinks"]:
        kw["sinks"] = torch.randn(hq, generator=g)
    if case["alibi"]:
        kw["alibi_slopes"] = torch.rand(hq, generator=g) * 0.5
    return q, k, v, kw


def extra_logit(kw, lq, lk):
    """Largest magnitude a non-dot term can add to a logit (for the float32 error bound)."""
    extra = kw["softcap"] or 0.0
    if kw.get("alibi_slopes") is not None:
        extra += float(kw["alibi_slopes"].abs().max()) * (lq + lk)
    mask = kw.get("mask")
    if mask is not None and mask.dtype != torch.bool:
        extra += float(mask[torch.isfinite(mask)].abs().max()) if torch.isfinite(mask).any() else 0.0
    return extra


@settings(max_examples=150)
@given(case=attention_cases())
def test_float64_reference_equals_naive(case):
    q, k, v, kw = build(case, torch.float64)
    out, lse = attention_reference(q, k, v, return_lse=True, compute_dtype=torch.float64, **kw)
    ref_out, ref_lse = naive_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref_out, **F64_TOL)
    torch.testing.assert_close(lse, ref_lse, **F64_TOL)


@settings(max_examples=60)
@given(case=attention_cases())
def test_float32_public_path_within_rounding(case):
    """flash_attention(backend="torch") in float32 vs the float64 truth: within the float32 bound."""
    q, k, v, kw = build(case, torch.float32)
    out, lse = ta.flash_attention(q, k, v, return_lse=True, backend="torch", **kw)
    ref_out, ref_lse = naive_attention(q, k, v, **kw)
    assert out.dtype == torch.float32 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    tol = float32_attention_tolerance(q, k, v, kw["scale"], extra_logit(kw, case["lq"], case["lk"]))
    assert float((out.double() - ref_out).abs().max()) <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.equal(lse[~finite], ref_lse[~finite].float())
    # LSE = log(sum exp(logit)): absolute error ~ the logits' error (delta of the bound's derivation).
    lse_tol = 4 * tol / max(float(v.abs().max()), 1e-30) + 8 * UNIT_ROUNDOFF[torch.float32] * float(ref_lse[finite].abs().max() if finite.any() else 0)
    assert float((lse.double() - ref_lse)[finite].abs().max() if finite.any() else 0) <= lse_tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_within_their_rounding(dtype, gen):
    """Exact math on the rounded inputs, then one rounding of the output to the input dtype."""
    q, k, v = rand(gen, 2, 4, 5, 64, dtype=dtype), rand(gen, 2, 2, 9, 64, dtype=dtype), rand(gen, 2, 2, 9, 64, dtype=dtype)
    out = ta.flash_attention(q, k, v, causal=True, backend="torch")
    assert out.dtype == dtype
    ref, _ = naive_attention(q, k, v, causal=True)
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + float32_attention_tolerance(q, k, v) * (1 + UNIT_ROUNDOFF[dtype])
    assert bool(((out.double() - ref).abs() <= bound).all())


# -- each feature, pinned by a construction whose answer is known --------------------------------

def test_causal_is_bottom_right_aligned(gen):
    q, k, v = rand(gen, 1, 2, 3, 16), rand(gen, 1, 2, 7, 16), rand(gen, 1, 2, 7, 16)
    out = attention_reference(q, k, v, causal=True, compute_dtype=torch.float64)
    for i in range(3):  # query i sits at position i + 4 and sees keys 0..i+4
        full = attention_reference(q[:, :, i:i + 1], k[:, :, : i + 5], v[:, :, : i + 5], compute_dtype=torch.float64)
        torch.testing.assert_close(out[:, :, i:i + 1], full, **F64_TOL)


def test_more_queries_than_keys_leaves_early_rows_empty(gen):
    q, k, v = rand(gen, 1, 1, 6, 16), rand(gen, 1, 1, 2, 16), rand(gen, 1, 1, 2, 16)
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :, :4], torch.zeros(1, 1, 4, 16))
    assert bool(torch.isneginf(lse[:, :, :4]).all()) and bool(torch.isfinite(lse[:, :, 4:]).all())
    assert bool(torch.isfinite(out).all())


def test_sliding_window_sees_exactly_the_last_w_keys(gen):
    w = 3
    q, k, v = rand(gen, 1, 1, 8, 16), rand(gen, 1, 1, 8, 16), rand(gen, 1, 1, 8, 16)
    out = attention_reference(q, k, v, causal=True, sliding_window=w, compute_dtype=torch.float64)
    for i in range(8):
        lo = max(0, i - w + 1)
        part = attention_reference(q[:, :, i:i + 1], k[:, :, lo:i + 1], v[:, :, lo:i + 1], compute_dtype=torch.float64)
        torch.testing.assert_close(out[:, :, i:i + 1], part, **F64_TOL)


def test_gqa_equals_repeated_kv_heads(gen):
    q, k, v = rand(gen, 2, 6, 4, 32), rand(gen, 2, 2, 5, 32), rand(gen, 2, 2, 5, 32)
    out = attention_reference(q, k, v, causal=True, compute_dtype=torch.float64)
    mha = attention_reference(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), causal=True,
                              compute_dtype=torch.float64)
    torch.testing.assert_close(out, mha, **F64_TOL)


def test_bool_mask_equals_additive_minus_inf(gen):
    q, k, v = rand(gen, 1, 2, 4, 16), rand(gen, 1, 2, 6, 16), rand(gen, 1, 2, 6, 16)
    keep = torch.rand(1, 2, 4, 6, generator=gen) < 0.5
    keep[..., 0] = True
    a = attention_reference(q, k, v, mask=keep, compute_dtype=torch.float64)
    b = attention_reference(q, k, v, mask=torch.where(keep, 0.0, -math.inf), compute_dtype=torch.float64)
    torch.testing.assert_close(a, b, **F64_TOL)


@pytest.mark.parametrize("how", ["bool", "additive", "window-and-causal"])
def test_fully_masked_row_is_zeros_not_nan(how, gen):
    q, k, v = (rand(gen, 1, 2, n, 16, dtype=torch.float32) for n in (3, 4, 4))
    sinks = torch.tensor([0.5, -1.0])
    if how == "bool":
        kw = dict(mask=torch.tensor([True, False, True])[:, None].expand(3, 4))
    elif how == "additive":
        kw = dict(mask=torch.tensor([0.0, -math.inf, 0.0])[:, None].expand(3, 4))
    else:  # query 1 sits at position 2; a window of 1 leaves it key 2 only, which the mask hides
        keep = torch.ones(3, 4, dtype=torch.bool)
        keep[1, 2] = False
        kw = dict(causal=True, sliding_window=1, mask=keep)
    for extra in ({}, {"sinks": sinks}):
        out, lse = ta.flash_attention(q, k, v, return_lse=True, backend="torch", **kw, **extra)
        assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 16))
        assert bool(torch.isfinite(out).all())
        if extra:
            torch.testing.assert_close(lse[0, :, 1], sinks)  # the sink alone fills the denominator
        else:
            assert bool(torch.isneginf(lse[:, :, 1]).all())


def test_sinks_only_add_to_the_denominator(gen):
    q, k, v = rand(gen, 1, 2, 3, 16), rand(gen, 1, 2, 5, 16), rand(gen, 1, 2, 5, 16)
    sinks = torch.tensor([1.5, -2.0], dtype=torch.float64)
    plain, lse = attention_reference(q, k, v, causal=True, return_lse=True, compute_dtype=torch.float64)
    with_sink, lse_sink = attention_reference(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                              compute_dtype=torch.float64)
    s = sinks[None, :, None]
    torch.testing.assert_close(with_sink, plain * (torch.exp(lse) / (torch.exp(lse) + torch.exp(s)))[..., None], **F64_TOL)
    torch.testing.assert_close(lse_sink, torch.logaddexp(lse, s.expand_as(lse)), **F64_TOL)


def test_softcap_caps_scores(gen):
    q, k, v = rand(gen, 1, 1, 2, 16, scale=20), rand(gen, 1, 1, 6, 16, scale=20), rand(gen, 1, 1, 6, 16)
    out, lse = attention_reference(q, k, v, softcap=2.0, return_lse=True, compute_dtype=torch.float64)
    scores = 2.0 * torch.tanh((q.double() @ k.double().transpose(-1, -2)) / 4.0 / 2.0)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **F64_TOL)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v.double(), **F64_TOL)


def test_alibi_adds_slope_times_distance(gen):
    q, k, v = rand(gen, 1, 2, 2, 16), rand(gen, 1, 2, 5, 16), rand(gen, 1, 2, 5, 16)
    slopes = torch.tensor([0.25, 1.0])
    out = attention_reference(q, k, v, causal=True, alibi_slopes=slopes, compute_dtype=torch.float64)
    pos_q = torch.tensor([3.0, 4.0])[:, None]
    bias = slopes.double()[:, None, None] * (torch.arange(5.0)[None, :] - pos_q)[None]  # [H, Lq, Lk]
    mask = torch.where(torch.arange(5.0)[None, :] <= pos_q, 0.0, -math.inf)
    expected = attention_reference(q, k, v, mask=(bias + mask)[None], compute_dtype=torch.float64)
    torch.testing.assert_close(out, expected, **F64_TOL)


def test_lse_is_logsumexp_of_scaled_scores(gen):
    q, k, v = rand(gen, 2, 2, 3, 32), rand(gen, 2, 2, 4, 32), rand(gen, 2, 2, 4, 32)
    _, lse = attention_reference(q, k, v, scale=0.3, return_lse=True, compute_dtype=torch.float64)
    torch.testing.assert_close(lse, torch.logsumexp(0.3 * q.double() @ k.double().transpose(-1, -2), -1), **F64_TOL)


def test_explicit_positions_and_padding_keys(gen):
    """k_positions < 0 are padding; given positions replace the bottom-right default."""
    q, k, v = rand(gen, 2, 2, 2, 16), rand(gen, 2, 2, 6, 16), rand(gen, 2, 2, 6, 16)
    k_pos = torch.tensor([[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]])
    q_pos = torch.tensor([[4, 5], [2, 3]])
    out = attention_reference(q, k, v, causal=True, q_positions=q_pos, k_positions=k_pos, compute_dtype=torch.float64)
    ref, _ = naive_attention(q, k, v, causal=True, q_positions=q_pos, k_positions=k_pos)
    torch.testing.assert_close(out, ref, **F64_TOL)
    # Sequence 1 equals attention over its real keys only.
    real = attention_reference(q[1:], k[1:, :, 2:], v[1:, :, 2:], causal=True, compute_dtype=torch.float64)
    torch.testing.assert_close(out[1:], real, **F64_TOL)


def test_non_causal_window_is_one_sided(gen):
    """Pinned behaviour: without causal, the window hides keys more than W-1 behind the query and
    keeps every later key (the window bounds the past only)."""
    q, k, v = rand(gen, 1, 1, 4, 16), rand(gen, 1, 1, 4, 16), rand(gen, 1, 1, 4, 16)
    out = attention_reference(q, k, v, sliding_window=2, compute_dtype=torch.float64)
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(out, attention_reference(q, k, v, mask=keep, compute_dtype=torch.float64), **F64_TOL)
