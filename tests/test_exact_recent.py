"""The exact recent window (QuantizedKVCache(exact_recent=R)): the R newest tokens of each sequence read in full
precision.  The Triton kernel against the PyTorch twin, exactness against float64 attention over the unquantized
K/V, the cache's state operations, persistence and a compiled static step."""

from __future__ import annotations

import pytest
import torch

import turboattn as ta
from turboattn.format.layout import recent_positions
from turboattn.ops.cached.naive import cached_attention_naive

from exact_cache import (FP16_TOL, check_batch_edits_follow, check_kernel_matches_twin,
                         check_static_step_compiles_once, fill, needs_triton, rel)
from naive import float32_attention_tolerance, naive_attention


def _cache(codec, b, hkv, r_len, window=None, capacity=64, **kw):
    return ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else capacity, sliding_window=window,
                               exact_recent=r_len, **kw)


# -- the Triton kernel against its PyTorch twin ------------------------------------------------------------
KERNEL_CASES = [
    # (R, chunks, window, pad, group, tq, shift, ragged)
    (1, (37, 30), None, None, 1, 1, False, False),
    (5, (3,), None, None, 4, 3, False, False),            # fewer tokens than R
    (5, (37, 30), None, [0, 3], 4, 3, True, False),       # left padding, a shifted key transform
    (16, (70,), None, None, 1, 3, False, False),          # one block straddled, not a multiple of it
    (5, (20, 9, 4), 9, None, 4, 1, False, False),         # ring wraps around several times
    (16, (7, 30), 24, [0, 2], 1, 3, True, False),         # ring, padding, shift
    (5, (12, 12), None, None, 4, 3, False, True),         # ragged appends through new_lengths
]


