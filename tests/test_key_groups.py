"""Keys coded in channel groups (KVCodec(key_groups=...)): the format, the channel order the key transform fits,
the cache and attention over it (the PyTorch path: no kernel reads it yet), persistence and transformers."""

from __future__ import annotations

import pytest
import torch

import turboattn as ta
from turboattn import KVCodec
from turboattn.format.codebook import expected_mse
from turboattn.format.codec import key_groups_name, parse_key_groups
from turboattn.format.key_transform import (MIN_FIT_TOKENS, fit_key_order, from_stored_keys, to_stored_keys,
                                            to_stored_queries)
from turboattn.ops.backend import choose
from turboattn.ops.flash.naive import attention_reference

from quantize_checks import assert_grouped_codes_agree

GROUPS = ((48, 6), (80, 3))   # head_dim 128: the wide group first, as the fitted order puts it


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _uneven_keys(gen, *lead, d=128):
    """Keys whose channels differ in scale by 30x, in a shuffled order (as a model's are)."""
    spread = torch.linspace(0.1, 3.0, d)[torch.randperm(d, generator=gen)]
    return torch.randn(*lead, d, generator=gen) * spread


# -- the format ------------------------------------------------------------------
def test_codec_codes_each_group_as_a_key_of_its_own_width(gen):
    """The definition: group g of the stored key is coded exactly as KVCodec(width_g, bits_g) codes it, codes and
    scales side by side; decoding gives each group's own decoding back."""
    codec = KVCodec(128, None, 4, key_groups=GROUPS, scale_dtype=torch.bfloat16)
    x = _uneven_keys(gen, 3, 5)
    packed = codec.quantize(x, "k")
    wide, narrow = (KVCodec(w, b, b, scale_dtype=torch.bfloat16) for w, b in GROUPS)
    a, b = wide.quantize(x[..., :48], "k"), narrow.quantize(x[..., 48:], "k")
    assert torch.equal(packed.codes, torch.cat([a.codes, b.codes], -1))
    assert torch.equal(packed.scales, torch.cat([a.scales, b.scales], -1))
    decoded = codec.dequantize(packed, "k")
    assert torch.equal(decoded, torch.cat([wide.dequantize(a, "k"), narrow.dequantize(b, "k")], -1))
    assert torch.equal(codec.unpack(packed, "k"), torch.cat([wide.unpack(a, "k"), narrow.unpack(b, "k")], -1))
    # Values keep the plain format.
    plain = KVCodec(128, 4, 4, scale_dtype=torch.bfloat16)
    assert torch.equal(codec.quantize(x, "v").codes, plain.quantize(x, "v").codes)


def test_each_group_has_its_own_widths_error(gen):
    """Relative squared error per group near its width's Lloyd-Max distortion for Gaussian coordinates (what the
    rotation makes of them): the 6-bit group is about 50x more precise than the 3-bit one."""
    codec = KVCodec(128, None, 4, key_groups=GROUPS)
    x = torch.randn(4096, 128, generator=gen, dtype=torch.float64)
    y = codec.dequantize(codec.quantize(x, "k"), "k", torch.float64)
    for (lo, hi), (_, bits) in zip(((0, 48), (48, 128)), GROUPS):
        err = float((y - x)[:, lo:hi].pow(2).sum() / x[:, lo:hi].pow(2).sum())
        # The "corrected" scale rule lowers the error a little below the fixed-scale distortion (6 bits: 0.91x).
        assert 0.8 * expected_mse(bits) < err < 1.1 * expected_mse(bits), (bits, err, expected_mse(bits))


