"""The lean eager decode step: a cached_attention call that repeats the last one's signature on a cache goes straight
to the implementation's launcher (attention.py's _DecodeStep), and _append_validated appends through launchers made
once per layout.  Both must do exactly what the general path does: the same outputs, the same cache state, the same
errors for bad input, and nothing kept past an edit of the cache or of the backend registry."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import turboattn as ta
import turboattn.attention
from turboattn.ops import backend

OPTIONS = [dict(), dict(static=True), dict(sliding_window=24), dict(exact_recent=4, exact_first=2),
           dict(static=True, exact_recent=4, exact_first=2), dict(key_transform=True)]
IDS = ["growing", "static", "ring", "exact-rows", "static-exact-rows", "key-transform"]


def _twins(gen, options, tokens=10, b=2, hkv=2, d=64):
    """Two caches in the same state (the same appends), a fresh q, k, v of one decode step."""
    options = dict(options)
    transform = options.pop("key_transform", False)
    caches = []
    k, v = (torch.randn(b, hkv, tokens, d, generator=gen) for _ in range(2))
    shift, gain = torch.randn(b, hkv, d, generator=gen), torch.rand(b, hkv, d, generator=gen) + 0.5
    for _ in range(2):
        capacity = None if "sliding_window" in options else 40
        cache = ta.QuantizedKVCache(ta.KVCodec(d, 4, 3), b, hkv, capacity=capacity, **options)
        if transform:
            cache.set_key_transform(shift, gain)
        cache.append(k, v)
        caches.append(cache)
    q = torch.randn(b, 4 * hkv, 1, d, generator=gen)
    fresh = tuple(torch.randn(b, hkv, 1, d, generator=gen) for _ in range(2))
    return caches, q, fresh


def _state(cache):
    layout = cache.layout
    tensors = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
    return tensors, cache._seen_host, cache.is_empty


def _assert_same_state(a, b):
    (ta_, sa, ea), (tb, sb, eb) = _state(a), _state(b)
    assert (sa, ea) == (sb, eb)
    for name, x in ta_.items():
        y = tb[name]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:
            assert x == y, name


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
@pytest.mark.parametrize("tokens", [1, 10])
def test_a_repeated_call_goes_to_the_launcher_with_the_same_output(options, tokens, gen, monkeypatch):
    """The second call of a signature skips the checks and the choice of implementation (choose is not asked) and
    returns what the general path returns on a cache in the same state; a decode loop's appends through
    _append_validated leave what append leaves (from 1 token held: the first exact rows are written on the way)."""
    (fast, general), q, (k, v) = _twins(gen, options, tokens)
    for step in range(6):
        want = ta.cached_attention(q, general, k, v, scale=0.125)
        general.append(k, v)
        if step == 0:
            got = ta.cached_attention(q, fast, k, v, scale=0.125)
            assert fast._attention_step is not None
            monkeypatch.setattr(turboattn.attention, "choose", lambda *a: pytest.fail("not the prepared step"))
        else:
            got = ta.cached_attention(q, fast, k, v, scale=0.125)
        fast._append_validated(k, v)
        assert torch.equal(got, want), step
        _assert_same_state(fast, general)
        q = torch.randn(q.shape, generator=gen)
        k, v = torch.randn(k.shape, generator=gen), torch.randn(v.shape, generator=gen)


def _bad_calls(q, k, v):
    """(name, keyword arguments of cached_attention) that each fail one check; the rest are the step's."""
    good = dict(q=q, k=k, v=v, scale=0.125)
    return [
        ("k, v dtype", dict(good, k=k.half(), v=v.half())),
        ("k dtype", dict(good, k=k.half())),
        ("v dtype", dict(good, v=v.double())),
        ("q dtype", dict(good, q=q.to(torch.int32))),
        ("k, v shape", dict(good, k=k[:, :1], v=v[:, :1])),
        ("k shape", dict(good, k=torch.cat([k, k], 3))),
        ("v shape", dict(good, v=torch.cat([v, v], 2))),
        ("q shape", dict(good, q=q[:1])),
        ("q heads", dict(good, q=q[:, :3])),
        ("q meta", dict(good, q=q.to("meta"))),
        ("k, v meta", dict(good, k=k.to("meta"), v=v.to("meta"))),
        ("k meta", dict(good, k=k.to("meta"))),
        ("v meta", dict(good, v=v.to("meta"))),
        ("k list", dict(good, k=k.tolist())),
        ("v missing", dict(good, v=None)),
        ("scale bool", dict(good, scale=True)),
        ("scale nan", dict(good, scale=float("nan"))),
        ("scale negative", dict(good, scale=-0.125)),
        ("softcap", dict(good, softcap=0.0)),
        ("sinks", dict(good, sinks=torch.zeros(3))),
        ("num_splits", dict(good, num_splits=0)),
        ("plan", dict(good, plan="a plan")),
        ("backend", dict(good, backend="cuda-please")),
    ]


