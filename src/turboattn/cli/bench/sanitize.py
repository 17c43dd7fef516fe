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
"""

from __future__ import annotations

import torch

import turboattn as ta

from ...format.key_transform import fit_key_transform
from .args import choices, positive_int
from .common import require_cuda

CASES = ("small", "passkey")


def add_arguments(parser) -> None:
    parser.add_argument("--cases", type=choices(*CASES), default=list(CASES),
                        help="comma list of case sets: small, passkey (default both)")
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
        k = _bf16(2, 2, 250, d)
        cache.append(k, torch.randn_like(k), new_lengths=[250, 117])
        for t in (3, 1):
            kf = _bf16(2, 2, t, d)
            out = ta.cached_attention(_bf16(2, 8, t, d), cache, kf, torch.randn_like(kf),
                                      sinks=torch.randn(8, device="cuda"))
            yield f"D={d} k{bits[0]}v{bits[1]} window={window} tokens={t}", out


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


def run(args) -> int:
    require_cuda()
    bad = 0
    for name in args.cases:
        for case, out in (small_cases() if name == "small" else passkey_cases(args.prompt)):
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(out).all())
            bad += not finite
            print(f"{case}: {'ok' if finite else 'NOT FINITE'}, output norm {float(out.float().norm()):.4g}",
                  flush=True)
    return 1 if bad else 0
