"""Times decode-kernel variants (lookup method x tile config) at one shape, as CUDA-graph replays.

Usage on a GPU: python scripts/decode_sweep.py   (prints a table; no files)
"""

import os

import torch

import turboattn as ta
from turboattn.bench.common import copy_bandwidth_tbs, time_us_graph
from turboattn.bench.decode import _fill_cache

CONFIGS = ["64,4,3", "64,8,3", "128,4,3", "128,8,3", "32,4,3", "64,4,2", "128,8,2"]

copy = copy_bandwidth_tbs()
print(f"copy {copy:.2f} TB/s")
for b, hq, hkv, d, length in [(8, 32, 8, 128, 32768), (1, 32, 8, 128, 32768)]:
    for bits in [(4, 4), (8, 8)]:
        codec = ta.KVCodec(d, *bits)
        cache = _fill_cache(codec, b, hkv, length, "cuda")
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        nbytes = b * hkv * length * codec.bytes_per_token()
        for lookup in (["lut", "gather"] if bits == (4, 4) else ["gather"]):
            os.environ["TURBOATTN_LOOKUP"] = lookup
            for config in CONFIGS:
                os.environ["TURBOATTN_DECODE_CONFIG"] = config
                try:
                    us = time_us_graph(lambda: ta.cached_attention(q, cache))
                    print(f"B={b} L={length} k{bits[0]}v{bits[1]} {lookup:6s} cfg={config:8s} {us:8.1f} us "
                          f"{nbytes / us / 1e6:.2f} TB/s {100 * nbytes / us / 1e6 / copy:.0f}% of copy")
                except Exception as e:  # a config may not fit in shared memory
                    print(f"B={b} k{bits[0]}v{bits[1]} {lookup} cfg={config}: {type(e).__name__}")
        os.environ.pop("TURBOATTN_LOOKUP")
        os.environ.pop("TURBOATTN_DECODE_CONFIG")
        del cache
        torch.cuda.empty_cache()
