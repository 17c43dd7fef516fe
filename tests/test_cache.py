"""QuantizedKVCache storage: contiguous and ring layouts, ragged appends, padding, sizes; crop, batch edits, reset;
static mode (lengths on the device only: overflow flag, fixed storage)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import turboattn as ta


def kv(gen, b, hkv, t, d, dtype=torch.float32):
    return (torch.randn(b, hkv, t, d, generator=gen).to(dtype), torch.randn(b, hkv, t, d, generator=gen).to(dtype))


def assert_slot_holds(cache, b, slot, k_token, v_token):
    """Slot `slot` of sequence b holds exactly the codec's coding of k_token, v_token [Hkv, D]."""
    pk, pv = cache.codec.quantize(k_token, "k"), cache.codec.quantize(v_token, "v")
    assert torch.equal(cache.k_codes[b, :, slot], pk.codes) and torch.equal(cache.k_scales[b, :, slot], pk.scales)
    assert torch.equal(cache.v_codes[b, :, slot], pv.codes) and torch.equal(cache.v_scales[b, :, slot], pv.scales)


def test_contiguous_appends_store_every_token(gen):
    codec = ta.KVCodec(64, 5, 3)
    b, hkv, cap = 2, 3, 20
    cache = ta.QuantizedKVCache(codec, batch_size=b, num_kv_heads=hkv, capacity=cap)
    ks, vs = [], []
    for t in (1, 4, 2, 7, 6):  # Hkv != T for most chunks: a transposed write would show
        k, v = kv(gen, b, hkv, t, 64)
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
        total = sum(x.shape[2] for x in ks)
        assert cache.lengths.tolist() == [total] * b
        all_k, all_v = torch.cat(ks, 2), torch.cat(vs, 2)
        pk, pv = codec.quantize(all_k, "k"), codec.quantize(all_v, "v")
        assert torch.equal(cache.k_codes[:, :, :total], pk.codes) and torch.equal(cache.k_scales[:, :, :total], pk.scales)
        assert torch.equal(cache.v_codes[:, :, :total], pv.codes) and torch.equal(cache.v_scales[:, :, :total], pv.scales)
        assert bool((cache.k_codes[:, :, total:] == 0).all())
        expected_pos = torch.where(torch.arange(cap) < total, torch.arange(cap), -1)
        assert torch.equal(cache.slot_positions(), expected_pos.expand(b, cap))
    k_hat, v_hat = cache.dequantize()
    assert torch.equal(k_hat[:, :, :total], codec.dequantize(pk, "k")) and torch.equal(v_hat[:, :, :total], codec.dequantize(pv, "v"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_append_accepts_each_input_dtype(dtype, gen):
    codec = ta.KVCodec(128, 4, 4)
    cache = ta.QuantizedKVCache(codec, batch_size=1, num_kv_heads=2, capacity=8)
    k, v = kv(gen, 1, 2, 3, 128, dtype)
    cache.append(k, v)
    for t in range(3):
        assert_slot_holds(cache, 0, t, k[0, :, t].float(), v[0, :, t].float())


def test_ragged_appends(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = ta.QuantizedKVCache(codec, batch_size=3, num_kv_heads=2, capacity=16)
    history = [[] for _ in range(3)]
    for new in ([3, 0, 5], [5, 2, 0], [1, 1, 1], torch.tensor([0, 5, 2])):
        k, v = kv(gen, 3, 2, 5, 64)
        cache.append(k, v, new_lengths=new)
        for b, n in enumerate(list(map(int, new))):
            history[b] += [(k[b, :, t], v[b, :, t]) for t in range(n)]  # the first n are real
    assert cache.lengths.tolist() == [len(h) for h in history] == [9, 8, 8]
    for b, h in enumerate(history):
        for slot, (k_t, v_t) in enumerate(h):
            assert_slot_holds(cache, b, slot, k_t, v_t)
        assert cache.slot_positions()[b].tolist() == list(range(len(h))) + [-1] * (16 - len(h))
        assert bool((cache.k_codes[b, :, len(h):] == 0).all())  # padding tokens were not written


@pytest.mark.parametrize("window", [1, 5])
def test_ring_holds_the_last_w_tokens_in_order(window, gen):
    codec = ta.KVCodec(64, 3, 2)
    b, hkv = 2, 2
    cache = ta.QuantizedKVCache(codec, batch_size=b, num_kv_heads=hkv, sliding_window=window)
    assert cache.capacity == window and cache.is_ring
    history = [[] for _ in range(b)]
    for t, new in ((1, None), (3, [3, 2]), (7, None), (2, [0, 2]), (5, [5, 1]), (11, [11, 9]), (1, None)):
        k, v = kv(gen, b, hkv, t, 64)
        cache.append(k, v, new_lengths=new)
        for s in range(b):
            n = t if new is None else new[s]
            history[s] += [(k[s, :, i], v[s, :, i]) for i in range(n)]
        for s in range(b):
            seen = len(history[s])
            assert int(cache.seen[s]) == seen and int(cache.lengths[s]) == min(seen, window)
            pos = cache.slot_positions()[s]
            held = sorted(p for p in pos.tolist() if p >= 0)
            assert held == list(range(max(0, seen - window), seen))  # the last W, no gaps
            for slot, p in enumerate(pos.tolist()):
                if p >= 0:
                    assert slot == p % window
                    assert_slot_holds(cache, s, slot, *history[s][p])
    assert max(len(h) for h in history) >= 4 * window  # several wrap-arounds happened


def test_left_padding_marks_positions(gen):
    cache = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=2, num_kv_heads=1, capacity=8)
    cache.set_left_padding([3, 0])
    cache.append(*kv(gen, 2, 1, 5, 64))
    assert cache.slot_positions().tolist() == [[-1, -1, -1, 3, 4, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1, -1]]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0] and bool((cache.slot_positions() == -1).all())
    cache.append(*kv(gen, 2, 1, 2, 64))
    assert cache.slot_positions()[0].tolist()[:2] == [0, 1]  # reset also clears the padding


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("k_bits,v_bits", [(8, 8), (5, 4), (4, 4), (3, 2), (2, 2)])
@pytest.mark.parametrize("window", [None, 7])
def test_nbytes(d, k_bits, v_bits, window):
    codec = ta.KVCodec(d, k_bits, v_bits)
    cache = ta.QuantizedKVCache(codec, batch_size=3, num_kv_heads=2, capacity=None if window else 40,
                                sliding_window=window)
    slots = window or 40
    assert cache.nbytes == 3 * 2 * slots * codec.bytes_per_token()
    assert cache.nbytes == 3 * 2 * slots * (d * (k_bits + v_bits) // 8 + 8 * max(1, d // 256))
    # Compared with bf16 K and V:
    assert 3 * 2 * slots * 2 * 2 * d / cache.nbytes == pytest.approx(32 / (k_bits + v_bits + 64 / min(d, 256)))


def test_device_names_are_normalized(gen):
    # "cpu:0" names the same device as tensors created on the CPU ("cpu"); likewise "cuda" vs "cuda:0".
    cache = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=1, num_kv_heads=1, capacity=4, device="cpu:0")
    k, v = kv(gen, 1, 1, 2, 64)
    cache.append(k, v)
    out = ta.cached_attention(torch.randn(1, 2, 1, 64, generator=gen), cache)
    assert out.shape == (1, 2, 1, 64) and cache.device == k.device


def test_repr_names_the_format():
    cache = ta.QuantizedKVCache(ta.KVCodec(128, 5, 4), batch_size=2, num_kv_heads=4, sliding_window=16)
    assert "ring W=16" in repr(cache) and "k5v4" in repr(cache) and "D=128" in repr(cache)


# -- crop, batch selection, reset --------------------------------------------------------------

STATE = ("k_codes", "v_codes", "k_scales", "v_scales", "seen", "starts", "key_shift", "key_gain", "key_gain_inv",
         "nonfinite")
# The edits read a static cache's lengths back from the device; they must leave it as they leave a growing one.
BOTH_MODES = pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])


