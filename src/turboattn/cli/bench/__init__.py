"""`turboattn bench {decode,quantize,prefill}`: GPU benchmarks against torch SDPA."""

from __future__ import annotations

import argparse
import importlib

SUITES = ("decode", "quantize", "prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--out", default="benchmarks", help="folder for the JSON and PNG results")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")


def run_bench(args) -> int:
    module = importlib.import_module(f".{args.suite}", __name__)
    return module.run(args)
