"""Decode time at the issue's shapes for split heuristics / tile configs given as env settings."""

import os

import torch

from turboattn.cli.bench.common import copy_bandwidth_tbs
from turboattn.cli.bench.decode import SHAPES, measure

copy = copy_bandwidth_tbs()
for setting in ("8,64,4,3", "2,64,4,3", "8,32,4,3"):
    per_sm, config = setting.split(",", 1)
    os.environ.update(TURBOATTN_PROGRAMS_PER_SM=per_sm)
    for bits in ((4, 4), (8, 8)):
        for shape in SHAPES:
            if shape[3] == 512:  # D = 512 keeps its own tile (the others overflow shared memory)
                os.environ.pop("TURBOATTN_DECODE_CONFIG", None)
            else:
                os.environ["TURBOATTN_DECODE_CONFIG"] = config
            r = measure(shape, bits, copy, "cuda")
            print(f"per_sm={per_sm} cfg={config} {shape} k{bits[0]}v{bits[1]}: {r['ours_us']:.1f} us "
                  f"(SDPA {r['sdpa_us']:.1f}) {r['speedup']:.2f}x {100 * r['ours_frac_copy']:.0f}% of copy")
    torch.cuda.empty_cache()
