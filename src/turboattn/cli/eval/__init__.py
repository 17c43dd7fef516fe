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
  - `--exact-recent R,...` adds every turboattn method with an exact window of
    the R newest tokens (TurboQuantCache(exact_recent=R); names end in -rR);
    their bits per element count the window's bytes at the measured length
    (prefill + scored tokens: TurboQuantCache.bits_per_element).  Strict mode
    with a window is stepped token by token (a chunk would share one window
    boundary among its queries).
  - `--exact-first S,...` likewise with the first S tokens of each sequence
    kept exact (TurboQuantCache(exact_first=S); names carry -sS, before -rR
    when both lists are given: every combination runs); bits per element
    counted from the cache at the measured length.
  - `--exact-recent-full-only` keeps the window on full-attention layers only.
  - `--scale-dtype float32,bfloat16` runs every turboattn method with each scale
    storage (KVCodec(scale_dtype=); bfloat16 names end in -bf16scales).

The package: methods.py (presets and cache configurations), peers.py (other
quantizers), scoring.py (the metrics), passkey.py, report.py (tables, plot,
QUALITY.md markdown); this module is the command and re-exports their names.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

from ..args import (CLIError, add_overwrite, choices, fresh_path, non_negative_ints, parse_bits, positive_int,
                    positive_ints, refuse_overwrite)
from ..corpus import CORPUS_INFO, corpus_text
from .methods import (FIT_SUFFIX, MAIN_PRESETS, MIXED_CANDIDATES, PEERS, RULES, SCALE_DTYPES, Method,
                      bits_per_element, parse_preset, reference_method, turbo_method)
from .passkey import PASSKEY_ANSWER_TOKENS, passkey_hits, passkey_trial
from .peers import check_peer, peer_default_method, peer_quantizer, peer_strict_method
from .report import markdown_tables, plot, print_passkey, print_table
from .scoring import AttnRecorder, compare, compare_paired, eval_tokens, quick_check, run_method, score_segment

# The command, and the names of the modules above that callers reach as `ev.<name>`
# (`from turboattn.cli import eval as ev`: tests, demo.py).
__all__ = ["add_arguments", "run_eval", "passkey_caches", "CORPUS_INFO", "corpus_text", "FIT_SUFFIX", "MAIN_PRESETS",
           "MIXED_CANDIDATES", "PEERS", "RULES", "Method", "bits_per_element", "parse_preset", "reference_method",
           "turbo_method", "PASSKEY_ANSWER_TOKENS", "passkey_hits", "passkey_trial", "check_peer",
           "peer_default_method", "peer_quantizer", "peer_strict_method", "markdown_tables", "plot",
           "print_passkey", "print_table", "AttnRecorder", "compare", "compare_paired", "eval_tokens", "quick_check",
           "run_method", "score_segment"]   # DecodeEmulationLayer too, through __getattr__ (it needs transformers)


