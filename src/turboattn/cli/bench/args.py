"""Argument types shared by the bench subcommands: comma lists and shapes, checked when parsed.

Each returns the parsed value or raises argparse.ArgumentTypeError, which
argparse turns into `error: argument --x: <message>` and exit status 2.
"""

from __future__ import annotations

import argparse

SHAPE_FIELDS = ("B", "Hq", "Hkv", "D", "L")


def _items(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
    return items


def positive_ints(text: str) -> list[int]:
    """"32,64" -> [32, 64]; every item a positive int."""
    out = []
    for item in _items(text):
        try:
            value = int(item)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected positive ints (e.g. 2,4,8), got {item!r} in {text!r}")
        out.append(value)
    return out


def positive_int(text: str) -> int:
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive int, got {text!r}")
    return values[0]


def powers_of_two(text: str) -> list[int]:
    """Like positive_ints, each a power of two (tile sizes, warp counts)."""
    out = positive_ints(text)
    for value in out:
        if value & (value - 1):
            raise argparse.ArgumentTypeError(f"expected powers of two (e.g. 32,64), got {value} in {text!r}")
    return out


def choices(*allowed: str):
    """A type for a comma list of names from `allowed`."""
    def parse(text: str) -> list[str]:
        out = _items(text)
        for item in out:
            if item not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(allowed)}")
        return out
    return parse


def presets(text: str) -> list[tuple[int, int]]:
    """"k4v4,k8v8" -> [(4, 4), (8, 8)], bit widths the codec supports."""
    from ...format.codec import SUPPORTED_BITS
    out = []
    for item in _items(text):
        try:
            kb, vb = (int(x) for x in item.lower().removeprefix("k").split("v"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"presets look like k4v4, got {item!r}") from None
        if kb not in SUPPORTED_BITS or vb not in SUPPORTED_BITS:
            raise argparse.ArgumentTypeError(f"bits of {item!r} must be in {SUPPORTED_BITS}")
        out.append((kb, vb))
    return out


def preset(text: str) -> tuple[int, int]:
    """"k4v4" -> (4, 4)."""
    if "," in text:
        raise argparse.ArgumentTypeError(f"expected one preset like k4v4, got {text!r}")
    return presets(text)[0]


def shape(text: str) -> tuple[int, ...]:
    """"8,32,8,128,32768" -> (B, Hq, Hkv, D, L), Hq a multiple of Hkv, D a supported head dim."""
    from ...format.rotation import SUPPORTED_HEAD_DIMS
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
        raise argparse.ArgumentTypeError(f"D={d} must be one of {SUPPORTED_HEAD_DIMS} in {text!r}")
    return values


def add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="benchmarks", help="folder for the JSON (and PNG) results")
