"""Keys in channel groups on the GPU (pytest -m gpu): the CUDA decode kernel (for the groupings it is built for,
config.CUDA_KEY_GROUPS) and the Triton kernels (every grouping; the appends) against the float64 PyTorch path at
real shapes, and a tiny model end to end."""

import pytest
import torch

import turboattn as ta
from turboattn.format.key_transform import fit_key_order
from turboattn.ops.backend import choose
from turboattn.ops.cached.naive import cached_attention_naive

from gpu_decode_inputs import decode_inputs, poison_allocator, rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fp16 dot operands and a bf16 output (the plain kernels' GPU bound, test_kernels_gpu.py).
TOL = 4 * 2.0 ** -11 + 2.0 ** -9

CASES = [
    # head_dim, key groups, v_bits, B, Hkv, G, length, ring W, Tq, fresh, exact first, exact recent
    (256, ((112, 6), (144, 4)), 3, 2, 1, 4, 3000, None, 1, True, 4, 8),      # Gemma-3-like, the preset's options
    (256, ((112, 6), (144, 4)), 3, 2, 1, 4, 1100, 512, 1, True, 0, 8),       # its sliding layers' ring
    (128, ((48, 5), (80, 2)), 8, 4, 8, 4, 5000, None, 2, True, 0, 0),
    (64, ((32, 6), (32, 3)), 4, 4, 3, 3, 2000, None, 1, False, 4, 64),
    (512, ((256, 8), (256, 4)), 4, 1, 2, 8, 3000, None, 1, True, 0, 0),
]


def _cache(d, groups, v_bits, b, hkv, length, window, first, recent, scale_dtype=torch.bfloat16):
    codec = ta.KVCodec(d, None, v_bits, key_groups=groups, scale_dtype=scale_dtype)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else length + 8, sliding_window=window,
                                device="cuda", exact_first=first, exact_recent=recent)
    spread = torch.linspace(0.1, 3.0, d, device="cuda")[torch.randperm(d, device="cuda")]
    k = (torch.randn(b, hkv, length, d, device="cuda") * spread + 1.0).bfloat16()
    v = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
    cache.set_key_transform(k[:, :, :512].float().mean(2), torch.ones(b, hkv, d, device="cuda"),
                            fit_key_order(k[:, :, :512]))
    cache.append(k[:, :, :512], v[:, :, :512])
    if length > 512:
        cache.append(k[:, :, 512:], v[:, :, 512:])
    return cache


@pytest.mark.parametrize("case", CASES, ids=[f"d{c[0]}-L{c[6]}" + ("-ring" if c[7] else "") for c in CASES])
def test_triton_serves_grouped_keys_and_matches_float64(case):
    d, groups, v_bits, b, hkv, g, length, window, tq, fresh, first, recent = case
    assert choose("quantize_append", "auto", torch.device("cuda"), d, True) == "triton"
    torch.manual_seed(0)
    cache = _cache(d, groups, v_bits, b, hkv, length, window, first, recent)
    q, kf, vf, _ = decode_inputs(b, hkv, g, tq, d, fresh, False)
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    poison_allocator()
    out = ta.cached_attention(q, cache, kf, vf, backend="triton")
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert rel_error(out, ref) < TOL


CUDA_CASES = [
    # key groups, B, Hkv, G, length, ring W, Tq, fresh, exact first, exact recent, scale dtype
    (((112, 6), (144, 4)), 2, 1, 4, 3000, None, 1, True, 4, 8, torch.bfloat16),   # Gemma-3-like, preset options
    (((112, 6), (144, 4)), 2, 1, 4, 1100, 512, 1, True, 0, 8, torch.bfloat16),    # its sliding layers' ring
    (((112, 6), (144, 4)), 3, 2, 8, 1000, 501, 1, False, 0, 0, torch.bfloat16),   # a ring of odd capacity: clamped
    (((96, 6), (160, 4)), 2, 2, 4, 5000, None, 2, True, 0, 0, torch.float32),     # 8 query rows, float32 scales
    (((96, 6), (160, 4)), 1, 1, 1, 37, None, 1, False, 4, 0, torch.bfloat16),     # short, G = 1, exact first only
    (((96, 6), (160, 4)), 4, 1, 2, 2500, None, 3, True, 0, 64, torch.float32),
]


@pytest.mark.parametrize("case", CUDA_CASES, ids=[f"a{c[0][0][0]}-L{c[4]}" + ("-ring" if c[5] else "") + f"-{i}"
                                                  for i, c in enumerate(CUDA_CASES)])
