"""`turboattn bench prefill`: dense flash attention (ta.flash_attention) vs torch SDPA, same inputs.

Three parts (or, with --configs / --decode-configs, a sweep of the kernels' block
configurations instead: prefill_configs.py):
  * causal prefill, bf16, D in {64, 128, 256, 512}, L = 1K..8K (16K tokens per
    batch): TFLOP/s of the path `ta.flash_attention` takes (column `path`), of
    the Triton kernel forced, and of SDPA;
  * sliding-window sweep at L = 16384: time should follow the visible
    (query, key) pairs, not L^2;
  * dense decode (Lq = 1) over long contexts, D = 512, 16 query / 2 KV heads:
    time and bandwidth (bytes of K and V over copy bandwidth).
FLOPs count only visible pairs: 4 * D per (query, key) pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import flash_attention
from .args import add_out
from .common import (copy_bandwidth_tbs, environment, plot_lines, print_table, require_cuda, time_us,
                     time_us_graph, write_results)

PREFILL_DIMS = (64, 128, 256, 512)
PREFILL_LENGTHS = (1024, 2048, 4096, 8192)
TOKENS = 16384  # batch * length for the prefill table
HEADS = 16
WINDOW_L = 16384
WINDOWS = (256, 512, 1024, 2048, 4096, 8192, None)  # None: plain causal
DECODE_LENGTHS = (4096, 8192, 16384, 32768)


def add_arguments(parser) -> None:
    add_out(parser)
    parser.add_argument("--quick", action="store_true", help="fewer head dims, lengths and windows")
    from . import prefill_configs
    prefill_configs.add_arguments(parser)
    parser.epilog = prefill_configs.__doc__


def visible_pairs(lq: int, lk: int, causal: bool, window: int | None) -> int:
    """Number of (query, key) pairs the attention computes (bottom-right causal, window)."""
    q_pos = torch.arange(lq, dtype=torch.int64) + (lk - lq)
    hi = torch.clamp(q_pos + 1, 0, lk) if causal else torch.full_like(q_pos, lk)
    lo = torch.clamp(q_pos - window + 1, 0, lk) if window is not None else torch.zeros_like(q_pos)
    return int(torch.clamp(hi - lo, min=0).sum())


def _qkv(b, hq, hkv, lq, lk, d, dtype=torch.bfloat16):
    q = torch.randn(b, hq, lq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype)
    return q, k, v


def _triton(q, k, v, **kw):
    from ...ops.flash.triton import flash_attention_triton
    return flash_attention_triton(q, k, v, allow_sdpa=False, **kw)


def measure_prefill(d: int, length: int, heads: int = HEADS, tokens: int = TOKENS, rep_ms: float = 300) -> dict:
    from ...ops.flash.triton import flash_path
    b = max(1, tokens // length)
    q, k, v = _qkv(b, heads, heads, length, length, d)
    flops = 4 * d * b * heads * visible_pairs(length, length, True, None)
    path = flash_path(q, k, causal=True)
    auto_us = time_us(lambda: flash_attention(q, k, v, causal=True), rep_ms=rep_ms)
    triton_us = auto_us if path != "sdpa" else time_us(lambda: _triton(q, k, v, causal=True), rep_ms=rep_ms)
    sdpa_us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), rep_ms=rep_ms)
    del q, k, v
    torch.cuda.empty_cache()
    return {"D": d, "L": length, "B": b, "H": heads, "path": path,
            "auto_us": auto_us, "auto_tflops": flops / auto_us / 1e6,
            "triton_us": triton_us, "triton_tflops": flops / triton_us / 1e6,
            "sdpa_us": sdpa_us, "sdpa_tflops": flops / sdpa_us / 1e6, "speedup": sdpa_us / auto_us}


def measure_window(d: int, window: int | None, length: int = WINDOW_L, heads: int = HEADS,
                   with_sdpa: bool = False, rep_ms: float = 200) -> dict:
    q, k, v = _qkv(1, heads, heads, length, length, d)
    pairs = visible_pairs(length, length, True, window)
    us = time_us(lambda: flash_attention(q, k, v, causal=True, sliding_window=window), rep_ms=rep_ms)
    row = {"D": d, "L": length, "window": window or length, "visible_frac": pairs / (length * length),
           "us": us, "tflops": 4 * d * heads * pairs / us / 1e6, "ns_per_kpair": us * 1e3 / (heads * pairs / 1e3)}
    if with_sdpa and window is not None:
        pos = torch.arange(length, device="cuda")
        diff = pos[:, None] - pos[None, :]
        keep = (diff >= 0) & (diff < window)
        row["sdpa_mask_us"] = time_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep), rep_ms=rep_ms)
        del keep
    del q, k, v
    torch.cuda.empty_cache()
    return row


def measure_decode(length: int, d: int = 512, hq: int = 16, hkv: int = 2, b: int = 1,
                   copy_tbs: float | None = None, rep_ms: float = 200, config: dict | None = None) -> dict:
    """Dense decode (Lq = 1), eager and CUDA-graph time; `config` forces the Triton decode kernel with it."""
    from ...ops.flash.triton import flash_path
    q, k, v = _qkv(b, hq, hkv, 1, length, d)
    if config is None:
        path = flash_path(q, k)

        def fn():
            return flash_attention(q, k, v, causal=True)
    else:
        path = "decode"

        def fn():
            return _triton(q, k, v, causal=True, config=config, path="decode")
    ours_us = time_us(fn, rep_ms=rep_ms)
    try:
        graph_us = time_us_graph(fn, rep_ms=rep_ms)
    except Exception:  # capture unsupported here: report eager time only
        graph_us = None
    sdpa_us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rep_ms=rep_ms)
    nbytes = 2 * k.numel() * k.element_size()
    del q, k, v
    torch.cuda.empty_cache()
    kernel_us = graph_us or ours_us
    row = {"B": b, "Hq": hq, "Hkv": hkv, "D": d, "L": length, "path": path, "ours_us": ours_us,
           "ours_graph_us": graph_us, "sdpa_us": sdpa_us, "speedup": sdpa_us / ours_us,
           "ours_tbs": nbytes / kernel_us / 1e6}
    if copy_tbs:
        row["ours_frac_copy"] = row["ours_tbs"] / copy_tbs
    return row


def run(args) -> int:
    require_cuda()
    if getattr(args, "configs", None) or getattr(args, "decode_configs", None):
        from .prefill_configs import run_sweep
        return run_sweep(args)
    out_dir = getattr(args, "out", "benchmarks")
    quick = getattr(args, "quick", False)
    copy_tbs = copy_bandwidth_tbs()
    dims = (128, 512) if quick else PREFILL_DIMS
    lengths = (2048, 8192) if quick else PREFILL_LENGTHS

    prefill = [measure_prefill(d, n) for d in dims for n in lengths]
    print_table("causal prefill, bf16, 16 heads, 16K tokens per batch (TFLOP/s over visible pairs)",
                ["D", "L", "B", "path", "turboattn TFLOP/s", "triton kernel TFLOP/s", "SDPA TFLOP/s", "speedup"],
                [[r["D"], r["L"], r["B"], r["path"], r["auto_tflops"], r["triton_tflops"], r["sdpa_tflops"],
                  r["speedup"]] for r in prefill])

    windows = (1024, 4096, None) if quick else WINDOWS
    window_rows = [measure_window(128, w, with_sdpa=(w == 1024)) for w in windows]
    window_rows += [measure_window(512, w) for w in ((1024, None) if quick else (1024, 4096, None))]
    print_table(f"sliding window, causal, L={WINDOW_L}, bf16, 16 heads: time follows the visible pairs",
                ["D", "window", "visible", "µs", "TFLOP/s", "ns per 1K pairs", "SDPA+mask µs"],
                [[r["D"], r["window"], f"{r['visible_frac']:.3f}", r["us"], r["tflops"], r["ns_per_kpair"],
                  r.get("sdpa_mask_us", "")] for r in window_rows])

    decode_lengths = (32768,) if quick else DECODE_LENGTHS
    decode = [measure_decode(n, copy_tbs=copy_tbs) for n in decode_lengths]
    print_table("dense decode, Lq=1, D=512, 16 q / 2 KV heads, bf16 (TB/s from the CUDA-graph time)",
                ["L", "path", "turboattn µs", "in CUDA graph µs", "SDPA µs", "speedup", "TB/s", "of copy bw"],
                [[r["L"], r["path"], r["ours_us"], r["ours_graph_us"] or "", r["sdpa_us"], r["speedup"],
                  r["ours_tbs"], r["ours_frac_copy"]] for r in decode])

    payload = {"environment": environment(), "copy_tbs": copy_tbs, "prefill": prefill,
               "window": window_rows, "decode": decode}
    path = write_results(out_dir, "prefill", payload)
    series = {}
    for d in dims:
        rows = [r for r in prefill if r["D"] == d]
        series[f"turboattn D={d}"] = ([r["L"] for r in rows], [r["auto_tflops"] for r in rows])
        series[f"SDPA D={d}"] = ([r["L"] for r in rows], [r["sdpa_tflops"] for r in rows])
    png = plot_lines(out_dir, "prefill", series, "sequence length", "TFLOP/s (visible pairs)",
                     "causal prefill, bf16", logx=True)
    wrows = [r for r in window_rows if r["D"] == 128]
    plot_lines(out_dir, "prefill_window", {"turboattn D=128": ([r["window"] for r in wrows], [r["us"] for r in wrows])},
               "window (tokens)", "µs", f"sliding window, L={WINDOW_L}", logx=True)
    print(f"wrote {path} and {png}")
    return 0
