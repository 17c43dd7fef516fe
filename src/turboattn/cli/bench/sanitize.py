"""`turboattn bench sanitize-cases`: small decode cases to run under NVIDIA compute-sanitizer.

  compute-sanitizer --tool memcheck .venv/bin/turboattn bench sanitize-cases
  compute-sanitizer --tool memcheck .venv/bin/turboattn bench sanitize-cases --cases passkey --prompt 3000

Each case launches the compressed-cache kernels (quantize-append and cached
attention), synchronizes, and prints one line; the sanitizer reports any
out-of-bounds or misaligned access.  The command exits with status 1 if an
output is not finite, so a run also fails on a silent wrong result.

  small    D 128 / 256 / 512 / 64 at k4v4 / k8v3 / k5v6, ring caches (window 100), ragged
           lengths (250 and 117 tokens), 3-token and 1-token steps with fresh K/V and attention sinks;
  passkey  SmolLM2's shapes (D 64, 3 KV heads, 9 query heads): a --prompt-token prefill,
           a 12-token question, then one-token steps, with and without a fitted key
           transform, at k4v3, k4v4, k8v8 and k5v3 (the configuration that once read
           shared memory out of bounds, BENCHMARKS.md).
  cuda     the CUDA decode kernel: k4v4, k8v8, k4v3 and k5v3 at D 64 / 128 / 256 / 512, and k2v2, k4v2, k8v4,
           k2v8, k3v3, k6v6 at D 128 (one-token steps, 1-8 query rows per KV head), a ring cache that has wrapped,
           fresh tokens in the launch, sinks and softcap, ragged lengths and a sequence of one token; 32 splits
           merged by the second launch.
  options  the cache options: exact recent window, exact first tokens, bfloat16 scales, a
           static cache, and head dims that are not powers of two (80, 96); the 3-token steps
           (12 query rows per KV head) run the Triton kernel, the 1-token steps the CUDA kernel
           where it serves the case (D 64 / 128).
  groups   keys in channel groups on the CUDA kernels (both groupings they are built for, D 256): appends of a
           300-token chunk with ragged lengths and of one token, with a key transform and channel order, into a
           contiguous cache with exact first and recent rows and into a ring that wraps; one-token decode steps
           with and without fresh tokens, 1-8 query rows per KV head.
  flash    the dense kernels: causal prefill at D 64 / 128 / 512 and D 80, a boolean mask
           (tile classification), sliding window with sinks, softcap and ALiBi, and the
           split-K decode kernel with its reduction (Lq 1 and 4) at D 128 / 512.

`tests/gpu/test_sanitizer.py` runs every case set under memcheck and racecheck.
"""

from __future__ import annotations

import torch

import turboattn as ta

from ...format.key_transform import fit_key_transform
from .args import choices, positive_int
from .common import require_cuda

CASES = ("small", "passkey", "cuda", "options", "groups", "flash")


def add_arguments(parser) -> None:
    parser.add_argument("--cases", type=choices(*CASES), default=list(CASES),
                        help="comma list of case sets: " + ", ".join(CASES) + " (default: all)")
    parser.add_argument("--prompt", type=positive_int, default=1500, help="prefill tokens of the passkey cases")


def _bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def small_cases():
    """(name, output) of decode steps over ragged, ring and plain caches: 3 tokens (12 query rows per KV head,
    the Triton kernels) and 1 token (4 rows: the CUDA kernel at k4v4 and D 64/128/256)."""
    for d, bits, window in ((128, (4, 4), None), (128, (4, 4), 100), (256, (4, 4), None), (512, (8, 3), 100),
                            (64, (5, 6), None)):
        cache = ta.QuantizedKVCache(ta.KVCodec(d, *bits), 2, 2, capacity=None if window else 300,
                                    sliding_window=window, device="cuda")
        for t, out in _ragged_steps(cache, d, store_steps=False):
            yield f"D={d} k{bits[0]}v{bits[1]} window={window} tokens={t}", out


def _ragged_steps(cache, d: int, store_steps: bool):
    """(tokens, output) of a 3-token and a 1-token step (fresh k/v, sinks, 8 query heads over 2 KV heads) after
    ragged prefills of 250 and 117 tokens; store_steps appends each step's k/v to the cache after it."""
    k = _bf16(2, 2, 250, d)
    cache.append(k, torch.randn_like(k), new_lengths=[250, 117])
    for t in (3, 1):
        kf = _bf16(2, 2, t, d)
        vf = torch.randn_like(kf)
        yield t, ta.cached_attention(_bf16(2, 8, t, d), cache, kf, vf, sinks=torch.randn(8, device="cuda"))
        if store_steps:
            cache.append(kf, vf)


