"""`turboattn bench prefill --configs ... --decode-configs ...`: time block configurations of the dense kernels.

A configuration is named by what it sets, e.g. m64n64w8s1tma, m64n32w8s2tma_ws, n32w4s3sp132:
  m<BLOCK_M> n<BLOCK_N> w<num_warps> s<num_stages>   (prefill: all four; decode: no m)
  tma      tensor-descriptor loads (prefill; without it, pointer loads)
  ws       Triton warp specialization (prefill)
  cta<N>   num_ctas, a CTA cluster (prefill)
  sp<N>    split count (decode)
'_' and '-' between parts are ignored.  `candidates` stands for the lists
measured for BENCHMARKS.md (per head dim for prefill).  The prefill sweep runs
causal bf16 attention at every --dims x --lengths (16K tokens per batch), SDPA
and the default configuration included; the decode sweep runs Lq = 1 at
D = 512, 16 query / 2 KV heads, at every --decode-lengths, eager and
CUDA-graph time.  A configuration that does not compile or fit is reported and
skipped.  Results: tables, and OUT/prefill_configs.json.
"""

from __future__ import annotations

import argparse
import re

import torch
import torch.nn.functional as F

from .args import positive_int, positive_ints, powers_of_two
from .common import environment, print_table, require_cuda, time_us, write_results

# Each compiles with Triton 3.6 on an H100/H200 (tests/gpu/test_flash_gpu.py checks every one; those over
# the shared memory limit are reported as such).  A 2-CTA cluster, m128n64w8s1tma_cta2, does not compile
# there (an assertion in Triton's PlanCTA pass): name it in --configs to try it on a newer Triton.
PREFILL_CANDIDATES = {
    512: "m64n64w8s1tma,m64n64w16s1tma,m64n64w8s2tma,m64n32w8s3tma,m64n64w8s2tma_ws,m64n32w8s2tma_ws,"
         "m64n128w8s1tma,m64n32w8s2tma,m64n32w8s2,m64n64w4s1tma",
    256: "m128n64w8s2tma,m128n128w8s1tma,m128n64w8s2tma_ws",
    128: "m128n64w8s3tma,m128n128w8s2tma,m128n64w8s3tma_ws",
    64: "m128n64w4s3tma,m128n128w8s3tma",
}
DECODE_CANDIDATES = "n16w4s4,n16w4s3,n32w4s3,n32w4s2,n16w4s2sp198,n16w4s3sp264,n16w4s4sp256,n32w4s3sp132"
_PART = re.compile(r"(cta|sp|m|n|w|s)(\d+)|(tma|ws)|[-_]")
_KEYS = {"m": "BLOCK_M", "n": "BLOCK_N", "w": "num_warps", "s": "num_stages", "cta": "num_ctas", "sp": "splits"}


def parse_config(name: str, kind: str) -> dict:
    """A configuration name -> the kernel's config dict; kind "prefill" or "decode"."""
    cfg, pos = {}, 0
    while pos < len(name):
        m = _PART.match(name, pos)
        if m is None:
            raise ValueError(f"config {name!r}: cannot read {name[pos:]!r} (parts: m, n, w, s + number; "
                             "tma, ws, cta<N>, sp<N>)")
        if m.group(1):
            cfg[_KEYS[m.group(1)]] = int(m.group(2))
        elif m.group(3):
            cfg["tma" if m.group(3) == "tma" else "warp_specialize"] = True
        pos = m.end()
    need = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages") if kind == "prefill" else ("BLOCK_N", "num_warps",
                                                                                        "num_stages")
    allowed = set(need) | ({"tma", "warp_specialize", "num_ctas"} if kind == "prefill" else {"splits"})
    if missing := [k for k in need if k not in cfg]:
        raise ValueError(f"{kind} config {name!r} lacks {', '.join(missing)}")
    if extra := sorted(set(cfg) - allowed):
        raise ValueError(f"{kind} config {name!r}: {', '.join(extra)} does not apply to the {kind} kernel")
    for key in ("BLOCK_M", "BLOCK_N", "num_warps"):
        if key in cfg and (cfg[key] < 1 or cfg[key] & (cfg[key] - 1)):
            raise ValueError(f"config {name!r}: {key}={cfg[key]} must be a power of two")
    if kind == "prefill":
        cfg.setdefault("tma", False)  # explicit, or the default config's TMA setting would apply
    return cfg