def test_sizes_and_names():
    codec = KVCodec(256, None, 3, key_groups=((112, 6), (144, 4)), scale_dtype=torch.bfloat16)
    assert codec.code_bytes("k") == (112 * 6 + 144 * 4) // 8 == 156
    assert codec.scale_count("k") == 2 and codec.scale_count("v") == 1
    assert codec.bytes_per_token() == 156 + 96 + 2 * 3
    assert codec.bits_per_element() == pytest.approx(8 * 258 / 512)
    assert codec.name == "k112x6+144x4v3" and KVCodec(64, 4, 3).name == "k4v3"
    assert parse_key_groups(key_groups_name(codec.key_groups)) == codec.key_groups
    assert codec.grouped_keys and not KVCodec(64).grouped_keys
    with pytest.raises(ValueError, match="no single width"):
        codec.bits("k")


@pytest.mark.parametrize("groups, k_bits, match", [
    (((48, 6), (80, 3)), 4, "k_bits=None"),
    ((), None, "needs key_groups"),
    (((128, 4),), None, "two groups"),
    (((32, 6), (32, 4), (64, 3)), None, "two groups"),
    (((48, 6), (64, 3)), None, "cover 112 channels"),
    (((40, 6), (88, 3)), None, "multiple of 16"),
    (((16, 6), (112, 3)), None, "multiple of 16"),
    (((48, 7), (80, 3)), None, "bits must be one of"),
    (((48, 6.0), (80, 3)), None, "bits must be one of"),
    ("48x6", None, "pairs"),
])
def test_bad_groups_are_refused(groups, k_bits, match):
    with pytest.raises(ValueError, match=match):
        KVCodec(128, k_bits, 4, key_groups=groups)


def test_groups_wider_than_a_norm_block_are_refused():
    with pytest.raises(ValueError, match="from 32 to 256"):
        KVCodec(512, None, 4, key_groups=((272, 6), (240, 4)))
    assert KVCodec(512, None, 4, key_groups=((256, 6), (256, 4))).scale_count("k") == 2


def test_nonfinite_anywhere_marks_the_whole_key(gen):
    codec = KVCodec(128, None, 4, key_groups=GROUPS)
    x = torch.randn(3, 128, generator=gen)
    x[0, 100] = float("nan")     # in the second group only
    x[1, 3] = float("inf")       # in the first
    packed = codec.quantize(x, "k")
    assert packed.scales[:2].isnan().all() and not packed.scales[2].isnan().any()
    assert (packed.codes[:2] == 0).all()
    y = codec.dequantize(packed, "k")
    assert y[:2].isnan().all() and torch.isfinite(y[2]).all()
    assert torch.equal(codec.dequantize(codec.quantize(torch.zeros(2, 128), "k"), "k"), torch.zeros(2, 128))


def test_parse_key_groups_refuses_other_text():
    with pytest.raises(ValueError, match="CHANNELSxBITS"):
        parse_key_groups("112-6+144x4")


# -- the channel order ----------------------------------------------------------------
def test_fit_key_order_sorts_channels_by_variance(gen):
    k = _uneven_keys(gen, 2, 3, 40) + 5.0     # a shared offset moves no variance
    order = fit_key_order(k)
    assert order.dtype == torch.int16 and order.shape == (2, 3, 128)
    var = k.double().var(dim=2, unbiased=False)
    sorted_var = var.gather(-1, order.long())
    assert (sorted_var[..., :-1] >= sorted_var[..., 1:]).all()
    assert torch.equal(order.long().sort(-1).values, torch.arange(128).expand(2, 3, 128))


def test_fit_key_order_ignores_padding_and_short_sequences(gen):
    t = 30
    k = _uneven_keys(gen, 2, 1, t)
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[0, :7] = False
    valid[1, :t - MIN_FIT_TOKENS + 1] = False
    k[0, :, :7] = 1e3 * torch.randn(1, 7, 128, generator=gen)   # padding that would dominate the variances
    order = fit_key_order(k, valid)
    assert torch.equal(order[0], fit_key_order(k[:1, :, 7:])[0])
    assert torch.equal(order[1, 0].long(), torch.arange(128))


