"""Exact first tokens (QuantizedKVCache(exact_first=S)): the first S tokens of each sequence (after its left
padding) read in full precision, alone and beside the exact recent window.  The Triton kernel against the PyTorch
twin, exactness against float64 attention over the unquantized K/V, the overlap rule (a position among the first S
and in the window is attended once), the cache's state operations, persistence and a compiled static step."""

from __future__ import annotations

import pytest
import torch

import turboattn as ta
from turboattn.format.layout import first_positions, recent_positions
from turboattn.ops.cached.naive import cached_attention_naive

from exact_cache import (FP16_TOL, check_batch_edits_follow, check_kernel_matches_twin,
                         check_static_step_compiles_once, fill, needs_triton, rel)
from naive import float32_attention_tolerance, naive_attention


def _cache(codec, b, hkv, s_len, r_len=0, capacity=64, pad=None, **kw):
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=capacity, exact_first=s_len, exact_recent=r_len, **kw)
    if pad is not None:
        cache.set_left_padding(pad)   # before the first append: the first-token rows are indexed from it
    return cache


# -- the Triton kernel against its PyTorch twin ------------------------------------------------------------
KERNEL_CASES = [
    # (S, R, chunks, pad, group, tq, shift, ragged)
    (1, 0, (37, 30), None, 1, 1, False, False),
    (4, 0, (2,), None, 4, 3, False, False),            # fewer tokens than S
    (4, 0, (37, 30), [0, 3], 4, 3, True, False),       # left padding, a shifted key transform
    (1, 16, (70,), None, 1, 3, False, False),          # with a window, one block straddled
    (4, 5, (3, 2), [0, 2], 4, 3, False, False),        # fewer tokens than S + R: first rows and window overlap
    (4, 5, (37, 30), [0, 3], 1, 1, True, False),       # both, padding, shift
    (4, 5, (2, 3, 1, 12), None, 4, 3, False, True),    # ragged appends through new_lengths
    (4, 0, (1, 1, 1, 1, 1, 1), [0, 2], 4, 1, False, False),   # token by token past left padding
]