def passkey_cases(prompt: int):
    """(name, output of the last step) of a prefill, a question chunk and decode steps, SmolLM2's shapes."""
    b, hkv, g, d = 1, 3, 3, 64
    for bits in ((4, 3), (4, 4), (8, 8), (5, 3)):
        for fit in (False, True):
            torch.manual_seed(0)
            cache = ta.QuantizedKVCache(ta.KVCodec(d, *bits), b, hkv, capacity=prompt, device="cuda")
            k = _bf16(b, hkv, prompt, d) + 2
            if fit:
                cache.set_key_transform(*fit_key_transform(_bf16(b, hkv * g, prompt, d), k))
            cache.append(k, torch.randn_like(k))
            for t in (12, 1, 1, 1):
                kn = _bf16(b, hkv, t, d)
                out = ta.cached_attention(_bf16(b, hkv * g, t, d), cache, kn, torch.randn_like(kn))
                if cache.max_seen + t > cache.capacity:
                    cache.reserve(cache.capacity + t)
                cache.append(kn, torch.randn_like(kn))
            yield f"passkey k{bits[0]}v{bits[1]} {'fit' if fit else 'plain'} prompt={prompt}", out


def cuda_cases():
    """(name, output) of one-token steps the CUDA decode kernel serves (cached/cuda.py `supports`)."""
    from ...ops.cached import cuda

    # Every head dim: one-plane and two-plane codes (3, 5 bits: the high plane's slice per lane); D = 128 adds
    # the other widths' pairs.
    pairs = ((4, 4), (8, 8), (4, 3), (5, 3), (2, 2), (4, 2), (8, 4), (2, 8), (3, 3), (6, 6))
    for d in (64, 128, 256, 512):
        for bits in pairs if d == 128 else pairs[:4]:
            for window in (None, 96):
                cache = ta.QuantizedKVCache(ta.KVCodec(d, *bits), 3, 2, capacity=None if window else 400,
                                            sliding_window=window, device="cuda")
                k = _bf16(3, 2, 333, d)
                cache.append(k, torch.randn_like(k), new_lengths=[333, 40, 1])   # a ring wraps at 96
                for g, fresh in ((4, True), (1, False), (8, True)):
                    q = _bf16(3, 2 * g, 1, d)
                    assert cuda.supports(q, cache.codec, 2), "the case must reach the CUDA kernel"
                    kf = _bf16(3, 2, 1, d) if fresh else None
                    vf = None if kf is None else torch.randn_like(kf)
                    sinks = torch.randn(2 * g, device="cuda")
                    out = ta.cached_attention(q, cache, kf, vf, sinks=sinks, softcap=30.0 if fresh else None)
                    yield f"cuda D={d} k{bits[0]}v{bits[1]} window={window} group={g} fresh={fresh}", out
                    # 32 parts of 8 rows, some empty: merged by a launch of their own, two CTAs a row at D = 512
                    # (cuda_merge_slices)
                    if g == 8:
                        out = ta.cached_attention(q, cache, kf, vf, sinks=sinks, num_splits=32)
                        yield f"cuda D={d} k{bits[0]}v{bits[1]} window={window} merge apart", out


def group_cases():
    """(name, output) of caches with keys in channel groups through the CUDA append and decode kernels."""
    from ...format.key_transform import fit_key_order
    from ...ops.cached import cuda
    from ...ops.cached.config import CUDA_KEY_GROUPS

    for d, groups, v_bits in sorted(CUDA_KEY_GROUPS):
        for window in (None, 96):
            exact = dict(exact_first=4, exact_recent=8) if window is None else dict(exact_recent=8)
            cache = ta.QuantizedKVCache(ta.KVCodec(d, None, v_bits, key_groups=groups, scale_dtype=torch.bfloat16),
                                        3, 2, capacity=None if window else 400, sliding_window=window,
                                        device="cuda", **exact)
            k = _bf16(3, 2, 300, d)
            cache.set_key_transform(k.float().mean(2), torch.rand(3, 2, d, device="cuda") + 0.5, fit_key_order(k))
            cache.append(k, torch.randn_like(k), new_lengths=[300, 40, 1])   # a ring wraps at 96
            for g, fresh in ((4, True), (1, False), (8, True)):
                q = _bf16(3, 2 * g, 1, d)
                assert cuda.supports(q, cache.codec, 2), "the case must reach the CUDA kernel"
                kf = _bf16(3, 2, 1, d) if fresh else None
                out = ta.cached_attention(q, cache, kf, None if kf is None else torch.randn_like(kf))
                if fresh:
                    cache.append(kf, torch.randn_like(kf))
                yield f"groups {cache.codec.name} window={window} group={g} fresh={fresh}", out


