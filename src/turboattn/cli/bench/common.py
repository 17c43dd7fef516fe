"""Shared benchmark plumbing: ceilings measured in the same run, timing, tables, files."""

from __future__ import annotations

import datetime
import json
import os
import platform

import torch


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("turboattn bench needs a CUDA GPU")
    return torch.device("cuda")


def time_us(fn, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median time of fn() in microseconds (CUDA events, via triton.testing.do_bench)."""
    from triton.testing import do_bench
    return 1e3 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_us_graph(fn, replays: int = 10, rep_ms: float = 300) -> float:
    """Median time of fn() captured in a CUDA graph (launch overhead excluded), in microseconds.

    The graph holds `replays` back-to-back calls, so that the replay's own
    launch cost is spread thin; returns the time per call.  fn runs once
    before the capture (compilation, warm-up), so 1 + replays times in Python.

    The warm-up runs on the current stream, not on a new stream per timing.  A process's graph replays take about
    0.4 µs more per launch after its first timings (H200: one sequence's decode 19.1 -> 19.9 µs, SDPA 38.2 -> 38.9;
    running a kernel on two more streams is one way there), and a stream per timing had put a measurement's first
    timing (ours) and its second (SDPA) in different states: one sequence read 2.04x SDPA, 1.97-2.01x in one state.
    """
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    return time_us(graph.replay, rep_ms=rep_ms) / replays


def copy_bandwidth_tbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    del src, dst
    return 2 * (nbytes // 2) / (us * 1e-6) / 1e12


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    import triton
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*[f"{x:.3g}" if isinstance(x, float) else str(x) for x in row])
    Console(width=200).print(table)


def write_results(out_dir: str, name: str, payload: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def plot_lines(out_dir: str, name: str, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str,
               title: str, logx: bool = True, hline: float | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
