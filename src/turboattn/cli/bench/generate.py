"""`turboattn bench generate`: end-to-end decode speed, ms per new token, turboattn vs transformers' bf16 paths.

Models are built from config with random weights in bf16 (nothing downloaded): `8b` is the Llama-3-8B shape
(hidden 4096, 32 q / 8 KV heads, head_dim 128, 32 layers), `1b` the Llama-3.2-1B shape (hidden 2048, 32 q / 8 KV
heads, head_dim 64, 16 layers), `270m` Gemma-3-270M's sizes on the Llama architecture (hidden 640, 4 q / 1 KV
heads, head_dim 256, 18 layers, all of them global: no sliding window).  `--bits` takes keys in channel groups too
(k112x6+144x4v3).  For every batch x context of `--grid` a prompt of random tokens is prefilled and
greedy decoding is timed on each path:

- `bf16`: transformers' default (SDPA attention, DynamicCache), `model.generate`;
- `bf16-compiled`: `generate` with a StaticCache, which transformers compiles (reduce-overhead);
- `turboattn`: TurboQuantCache k4v4, growing storage, eager;
- `turboattn-compiled`: TurboQuantCache(max_cache_len=...), which is compileable, so `generate` compiles it;
- `bf16-loop`, `turboattn-loop`: a hand-written greedy loop passing `cache_position` (no generate overhead),
  the prompt prefilled in chunks (`--prefill-chunk`), so that batches too large for one prefill forward run;
- `bf16-compiled-loop`, `turboattn-compiled-loop`: that loop with the decode step under
  `torch.compile(mode="reduce-overhead")` (StaticCache / TurboQuantCache(max_cache_len)): GPU time with
  neither generate's nor eager PyTorch's host overhead.

generate paths: ms/token = (time of prefill + N steps - time of prefill + 1 step) / (N - 1), medians of
`--repeats`, so the prompt's cost cancels.  Loop paths time N steps after the prefill directly.  A path that
runs out of memory is reported as such (a bf16 cache that does not fit where the compressed one does).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..args import batch_by_length, choices, positive_int
from ..eval.methods import key_options, parse_preset
from .args import add_cache_options, add_out
from .common import environment, print_table, require_cuda, write_results

MODEL_SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=32, head_dim=128, rope_theta=500000.0, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=16, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True),
    "270m": dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1,
                 num_hidden_layers=18, head_dim=256, rope_theta=1000000.0, tie_word_embeddings=True),
}
PATHS = ("bf16", "bf16-compiled", "turboattn", "turboattn-compiled", "bf16-loop", "turboattn-loop",
         "bf16-compiled-loop", "turboattn-compiled-loop")


def add_arguments(parser) -> None:
    add_out(parser)
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="8b",
                        help="model shape, random weights: 8b is Llama-3-8B, 1b Llama-3.2-1B, 270m Gemma-3-270M's "
                             "sizes")
    parser.add_argument("--grid", type=batch_by_length, default="1x32768", help="comma list of BATCHxCONTEXT")
    parser.add_argument("--paths", type=choices(*PATHS), default=",".join(PATHS), help="comma list of paths to time")
    parser.add_argument("--new-tokens", type=positive_int, default=32, help="decode steps timed")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="decoder layers (default: the model shape's)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs per generate measurement (median)")
    parser.add_argument("--bits", type=coded_preset, default="k4v4",
                        help="bits of the turboattn cache (keys in channel groups: k112x6+144x4v3)")
    add_cache_options(parser)   # the turboattn cache's (the quality presets: first 4, recent 8 or 64, bfloat16)
    parser.add_argument("--prefill-chunk", type=positive_int, default=65536, metavar="TOKENS",
                        help="loop paths: prompt tokens per prefill forward, all sequences together (generate paths "
                             "prefill in one forward)")


def coded_preset(text: str) -> tuple[str, int | tuple, int]:
    """"k4v4" or "k112x6+144x4v3" -> (the name, the keys' bits or groups, the values' bits)."""
    try:
        return (text, *parse_preset(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _model(shape: str, layers: int | None):
    from transformers import LlamaConfig, LlamaForCausalLM
    fields = dict(MODEL_SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = LlamaConfig(vocab_size=128256, max_position_embeddings=131072, **fields)
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


def _bf16_cache_bytes(config, batch: int, tokens: int) -> int:
    c = config
    return 2 * c.num_hidden_layers * batch * c.num_key_value_heads * tokens * c.head_dim * 2


def _time_generate(model, ids, new_tokens: int, repeats: int, make_cache, **kwargs) -> tuple[float, object]:
    """ms per token from generate(N) - generate(1); returns (ms, the last cache made)."""
    made = {}

    def generate(steps):
        cache = make_cache()
        made["cache"] = cache
        model.generate(ids, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       **kwargs)
    generate(3)  # warm-up: kernels compiled, graphs captured, the CUDA extension built
    generate(3)
    short = _seconds(lambda: generate(1), repeats)
    long = _seconds(lambda: generate(new_tokens), repeats)
    return 1e3 * (long - short) / (new_tokens - 1), made["cache"]


def _prefill(model, ids, cache, chunk_tokens: int):
    """Logits of the last prompt token, the prompt fed in chunks of about chunk_tokens tokens (all sequences
    together): a 32-sequence 32K prompt in one forward would need ~30 GB for one MLP activation alone."""
    b, t = ids.shape
    step = max(1, chunk_tokens // b)
    for start in range(0, t, step):
        end = min(start + step, t)
        out = model(ids[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1,
                    cache_position=torch.arange(start, end, device=ids.device))
    return out.logits


def _time_loop(model, ids, new_tokens: int, cache, chunk_tokens: int, compiled: bool = False) -> float:
    """ms per token of a greedy loop that passes cache_position (what a lean serving loop does); compiled: its
    decode step through torch.compile(mode="reduce-overhead"), inductor plus CUDA graphs (the prefill stays eager)."""
    b, t = ids.shape
    token = _prefill(model, ids, cache, chunk_tokens)[:, -1].argmax(-1, keepdim=True)
    position = torch.tensor([t], device=ids.device)

    def forward(token, position):
        return model(token, past_key_values=cache, cache_position=position, use_cache=True).logits
    if compiled:
        forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)

    def step():
        nonlocal token, position
        # argmax reads the logits before the next replay of a CUDA graph overwrites them
        token = forward(token, position)[:, -1].argmax(-1, keepdim=True)
        position = position + 1
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(new_tokens):
        step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / new_tokens


def _run_path(path: str, model, ids, args, k_code: int | tuple, v_bits: int) -> dict:
    from transformers import DynamicCache, StaticCache

    from ...hf import TurboQuantCache
    config = model.config
    options = dict(exact_first=args.exact_first, exact_recent=args.exact_recent,
                   scale_dtype=getattr(torch, args.scale_dtype), v_bits=v_bits, **key_options(k_code))
    b, context = ids.shape
    tokens = context + args.new_tokens + 4
    model.config._attn_implementation = "turboattn" if path.startswith("turboattn") else "sdpa"
    kv_bytes = None
    if path == "bf16":
        ms, _ = _time_generate(model, ids, args.new_tokens, args.repeats, lambda: None)
        kv_bytes = _bf16_cache_bytes(config, b, context + args.new_tokens)
    elif path == "bf16-compiled":
        # One capacity for every call (as turboattn-compiled): cache_implementation="static" would size the cache
        # from max_new_tokens, so the timed calls would compile again.
        ms, _ = _time_generate(model, ids, args.new_tokens, args.repeats,
                               lambda: StaticCache(config=config, max_cache_len=tokens))
        kv_bytes = _bf16_cache_bytes(config, b, context + args.new_tokens)
    elif path == "turboattn":
        ms, cache = _time_generate(model, ids, args.new_tokens, args.repeats,
                                   lambda: TurboQuantCache(config, **options), disable_compile=True)
        kv_bytes = cache.nbytes
    elif path == "turboattn-compiled":
        ms, cache = _time_generate(model, ids, args.new_tokens, args.repeats,
                                   lambda: TurboQuantCache(config, max_cache_len=tokens, **options))
        kv_bytes = cache.nbytes
    elif path == "bf16-loop":
        ms = _time_loop(model, ids, args.new_tokens, DynamicCache(config=config), args.prefill_chunk)
        kv_bytes = _bf16_cache_bytes(config, b, context + args.new_tokens + 2)
    elif path == "bf16-compiled-loop":
        ms = _time_loop(model, ids, args.new_tokens, StaticCache(config=config, max_cache_len=tokens),
                        args.prefill_chunk, compiled=True)
        kv_bytes = _bf16_cache_bytes(config, b, tokens)
    elif path == "turboattn-compiled-loop":
        cache = TurboQuantCache(config, max_cache_len=tokens, **options)
        ms = _time_loop(model, ids, args.new_tokens, cache, args.prefill_chunk, compiled=True)
        kv_bytes = cache.nbytes
    else:
        cache = TurboQuantCache(config, **options)
        ms = _time_loop(model, ids, args.new_tokens, cache, args.prefill_chunk)
        kv_bytes = cache.nbytes
    return {"ms_per_token": ms, "kv_cache_gib": kv_bytes / 2**30}


@torch.no_grad()
def run(args) -> int:
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens must be at least 2 (the first step is subtracted), got {args.new_tokens}")
    name, k_code, v_bits = args.bits
    require_cuda()
    model = _model(args.model, args.layers)
    results = []
    for batch, context in args.grid:
        ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
        for path in args.paths:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            torch._dynamo.reset()   # each compiled path compiles afresh, not on top of another path's graphs
            row = {"model": args.model, "batch": batch, "context": context, "path": path}
            try:
                row.update(_run_path(path, model, ids, args, k_code, v_bits))
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            except torch.cuda.OutOfMemoryError:
                row.update(ms_per_token=None, kv_cache_gib=None, peak_gib=None, error="out of memory")
            results.append(row)
            print(row, flush=True)
    env = environment()
    rows = [[r["batch"], r["context"], r["path"], "OOM" if r["ms_per_token"] is None else r["ms_per_token"],
             "-" if r["kv_cache_gib"] is None else r["kv_cache_gib"], "-" if r["peak_gib"] is None else r["peak_gib"]]
            for r in results]
    exact = f", exact first {args.exact_first} + recent {args.exact_recent}" if args.exact_first + args.exact_recent else ""
    print_table(f"generate, {args.model} shape, {env['gpu']}, {name}{exact}, {args.scale_dtype} scales",
                ["B", "context", "path", "ms / new token", "KV cache GiB", "peak GiB"], rows)
    payload = {"env": env, "args": {k: v for k, v in vars(args).items() if k not in ("func", "out")}, "results": results}
    write_results(args.out, f"generate_{args.model}", payload)
    _plot(args.out, f"generate_{args.model}", results, f"{args.model} shape, {env['gpu']}")
    return 0


def _plot(out_dir: str, name: str, results: list[dict], title: str) -> None:
    """Grouped bars: ms/token per path, one group per batch x context."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({(r["batch"], r["context"]) for r in results})
    paths = list(dict.fromkeys(r["path"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(paths), 1)
    for i, path in enumerate(paths):
        ys = []
        for shape in shapes:
            ms = next((r["ms_per_token"] for r in results if (r["batch"], r["context"]) == shape
                       and r["path"] == path), None)
            ys.append(ms or 0.0)
        ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=path)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"B={b} L={l}" for b, l in shapes])
    ax.set_ylabel("ms per new token (0: out of memory)")
    ax.set_title(f"generate: {title}")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=120)
    plt.close(fig)
