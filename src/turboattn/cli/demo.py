"""`turboattn demo`: SmolLM2 answers a chat prompt with a compressed KV cache and with an exact one.

Prints both answers, the memory of each cache, and a short quality check
(perplexity change, argmax disagreement and attention-output cosine on the
evaluation corpus).  Runs on the CPU (the exact PyTorch path) and on a CUDA GPU
(Triton kernels, bf16) when one is present.  `--synthetic` prints the older
codec-only table (quantization error of synthetic K/V per preset).
"""

from __future__ import annotations

import argparse
import time

import torch

from ..format.codec import KVCodec

PRESETS = ((8, 8), (6, 6), (5, 4), (4, 4), (4, 3), (3, 3), (2, 2))
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--preset", default="k4v4", help="compressed cache preset, kKvV (default k4v4)")
    parser.add_argument("--scale-rule", default="corrected", choices=("rms", "corrected", "lsq"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=128, help="scored tokens of the short eval (0: skip)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--synthetic", action="store_true", help="codec-only table on synthetic K/V, no model")
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim of --synthetic")


def run_demo(args) -> int:
    if args.synthetic:
        return _synthetic_table(args.head_dim)
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from transformers import DynamicCache

    from . import eval as ev
    from ..hf import TurboQuantCache
    from .models import MODELS, load_model

    console = Console()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 on the GPU; on the CPU float32 (bf16 matmuls are slow there), so the exact cache is float32.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kb, vb = ev.parse_preset(args.preset)
    console.print(f"[bold]turboattn demo[/bold]: {MODELS['smollm2'].description} on {device}, {dtype}")
    model, tok = load_model("smollm2", dtype=dtype, device=device, attn_implementation="turboattn")
    messages = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.to(device) for k, v in ids.items()}
    n_prompt = ids["input_ids"].shape[1]

    exact_name = f"{str(dtype).removeprefix('torch.')} cache"
    caches = {exact_name: DynamicCache(config=model.config),
              f"{args.preset} cache": TurboQuantCache(model.config, kb, vb, args.scale_rule)}
    answers = {}
    for name, cache in caches.items():
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(**ids, past_key_values=cache, max_new_tokens=args.max_new_tokens, do_sample=False)
        seconds = time.time() - t0
        text = tok.decode(out[0, n_prompt:], skip_special_tokens=True).strip()
        answers[name] = (out[0, n_prompt:], seconds)
        console.print(Panel(text, title=f"{name}  ({out.shape[1] - n_prompt} tokens, {seconds:.1f} s)"))

    (exact_tokens, _), (quant_tokens, _) = answers.values()
    same = _common_prefix(exact_tokens, quant_tokens)
    console.print(f"The two answers agree on their first {same} of {len(exact_tokens)} tokens.")

    table = Table(title=f"KV cache memory for this conversation ({n_prompt + len(exact_tokens)} tokens)")
    for col in ("cache", "bytes", "per token", "vs exact"):
        table.add_column(col, justify="right")
    exact_bytes = _dynamic_cache_bytes(caches[exact_name])
    quant_bytes = caches[f"{args.preset} cache"].nbytes_used()
    tokens = caches[exact_name].get_seq_length()
    bf16_bytes = exact_bytes * 2 // torch.tensor([], dtype=dtype).element_size()
    table.add_row(exact_name, f"{exact_bytes:,}", f"{exact_bytes / tokens:,.0f}", "1.00x")
    if dtype != torch.bfloat16:
        table.add_row("bf16 (same tokens)", f"{bf16_bytes:,}", f"{bf16_bytes / tokens:,.0f}",
                      f"{exact_bytes / bf16_bytes:.2f}x smaller")
    table.add_row(f"{args.preset} cache", f"{quant_bytes:,}", f"{quant_bytes / tokens:,.0f}",
                  f"{exact_bytes / quant_bytes:.2f}x smaller ({bf16_bytes / quant_bytes:.2f}x vs bf16)")
    console.print(table)

    if args.eval_tokens > 0:
        console.print(f"Short eval: 128-token prompt + {args.eval_tokens} decode steps of "
                      f"{ev.CORPUS_INFO['name']} ...")
        segments = ev.eval_tokens(tok, 1, 128 + args.eval_tokens + 1)
        recorder = ev.AttnRecorder(model)
        ref = ev.run_method(model, segments, 128, ev.reference_method(), recorder)
        got = ev.run_method(model, segments, 128, ev.turbo_method(args.preset, args.scale_rule, "decode"), recorder)
        recorder.close()
        m = ev.compare(ref, got)
        lo, hi = m["ppl_change_ci95_pct"]
        console.print(f"  perplexity {math_exp_mean(ref['nll']):.3f} -> {m['ppl']:.3f}: "
                      f"{m['ppl_change_pct']:+.2f}% (95% interval {lo:+.2f}% .. {hi:+.2f}%)")
        console.print(f"  next-token argmax differs at {m['argmax_disagree_pct']:.1f}% of positions; "
                      f"attention-output cosine mean {m['attn_cos_mean']:.5f}, 1st percentile {m['attn_cos_p1']:.4f}")
        console.print("  (QUALITY.md has the full evaluation: both models, all presets, peers, passkey.)")
    return 0


def math_exp_mean(nll: torch.Tensor) -> float:
    return float(torch.exp(nll.mean()))


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def _dynamic_cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def _realistic_kv(n: int, d: int, generator: torch.Generator):
    """Keys with outlier channels and a shared offset (as in real models); Gaussian-ish values."""
    channel_scale = torch.exp(torch.randn(d, generator=generator) * 0.8)
    k = (torch.randn(n, d, generator=generator) + 0.5 * torch.randn(d, generator=generator)) * channel_scale
    v = torch.randn(n, d, generator=generator)
    return k, v


def _synthetic_table(head_dim: int) -> int:
    from rich.console import Console
    from rich.table import Table
    g = torch.Generator().manual_seed(0)
    k, v = _realistic_kv(4096, head_dim, g)
    table = Table(title=f"TurboQuant K/V coding, head_dim={head_dim}, 4096 tokens")
    for col in ("preset", "bytes/token", "vs bf16", "K rel. error", "V rel. error"):
        table.add_column(col, justify="right")
    for kb, vb in PRESETS:
        codec = KVCodec(head_dim, kb, vb)
        errs = []
        for kind, x in (("k", k), ("v", v)):
            x_hat = codec.dequantize(codec.quantize(x, kind), kind)
            errs.append(float((x_hat - x).norm() / x.norm()))
        ratio = 4 * head_dim / codec.bytes_per_token()
        table.add_row(f"k{kb}v{vb}", str(codec.bytes_per_token()), f"{ratio:.2f}x", f"{errs[0]:.4f}", f"{errs[1]:.4f}")
    Console().print(table)
    return 0
