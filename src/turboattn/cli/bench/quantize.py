"""`turboattn bench quantize`: fused quantize-and-append of a prefill, vs copy bandwidth."""

from __future__ import annotations

import torch

from ... import KVCodec, QuantizedKVCache
from .args import add_out
from .common import copy_bandwidth_tbs, environment, print_table, require_cuda, time_us, write_results

CASES = [(1, 8, 128, 32768, (4, 4)), (1, 8, 128, 32768, (8, 8)), (1, 8, 128, 32768, (5, 3)),
         (1, 8, 256, 16384, (4, 4)), (1, 2, 512, 32768, (4, 4))]


def add_arguments(parser) -> None:
    add_out(parser)
    parser.add_argument("--quick", action="store_true", help="the first two cases only")


def run(args) -> int:
    device = require_cuda()
    copy_tbs = copy_bandwidth_tbs()
    results = []
    for b, hkv, d, t, bits in (CASES[:2] if args.quick else CASES):
        codec = KVCodec(d, *bits)
        cache = QuantizedKVCache(codec, b, hkv, capacity=t, device=device)
        k = torch.randn(b, hkv, t, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)

        def step():
            cache.reset()
            cache.append(k, v)
        us = time_us(step)
        nbytes = 2 * k.numel() * k.element_size() + b * hkv * t * codec.bytes_per_token()
        tbs = nbytes / us / 1e6
        results.append({"B": b, "Hkv": hkv, "D": d, "T": t, "k_bits": bits[0], "v_bits": bits[1],
                        "us": us, "tbs": tbs, "frac_copy": tbs / copy_tbs})
    env = environment()
    print_table(f"quantize-and-append, {env['gpu']}, copy {copy_tbs:.2f} TB/s",
                ["B", "Hkv", "D", "T", "bits", "µs", "TB/s", "of copy"],
                [[r["B"], r["Hkv"], r["D"], r["T"], f"k{r['k_bits']}v{r['v_bits']}", r["us"], r["tbs"],
                  f"{100 * r['frac_copy']:.0f}%"] for r in results])
    write_results(args.out, "quantize", {"env": env, "copy_tbs": copy_tbs, "results": results})
    return 0
