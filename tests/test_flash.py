"""Dense flash attention (kernels/flash.py) against the float64 reference, under the Triton interpreter.

Shapes are tiny: the interpreter simulates every program.  On the CPU the
launcher uses 16x16 tiles, so a few dozen tokens already cover several query
and key tiles, partial tiles, and every segment of the causal / window split.
Mostly fp16 here; every dtype (bf16 included) at each head dim is in
tests/test_kernels_dtypes.py, and bf16 on the GPU in tests/gpu/test_flash_gpu.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import turboattn as ta  # noqa: E402
from turboattn.ops.flash.triton import flash_attention_triton, flash_path  # noqa: E402
from turboattn.ops.flash.naive import attention_reference  # noqa: E402

# Relative error budgets vs float64: fp16 operands and fp16 P round at ~5e-4 each;
# fp32 runs with IEEE dots (float32 accumulation over <= 64 keys).
TOL = {torch.float16: 3e-3, torch.float32: 2e-5}
LSE_TOL = {torch.float16: 2e-4, torch.float32: 2e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def make_qkv(b, hq, hkv, lq, lk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    return q, k, v


def reference(q, k, v, kv_start=None, mask=None, **kw):
    """Float64 reference; kv_start becomes a boolean key mask (it is left padding)."""
    if kv_start is not None:
        lk = k.shape[2]
        keep = (torch.arange(lk)[None, :] >= kv_start[:, None].long())[:, None, None, :]
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.double() + torch.where(keep, 0.0, -math.inf).double()
    return attention_reference(q.double(), k.double(), v.double(), mask=mask, return_lse=True,
                               compute_dtype=torch.float64, **kw)


def check(q, k, v, *, kv_start=None, **kw):
    """Run kernel and reference; compare out (relative) and LSE (absolute where finite, equal -inf)."""
    out = torch.full_like(q, float("nan"))  # poison: the kernel must write every element
    res, lse = flash_attention_triton(q, k, v, kv_start=kv_start, return_lse=True, **kw)
    out.copy_(res)
    ref, ref_lse = reference(q, k, v, kv_start=kv_start, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert not torch.isnan(out).any(), "NaN in output"
    assert rel_err(out, ref) < TOL[q.dtype], rel_err(out, ref)
    # Rows that see nothing: exactly zero output, LSE -inf (or the sink's logit).
    dead = ref_lse == -math.inf
    assert torch.equal(torch.isinf(lse) & (lse < 0), dead)
    assert (out[dead] == 0).all()
    live = ~dead
    if live.any():
        assert (lse[live].double() - ref_lse[live]).abs().max().item() < LSE_TOL[q.dtype]
    return out, lse


# --- shapes, GQA, causal alignment -------------------------------------------------------------

@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 37), (5, 5), (33, 33), (17, 50), (40, 23), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_shapes_and_causal(lq, lk, causal, seed):
    q, k, v = make_qkv(1, 2, 1, lq, lk, 32, torch.float16, seed=seed)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("lq", [1, 4, 24])
def test_gqa(group, lq, seed):
    q, k, v = make_qkv(2, 2 * group, 2, lq, 41, 16, torch.float16, seed=seed)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("d", [16, 48, 64, 80])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_head_dims_and_dtypes(d, dtype, seed):
    q, k, v = make_qkv(1, 2, 2, 19, 29, d, dtype, seed=seed)
    check(q, k, v, causal=True)


def test_non_contiguous_inputs(seed):
    # [B, L, H, D] storage viewed as [B, H, L, D], as transformers hands it over.
    qkv = make_qkv(2, 4, 2, 21, 21, 32, torch.float16, seed=seed)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv)
    assert not q.is_contiguous()
    check(q, k, v, causal=True)


def test_default_scale_and_custom_scale(seed):
    q, k, v = make_qkv(1, 2, 1, 18, 18, 32, torch.float16, seed=seed)
    check(q, k, v, causal=True, scale=0.3)


# --- sliding window, kv_start ------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 5, 16, 17, 100])
@pytest.mark.parametrize("lq,lk,causal", [(48, 48, True), (20, 45, True), (30, 30, False)])
def test_sliding_window(window, lq, lk, causal, seed):
    q, k, v = make_qkv(1, 2, 1, lq, lk, 16, torch.float16, seed=seed)
    check(q, k, v, causal=causal, sliding_window=window)


@pytest.mark.parametrize("lq", [1, 3, 35])
def test_kv_start_left_padding(lq, seed):
    q, k, v = make_qkv(3, 4, 2, lq, 40, 16, torch.float16, seed=seed)
    kv_start = torch.tensor([0, 17, 39], dtype=torch.int32)
    check(q, k, v, causal=True, kv_start=kv_start)
    check(q, k, v, causal=True, sliding_window=8, kv_start=kv_start)


def test_kv_start_past_the_end_gives_zeros(seed):
    q, k, v = make_qkv(2, 2, 1, 4, 20, 16, torch.float16, seed=seed)
    kv_start = torch.tensor([20, 5], dtype=torch.int32)
    out, lse = check(q, k, v, causal=True, kv_start=kv_start)
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()


# --- user masks and tile classification ----------------------------------------------------------

def _bool_mask(shape, p_keep=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < p_keep


@pytest.mark.parametrize("mask_shape", ["LqLk", "B1LqLk", "BHLqLk", "11 1Lk", "B H 1 Lk"])
@pytest.mark.parametrize("lq", [1, 37])
def test_boolean_mask_broadcasts(mask_shape, lq, seed):
    b, hq, hkv, lk = 2, 4, 2, 45
    shape = {"LqLk": (lq, lk), "B1LqLk": (b, 1, lq, lk), "BHLqLk": (b, hq, lq, lk),
             "11 1Lk": (1, 1, 1, lk), "B H 1 Lk": (b, hq, 1, lk)}[mask_shape]
    q, k, v = make_qkv(b, hq, hkv, lq, lk, 16, torch.float16, seed=seed)
    check(q, k, v, mask=_bool_mask(shape, seed=lq), causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_additive_mask_with_inf_and_finite_values(dtype, seed):
    b, hq, lq, lk = 1, 2, 40, 40
    q, k, v = make_qkv(b, hq, 1, lq, lk, 32, torch.float16, seed=seed)
    mask = torch.randn(b, hq, lq, lk).to(dtype)
    mask[..., :16, 16:] = -math.inf          # whole tiles masked -> skipped
    mask[..., 16:32, :16] = 0.0              # whole tiles zero -> plain path
    mask[..., 3, :] = -math.inf              # a fully masked row -> zeros
    check(q, k, v, mask=mask)
    check(q, k, v, mask=mask, causal=True, softcap=4.0)


def test_fully_masked_rows_are_zero_not_nan(seed):
    q, k, v = make_qkv(1, 2, 1, 20, 12, 16, torch.float16, seed=seed)
    mask = _bool_mask((20, 12), seed=3)
    mask[5] = False
    mask[17] = False
    out, lse = check(q, k, v, mask=mask)
    assert (out[:, :, [5, 17]] == 0).all()
    # Causal with Lq > Lk: the first Lq - Lk queries sit before every key.
    out, lse = check(q, k, v, causal=True)
    assert (out[:, :, :8] == 0).all() and (lse[:, :, :8] == -math.inf).all()


def test_sinks_on_fully_masked_rows(seed):
    q, k, v = make_qkv(1, 2, 1, 20, 12, 16, torch.float16, seed=seed)
    sinks = torch.tensor([0.5, -1.0])
    out, lse = check(q, k, v, causal=True, sinks=sinks)
    assert (out[:, :, :8] == 0).all()
    assert torch.allclose(lse[0, :, :8], sinks[:, None].expand(2, 8))


@pytest.mark.parametrize("kind", ["none", "causal_mask", "random_bool", "additive", "window"])
def test_tile_skipping_changes_nothing(kind, seed):
    """Visiting every tile through the masked path gives the same numbers as the skipping paths."""
    b, hq, lq, lk = 2, 2, 48, 64
    q, k, v = make_qkv(b, hq, 1, lq, lk, 32, torch.float16, seed=seed)
    kw = dict(causal=True)
    if kind == "causal_mask":  # the same causal pattern given as a mask: tiles above the band are skipped
        kw = dict(mask=torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq))
    elif kind == "random_bool":
        m = _bool_mask((b, 1, lq, lk), seed=7)
        m[..., :, 32:48] = False
        kw = dict(mask=m, sliding_window=40)
    elif kind == "additive":
        m = torch.zeros(lq, lk)
        m[:, :16] = -math.inf
        m[20:, 40:] = torch.randn(28, 24)
        kw = dict(mask=m, causal=True)
    elif kind == "window":
        kw = dict(causal=True, sliding_window=20, kv_start=torch.tensor([3, 21], dtype=torch.int32))
    fast = flash_attention_triton(q, k, v, return_lse=True, **kw)
    full = flash_attention_triton(q, k, v, return_lse=True, skip_tiles=False, **kw)
    assert torch.equal(fast[0], full[0])
    assert torch.equal(fast[1], full[1])
    check(q, k, v, **kw)
    if kind == "causal_mask":
        assert torch.equal(fast[0], flash_attention_triton(q, k, v, causal=True))


# --- softcap, ALiBi, sinks, LSE ----------------------------------------------------------------

@pytest.mark.parametrize("lq", [1, 6, 33])
def test_softcap_alibi_sinks_together(lq, seed):
    hq = 4
    q, k, v = make_qkv(2, hq, 2, lq, 35, 32, torch.float16, seed=seed)
    q = q * 3  # large scores so the softcap matters
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    sinks = torch.tensor([0.0, 2.0, -1.0, 5.0])
    check(q, k, v, causal=True, softcap=3.0)
    check(q, k, v, causal=True, alibi_slopes=slopes)
    check(q, k, v, causal=True, sinks=sinks)
    check(q, k, v, causal=True, sliding_window=7, softcap=3.0, alibi_slopes=slopes, sinks=sinks,
          mask=_bool_mask((lq, 35), seed=1))


def test_lse_merges_two_halves(seed):
    """LSE lets two partial attentions over disjoint keys merge into the full one (the extend path's use)."""
    q, k, v = make_qkv(1, 2, 2, 8, 40, 32, torch.float32, seed=seed)
    full = flash_attention_triton(q, k, v)
    o1, l1 = flash_attention_triton(q, k[:, :, :25], v[:, :, :25], return_lse=True)
    o2, l2 = flash_attention_triton(q, k[:, :, 25:], v[:, :, 25:], return_lse=True)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]
    assert rel_err(merged, full.double()) < 1e-5


