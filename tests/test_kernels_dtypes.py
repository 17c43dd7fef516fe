"""Every Triton kernel x input dtype (float32, float16, bfloat16) under the interpreter, against float64.

The interpreter once returned garbage for bfloat16 without an error (its tl.dot multiplied the
operands' raw bit patterns; docs/design.md, "Tests"), so each kernel runs here on each dtype it
accepts, at every head dim it serves.  Shapes are tiny: the interpreter simulates every program.

Tolerances count the kernels' roundings to the input dtype; CAST is one float32 -> dtype cast,
relative: float16 rounds to nearest (2^-11), the interpreter truncates to bfloat16 (under one ulp,
2^-7; the GPU rounds to nearest, 2^-8), float32 does not round.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import turboattn as ta
from turboattn.format import codebook, rotation
from turboattn.ops.cached.naive import cached_attention_naive
from turboattn.ops.flash.naive import attention_reference
from turboattn.ops.flash.triton import flash_attention_triton, flash_path

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 (set by `make test`)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256, 512]
CAST = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-7}
U32 = 2.0**-24


def _rel(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# --- dense flash attention: prefill and split-K decode ------------------------------------------

# tests/test_flash.py's float32 budget: float32 scores, softmax and accumulation over <= 64 keys.
FLASH_FP32 = 2e-5


def _flash_inputs(gen, lq, lk, d, dtype):
    q = torch.randn(1, 4, lq, d, generator=gen).to(dtype)
    k = torch.randn(1, 2, lk, d, generator=gen).to(dtype)
    v = torch.randn(1, 2, lk, d, generator=gen).to(dtype)
    return q, k, v


def _gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def _check_flash(q, k, v, launch=None, **kw):
    """Output within its rounding bound, LSE within float32's, of the float64 reference.

    The kernels round the softmax weights P to the input dtype before P @ V, each by at most
    CAST * P, which moves the output by at most CAST * (P @ |V|) per element; the output cast adds
    CAST * |out|.  The LSE is float32 throughout: a score errs by at most gamma_D sum|q_i k_i| * scale
    plus a few roundings of its terms (scaled score, softcap, ALiBi, mask), the sum of weights by gamma_Lk.
    `launch`: the launcher's own keywords (path, config).
    """
    out, lse = flash_attention_triton(q, k, v, return_lse=True, **kw, **(launch or {}))
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref, ref_lse = attention_reference(q64, k64, v64, return_lse=True, compute_dtype=torch.float64, **kw)
    spread = attention_reference(q64, k64, v64.abs(), compute_dtype=torch.float64, **kw).norm() / ref.norm()
    assert out.dtype == q.dtype
    assert _rel(out, ref) < CAST[q.dtype] * (float(spread) + 1) + FLASH_FP32

    d, lk = q.shape[-1], k.shape[-2]
    k_per_q = k64.abs().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    dot_bound = float((q64.abs() @ k_per_q.transpose(-1, -2)).max()) / math.sqrt(d)
    extra = kw.get("softcap") or 0.0
    if kw.get("alibi_slopes") is not None:
        extra += float(kw["alibi_slopes"].abs().max()) * lk
    if kw.get("mask") is not None:
        mask = kw["mask"].double()
        extra += float(mask[torch.isfinite(mask)].abs().max())
    score_err = _gamma(d + 2) * dot_bound + 8 * U32 * (dot_bound + extra)
    live = torch.isfinite(ref_lse)
    assert float((lse.double() - ref_lse)[live].abs().max()) < score_err + _gamma(lk + 2)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_prefill(gen, dtype, d):
    # 16x16 tiles on the CPU: masked edges and unmasked interior tiles, partial at both ends.
    q, k, v = _flash_inputs(gen, 37, 45, d, dtype)
    assert flash_path(q, k) == "prefill"
    _check_flash(q, k, v, causal=True)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_decode(gen, dtype, d):
    # Two query tokens per head, three splits (merged by the reduce kernel).
    q, k, v = _flash_inputs(gen, 2, 45, d, dtype)
    assert flash_path(q, k) == "decode"
    _check_flash(q, k, v, causal=True, launch=dict(config={"splits": 3}))


@pytest.mark.parametrize("path", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_mask_in_the_input_dtype(gen, dtype, path):
    """An additive mask in q's dtype (read by the tile classifier and the kernels), with softcap and ALiBi."""
    q, k, v = _flash_inputs(gen, 20, 33, 64, dtype)
    mask = torch.randn(1, 4, 20, 33, generator=gen)
    mask[torch.rand(1, 4, 20, 33, generator=gen) < 0.3] = -math.inf
    _check_flash(q, k, v, mask=mask.to(dtype), softcap=3.0, alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 0.05]),
                 launch=dict(path=path))


