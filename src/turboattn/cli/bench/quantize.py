"""`turboattn bench quantize`: fused quantize-and-append, a prefill vs copy bandwidth and a decode step's append.

Prefill rows time one `cache.append(k, v)` of a whole prompt (bf16 in; bytes = K and V read + codes and scales
written).  Decode rows time an append of a few tokens per sequence as a decode step does it (also into a cache
with the quality presets' exact rows and bfloat16 scales, and as the default caches run them, with a key transform):
"graph" is GPU time (CUDA-graph replays of 10 appends, launch overhead excluded, the graph's one reset of the lengths
timed alone and taken out), "eager" the wall time per call of back-to-back eager appends (host time where that is
the larger).  Each row runs on every implementation of `--backends`.  The caches
are static, so the lengths can be reset on the device between calls (a reset of the whole cache would be timed too).
`--cases key-groups` times Gemma-3-like shapes (head_dim 256, one KV head) with the preset's k5v3 and with keys in
the channel groups the CUDA kernels read, side by side.
"""

from __future__ import annotations

import time

import torch

from ... import KVCodec, QuantizedKVCache
from ..args import choices
from ..eval.methods import key_options
from .args import add_out
from .common import copy_bandwidth_tbs, environment, print_table, require_cuda, time_us, time_us_graph, write_results

# B, Hkv, D, tokens, (k_bits, v_bits)
PREFILL_CASES = [(1, 8, 128, 32768, (4, 4)), (1, 8, 128, 32768, (8, 8)), (1, 8, 128, 32768, (5, 3)),
                 (1, 8, 128, 32768, (4, 3)), (1, 8, 256, 16384, (4, 4)), (1, 2, 512, 32768, (4, 4)),
                 (1, 3, 64, 32768, (4, 4))]
# ... and the exact rows (first tokens, recent window) the quality presets keep, with bfloat16 scales (QUALITY.md);
# the last three as the default caches are after a prefill, whose key fit ("center") sets a key transform.
DECODE_CASES = [(1, 8, 128, 1, (4, 4), (0, 0)), (8, 8, 128, 1, (4, 4), (0, 0)), (8, 8, 128, 16, (4, 4), (0, 0)),
                (32, 8, 128, 1, (4, 4), (0, 0)), (8, 3, 64, 1, (4, 3), (0, 0)), (8, 8, 256, 1, (5, 3), (0, 0)),
                (8, 8, 128, 1, (4, 3), (4, 64)), (8, 3, 64, 1, (4, 3), (4, 64)), (8, 1, 256, 1, (5, 3), (4, 8)),
                (8, 8, 128, 1, (4, 3), (4, 64), "transform"), (8, 3, 64, 1, (4, 3), (4, 64), "transform"),
                (8, 1, 256, 1, (5, 3), (4, 8), "transform")]
# Keys in channel groups against the head_dim-256 preset's k5v3 (a key transform with a channel order: the groups'
# caches always fit one), prefill and decode steps.
KEY_GROUP_CODES = (5, ((112, 6), (144, 4)), ((96, 6), (160, 4)))
KEY_GROUP_PREFILL_CASES = [(1, 1, 256, t, (code, 3)) for t in (2048, 32768) for code in KEY_GROUP_CODES]
KEY_GROUP_DECODE_CASES = [(b, hkv, 256, 1, (code, 3), (4, 8), "transform")
                          for b, hkv in ((1, 1), (8, 1), (32, 1), (8, 8)) for code in KEY_GROUP_CODES]
CASES = ("all", "key-groups")
BACKENDS = ("auto", "triton")   # auto: the CUDA kernel where it serves (head_dim 64 / 128 / 256 / 512)
DECODE_CAPACITY = 4096


def add_arguments(parser) -> None:
    add_out(parser)
    parser.add_argument("--quick", action="store_true", help="the first two cases of each kind only")
    parser.add_argument("--cases", choices=CASES, default="all",
                        help="all: the plain codes' shapes; key-groups: k5v3 against keys in channel groups")
    parser.add_argument("--backends", type=choices(*BACKENDS), default=",".join(BACKENDS),
                        help="paths to time (auto: the CUDA kernel on these shapes)")


def _inputs(b, hkv, d, t, device):
    k = torch.randn(b, hkv, t, d, device=device, dtype=torch.bfloat16)
    return k, torch.randn_like(k)


def _codec(d: int, bits: tuple, **options) -> KVCodec:
    """bits: (k_bits or key groups, v_bits)."""
    return KVCodec(d, v_bits=bits[1], **key_options(bits[0]), **options)