def test_order_changes_no_score(gen):
    """(q / gain)[order] . ((k - shift) * gain)[order] = q . k - q . shift: a constant per query."""
    b, hkv, g, t, d = 2, 2, 2, 9, 128
    q = torch.randn(b, hkv * g, 1, d, generator=gen, dtype=torch.float64)
    k = _uneven_keys(gen, b, hkv, t).double()
    shift = torch.randn(b, hkv, d, generator=gen, dtype=torch.float64)
    gain = torch.rand(b, hkv, d, generator=gen, dtype=torch.float64) + 0.5
    order = fit_key_order(k)
    stored = to_stored_keys(k, shift, gain, order)
    torch.testing.assert_close(from_stored_keys(stored, shift, gain, order), k)
    qs = to_stored_queries(q, gain, order).reshape(b, hkv, g, d)
    got = torch.einsum("bhgd,bhtd->bhgt", qs, stored)
    qq = q.reshape(b, hkv, g, d)
    want = torch.einsum("bhgd,bhtd->bhgt", qq, k) - torch.einsum("bhgd,bhd->bhg", qq, shift)[..., None]
    # to_stored_queries works in float32 (as the kernels take q): one rounding of each q_c / gain_c.
    bound = 2.0**-23 * torch.einsum("bhgd,bhtd->bhgt", qs.abs(), stored.abs())
    assert ((got - want).abs() <= bound).all()


# -- the cache and attention ----------------------------------------------------------
def _filled_cache(gen, b=2, hkv=2, t=37, window=None, order=True, **options):
    codec = KVCodec(128, None, 4, key_groups=GROUPS, scale_dtype=torch.bfloat16)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else 64, sliding_window=window, **options)
    k, v = _uneven_keys(gen, b, hkv, t), torch.randn(b, hkv, t, 128, generator=gen)
    shift = k.mean(2)
    cache.set_key_transform(shift, torch.ones_like(shift), fit_key_order(k) if order else None)
    cache.append(k, v)
    return cache, k, v


def _expected_keys(cache, k):
    """k as the cache should give it back, built from the group codecs and the order by hand."""
    shift, order = cache.key_shift, cache.key_order.long()
    stored = (k - shift[:, :, None]).gather(-1, order[:, :, None, :].expand(k.shape))
    parts, lo = [], 0
    for width, bits in GROUPS:
        sub = KVCodec(width, bits, bits, scale_dtype=torch.bfloat16)
        parts.append(sub.dequantize(sub.quantize(stored[..., lo:lo + width], "k"), "k"))
        lo += width
    decoded = torch.cat(parts, -1)
    return torch.empty_like(decoded).scatter_(-1, order[:, :, None, :].expand(k.shape), decoded) + shift[:, :, None]


@pytest.mark.parametrize("gqa", [1, 3])
def test_attention_matches_float64_reference(gen, gqa):
    """Decode with fresh k, v over the grouped cache against exact attention over the keys and values the format
    defines (group codecs and the order applied by hand), in float64."""
    cache, k, v = _filled_cache(gen, exact_recent=4)
    k_hat, v_hat = _expected_keys(cache, k), cache.codec.dequantize(cache.codec.quantize(v, "v"), "v")
    recent = slice(37 - 4, 37)   # the exact window: read in full precision
    k_hat[:, :, recent], v_hat[:, :, recent] = k[:, :, recent].bfloat16().float(), v[:, :, recent].bfloat16().float()
    q = torch.randn(2, 2 * gqa, 1, 128, generator=gen)
    kf, vf = torch.randn(2, 2, 1, 128, generator=gen), torch.randn(2, 2, 1, 128, generator=gen)
    got = ta.cached_attention(q, cache, kf, vf)
    want = attention_reference(q.double(), torch.cat([k_hat, kf], 2).double(), torch.cat([v_hat, vf], 2).double(),
                               causal=True)
    # float32 compute over float64: rounding only (1e-6 relative), where a wrong group or order costs > 1e-2.
    assert _rel(got, want) < 1e-5
    kd, _ = cache.dequantize()
    torch.testing.assert_close(kd[:, :, :37], _expected_keys(cache, k))


