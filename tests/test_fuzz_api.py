"""Fuzzed public API: every call either matches the reference or is refused, naming the argument.

Hypothesis draws shapes, dtypes, bit widths, options, capacities, ring states
and memory layouts for KVCodec, QuantizedKVCache, cached_attention,
flash_attention and TurboQuantCache, and now and then spoils one argument with
a mistake a newcomer makes (0-token tensors, float64 or int inputs, bits as
strings or floats, GQA ratios that do not divide, capacities exceeded, `meta`
tensors, a bool where an int belongs, ...).  A spoiled call must raise
TypeError or ValueError, on one line, naming the spoiled argument, before any
work starts (`no_work`, as in test_errors.py).  A valid call must give the
same result for non-contiguous inputs as for contiguous copies (bit for bit:
both run the PyTorch path), and match the float64 reference within the bounds
the other tests derive (tests/naive.py, test_cached_attention.py, test_flash.py,
test_kernels_cached.py).  A few examples run the Triton kernels under the
interpreter at tiny shapes.

Examples are derandomized and nothing is stored between runs, so CI sees the
same cases every time; seeds for the tensors are drawn by Hypothesis too.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from naive import UNIT_ROUNDOFF, float32_attention_tolerance, naive_attention

import turboattn as ta
from turboattn.format import codec as codec_mod, rotation
from turboattn.format.codec import ATTENTION_DTYPES, FLOAT_DTYPES, SUPPORTED_BITS
from turboattn.ops import backend
from turboattn.ops.cached.naive import cached_attention_naive

U32 = UNIT_ROUNDOFF[torch.float32]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (set by `make test`)")
if INTERPRETED:  # the kernels' budgets against float64 (test_flash.py skips itself without the interpreter)
    from test_flash import TOL, rel_err
    from test_kernels_cached import FP16_TOL, _rel



def fuzz(max_examples: int) -> settings:
    """Reproducible (derandomized, no example database) and without shrinking, which re-runs the calls
    many times; the failing example is printed either way."""
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- the two outcomes ----------------------------------------------------------------------------------

def _forbidden(*args, **kwargs):
    raise AssertionError("work started before the input was validated")


@contextlib.contextmanager
def no_work():
    """The functions that do the work (rotation, coding, every op implementation) fail while inside."""
    with mock.patch.object(rotation, "walsh_hadamard", _forbidden), \
            mock.patch.object(codec_mod.KVCodec, "quantize_rotated", _forbidden), \
            mock.patch.object(codec_mod.KVCodec, "dequantize_rotated", _forbidden), \
            mock.patch.object(backend, "load", _forbidden):
        yield


def assert_refused(call, arg: str):
    """call() raises TypeError / ValueError, one line, naming `arg`, before any work."""
    with no_work(), pytest.raises((TypeError, ValueError)) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert re.search(rf"(?<![A-Za-z_]){re.escape(arg)}(?![A-Za-z_])", msg), (arg, msg)


# -- memory layouts ------------------------------------------------------------------------------------

LAYOUTS = ("contiguous", "transposed", "strided", "expanded")


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x's values in another memory layout: a view with other strides (equal to x element for element)."""
    if layout == "transposed":  # [B, T, H, D] storage seen as [B, H, T, D], as after q.view(...).transpose(1, 2)
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":  # every other element of a wider buffer
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "expanded" and x.shape[1] == 1:  # a broadcast head (stride 0)
        return x[:, :1].expand(x.shape)
    return x


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


# -- KVCodec -------------------------------------------------------------------------------------------

BAD_BITS = st.sampled_from([1, 7, 9, 4.0, "4", True, None])
BAD_HEAD_DIM = st.sampled_from([0, 16, 24, 100, 520, 1024, 64.0, "64", True])  # valid: multiples of 16, 32..512


@st.composite
def codec_case(draw):
    head_dim = draw(st.sampled_from([64, 128, 256, 512, 80, 96]))
    k_bits, v_bits = draw(st.sampled_from(SUPPORTED_BITS)), draw(st.sampled_from(SUPPORTED_BITS))
    rule = draw(st.sampled_from(codec_mod.SCALE_RULES))
    bad = draw(st.sampled_from([None] * 4 + ["head_dim", "k_bits", "v_bits", "scale_rule", "x", "x dtype",
                                             "x shape", "kind", "packed", "dtype"]))
    if bad == "head_dim":
        head_dim = draw(BAD_HEAD_DIM)
    elif bad == "k_bits":
        k_bits = draw(BAD_BITS)
    elif bad == "v_bits":
        v_bits = draw(BAD_BITS)
    elif bad == "scale_rule":
        rule = draw(st.sampled_from(["max", "RMS", None, 1]))
    lead = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))  # 0-token tensors are valid here
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    return head_dim, k_bits, v_bits, rule, lead, dtype, layout, bad, draw(st.integers(0, 2**31 - 1))


