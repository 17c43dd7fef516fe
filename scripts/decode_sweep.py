"""Times decode-kernel variants at the B=8 / B=1, 32K-token, D=128 shapes, as CUDA-graph replays.

Variants: lookup (register LUT vs table gather, 4-bit), tile config
"BLOCK_N,num_warps,num_stages[,maxnreg]", and programs per SM (split count).
Usage on a GPU: python scripts/decode_sweep.py   (prints one line per variant)
"""

import os

import torch

import turboattn as ta
from turboattn.cli.bench.common import copy_bandwidth_tbs, time_us_graph
from turboattn.cli.bench.decode import _fill_cache

VARIANTS = [  # (lookup, config, programs per SM)
    ("lut", "64,4,3", 2), ("lut", "32,4,3", 2), ("lut", "32,4,3", 4), ("lut", "32,4,3", 8),
    ("lut", "64,4,3,128", 4), ("lut", "32,4,3,128", 4), ("lut", "32,8,3", 2), ("lut", "32,4,2", 4),
    ("gather", "32,4,3", 2), ("gather", "32,4,3", 4),
]


def main():
    copy = copy_bandwidth_tbs()
    print(f"copy {copy:.2f} TB/s")
    for b, hq, hkv, d, length in [(8, 32, 8, 128, 32768), (1, 32, 8, 128, 32768)]:
        for bits in [(4, 4), (8, 8)]:
            codec = ta.KVCodec(d, *bits)
            cache = _fill_cache(codec, b, hkv, length, "cuda")
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
            nbytes = b * hkv * length * codec.bytes_per_token()
            for lookup, config, per_sm in VARIANTS:
                if bits != (4, 4) and lookup == "lut":
                    continue
                os.environ.update(TURBOATTN_LOOKUP=lookup, TURBOATTN_DECODE_CONFIG=config,
                                  TURBOATTN_PROGRAMS_PER_SM=str(per_sm))
                try:
                    us = time_us_graph(lambda: ta.cached_attention(q, cache))
                    print(f"B={b} k{bits[0]}v{bits[1]} {lookup:6s} cfg={config:10s} per_sm={per_sm} {us:8.1f} us "
                          f"{100 * nbytes / us / 1e6 / copy:.0f}% of copy")
                except Exception as e:  # a variant may not fit or not compile
                    print(f"B={b} k{bits[0]}v{bits[1]} {lookup} cfg={config} per_sm={per_sm}: {type(e).__name__} {e}"[:200])
            for key in ("TURBOATTN_LOOKUP", "TURBOATTN_DECODE_CONFIG", "TURBOATTN_PROGRAMS_PER_SM"):
                os.environ.pop(key)
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
