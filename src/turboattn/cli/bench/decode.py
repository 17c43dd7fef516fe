"""`turboattn bench decode`: one decode step over the compressed cache vs torch SDPA bf16.

Both sides are timed as CUDA-graph replays (what a serving engine runs), so
the numbers are GPU time, not Python launch overhead; eager time is recorded
too.  A graph cycles through copies of each side's inputs that together span
twice the GPU's L2 (l2_copies): a model's decode step streams every layer's
cache in turn, so one small cache replayed back to back would read from L2
what a real step reads from DRAM.  Bytes counted are those each method must
read: ours reads packed codes and float32 scales for K and V (plus q/out,
negligible); SDPA reads bf16 K and V.  Our own dense decode (ta.flash_attention
over the same bf16 K and V) is timed beside SDPA: at head_dim 512, where torch
SDPA has no fused kernel, it is the fair bf16 baseline.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ... import KVCodec, QuantizedKVCache, cached_attention, flash_attention
from ..args import presets
from .args import add_cache_options, add_out
from .common import (copy_bandwidth_tbs, environment, plot_lines, print_table, require_cuda, time_us,
                     time_us_graph, write_results)

# B, Hq, Hkv, D, L — the shapes of the issue.
SHAPES = [(1, 32, 8, 128, 32768), (8, 32, 8, 128, 32768), (32, 32, 8, 128, 8192),
          (8, 16, 8, 256, 8192), (8, 9, 3, 64, 16384), (1, 16, 2, 512, 32768)]
BITS = "k4v4,k8v8"
SWEEP = (1024, 2048, 4096, 8192, 16384, 32768)  # context lengths for the plot, at B=8 Hq=32 Hkv=8 D=128


def add_arguments(parser) -> None:
    add_out(parser)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and context lengths")
    parser.add_argument("--bits", type=presets, default=presets(BITS),
                        help="bit pairs to measure at every shape; the context sweep takes "
                             "the first two")
    add_cache_options(parser)
    parser.add_argument("--backend", choices=["auto", "triton"], default="auto",
                        help="the cached-attention implementation (auto: the CUDA kernel where it serves)")


def fill_cache(codec, b, hkv, length, device, capacity=None, **options) -> QuantizedKVCache:
    """A cache holding `length` random bf16 tokens per sequence (capacity: default `length`); options go to
    QuantizedKVCache (exact_first, exact_recent)."""
    cache = QuantizedKVCache(codec, b, hkv, capacity=capacity or length, device=device, **options)
    chunk = 8192
    for t0 in range(0, length, chunk):
        t = min(chunk, length - t0)
        k = torch.randn(b, hkv, t, codec.head_dim, device=device, dtype=torch.bfloat16)
        cache.append(k, torch.randn_like(k))
    return cache


def l2_copies(nbytes: int) -> int:
    """Copies of an nbytes working set that a timed graph cycles through: enough to span twice the L2 (at most
    8), so that every call reads its inputs from DRAM."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(8, -(-2 * l2 // max(nbytes, 1))))


def dense_decode_us(q: torch.Tensor, hkv: int, length: int, with_ours: bool = True) -> tuple[float, float | None, int]:
    """(CUDA-graph times of torch SDPA and of our dense decode (ta.flash_attention; None unless with_ours) for the
    decode query q over `length` random bf16 keys, bytes of K and V)."""
    b, _, _, d = q.shape
    shape = (b, hkv, length, d)
    nbytes = 2 * b * hkv * length * d * 2
    kv = [(torch.randn(shape, device=q.device, dtype=torch.bfloat16),
           torch.randn(shape, device=q.device, dtype=torch.bfloat16)) for _ in range(l2_copies(nbytes))]
    pairs = itertools.cycle(kv)

    def sdpa():
        k, v = next(pairs)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def ours():
        k, v = next(pairs)
        return flash_attention(q, k, v, causal=True)
    return time_us_graph(sdpa), time_us_graph(ours) if with_ours else None, nbytes


