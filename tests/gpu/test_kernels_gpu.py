"""GPU checks of the compressed-cache kernels at real shapes (run with `pytest -m gpu` on a CUDA machine)."""


import pytest
import torch

import turboattn as ta
from turboattn.ops.cached.naive import cached_attention_naive

from gpu_decode_inputs import decode_inputs, poison_allocator, rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fp16 operands (rotated q, softmax weights, centroids): unit roundoff 2^-11, a few of them add up.
TOL = 4 * 2.0 ** -11


CASES = [
    # D, bits, B, Hkv, G, length, ring W, Tq, fresh, softcap, sinks
    (128, (4, 4), 4, 8, 4, 8192 + 37, None, 1, False, None, False),
    (128, (8, 8), 2, 8, 4, 6000, None, 1, True, None, True),
    (128, (5, 3), 2, 4, 8, 3000, None, 7, True, 50.0, False),
    (64, (6, 2), 2, 4, 1, 4097, 1024, 1, False, None, True),
    (256, (4, 4), 2, 8, 2, 5000, None, 16, False, None, False),
    (512, (4, 4), 1, 2, 8, 9000, None, 1, False, None, False),
    (512, (8, 5), 1, 2, 16, 3000, 700, 3, True, 30.0, True),
    (128, (4, 4), 3, 2, 4, 2000, None, 300, True, None, False),
    # D = 64 with 64-row tiles and one side on the 4-bit asm LUT: miscompiled before the gather fallback.
    (64, (4, 3), 1, 3, 3, 1500, None, 12, True, None, False),
    (64, (3, 4), 1, 3, 3, 1500, None, 12, True, None, False),
    (64, (4, 5), 2, 2, 8, 700, 256, 8, False, None, True),
    # Head dims that are not powers of two: the Triton kernels' padded layout (the CUDA kernel does not serve them).
    (80, (4, 4), 2, 4, 4, 3000, None, 1, True, None, False),
    (96, (4, 3), 2, 2, 8, 2000, 512, 2, True, None, True),
    (160, (8, 4), 1, 4, 2, 1500, None, 5, False, 30.0, False),
    (320, (4, 4), 1, 2, 4, 2500, None, 1, True, None, False),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[:8]) for c in CASES])
def test_cached_attention_matches_reference(case):
    d, bits, b, hkv, g, length, window, tq, fresh, softcap, with_sinks = case
    torch.manual_seed(hash(case) % 2**31)
    codec = ta.KVCodec(d, *bits)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else length + tq,
                                sliding_window=window, device="cuda")
    for chunk in (length // 3, length - length // 3):
        k = torch.randn(b, hkv, chunk, d, device="cuda", dtype=torch.bfloat16)
        cache.append(k, torch.randn_like(k))
    cache.set_left_padding(torch.arange(b) * 5)
    q, kf, vf, sinks = decode_inputs(b, hkv, g, tq, d, fresh, with_sinks)
    poison_allocator()
    out = ta.cached_attention(q, cache, kf, vf, softcap=softcap, sinks=sinks)
    assert not out.isnan().any()
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, softcap=softcap, sinks=sinks, compute_dtype=torch.float64)
    # bf16 output rounding (2^-9) on top of the fp16 operand error.
    err = rel_error(out, ref)
    assert err < TOL + 2.0 ** -9, f"relative error {err:.3g}"


@pytest.mark.parametrize("d,bits", [(128, (4, 4)), (128, (8, 3)), (256, (6, 5)), (512, (2, 4)), (64, (4, 8)),
                                    (80, (4, 4)), (96, (3, 5)), (320, (4, 4))])