@pytest.mark.parametrize("options", OPTIONS[:2], ids=IDS[:2])
def test_a_repeated_call_is_checked_like_a_first_one(options, gen):
    """Every input that a cache without a prepared step refuses, a cache with one refuses with the same error."""
    (fast, fresh), q, (k, v) = _twins(gen, options)
    ta.cached_attention(q, fast, k, v, scale=0.125)
    assert fast._attention_step is not None
    for name, call in _bad_calls(q, k, v):
        errors = []
        for cache in (fresh, fast):
            with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
                ta.cached_attention(cache=cache, **call)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1], name


def test_a_scale_equal_to_the_steps_but_no_float_is_checked(gen):
    """True == 1.0 and 1 == 1.0: a bool scale is refused and an int one served, as on a first call."""
    (fast, general), q, (k, v) = _twins(gen, {})
    ta.cached_attention(q, fast, k, v, scale=1.0)
    for cache in (fast, general):
        with pytest.raises(ValueError, match="scale must be a positive finite float"):
            ta.cached_attention(q, cache, k, v, scale=True)
    assert torch.equal(ta.cached_attention(q, fast, k, v, scale=1), ta.cached_attention(q, general, k, v, scale=1))


def test_a_call_of_another_signature_is_served_and_prepares_its_own(gen):
    """Another scale, a chunk of two tokens, fresh k, v absent: each goes the general way (same output as a fresh
    cache) and the cache keeps the step of its last call with fresh k, v."""
    (fast, general), q, (k, v) = _twins(gen, {})
    ta.cached_attention(q, fast, k, v, scale=0.125)
    q2, k2, v2 = torch.cat([q, q], 2), torch.cat([k, k], 2), torch.cat([v, v], 2)
    for args, kwargs in [((q, k, v), dict(scale=0.25)), ((q, k, v), dict(scale=None)), ((q2, k2, v2), {}),
                         ((q,), {}), ((q, k, v), dict(scale=0.125)), ((q, k, v), dict(scale=0.125, num_splits=2))]:
        got = ta.cached_attention(args[0], fast, *args[1:], **kwargs)
        want = ta.cached_attention(args[0], general, *args[1:], **kwargs)
        assert torch.equal(got, want), kwargs
    assert fast._attention_step.q_shape == q.shape and fast._attention_step.scale == 0.125


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_edits_and_the_registry_drop_what_a_step_derived(static, gen):
    """An edit that replaces the cache's tensors (reserve, a batch edit, a new key transform, reset) drops the
    prepared step and the append launchers; so does a change of the registry.  The next steps then match a cache
    that never had them."""
    (fast, general), q, (k, v) = _twins(gen, dict(static=static))

    def step_both(q, k, v):
        want = ta.cached_attention(q, general, k, v)
        general.append(k, v)
        got = ta.cached_attention(q, fast, k, v)
        fast._append_validated(k, v)
        assert torch.equal(got, want)
        _assert_same_state(fast, general)

    step_both(q, k, v)
    step_both(q, k, v)
    def new_transform(cache):   # on the emptied cache: its keys are coded with it from the next append on
        cache.reset()
        cache.set_key_transform(torch.randn(2, 2, 64, generator=seeded(1)), torch.full((2, 2, 64), 2.0))

    def seeded(n):
        return torch.Generator().manual_seed(n)
    edits = [lambda c: c.batch_select_indices([1, 1]), lambda c: c.reset(), new_transform]
    if not static:
        edits.insert(0, lambda c: c.reserve(64))
    for edit in edits:
        for cache in (fast, general):
            edit(cache)
        assert fast._attention_step is None and fast._append_launches is None
        step_both(q, k, v)
        step_both(q, k, v)
    impl = backend._REGISTRY["cached_attention"]["torch"]
    backend.register(impl.op, impl.name, impl.target, priority=impl.priority, devices=impl.devices,
                     requires=impl.requires, head_dims=impl.head_dims, grouped_keys=impl.grouped_keys)
    assert fast._attention_step.generation != backend.generation
    step_both(q, k, v)
    assert fast._attention_step.generation == backend.generation