def _config_list(kind: str):
    def parse(text: str):
        if text == "candidates":
            return "candidates"
        try:
            return [(n, parse_config(n, kind)) for n in (x.strip() for x in text.split(",")) if n]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def add_arguments(parser) -> None:
    parser.add_argument("--configs", type=_config_list("prefill"), metavar="NAMES",
                        help="sweep prefill block configs: comma list of names, or 'candidates'")
    parser.add_argument("--decode-configs", type=_config_list("decode"), metavar="NAMES",
                        help="sweep dense-decode block configs: comma list of names, or 'candidates'")
    parser.add_argument("--dims", type=powers_of_two, default=[512, 256, 128, 64], help="prefill sweep head dims")
    parser.add_argument("--lengths", type=positive_ints, default=[4096, 8192], help="prefill sweep lengths")
    parser.add_argument("--heads", type=positive_int, default=16, help="query heads of the prefill sweep")
    parser.add_argument("--kv-heads", type=positive_int, default=None, help="its KV heads (default: --heads)")
    parser.add_argument("--decode-lengths", type=positive_ints, default=[4096, 32768], help="decode sweep keys")


def _prefill_configs(spec, d: int) -> list[tuple[str, dict]]:
    if spec == "candidates":
        return [(n, parse_config(n, "prefill")) for n in PREFILL_CANDIDATES.get(d, "").split(",") if n]
    return spec


def sweep_prefill(args) -> list[dict]:
    from .prefill import TOKENS, _qkv, _triton, visible_pairs
    hq, hkv = args.heads, args.kv_heads or args.heads
    if hq % hkv:
        raise SystemExit(f"--heads {hq} must be a multiple of --kv-heads {hkv}")
    rows = []
    for d in args.dims:
        for n in args.lengths:
            b = max(1, TOKENS // n)
            q, k, v = _qkv(b, hq, hkv, n, n, d)
            flops = 4 * d * b * hq * visible_pairs(n, n, True, None)
            sdpa_us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv))
            for name, cfg in [("sdpa", None), ("default", {})] + _prefill_configs(args.configs, d):
                row = {"D": d, "L": n, "B": b, "Hq": hq, "Hkv": hkv, "config": name}
                try:
                    us = sdpa_us if cfg is None else time_us(
                        lambda: _triton(q, k, v, causal=True, config=cfg, path="prefill"))
                    row.update(us=us, tflops=flops / us / 1e6, x_sdpa=sdpa_us / us)
                except Exception as e:  # does not compile or does not fit: report, go on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
            q = k = v = None
            torch.cuda.empty_cache()
    return rows


def sweep_decode(args) -> list[dict]:
    from .prefill import measure_decode
    spec = args.decode_configs
    configs = [(n, parse_config(n, "decode")) for n in DECODE_CANDIDATES.split(",")] if spec == "candidates" else spec
    rows = []
    for n in args.decode_lengths:
        for name, cfg in [("default", None)] + configs:
            try:
                rows.append({"config": name} | measure_decode(n, config=cfg))
            except Exception as e:  # does not compile or does not fit: report, go on
                rows.append({"config": name, "L": n, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def run_sweep(args) -> int:
    require_cuda()
    prefill = sweep_prefill(args) if args.configs else []
    decode = sweep_decode(args) if args.decode_configs else []
    if prefill:
        print_table("prefill block configs, causal bf16 (TFLOP/s over visible pairs)",
                    ["D", "L", "B", "Hq", "Hkv", "config", "µs", "TFLOP/s", "vs SDPA"],
                    [[r["D"], r["L"], r["B"], r["Hq"], r["Hkv"], r["config"],
                      *((r["us"], r["tflops"], f"{r['x_sdpa']:.2f}x") if "us" in r else (r["error"][:60], "", ""))]
                     for r in prefill])
    if decode:
        print_table("dense decode block configs, Lq=1, D=512, 16 q / 2 KV heads",
                    ["L", "config", "eager µs", "CUDA graph µs", "SDPA µs", "vs SDPA", "TB/s"],
                    [[r["L"], r["config"], *((r["ours_us"], r["ours_graph_us"] or "", r["sdpa_us"],
                                              f"{r['speedup']:.1f}x", r["ours_tbs"]) if "ours_us" in r
                                             else (r["error"][:60], "", "", "", ""))] for r in decode])
    path = write_results(args.out, "prefill_configs", {"environment": environment(), "prefill": prefill,
                                                       "decode": decode})
    print(f"wrote {path}")
    return 0
