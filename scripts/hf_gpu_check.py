"""GPU check of the transformers integration: the Triton path inside real model forward passes.

Tiny random Llama / Gemma-3 (ring caches) / Gemma-2 (softcap) models from tests/test_hf.py, moved
to CUDA: logits with TurboQuantCache (Triton kernels) vs the fake-quantized reference cache (same
codes and key transform, dequantized, eager attention). Prints relative logit error and argmax agreement per case.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_hf import (fake_quant_cache, random_ids, teacher_forced_logits, tiny_gemma2, tiny_gemma3,  # noqa: E402
                     tiny_llama)

from turboattn.hf import TurboQuantCache  # noqa: E402

worst = 0.0
with torch.no_grad():
    for factory in (tiny_llama, tiny_gemma3, tiny_gemma2):
        for bits in ((4, 4), (8, 8)):
            for strict in (False, True):
                model = factory().cuda()
                ref_model = factory(attn="eager").cuda()
                ids = random_ids(80, batch=2).cuda()
                cache = TurboQuantCache(model.config, k_bits=bits[0], v_bits=bits[1], quantize_current=strict)
                got = teacher_forced_logits(model, ids, cache, prefill=40)  # 40 tokens: the key transform is fitted
                want = teacher_forced_logits(ref_model, ids, fake_quant_cache(ref_model, bits, strict, fitted=cache),
                                             prefill=40)
                rel = float((got - want).norm() / want.norm())
                agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
                worst = max(worst, rel)
                print(f"{factory.__name__:12s} k{bits[0]}v{bits[1]} {'strict' if strict else 'decode'}: "
                      f"logit rel err {rel:.2e}, argmax agreement {agree:.3f}")
    model = tiny_llama().cuda()
    out = model.generate(random_ids(16).cuda(), past_key_values=TurboQuantCache(model.config), max_new_tokens=16,
                         do_sample=False)
    print("generate ok:", tuple(out.shape))
print(f"worst relative logit error {worst:.2e}")