def measure(shape, bits, copy_tbs, device, exact_first=0, exact_recent=0, scale_dtype=torch.float32,
            backend="auto") -> dict:
    b, hq, hkv, d, length = shape
    codec = KVCodec(d, *bits, scale_dtype=scale_dtype)
    # Bytes a step reads: codes and scales of every token, plus the exact rows in bf16.
    ours_bytes = b * hkv * (length * codec.bytes_per_token() + (exact_first + exact_recent) * 2 * d * 2)
    options = dict(exact_first=exact_first, exact_recent=exact_recent)
    caches = [fill_cache(codec, b, hkv, length, device, **options) for _ in range(l2_copies(ours_bytes))]
    q = torch.randn(b, hq, 1, d, device=device, dtype=torch.bfloat16)
    rotation = itertools.cycle(caches)
    ours_us = time_us_graph(lambda: cached_attention(q, next(rotation), backend=backend))
    ours_eager_us = time_us(lambda: cached_attention(q, caches[0], backend=backend))  # do_bench flushes L2
    sdpa_us, dense_us, sdpa_bytes = dense_decode_us(q, hkv, length)
    del caches
    torch.cuda.empty_cache()
    ours_tbs = ours_bytes / ours_us / 1e6
    return {
        "B": b, "Hq": hq, "Hkv": hkv, "D": d, "L": length, "k_bits": bits[0], "v_bits": bits[1],
        "exact_first": exact_first, "exact_recent": exact_recent, "scale_dtype": str(scale_dtype),
        "backend": backend,
        "ours_us": ours_us, "ours_eager_us": ours_eager_us, "sdpa_us": sdpa_us, "speedup": sdpa_us / ours_us,
        "dense_us": dense_us, "speedup_vs_dense": dense_us / ours_us,
        "ours_tbs": ours_tbs, "ours_frac_copy": ours_tbs / copy_tbs,
        "sdpa_tbs": sdpa_bytes / sdpa_us / 1e6, "sdpa_frac_copy": sdpa_bytes / sdpa_us / 1e6 / copy_tbs,
    }


def run(args) -> int:
    device = require_cuda()
    copy_tbs = copy_bandwidth_tbs()
    results = []
    shapes = SHAPES[:2] if args.quick else SHAPES
    options = dict(exact_first=args.exact_first, exact_recent=args.exact_recent,
                   scale_dtype=getattr(torch, args.scale_dtype), backend=args.backend)
    for bits in args.bits:
        for shape in shapes:
            results.append(measure(shape, bits, copy_tbs, device, **options))
    sweep = []
    for bits in args.bits[:2]:
        for length in (SWEEP[::2] if args.quick else SWEEP):
            sweep.append(measure((8, 32, 8, 128, length), bits, copy_tbs, device, **options))
    env = environment()
    cols = ["B", "Hq", "Hkv", "D", "L", "bits", "ours µs", "SDPA µs", "speedup", "dense µs", "vs dense", "ours TB/s",
            "of copy", "SDPA of copy"]
    rows = [[r["B"], r["Hq"], r["Hkv"], r["D"], r["L"], f"k{r['k_bits']}v{r['v_bits']}", r["ours_us"], r["sdpa_us"],
             f"{r['speedup']:.2f}x", r["dense_us"], f"{r['speedup_vs_dense']:.2f}x", r["ours_tbs"],
             f"{100 * r['ours_frac_copy']:.0f}%", f"{100 * r['sdpa_frac_copy']:.0f}%"] for r in results + sweep]
    print_table(f"decode, {env['gpu']}, copy bandwidth {copy_tbs:.2f} TB/s (read+write)", cols, rows)
    write_results(args.out, "decode", {"env": env, "copy_tbs": copy_tbs, "shapes": results, "sweep": sweep})
    series = {}
    for bits in args.bits[:2]:
        pts = [r for r in sweep if (r["k_bits"], r["v_bits"]) == bits]
        series[f"k{bits[0]}v{bits[1]}"] = ([r["L"] for r in pts], [r["speedup"] for r in pts])
    plot_lines(args.out, "decode", series, "context length (tokens)", "speedup over SDPA bf16",
               f"decode B=8 Hq=32 Hkv=8 D=128, {env['gpu']}", hline=1.0)
    return 0
