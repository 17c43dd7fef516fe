"""What the tests of the exact cache options (tests/test_exact_recent.py, tests/test_exact_first.py) share: the
kernel tolerance and its comparison with the twin, filling a cache with random chunks, batch edits, and the
compiled static step."""

from __future__ import annotations

import os

import pytest
import torch

import turboattn as ta
from turboattn.ops.cached.naive import cached_attention_naive

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERPRETER and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 (set by `make test`) or a GPU")
# As in test_kernels_cached.py: float16 dot operands (rotated q, weights, centroids, the rotated exact rows), each
# rounded to 2^-11 relative, and one more rounding for the float16 output.
FP16_TOL = 4 * 2.0**-11 + 2.0**-11


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def fill(gen, cache, chunks, new_lengths=None, shift=False):
    """Append random chunks (T tokens each); returns the real K/V per sequence as lists of [Hkv, D] rows."""
    b, hkv, d = cache.batch_size, cache.num_kv_heads, cache.codec.head_dim
    if shift:
        cache.set_key_transform(torch.randn(b, hkv, d, generator=gen), torch.rand(b, hkv, d, generator=gen) + 0.5)
    ks, vs = [[] for _ in range(b)], [[] for _ in range(b)]
    for i, t in enumerate(chunks):
        k = torch.randn(b, hkv, t, d, generator=gen) * 2
        v = torch.randn(b, hkv, t, d, generator=gen)
        n = new_lengths[i] if new_lengths else None
        cache.append(k, v, new_lengths=n, backend="torch")
        for s in range(b):
            real = t if n is None else n[s]
            ks[s] += list(k[s, :, :real].unbind(1))
            vs[s] += list(v[s, :, :real].unbind(1))
    return ks, vs


def check_static_step_compiles_once(gen, static, growing, prompt, steps, backend):
    """Attention plus append on `static` under torch.compile(fullgraph=True), one-token steps after a `prompt`-token
    prefill: one graph, each step equal to eager steps on `growing` (same options, growing storage)."""
    b, hkv, d = static.batch_size, static.num_kv_heads, static.codec.head_dim
    k, v = (torch.randn(b, hkv, prompt + steps, d, generator=gen) for _ in range(2))
    for c in (static, growing):
        c.append(k[:, :, :prompt], v[:, :, :prompt], backend="torch")

    def step(q, k, v):
        out = ta.cached_attention(q, static, k, v, backend=backend)
        static.append(k, v, backend=backend)
        return out

    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=count, fullgraph=True)
    for s in range(prompt, prompt + steps):
        q = torch.randn(b, 2 * hkv, 1, d, generator=gen)
        got = compiled(q, k[:, :, s:s + 1], v[:, :, s:s + 1])
        want = ta.cached_attention(q, growing, k[:, :, s:s + 1], v[:, :, s:s + 1], backend="torch")
        growing.append(k[:, :, s:s + 1], v[:, :, s:s + 1], backend="torch")
        assert rel(got, want) < (FP16_TOL if backend == "triton" else 1e-5), s
    assert len(graphs) == 1
    return k


def check_batch_edits_follow(gen, make_cache, k_name, v_name):
    """Beam reorder, batch select, repeat and reset carry the exact rows `k_name`, `v_name` along with the
    sequences (a static cache in place), for a growing and a static cache of 2 sequences, 1 KV head, D = 64."""
    for static in (False, True):
        cache = make_cache(static)
        fill(gen, cache, (6,))
        rows = getattr(cache, k_name).clone()
        address = getattr(cache, k_name).data_ptr()
        cache.reorder_cache([1, 1])
        assert torch.equal(getattr(cache, k_name), rows[[1, 1]])
        assert getattr(cache, k_name).data_ptr() == address or not static   # a static cache permutes in place
        cache.batch_select_indices([0])
        assert getattr(cache, k_name).shape == (1, *rows.shape[1:]) and torch.equal(getattr(cache, k_name), rows[[1]])
        cache.batch_repeat_interleave(3)
        kept = getattr(cache, v_name)
        assert torch.equal(kept, kept[[0, 0, 0]]) and kept.shape[0] == 3
        cache.reset()
        assert torch.count_nonzero(getattr(cache, k_name)) == 0 and torch.count_nonzero(getattr(cache, v_name)) == 0


def check_kernel_matches_twin(gen, cache, group, tq):
    """The Triton kernel against the PyTorch twin (float64) on `cache`, without and with fresh k/v, with the
    planned split count and with 3 splits."""
    b, hkv, d = cache.batch_size, cache.num_kv_heads, cache.codec.head_dim
    q = torch.randn(b, hkv * group, tq, d, generator=gen).half()
    kf = torch.randn(b, hkv, tq, d, generator=gen).half()
    vf = torch.randn(b, hkv, tq, d, generator=gen).half()
    for fresh in (False, True):
        k, v = (kf, vf) if fresh else (None, None)
        for splits in (None, 3):
            out = ta.cached_attention(q, cache, k, v, backend="triton", num_splits=splits)
            ref = cached_attention_naive(q, cache.layout, cache.codec, k, v, compute_dtype=torch.float64)
            assert rel(out, ref) < FP16_TOL, (fresh, splits, rel(out, ref))