def test_fitted_order_beats_the_model_order(gen):
    """The point of the order: high-variance channels in the 6-bit group code the keys with less error."""
    fitted, k, _ = _filled_cache(gen)
    plain, _, _ = _filled_cache(torch.Generator().manual_seed(0), order=False)
    k_plain = _uneven_keys(torch.Generator().manual_seed(0), 2, 2, 37)
    err_fitted = _rel(fitted.dequantize()[0][:, :, :37], k)
    err_plain = _rel(plain.dequantize()[0][:, :, :37], k_plain)
    assert err_fitted < 0.8 * err_plain


def test_ring_wraps(gen):
    cache, k, v = _filled_cache(gen, b=1, t=50, window=16)
    q = torch.randn(1, 2, 1, 128, generator=gen)
    k_hat, v_hat = _expected_keys(cache, k), cache.codec.dequantize(cache.codec.quantize(v, "v"), "v")
    got = ta.cached_attention(q, cache)
    want = attention_reference(q.double(), k_hat[:, :, -16:].double(), v_hat[:, :, -16:].double(), causal=True)
    assert _rel(got, want) < 1e-5


def test_batch_edits_keep_each_sequences_order(gen):
    cache, k, v = _filled_cache(gen)
    q = torch.randn(2, 2, 1, 128, generator=gen)
    before = ta.cached_attention(q, cache)
    cache.reorder_cache([1, 0])
    assert torch.equal(ta.cached_attention(q[[1, 0]], cache), before[[1, 0]])
    cache.crop(20)
    assert torch.equal(cache.dequantize()[0][:, :, :20], _expected_keys(cache, k[[1, 0], :, :20]))


def test_auto_sends_grouped_keys_where_they_are_read():
    """"auto" on CUDA tensors: cached attention and quantize-append go to the CUDA implementations, which run their
    kernels for the key groups they are built for and hand other groupings to Triton."""
    from turboattn.ops import backend
    cuda = torch.device("cuda")
    assert choose("cached_attention", "auto", cuda, 256, True) == "cuda"
    for grouped in (False, True):
        assert choose("quantize_append", "auto", cuda, 256, grouped) == "cuda"
    assert choose("quantize_append", "auto", cuda, 80, True) == "triton"
    assert backend._REGISTRY["quantize_append"]["cuda"].serves(128, True)


def test_cuda_key_group_builds_match_the_kernels_list():
    """config.CUDA_KEY_GROUPS names the builds of TURBOATTN_KEY_GROUPS (csrc/decode.h), and only those serve."""
    import re
    from pathlib import Path
    from turboattn.ops.cached import config
    header = (Path(config.__file__).parent / "csrc" / "decode.h").read_text()
    macro = re.search(r"#define TURBOATTN_KEY_GROUPS\(X\)(.*)", header).group(1)
    entries = re.findall(r"X\((\d+), (\d+), (\d+), (\d+), (\d+)\)", macro)
    built = {(d, ((ga, kb), (d - ga, kb2)), vb) for d, ga, kb, kb2, vb in (map(int, e) for e in entries)}
    assert built == set(config.CUDA_KEY_GROUPS) and len(built) >= 2
    for d, groups, vb in built:
        assert config.cuda_kernel_serves(d, groups, vb, 8) and not config.cuda_kernel_serves(d, groups, vb, 9)
        assert KVCodec(d, None, vb, key_groups=groups).key_code == groups
    assert not config.cuda_kernel_serves(256, ((128, 6), (128, 4)), 3, 1)
    assert not config.cuda_kernel_serves(256, ((112, 6), (144, 4)), 4, 1)
    # Tables: 6-bit (8 KB) + 4-bit (32 KB) + 3-bit values (12 KB); D = 256 kernels are built for 2 CTAs per SM.
    assert config.cuda_ctas_per_sm(256, ((112, 6), (144, 4)), 3) == 2