def test_cuda_kernel_serves_its_key_groups_and_matches_float64(case, monkeypatch):
    from turboattn.ops.cached import cuda as cuda_path
    groups, b, hkv, g, length, window, tq, fresh, first, recent, scale_dtype = case
    d = 256
    assert choose("cached_attention", "auto", torch.device("cuda"), d, True) == "cuda"

    def no_fallback(*args):
        raise AssertionError("the CUDA kernel handed the call to Triton")
    monkeypatch.setattr(cuda_path, "cached_attention_triton", no_fallback)
    torch.manual_seed(0)
    cache = _cache(d, groups, 3, b, hkv, length, window, first, recent, scale_dtype)
    q, kf, vf, _ = decode_inputs(b, hkv, g, tq, d, fresh, False)
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    poison_allocator()
    out = ta.cached_attention(q, cache, kf, vf)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert rel_error(out, ref) < TOL
    # The decode step's launcher (attention.py's fast path) gives the same output.
    again = ta.cached_attention(q, cache, kf, vf)
    assert torch.equal(again, out)


def test_cuda_key_group_builds_agree_with_the_planner():
    from turboattn.ops.cached.config import CUDA_KEY_GROUPS, cuda_ctas_per_sm
    from turboattn.ops.cuda_extension import extension
    ext = extension()
    for d, groups, v_bits in CUDA_KEY_GROUPS:
        for exact in (False, True):
            built = ext.ctas_per_sm(d, groups[0][1], v_bits, exact, groups[0][0], groups[1][1])
            assert built == cuda_ctas_per_sm(d, groups, v_bits, exact), (d, groups, v_bits, exact)
    assert ext.ctas_per_sm(256, 6, 3, False, 128, 4) == -1


def test_cuda_key_groups_poison_checked_nonfinite_keys():
    """A non-finite key (both group scales NaN) gives NaN where it is seen, as the reference does."""
    torch.manual_seed(3)
    groups = ((112, 6), (144, 4))
    codec = ta.KVCodec(256, None, 3, key_groups=groups, scale_dtype=torch.bfloat16)
    cache = ta.QuantizedKVCache(codec, 2, 1, capacity=700, device="cuda")
    k = torch.randn(2, 1, 600, 256, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1, 600, 256, device="cuda", dtype=torch.bfloat16)
    cache.set_key_transform(k.float().mean(2), torch.ones(2, 1, 256, device="cuda"), fit_key_order(k))
    k[1, 0, 300, 5] = float("inf")
    cache.append(k, v)
    q = torch.randn(2, 4, 1, 256, device="cuda", dtype=torch.bfloat16)
    out = ta.cached_attention(q, cache)
    ref = cached_attention_naive(q, cache.layout, cache.codec, compute_dtype=torch.float64)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all() and torch.isnan(ref[1]).all()
    assert rel_error(out[0], ref[0]) < TOL


def test_triton_append_codes_like_the_pytorch_path():
    """The same tokens appended through the Triton kernels and through the PyTorch path decode alike: only cells
    decided by float rounding may differ (tests/test_key_groups.py checks them one by one under the interpreter)."""
    torch.manual_seed(1)
    caches = []
    for backend in ("auto", "torch"):
        codec = ta.KVCodec(256, None, 3, key_groups=((112, 6), (144, 4)), scale_dtype=torch.bfloat16)
        cache = ta.QuantizedKVCache(codec, 2, 1, capacity=2100, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(2)
        k = torch.randn(2, 1, 2048, 256, device="cuda", generator=gen) * 2 + 0.5
        v = torch.randn(2, 1, 2048, 256, device="cuda", generator=gen)
        cache.set_key_transform(k.mean(2), torch.ones(2, 1, 256, device="cuda"), fit_key_order(k))
        cache.append(k[:, :, :2000], v[:, :, :2000], backend=backend)
        for t in range(2000, 2048):   # decode steps
            cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1], backend=backend)
        caches.append(cache.dequantize())
    for got, want in zip(*caches):
        assert rel_error(got, want) < 1e-3


@torch.no_grad()
def test_tiny_model_matches_the_pytorch_path(monkeypatch):
    """A tiny Gemma-3 (sliding and full layers) in bf16 through the Triton kernels against the same cache on the
    PyTorch path: logits within bf16 rounding of a decode step."""
    pytest.importorskip("transformers")
    from hf_models import random_ids, teacher_forced_logits, tiny_gemma3
    from turboattn.hf import TurboQuantCache
    from turboattn.ops import backend as registry

    model = tiny_gemma3().to("cuda", torch.bfloat16)
    ids = random_ids(40).cuda()
    groups = ((32, 6), (32, 3))
    got = teacher_forced_logits(model, ids, TurboQuantCache(model.config, v_bits=4, key_groups=groups), 24)
    for op in ("cached_attention", "quantize_append"):   # the PyTorch path alone serves the same cache
        monkeypatch.setitem(registry._REGISTRY, op, {"torch": registry._REGISTRY[op]["torch"]})
    registry._auto.cache_clear()
    try:
        want = teacher_forced_logits(model, ids, TurboQuantCache(model.config, v_bits=4, key_groups=groups), 24)
    finally:
        monkeypatch.undo()
        registry._auto.cache_clear()   # "auto" decisions are cached: drop the ones made without Triton
    # The paths differ only in each attention output, by float16 operand rounding and the bf16 cast (TOL, ~4e-3
    # relative); through three residual layers that moves bf16 logits by a few times as much: 2e-2, about 5x TOL.
    assert rel_error(got.float(), want.float()) < 2e-2
