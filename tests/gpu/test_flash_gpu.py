"""Dense flash attention on a CUDA GPU at real shapes, bf16 included (pytest -m gpu).

Compared with a float64 reference by relative error; outputs are poisoned with
NaN first so an unwritten element fails.  bf16 operands: errors of a few 1e-3.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}


def _run(b, hq, hkv, lq, lk, d, dtype=torch.bfloat16, kv_start=None, mask=None, **kw):
    from turboattn.ops.flash.triton import flash_attention_triton
    from turboattn.ops.flash.naive import attention_reference
    q = torch.randn(b, hq, lq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    res, lse = flash_attention_triton(q, k, v, mask=mask, kv_start=kv_start, return_lse=True,
                                      allow_sdpa=False, **kw)
    out.copy_(res)
    ref_mask = mask
    if kv_start is not None:
        keep = (torch.arange(lk, device="cuda")[None] >= kv_start[:, None].long())[:, None, None, :]
        ref_mask = keep if mask is None else mask & keep
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), mask=ref_mask, return_lse=True,
                                       compute_dtype=torch.float64, **kw)
    assert not torch.isnan(out).any()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err
    dead = ref_lse == -math.inf
    assert (out[dead] == 0).all()
    assert torch.equal(lse == -math.inf, dead)
    assert (lse[~dead].double() - ref_lse[~dead]).abs().max().item() < 1e-3


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_prefill(d, dtype):
    _run(2, 8, 2, 1000, 1000, d, dtype, causal=True)


@pytest.mark.parametrize("d", [128, 512])
def test_window_kv_start_lq_ne_lk(d):
    kv_start = torch.tensor([0, 333], dtype=torch.int32, device="cuda")
    _run(2, 4, 1, 700, 1300, d, causal=True, sliding_window=300, kv_start=kv_start)


@pytest.mark.parametrize("d", [128, 512])
def test_bool_mask_with_skipped_tiles(d):
    mask = torch.rand(2, 1, 700, 900, device="cuda") < 0.8
    mask[..., 300:450] = False
    _run(2, 4, 2, 700, 900, d, mask=mask)


def test_softcap_alibi_sinks():
    hq = 8
    _run(1, hq, 2, 600, 600, 256, causal=True, softcap=20.0,
         alibi_slopes=torch.rand(hq, device="cuda") * 0.1, sinks=torch.randn(hq, device="cuda"))


@pytest.mark.parametrize("lk", [1, 4097, 32768])
def test_decode_d512_gqa8(lk):
    _run(1, 16, 2, 1, lk, 512, causal=True)


def test_tile_skipping_changes_nothing():
    from turboattn.ops.flash.triton import flash_attention_triton
    q = torch.randn(2, 4, 1500, 512, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 1500, 512, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kw = dict(causal=True, sliding_window=500, kv_start=torch.tensor([0, 200], dtype=torch.int32, device="cuda"))
    a = flash_attention_triton(q, k, v, **kw)
    b = flash_attention_triton(q, k, v, skip_tiles=False, **kw)
    # Not bitwise: the compiler may contract multiply-adds differently in the masked and plain
    # paths, so allow rounding-level differences (far below the 1e-2 bf16 error budget).
    assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 5e-4


@pytest.mark.parametrize("hkv", [16, 4])
def test_public_entry_point_sdpa_dispatch(hkv):
    """Plain causal D<=256 goes to torch SDPA (measured faster); it must compute the same thing."""
    import turboattn as ta
    from turboattn.ops.flash.triton import flash_path
    from turboattn.ops.flash.naive import attention_reference
    q = torch.randn(1, 16, 600, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, 600, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    assert flash_path(q, k, causal=True) == "sdpa"
    assert flash_path(q, k, causal=True, return_lse=True) == "prefill"
    out = ta.flash_attention(q, k, v, causal=True)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True, compute_dtype=torch.float64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1.5e-2