def test_a_forced_backend_that_does_not_read_groups_is_refused(gen, monkeypatch):
    from turboattn.ops import backend
    monkeypatch.setitem(backend._REGISTRY, "cached_attention", dict(backend._REGISTRY["cached_attention"]))
    backend.register("cached_attention", "triton", "turboattn.ops.cached.naive:cached_attention_naive", priority=10,
                     devices=("cuda",))   # one without grouped_keys=True
    cache, _, _ = _filled_cache(gen)
    q = torch.randn(2, 2, 1, 128, generator=gen)
    try:
        with pytest.raises(ValueError, match="channel groups"):
            ta.cached_attention(q, cache, backend="triton")
    finally:
        monkeypatch.undo()
        backend._auto.cache_clear()


def test_bad_orders_are_refused(gen):
    codec = KVCodec(128, None, 4, key_groups=GROUPS)
    cache = ta.QuantizedKVCache(codec, 1, 1, capacity=8)
    zeros, ones = torch.zeros(1, 1, 128), torch.ones(1, 1, 128)
    repeated = torch.zeros(1, 1, 128, dtype=torch.int16)
    with pytest.raises(ValueError, match="permutation"):
        cache.set_key_transform(zeros, ones, repeated)
    with pytest.raises(ValueError, match="int16"):
        cache.set_key_transform(zeros, ones, torch.arange(128)[None, None])
    plain = ta.QuantizedKVCache(KVCodec(128, 4, 4), 1, 1, capacity=8)
    with pytest.raises(ValueError, match="channel groups"):
        plain.set_key_transform(zeros, ones, torch.arange(128, dtype=torch.int16)[None, None])


def test_saved_cache_loads_bit_for_bit(gen, tmp_path):
    cache, _, _ = _filled_cache(gen, exact_recent=4)
    cache.save(tmp_path / "c.safetensors")
    loaded = ta.QuantizedKVCache.load(tmp_path / "c.safetensors")
    assert loaded.codec == cache.codec and torch.equal(loaded.key_order, cache.key_order)
    for name in ("k_codes", "k_scales", "v_codes", "v_scales", "recent_k"):
        assert torch.equal(getattr(loaded, name), getattr(cache, name))
    q = torch.randn(2, 2, 1, 128, generator=gen)
    assert torch.equal(ta.cached_attention(q, loaded), ta.cached_attention(q, cache))


# -- the Triton kernels (TRITON_INTERPRET=1 in CI, or a GPU) -----------------------------------
needs_triton = pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1"
                                  and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 (set by `make test`) or a GPU")
# float16 dot operands (q, centroids, weights; exact rows' keys): a handful of 2^-11 roundings (the plain kernel's
# tests/test_kernels_cached.py bound).
FP16_TOL = 5 * 2.0**-11
# (head_dim, groups, v_bits): powers of two, groups that are not (112 = 16 x 7, 144 = 16 x 9), two norm blocks of
# values at 512.
TRITON_CASES = [(64, ((32, 6), (32, 3)), 4), (256, ((112, 6), (144, 4)), 3), (128, ((48, 5), (80, 2)), 8),
                (512, ((256, 8), (256, 4)), 4)]


def _grouped_cache(gen, d, groups, v_bits, b=2, hkv=2, t=45, window=None, **options):
    codec = KVCodec(d, None, v_bits, key_groups=groups, scale_dtype=torch.bfloat16)
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=None if window else t + 4, sliding_window=window, **options)
    k, v = _uneven_keys(gen, b, hkv, t, d=d), torch.randn(b, hkv, t, d, generator=gen)
    gain = torch.rand(b, hkv, d, generator=gen) + 0.5   # a "balance" fit's gains: q / gain against k * gain
    cache.set_key_transform(k.mean(2), gain, fit_key_order(k * gain[:, :, None]))
    cache.append(k[:, :, :20], v[:, :, :20], backend="torch")
    cache.append(k[:, :, 20:], v[:, :, 20:], backend="torch")
    return cache


@needs_triton
@pytest.mark.parametrize("d, groups, v_bits", TRITON_CASES, ids=["d64", "d256", "d128", "d512"])
@pytest.mark.parametrize("options", [dict(), dict(exact_recent=5, exact_first=3), dict(window=16)],
                         ids=["plain", "exact-rows", "ring"])
