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


def _run(b, hq, hkv, lq, lk, d, dtype=torch.bfloat16, kv_start=None, mask=None, config=None, path=None, **kw):
    """config / path go to the Triton launcher only (a block configuration, a forced kernel)."""
    from turboattn.ops.flash.triton import flash_attention_triton
    from turboattn.ops.flash.naive import attention_reference
    q = torch.randn(b, hq, lq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    res, lse = flash_attention_triton(q, k, v, mask=mask, kv_start=kv_start, return_lse=True,
                                      allow_sdpa=False, config=config, path=path, **kw)
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


@pytest.mark.parametrize("shape", [(1, 4, 1, 300, 450, 80, False), (1, 6, 2, 500, 500, 192, True)],
                         ids=["full-d80-gqa4", "causal-d192-gqa3"])
def test_head_dims_that_are_not_powers_of_two(shape):
    *dims, causal = shape
    _run(*dims, causal=causal)


@pytest.mark.parametrize("shape", [(2, 4, 4, 300, 1100, 128), (1, 2, 1, 900, 400, 512)], ids=["lq<lk", "lq>lk"])
def test_causal_bottom_right_lq_ne_lk(shape):
    _run(*shape, causal=True)


def test_additive_mask_with_fully_masked_rows():
    lq = lk = 640
    mask = torch.randn(1, 4, lq, lk, device="cuda").to(torch.bfloat16)
    mask[..., : lq // 2, lk // 2:] = -math.inf   # whole tiles skipped
    mask[..., lq // 2:, : lk // 2] = 0
    mask[..., 1, :] = -math.inf                  # a row with no key: output 0, LSE -inf
    _run(1, 4, 4, lq, lk, 256, mask=mask)


def test_softcap_sinks_window_d512():
    _run(1, 4, 2, 800, 800, 512, causal=True, softcap=30.0, sinks=torch.randn(4, device="cuda"),
         sliding_window=200)


def test_decode_d512_window_sinks_softcap_kv_start():
    _run(2, 16, 2, 1, 5000, 512, causal=True, sliding_window=3000, sinks=torch.randn(16, device="cuda"),
         softcap=25.0, kv_start=torch.tensor([0, 1234], dtype=torch.int32, device="cuda"))


def test_decode_kernel_with_several_queries_and_a_mask():
    """Lq = 4 with a GQA group of 8 (32 rows) still takes the decode kernel."""
    mask = torch.rand(2, 1, 4, 3000, device="cuda") < 0.8
    mask[..., 1000:1500] = False
    _run(2, 16, 2, 4, 3000, 128, causal=True, mask=mask, path="decode")


def test_decode_d256_alibi():
    _run(1, 8, 8, 1, 4100, 256, alibi_slopes=torch.rand(8, device="cuda") * 0.1)


def _candidates(kind):
    from turboattn.cli.bench.prefill_configs import DECODE_CANDIDATES, PREFILL_CANDIDATES, parse_config
    if kind == "decode":
        return [(512, n, parse_config(n, "decode")) for n in DECODE_CANDIDATES.split(",")]
    return [(d, n, parse_config(n, "prefill")) for d, names in PREFILL_CANDIDATES.items() for n in names.split(",")]


def _compiles(fn):
    """Run fn; skip the test when Triton rejects the configuration on this GPU (shared memory, clusters)."""
    from triton.runtime.errors import OutOfResources
    try:
        fn()
    except OutOfResources as e:
        pytest.skip(f"does not fit on this GPU: {e}")


@pytest.mark.parametrize("d, name, config", _candidates("prefill"), ids=lambda x: x if isinstance(x, str) else None)
def test_every_timed_prefill_config_is_correct(d, name, config):
    """`turboattn bench prefill --configs candidates` times these: each must compute the right thing."""
    _compiles(lambda: _run(1, 4, 2, 1000, 1000, d, causal=True, config=config, path="prefill"))


@pytest.mark.parametrize("d, name, config", _candidates("decode"), ids=lambda x: x if isinstance(x, str) else None)
def test_every_timed_decode_config_is_correct(d, name, config):
    _compiles(lambda: _run(1, 16, 2, 1, 32768, d, causal=True, config=config, path="decode"))


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


def _compiled_variants(*kernels) -> int:
    """Compiled specializations of these @triton.jit kernels held by this process (Triton's JIT cache)."""
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_no_recompile_as_lengths_grow(path):
    """A generation's growing key count (and its mask's row pitch) must not compile new kernels: one that
    crossed a multiple of 16 used to compile mid-generation, half a second on the clock of a first run."""
    from turboattn.ops.flash.decode import _decode_reduce, _flash_decode
    from turboattn.ops.flash.prefill import _classify_tiles, _flash_fwd
    kernels = (_flash_decode, _decode_reduce) if path == "decode" else (_flash_fwd, _classify_tiles)
    counts = []
    for lk in (61, 64, 65, 80, 513, 1024, 1500, 4099, 8192):
        lq = 1 if path == "decode" else min(lk, 100)
        mask = torch.rand(1, 1, lq, lk, device="cuda") > 0.1
        _run(1, 9, 3, lq, lk, 64, mask=mask, path=path)
        counts.append(_compiled_variants(*kernels))
    assert counts[1:] == counts[:1] * (len(counts) - 1), counts
