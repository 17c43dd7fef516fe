"""`turboattn bench generate`: end-to-end `model.generate` ms per new token, turboattn vs transformers' bf16 path.

A random-weight model of the Llama-3-8B shape (hidden 4096, 32 q / 8 KV heads, head_dim 128; `--layers`
of them) is built on the GPU in bf16.  A prompt of `--context` random tokens is prefilled, then greedy
decoding runs `--new-tokens` steps.  ms/token = (time of prefill + N steps - time of prefill + 1 step) / (N - 1),
each the median of `--repeats` runs, so the prompt's cost cancels.  Paths: transformers' default (SDPA
attention, DynamicCache, bf16) and TurboQuantCache (k4v4, attn_implementation="turboattn").
"""

from __future__ import annotations

import statistics
import time

import torch

from .args import add_out, positive_int
from .common import environment, print_table, require_cuda, write_results


def add_arguments(parser) -> None:
    add_out(parser)
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per batch (default 1)")
    parser.add_argument("--context", type=positive_int, default=32768, help="prompt tokens (default 32768)")
    parser.add_argument("--new-tokens", type=positive_int, default=32, help="decode steps timed (default 32)")
    parser.add_argument("--layers", type=positive_int, default=32, help="decoder layers (default 32, as Llama-3-8B)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs per measurement (median)")


def _model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def run(args) -> int:
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens must be at least 2 (the first step is subtracted), got {args.new_tokens}")
    require_cuda()
    from ...hf import TurboQuantCache
    model = _model(args.layers)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context), device="cuda")
    paths = {"transformers bf16 (sdpa, DynamicCache)": ("sdpa", lambda: None),
             "turboattn k4v4 (TurboQuantCache)": ("turboattn", lambda: TurboQuantCache(model.config, 4, 4))}
    results = []
    for name, (attn, make_cache) in paths.items():
        model.config._attn_implementation = attn  # read by every attention module and mask at forward time

        def generate(steps, make_cache=make_cache):
            model.generate(ids, past_key_values=make_cache(), max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False)
        generate(2)  # warm-up: kernels compiled, the CUDA extension built
        short = _seconds(lambda: generate(1), args.repeats)
        long = _seconds(lambda: generate(args.new_tokens), args.repeats)
        ms = 1e3 * (long - short) / (args.new_tokens - 1)
        results.append({"path": name, "ms_per_token": ms, "prefill_s": short})
        torch.cuda.empty_cache()
    env = environment()
    print_table(f"generate, Llama-3-8B shape x {args.layers} layers, B={args.batch}, context {args.context}, "
                f"{env['gpu']}", ["path", "ms / new token", "prefill + 1 token s"],
                [[r["path"], r["ms_per_token"], r["prefill_s"]] for r in results])
    write_results(args.out, "generate", {"env": env, "args": {k: v for k, v in vars(args).items() if k != "func"},
                                         "results": results})
    return 0
