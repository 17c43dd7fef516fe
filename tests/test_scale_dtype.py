"""Scales stored in bfloat16 (KVCodec(scale_dtype=torch.bfloat16)): half the scale bytes, the same codes.

bfloat16 keeps float32's exponent range and rounds to 8 significant bits: a scale rounded to nearest is off by at
most 2^-8 relative (the unit roundoff), and a block decodes to its float32-scale value times (1 + that), so every bound below follows
from that one rounding.  The Triton quantize kernel rounds in integer arithmetic (ops/quantize/triton.py), so it
must store the very bits torch's .to(torch.bfloat16) gives.
"""

from __future__ import annotations

import os

import pytest
import torch

import turboattn as ta
from turboattn.cache.persist import load_cache, save_cache
from turboattn.format import rotation
from turboattn.ops.cached.naive import cached_attention_naive

BF16 = torch.bfloat16
BF16_ROUNDING = 2.0**-8            # unit roundoff of 8 significant bits, round to nearest
FP16_TOL = 4 * 2.0**-11            # the cached-attention kernel's float16 dot operands (test_kernels_cached.py)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _kv(gen, b, hkv, t, d):
    k = torch.randn(b, hkv, t, d, generator=gen) * 3
    return k, torch.randn(b, hkv, t, d, generator=gen)


@pytest.mark.parametrize("d", [64, 128, 512, 80])
def test_bf16_scales_cost_half_and_round_once(d, gen):
    f32, bf16 = ta.KVCodec(d, 4, 3), ta.KVCodec(d, 4, 3, scale_dtype=BF16)
    assert f32.bytes_per_token() - bf16.bytes_per_token() == 2 * 2 * f32.num_blocks
    if d == 64:
        assert ta.KVCodec(64, 4, 4, scale_dtype=BF16).bits_per_element() == 4.25
    x = torch.randn(5, 7, d, generator=gen) * torch.logspace(-20, 20, 7)[:, None]   # far outside float16's range
    for kind in ("k", "v"):
        a, b = f32.quantize(x, kind), bf16.quantize(x, kind)
        assert b.scales.dtype == BF16 and torch.equal(a.codes, b.codes)
        assert torch.equal(b.scales, a.scales.to(BF16))
        xa, xb = f32.dequantize(a, kind, torch.float64), bf16.dequantize(b, kind, torch.float64)
        # A scale block lives in the rotated domain; the rotation spans the whole head (two 256-blocks at
        # D = 512), so the per-block bound holds there, and over the whole vector in either domain.
        ya, yb = rotation.rotate(xa), rotation.rotate(xb)
        blocks = (-1, f32.num_blocks, f32.block_size)
        rel = (yb - ya).reshape(blocks).norm(dim=-1) / ya.reshape(blocks).norm(dim=-1)
        assert float(rel.max()) <= BF16_ROUNDING * (1 + 1e-6)
        whole = (xb - xa).norm(dim=-1) / xa.norm(dim=-1)
        assert float(whole.max()) <= BF16_ROUNDING * (1 + 1e-6)


def test_other_scale_dtypes_are_refused():
    with pytest.raises(ValueError, match="scale_dtype must be one of float32, bfloat16"):
        ta.KVCodec(64, 4, 4, scale_dtype=torch.float16)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("d, window", [(64, None), (128, 9), (512, None)])