@needs_triton
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"S{c[0]}R{c[1]}-{i}" for i, c in enumerate(KERNEL_CASES)])
def test_kernel_matches_twin(gen, case):
    s_len, r_len, chunks, pad, group, tq, shift, ragged = case
    d, b, hkv = 64, 2, 2
    codec = ta.KVCodec(d, 4, 3)
    cache = _cache(codec, b, hkv, s_len, r_len, capacity=80, pad=pad, exact_dtype=torch.float32)
    fill(gen, cache, chunks, [[t, t // 2 + 1] for t in chunks] if ragged else None, shift)
    check_kernel_matches_twin(gen, cache, group, tq)


@needs_triton
@pytest.mark.parametrize("d", [48, 320])
def test_kernel_matches_twin_at_other_head_dims(gen, d):
    """Head dims that are not powers of two: first rows and window rotated in the kernel (48) or on the host (320)."""
    codec = ta.KVCodec(d, 4, 3)
    cache = _cache(codec, 2, 2, 4, 5, capacity=40, pad=[0, 3], exact_dtype=torch.float32)
    fill(gen, cache, (14, 9), shift=True)
    check_kernel_matches_twin(gen, cache, 2, 2)


@needs_triton
@pytest.mark.parametrize("r_len", [0, 6])
def test_kernel_reads_the_first_rows_not_the_codes(gen, r_len):
    """Spoiling the codes of the first positions changes nothing (both paths); spoiling a first-token row does."""
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 2, 2, 4, r_len, capacity=40, pad=[0, 3], exact_dtype=torch.float32)
    fill(gen, cache, (30,))
    q = torch.randn(2, 2, 3, 64, generator=gen).half()
    before = {be: ta.cached_attention(q, cache, backend=be) for be in ("torch", "triton")}
    cache.k_codes[0, :, 0:4] = 0xFF
    cache.k_codes[1, :, 3:7] = 0xFF
    cache.v_scales[0, :, 0:4] = 100.0
    cache.v_scales[1, :, 3:7] = 100.0
    for be in ("torch", "triton"):
        assert torch.equal(ta.cached_attention(q, cache, backend=be), before[be]), be
    cache.first_v[1, :, 2] = 50.0
    for be in ("torch", "triton"):
        after = ta.cached_attention(q, cache, backend=be)
        assert torch.equal(after[0], before[be][0]) and not torch.equal(after[1], before[be][1]), be


@needs_triton
def test_kernel_head_dim_512_rotates_the_first_rows_on_the_host(gen):
    codec = ta.KVCodec(512, 4, 4)
    cache = _cache(codec, 1, 1, 4, 3, capacity=40)   # exact_dtype bfloat16, the default
    fill(gen, cache, (20,), shift=True)
    q = torch.randn(1, 2, 2, 512, generator=gen).half()
    k, v = (torch.randn(1, 1, 2, 512, generator=gen).half() for _ in range(2))
    for fresh in ((None, None), (k, v)):
        out = ta.cached_attention(q, cache, *fresh, backend="triton")
        ref = cached_attention_naive(q, cache.layout, codec, *fresh, compute_dtype=torch.float64)
        assert rel(out, ref) < FP16_TOL


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_nonfinite_first_row_reaches_exactly_the_queries_that_see_it(gen, backend):
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 2, 1, 4, 2, capacity=40, exact_dtype=torch.float32)
    fill(gen, cache, (6,))
    cache.first_k[0, :, 2, 5] = float("nan")   # position 2 of sequence 0
    q = torch.randn(2, 1, 6, 64, generator=gen).half()
    out = ta.cached_attention(q, cache, backend=backend)   # queries at positions 0..5
    assert not out[0, :, :2].isnan().any() and out[0, :, 2:].isnan().all() and not out[1].isnan().any()
    # A row not stored yet (position 3 of a 3-token sequence) is invisible: its NaN reaches nobody.
    cache = _cache(codec, 1, 1, 4, capacity=40, exact_dtype=torch.float32)
    fill(gen, cache, (3,))
    cache.first_v[0, :, 3] = float("nan")
    assert not ta.cached_attention(q[:1, :, :3], cache, backend=backend).isnan().any()


# -- exactness and the overlap rule ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("s_len,r_len", [(16, 0), (5, 8), (6, 9)], ids=["first-only", "meet", "overlap"])
def test_first_rows_and_window_covering_every_token_are_exact_attention(gen, backend, s_len, r_len):
    """S + R >= every stored token: cached_attention equals attention over the unquantized K/V (float64 reference;
    2-bit codes, so reading any of them would show).  Where the first rows and the window overlap, a position read
    twice would weigh double and show as well."""
    d, b, hkv, tq, n = 64, 2, 2, 3, 13
    codec = ta.KVCodec(d, 2, 2)
    cache = _cache(codec, b, hkv, s_len, r_len, capacity=40, pad=[0, 2], exact_dtype=torch.float32)
    ks, vs = fill(gen, cache, (9, 4), shift=True)
    if r_len:
        pos = torch.cat([first_positions(cache.layout), recent_positions(cache.layout)], 1)
        for row in pos:
            held = row[row >= 0].tolist()
            assert len(held) == len(set(held))   # no position in both buffers
    q = torch.randn(b, hkv * 2, tq, d, generator=gen)
    kf, vf = (torch.randn(b, hkv, tq, d, generator=gen) for _ in range(2))
    k_all = torch.stack([torch.stack(x, 1) for x in ks])
    v_all = torch.stack([torch.stack(x, 1) for x in vs])
    k_pos = torch.arange(n)[None].repeat(b, 1)
    k_pos[1, :2] = -1   # left padding
    for fresh in (False, True):
        keys, values, pos = k_all, v_all, k_pos
        q_pos = torch.arange(n - tq, n)[None].repeat(b, 1)
        if fresh:
            keys, values = torch.cat([k_all, kf], 2), torch.cat([v_all, vf], 2)
            pos = torch.cat([k_pos, torch.arange(n, n + tq)[None].repeat(b, 1)], 1)
            q_pos = q_pos + tq
        want, _ = naive_attention(q, keys, values, causal=True, q_positions=q_pos, k_positions=pos)
        got = ta.cached_attention(q.half() if backend == "triton" else q, cache,
                                  *((kf.half(), vf.half()) if fresh and backend == "triton" else
                                    (kf, vf) if fresh else (None, None)), backend=backend)
        if backend == "torch":
            err = float((got.double() - want).abs().max())
            assert err <= float32_attention_tolerance(q, keys, values), err
        else:
            assert rel(got, want) < FP16_TOL + 2 * 2.0**-11   # q, k, v also rounded to float16 here


def test_first_off_is_todays_cache():
    """S = 0: no buffers, nothing in the layout or the repr, the same bytes."""
    codec = ta.KVCodec(64, 4, 4)
    cache = ta.QuantizedKVCache(codec, 2, 2, capacity=32)
    assert cache.first_k is None and cache.layout.exact_first == 0 and cache.exact_first_nbytes == 0
    assert cache.nbytes == 2 * 2 * 32 * codec.bytes_per_token()
    assert "exact_first" not in repr(cache)


def test_first_rows_hold_the_first_tokens_exactly(gen):
    """After appends of every shape (shorter than S, ragged, past left padding), row j holds position starts + j
    once it is stored, in the exact dtype; rows not stored yet are untouched (zero)."""
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 2, 2, 5, capacity=64, pad=[0, 3])
    ks, vs = fill(gen, cache, (2, 4, 1, 3), [[2, 1], [0, 3], [1, 0], [3, 3]])
    pos = first_positions(cache.layout)
    for s, start in enumerate((0, 3)):
        n = len(ks[s])
        for j in range(5):
            p = start + j
            assert int(pos[s, j]) == (p if p < n else -1)
            if p < n:
                assert torch.equal(cache.first_k[s, :, j], ks[s][p].to(torch.bfloat16))
                assert torch.equal(cache.first_v[s, :, j], vs[s][p].to(torch.bfloat16))
            else:
                assert torch.count_nonzero(cache.first_k[s, :, j]) == 0


