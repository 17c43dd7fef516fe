"""A small decode + append case for compute-sanitizer (memcheck) runs on the GPU."""

import torch

import turboattn as ta

for d, bits, window in ((128, (4, 4), None), (512, (8, 3), 100), (64, (5, 6), None)):
    codec = ta.KVCodec(d, *bits)
    cache = ta.QuantizedKVCache(codec, 2, 2, capacity=None if window else 300, sliding_window=window, device="cuda")
    k = torch.randn(2, 2, 250, d, device="cuda", dtype=torch.bfloat16)
    cache.append(k, torch.randn_like(k), new_lengths=[250, 117])
    q = torch.randn(2, 8, 3, d, device="cuda", dtype=torch.bfloat16)
    kf = torch.randn(2, 2, 3, d, device="cuda", dtype=torch.bfloat16)
    out = ta.cached_attention(q, cache, kf, torch.randn_like(kf), sinks=torch.randn(8, device="cuda"))
    torch.cuda.synchronize()
    print(d, bits, window, "ok", float(out.float().norm()))
