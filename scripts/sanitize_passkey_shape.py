"""Passkey-shaped decode under compute-sanitizer: one long prompt, a multi-token question, decode steps.

SmolLM2's shapes (D = 64, 3 KV heads, 9 query heads), a growing cache, with and without a fitted key
transform, at every bit pair the quality runs use.
"""

import sys

import torch

import turboattn as ta
from turboattn.format.key_transform import fit_key_transform

prompt = int(sys.argv[1]) if len(sys.argv) > 1 else 1500
for bits in ((4, 3), (4, 4), (8, 8), (5, 3)):
    for fit in (False, True):
        torch.manual_seed(0)
        b, hkv, g, d = 1, 3, 3, 64
        cache = ta.QuantizedKVCache(ta.KVCodec(d, *bits), b, hkv, capacity=prompt, device="cuda")
        k = torch.randn(b, hkv, prompt, d, device="cuda", dtype=torch.bfloat16) + 2
        v = torch.randn_like(k)
        q = torch.randn(b, hkv * g, prompt, d, device="cuda", dtype=torch.bfloat16)
        if fit:
            cache.set_key_transform(*fit_key_transform(q, k))
        cache.append(k, v)
        for t in (12, 1, 1, 1):
            qn = torch.randn(b, hkv * g, t, d, device="cuda", dtype=torch.bfloat16)
            kn = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
            out = ta.cached_attention(qn, cache, kn, torch.randn_like(kn))
            cache.reserve(cache.capacity + t) if cache.max_seen + t > cache.capacity else None
            cache.append(kn, torch.randn_like(kn))
        torch.cuda.synchronize()
        print(bits, "fit" if fit else "plain", "ok", float(out.float().norm()))