# --- decode (split-K) ----------------------------------------------------------------------------

@pytest.mark.parametrize("lk", [1, 15, 16, 300])
@pytest.mark.parametrize("group", [1, 8])
def test_decode_split_k(lk, group, seed):
    q, k, v = make_qkv(2, 2 * group, 2, 1, lk, 32, torch.float16, seed=seed)
    assert flash_path(q, k) == "decode"
    check(q, k, v, causal=True)
    check(q, k, v, causal=True, sliding_window=100, kv_start=torch.tensor([0, 7], dtype=torch.int32),
          sinks=torch.linspace(-1, 1, 2 * group), softcap=2.0)


def test_decode_and_prefill_paths_agree(seed):
    q, k, v = make_qkv(1, 4, 2, 3, 90, 32, torch.float16, seed=seed)
    mask = _bool_mask((1, 4, 3, 90), seed=11)
    kw = dict(causal=True, mask=mask, alibi_slopes=torch.tensor([0.1, 0.2, 0.3, 0.4]), return_lse=True)
    o_dec, l_dec = flash_attention_triton(q, k, v, path="decode", **kw)
    o_pre, l_pre = flash_attention_triton(q, k, v, path="prefill", **kw)
    assert rel_err(o_dec, o_pre.double()) < 2e-3
    assert (l_dec - l_pre).abs().max() < 1e-4


