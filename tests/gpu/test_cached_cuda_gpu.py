"""The CUDA decode kernel (ops/cached/cuda.py, 4-bit K/V at head_dim 64/128/256) against the float64 reference (pytest -m gpu).

backend="auto" picks it on CUDA tensors; backend="triton" forces the portable kernel, which serves as a
second reference.  Same tolerance as the Triton kernel (test_kernels_gpu.py): fp16 operands and bf16 output.
"""

import pytest
import torch

import turboattn as ta
from turboattn.format.key_transform import fit_key_transform
from turboattn.ops import backend
from turboattn.ops.cached import cuda
from turboattn.ops.cached.naive import cached_attention_naive

from gpu_decode_inputs import decode_inputs, poison_allocator, rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = 4 * 2.0 ** -11 + 2.0 ** -9


CASES = [
    # B, Hkv, G, length, ring W, Tq, fresh, softcap, sinks, key transform, splits
    (4, 8, 4, 8192 + 37, None, 1, False, None, False, False, None),
    (2, 8, 4, 6000, None, 1, True, None, True, True, None),
    (2, 4, 8, 3000, None, 1, True, 50.0, False, False, 3),
    (2, 4, 8, 3000, None, 2, True, None, False, False, None),   # 16 rows: the Triton kernel serves it
    (2, 4, 1, 4097, 1024, 1, False, None, True, False, None),
    (3, 2, 16, 2000, None, 1, True, None, False, True, 1),
    (1, 8, 4, 100, None, 2, False, None, False, False, None),
    (2, 8, 1, 5000, 2048, 8, True, None, False, True, 7),
    (2, 2, 2, 777, 256, 3, True, 30.0, True, False, 5),
]


def test_the_extension_builds():
    assert cuda._extension() is not None
    assert backend.choose("cached_attention", "auto", torch.device("cuda")) == "cuda"


# Other head dims: the kernel's per-dim code paths (fragment words, output tiles, q fragments in shared memory).
HEAD_DIM_CASES = [(d, CASES[i]) for d in (64, 256) for i in (0, 1, 2, 4, 7, 8)]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_cuda_decode_matches_reference(case):
    _check_against_reference(case, 128)


@pytest.mark.parametrize("d,case", HEAD_DIM_CASES, ids=[f"D{d}-{c}" for d, c in HEAD_DIM_CASES])
def test_cuda_decode_other_head_dims(d, case):
    _check_against_reference(case, d)


def _check_against_reference(case, d):
    b, hkv, g, length, window, tq, fresh, softcap, with_sinks, fit, splits = case
    torch.manual_seed(hash((case, d)) % 2**31)
    codec = ta.KVCodec(d, 4, 4)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else length + tq, sliding_window=window,
                                device="cuda")
    first = torch.randn(b, hkv, length // 3, d, device="cuda", dtype=torch.bfloat16) + 0.5
    if fit:
        qf = torch.randn(b, hkv * g, length // 3, d, device="cuda", dtype=torch.bfloat16)
        cache.set_key_transform(*fit_key_transform(qf, first, center=softcap is None and not with_sinks))
    cache.append(first, torch.randn_like(first))
    rest = torch.randn(b, hkv, length - length // 3, d, device="cuda", dtype=torch.bfloat16) + 0.5
    cache.append(rest, torch.randn_like(rest))
    cache.set_left_padding(torch.arange(b) * 5)
    q, kf, vf, sinks = decode_inputs(b, hkv, g, tq, d, fresh, with_sinks)
    poison_allocator()
    assert cuda.supports(q, codec, hkv) == (tq * g <= 8)  # the cases are meant for the CUDA kernel
    out = ta.cached_attention(q, cache, kf, vf, softcap=softcap, sinks=sinks, num_splits=splits)
    assert not out.isnan().any()
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, softcap=softcap, sinks=sinks,
                                 compute_dtype=torch.float64)
    err = rel_error(out, ref)
    assert err < TOL, f"relative error {err:.3g}"
    portable = ta.cached_attention(q, cache, kf, vf, softcap=softcap, sinks=sinks, num_splits=splits, backend="triton")
    assert rel_error(portable, ref) < TOL


def test_cuda_decode_is_graph_capturable():
    codec = ta.KVCodec(128, 4, 4)
    cache = ta.QuantizedKVCache(codec, 2, 8, capacity=4096, device="cuda")
    k = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    cache.append(k, torch.randn_like(k))
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    out = ta.cached_attention(q, cache, kn, kn, num_splits=4)
    cache.append(kn, kn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.cached_attention(q, cache, kn, kn, num_splits=4)
        cache.append(kn, kn)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    # The graph's attention ran before its own append: the reference sees the cache one token shorter.
    cache.seen -= 1
    ref = cached_attention_naive(q, cache.layout, cache.codec, kn, kn, compute_dtype=torch.float64)
    assert rel_error(out, ref) < TOL
