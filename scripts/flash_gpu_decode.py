"""Decode timing detail (device tool): eager vs CUDA-graph time per block config, D=512, 16 q / 2 KV heads."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from turboattn.cli.bench.common import time_us  # noqa: E402
from turboattn.cli.bench.prefill import graph_time_us, measure_decode  # noqa: E402
from turboattn.ops.flash.triton import flash_attention_triton  # noqa: E402

CONFIGS = {"n16w4s4": dict(BLOCK_N=16, num_warps=4, num_stages=4),
           "n32w4s3": dict(BLOCK_N=32, num_warps=4, num_stages=3),
           "n32w4s2": dict(BLOCK_N=32, num_warps=4, num_stages=2)}
for n in (4096, 32768):
    print("default", measure_decode(n), flush=True)
    q = torch.randn(1, 16, 1, 512, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, n, 512, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for name, cfg in CONFIGS.items():
        fn = lambda: flash_attention_triton(q, k, v, causal=True, config=cfg)  # noqa: E731
        print(f"L={n} {name}: eager {time_us(fn):.1f} us, graph {graph_time_us(fn):.1f} us", flush=True)