# -- state operations ---------------------------------------------------------------------------------------------
def test_options_are_checked(gen):
    codec = ta.KVCodec(64, 4, 4)
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="exact_first"):
            ta.QuantizedKVCache(codec, 1, 1, capacity=8, exact_first=bad)
    with pytest.raises(ValueError, match="ring cache"):
        ta.QuantizedKVCache(codec, 1, 1, sliding_window=8, exact_first=2)
    cache = ta.QuantizedKVCache(codec, 1, 1, capacity=8, exact_first=3, exact_recent=2)
    assert cache.nbytes == 8 * codec.bytes_per_token() + 2 * 3 * 64 * 2 + 2 * 3 * 64 * 2
    assert cache.exact_first_nbytes == 2 * 3 * 64 * 2
    assert "exact_recent=2, exact_first=3 (bfloat16)" in repr(cache)
    cache.set_left_padding([1])   # empty: fine
    fill(gen, cache, (2,))
    with pytest.raises(ValueError, match="empty"):
        cache.set_left_padding([0])
    cache.reset()
    cache.set_left_padding([0])


def test_crop_below_the_first_tokens_hides_their_rows_until_appended_again(gen):
    """A crop to fewer than starts + S tokens: the dropped rows are invisible (the position rule) and zeroed;
    appending again writes them, and the cache then equals one filled with those tokens directly."""
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 2, 1, 6, 3, capacity=40, pad=[0, 2], exact_dtype=torch.float32)
    fill(gen, cache, (12,))
    cache.crop(4)
    assert first_positions(cache.layout).tolist() == [[0, 1, 2, 3, -1, -1], [2, 3, -1, -1, -1, -1]]
    assert torch.count_nonzero(cache.first_k[0, :, 4:]) == 0 and torch.count_nonzero(cache.first_k[1, :, 2:]) == 0
    q = torch.randn(2, 1, 1, 64, generator=gen)
    ref = cached_attention_naive(q, cache.layout, codec, compute_dtype=torch.float64)
    assert rel(ta.cached_attention(q, cache, backend="torch"), ref) < 1e-5
    k, v = torch.randn(2, 1, 8, 64, generator=gen), torch.randn(2, 1, 8, 64, generator=gen)
    cache.append(k, v, backend="torch")
    fresh = _cache(codec, 2, 1, 6, 3, capacity=40, pad=[0, 2], exact_dtype=torch.float32)
    fresh.append(cache.dequantize()[0][:, :, :4], cache.dequantize()[1][:, :, :4], backend="torch")
    fresh.first_k[:, :, :4].copy_(cache.first_k[:, :, :4])   # the kept exact rows
    fresh.first_v[:, :, :4].copy_(cache.first_v[:, :, :4])
    fresh.append(k, v, backend="torch")
    assert torch.equal(fresh.first_k, cache.first_k) and torch.equal(fresh.first_v, cache.first_v)