@needs_triton
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"R{c[0]}-{i}" for i, c in enumerate(KERNEL_CASES)])
def test_kernel_matches_twin(gen, case):
    r_len, chunks, window, pad, group, tq, shift, ragged = case
    d, b, hkv = 64, 2, 2
    codec = ta.KVCodec(d, 4, 3)
    cache = _cache(codec, b, hkv, r_len, window, capacity=80, exact_dtype=torch.float32)
    fill(gen, cache, chunks, [[t, t // 2 + 1] for t in chunks] if ragged else None, shift)
    if pad is not None:
        cache.set_left_padding(pad)
    check_kernel_matches_twin(gen, cache, group, tq)


@needs_triton
@pytest.mark.parametrize("d, window", [(80, None), (96, 11), (320, None)])
def test_kernel_matches_twin_at_other_head_dims(gen, d, window):
    """Head dims that are not powers of two: the window rotated in the kernel (80; 96 with a ring that wraps) or
    on the host (320), keys through a shifted key transform."""
    codec = ta.KVCodec(d, 4, 3)
    cache = _cache(codec, 2, 2, 5, window, capacity=40, exact_dtype=torch.float32)
    fill(gen, cache, (14, 9), shift=True)
    if window is None:
        cache.set_left_padding([0, 2])
    check_kernel_matches_twin(gen, cache, 2, 2)


@needs_triton
def test_kernel_reads_the_window_not_the_codes(gen):
    """Spoiling the codes of the window's positions changes nothing; spoiling the window's rows does."""
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 1, 2, 8, capacity=40, exact_dtype=torch.float32)
    fill(gen, cache, (30,))
    q = torch.randn(1, 2, 1, 64, generator=gen).half()
    before = ta.cached_attention(q, cache, backend="triton")
    cache.k_codes[:, :, 22:30] = 0xFF
    cache.v_scales[:, :, 22:30] = 100.0
    assert torch.equal(ta.cached_attention(q, cache, backend="triton"), before)
    cache.recent_v[:, :, 3] = 50.0
    assert not torch.equal(ta.cached_attention(q, cache, backend="triton"), before)


@needs_triton
def test_kernel_head_dim_512_rotates_the_window_on_the_host(gen):
    codec = ta.KVCodec(512, 4, 4)
    cache = _cache(codec, 1, 1, 5, capacity=40)   # exact_dtype bfloat16, the default
    fill(gen, cache, (20,), shift=True)
    q = torch.randn(1, 2, 2, 512, generator=gen).half()
    k, v = (torch.randn(1, 1, 2, 512, generator=gen).half() for _ in range(2))
    out = ta.cached_attention(q, cache, k, v, backend="triton")
    ref = cached_attention_naive(q, cache.layout, codec, k, v, compute_dtype=torch.float64)
    assert rel(out, ref) < FP16_TOL


@needs_triton
def test_nonfinite_window_row_reaches_exactly_the_queries_that_see_it(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 2, 1, 4, capacity=40, exact_dtype=torch.float32)
    fill(gen, cache, (20,))
    cache.recent_k[0, :, 18 % 4, 5] = float("nan")   # position 18 of sequence 0
    q = torch.randn(2, 1, 3, 64, generator=gen).half()
    for backend in ("torch", "triton"):
        out = ta.cached_attention(q, cache, backend=backend)   # queries at positions 17, 18, 19
        assert not out[0, :, 0].isnan().any() and out[0, :, 1:].isnan().all() and not out[1].isnan().any()


# -- exactness ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("window", [None, 20])
def test_a_window_covering_every_token_is_exact_attention(gen, backend, window):
    """R >= every stored token: cached_attention equals attention over the unquantized K/V (float64 reference),
    within float32 rounding on the PyTorch path and float16 operand rounding in the kernel."""
    d, b, hkv, tq = 64, 2, 2, 3
    codec = ta.KVCodec(d, 2, 2)   # coarse codes: reading any of them would show
    cache = _cache(codec, b, hkv, 16, window, capacity=40, exact_dtype=torch.float32)
    ks, vs = fill(gen, cache, (9, 4), shift=True)
    cache.set_left_padding([0, 2])
    q = torch.randn(b, hkv * 2, tq, d, generator=gen)
    kf, vf = (torch.randn(b, hkv, tq, d, generator=gen) for _ in range(2))
    k_all = torch.stack([torch.stack(x, 1) for x in ks])
    v_all = torch.stack([torch.stack(x, 1) for x in vs])
    k_pos = torch.arange(13)[None].repeat(b, 1)
    k_pos[1, :2] = -1   # left padding
    for fresh in (False, True):
        keys, values, pos = k_all, v_all, k_pos
        q_pos = torch.arange(13 - tq, 13)[None].repeat(b, 1)
        if fresh:
            keys, values = torch.cat([k_all, kf], 2), torch.cat([v_all, vf], 2)
            pos = torch.cat([k_pos, torch.arange(13, 13 + tq)[None].repeat(b, 1)], 1)
            q_pos = q_pos + tq
        want, _ = naive_attention(q, keys, values, causal=True, sliding_window=window, q_positions=q_pos,
                                  k_positions=pos)
        got = ta.cached_attention(q.half() if backend == "triton" else q, cache,
                                  *((kf.half(), vf.half()) if fresh and backend == "triton" else
                                    (kf, vf) if fresh else (None, None)), backend=backend)
        if backend == "torch":
            err = float((got.double() - want).abs().max())
            assert err <= float32_attention_tolerance(q, keys, values), err
        else:
            assert rel(got, want) < FP16_TOL + 2 * 2.0**-11   # q, k, v also rounded to float16 here


def test_window_off_is_todays_cache(gen):
    """R = 0: no buffers, nothing in the layout or the file, the same bytes, and the op reads no window."""
    codec = ta.KVCodec(64, 4, 4)
    cache = ta.QuantizedKVCache(codec, 2, 2, capacity=32)
    assert cache.recent_k is None and cache.layout.exact_recent == 0 and cache.exact_recent_nbytes == 0
    assert cache.nbytes == 2 * 2 * 32 * codec.bytes_per_token()
    assert "exact_recent" not in repr(cache)


def test_window_rows_hold_the_newest_tokens_exactly(gen):
    """After appends of every shape (longer than R, shorter, ragged, a ring wrapping), row p % R holds position p
    for p in [seen - R, seen), in the exact dtype."""
    codec = ta.KVCodec(64, 4, 4)
    for window in (None, 11):
        cache = _cache(codec, 2, 2, 5, window, capacity=64)
        ks, vs = fill(gen, cache, (3, 9, 1, 4, 2), [None, [9, 2], [1, 0], [4, 4], [0, 2]])
        pos = recent_positions(cache.layout)
        for s in range(2):
            n = len(ks[s])
            assert cache.seen[s] == n
            for r in range(5):
                p = int(pos[s, r])
                assert p == (n - 5 + (r - n) % 5 if n - 5 + (r - n) % 5 >= 0 else -1)
                if p >= 0:
                    assert torch.equal(cache.recent_k[s, :, r], ks[s][p].to(torch.bfloat16))
                    assert torch.equal(cache.recent_v[s, :, r], vs[s][p].to(torch.bfloat16))



def test_all_real_appends_fill_the_window_as_ragged_ones_do(gen):
    """An append without new_lengths (every decode step: a shorter path, no gather or masks) leaves the window as
    the same append with new_lengths = T does: chunks longer than R, shorter, single tokens, a ring wrapping."""
    codec = ta.KVCodec(64, 4, 4)
    for window in (None, 11):
        plain, ragged = (_cache(codec, 2, 2, 5, window) for _ in range(2))
        for t in (7, 1, 3, 1, 5, 1, 1):
            k, v = (torch.randn(2, 2, t, 64, generator=gen) for _ in range(2))
            plain.append(k, v, backend="torch")
            ragged.append(k, v, new_lengths=[t, t], backend="torch")
            assert torch.equal(plain.recent_k, ragged.recent_k) and torch.equal(plain.recent_v, ragged.recent_v)

# -- state operations ---------------------------------------------------------------------------------------------
def test_options_are_checked():
    codec = ta.KVCodec(64, 4, 4)
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="exact_recent"):
            ta.QuantizedKVCache(codec, 1, 1, capacity=8, exact_recent=bad)
    for r_len in (8, 9):
        with pytest.raises(ValueError, match="sliding_window=8"):
            ta.QuantizedKVCache(codec, 1, 1, sliding_window=8, exact_recent=r_len)
    with pytest.raises(ValueError, match="exact_dtype"):
        ta.QuantizedKVCache(codec, 1, 1, capacity=8, exact_recent=2, exact_dtype=torch.int8)
    cache = ta.QuantizedKVCache(codec, 1, 1, sliding_window=8, exact_recent=7)
    assert cache.nbytes == 8 * codec.bytes_per_token() + 2 * 8 * 64 * 2
    assert "exact_recent=7 (bfloat16)" in repr(cache)


def test_crop_refills_overwritten_rows_from_the_codes(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 2, 1, 8, capacity=40, exact_dtype=torch.float32)
    ks, _ = fill(gen, cache, (20,))
    k_hat, _ = cache.dequantize()
    cache.crop(-3)   # window now [9, 17): 12..16 still exact, 9..11 were overwritten by 17..19
    pos = recent_positions(cache.layout)
    for r in range(8):
        p = int(pos[0, r])
        want = ks[0][p] if p >= 12 else k_hat[0, :, p]
        assert torch.equal(cache.recent_k[0, :, r], want), p
    q = torch.randn(2, 1, 1, 64, generator=gen)
    ref = cached_attention_naive(q, cache.layout, codec, compute_dtype=torch.float64)
    assert rel(ta.cached_attention(q, cache, backend="torch"), ref) < 1e-5
    cache.crop(2)    # fewer tokens than R: the rows without a position are zeroed, as in a fresh cache
    assert (recent_positions(cache.layout)[0] >= 0).sum() == 2
    assert torch.count_nonzero(cache.recent_k[:, :, [r for r in range(8) if r not in (0, 1)]]) == 0


def test_crop_of_a_wrapped_ring_keeps_it_consistent(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 1, 1, 4, window=6, exact_dtype=torch.float32)
    ks, _ = fill(gen, cache, (10,))
    k_hat, _ = cache.dequantize()
    cache.crop(-1)   # window [5, 9): 6..8 exact, 5 from the ring's slot 5 % 6
    r5 = 5 % 4
    assert torch.equal(cache.recent_k[0, :, r5], k_hat[0, :, 5 % 6])
    for p in (6, 7, 8):
        assert torch.equal(cache.recent_k[0, :, p % 4], ks[0][p])


def test_batch_edits_reset_and_repeat(gen):
    codec = ta.KVCodec(64, 4, 4)
    check_batch_edits_follow(gen, lambda static: _cache(codec, 2, 1, 4, capacity=16, static=static), "recent_k", "recent_v")


def test_growing_cache_keeps_the_window_across_reserve(gen):
    codec = ta.KVCodec(64, 4, 4)
    cache = _cache(codec, 1, 1, 4, capacity=8, exact_dtype=torch.float32)
    ks, _ = fill(gen, cache, (7,))
    cache.reserve(32)
    fill(gen, cache, (1,))
    assert torch.equal(cache.recent_k[0, :, 6 % 4], ks[0][6])


@pytest.mark.parametrize("window", [None, 12])
def test_save_and_load_round_trip(gen, tmp_path, window):
    codec = ta.KVCodec(64, 4, 3)
    cache = _cache(codec, 2, 2, 5, window, capacity=30)
    fill(gen, cache, (14,), shift=True)
    cache.save(tmp_path / "c.safetensors")
    back = ta.QuantizedKVCache.load(tmp_path / "c.safetensors")
    assert back.exact_recent == 5 and back.exact_dtype == torch.bfloat16
    assert torch.equal(back.recent_k, cache.recent_k) and torch.equal(back.recent_v, cache.recent_v)
    q = torch.randn(2, 4, 2, 64, generator=gen)
    assert torch.equal(ta.cached_attention(q, back, backend="torch"), ta.cached_attention(q, cache, backend="torch"))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "c.safetensors"), "pt") as f:
        assert f.metadata()["file_version"] == "2"


def test_a_file_without_a_window_still_loads(gen, tmp_path):
    codec = ta.KVCodec(64, 4, 3)
    cache = ta.QuantizedKVCache(codec, 1, 1, capacity=10)
    fill(gen, cache, (4,))
    cache.save(tmp_path / "old.safetensors")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "old.safetensors"), "pt") as f:
        assert f.metadata()["file_version"] == "1" and "exact_recent" not in f.metadata()
        assert "recent_k" not in f.keys()
    back = ta.QuantizedKVCache.load(tmp_path / "old.safetensors")
    assert back.exact_recent == 0 and back.recent_k is None


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@torch.no_grad()
def test_static_step_with_window_compiles_once(gen, backend):
    """Attention plus append on a static cache with a window: one graph (fullgraph=True), equal to eager steps
    on a growing cache with the same window."""
    codec = ta.KVCodec(64, 4, 3)
    static = _cache(codec, 2, 2, 6, capacity=64, static=True, exact_dtype=torch.float32)
    growing = _cache(codec, 2, 2, 6, capacity=64, exact_dtype=torch.float32)
    check_static_step_compiles_once(gen, static, growing, 4, 8 if backend == "torch" else 4, backend)
    assert torch.equal(static.recent_k, growing.recent_k)