def __getattr__(name):
    # The decode-emulation layer needs transformers: imported on first use, not with this package.
    if name == "DecodeEmulationLayer":
        from ...integrations.decode_emulation import DecodeEmulationLayer
        return DecodeEmulationLayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _preset_list(text: str) -> list[str]:
    """"k4v4,mixed" -> ["k4v4", "mixed"]: presets the codec has (keys in channel groups: k112x6+144x4v3), and
    "mixed" (resolved per model)."""
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise argparse.ArgumentTypeError(f"expected a comma list of presets like k4v4, got {text!r}")
    for item in items:
        if item == "mixed":
            continue
        try:
            keys, v_bits = parse_preset(item)   # keys in channel groups too: k112x6+144x4v3
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        for k_bits in ((bits for _, bits in keys) if isinstance(keys, tuple) else (keys,)):
            parse_bits(f"k{k_bits}v{v_bits}")   # each width one the codec has
    return items


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"),
                        help="the model, from its PyPI package (cli/models.py)")
    parser.add_argument("--presets", type=_preset_list, default=",".join(MAIN_PRESETS) + ",mixed",
                        metavar="LIST",
                        help="comma list of kKvV presets; 'mixed' adds the <=4.25 bits/element candidates")
    parser.add_argument("--rules", type=choices(*RULES), default="corrected", metavar="LIST",
                        help=f"comma list of scale rules from {', '.join(RULES)}")
    parser.add_argument("--modes", type=choices("decode", "strict"), default="decode,strict", metavar="LIST",
                        help="decode (the library default) and/or strict (module docstring)")
    parser.add_argument("--key-fit", type=choices(*FIT_SUFFIX), default="center", metavar="LIST",
                        help="comma list of key transforms: center (library default), balance, off "
                             "(see format/key_transform.py)")
    parser.add_argument("--peers", type=choices(*PEERS, extra=("all",)), default=[], metavar="LIST",
                        help=f"every-token runs of peers: comma list from {', '.join(PEERS)}, or 'all' "
                             "(default: none)")
    parser.add_argument("--peer-defaults", type=choices(*PEERS, extra=("all",)), default=[], metavar="LIST",
                        help="peers to run also with their default 128 full-precision recent tokens, token by token "
                             "(default: none)")
    parser.add_argument("--exact-recent", type=non_negative_ints, default=[0], metavar="LIST",
                        help="comma list of exact recent windows R (0: none); each R > 0 adds the turboattn methods "
                             "with the R newest tokens kept exact, named ...-rR")
    parser.add_argument("--exact-first", type=non_negative_ints, default=[0], metavar="LIST",
                        help="comma list of exact first-token counts S (0: none); each S > 0 adds the turboattn "
                             "methods with the first S tokens of each sequence kept exact, named ...-sS")
    parser.add_argument("--scale-dtype", type=choices(*SCALE_DTYPES), default="float32", metavar="LIST",
                        help="comma list of scale storage dtypes from float32, bfloat16 (bfloat16: half the scale "
                             "bytes, names end in -bf16scales)")
    parser.add_argument("--exact-recent-full-only", action="store_true",
                        help="keep the exact recent window on full-attention layers only (sliding layers' rings are "
                             "short: a window costs a large share of them); names end in -r{R}full")
    parser.add_argument("--exact-decode", action="store_true",
                        help="step decode mode token by token instead of the (tested-equal) chunked emulation")
    parser.add_argument("--segments", type=positive_int, default=2, metavar="N", help="corpus windows")
    parser.add_argument("--prefill", type=positive_int, default=256, metavar="N", help="prompt tokens per window")
    parser.add_argument("--scored", type=positive_int, default=256, metavar="N",
                        help="decode positions scored per window")
    parser.add_argument("--passkey-lengths", type=positive_ints, default=[], metavar="LIST",
                        help="comma list of context lengths, e.g. 512,1024 (default: no passkey test)")
    parser.add_argument("--passkey-trials", type=positive_int, default=5, metavar="N",
                        help="passkey trials per length")
    parser.add_argument("--passkey-presets", type=_preset_list, default=[], metavar="LIST",
                        help="presets (rule corrected, decode mode) for passkey, besides the reference (default: none)")
    parser.add_argument("--out", type=Path, default=None, metavar="JSON",
                        help="results JSON, the plot beside it as .png (default: a new file "
                             "runs/quality_<model>-<time>.json; an existing file only with --overwrite)")
    add_overwrite(parser)
    parser.add_argument("--no-plot", action="store_true", help="skip the perplexity-vs-bits plot")
    parser.add_argument("--markdown", metavar="JSON", type=Path, default=None,
                        help="print the QUALITY.md tables of an existing results JSON, and draw its plot beside it "
                             "(an existing plot only with --overwrite); run nothing")
    parser.add_argument("--plot", metavar="JSON", type=Path, default=None,
                        help="draw the perplexity-vs-bits plot of an existing results JSON beside it (JSON's name "
                             "with .png; an existing plot only with --overwrite): turboattn's methods of --key-fit "
                             "and --modes and every peer, bits counted for a bf16 model; run nothing")


def _resolve_presets(spec, head_dim: int) -> list[str]:
    out = []
    for p in (spec.split(",") if isinstance(spec, str) else spec):
        p = p.strip()
        if p == "mixed":
            out += [c for c in MIXED_CANDIDATES.get(head_dim, ()) if c not in out]
        elif p and p not in out:
            parse_preset(p)
            out.append(p)
    return out