def filled(codec, k, v, lengths, window=None, capacity=None, shift=None, gain=None, pad=None, chunks=(None,),
           static=False):
    """A cache given sequence b's first lengths[b] tokens of k, v [B, Hkv, T, D], in `chunks` appends."""
    b, hkv, t, _ = k.shape
    cache = ta.QuantizedKVCache(codec, batch_size=b, num_kv_heads=hkv, capacity=capacity, sliding_window=window,
                                static=static)
    if shift is not None:
        cache.set_key_transform(shift, gain)
    if pad is not None:
        cache.set_left_padding(pad)
    bounds = [0, *(c for c in chunks if c is not None), t]
    for lo, hi in zip(bounds, bounds[1:]):
        n = [min(max(x - lo, 0), hi - lo) for x in lengths]
        if max(n) > 0:
            cache.append(k[:, :, lo:hi], v[:, :, lo:hi], new_lengths=n)
    return cache


def assert_same_state(got, want):
    for name in STATE:
        x, y = getattr(got, name), getattr(want, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert (got.batch_size, got.max_seen, got.has_key_shift) == (want.batch_size, want.max_seen, want.has_key_shift)
    assert got.lengths.tolist() == want.lengths.tolist()


def transform(gen, b, hkv, d):
    shift = torch.randn(b, hkv, d, generator=gen)
    shift[-1] = 0  # the last sequence unshifted: selecting it alone must turn has_key_shift off
    return shift, torch.rand(b, hkv, d, generator=gen) + 0.5


def attend_both(gen, got, want, tq=2, backend="auto", without_fresh=True):
    """cached_attention over both caches, with fresh k, v and (queries ending at the last cached token)
    without; must be bit-identical."""
    b, hkv, d = got.batch_size, got.num_kv_heads, got.codec.head_dim
    q = torch.randn(b, 2 * hkv, tq, d, generator=gen)
    k, v = kv(gen, b, hkv, tq, d)
    for fresh in ((k, v), (None, None)) if without_fresh else ((k, v),):
        out = ta.cached_attention(q, got, *fresh, backend=backend)
        assert torch.equal(out, ta.cached_attention(q, want, *fresh, backend=backend))


@pytest.mark.parametrize("window", [None, 16], ids=["contiguous", "ring-not-wrapped"])
@pytest.mark.parametrize("max_length", [-3, 7, 0, 40])
@BOTH_MODES
def test_crop_equals_a_cache_given_only_the_kept_tokens(window, max_length, static, gen):
    """Negative: drop that many from each sequence; else keep the first max_length (40: more than held)."""
    codec = ta.KVCodec(64, 5, 3)
    b, hkv, lengths = 3, 2, [9, 5, 12]
    k, v = kv(gen, b, hkv, 12, 64)
    shift, gain = transform(gen, b, hkv, 64)
    opts = dict(window=window, capacity=None if window else 20, shift=shift, gain=gain, static=static)
    cache = filled(codec, k, v, lengths, chunks=(4, 7), **opts)
    cache.crop(max_length)
    kept = [n + max_length if max_length < 0 else min(n, max_length) for n in lengths]
    want = filled(codec, k, v, kept, **opts)
    assert_same_state(cache, want)
    attend_both(gen, cache, want)
    k2, v2 = kv(gen, b, hkv, 3, 64)  # it goes on as the reference does
    cache.append(k2, v2)
    want.append(k2, v2)
    assert_same_state(cache, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@BOTH_MODES
def test_wrapped_ring_crops_its_spare_slot_only(backend, static, gen):
    """A ring of W slots at seen > W holds positions seen-W .. seen-1; the next query's window needs only
    the W - 1 before it, so one token can go.  The slot then maps to the overwritten position seen-1-W:
    it is marked as padding, and attention equals a ring that was only ever given the kept tokens."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by `make test`) or a GPU")
    codec, w = ta.KVCodec(64, 4, 4), 8
    k, v = kv(gen, 2, 1, 13, 64)
    cache = filled(codec, k, v, [13, 5], window=w, chunks=(6,), static=static)
    before = {name: getattr(cache, name).clone() for name in STATE[:6]}
    with pytest.raises(ValueError, match="sliding_window=8 slots no longer holds positions 4..4"):
        cache.crop(-2)
    assert all(torch.equal(getattr(cache, name), t) for name, t in before.items())  # untouched
    cache.crop(-1)
    want = filled(codec, k, v, [12, 4], window=w)
    pos, want_pos = cache.slot_positions(), want.slot_positions()
    assert want_pos[0, 12 % w] == 12 - w and pos[0, 12 % w] == -1   # the overwritten position: gone
    want_pos[0, 12 % w] = -1
    assert torch.equal(pos, want_pos)
    valid = (pos >= 0)[:, None, :, None]
    for name in STATE[:4]:
        assert torch.equal(getattr(cache, name) * valid, getattr(want, name) * valid), name
    # Queries from the new length on (fresh k, v); the kept last token's own query (positions seen - 1
    # and before) ran before the crop and needed the overwritten position, so it is not asked again.
    attend_both(gen, cache, want, tq=1, backend=backend, without_fresh=False)
    attend_both(gen, cache, want, tq=3, backend=backend, without_fresh=False)
    k2, v2 = kv(gen, 2, 1, 1, 64)
    cache.append(k2, v2)
    want.append(k2, v2)
    attend_both(gen, cache, want, tq=1, backend=backend)


@pytest.mark.parametrize("window", [None, 4], ids=["contiguous", "ring"])
@pytest.mark.parametrize("op,arg,idx", [
    ("batch_select_indices", [2, 0], [2, 0]),
    ("batch_select_indices", torch.tensor([1, 1, 0, 2]), [1, 1, 0, 2]),
    ("batch_select_indices", torch.tensor([2], dtype=torch.int32), [2]),
    ("reorder_cache", torch.tensor([2, 0, 0]), [2, 0, 0]),
    ("batch_repeat_interleave", 2, [0, 0, 1, 1, 2, 2]),
])
@BOTH_MODES
def test_batch_edits_equal_the_same_edit_of_the_inputs(window, op, arg, idx, static, gen):
    """Codes, scales, lengths, left padding and the key transform all follow the selected sequences."""
    codec = ta.KVCodec(64, 4, 3)
    b, hkv, lengths, pad = 3, 2, [5, 9, 2], [1, 0, 0]
    k, v = kv(gen, b, hkv, 9, 64)
    shift, gain = transform(gen, b, hkv, 64)
    opts = dict(window=window, capacity=None if window else 12, static=static)
    cache = filled(codec, k, v, lengths, shift=shift, gain=gain, pad=pad, chunks=(3,), **opts)
    getattr(cache, op)(arg)
    want = filled(codec, k[idx], v[idx], [lengths[i] for i in idx], shift=shift[idx], gain=gain[idx],
                  pad=[pad[i] for i in idx], **opts)
    assert_same_state(cache, want)
    assert cache.has_key_shift == (idx != [2])
    attend_both(gen, cache, want)


@BOTH_MODES
def test_reset_gives_a_fresh_cache(static, gen):
    codec = ta.KVCodec(64, 3, 2)
    k, v = kv(gen, 2, 2, 6, 64)
    shift, gain = transform(gen, 2, 2, 64)
    cache = filled(codec, k, v, [6, 4], capacity=8, shift=shift, gain=gain, pad=[2, 0], static=static)
    cache.reset()
    assert cache.is_empty
    fresh = ta.QuantizedKVCache(codec, batch_size=2, num_kv_heads=2, capacity=8, static=static)
    assert_same_state(cache, fresh)
    k2, v2 = kv(gen, 2, 2, 3, 64)
    cache.append(k2, v2)
    fresh.append(k2, v2)
    assert_same_state(cache, fresh)


def assert_layout_is_current(cache):
    """cache.layout (one object until the cache's tensors change) holds the cache's tensors and flags now."""
    layout = cache.layout
    for field in dataclasses.fields(layout):
        got = getattr(layout, field.name)
        want = cache.has_key_shift if field.name == "key_shifted" else getattr(cache, field.name)
        assert got is want if isinstance(want, torch.Tensor) or want is None else got == want, field.name


@BOTH_MODES
def test_layout_follows_every_edit_of_the_tensors(static, gen):
    """Each edit that replaces a tensor or the key transform's flag hands out a new layout: a stale one would
    attend or append to the old storage."""
    codec = ta.KVCodec(64, 4, 3)
    cache = ta.QuantizedKVCache(codec, batch_size=3, num_kv_heads=2, capacity=8, static=static, exact_recent=2,
                                exact_first=2)
    edits = [lambda: cache.set_key_transform(*transform(gen, 3, 2, 64)), lambda: cache.append(*kv(gen, 3, 2, 3, 64)),
             lambda: cache.crop(2), lambda: cache.batch_select_indices([2, 0, 0]),
             lambda: cache.batch_select_indices([1, 0]), lambda: cache.reset(),
             lambda: cache.set_key_transform(*transform(gen, 2, 2, 64)), lambda: cache.append(*kv(gen, 2, 2, 5, 64))]
    if not static:
        edits.insert(2, lambda: cache.reserve(16))
    for edit in edits:
        assert_layout_is_current(cache)   # asked before the edit: a layout to hand out again
        edit()
        assert_layout_is_current(cache)


def test_edit_arguments_are_checked(gen):
    cache = filled(ta.KVCodec(64), *kv(gen, 2, 1, 4, 64), [4, 2], capacity=8)
    for bad, match in ((-3, "holds only 2"), (2.0, "must be an int"), (True, "must be an int")):
        with pytest.raises(ValueError, match=match):
            cache.crop(bad)
    for bad, match in (([0, 2], r"in \[0, 2\)"), ([-1], r"in \[0, 2\)"), ([], "at least one"),
                       (torch.tensor([0.0, 1.0]), "integers"), (torch.tensor([True, False]), "integers"),
                       (torch.tensor([[0, 1]]), "1-D"), ([0, 1.0], "ints")):
        with pytest.raises(ValueError, match=match):
            cache.batch_select_indices(bad)
    with pytest.raises(ValueError, match="batch_size=2"):
        cache.reorder_cache(torch.tensor([0, 1, 1]))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="repeats"):
            cache.batch_repeat_interleave(bad)
    assert cache.lengths.tolist() == [4, 2] and cache.batch_size == 2  # nothing changed


# -- static mode: lengths on the device only (torch.compile, CUDA graphs) ---------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_overflow_stores_what_fits_and_flags(backend, gen):
    """Past its capacity a static cache cannot refuse an append (that needs a host read): it stores the
    tokens that fit, counts all of them, and says so; nothing is written past the last slot."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    codec = ta.KVCodec(64, 4, 4)
    static = ta.QuantizedKVCache(codec, 2, 1, capacity=8, static=True)
    big = ta.QuantizedKVCache(codec, 2, 1, capacity=16)
    k, v = (torch.randn(2, 1, 11, 64, generator=gen) for _ in range(2))
    static.append(k[:, :, :6], v[:, :, :6], backend=backend)
    assert not static.overflowed
    static.append(k[:, :, 6:], v[:, :, 6:], backend=backend)
    big.append(k[:, :, :6], v[:, :, :6], backend=backend)
    big.append(k[:, :, 6:], v[:, :, 6:], backend=backend)
    assert static.overflowed and static.seen.tolist() == [11, 11] and static.lengths.tolist() == [8, 8]
    for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
        assert torch.equal(getattr(static, name), getattr(big, name)[:, :, :8]), name
    # A ring never overflows: it keeps the last W.
    ring = ta.QuantizedKVCache(codec, 2, 1, sliding_window=4, static=True)
    ring.append(k, v, backend=backend)
    assert not ring.overflowed


def test_static_cache_marks_every_tensor_a_step_mutates():
    """CUDA graphs (reduce-overhead) skip a graph whose op mutates an input that is not marked static:
    every tensor the ops write (their schemas' mutated arguments: codes, exact rows, counters) and `seen`
    (advanced in place) must carry the mark, key transform included."""
    from turboattn.ops.library import cached_attention, quantize_append

    cache = ta.QuantizedKVCache(ta.KVCodec(64, 4, 4), 2, 2, capacity=8, static=True, exact_recent=2, exact_first=2)
    cache.set_key_transform(torch.zeros(2, 2, 64), torch.ones(2, 2, 64))
    mutated = [a.name for op in (quantize_append, cached_attention) for a in op._opoverload._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert {"k_codes", "v_codes", "k_scales", "v_scales", "nonfinite", "merge_counters", "recent_k",
            "recent_v", "first_k", "first_v"} <= set(mutated)
    for name in mutated + ["seen", "starts", "key_shift", "key_gain", "key_gain_inv"]:   # seen: advanced in place
        assert getattr(getattr(cache, name), "_dynamo_static_input_type", None) is not None, name


def test_static_cache_rules():
    codec = ta.KVCodec(64, 4, 4)
    with pytest.raises(TypeError, match="static must be a bool"):
        ta.QuantizedKVCache(codec, 1, 1, capacity=8, static=1)
    cache = ta.QuantizedKVCache(codec, 1, 1, capacity=8, static=True)
    with pytest.raises(ValueError, match="fixed capacity"):
        cache.reserve(16)
    assert cache.is_empty and cache.is_static and "static" in repr(cache)
    cache.append(torch.randn(1, 1, 3, 64), torch.randn(1, 1, 3, 64))
    assert not cache.is_empty and cache.max_seen == 3
    cache.crop(0)
    assert cache.is_empty
    cache.reset()
    assert cache.is_empty and cache.seen.tolist() == [0]


def test_static_reorder_keeps_the_storage(gen):
    """Beam search's reorder (B unchanged) permutes a static cache in place, keeping every tensor's address
    (what a CUDA graph recorded); a new batch size reallocates."""
    cache = ta.QuantizedKVCache(ta.KVCodec(64, 4, 4), 2, 1, capacity=8, static=True)
    cache.set_key_transform(torch.randn(2, 1, 64, generator=gen), torch.ones(2, 1, 64))
    k = torch.randn(2, 1, 5, 64, generator=gen)
    cache.append(k, k)
    cache.append(k[:1].expand(2, -1, -1, -1)[:, :, :2], k[:, :, :2])   # lengths stay equal, contents differ
    names = ("k_codes", "k_scales", "v_codes", "v_scales", "seen", "starts", "key_shift", "key_gain", "key_gain_inv")
    before = {n: getattr(cache, n).clone() for n in names}
    ptrs = {n: getattr(cache, n).data_ptr() for n in names}
    cache.reorder_cache(torch.tensor([1, 0]))
    for n in names:
        assert getattr(cache, n).data_ptr() == ptrs[n], n
        assert torch.equal(getattr(cache, n), before[n].flip(0)), n
    cache.batch_select_indices([1])
    assert cache.batch_size == 1 and torch.equal(cache.k_codes, before["k_codes"][:1])


def test_static_key_transform_keeps_its_storage():
    """reset() and a new prompt's transform reuse the same tensors: a compiled step (or CUDA graph) that
    read them stays valid."""
    cache = ta.QuantizedKVCache(ta.KVCodec(64, 4, 4), 1, 2, capacity=8, static=True)
    shift, gain = torch.randn(1, 2, 64), torch.rand(1, 2, 64) + 0.5
    cache.set_key_transform(shift, gain)
    ptrs = [t.data_ptr() for t in (cache.key_shift, cache.key_gain, cache.key_gain_inv)]
    cache.reset()
    assert cache.key_shift is None
    cache.set_key_transform(2 * shift, gain)
    assert [t.data_ptr() for t in (cache.key_shift, cache.key_gain, cache.key_gain_inv)] == ptrs
    assert torch.equal(cache.key_shift, 2 * shift) and torch.equal(cache.key_gain_inv, 1 / gain)
