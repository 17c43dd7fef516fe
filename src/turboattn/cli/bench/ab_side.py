"""One side of `turboattn bench ab`, run as a script in its own process: times cached_attention of the turboattn that
sys.path finds first (the parent puts one tree's src/ there, and its own TORCH_EXTENSIONS_DIR in the environment).

It uses only the public API that every revision of the package has (KVCodec, QuantizedKVCache, cached_attention)
and plain torch, so it can time an older tree than its own.  Inputs come from a seeded generator, so both sides see
the same caches and queries; each call's output is saved for the parent to compare.  One JSON line per measurement
on stdout (other lines are the package's own messages).

  python ab_side.py --shapes 8,32,8,128,32768 --bits 4,4 --outputs side.pt
  python ab_side.py --shapes 8,32,8,128,32768 --bits 4,3 --scale-dtype bfloat16 --exact-first 4 --exact-recent 64
  python ab_side.py --build-only
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch


def graph_us(fn, replays: int = 10, repeats: int = 30) -> float:
    """Median µs per call of fn() captured `replays` times in one CUDA graph (launch overhead excluded)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / replays)
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    """Caches a timed graph cycles through: enough to span twice the L2 (at most 8), so calls read DRAM."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(8, -(-2 * l2 // max(nbytes, 1))))


def filled_cache(ta, codec, b: int, hkv: int, length: int, generator: torch.Generator, **options):
    cache = ta.QuantizedKVCache(codec, b, hkv, capacity=length, device="cuda", **options)
    for t0 in range(0, length, 8192):
        t = min(8192, length - t0)
        k = torch.randn(b, hkv, t, codec.head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        v = torch.randn(b, hkv, t, codec.head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        cache.append(k, v)
    return cache


def options_of(args) -> tuple[dict, dict]:
    """(KVCodec options, QuantizedKVCache options) of the command line: only those set, so that an older tree,
    whose API may lack one, still runs without it."""
    codec = {} if args.scale_dtype == "float32" else {"scale_dtype": getattr(torch, args.scale_dtype)}
    cache = {name: value for name, value in (("exact_first", args.exact_first), ("exact_recent", args.exact_recent))
             if value}
    return codec, cache


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="*", default=[], help="B,Hq,Hkv,D,L")
    parser.add_argument("--bits", nargs="*", default=[], help="K,V bits, e.g. 4,4")
    parser.add_argument("--outputs", help="file for the calls' outputs (torch.save)")
    parser.add_argument("--build-only", action="store_true", help="build (or load) the CUDA kernels, time nothing")
    # Cache options, passed only when set (a tree older than an option still times plain caches).
    parser.add_argument("--scale-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--exact-first", type=int, default=0)
    parser.add_argument("--exact-recent", type=int, default=0)
    args = parser.parse_args(argv)
    codec_options, cache_options = options_of(args)
    import turboattn as ta
    generator = torch.Generator(device="cuda")
    if args.build_only:   # a small call builds the extension on first use
        generator.manual_seed(0)
        cache = filled_cache(ta, ta.KVCodec(128, 4, 4), 1, 1, 64, generator)
        ta.cached_attention(torch.randn(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16), cache)
        torch.cuda.synchronize()
        print(json.dumps({"built": ta.__file__}), flush=True)
        return 0
    outputs = {}
    for shape in args.shapes:
        b, hq, hkv, d, length = (int(x) for x in shape.split(","))
        for bits in args.bits:
            k_bits, v_bits = (int(x) for x in bits.split(","))
            codec = ta.KVCodec(d, k_bits, v_bits, **codec_options)
            generator.manual_seed(0)
            caches = [filled_cache(ta, codec, b, hkv, length, generator, **cache_options)
                      for _ in range(copies_for(b * hkv * length * codec.bytes_per_token()))]
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=generator)
            key = f"{shape}/{bits}"
            outputs[key] = ta.cached_attention(q, caches[0]).float().cpu()
            rotation = itertools.cycle(caches)
            us = graph_us(lambda: ta.cached_attention(q, next(rotation)))
            print(json.dumps({"shape": shape, "bits": bits, "us": us}), flush=True)
            del caches
            torch.cuda.empty_cache()
    if args.outputs:
        torch.save(outputs, args.outputs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
