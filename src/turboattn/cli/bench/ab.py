"""`turboattn bench ab`: the decode step of this tree against another git revision, each side built and timed in its
own processes, rounds interleaved.

A kernel change is judged by a small difference (1-3%) between two builds on one GPU, and the GPU's speed drifts
between runs, so both builds are timed in the same run, alternating.  Each side is a whole tree (this one, and
`git archive REV src` of the other, kept under ~/.cache/turboattn/ab/<commit>), with its own
TORCH_EXTENSIONS_DIR so that torch keeps both builds; each round runs each side in a fresh process (two builds of
the extension loaded in one process crashed at D = 512).  The sides see the same seeded caches and queries, and their
outputs are compared (a kernel change that is meant to keep the numbers shows a difference at rounding level).
Where no .git travels (a GPU machine given a copy of the working tree), --against also takes a folder holding the
other tree, e.g. `git archive REV src | tar -x -C runs/base` made beforehand.
The timing is a CUDA graph of 10 calls cycling through caches that span twice the L2 (ab_side.py), as
`turboattn bench decode` times.

  turboattn bench ab --against HEAD~1 --shapes 1,32,8,128,32768 8,32,8,128,32768 --bits k4v4 --rounds 2
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .args import add_cache_options, add_out, positive_int, presets, shape
from .common import environment, print_table, require_cuda, write_results
from .decode import SHAPES

SIDE_SCRIPT = Path(__file__).with_name("ab_side.py")
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "turboattn" / "ab"


def add_arguments(parser) -> None:
    parser.add_argument("--against", required=True, metavar="REV",
                        help="what to compare this tree with: a git revision (a commit, tag or branch), or a folder "
                             "holding another tree's src/ (e.g. `git archive REV src` extracted where no .git "
                             "travels)")
    parser.add_argument("--shapes", nargs="+", type=shape, default=SHAPES, metavar="B,Hq,Hkv,D,L",
                        help="decode shapes (default: the six of `bench decode`)")
    parser.add_argument("--bits", type=presets, default=presets("k4v4"), help="comma list (default k4v4)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="times each side runs, alternating")
    add_cache_options(parser)
    add_out(parser)


def cache_arguments(args) -> list[str]:
    """ab_side.py's cache options for `args` (none when every one is at its default, so older trees' sides run)."""
    out = []
    if args.scale_dtype != "float32":
        out += ["--scale-dtype", args.scale_dtype]
    if args.exact_first:
        out += ["--exact-first", str(args.exact_first)]
    if args.exact_recent:
        out += ["--exact-recent", str(args.exact_recent)]
    return out


@dataclass(frozen=True)
class Side:
    name: str
    src: Path            # put first on sys.path: the package's tree
    extensions: Path | None   # TORCH_EXTENSIONS_DIR (None: torch's default, this tree's usual build)


def repo_root() -> Path:
    """The git checkout this package runs from (a clear error outside one)."""
    here = Path(__file__).resolve().parent
    result = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit("turboattn bench ab compares git revisions: run it from a git checkout of turboattn")
    return Path(result.stdout.strip())


def resolve(root: Path, rev: str) -> str:
    """The full commit id of `rev` (checked before any GPU time is spent)."""
    result = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"turboattn bench ab: {rev!r} is not a commit of {root}")
    return result.stdout.strip()


def archived_side(root: Path, commit: str, cache_dir: Path = CACHE_DIR) -> Side:
    """The tree of `commit` (its src/), extracted once into cache_dir/<commit>, with its own extension builds."""
    base = cache_dir / commit
    src = base / "src"
    if not (src / "turboattn" / "__init__.py").exists():
        base.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=base) as tmp:   # extract, then move: no half tree is ever used
            archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", commit, "src"],
                                     capture_output=True, check=True).stdout
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(tmp, filter="data")
            (Path(tmp) / "src").rename(src)
    return Side(commit[:10], src, base / "torch_extensions")


def other_side(against: str) -> tuple[Side, str | None]:
    """The side to compare with, and its commit: a folder holding a tree (its src/, or the package's parent), or
    a git revision of this checkout (checked before any GPU time is spent)."""
    folder = Path(against)
    if folder.is_dir():
        src = folder / "src" if (folder / "src" / "turboattn").is_dir() else folder
        if not (src / "turboattn" / "__init__.py").is_file():
            raise SystemExit(f"turboattn bench ab: {against!r} holds no turboattn tree (src/turboattn/__init__.py)")
        return Side(folder.resolve().name, src.resolve(), (folder / "torch_extensions").resolve()), None
    root = repo_root()
    commit = resolve(root, against)
    return archived_side(root, commit), commit


def this_side() -> Side:
    return Side("this tree", Path(__file__).resolve().parents[3], None)


def side_env(side: Side) -> dict[str, str]:
    path = [str(side.src)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    if side.extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(side.extensions)
    return env


def run_side(side: Side, args: list[str]) -> list[dict]:
    """Run ab_side.py for `side`; its JSON lines (SystemExit with the output's tail if it fails)."""
    result = subprocess.run([sys.executable, str(SIDE_SCRIPT), *args], env=side_env(side), capture_output=True,
                            text=True)
    if result.returncode:
        tail = (result.stdout + result.stderr)[-3000:]
        raise SystemExit(f"turboattn bench ab: the side {side.name!r} failed (exit {result.returncode}):\n{tail}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def build_sides(sides: list[Side]) -> None:
    """Build (or load) both sides' kernels at once: nvcc runs for both in parallel."""
    procs = [(side, subprocess.Popen([sys.executable, str(SIDE_SCRIPT), "--build-only"], env=side_env(side),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for side in sides]
    for side, proc in procs:
        out = proc.communicate()[0]
        if proc.returncode:
            raise SystemExit(f"turboattn bench ab: building {side.name!r} failed:\n{out[-3000:]}")


def relative_difference(a, b) -> float:
    """max |a - b| / max |b| (0 when b is all zeros and a equals it)."""
    scale = float(b.abs().max())
    diff = float((a - b).abs().max())
    return diff / scale if scale else diff


def summarize(records: list[dict], names: list[str]) -> list[dict]:
    """One row per (shape, bits): each side's times by round, and the first side's best over the second's (below 1:
    the first is faster)."""
    rows = {}
    for r in records:
        row = rows.setdefault((r["shape"], r["bits"]), {"shape": r["shape"], "bits": r["bits"],
                                                          **{name: [] for name in names}})
        row[r["side"]].append(r["us"])
    for row in rows.values():
        best = [min(row[name]) for name in names]
        row["ratio"] = best[0] / best[1]
    return list(rows.values())


def run(args) -> int:
    other, commit = other_side(args.against)
    require_cuda()
    sides = [this_side(), other]
    names = [side.name for side in sides]
    build_sides(sides)
    shapes = [",".join(str(x) for x in s) for s in args.shapes]
    bits = [f"{k},{v}" for k, v in args.bits]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        outputs = [Path(tmp) / f"side{i}.pt" for i in range(len(sides))]
        for rnd in range(args.rounds):
            for side, out in zip(sides, outputs):
                for line in run_side(side, ["--shapes", *shapes, "--bits", *bits, "--outputs", str(out),
                                            *cache_arguments(args)]):
                    records.append({**line, "side": side.name, "round": rnd})
        import torch
        first, second = (torch.load(p) for p in outputs)
        differences = {key: relative_difference(first[key], second[key]) for key in first}
    rows = summarize(records, names)
    for row in rows:
        row["rel_difference"] = differences[f"{row['shape']}/{row['bits']}"]
    env = environment()
    cols = ["shape", "bits", *(f"{n} µs" for n in names), f"{names[0]} / {names[1]}", "output difference"]
    table = [[row["shape"], "k{}v{}".format(*row["bits"].split(",")),
              *(", ".join(f"{t:.1f}" for t in row[n]) for n in names), f"{row['ratio']:.3f}",
              f"{row['rel_difference']:.1e}"] for row in rows]
    against = args.against if commit is None else f"{args.against} ({commit[:10]})"
    print_table(f"decode, this tree vs {against}, {env['gpu']}, graph-replayed µs by round", cols, table)
    write_results(args.out, "ab", {"env": env, "against": args.against, "commit": commit, "sides": names,
                                   "rows": rows, "records": records})
    return 0
