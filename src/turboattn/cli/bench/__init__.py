"""`turboattn bench <suite>`: GPU benchmarks against torch SDPA, tuning sweeps, sanitizer cases, host overhead.

One module per suite; each has `run(args)` and, for its own options, `add_arguments(parser)`.
`turboattn bench <suite> --help` prints the module's description.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from ..args import HelpFormatter, fresh_path, refuse_overwrite

# suite -> (module, one-line help)
SUITES = {
    "decode": ("decode", "one decode step over the compressed cache vs torch SDPA bf16"),
    "quantize": ("quantize", "fused quantize-and-append vs copy bandwidth"),
    "prefill": ("prefill", "dense flash attention vs torch SDPA; --configs sweeps block configurations"),
    "decode-sweep": ("decode_sweep", "compressed-cache decode under explicit launch plans (tiles, splits, lookup)"),
    "key-transform": ("key_transform", "a decode step's cost with and without the key transform"),
    "sanitize-cases": ("sanitize", "small decode cases to run under compute-sanitizer"),
    "generate": ("generate", "end-to-end model.generate ms per token, turboattn vs transformers bf16"),
    "host": ("host", "host time of turboattn per layer and decode step, kernels stubbed (runs on a CPU)"),
    "phases": ("phases", "per-CTA phase times of the CUDA decode kernel (a profiling build with stamps)"),
    "ab": ("ab", "the decode step of this tree against another git revision, timed alternately in one run"),
}
# The files each suite writes into --out (checked before the run: no GPU time is spent on results that
# could not be saved).
OUTPUTS = {
    "decode": ("decode.json", "decode.png"),
    "quantize": ("quantize.json",),
    "prefill": ("prefill.json", "prefill.png", "prefill_window.png"),
    "decode-sweep": ("decode_sweep.json",),
    "key-transform": ("key_transform.json",),
    "generate": ("generate.json",),
    "host": ("host.json",),
    "phases": ("phases.json",),
    "ab": ("ab.json",),
}


def _module(suite: str):
    return importlib.import_module(f".{SUITES[suite][0]}", __name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="suite", required=True, metavar="suite",
                                help=", ".join(SUITES) + " (each takes --help)")
    for name, (_, summary) in SUITES.items():
        module = _module(name)
        p = sub.add_parser(name, help=summary, description=module.__doc__,
                           formatter_class=HelpFormatter)
        module.add_arguments(p)


def _outputs(args) -> tuple[str, ...]:
    if args.suite == "prefill" and (args.configs or args.decode_configs):
        return ("prefill_configs.json",)
    if args.suite == "generate":
        return (f"generate_{args.model}.json", f"generate_{args.model}.png")
    return OUTPUTS[args.suite]


def run_bench(args) -> int:
    if getattr(args, "out", False) is None:
        args.out = str(fresh_path(f"bench-{args.suite}"))
    elif args.suite in OUTPUTS:
        refuse_overwrite([Path(args.out) / name for name in _outputs(args)], args.overwrite)
    return _module(args.suite).run(args)
