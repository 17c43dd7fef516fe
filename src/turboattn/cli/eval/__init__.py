"""`turboattn eval`: what a compressed KV cache costs a real model, measured against an exact cache.

Protocol (the same tokens for every method).  Each segment of the corpus is
`prefill` tokens processed as one chunk, then `scored` tokens fed as decode
steps with teacher forcing.  Only the logits of decode steps are scored: the
prefill attends to its own fresh K/V in every method, so it carries no
quantization error.  Compared with the reference run (the model's own dtype,
transformers' DynamicCache, no quantization):

  (A) cosine similarity of every layer's attention output (after o_proj) at
      every scored position: mean and 1st percentile;
  (B) next-token argmax disagreement;
  (C) perplexity change, with its noise: per-token NLL differences are
      paired, so the 95% interval is exp(mean(d) +- 2 se(d)) - 1;
  and passkey retrieval accuracy at several context lengths.

Methods.  All of them run through the same attention code (turboattn's; on
CPU the exact PyTorch reference), only the cache differs:
  - turboattn presets kKvV with a scale rule, in two modes: "decode" (the
    library default: a step attends to its own new K/V in full precision and
    stores them quantized; every earlier token is read quantized) and
    "strict" (the step's own K/V are quantized first, so every token is seen
    only quantized).  Strict mode is exact in chunks (append, then attend),
    so it is scored `chunk` tokens at a time; decode mode one token per step.
  - peers: transformers' QuantizedCache (quanto int4/int2, HQQ) and the
    `turboquant` package, one token per step, with residual 1 (every earlier
    token quantized, the current one full precision: like "decode" mode) and
    with their default residual of 128 full-precision recent tokens.

The package: methods.py (presets and cache configurations), peers.py (other
quantizers), scoring.py (the metrics), passkey.py, report.py (tables, plot,
QUALITY.md markdown); this module is the command and re-exports their names.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from ..corpus import CORPUS_INFO, corpus_text
from .methods import (FIT_SUFFIX, MAIN_PRESETS, MIXED_CANDIDATES, PEERS, RULES, Method, bits_per_element,
                      parse_preset, reference_method, turbo_method)
from .passkey import PASSKEY_ANSWER_TOKENS, passkey_hits, passkey_trial
from .peers import check_peer, peer_default_method, peer_quantizer, peer_strict_method
from .report import markdown_tables, plot, print_passkey, print_table
from .scoring import AttnRecorder, compare, eval_tokens, quick_check, run_method, score_segment

# The command, and the names of the modules above that callers reach as `ev.<name>`
# (`from turboattn.cli import eval as ev`: tests, demo.py).
__all__ = ["add_arguments", "run_eval", "CORPUS_INFO", "corpus_text", "FIT_SUFFIX", "MAIN_PRESETS",
           "MIXED_CANDIDATES", "PEERS", "RULES", "Method", "bits_per_element", "parse_preset", "reference_method",
           "turbo_method", "PASSKEY_ANSWER_TOKENS", "passkey_hits", "passkey_trial", "check_peer",
           "peer_default_method", "peer_quantizer", "peer_strict_method", "markdown_tables", "plot",
           "print_passkey", "print_table", "AttnRecorder", "compare", "eval_tokens", "quick_check", "run_method",
           "score_segment"]   # DecodeEmulationLayer too, through __getattr__ (it needs transformers)


def __getattr__(name):
    # The decode-emulation layer needs transformers: imported on first use, not with this package.
    if name == "DecodeEmulationLayer":
        from ...integrations.decode_emulation import DecodeEmulationLayer
        return DecodeEmulationLayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    parser.add_argument("--presets", default=",".join(MAIN_PRESETS) + ",mixed",
                        help="comma list of kKvV presets; 'mixed' adds the <=4.25 bits/element candidates")
    parser.add_argument("--rules", default="corrected", help="comma list of scale rules (rms, corrected, lsq)")
    parser.add_argument("--modes", default="decode,strict", help="decode (library default) and/or strict")
    parser.add_argument("--key-fit", default="center",
                        help="comma list of key transforms: center (library default), balance, off "
                             "(see key_transform.py)")
    parser.add_argument("--peers", default="", help=f"every-token runs of peers: comma list from {PEERS}, or 'all'")
    parser.add_argument("--peer-defaults", default="",
                        help="peers to run also with their default 128 full-precision recent tokens (token by token)")
    parser.add_argument("--exact-decode", action="store_true",
                        help="step decode mode token by token instead of the (tested-equal) chunked emulation")
    parser.add_argument("--segments", type=int, default=2, help="corpus windows")
    parser.add_argument("--prefill", type=int, default=256, help="prompt tokens per window")
    parser.add_argument("--scored", type=int, default=256, help="decode positions scored per window")
    parser.add_argument("--passkey-lengths", default="", help="comma list of context lengths, e.g. 512,1024")
    parser.add_argument("--passkey-trials", type=int, default=5)
    parser.add_argument("--passkey-presets", default="", help="presets (rule corrected, decode mode) for passkey")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/quality_<model>.json)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--markdown", metavar="JSON", default=None,
                        help="print the QUALITY.md tables (and redraw the plot) of an existing results JSON, run nothing")


def _resolve_presets(spec: str, head_dim: int) -> list[str]:
    out = []
    for p in spec.split(","):
        p = p.strip()
        if p == "mixed":
            out += [c for c in MIXED_CANDIDATES.get(head_dim, ()) if c not in out]
        elif p:
            parse_preset(p)
            out.append(p)
    return out


def run_eval(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from ..models import load_model

    console = Console()
    if args.markdown:
        saved = json.loads(Path(args.markdown).read_text())
        print(markdown_tables(saved))
        if not args.no_plot:
            plot(saved, Path(args.markdown).with_suffix(".png"))
        return 0
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tok = load_model(args.model, dtype=dtype, device=device, attn_implementation="turboattn")
    text_cfg = model.config.get_text_config()
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    presets = _resolve_presets(args.presets, head_dim)
    rules = [r for r in args.rules.split(",") if r]
    modes = [m for m in args.modes.split(",") if m]
    peers = list(PEERS) if args.peers == "all" else [p for p in args.peers.split(",") if p]
    peer_defaults = list(PEERS) if args.peer_defaults == "all" else [p for p in args.peer_defaults.split(",") if p]

    fits = [f for f in args.key_fit.split(",") if f]
    if not fits or any(f not in FIT_SUFFIX for f in fits):
        raise SystemExit(f"--key-fit takes a comma list of {tuple(FIT_SUFFIX)}, got {args.key_fit!r}")
    methods = [turbo_method(p, r, m, exact_decode=args.exact_decode, fit_keys=f)
               for p in presets for r in rules for m in modes for f in fits]
    skipped = {}
    for peer in dict.fromkeys(peers + peer_defaults):
        why = check_peer(peer)
        if why:
            skipped[peer] = why
            continue
        if peer in peers:
            methods.append(peer_strict_method(peer, head_dim))
        if peer in peer_defaults:
            methods.append(peer_default_method(peer))

    segments = eval_tokens(tok, args.segments, args.prefill + args.scored + 1)
    recorder = AttnRecorder(model)
    results, passkey_trials = {}, {}
    out = Path(args.out or f"benchmarks/quality_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def report(passkey=None):
        return {
            "model": args.model, "head_dim": head_dim, "device": device, "dtype": str(dtype),
            "corpus": CORPUS_INFO, "segments": args.segments, "prefill": args.prefill,
            "scored_per_segment": args.scored, "results": results, "passkey": passkey or {},
            "passkey_trials": args.passkey_trials, "passkey_hits": passkey_trials, "skipped": skipped,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        }

    with Progress(console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task(f"{args.model}: reference", total=len(methods) + 1)
        ref = run_method(model, segments, args.prefill, reference_method(), recorder)
        results["reference"] = {"ppl": math.exp(ref["nll"].mean().item()), "seconds": ref["seconds"]}
        progress.advance(task)
        for i, m in enumerate(methods):
            progress.update(task, description=f"{args.model}: {m.name}")
            try:
                got = run_method(model, segments, args.prefill, m, recorder)
            except Exception as e:  # a peer failing at run time is reported, not fatal
                if m.family == "turboattn":
                    raise
                skipped[m.name] = f"{type(e).__name__}: {e}"
                progress.advance(task)
                continue
            row = compare(ref, got) | m.info | {"family": m.family, "seconds": got["seconds"],
                                                 "cache_bytes": got["cache_bytes"]}
            if m.family == "turboattn":
                row["bits_per_element"] = bits_per_element(m.info["preset"], head_dim)
            results[m.name] = row
            progress.advance(task)
            if not console.is_terminal:  # logs: one line per method
                console.print(f"[{i + 1}/{len(methods)}] {m.name}: ppl {row['ppl_change_pct']:+.2f}% "
                              f"argmax {row['argmax_disagree_pct']:.2f}% cos {row['attn_cos_mean']:.5f} "
                              f"({row['seconds']:.0f} s)")
            out.write_text(json.dumps(report(), indent=1))
    recorder.close()

    passkey = {}
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x]
    if lengths:
        from transformers import DynamicCache
        pk_methods = {"reference": lambda m: DynamicCache(config=m.config)}
        for p in [p for p in args.passkey_presets.split(",") if p]:
            for fit in fits:
                pk_methods[p + FIT_SUFFIX[fit]] = turbo_method(p, "corrected", "decode", exact_decode=True,
                                                                         fit_keys=fit).make_cache
        for name, make in pk_methods.items():
            console.print(f"passkey {name} ...")
            hits = passkey_hits(model, tok, make, lengths, args.passkey_trials)
            passkey_trials[name] = hits
            passkey[name] = {n: sum(h) / len(h) for n, h in hits.items()}
            out.write_text(json.dumps(report(passkey), indent=1))

    final = report(passkey)
    out.write_text(json.dumps(final, indent=1))
    print_table(final, console)
    if passkey:
        print_passkey(final, console)
    if not args.no_plot:
        plot(final, out.with_suffix(".png"))
    console.print(f"wrote {out}")
    return 0