def option_cases():
    """(name, output) of the cached-attention kernels (Triton; CUDA for the 1-token steps it serves) and the
    quantize kernel with the cache options on."""
    variants = (
        ("exact_recent=32", 128, ta.KVCodec(128, 4, 4), dict(exact_recent=32)),
        ("exact_first=4 exact_recent=16", 64, ta.KVCodec(64, 4, 3), dict(exact_first=4, exact_recent=16)),
        ("bf16 scales", 128, ta.KVCodec(128, 4, 4, scale_dtype=torch.bfloat16), {}),
        ("exact_first=4 exact_recent=64 bf16 scales", 64, ta.KVCodec(64, 4, 4, scale_dtype=torch.bfloat16),
         dict(exact_first=4, exact_recent=64)),
        # 68 exact rows at D = 128: three exact CTAs per (sequence, KV head) (config.cuda_exact_parts).
        ("D=128 exact_first=4 exact_recent=64 bf16 scales", 128,
         ta.KVCodec(128, 4, 3, scale_dtype=torch.bfloat16), dict(exact_first=4, exact_recent=64)),
        ("static", 128, ta.KVCodec(128, 4, 4), dict(static=True)),
        ("D=80", 80, ta.KVCodec(80, 4, 4), {}),
        ("D=96 ring", 96, ta.KVCodec(96, 5, 3), dict(sliding_window=64)),
    )
    for name, d, codec, options in variants:
        capacity = None if "sliding_window" in options else 300
        cache = ta.QuantizedKVCache(codec, 2, 2, capacity=capacity, device="cuda", **options)
        for t, out in _ragged_steps(cache, d, store_steps=True):
            yield f"options {name} tokens={t}", out


def flash_cases():
    """(name, output) of the dense flash-attention kernels (prefill, tile classification, split-K decode)."""
    for d in (64, 128, 512, 80):
        q, k, v = _bf16(2, 4, 200, d), _bf16(2, 2, 230, d), _bf16(2, 2, 230, d)
        yield f"flash prefill D={d} causal", ta.flash_attention(q, k, v, causal=True, backend="triton")
    d = 128
    q, k, v = _bf16(2, 4, 150, d), _bf16(2, 2, 300, d), _bf16(2, 2, 300, d)
    keep = torch.rand(2, 1, 150, 300, device="cuda") > 0.3
    keep[:, :, :, 64:192] = False          # whole tiles the classification skips
    keep[0, :, 5] = False                  # a fully masked row
    yield "flash prefill bool mask", ta.flash_attention(q, k, v, mask=keep, backend="triton")
    yield "flash prefill window sinks softcap alibi", ta.flash_attention(
        q, k, v, causal=True, sliding_window=70, sinks=torch.randn(4, device="cuda"), softcap=20.0,
        alibi_slopes=torch.rand(4, device="cuda"), backend="triton")
    for d in (128, 512):
        for lq in (1, 4):
            q, k, v = _bf16(2, 16, lq, d), _bf16(2, 2, 1000, d), _bf16(2, 2, 1000, d)
            yield f"flash decode D={d} Lq={lq}", ta.flash_attention(
                q, k, v, causal=True, sliding_window=600, sinks=torch.randn(16, device="cuda"), backend="triton")


CASE_SETS = {"small": small_cases, "cuda": cuda_cases, "options": option_cases, "groups": group_cases,
             "flash": flash_cases}


def run(args) -> int:
    require_cuda()
    bad = 0
    for name in args.cases:
        for case, out in (passkey_cases(args.prompt) if name == "passkey" else CASE_SETS[name]()):
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(out).all())
            bad += not finite
            print(f"{case}: {'ok' if finite else 'NOT FINITE'}, output norm {float(out.float().norm()):.4g}",
                  flush=True)
    return 1 if bad else 0