@fuzz(200)
@given(case=codec_case())
@example(case=(64, 4, 4, "corrected", [0], torch.float32, "contiguous", None, 0))      # 0 vectors
@example(case=(64, "4", 4, "corrected", [2], torch.float32, "contiguous", "k_bits", 0))  # bits as a string
@example(case=(64, 4, 4.0, "corrected", [2], torch.float32, "contiguous", "v_bits", 0))  # bits as a float
@example(case=(128, 4, 4, "lsq", [2, 3], torch.float16, "packed", "packed", 0))        # a tensor for Packed
def test_codec(case):
    head_dim, k_bits, v_bits, rule, lead, dtype, layout, bad, seed = case
    make = lambda: ta.KVCodec(head_dim, k_bits, v_bits, rule)  # noqa: E731
    if bad in ("head_dim", "k_bits", "v_bits", "scale_rule"):
        return assert_refused(make, bad)
    codec = make()
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, *lead, 2, head_dim, dtype=dtype)
    if bad == "x":
        return assert_refused(lambda: codec.quantize(x.tolist()), "x")
    if bad == "x dtype":
        return assert_refused(lambda: codec.quantize(x.to(torch.int32)), "x")
    if bad == "x shape":
        return assert_refused(lambda: codec.quantize(x[..., : head_dim // 2]), "x")
    if bad == "kind":
        return assert_refused(lambda: codec.quantize(x, "q"), "kind")
    if bad == "packed":
        codes = codec.quantize(x).codes
        return assert_refused(lambda: codec.dequantize(codes), "packed")
    want = codec.quantize(x, "v")
    if bad == "dtype":
        return assert_refused(lambda: codec.dequantize(want, "v", torch.int32), "dtype")
    got = codec.quantize(laid_out(x, layout) if x.dim() == 4 else x.mT.contiguous().mT, "v")
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    assert got.codes.shape == (*lead, 2, head_dim * v_bits // 8) and got.scales.shape == (*lead, 2, codec.num_blocks)
    out = codec.dequantize(got, "v", dtype)
    assert out.shape == x.shape and out.dtype == dtype and bool(torch.isfinite(out).all())


def test_codec_on_meta_tensors_gives_shapes():
    """A meta tensor has a shape and no values: quantize propagates the shapes (as torch ops do)."""
    packed = ta.KVCodec(128, 3, 5).quantize(torch.zeros(2, 5, 128, device="meta"), "k")
    assert packed.codes.device.type == "meta" and packed.codes.shape == (2, 5, 48)
    assert packed.scales.shape == (2, 5, 1)


# -- QuantizedKVCache ----------------------------------------------------------------------------------

def expected_state(codec, b, hkv, capacity, window, static, chunks):
    """codes and scales [B, Hkv, N, ...] and seen, written slot by slot from codec.quantize of each token."""
    n = capacity
    state = {name: torch.zeros(b, hkv, n, codec.code_bytes(name[0]) if "codes" in name else codec.num_blocks,
                               dtype=torch.uint8 if "codes" in name else torch.float32)
             for name in ("k_codes", "k_scales", "v_codes", "v_scales")}
    seen = [0] * b
    for k, v, lengths in chunks:
        kp, vp = codec.quantize(k, "k"), codec.quantize(v, "v")
        for s in range(b):
            for t in range(lengths[s]):
                pos = seen[s] + t
                if window is None and pos >= capacity:
                    continue  # a static cache drops what does not fit
                if window is not None and t < lengths[s] - window:
                    continue  # a ring keeps a chunk's last W tokens
                slot = pos % n
                state["k_codes"][s, :, slot], state["k_scales"][s, :, slot] = kp.codes[s, :, t], kp.scales[s, :, t]
                state["v_codes"][s, :, slot], state["v_scales"][s, :, slot] = vp.codes[s, :, t], vp.scales[s, :, t]
            seen[s] += lengths[s]
    return state, seen


BAD_CACHE_ARGS = {
    "codec": ["k4v4", None],
    "batch_size": [0, -1, 2.0, True, "2"],
    "num_kv_heads": [0, 1.0, True],
    "capacity": [0, None, 8.5, True],
    "sliding_window": [0, 2.5, True],
    "static": [1, "yes", None],
    "device": ["gpu0", "nope", 3.5],
}
BAD_APPENDS = ["k", "k dtype", "k shape", "k tokens", "k meta", "v", "v dtype", "new_lengths", "backend"]


@st.composite
def cache_case(draw):
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ring = draw(st.booleans())
    window = draw(st.integers(1, 6)) if ring else None
    static = draw(st.booleans())
    capacity = None if ring else draw(st.integers(1, 10))
    kwargs = dict(batch_size=b, num_kv_heads=hkv, capacity=capacity, sliding_window=window, static=static)
    bad = None
    if draw(st.integers(0, 5)) == 0:
        bad = draw(st.sampled_from(sorted(BAD_CACHE_ARGS)))
        kwargs[bad] = draw(st.sampled_from(BAD_CACHE_ARGS[bad]))
    chunks = draw(st.lists(st.tuples(st.integers(1, 5), st.sampled_from(ATTENTION_DTYPES), st.sampled_from(LAYOUTS),
                                     st.sampled_from([None, "list", "tensor"]),
                                     st.sampled_from([None] * 6 + BAD_APPENDS)), min_size=1, max_size=4))
    bits = draw(st.sampled_from(SUPPORTED_BITS)), draw(st.sampled_from(SUPPORTED_BITS))
    return kwargs, bad, bits, chunks, draw(st.integers(0, 2**31 - 1))


@fuzz(250)
@given(case=cache_case())
@example(case=(dict(batch_size=1, num_kv_heads=1, capacity=4, sliding_window=None, static=False, device="meta"),
               None, (4, 4), [(2, torch.float32, "contiguous", None, None)], 0))   # a meta cache: no values to store
@example(case=(dict(batch_size=2, num_kv_heads=1, capacity=3, sliding_window=None, static=False), None, (4, 4),
               [(2, torch.float32, "contiguous", None, None), (2, torch.float32, "contiguous", None, None)], 0))
@example(case=(dict(batch_size=2, num_kv_heads=1, capacity=4, sliding_window=None, static=False), None, (4, 4),
               [(2, torch.float32, "contiguous", None, "new_lengths")], 0))         # new_lengths=[1.5, 1]
def test_cache(case):
    kwargs, bad, (k_bits, v_bits), chunks, seed = case
    codec = ta.KVCodec(64, k_bits, v_bits)
    make = lambda: ta.QuantizedKVCache(kwargs.pop("codec", codec), **kwargs)  # noqa: E731
    if bad is not None:
        return assert_refused(make, bad)
    if kwargs.get("device") == "meta":
        cache = make()
        k = torch.zeros(1, 1, 2, 64, device="meta")
        return assert_refused(lambda: cache.append(k, k), "k")
    cache = make()
    b, hkv, n = cache.batch_size, cache.num_kv_heads, cache.capacity
    gen = torch.Generator().manual_seed(seed)
    done, seen = [], [0] * b
    for t, dtype, layout, lengths_kind, spoil in chunks:
        k, v = randn(gen, b, hkv, t, 64, dtype=dtype), randn(gen, b, hkv, t, 64, dtype=dtype)
        lengths = [int(x) for x in torch.randint(0, t + 1, (b,), generator=gen)] if lengths_kind else [t] * b
        new_lengths = {None: None, "list": lengths, "tensor": torch.tensor(lengths)}[lengths_kind]
        call = lambda k=k, v=v: cache.append(k, v, new_lengths=new_lengths)  # noqa: E731
        before = [x.clone() for x in (cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales, cache.seen)]
        overflow = not cache.is_ring and not cache.is_static and max(s + x for s, x in zip(seen, lengths)) > n
        if spoil is None and overflow:
            spoil = "capacity"  # a growing cache refuses the chunk that would pass its capacity
        spoiled = {
            "k": lambda: cache.append(k.tolist(), v),
            "k dtype": lambda: cache.append(k.double(), v.double()),
            "k shape": lambda: cache.append(k[..., :32], v[..., :32]),
            "k tokens": lambda: cache.append(k[:, :, :0], v[:, :, :0]),
            "k meta": lambda: cache.append(k.to("meta"), v),
            "v": lambda: cache.append(k, v[:, :, :t - 1] if t > 1 else v[..., :32]),
            "v dtype": lambda: cache.append(k, v.to(torch.float16 if dtype != torch.float16 else torch.float32)),
            "new_lengths": lambda: cache.append(k, v, new_lengths=[x + 0.5 for x in lengths]),
            "backend": lambda: cache.append(k, v, backend="cuda"),
            "capacity": call,
        }
        if spoil is not None:
            assert_refused(spoiled[spoil], spoil.split()[0])
            after = (cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales, cache.seen)
            assert all(torch.equal(x, y) for x, y in zip(before, after)), "a refused append changed the cache"
            continue
        call(laid_out(k, layout), laid_out(v, layout))
        done.append((k, v, lengths))
        seen = [s + x for s, x in zip(seen, lengths)]
    state, want_seen = expected_state(codec, b, hkv, n, cache.sliding_window, cache.is_static, done)
    for name, want in state.items():
        assert torch.equal(getattr(cache, name), want), name
    assert cache.seen.tolist() == want_seen
    assert bool(cache.overflowed.any()) == (not cache.is_ring and max(want_seen) > n)


# -- flash_attention -----------------------------------------------------------------------------------

BAD_FLASH = ["q tokens", "k tokens", "q dtype", "q int", "q dims", "k heads", "k meta", "v shape", "v dtype",
             "mask dtype", "mask shape", "causal", "sliding_window", "scale", "softcap", "sinks", "alibi_slopes",
             "return_lse", "backend"]


@st.composite
def flash_case(draw, d=st.sampled_from([16, 64]), max_tokens=8, dtypes=ATTENTION_DTYPES, spoil=True):
    shape = dict(b=draw(st.integers(1, 2)), hkv=draw(st.integers(1, 2)), group=draw(st.integers(1, 3)),
                 lq=draw(st.integers(1, max_tokens)), lk=draw(st.integers(1, max_tokens)), d=draw(d))
    opts = dict(causal=draw(st.booleans()), sliding_window=draw(st.one_of(st.none(), st.integers(1, max_tokens))),
                mask=draw(st.sampled_from([None, "bool", "additive", "none visible"])),
                scale=draw(st.sampled_from([None, 0.05, 1])), softcap=draw(st.sampled_from([None, 3.0])),
                sinks=draw(st.booleans()), alibi_slopes=draw(st.booleans()), return_lse=draw(st.booleans()))
    layouts = draw(st.tuples(*[st.sampled_from(LAYOUTS)] * 3))
    bad = draw(st.sampled_from([None] * 8 + BAD_FLASH)) if spoil else None
    return shape, draw(st.sampled_from(dtypes)), opts, layouts, bad, draw(st.integers(0, 2**31 - 1))


def flash_inputs(shape, dtype, opts, seed):
    gen = torch.Generator().manual_seed(seed)
    b, hkv, lq, lk, d = shape["b"], shape["hkv"], shape["lq"], shape["lk"], shape["d"]
    hq = hkv * shape["group"]
    q, k, v = randn(gen, b, hq, lq, d, dtype=dtype), randn(gen, b, hkv, lk, d, dtype=dtype), \
        randn(gen, b, hkv, lk, d, dtype=dtype)
    kw = dict(opts)
    kind = kw.pop("mask")
    kw["mask"] = {None: None, "bool": torch.rand(b, 1, lq, lk, generator=gen) < 0.7,
                  "additive": torch.randn(1, hq, lq, lk, generator=gen),
                  "none visible": torch.zeros(lq, lk, dtype=torch.bool)}[kind]
    kw["sinks"] = randn(gen, hq) if kw["sinks"] else None
    kw["alibi_slopes"] = torch.rand(hq, generator=gen) if kw["alibi_slopes"] else None
    return q, k, v, kw


def flash_spoiled(bad, q, k, v, kw):
    """flash_attention's arguments with one mistake, and the argument its error must name."""
    b, hq, lq, _ = q.shape
    kw = dict(kw)
    other = torch.float16 if q.dtype != torch.float16 else torch.float32
    if bad == "q tokens":
        q = q[:, :, :0]
    elif bad == "k tokens":
        k, v = k[:, :, :0], v[:, :, :0]
    elif bad == "q dtype":
        q, k, v = q.double(), k.double(), v.double()
    elif bad == "q int":
        q = q.to(torch.int32)
    elif bad == "q dims":
        q = q[0]
    elif bad == "k heads":  # hq + 1 KV heads never divide hq
        k = torch.zeros(b, hq + 1, *k.shape[2:], dtype=k.dtype)
        v = torch.zeros_like(k)
    elif bad == "k meta":
        k = k.to("meta")
    elif bad == "v shape":
        v = v[..., :1, :]
    elif bad == "v dtype":
        v = v.to(other)
    elif bad == "mask dtype":
        kw["mask"] = torch.ones(lq, k.shape[2], dtype=torch.int64)
    elif bad == "mask shape":
        kw["mask"] = torch.ones(lq + 1, k.shape[2] + 1, dtype=torch.bool)
    else:
        kw[bad] = {"causal": "no", "sliding_window": True, "scale": "0.1", "softcap": 0.0,
                   "sinks": torch.zeros(hq + 1), "alibi_slopes": torch.ones(hq, dtype=torch.int64),
                   "return_lse": 1, "backend": "cuda"}[bad]
    return (q, k, v), kw, bad.split()[0]


def flash_reference(q, k, v, kw):
    """float64 out and LSE (tests/naive.py), and the bound on the PyTorch path's error (float32 attention,
    then one rounding to q's dtype)."""
    kw = {name: x for name, x in kw.items() if name != "return_lse"}
    ref, lse = naive_attention(q, k, v, **kw)
    extra = kw["softcap"] or 0.0
    if kw["alibi_slopes"] is not None:
        extra += float(kw["alibi_slopes"].abs().max()) * (q.shape[2] + k.shape[2])
    if kw["mask"] is not None and kw["mask"].dtype != torch.bool:
        extra += float(kw["mask"].abs().max())
    tol = float32_attention_tolerance(q, k, v, kw["scale"], extra_logit=extra)
    tol += UNIT_ROUNDOFF[q.dtype] * float(v.double().abs().max())
    return ref, lse, tol


@fuzz(300)
@given(case=flash_case())
@example(case=(dict(b=1, hkv=1, group=2, lq=3, lk=4, d=16),  torch.float32,
               dict(causal=False, sliding_window=None, mask="none visible", scale=None, softcap=None, sinks=False,
                    alibi_slopes=False, return_lse=True), ("contiguous",) * 3, None, 0))  # all-zero mask: zeros
@example(case=(dict(b=1, hkv=2, group=2, lq=3, lk=4, d=16), torch.float32,
               dict(causal=True, sliding_window=None, mask=None, scale=None, softcap=None, sinks=False,
                    alibi_slopes=False, return_lse=False), ("contiguous",) * 3, "k heads", 0))  # 4 q heads, 5 kv
@example(case=(dict(b=1, hkv=1, group=1, lq=2, lk=2, d=16), torch.float32,
               dict(causal=True, sliding_window=None, mask=None, scale=None, softcap=None, sinks=False,
                    alibi_slopes=False, return_lse=False), ("contiguous",) * 3, "mask dtype", 0))  # 0/1 int mask
@example(case=(dict(b=1, hkv=1, group=1, lq=2, lk=2, d=16), torch.float32,
               dict(causal=True, sliding_window=None, mask=None, scale=None, softcap=None, sinks=False,
                    alibi_slopes=False, return_lse=False), ("contiguous",) * 3, "causal", 0))  # causal="no"
@example(case=(dict(b=1, hkv=1, group=1, lq=1, lk=1, d=16), torch.float32,
               dict(causal=False, sliding_window=None, mask=None, scale=None, softcap=None, sinks=False,
                    alibi_slopes=False, return_lse=False), ("contiguous",) * 3, "mask shape", 0))  # [2, 2] mask
def test_flash_attention(case):
    shape, dtype, opts, layouts, bad, seed = case
    q, k, v, kw = flash_inputs(shape, dtype, opts, seed)
    if bad is not None:
        args, kw, name = flash_spoiled(bad, q, k, v, kw)
        return assert_refused(lambda: ta.flash_attention(*args, **kw), name)
    want = ta.flash_attention(q, k, v, backend="torch", **kw)
    got = ta.flash_attention(*(laid_out(x, lay) for x, lay in zip((q, k, v), layouts)), backend="torch", **kw)
    out, lse = (got if kw["return_lse"] else (got, None))
    assert all(torch.equal(a, b) for a, b in zip(got if kw["return_lse"] else (got,),
                                                 want if kw["return_lse"] else (want,)))
    assert out.shape == q.shape and out.dtype == q.dtype and not bool(out.isnan().any())
    ref, ref_lse, tol = flash_reference(q, k, v, kw)
    err = float((out.double() - ref).abs().max())
    assert err <= tol, (err, tol)
    dead = ref_lse == -math.inf
    assert bool((out[dead] == 0).all()), "a row with no visible key must output zeros"
    if lse is not None:
        assert torch.equal(lse == -math.inf, dead)


def test_flash_attention_on_meta_tensors_gives_shapes():
    q, kv = torch.zeros(1, 4, 3, 64, device="meta"), torch.zeros(1, 2, 5, 64, device="meta")
    out, lse = ta.flash_attention(q, kv, kv, causal=True, return_lse=True, backend="torch")
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (1, 4, 3)


@needs_interpreter
@fuzz(20)
@given(case=flash_case(d=st.just(64), max_tokens=5, dtypes=(torch.float16, torch.float32), spoil=False))
def test_flash_attention_triton(case):
    shape, dtype, opts, layouts, _, seed = case
    q, k, v, kw = flash_inputs(shape, dtype, opts, seed)
    kw["return_lse"] = False
    got = ta.flash_attention(*(laid_out(x, lay) for x, lay in zip((q, k, v), layouts)), backend="triton", **kw)
    ref, ref_lse, _ = flash_reference(q, k, v, kw)
    assert got.shape == q.shape and not bool(got.isnan().any())
    dead = ref_lse == -math.inf
    assert bool((got[dead] == 0).all())
    if bool((~dead).any()):
        assert rel_err(got, ref) < TOL[dtype]


# -- cached_attention ----------------------------------------------------------------------------------

BAD_CACHED = ["q tokens", "q dtype", "q int", "q dims", "q head_dim", "q heads", "q meta", "k alone", "k tokens",
              "k dtype", "cache", "scale", "softcap", "sinks", "num_splits", "backend"]


@st.composite
def cached_case(draw, dtypes=ATTENTION_DTYPES, spoil=True):
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    ring = draw(st.booleans())
    window = draw(st.integers(1, 6)) if ring else None
    chunks = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    static = draw(st.booleans())
    # A static cache may have overflowed (it keeps what fits); a growing one is sized to hold everything.
    capacity = None if ring else (draw(st.integers(1, 12)) if static else sum(chunks))
    pad = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
    tq = draw(st.integers(1, 3))
    opts = dict(scale=draw(st.sampled_from([None, 0.1])), softcap=draw(st.sampled_from([None, 4.0])),
                sinks=draw(st.booleans()), num_splits=draw(st.sampled_from([None, 1, 2])))
    fresh, layout = draw(st.booleans()), draw(st.sampled_from(LAYOUTS))
    bits = draw(st.sampled_from(SUPPORTED_BITS)), draw(st.sampled_from(SUPPORTED_BITS))
    bad = draw(st.sampled_from([None] * 6 + BAD_CACHED)) if spoil else None
    return (dict(b=b, hkv=hkv, group=group, window=window, chunks=chunks, static=static, capacity=capacity, pad=pad,
                 tq=tq, fresh=fresh, bits=bits), draw(st.sampled_from(dtypes)), opts, layout, bad,
            draw(st.integers(0, 2**31 - 1)))


def cached_inputs(c, dtype, opts, seed):
    gen = torch.Generator().manual_seed(seed)
    codec = ta.KVCodec(64, *c["bits"])
    cache = ta.QuantizedKVCache(codec, c["b"], c["hkv"], capacity=c["capacity"], sliding_window=c["window"],
                                static=c["static"])
    for t in c["chunks"]:
        cache.append(randn(gen, c["b"], c["hkv"], t, 64), randn(gen, c["b"], c["hkv"], t, 64), backend="torch")
    cache.set_left_padding(c["pad"])
    q = randn(gen, c["b"], c["hkv"] * c["group"], c["tq"], 64, dtype=dtype)
    k = v = None
    if c["fresh"]:
        k, v = (randn(gen, c["b"], c["hkv"], c["tq"], 64, dtype=dtype) for _ in range(2))
    kw = dict(opts)
    kw["sinks"] = randn(gen, q.shape[1]) if kw["sinks"] else None
    return cache, q, k, v, kw


def cached_spoiled(bad, cache, q, k, v, kw):
    kw = dict(kw)
    b, hq, tq, d = q.shape
    fresh = lambda x: torch.zeros(b, cache.num_kv_heads, tq, d) if x is None else x  # noqa: E731
    if bad == "q tokens":
        q = q[:, :, :0]
    elif bad == "q dtype":
        q = q.double()
    elif bad == "q int":
        q = q.to(torch.int64)
    elif bad == "q dims":
        q = q[0]
    elif bad == "q head_dim":
        q = q[..., :32]
    elif bad == "q heads":  # hq + 1 query heads over Hkv KV heads: a ratio that does not divide unless Hkv = 1
        q = torch.zeros(b, hq + 1 if cache.num_kv_heads > 1 else 0, tq, d)
        if cache.num_kv_heads == 1:
            return None  # any head count divides 1
    elif bad == "q meta":
        meta = ta.QuantizedKVCache(cache.codec, b, cache.num_kv_heads, capacity=4, device="meta")
        return (q.to("meta"), meta, None, None), {}, "q"
    elif bad == "k alone":
        k, v = fresh(k).to(q.dtype), None
    elif bad == "k tokens":
        k, v = fresh(k)[:, :, :0].to(q.dtype), fresh(v)[:, :, :0].to(q.dtype)
    elif bad == "k dtype":
        other = torch.float16 if q.dtype != torch.float16 else torch.float32
        k, v = fresh(k).to(other), fresh(v).to(other)
    elif bad == "cache":
        cache = cache.layout
    else:
        kw[bad] = {"scale": -1.0, "softcap": float("inf"), "sinks": [0.0] * hq, "num_splits": True,
                   "backend": "gpu"}[bad]
    return (q, cache, k, v), kw, bad.split()[0]


def cached_reference(cache, q, k, v, kw):
    """float64 attention over what the cache holds (its float64 decoding) plus the fresh tokens, and the
    PyTorch path's bound: float32 attention and float32 decoding (test_cached_attention.py), then one
    rounding to q's dtype.  The bound's magnitudes are taken over every slot, a superset of those seen."""
    ref = cached_attention_naive(q, cache.layout, cache.codec, k, v, scale=kw["scale"], softcap=kw["softcap"],
                                 sinks=kw["sinks"], compute_dtype=torch.float64)
    keys, vals = cache.dequantize(torch.float64)
    if k is not None:
        keys, vals = torch.cat([keys, k.double()], 2), torch.cat([vals, v.double()], 2)
    tol = float32_attention_tolerance(q, keys, vals, kw["scale"], extra_logit=kw["softcap"] or 0.0,
                                      kv_rel_error=2 * (math.log2(64) + 2) * U32)
    return ref, tol + UNIT_ROUNDOFF[q.dtype] * float(vals.abs().max())


@fuzz(250)
@given(case=cached_case())
@example(case=(dict(b=2, hkv=2, group=1, window=3, chunks=[5, 4], static=False, capacity=None, pad=[0, 2], tq=2,
                    fresh=True, bits=(4, 4)), torch.float32, dict(scale=None, softcap=None, sinks=False,
                                                                  num_splits=None), "transposed", None, 0))  # ring
@example(case=(dict(b=1, hkv=2, group=2, window=None, chunks=[2], static=False, capacity=2, pad=[0], tq=1,
                    fresh=False, bits=(4, 4)), torch.float32, dict(scale=None, softcap=None, sinks=False,
                                                               num_splits=None), "contiguous", "q heads", 0))
@example(case=(dict(b=1, hkv=1, group=1, window=None, chunks=[2], static=False, capacity=2, pad=[0], tq=1,
                    fresh=False, bits=(4, 4)), torch.float32, dict(scale=None, softcap=None, sinks=False,
                                                               num_splits=None), "contiguous", "num_splits", 0))
def test_cached_attention(case):
    c, dtype, opts, layout, bad, seed = case
    cache, q, k, v, kw = cached_inputs(c, dtype, opts, seed)
    if bad is not None:
        spoiled = cached_spoiled(bad, cache, q, k, v, kw)
        if spoiled is not None:
            args, kw, name = spoiled
            assert_refused(lambda: ta.cached_attention(*args, **kw), name)
        return
    want = ta.cached_attention(q, cache, k, v, backend="torch", **kw)
    lay = lambda x: None if x is None else laid_out(x, layout)  # noqa: E731
    got = ta.cached_attention(lay(q), cache, lay(k), lay(v), backend="torch", **kw)
    assert torch.equal(got, want)
    assert got.shape == q.shape and got.dtype == q.dtype and not bool(got.isnan().any())
    ref, tol = cached_reference(cache, q, k, v, kw)
    err = float((got.double() - ref).abs().max())
    assert err <= tol, (err, tol)


@needs_interpreter
@fuzz(15)
@given(case=cached_case(dtypes=(torch.float16,), spoil=False))
def test_cached_attention_triton(case):
    c, dtype, opts, layout, _, seed = case
    cache, q, k, v, kw = cached_inputs(c, dtype, opts, seed)
    lay = lambda x: None if x is None else laid_out(x, layout)  # noqa: E731
    got = ta.cached_attention(lay(q), cache, lay(k), lay(v), backend="triton", **kw)
    ref = cached_attention_naive(q, cache.layout, cache.codec, k, v, scale=kw["scale"], softcap=kw["softcap"],
                                 sinks=kw["sinks"], compute_dtype=torch.float64)
    assert got.shape == q.shape and not bool(got.isnan().any())
    if float(ref.norm()) > 0:
        assert _rel(got, ref) < FP16_TOL + 2.0**-11
    else:
        assert bool((got == 0).all())


# -- TurboQuantCache -----------------------------------------------------------------------------------

BAD_HF = {"config": [None, {}, "llama"], "k_bits": [7, 4.0, "4"], "v_bits": [1, True], "scale_rule": ["max"],
          "quantize_current": ["yes", 1], "max_cache_len": [0, True, 8.0], "fit_keys": ["on", True]}


@fuzz(40)
@given(k_bits=st.sampled_from(SUPPORTED_BITS), v_bits=st.sampled_from(SUPPORTED_BITS),
       scale_rule=st.sampled_from(codec_mod.SCALE_RULES), quantize_current=st.booleans(),
       max_cache_len=st.sampled_from([None, 16]), fit_keys=st.sampled_from(["off", "center", "balance"]),
       model=st.sampled_from(["llama", "gemma3"]), bad=st.sampled_from([None] * 3 + sorted(BAD_HF)),
       data=st.data())
@example(k_bits=4, v_bits=4, scale_rule="corrected", quantize_current=False, max_cache_len=None, fit_keys="center",
         model="llama", bad="config", data=None)  # config=None
def test_turboquant_cache(k_bits, v_bits, scale_rule, quantize_current, max_cache_len, fit_keys, model, bad, data):
    """The constructor's arguments, then a prefill and a decode step through one layer (ring or not): the
    attention function gives flash_attention on the prefill and cached_attention on the step, bit for bit."""
    pytest.importorskip("transformers")
    from turboattn.hf import TurboQuantCache, turboattn_attention

    config = _tiny_config(model)
    kw = dict(k_bits=k_bits, v_bits=v_bits, scale_rule=scale_rule, quantize_current=quantize_current,
              max_cache_len=max_cache_len, fit_keys=fit_keys)
    if bad is not None:
        value = data.draw(st.sampled_from(BAD_HF[bad])) if data is not None else BAD_HF[bad][0]
        if bad == "config":
            config = value
        else:
            kw[bad] = value
        return assert_refused(lambda: TurboQuantCache(config, **kw), bad)
    cache = TurboQuantCache(config, **kw)
    assert len(cache.layers) == config.num_hidden_layers
    for layer in cache.layers:
        assert (layer.k_bits, layer.v_bits, layer.scale_rule, layer.quantize_current, layer.max_cache_len,
                layer.fit_keys) == (k_bits, v_bits, scale_rule, quantize_current, max_cache_len, fit_keys)

    layer = cache.layers[0]
    window = layer.sliding_window
    b, hkv, group, t = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), \
        data.draw(st.integers(1, 20))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q, k, v = randn(gen, b, hkv * group, t, 64), randn(gen, b, hkv, t, 64), randn(gen, b, hkv, t, 64)
    module = torch.nn.Module()
    layer.update(k, v)
    out, _ = turboattn_attention(module, q, k, v, None, sliding_window=window)
    want = ta.flash_attention(q, k, v, causal=True, sliding_window=window).transpose(1, 2)
    assert torch.equal(out, want)
    q1, k1, v1 = randn(gen, b, hkv * group, 1, 64), randn(gen, b, hkv, 1, 64), randn(gen, b, hkv, 1, 64)
    want = None if quantize_current else ta.cached_attention(q1, layer.cache, k1, v1).transpose(1, 2)
    layer.update(k1, v1)
    out, _ = turboattn_attention(module, q1, k1, v1, None, sliding_window=window)
    assert out.shape == (b, 1, hkv * group, 64) and bool(out.isfinite().all())
    if want is not None:
        assert torch.equal(out, want)
    assert layer.cache.seen.tolist() == [t + 1] * b


_CONFIGS = {}


def _tiny_config(model: str):
    """The config of a tiny model of tests/hf_models.py (llama: full layers; gemma3: a ring of 8 first)."""
    if model not in _CONFIGS:
        import hf_models

        _CONFIGS[model] = {"llama": hf_models.tiny_llama, "gemma3": hf_models.tiny_gemma3}[model]().config
    return _CONFIGS[model]


# -- regressions the fuzzer found (before: a crash from inside torch, or a silent wrong result) -------

def test_a_mask_may_not_stretch_q_or_k():
    """A [2, 2] mask over Lq = Lk = 1 used to broadcast the output to 2 query rows."""
    x = torch.zeros(1, 1, 1, 64)
    assert_refused(lambda: ta.flash_attention(x, x, x, mask=torch.ones(2, 2, dtype=torch.bool)), "mask")


@pytest.mark.parametrize("heads", [(0, 1), (1, 0)])
def test_flash_attention_needs_a_head(heads):
    """Zero heads used to raise ZeroDivisionError."""
    q, k = torch.zeros(1, heads[0], 2, 64), torch.zeros(1, heads[1], 2, 64)
    assert_refused(lambda: ta.flash_attention(q, k, k), "q" if heads[0] == 0 else "k")


@pytest.mark.parametrize("name", ["sinks", "alibi_slopes"])
def test_integer_sinks_and_slopes_are_refused(name):
    x = torch.zeros(1, 2, 2, 64)
    assert_refused(lambda: ta.flash_attention(x, x, x, **{name: torch.zeros(2, dtype=torch.int64)}), name)


def test_cache_lengths_must_be_ints():
    """1.5 used to be truncated to 1, and '1' read as 1."""
    cache = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=1, num_kv_heads=1, capacity=4)
    k = torch.zeros(1, 1, 2, 64)
    for lengths in ([1.5], ["1"], [True], 1, torch.tensor([1.0])):
        assert_refused(lambda: cache.append(k, k, new_lengths=lengths), "new_lengths")
    for pad in ([1.5], [True]):
        assert_refused(lambda: cache.set_left_padding(pad), "num_padding")
    cache.set_left_padding(torch.tensor([1]))  # integer tensors and lists stay fine
    cache.append(k, k, new_lengths=torch.tensor([1], dtype=torch.int32))
    assert cache.seen.tolist() == [1] and cache.starts.tolist() == [1]


def test_cache_device_string_is_checked():
    """An unknown device string used to raise torch's RuntimeError."""
    assert_refused(lambda: ta.QuantizedKVCache(ta.KVCodec(64), 1, 1, capacity=4, device="gpu0"), "device")


def test_dequantize_takes_a_floating_dtype():
    """dtype=torch.int32 used to return truncated integers; "float32" to raise torch's RuntimeError."""
    codec = ta.KVCodec(64)
    packed = codec.quantize(torch.randn(3, 64))
    for dtype in (torch.int32, "float32"):
        assert_refused(lambda: codec.dequantize(packed, "k", dtype), "dtype")


def test_transposed_input_codes_like_its_contiguous_copy(gen):
    """The lsq scale used to differ in the last bit for a transposed input (a reduction over strides)."""
    codec = ta.KVCodec(128, 4, 2, "lsq")
    x = torch.randn(4, 3, 128, generator=gen)
    got, want = codec.quantize(x.mT.contiguous().mT, "v"), codec.quantize(x, "v")
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