def test_triton_attention_matches_the_pytorch_twin(gen, d, groups, v_bits, options):
    """Decode (Tq = 1, GQA 4) and a 3-token extend with fresh k, v: the Triton kernel against the PyTorch path,
    both over the same cache."""
    cache = _grouped_cache(gen, d, groups, v_bits, **options)
    for tq, group in ((1, 4), (3, 2)):
        q = torch.randn(2, 2 * group, tq, d, generator=gen)
        kf, vf = _uneven_keys(gen, 2, 2, tq, d=d), torch.randn(2, 2, tq, d, generator=gen)
        want = ta.cached_attention(q, cache, kf, vf, backend="torch")
        got = ta.cached_attention(q, cache, kf, vf, backend="triton")
        assert _rel(got, want) < FP16_TOL, (tq, _rel(got, want))


@needs_triton
def test_triton_attention_nonfinite_keys(gen):
    """A stored key with a NaN reaches exactly the queries that see it, in both paths."""
    codec = KVCodec(64, None, 4, key_groups=((32, 6), (32, 3)))
    cache = ta.QuantizedKVCache(codec, 1, 1, capacity=40)
    k, v = torch.randn(1, 1, 30, 64, generator=gen), torch.randn(1, 1, 30, 64, generator=gen)
    k[0, 0, 7, 50] = float("nan")
    cache.append(k, v, backend="torch")
    q = torch.randn(1, 2, 1, 64, generator=gen)
    assert torch.isnan(ta.cached_attention(q, cache, backend="triton")).all()
    cache.crop(7)   # the NaN key is gone
    want = ta.cached_attention(q, cache, backend="torch")
    assert torch.isfinite(want).all() and _rel(ta.cached_attention(q, cache, backend="triton"), want) < FP16_TOL


@needs_triton
@pytest.mark.parametrize("d, groups, v_bits", TRITON_CASES, ids=["d64", "d256", "d128", "d512"])
@pytest.mark.parametrize("window", [None, 16], ids=["contiguous", "ring"])
def test_triton_append_matches_the_pytorch_twin(gen, d, groups, v_bits, window):
    """Two appends (the second ragged) through the Triton kernels and through the PyTorch path, codes compared;
    a NaN anywhere in a key marks all of it and is counted once."""
    caches = []
    codec = KVCodec(d, None, v_bits, key_groups=groups)
    k, v = _uneven_keys(gen, 2, 2, 30, d=d), torch.randn(2, 2, 30, d, generator=gen)
    k[1, 0, 25, d - 1] = float("nan")
    order = fit_key_order(k[:, :, :20])
    for backend in ("triton", "torch"):
        cache = ta.QuantizedKVCache(codec, 2, 2, capacity=None if window else 32, sliding_window=window)
        cache.set_key_transform(k[:, :, :20].mean(2), torch.ones(2, 2, d), order)
        cache.append(k[:, :, :20], v[:, :, :20], backend=backend)
        cache.append(k[:, :, 20:], v[:, :, 20:], new_lengths=[10, 7], backend=backend)
        caches.append(cache)
    fused, ref = caches
    assert torch.equal(fused.nonfinite, ref.nonfinite) and fused.nonfinite.tolist() == [0, 1]
    assert torch.equal(fused.k_scales.isnan(), ref.k_scales.isnan())
    if window is None:
        keep = torch.cat([torch.ones(20, dtype=torch.bool), torch.arange(10) < 7])   # sequence 1's real tokens
        finite = torch.isfinite(k).all(-1)
        assert bool(finite[0].all()) and not bool(finite[1, 0, 25])
        assert_grouped_codes_agree(fused, ref, k[:1], v[:1], 0)
        kept = torch.where(finite[..., None], k, 0)[1:, :, keep]   # the NaN key: codes 0 in both (checked above)
        assert_grouped_codes_agree(fused, ref, kept, v[1:, :, keep], 1)
