"""Argument types of the bench subcommands (the shared ones come from cli/args.py), checked when parsed."""

from __future__ import annotations

import argparse

# The suites import these from here too.
from ..args import add_overwrite, choices, non_negative_int, positive_int, positive_ints, preset, presets  # noqa: F401

SHAPE_FIELDS = ("B", "Hq", "Hkv", "D", "L")


def shape(text: str) -> tuple[int, ...]:
    """"8,32,8,128,32768" -> (B, Hq, Hkv, D, L), Hq a multiple of Hkv, D a supported head dim."""
    from ...format.rotation import SUPPORTED_HEAD_DIMS  # the kernels serve every one
    try:
        values = tuple(positive_ints(text))
    except argparse.ArgumentTypeError:
        values = ()
    if len(values) != len(SHAPE_FIELDS):
        raise argparse.ArgumentTypeError(f"a shape is {','.join(SHAPE_FIELDS)} (5 positive ints), got {text!r}")
    b, hq, hkv, d, length = values
    if hq % hkv:
        raise argparse.ArgumentTypeError(f"Hq={hq} must be a multiple of Hkv={hkv} in {text!r}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise argparse.ArgumentTypeError(f"D={d} must be a multiple of 16 from 32 to 512 in {text!r}")
    return values


def powers_of_two(text: str) -> list[int]:
    """Like positive_ints, each a power of two (tile sizes, warp counts)."""
    out = positive_ints(text)
    for value in out:
        if value & (value - 1):
            raise argparse.ArgumentTypeError(f"expected powers of two (e.g. 32,64), got {value} in {text!r}")
    return out


def add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None,
                        help="folder for the JSON (and PNG) results (default: a new folder runs/bench-<suite>-<time>; "
                             "BENCHMARKS.md's numbers are in benchmarks/, replaced only with --overwrite)")
    add_overwrite(parser)


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """The timed caches' storage options: scale dtype, exact first tokens, exact recent window."""
    parser.add_argument("--scale-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the caches' scale dtype (KVCodec(scale_dtype=))")
    parser.add_argument("--exact-first", type=non_negative_int, default=0,
                        help="QuantizedKVCache(exact_first=): the first tokens kept exact")
    parser.add_argument("--exact-recent", type=non_negative_int, default=0,
                        help="QuantizedKVCache(exact_recent=): the newest tokens kept exact")
