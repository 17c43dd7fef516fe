"""Decode-step cost of the key transform on the GPU: cached_attention + append, with and without one.

The transform adds two small elementwise passes per step (q / gain, and (k - shift) * gain on
the new token); this measures them in CUDA-graph time at the decode benchmark's shapes.
"""

import torch

import turboattn as ta
from turboattn.cli.bench.common import time_us_graph
from turboattn.format.key_transform import fit_key_transform

SHAPES = [(8, 32768, 128), (1, 32768, 128), (32, 8192, 128), (8, 8192, 256)]   # B, L, D; 32 q / 8 KV heads
print("| B | L | D | no transform (us) | key transform (us) | ratio |")
print("|---|---|---|---|---|---|")
ORDER = (False, True, False, True)  # interleaved: drift between runs shows up as a difference between repeats
for b, length, d in SHAPES:
    hq, hkv = 32, 8
    times = []
    for fit in ORDER:
        torch.manual_seed(0)
        cache = ta.QuantizedKVCache(ta.KVCodec(d, 4, 4), b, hkv, capacity=length + 64, device="cuda")
        k = torch.randn(b, hkv, 512, d, device="cuda", dtype=torch.bfloat16)
        if fit:
            cache.set_key_transform(*fit_key_transform(torch.randn(b, hq, 512, d, device="cuda",
                                                                   dtype=torch.bfloat16), k))
        for _ in range(length // 512):
            cache.append(k, k)
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16)
        splits = None

        def step():
            ta.cached_attention(q, cache, kn, kn, num_splits=splits)
            cache.append(kn, kn)
            cache.seen -= 1          # keep the length fixed across replays
            cache._seen_host = [s - 1 for s in cache._seen_host]
        from turboattn.kernels.cached import choose_num_splits, decode_config
        splits = choose_num_splits(q.device, b * hkv, length, decode_config(d)["BLOCK_N"])
        times.append(time_us_graph(step))
        del cache
    plain, fitted = min(times[0::2]), min(times[1::2])
    print(f"| {b} | {length} | {d} | {plain:.1f} | {fitted:.1f} | {fitted / plain:.3f} |  (all runs: "
          + ", ".join(f"{t:.1f}" for t in times) + ")")
