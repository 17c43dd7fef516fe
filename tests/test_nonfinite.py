"""Non-finite K/V: stored as NaN, counted on the device, and seen by exactly the queries that attend to them.

A K or V vector holding a NaN or an infinity is stored with NaN scales (codec.quantize); attention then
gives a NaN output row to every query that sees that key, and leaves every other output bit-identical to
a run where the vector was finite: other sequences, other KV heads, earlier queries (causal), keys out of
the window or in the left padding.  Both backends, the Triton kernels under the interpreter.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import turboattn as ta

# NaN arithmetic in the Triton interpreter (numpy) warns; here it is the point.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BACKENDS = ["torch", "triton"]
BAD = [float("nan"), float("inf"), -float("inf")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The kernels take float16 dot operands: a handful of 2^-11 roundings (test_kernels_cached.py), plus the output's.
FP16_TOL = 4 * 2.0**-11 + 2.0**-11


def need_backend(backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by `make test`) or a GPU")


def kv(gen, b, hkv, t, d, dtype=torch.float32):
    return (torch.randn(b, hkv, t, d, generator=gen).to(dtype), torch.randn(b, hkv, t, d, generator=gen).to(dtype))


def poison(x: torch.Tensor, index, value: float) -> torch.Tensor:
    """A copy of x with one entry set to value (index: b, h, t, coordinate)."""
    x = x.clone()
    x[index] = value
    return x


# -- storage and the counter ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 512])
def test_nonfinite_vectors_are_stored_as_nan_and_counted(backend, dtype, d, gen):
    need_backend(backend)
    codec = ta.KVCodec(d, 4, 3)
    b, hkv, t = 3, 2, 5
    k, v = kv(gen, b, hkv, t, d, dtype)
    clean = ta.QuantizedKVCache(codec, b, hkv, capacity=8)
    clean.append(k, v, backend=backend)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=8)
    assert not cache.received_nonfinite()
    bad = [("k", (0, 1, 2, 7)), ("v", (0, 0, 4, d - 1)), ("k", (2, 0, 0, 0)), ("v", (2, 0, 0, 3))]
    for (kind, index), value in zip(bad, BAD + BAD[:1]):
        if kind == "k":
            k = poison(k, index, value)
        else:
            v = poison(v, index, value)
    cache.append(k, v, backend=backend)
    # Per sequence, vectors: sequence 2 has a bad K and a bad V at one token (two vectors).
    assert cache.nonfinite.tolist() == [2, 0, 2] and cache.received_nonfinite()
    for kind, (sb, sh, st, _) in bad:
        codes, scales = getattr(cache, f"{kind}_codes"), getattr(cache, f"{kind}_scales")
        assert bool(scales[sb, sh, st].isnan().all()) and bool((codes[sb, sh, st] == 0).all())
        codes[sb, sh, st] = getattr(clean, f"{kind}_codes")[sb, sh, st]
        scales[sb, sh, st] = getattr(clean, f"{kind}_scales")[sb, sh, st]
    for name in ("k_codes", "k_scales", "v_codes", "v_scales"):  # every other vector as if all were finite
        assert torch.equal(getattr(cache, name), getattr(clean, name)), name
    k_hat, v_hat = cache.dequantize()
    assert bool(torch.isfinite(k_hat[1]).all()) and bool(torch.isfinite(v_hat[1]).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_counter_counts_stored_vectors_and_follows_edits(backend, gen):
    """Right padding of a chunk (new_lengths) and the part of a long chunk a ring drops are not stored,
    so not counted; batch edits carry the counts; reset clears them."""
    need_backend(backend)
    codec = ta.KVCodec(64, 4, 4)
    ring = ta.QuantizedKVCache(codec, 2, 1, sliding_window=4)
    k, v = kv(gen, 2, 1, 9, 64)
    k = poison(k, (0, 0, 1, 0), math.nan)       # dropped: a ring of 4 keeps the chunk's last 4
    k = poison(k, (0, 0, 6, 0), math.inf)       # kept
    v = poison(v, (1, 0, 8, 0), math.nan)       # beyond new_lengths[1] = 7: padding, not stored
    ring.append(k, v, new_lengths=[9, 7], backend=backend)
    assert ring.nonfinite.tolist() == [1, 0]
    ring.batch_repeat_interleave(2)
    assert ring.nonfinite.tolist() == [1, 1, 0, 0]
    ring.batch_select_indices([2, 1])
    assert ring.nonfinite.tolist() == [0, 1] and ring.received_nonfinite()
    ring.reset()
    assert ring.nonfinite.tolist() == [0, 0] and not ring.received_nonfinite()


# -- attention ------------------------------------------------------------------------------------

def attend(q, cache, fresh, backend, splits):
    return ta.cached_attention(q, cache, *fresh, backend=backend, num_splits=splits if backend == "triton" else None)


def check_nan_rows(got, want_nan, clean, backend, ref):
    """NaN exactly in the rows want_nan [B, Hq, Tq]; every other row equal to the clean run, bit for bit."""
    nan_rows = got.isnan().any(-1)
    assert torch.equal(nan_rows, want_nan)
    assert bool(got[want_nan].isnan().all())
    assert torch.equal(got[~want_nan], clean[~want_nan])
    if backend == "triton":  # and the twin agrees on the finite rows
        err = (got[~want_nan].double() - ref[~want_nan].double()).norm() / ref[~want_nan].double().norm()
        assert float(err) < FP16_TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("value", BAD, ids=["nan", "inf", "-inf"])
def test_cached_nonfinite_reaches_only_the_queries_that_see_it(backend, kind, value, gen):
    """Cached position 5 of sequence 0, KV head 0 is poisoned.  A chunk of Tq = 3 queries ending at the
    last cached token (positions 4, 5, 6): query 4 does not see it, 5 and 6 do.  Split-K (3 splits) puts
    the key in one split; the merge must carry the NaN to its rows and nowhere else."""
    need_backend(backend)
    codec = ta.KVCodec(64, 4, 3)
    b, hkv, g, t, tq = 2, 2, 2, 7, 3
    k, v = kv(gen, b, hkv, t, 64)
    bad_k, bad_v = (poison(k, (0, 0, 5, 3), value), v) if kind == "k" else (k, poison(v, (0, 0, 5, 3), value))
    q = torch.randn(b, hkv * g, tq, 64, generator=gen).half()
    outs = []
    for kk, vv in ((k, v), (bad_k, bad_v)):
        cache = ta.QuantizedKVCache(codec, b, hkv, capacity=12)
        cache.append(kk.half(), vv.half(), backend=backend)
        outs.append(attend(q, cache, (None, None), backend, 3))
    clean, got = outs
    want_nan = torch.zeros(b, hkv * g, tq, dtype=torch.bool)
    want_nan[0, :g, 1:] = True
    ref = ta.cached_attention(q.float(), cache, backend="torch").half()
    check_nan_rows(got, want_nan, clean, backend, ref)
    assert bool(torch.isfinite(clean).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k", "v"])
def test_hidden_nonfinite_keys_change_nothing(backend, kind, gen):
    """Keys no query sees: a left-padding position, and the oldest slot of a wrapped ring (out of the
    window of the next query, still stored).  Outputs stay finite and bit-identical."""
    need_backend(backend)
    codec = ta.KVCodec(64, 4, 4)
    w, b, hkv = 4, 2, 1
    k, v = kv(gen, b, hkv, 5, 64)
    fresh = kv(gen, b, hkv, 1, 64)
    q = torch.randn(b, 2, 1, 64, generator=gen)
    where = [(0, 0, 1, 0), (1, 0, 0, 0)]   # sequence 0: ring slot of position 1 (seen 5: window 2..5); 1: padding
    outs = []
    for poisoned in (False, True):
        kk, vv = k, v
        if poisoned:
            for index in where:
                kk, vv = (poison(kk, index, math.nan), vv) if kind == "k" else (kk, poison(vv, index, math.inf))
        cache = ta.QuantizedKVCache(codec, b, hkv, sliding_window=w)
        cache.set_left_padding([0, 1])
        cache.append(kk[:, :, :1], vv[:, :, :1], backend=backend)
        cache.append(kk[:, :, 1:], vv[:, :, 1:], backend=backend)
        outs.append(attend(q, cache, fresh, backend, 2))
    assert cache.nonfinite.tolist() == [1, 1]  # stored and counted, yet seen by no query
    assert bool(torch.isfinite(outs[1]).all()) and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("value", BAD, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("d", [64, 512])
def test_fresh_nonfinite_reaches_only_later_queries(backend, kind, value, d, gen):
    """Fresh token 1 of sequence 1 (KV head 1) is poisoned: fresh queries 1.. of that head group see it,
    query 0 (before it) and everything else do not.  D = 512 rotates on the host (infinities stay
    infinite there instead of turning NaN)."""
    need_backend(backend)
    codec = ta.KVCodec(d, 4, 4)
    b, hkv, g, tq = 2, 2, 2, 3
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=8)
    cache.append(*kv(gen, b, hkv, 4, d), backend=backend)
    k, v = kv(gen, b, hkv, tq, d, torch.float16)
    q = torch.randn(b, hkv * g, tq, d, generator=gen).half()
    bad = (poison(k, (1, 1, 1, 2), value), v) if kind == "k" else (k, poison(v, (1, 1, 1, 2), value))
    clean = attend(q, cache, (k, v), backend, 2)
    got = attend(q, cache, bad, backend, 2)
    want_nan = torch.zeros(b, hkv * g, tq, dtype=torch.bool)
    want_nan[1, g:, 1:] = True
    ref = ta.cached_attention(q.float(), cache, bad[0].float(), bad[1].float(), backend="torch").half()
    check_nan_rows(got, want_nan, clean, backend, ref)