def test_a_full_growing_cache_refuses_a_decode_steps_append(gen):
    """_append_validated raises append's ValueError at the capacity, before anything is written."""
    (fast, general), q, (k, v) = _twins(gen, {}, tokens=39)
    fast._append_validated(k, v)
    general.append(k, v)
    for cache in (fast, general):
        with pytest.raises(ValueError, match="would overflow the cache: a sequence would hold 41 tokens"):
            (cache._append_validated if cache is fast else cache.append)(k, v)
    _assert_same_state(fast, general)


# -- the CUDA launchers, on the CPU: what they hand the extension -----------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="ops/cached/cuda.py imports the Triton kernels")


class _Recorder:
    """The CUDA extension, recording each call's arguments (nothing runs)."""

    def __init__(self):
        self.calls = []

    def decode(self, q, *args):
        self.calls.append(("decode", (q, *args)))
        return torch.empty_like(q)

    def quantize_append(self, *args):
        self.calls.append(("quantize_append", args))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a is b or (
            a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)))
    return type(a) is type(b) and a == b


@needs_triton
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
@pytest.mark.parametrize("scale,softcap", [(None, None), (0.1, 30.0)])
def test_the_cuda_launchers_hand_the_extension_what_the_wrappers_do(options, scale, softcap, gen, monkeypatch):
    """cuda.decode_launcher and quantize/cuda.append_launcher (a decode step's launches, their arguments derived once)
    call the extension with the arguments of cached_attention_cuda and quantize_append_cuda for the same call; inputs
    of other strides go through the wrappers."""
    from turboattn.ops.cached import cuda
    from turboattn.ops.cached.config import plan_decode
    from turboattn.ops.quantize import cuda as quantize_cuda
    recorder = _Recorder()
    for module in (cuda, quantize_cuda):
        monkeypatch.setattr(module, "extension", lambda: recorder)
        monkeypatch.setattr(module, "capable", lambda device: True)
    (cache, _), q, (k, v) = _twins(gen, options)
    q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    layout, codec = cache.layout, cache.codec
    plan = plan_decode(q.device, 64, 4, 3, 4, 4, 40, None, None, "cuda", layout.exact_row_count)

    def recorded(call):
        recorder.calls.clear()
        call()
        assert len(recorder.calls) == 1
        return recorder.calls[0]

    def assert_same(want, got):
        assert want[0] == got[0] and len(want[1]) == len(got[1])
        for i, (a, b) in enumerate(zip(want[1], got[1])):
            assert _same(a, b), (want[0], i)

    decode = cuda.decode_launcher(q, layout, codec, scale, softcap)
    append = quantize_cuda.append_launcher(layout, codec)
    strided = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v)]
    for qq, kk, vv in [(q, k, v), tuple(strided)]:
        assert_same(recorded(lambda: cuda.cached_attention_cuda(qq, layout, codec, kk, vv, scale, softcap, None, plan)),
                    recorded(lambda: decode(qq, kk, vv, plan)))
        assert_same(recorded(lambda: quantize_cuda.quantize_append_cuda(kk, vv, layout, codec, None)),
                    recorded(lambda: append(kk, vv)))