def _saved_results(path: Path) -> dict:
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CLIError(f"{path} is not JSON ({e})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("results"), dict):
        raise CLIError(f"{path} is not a `turboattn eval` results file (no 'results' table)")
    return saved


def _plot_beside(args, saved: dict, path: Path) -> None:
    """Draw the plot of `saved` beside `path`, keeping an existing plot unless --overwrite."""
    png = path.with_suffix(".png")
    if png.exists() and not args.overwrite:
        print(f"(kept {png}; --overwrite redraws it)", file=sys.stderr)
    else:
        plot(saved, png, fits=args.key_fit, modes=args.modes)
        print(f"wrote {png}", file=sys.stderr)


def _markdown(args) -> int:
    saved = _saved_results(args.markdown)
    print(markdown_tables(saved))
    if not args.no_plot:
        _plot_beside(args, saved, args.markdown)
    return 0


def _out_path(args) -> Path:
    """Where the results go: --out (an existing file only with --overwrite), else a new file under runs/."""
    if args.out is None:
        return fresh_path(f"quality_{args.model}", ".json")
    if args.out.suffix != ".json":
        raise CLIError(f"--out names the results JSON (the plot goes beside it), got {str(args.out)!r}")
    refuse_overwrite([args.out] + ([] if args.no_plot else [args.out.with_suffix(".png")]), args.overwrite)
    return args.out


def passkey_caches(args: argparse.Namespace, head_dim: int) -> dict:
    """{name: make_cache(model)} of the passkey presets, with the perplexity runs' cache options (key fits, exact
    first tokens, exact window, scale dtype): the passkey rows measure the caches the perplexity rows do."""
    caches = {}
    for p in _resolve_presets(args.passkey_presets, head_dim):
        for fit, s, w, sd in itertools.product(args.key_fit, args.exact_first, args.exact_recent, args.scale_dtype):
            method = turbo_method(p, "corrected", "decode", exact_decode=True, fit_keys=fit, exact_recent=w,
                                  exact_first=s, scale_dtype=sd, recent_sliding=not args.exact_recent_full_only)
            caches[method.name.replace("-corrected-decode", "", 1)] = method.make_cache
    return caches


def run_eval(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from ..models import load_model

    if args.markdown and args.plot:
        raise CLIError("--markdown draws the plot too: give one of --markdown, --plot")
    if args.markdown:
        return _markdown(args)
    if args.plot:
        _plot_beside(args, _saved_results(args.plot), args.plot)
        return 0
    # Everything the arguments decide is checked before the model loads.
    out = _out_path(args)
    if not Path(CORPUS_INFO["path"]).is_file():
        raise CLIError(f"the evaluation text {CORPUS_INFO['path']} is missing: {CORPUS_INFO['package']}")
    rules, modes, fits = args.rules, args.modes, args.key_fit
    peers = list(PEERS) if args.peers == ["all"] else args.peers
    peer_defaults = list(PEERS) if args.peer_defaults == ["all"] else args.peer_defaults
    lengths = args.passkey_lengths
    if args.passkey_presets and not lengths:
        raise CLIError("--passkey-presets needs --passkey-lengths")

    console = Console()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tok = load_model(args.model, dtype=dtype, device=device, attn_implementation="turboattn")
    text_cfg = model.config.get_text_config()
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    presets = _resolve_presets(args.presets, head_dim)
    longest = max([args.prefill + args.scored + 1] + lengths)
    if longest > text_cfg.max_position_embeddings:
        raise CLIError(f"{args.model} takes at most {text_cfg.max_position_embeddings} positions; --prefill + "
                       f"--scored + 1 and --passkey-lengths must fit (got {longest})")
    methods = [turbo_method(p, r, m, exact_decode=args.exact_decode, fit_keys=f, exact_recent=w, exact_first=s,
                            scale_dtype=sd, recent_sliding=not args.exact_recent_full_only)
               for p in presets for r in rules for m in modes for f in fits for s in args.exact_first
               for w in args.exact_recent for sd in args.scale_dtype]
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

    try:
        segments = eval_tokens(tok, args.segments, args.prefill + args.scored + 1)
    except ValueError as e:
        raise CLIError(f"{e}: lower --segments, --prefill or --scored") from None
    recorder = AttnRecorder(model)
    results, passkey_trials = {}, {}
    out.parent.mkdir(parents=True, exist_ok=True)

    def report(passkey=None):
        return {
            "model": args.model, "head_dim": head_dim, "device": device, "dtype": str(dtype),
            "corpus": CORPUS_INFO, "segments": args.segments, "prefill": args.prefill,
            "scored_per_segment": args.scored, "results": results, "passkey": passkey or {},
            "passkey_trials": args.passkey_trials, "passkey_hits": passkey_trials, "skipped": skipped,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        }

    # Every method after the first turboattn one is also compared with it on the same tokens (paired).
    paired_base = None
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
                # With exact buffers the cache's own count at the measured length (they are a fixed cost).
                row["bits_per_element"] = (got["bits_per_element"] if m.info["exact_recent"] or m.info["exact_first"]
                                           else bits_per_element(m.info["preset"], head_dim, m.info["scale_dtype"]))
            if paired_base is not None:
                row |= compare_paired(paired_base[0], paired_base[1], got)
            elif m.family == "turboattn":
                paired_base = (m.name, {"nll": got["nll"]})
            results[m.name] = row
            progress.advance(task)
            if not console.is_terminal:  # logs: one line per method
                console.print(f"[{i + 1}/{len(methods)}] {m.name}: ppl {row['ppl_change_pct']:+.2f}% "
                              f"argmax {row['argmax_disagree_pct']:.2f}% cos {row['attn_cos_mean']:.5f} "
                              f"({row['seconds']:.0f} s)")
            out.write_text(json.dumps(report(), indent=1))
    recorder.close()

    passkey = {}
    if lengths:
        from transformers import DynamicCache
        pk_methods = {"reference": lambda m: DynamicCache(config=m.config)} | passkey_caches(args, head_dim)
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
        plot(final, out.with_suffix(".png"), fits=args.key_fit, modes=args.modes)
    console.print(f"wrote {out}")
    return 0
