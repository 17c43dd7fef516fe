"""What every `turboattn` subcommand shares: argument types checked when parsed, the help formatter,
the one-line error, and where results go.

An argument type returns the parsed value or raises argparse.ArgumentTypeError,
which argparse turns into `turboattn <cmd>: error: argument --x: <message>` and
exit status 2, before any model is loaded.  Problems found later (a file that
is not there, a run that would overwrite results) raise CLIError, which
`turboattn` prints as one line, `turboattn: error: <message>`, also exit 2.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

# Results of `turboattn eval` and `turboattn bench` go here unless --out says otherwise (.gitignore lists it):
# committed results under benchmarks/ are replaced only on request.
RUNS_DIR = Path("runs")
# The head dims the table of `turboattn info` lists and the synthetic demo offers: the common ones (the kernels
# serve every head dim of the format, format/rotation.SUPPORTED_HEAD_DIMS).
COMMON_HEAD_DIMS = (64, 128, 256, 512)


class CLIError(Exception):
    """A user-facing error: `turboattn` prints `turboattn: error: <message>` and exits with status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: `turboattn demo: error: argument --preset: ... (--help ...)`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default, when it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is False or default is argparse.SUPPRESS
                or not action.option_strings):
            return text
        if isinstance(default, list):
            if not default:
                return text
            default = ",".join(_spell(x) for x in default)
        shown = _spell(default).replace("%", "%%")   # help strings are %-formatted
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def _spell(x) -> str:
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(b, int) for b in x):
        return f"k{x[0]}v{x[1]}"   # a parsed preset
    return str(x)


def _items(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
    return items


def _int_at_least(text: str, low: int) -> int | None:
    """int(text) when it is an int >= low, else None (the callers word the error)."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= low else None


def positive_ints(text: str) -> list[int]:
    """"32,64" -> [32, 64]; every item a positive int."""
    out = []
    for item in _items(text):
        value = _int_at_least(item, 1)
        if value is None:
            raise argparse.ArgumentTypeError(f"expected positive ints (e.g. 2,4,8), got {item!r} in {text!r}")
        out.append(value)
    return out


def non_negative_ints(text: str) -> list[int]:
    """"0,32,64" -> [0, 32, 64]; every item an int >= 0, no repeats kept."""
    out = []
    for item in _items(text):
        value = _int_at_least(item, 0)
        if value is None:
            raise argparse.ArgumentTypeError(f"expected ints >= 0 (e.g. 0,32,64), got {item!r} in {text!r}")
        if value not in out:
            out.append(value)
    return out


def positive_int(text: str) -> int:
    value = _int_at_least(text, 1)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int_at_least(text, 0)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def batch_by_length(text: str) -> list[tuple[int, int]]:
    """"1x32768,8x16384" -> [(1, 32768), (8, 16384)]: positive BATCHxLENGTH pairs."""
    out = []
    for item in _items(text):
        parts = item.lower().split("x")
        pair = [_int_at_least(x, 1) for x in parts] if len(parts) == 2 else [None]
        if None in pair:
            raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT items (e.g. 1x32768,8x16384), got {item!r}")
        out.append(tuple(pair))
    return out


def choices(*allowed: str, extra: tuple[str, ...] = ()):
    """A type for a comma list of names from `allowed`; an item of `extra` (e.g. "all") stands alone."""
    def parse(text: str) -> list[str]:
        out = _items(text)
        for item in out:
            if item in extra:
                if len(out) > 1:
                    raise argparse.ArgumentTypeError(f"{item!r} stands alone, got {text!r}")
                return out
            if item not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(allowed + extra)}")
        return out
    return parse


def parse_bits(item: str) -> tuple[int, int]:
    """"k4v4" -> (4, 4), bit widths the codec supports; ArgumentTypeError otherwise."""
    from ..format.codec import SUPPORTED_BITS
    try:
        kb, vb = (int(x) for x in item.lower().removeprefix("k").split("v"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"presets look like k4v4, got {item!r}") from None
    if kb not in SUPPORTED_BITS or vb not in SUPPORTED_BITS:
        raise argparse.ArgumentTypeError(f"bits of {item!r} must be in {SUPPORTED_BITS}")
    return kb, vb


def presets(text: str) -> list[tuple[int, int]]:
    """"k4v4,k8v8" -> [(4, 4), (8, 8)]."""
    return [parse_bits(item) for item in _items(text)]


def preset(text: str) -> tuple[int, int]:
    """"k4v4" -> (4, 4)."""
    if "," in text:
        raise argparse.ArgumentTypeError(f"expected one preset like k4v4, got {text!r}")
    return presets(text)[0]


def preset_name(bits: tuple[int, int]) -> str:
    return f"k{bits[0]}v{bits[1]}"


def fresh_path(stem: str, suffix: str = "") -> Path:
    """RUNS_DIR/<stem>-<local time><suffix>, a path no earlier run has taken (a counter breaks ties)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RUNS_DIR / f"{stem}-{stamp}{suffix}"
    n = 2
    while path.exists():
        path = RUNS_DIR / f"{stem}-{stamp}-{n}{suffix}"
        n += 1
    return path


def refuse_overwrite(paths, overwrite: bool) -> None:
    """CLIError when a result file would replace an existing one and --overwrite was not given."""
    if overwrite:
        return
    taken = [str(p) for p in paths if Path(p).exists()]
    if taken:
        raise CLIError(f"{', '.join(taken)} already exist{'s' if len(taken) == 1 else ''}; pass --overwrite to "
                       "replace, or another --out (by default results go to a new file under runs/)")


def add_overwrite(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="let --out replace existing result files (committed ones under benchmarks/ included)")