# --- random combinations -------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
    lq=st.integers(1, 40), lk=st.integers(1, 40), d=st.sampled_from([16, 32, 48]),
    causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 30)),
    mask_kind=st.sampled_from([None, "bool", "additive"]), softcap=st.one_of(st.none(), st.just(2.5)),
    alibi=st.booleans(), sinks=st.booleans(), kv_start=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_random_configurations(b, hkv, group, lq, lk, d, causal, window, mask_kind, softcap, alibi, sinks,
                               kv_start, seed):
    hq = hkv * group
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, torch.float16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, lq, lk, generator=g) < 0.7
    elif mask_kind == "additive":
        mask = torch.randn(1, hq, lq, lk, generator=g)
        mask[torch.rand(1, hq, lq, lk, generator=g) < 0.3] = -math.inf
    check(q, k, v, causal=causal, sliding_window=window, mask=mask, softcap=softcap,
          alibi_slopes=torch.rand(hq, generator=g) if alibi else None,
          sinks=torch.randn(hq, generator=g) if sinks else None,
          kv_start=torch.randint(0, lk + 1, (b,), generator=g, dtype=torch.int32) if kv_start else None)


# --- public entry point and validation -----------------------------------------------------------

def test_public_flash_attention_triton_backend(seed):
    q, k, v = make_qkv(1, 4, 2, 20, 20, 32, torch.float16, seed=seed)
    out, lse = ta.flash_attention(q, k, v, causal=True, return_lse=True, backend="triton")
    ref, ref_lse = reference(q, k, v, causal=True)
    assert rel_err(out, ref) < TOL[torch.float16]
    assert (lse.double() - ref_lse).abs().max() < 1e-4


def test_bad_input_raises_before_launch(seed):
    q, k, v = make_qkv(2, 4, 2, 8, 8, 16, torch.float16, seed=seed)
    with pytest.raises(ValueError, match="kv_start"):
        flash_attention_triton(q, k, v, kv_start=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_start"):
        flash_attention_triton(q, k, v, kv_start=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="kv_start"):
        flash_attention_triton(q, k, v, kv_start=[0, 0])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ta.flash_attention(q[:, :3], k, v, backend="triton")
    with pytest.raises(ValueError, match="mask shape"):
        ta.flash_attention(q, k, v, mask=torch.ones(3, 8, dtype=torch.bool), backend="triton")
    with pytest.raises(TypeError, match="share a dtype"):
        ta.flash_attention(q, k.float(), v, backend="triton")