def _key_transform(cache: QuantizedKVCache, device) -> None:
    """A fitted cache's key transform: a shift, gains, and with key groups a channel order."""
    b, hkv, d = cache.batch_size, cache.num_kv_heads, cache.codec.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    shift = 0.1 * torch.randn(b, hkv, d, device=device, generator=gen)
    order = None
    if cache.codec.grouped_keys:
        order = torch.stack([torch.randperm(d, device=device, generator=gen) for _ in range(b * hkv)])
        order = order.reshape(b, hkv, d).to(torch.int16)
    cache.set_key_transform(shift, 0.5 + torch.rand(b, hkv, d, device=device, generator=gen), order)


def _prefill_row(case, backend, device, copy_tbs) -> dict:
    b, hkv, d, t, bits = case
    codec = _codec(d, bits)
    cache = QuantizedKVCache(codec, b, hkv, capacity=t, device=device, static=True)
    if codec.grouped_keys:
        _key_transform(cache, device)
    k, v = _inputs(b, hkv, d, t, device)

    def step():
        cache.seen.zero_()
        cache.append(k, v, backend=backend)
    us = time_us(step)
    nbytes = 2 * k.numel() * k.element_size() + b * hkv * t * codec.bytes_per_token()
    tbs = nbytes / us / 1e6
    return {"kind": "prefill", "backend": backend, "B": b, "Hkv": hkv, "D": d, "T": t, "code": codec.name,
            "us": us, "tbs": tbs, "frac_copy": tbs / copy_tbs}


def _decode_row(case, backend, device) -> dict:
    b, hkv, d, t, bits, (first, recent), *options = case
    exact = first + recent > 0
    transform = "transform" in options
    codec = _codec(d, bits, scale_dtype=torch.bfloat16 if exact else torch.float32)
    cache = QuantizedKVCache(codec, b, hkv, capacity=DECODE_CAPACITY, device=device, static=True, exact_first=first,
                             exact_recent=recent, exact_dtype=torch.bfloat16)
    if transform:
        _key_transform(cache, device)
    k, v = _inputs(b, hkv, d, t, device)
    calls = 10

    def steps():
        cache.seen.zero_()
        for _ in range(calls):
            cache.append(k, v, backend=backend)
    # The graph's lengths reset (one small launch per `calls` appends) is timed alone and taken out.
    graph_us = (time_us_graph(steps, replays=1) - time_us_graph(cache.seen.zero_, replays=calls)) / calls
    steps()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        steps()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) / (20 * calls) * 1e6
    return {"kind": "decode", "backend": backend, "B": b, "Hkv": hkv, "D": d, "T": t, "code": codec.name,
            "exact_first": first, "exact_recent": recent, "key_transform": transform,
            "graph_us": graph_us, "eager_us": eager_us}


def run(args) -> int:
    device = require_cuda()
    copy_tbs = copy_bandwidth_tbs()
    backends = args.backends
    prefill, decode = ((PREFILL_CASES, DECODE_CASES) if args.cases == "all"
                       else (KEY_GROUP_PREFILL_CASES, KEY_GROUP_DECODE_CASES))
    if args.quick:
        prefill, decode = prefill[:2], decode[:2]
    results = [_prefill_row(case, name, device, copy_tbs) for case in prefill for name in backends]
    results += [_decode_row(case, name, device) for case in decode for name in backends]
    env = environment()
    print_table(f"quantize-and-append of a prefill, {env['gpu']}, copy {copy_tbs:.2f} TB/s",
                ["backend", "B", "Hkv", "D", "T", "bits", "µs", "TB/s", "of copy"],
                [[r["backend"], r["B"], r["Hkv"], r["D"], r["T"], r["code"], r["us"], r["tbs"],
                  f"{100 * r['frac_copy']:.0f}%"] for r in results if r["kind"] == "prefill"])
    print_table(f"quantize-and-append of a decode step, {env['gpu']}",
                ["backend", "B", "Hkv", "D", "T", "bits", "exact rows", "graph µs", "eager µs"],
                [[r["backend"], r["B"], r["Hkv"], r["D"], r["T"], r["code"],
                  (f"first {r['exact_first']} + recent {r['exact_recent']}" if r["exact_first"] + r["exact_recent"]
                   else "-") + (", key transform" if r["key_transform"] else ""), r["graph_us"], r["eager_us"]]
                 for r in results if r["kind"] == "decode"])
    write_results(args.out, "quantize", {"env": env, "copy_tbs": copy_tbs, "results": results})
    return 0
