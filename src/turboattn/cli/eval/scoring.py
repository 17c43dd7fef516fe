"""Teacher-forced scoring of one method against the reference: metrics (A), (B), (C) of `turboattn eval`."""

from __future__ import annotations

import math
import time

import torch

from ..corpus import corpus_text
from .methods import Method, reference_method, turbo_method


class AttnRecorder:
    """Forward hooks that keep each layer's attention output for the positions being scored."""

    def __init__(self, model):
        self.modules = [m for n, m in model.named_modules() if n.endswith("self_attn")]
        self.active = False
        self.outputs: list[list[torch.Tensor]] = [[] for _ in self.modules]
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]

    def _hook(self, i):
        def hook(module, args, output):
            if self.active:
                self.outputs[i].append(output[0][0].detach().float())
        return hook

    def take(self) -> list[torch.Tensor]:
        out = [torch.cat(o) for o in self.outputs]
        self.outputs = [[] for _ in self.modules]
        return out

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def score_segment(model, tokens: torch.Tensor, prefill: int, method: Method, recorder: AttnRecorder):
    """Teacher-forced decode over tokens[prefill:]: NLL [S], argmax [S], attention outputs per layer."""
    cache = method.make_cache(model)
    ids = tokens[None].to(model.device)
    # Only decode positions are scored: skip the prefill's logits (Gemma's vocabulary is 262k wide).
    model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True, logits_to_keep=1)
    nll, top = [], []
    recorder.active = True
    end = ids.shape[1] - 1  # the last token is only a target
    for s in range(prefill, end, method.step):
        e = min(s + method.step, end)
        logits = model(input_ids=ids[:, s:e], past_key_values=cache, use_cache=True).logits[0].float()
        nll.append(torch.nn.functional.cross_entropy(logits, ids[0, s + 1:e + 1], reduction="none"))
        top.append(logits.argmax(-1))
    recorder.active = False
    return torch.cat(nll), torch.cat(top), recorder.take(), cache


def ppl_change(d: torch.Tensor) -> tuple[float, list[float]]:
    """The perplexity change in percent that per-token NLL differences d (nats) make, and its 95% interval (two
    standard errors of the mean difference): paired, since both sides scored the same tokens."""
    mean, se = d.mean().item(), d.std().item() / math.sqrt(d.numel())
    return 100 * (math.exp(mean) - 1), [100 * (math.exp(mean - 2 * se) - 1), 100 * (math.exp(mean + 2 * se) - 1)]


def compare(ref: dict, got: dict) -> dict:
    """Metrics (A), (B), (C) of one method against the reference, over all segments."""
    d = got["nll"] - ref["nll"]
    n = d.numel()
    change, interval = ppl_change(d)
    cos = torch.cat([torch.nn.functional.cosine_similarity(a, b, dim=-1)
                     for a, b in zip(ref["attn"], got["attn"])])
    return {
        "ppl": math.exp(got["nll"].mean().item()),
        "ppl_change_pct": change,
        "ppl_change_ci95_pct": interval,
        "argmax_disagree_pct": 100 * (got["top"] != ref["top"]).float().mean().item(),
        "attn_cos_mean": cos.mean().item(),
        "attn_cos_p1": torch.quantile(cos, 0.01).item(),
        "scored_tokens": n,
    }


def compare_paired(base_name: str, base: dict, got: dict) -> dict:
    """`got`'s perplexity against another method's (`base`, run on the same segments), token by token.  Two methods'
    intervals against the reference can overlap while the paired one does not: most of each method's noise is the
    tokens', which the pairing cancels."""
    change, interval = ppl_change(got["nll"] - base["nll"])
    return {"paired_against": base_name, "ppl_vs_paired_pct": change, "ppl_vs_paired_ci95_pct": interval}


def eval_tokens(tokenizer, segments: int, length: int) -> list[torch.Tensor]:
    """`segments` disjoint windows of `length` tokens, spread over the corpus."""
    text = corpus_text()
    ids = tokenizer(text[: len(text) // 2], return_tensors="pt", add_special_tokens=False).input_ids[0]
    if segments * length > ids.numel():
        raise ValueError(f"{segments} windows of {length} tokens do not fit in the corpus' {ids.numel()} tokens")
    stride = (ids.numel() - length) // max(segments, 1)
    out = []
    for i in range(segments):
        seg = ids[i * stride: i * stride + length]
        if tokenizer.bos_token_id is not None and "gemma" in type(tokenizer).__name__.lower():
            seg = torch.cat([torch.tensor([tokenizer.bos_token_id]), seg[:-1]])
        out.append(seg)
    return out


def run_method(model, segments, prefill, method, recorder) -> dict:
    nll, top, attn = [], [], None
    t0 = time.time()
    for seg in segments:
        n, t, a, cache = score_segment(model, seg, prefill, method, recorder)
        nll.append(n)
        top.append(t)
        attn = a if attn is None else [torch.cat([x, y]) for x, y in zip(attn, a)]
    nbytes = cache.nbytes_used() if hasattr(cache, "nbytes_used") else None
    # Bits per element at the measured length (the last segment's), exact windows and first tokens included.
    bits = cache.bits_per_element() if hasattr(cache, "bits_per_element") else None
    return {"nll": torch.cat(nll), "top": torch.cat(top), "attn": attn, "seconds": time.time() - t0,
            "cache_bytes": nbytes, "bits_per_element": bits}


def quick_check(model, tokenizer, preset: str = "k4v4", rule: str = "corrected", mode: str = "decode",
                segments: int = 1, prefill: int = 128, scored: int = 128) -> dict:
    """Metrics of one preset against the reference on a small slice of the corpus (CI, demo)."""
    segs = eval_tokens(tokenizer, segments, prefill + scored + 1)
    recorder = AttnRecorder(model)
    try:
        ref = run_method(model, segs, prefill, reference_method(), recorder)
        got = run_method(model, segs, prefill, turbo_method(preset, rule, mode), recorder)
    finally:
        recorder.close()
    return compare(ref, got) | {"reference_ppl": math.exp(ref["nll"].mean().item())}