def test_triton_quantize_stores_torchs_bf16_rounding(d, window, gen):
    """The Triton kernel against the PyTorch twin with bfloat16 scales: ragged lengths, a ring that wraps, a NaN
    vector (NaN scales, counted), a zero vector (zero scale).  As with float32 scales (test_kernels_quantize.py),
    only codes within float rounding of a cell boundary may differ, and float32 scales agree to 1e-5 relative
    where a block's codes agree; rounded to nearest bfloat16, two such values are equal or adjacent (one
    rounding boundary may lie between them), so their bit patterns differ by at most 1."""
    from quantize_checks import near_boundary
    codec = ta.KVCodec(d, 4, 3, scale_dtype=BF16)
    caches = [ta.QuantizedKVCache(codec, 2, 2, capacity=None if window else 40, sliding_window=window)
              for _ in range(2)]
    inputs = []
    for t, lengths in ((13, [13, 5]), (11, None)):
        k, v = _kv(gen, 2, 2, t, d)
        k[0, 1, 2] = float("nan")
        v[1, 0, 0] = 0.0
        inputs.append((k, v))
        for cache, backend in zip(caches, ("torch", "triton")):
            cache.append(k, v, new_lengths=lengths, backend=backend)
    want, got = caches
    assert torch.equal(want.seen, got.seen) and torch.equal(want.nonfinite, got.nonfinite)
    # Two NaN vectors were appended; a 9-slot ring keeps only the last 9 of the first 13-token chunk.
    assert int(got.nonfinite.sum()) == (1 if window else 2)
    for i, kind in enumerate(("k", "v")):
        idx = [codec.unpack(ta.Packed(getattr(c, f"{kind}_codes"), getattr(c, f"{kind}_scales")), kind)
               for c in (want, got)]
        finite = torch.isfinite(getattr(want, f"{kind}_scales"))
        near = sum(int(near_boundary(codec, kv[i].nan_to_num(), kind).sum()) for kv in inputs)
        assert int((idx[0] != idx[1]).sum()) <= near
        a, b = getattr(want, f"{kind}_scales"), getattr(got, f"{kind}_scales")
        assert b.dtype == BF16 and torch.equal(a.isnan(), b.isnan())
        flipped = (idx[0] != idx[1]).reshape(*idx[0].shape[:-1], codec.num_blocks, codec.block_size).any(-1)
        steps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        assert int(steps[finite & ~flipped].max()) <= 1
        # A midpoint lies between two float32 values 1e-5 apart with probability <= 1e-5 / 2^-8 (0.3%): more than
        # a few adjacent pairs means another rounding (truncation would differ in about half of them).
        used = finite & ~flipped & (a != 0)
        assert float((steps[used] > 0).float().mean()) < 0.05
        rel = (a.double() - b.double()).abs() / a.double().abs().clamp_min(1e-30)
        assert float(rel[finite].max()) < 0.05 + 2.0**-7   # a flipped code's 5% (test_kernels_quantize.py)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("d, group, tq, fresh", [(64, 3, 1, True), (128, 1, 3, False), (512, 4, 2, True)])
def test_cached_attention_reads_bf16_scales(d, group, tq, fresh, gen):
    codec = ta.KVCodec(d, 4, 4, scale_dtype=BF16)
    cache = ta.QuantizedKVCache(codec, 2, 2, capacity=80)
    cache.append(*_kv(gen, 2, 2, 70, d), new_lengths=[70, 33], backend="torch")
    q = torch.randn(2, 2 * group, tq, d, generator=gen).half()
    kf, vf = (x.half() for x in _kv(gen, 2, 2, tq, d)) if fresh else (None, None)
    out = ta.cached_attention(q, cache, kf, vf, backend="triton")
    ref = cached_attention_naive(q, cache.layout, cache.codec, kf, vf, compute_dtype=torch.float64)
    assert float((out.double() - ref).norm() / ref.norm()) < FP16_TOL


def test_bf16_scale_cache_reloads_bit_for_bit(gen, tmp_path):
    cache = ta.QuantizedKVCache(ta.KVCodec(64, 4, 3, scale_dtype=BF16), 2, 2, capacity=30)
    cache.append(*_kv(gen, 2, 2, 17, 64), backend="torch")
    save_cache(cache, tmp_path / "c.safetensors")
    back = load_cache(tmp_path / "c.safetensors")
    assert back.codec == cache.codec and back.k_scales.dtype == BF16
    for name in ("k_codes", "v_codes", "k_scales", "v_scales", "seen"):
        assert torch.equal(getattr(back, name)[:, :, :17] if getattr(back, name).dim() > 1 else getattr(back, name),
                           getattr(cache, name)[:, :, :17] if getattr(cache, name).dim() > 1 else getattr(cache, name))
    q = torch.randn(2, 4, 1, 64, generator=gen)
    assert torch.equal(ta.cached_attention(q, back, backend="torch"), ta.cached_attention(q, cache, backend="torch"))