# --- compressed cache: quantize-and-append, split-K attention with fresh k/v, merge ----------------

# tests/test_kernels_cached.py's budget: float16 dot operands (rotated q, weights, centroids).
CACHED_FP16 = 4 * 2.0**-11


def _filled_cache(gen, codec, dtype, length):
    cache = ta.QuantizedKVCache(codec, 1, 2, capacity=length + 8)
    k = (torch.randn(1, 2, length, codec.head_dim, generator=gen) * 2).to(dtype)
    v = torch.randn(1, 2, length, codec.head_dim, generator=gen).to(dtype)
    cache.append(k, v, backend="triton")
    return cache, k, v


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_append(gen, dtype, d):
    """Codes equal the float64-rotation codec's except where u = y / rms lies within float32 rounding
    of a cell boundary.  Scales |y_b| / |c_b| ("corrected") of the blocks whose codes agree: the kernel's
    rotation holds ~22 significant bits (2^-21), and two float32 sums of BLK squares, two square roots,
    a division and the 1/sqrt(D) factor round, against a float64 value."""
    codec = ta.KVCodec(d, 4, 3, "corrected")
    t, nb, blk = 19, codec.num_blocks, codec.block_size
    cache, k, v = _filled_cache(gen, codec, dtype, t)
    for kind, x in (("k", k), ("v", v)):
        want = codec.unpack(codec.quantize(x.double(), kind), kind)
        got = ta.Packed(getattr(cache, f"{kind}_codes")[:, :, :t], getattr(cache, f"{kind}_scales")[:, :, :t])
        flips = (codec.unpack(got, kind) != want).reshape(1, 2, t, nb, blk)
        y = rotation.rotate(x.double()).reshape(1, 2, t, nb, blk)
        u = y / y.pow(2).mean(-1, keepdim=True).sqrt()
        gap = (u[..., None] - codebook.boundaries(codec.bits(kind), torch.float64)).abs().amin(-1)
        assert not (flips & (gap > 1e-5 * (1 + u.abs()))).any()
        c = codebook.centroids(codec.bits(kind), torch.float32).double()[want].reshape(1, 2, t, nb, blk)
        rel = (got.scales.double() / (y.norm(dim=-1) / c.norm(dim=-1)) - 1).abs()
        assert float(rel.masked_fill(flips.any(-1), 0).max()) < 2.0**-21 + 2 * _gamma(blk) + 6 * U32


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cached_attention(gen, dtype, d):
    """Two cache splits and the fresh k/v part, merged: q, fresh k/v and the output in `dtype`."""
    codec = ta.KVCodec(d, 4, 3)
    cache, _, _ = _filled_cache(gen, codec, dtype, 70)  # key tiles of 32 or 64: both splits hold keys
    q = torch.randn(1, 4, 2, d, generator=gen).to(dtype)
    kf = torch.randn(1, 2, 2, d, generator=gen).to(dtype)
    vf = torch.randn(1, 2, 2, d, generator=gen).to(dtype)
    out = ta.cached_attention(q, cache, kf, vf, backend="triton", num_splits=2)
    ref = cached_attention_naive(q.double(), cache.layout, codec, kf.double(), vf.double(),
                                 compute_dtype=torch.float64)
    assert out.dtype == dtype
    assert _rel(out, ref) < CACHED_FP16 + CAST[dtype]