def test_quantize_append_matches_codec(d, bits):
    torch.manual_seed(d + bits[0])
    codec = ta.KVCodec(d, *bits)
    b, hkv, t = 2, 8, 3000
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16) * 4
    v = torch.randn_like(k)
    fused = ta.QuantizedKVCache(codec, b, hkv, capacity=t, device="cuda")
    fused.k_codes.fill_(0xAB)
    fused.k_scales.fill_(float("nan"))
    fused.append(k, v)
    ref = ta.QuantizedKVCache(codec, b, hkv, capacity=t, device="cuda")
    ref.append(k, v, backend="torch")
    assert not fused.k_scales.isnan().any()
    for kind in ("k", "v"):
        got = getattr(fused, f"{kind}_codes")
        want = getattr(ref, f"{kind}_codes")
        # Codes differ only where a value sits within float rounding of a cell boundary.
        differ = got != want
        assert differ.float().mean().item() < 1e-4
        # Scales agree to float32 summation order where the row's codes agree; a flipped
        # code moves the "corrected" scale by (c_a^2 - c_b^2) / (2 |c|^2) at most.
        same_row = ~differ.any(-1, keepdim=True)
        gs, ws = getattr(fused, f"{kind}_scales"), getattr(ref, f"{kind}_scales")
        rel = (gs - ws).abs() / ws.abs()
        assert rel[same_row.expand_as(rel)].max() < 1e-5
        assert rel.max() < 0.05


@pytest.mark.parametrize("fit", [False, True], ids=["plain", "key-transform"])
def test_decode_step_replays_in_cuda_graph(fit):
    from turboattn.format.key_transform import fit_key_transform
    torch.manual_seed(0)
    codec = ta.KVCodec(128, 4, 4)
    b, hkv, g, d = 4, 8, 4, 128
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=4096, device="cuda")
    k = torch.randn(b, hkv, 3000, d, device="cuda", dtype=torch.bfloat16)
    if fit:
        cache.set_key_transform(*fit_key_transform(torch.randn(b, hkv * g, 3000, d, device="cuda"), k + 2))
    cache.append(k, torch.randn_like(k))
    q = torch.randn(b, hkv * g, 1, d, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    num_splits = 8  # fixed for the graph; lengths grow on the device
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        ta.cached_attention(q, cache, k_new, v_new, num_splits=num_splits)
        cache.append(k_new, v_new)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.cached_attention(q, cache, k_new, v_new, num_splits=num_splits)
        cache.append(k_new, v_new)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        seen_before = cache.seen.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache.seen, seen_before + 1)
        # Reference: the cache before this step's append, plus the fresh token.
        cache.seen.copy_(seen_before)
        ref = cached_attention_naive(q, cache.layout, cache.codec, k_new, v_new, compute_dtype=torch.float64)
        cache.seen.copy_(seen_before + 1)
        assert rel_error(out, ref) < TOL + 2.0 ** -9


@pytest.mark.parametrize("center", [True, False], ids=["centered", "gain-only+softcap+sinks"])
def test_key_transform_matches_reference(center):
    """A fitted key transform at a real shape: Triton (stored domain) vs the reference (model domain)."""
    from turboattn.format.key_transform import fit_key_transform
    torch.manual_seed(1)
    d, b, hkv, g, length = 128, 2, 4, 4, 5000
    codec = ta.KVCodec(d, 4, 4)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=length + 1, device="cuda")
    offset = 4 * torch.randn(b, hkv, 1, d, device="cuda")
    k = (offset + torch.randn(b, hkv, length, d, device="cuda") * torch.linspace(0.2, 3, d, device="cuda"))
    k = k.to(torch.bfloat16)
    q_prompt = torch.randn(b, hkv * g, length, d, device="cuda", dtype=torch.bfloat16)
    cache.set_key_transform(*fit_key_transform(q_prompt, k, center=center))
    cache.append(k, torch.randn_like(k))
    q = torch.randn(b, hkv * g, 1, d, device="cuda", dtype=torch.bfloat16)
    k_new = (offset + torch.randn(b, hkv, 1, d, device="cuda")).to(torch.bfloat16)
    v_new = torch.randn_like(k_new)
    options = {} if center else {"softcap": 30.0, "sinks": torch.randn(hkv * g, device="cuda")}
    out = ta.cached_attention(q, cache, k_new, v_new, **options)
    ref = cached_attention_naive(q, cache.layout, cache.codec, k_new, v_new, compute_dtype=torch.float64, **options)
    # bf16 q / gain and transformed fresh keys add roundings of 2^-9 each.
    assert rel_error(out, ref) < TOL + 3 * 2.0 ** -9
