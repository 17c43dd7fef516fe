"""`turboattn demo`: SmolLM2 answers a chat prompt with a compressed KV cache and with an exact one.

Prints both answers, the memory of each cache, and a short quality check
(perplexity change, argmax disagreement and attention-output cosine on the
evaluation corpus).  Runs on the CPU (the exact PyTorch path) and on a CUDA GPU
(Triton kernels, bf16) when one is present.  `--synthetic` prints the older
codec-only table (quantization error of synthetic K/V per preset), no model.

On a GPU the first run on a machine builds the CUDA decode kernel (under a
minute of nvcc; `make install` does it ahead, `turboattn info --build-kernels`)
and compiles the Triton kernels (seconds); both are cached for later runs.  The
demo does this before it times anything, so the times it prints are the same
on the first run and later ones.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..format.codec import SCALE_RULES, KVCodec
from .args import COMMON_HEAD_DIMS, CLIError, non_negative_int, positive_int, preset, preset_name

PRESETS = ((8, 8), (6, 6), (5, 4), (4, 4), (4, 3), (3, 3), (2, 2))
DEFAULT_PRESET = (4, 4)
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
# Options of the model demo that --synthetic does not use, and --synthetic's own.
MODEL_ONLY = ("prompt", "max_new_tokens", "eval_tokens", "device")
SYNTHETIC_ONLY = ("head_dim",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message of the chat")
    parser.add_argument("--preset", type=preset, default=None, metavar="kKvV",
                        help="compressed cache preset: K and V bits from 2, 3, 4, 5, 6, 8 (default: k4v4; with "
                             f"--synthetic, the table's one row instead of {', '.join(map(preset_name, PRESETS))})")
    parser.add_argument("--scale-rule", default="corrected", choices=SCALE_RULES,
                        help="how each vector's scale is chosen (docs/design.md)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                        help="tokens each cache generates")
    parser.add_argument("--eval-tokens", type=non_negative_int, default=128, metavar="N",
                        help="decode steps scored by the short quality check on the evaluation corpus (0: skip it)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the model runs (default: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--synthetic", action="store_true",
                        help="no model: the codec's round-trip error on synthetic K/V, one row per preset")
    parser.add_argument("--head-dim", type=int, choices=COMMON_HEAD_DIMS, default=128,
                        help="head_dim of the --synthetic vectors")


def check_arguments(args, parser: argparse.ArgumentParser) -> None:
    """Refuse options that the chosen mode would ignore (before any model is loaded)."""
    unused, mode = (MODEL_ONLY, "--synthetic") if args.synthetic else (SYNTHETIC_ONLY, "the model demo")
    for dest in unused:
        if getattr(args, dest) != parser.get_default(dest):
            raise CLIError(f"--{dest.replace('_', '-')} does not apply to {mode}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA GPU is visible to torch")


def run_demo(args) -> int:
    check_arguments(args, args.parser)
    if args.synthetic:
        return _synthetic_table(args.head_dim, [args.preset] if args.preset else PRESETS, args.scale_rule)
    from .corpus import CORPUS_PATH
    from .models import gguf_path
    if args.eval_tokens and not CORPUS_PATH.is_file():
        raise CLIError(f"the quality check reads {CORPUS_PATH}, which is missing: apt-get install dict-jargon "
                       "(or --eval-tokens 0 to skip the check)")
    gguf_path("smollm2")  # a missing model package is one line (FileNotFoundError), before the imports below

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
    kb, vb = args.preset or DEFAULT_PRESET
    preset_label = preset_name((kb, vb))
    console.print(f"[bold]turboattn demo[/bold]: {MODELS['smollm2'].description} on {device}, {dtype}")
    model, tok = load_model("smollm2", dtype=dtype, device=device, attn_implementation="turboattn")
    messages = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.to(device) for k, v in ids.items()}
    n_prompt = ids["input_ids"].shape[1]

    exact_name = f"{str(dtype).removeprefix('torch.')} cache"
    make_caches = {exact_name: lambda: DynamicCache(config=model.config),
                   f"{preset_label} cache": lambda: TurboQuantCache(model.config, kb, vb, args.scale_rule)}
    if device == "cuda":
        # The first decode steps on a GPU build and compile kernels (cached for later runs): do it untimed.
        t0 = time.time()
        console.print("Preparing the GPU kernels (the first run on a machine builds them: about a minute; "
                      "later runs reuse the build) ...")
        with torch.no_grad():
            for make in make_caches.values():
                model.generate(**ids, past_key_values=make(), max_new_tokens=2, do_sample=False)
        console.print(f"  ready in {time.time() - t0:.1f} s")
    caches = {name: make() for name, make in make_caches.items()}
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
    quant_bytes = caches[f"{preset_label} cache"].nbytes_used()
    tokens = caches[exact_name].get_seq_length()
    bf16_bytes = exact_bytes * 2 // torch.tensor([], dtype=dtype).element_size()
    table.add_row(exact_name, f"{exact_bytes:,}", f"{exact_bytes / tokens:,.0f}", "1.00x")
    if dtype != torch.bfloat16:
        table.add_row("bf16 (same tokens)", f"{bf16_bytes:,}", f"{bf16_bytes / tokens:,.0f}",
                      f"{exact_bytes / bf16_bytes:.2f}x smaller")
    table.add_row(f"{preset_label} cache", f"{quant_bytes:,}", f"{quant_bytes / tokens:,.0f}",
                  f"{exact_bytes / quant_bytes:.2f}x smaller ({bf16_bytes / quant_bytes:.2f}x vs bf16)")
    console.print(table)

    if args.eval_tokens > 0:
        console.print(f"Short eval: 128-token prompt + {args.eval_tokens} decode steps of "
                      f"{ev.CORPUS_INFO['name']} ...")
        segments = ev.eval_tokens(tok, 1, 128 + args.eval_tokens + 1)
        recorder = ev.AttnRecorder(model)
        ref = ev.run_method(model, segments, 128, ev.reference_method(), recorder)
        got = ev.run_method(model, segments, 128, ev.turbo_method(preset_label, args.scale_rule, "decode"), recorder)
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


def _synthetic_table(head_dim: int, presets=PRESETS, scale_rule: str = "corrected") -> int:
    from rich.console import Console
    from rich.table import Table
    g = torch.Generator().manual_seed(0)
    k, v = _realistic_kv(4096, head_dim, g)
    table = Table(title=f"TurboQuant K/V coding, head_dim={head_dim}, 4096 tokens, scale rule {scale_rule}",
                  caption="error: ||x̂ - x|| / ||x|| over all 4096 vectors after quantize + dequantize "
                          "(relative RMS error; its square is the relative MSE of README's table)")
    for col in ("preset", "bytes/token", "vs bf16", "K error", "V error"):
        table.add_column(col, justify="right")
    for kb, vb in presets:
        codec = KVCodec(head_dim, kb, vb, scale_rule)
        errs = []
        for kind, x in (("k", k), ("v", v)):
            x_hat = codec.dequantize(codec.quantize(x, kind), kind)
            errs.append(float((x_hat - x).norm() / x.norm()))
        ratio = 4 * head_dim / codec.bytes_per_token()
        table.add_row(f"k{kb}v{vb}", str(codec.bytes_per_token()), f"{ratio:.2f}x", f"{errs[0]:.4f}", f"{errs[1]:.4f}")
    Console().print(table)
    return 0