@torch.no_grad()
def test_hf_cache_with_bf16_scales_saves_and_reloads(tmp_path):
    """TurboQuantCache(scale_dtype=torch.bfloat16): every layer stores bfloat16 scales, counted in the bits per
    element, and a saved cache reloads to the same next-token logits."""
    pytest.importorskip("transformers")
    from hf_models import random_ids, tiny_gemma3

    from turboattn.hf import TurboQuantCache, load_turboquant_cache, save_turboquant_cache
    model = tiny_gemma3()
    ids = random_ids(20, seed=3)
    caches = {dt: TurboQuantCache(model.config, 4, 4, scale_dtype=dt) for dt in (torch.float32, BF16)}
    for cache in caches.values():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    cache = caches[BF16]
    d = cache.layers[0].cache.codec.head_dim
    assert all(layer.cache.k_scales.dtype == BF16 for layer in cache.layers)
    assert caches[torch.float32].bits_per_element() - cache.bits_per_element() == pytest.approx(16 / d)
    save_turboquant_cache(cache, tmp_path / "c.safetensors")
    loaded = load_turboquant_cache(tmp_path / "c.safetensors", model.config)
    assert loaded.scale_dtype == BF16
    token = torch.tensor([[5]])
    assert torch.equal(model(input_ids=token, past_key_values=loaded).logits,
                       model(input_ids=token, past_key_values=cache).logits)


def test_eval_runs_each_scale_dtype():
    """`turboattn eval --scale-dtype float32,bfloat16`: both storages, named apart, bits from the codec."""
    pytest.importorskip("transformers")
    from turboattn.cli import eval as ev
    from turboattn.cli.main import build_parser
    assert build_parser().parse_args(["eval"]).scale_dtype == ["float32"]
    assert build_parser().parse_args(["eval", "--scale-dtype", "float32,bfloat16"]).scale_dtype == ["float32",
                                                                                                   "bfloat16"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--scale-dtype", "float16"])
    method = ev.turbo_method("k4v4", "corrected", "decode", scale_dtype="bfloat16", exact_recent=8)
    assert method.name == "k4v4-corrected-decode-center-r8-bf16scales" and method.info["scale_dtype"] == "bfloat16"
    assert ev.bits_per_element("k4v4", 64, "bfloat16") == 4.25 and ev.bits_per_element("k4v4", 64) == 4.5


def test_report_labels_scales_and_full_layer_windows():
    """QUALITY.md's tables list rows with bf16 scales and with the window on full layers only, each under its
    own label (their method names carry -bf16scales and -r{R}full)."""
    from turboattn.cli.eval.report import markdown_tables
    base = dict(family="turboattn", preset="k4v4", rule="corrected", mode="decode", fit_keys="center",
                ppl_change_pct=0.04, ppl_change_ci95_pct=[0.0, 0.1], argmax_disagree_pct=1.0, attn_cos_mean=0.99,
                attn_cos_p1=0.9)
    rows = {"k4v4-corrected-decode-center-bf16scales": base | dict(scale_dtype="bfloat16"),
            "k4v4-corrected-decode-center-r8full-bf16scales": base | dict(scale_dtype="bfloat16", exact_recent=8,
                                                                         recent_sliding=False, bits_per_element=4.3)}
    report = {"results": {"reference": {"ppl": 10.0}} | rows, "head_dim": 64, "segments": 1, "scored_per_segment": 8}
    text = markdown_tables(report)
    assert "| k4v4 + bf16 scales | 4.250 |" in text
    assert "| k4v4 + 8 exact (full layers) + bf16 scales | 4.300 |" in text