def test_growing_cache_skips_the_first_rows_copy_only_when_no_row_can_change(gen, tmp_path):
    """A growing cache's appends skip the first-token copy once every sequence holds starts + S tokens (a host
    bound on starts); a static cache always makes it.  Through single-token steps with left padding, a crop below
    starts + S, a save and load in that state and more steps, both hold the same rows."""
    codec = ta.KVCodec(64, 4, 4)
    growing, static = (_cache(codec, 2, 1, 4, capacity=32, pad=[3, 1], static=s, exact_dtype=torch.float32)
                       for s in (False, True))

    def steps(caches, n):
        for _ in range(n):
            k, v = torch.randn(2, 1, 1, 64, generator=gen), torch.randn(2, 1, 1, 64, generator=gen)
            for c in caches:
                c.append(k, v, backend="torch")
            for c in caches[1:]:
                assert torch.equal(c.first_k, caches[0].first_k) and torch.equal(c.first_v, caches[0].first_v)
    steps([static, growing], 9)
    assert growing._first_rows_full()
    for c in (growing, static):
        c.crop(5)   # sequence 0 (starts 3) now holds 2 of its 4 first tokens
    assert not growing._first_rows_full()
    growing.save(tmp_path / "c.safetensors")
    steps([static, ta.QuantizedKVCache.load(tmp_path / "c.safetensors"), growing], 4)
    assert torch.count_nonzero(growing.first_k[0]) == growing.first_k[0].numel()   # rows 2, 3 written again

def test_batch_edits_reset_and_repeat(gen):
    codec = ta.KVCodec(64, 4, 4)
    check_batch_edits_follow(gen, lambda static: _cache(codec, 2, 1, 4, capacity=16, static=static), "first_k", "first_v")


def test_growing_cache_keeps_the_first_rows_across_reserve(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 1, 1, 4, capacity=8, exact_dtype=torch.float32)
    ks, _ = fill(gen, cache, (3,))
    cache.reserve(32)
    ks2, _ = fill(gen, cache, (5,))
    assert torch.equal(cache.first_k[0, :, 2], ks[0][2]) and torch.equal(cache.first_k[0, :, 3], ks2[0][0])


@pytest.mark.parametrize("r_len", [0, 5])
def test_save_and_load_round_trip(gen, tmp_path, r_len):
    codec = ta.KVCodec(64, 4, 3)
    cache = _cache(codec, 2, 2, 4, r_len, capacity=30, pad=[1, 0])
    fill(gen, cache, (14,), shift=True)
    cache.save(tmp_path / "c.safetensors")
    back = ta.QuantizedKVCache.load(tmp_path / "c.safetensors")
    assert back.exact_first == 4 and back.exact_recent == r_len and back.exact_dtype == torch.bfloat16
    assert torch.equal(back.first_k, cache.first_k) and torch.equal(back.first_v, cache.first_v)
    assert torch.equal(back.starts, cache.starts)
    q = torch.randn(2, 4, 2, 64, generator=gen)
    assert torch.equal(ta.cached_attention(q, back, backend="torch"), ta.cached_attention(q, cache, backend="torch"))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "c.safetensors"), "pt") as f:
        assert f.metadata()["file_version"] == "3" and "first_k" in f.keys()


def test_files_without_first_tokens_keep_their_version(gen, tmp_path):
    codec = ta.KVCodec(64, 4, 3)
    for r_len, version in ((0, "1"), (3, "2")):
        cache = ta.QuantizedKVCache(codec, 1, 1, capacity=10, exact_recent=r_len)
        fill(gen, cache, (4,))
        cache.save(tmp_path / "old.safetensors")
        from safetensors import safe_open
        with safe_open(str(tmp_path / "old.safetensors"), "pt") as f:
            assert f.metadata()["file_version"] == version and "exact_first" not in f.metadata()
        back = ta.QuantizedKVCache.load(tmp_path / "old.safetensors")
        assert back.exact_first == 0 and back.first_k is None and back.exact_recent == r_len


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@torch.no_grad()
def test_static_step_with_first_tokens_compiles_once(gen, backend):
    """Attention plus append on a static cache with exact first tokens and a window: one graph (fullgraph=True),
    equal to eager steps on a growing cache with the same options.  The prompt (2 tokens) is shorter than S, so
    the compiled steps write first-token rows too."""
    codec = ta.KVCodec(64, 4, 3)
    static = _cache(codec, 2, 2, 4, 3, capacity=64, static=True, exact_dtype=torch.float32)
    growing = _cache(codec, 2, 2, 4, 3, capacity=64, exact_dtype=torch.float32)
    k = check_static_step_compiles_once(gen, static, growing, 2, 8 if backend == "torch" else 5, backend)
    assert torch.equal(static.first_k, growing.first_k) and torch.equal(static.first_k[:, :, :4], k[:, :, :4])
