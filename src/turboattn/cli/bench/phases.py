"""`turboattn bench phases`: where a CUDA decode call spends its time, CTA by CTA.

Runs a profiling build of the CUDA decode kernel (ops/cuda_extension.stamped_extension: nvcc -DTURBOATTN_STAMPS;
built on first use, about a minute) in which thread 0 of every CTA records the SM clock at each phase of
csrc/decode.cuh (start, loads issued, tables built, q fragments ready, main loop done, every
warp done, part written; in the merging CTA: merge started, weights ready, parts summed, end) and the global timer
at the start, when its part is written and at the end.  One eager
call per shape after warm-up; the table gives medians over CTAs of each phase (µs), the last CTA's part and the
end (µs after the first CTA started), and how many CTAs each SM ran.

  turboattn bench phases --shapes 1,32,8,128,32768 1,16,2,512,32768 --bits k4v4

With exact rows (--exact-first / --exact-recent) the grid's last CTAs attend them (the plan's exact_parts per
sequence x KV head): the phase medians are then the splits' alone, and more columns give the exact CTAs' median
time to their part, its phases (set-up, the first chunk's scores, the other rows, the output) and when the last of
them wrote its part.

Calls whose parts merge in a launch of their own (ops/cached/config.cuda_merge_apart) leave the merge columns
empty: that launch is not stamped, and "end" is the decode launch's.

The stamps cost a few instructions per phase; time the shipped build with `turboattn bench decode`.
"""

from __future__ import annotations

import statistics
from unittest import mock

import torch

from ... import KVCodec, cached_attention
from ...ops.cached import cuda as cuda_path
from ...ops.cached.config import plan_decode
from ...ops.cached.triton import part_buffers
from ...ops.cuda_extension import stamped_extension
from .args import add_cache_options, add_out, presets, shape
from .common import environment, print_table, require_cuda, write_results
from .decode import SHAPES, fill_cache

SLOTS = 16   # csrc/decode.cuh: STAMP_SLOTS
WARPS_DONE, START, STAGED, READY, LOOP_DONE, PART_DONE, MERGE, END, _UNUSED, TABLES = range(10)
G_START, G_PART, G_END, SM, MERGE_WEIGHTS, MERGE_SUMMED = range(10, 16)


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", nargs="+", type=shape, default=SHAPES, metavar="B,Hq,Hkv,D,L",
                        help="decode shapes (default: the six of `bench decode`)")
    parser.add_argument("--bits", type=presets, default=presets("k4v4"), help="comma list (default k4v4)")
    add_cache_options(parser)
    add_out(parser)


def stamped_call(q: torch.Tensor, cache) -> torch.Tensor:
    """One call of the stamped kernel: [CTAs, SLOTS] int64 (phases never reached are 0)."""
    held = {}

    def buffers(q_, hkv, parts):
        o_part, lse_part = part_buffers(q_, hkv, parts)
        ctas = q_.shape[0] * hkv * parts
        room = torch.zeros(o_part.numel() + 2 * SLOTS * ctas, dtype=torch.float32, device=q_.device)
        held["stamps"] = room[o_part.numel():].view(torch.int64).view(ctas, SLOTS)
        return room, lse_part

    with mock.patch.object(cuda_path, "extension", stamped_extension), \
            mock.patch.object(cuda_path, "part_scratch", buffers):
        cached_attention(q, cache)
    torch.cuda.synchronize()
    return held["stamps"].cpu()


def summarize(stamps: torch.Tensor, exact_ctas: int = 0) -> dict:
    """Phase times (µs) from one call's stamps: per-CTA clock intervals at the clock rate the global timer gives.
    The last `exact_ctas` CTAs attend exact rows (their own phases in some of the splits' slots): the splits'
    phases are taken over the others."""
    s = stamps.double()
    splits = torch.arange(s.shape[0]) < s.shape[0] - exact_ctas
    wall = s[:, G_END] - s[:, G_START]                     # ns
    ticks = s[:, END] - s[:, START]
    ghz = statistics.median((ticks / wall.clamp(min=1)).tolist())
    us = lambda cycles: cycles / ghz / 1e3                  # noqa: E731
    t0 = s[:, G_START].min()
    merging = s[:, MERGE] > 0

    def med(a, b, rows=splits):
        x = us(s[rows, b] - s[rows, a])
        return statistics.median(x.tolist()) if x.numel() else 0.0
    per_sm = torch.bincount(stamps[:, SM].long())
    per_sm = per_sm[per_sm > 0]
    return {
        "ctas": stamps.shape[0], "sm_clock_ghz": ghz,
        "ctas_per_sm": {"min": int(per_sm.min()), "max": int(per_sm.max())},
        "start_spread_us": float((s[:, G_START].max() - t0) / 1e3),
        "staged_us": med(START, STAGED), "tables_us": med(STAGED, TABLES), "q_us": med(TABLES, READY),
        "loop_us": med(READY, LOOP_DONE), "loop_max_us": float(us(s[splits, LOOP_DONE] - s[splits, READY]).max()),
        "warps_us": med(LOOP_DONE, WARPS_DONE), "combine_us": med(WARPS_DONE, PART_DONE),
        "parts_median_us": float((s[splits, G_PART].median() - t0) / 1e3),
        "parts_last_us": float((s[:, G_PART].max() - t0) / 1e3),
        "merge_us": med(MERGE, END, merging), "arrive_us": med(PART_DONE, MERGE, merging),
        "merge_weights_us": med(MERGE, MERGE_WEIGHTS, merging),
        "merge_sum_us": med(MERGE_WEIGHTS, MERGE_SUMMED, merging), "merge_out_us": med(MERGE_SUMMED, END, merging),
        "end_us": float((s[:, G_END].max() - t0) / 1e3),
        "exact_ctas": exact_ctas,
        "exact_us": med(START, PART_DONE, ~splits),
        # The exact CTAs' own phases (csrc/decode.cuh reuses the split slots): set-up, the first chunk's scores,
        # the rest of the rows (softmax, P V, later chunks), the output's rotation and store.
        "exact_setup_us": med(START, STAGED, ~splits), "exact_scores_us": med(STAGED, TABLES, ~splits),
        "exact_rows_us": med(TABLES, READY, ~splits), "exact_out_us": med(READY, PART_DONE, ~splits),
        "exact_last_us": float((s[~splits, G_PART].max() - t0) / 1e3) if exact_ctas else 0.0,
    }


def run(args) -> int:
    device = require_cuda()
    results = []
    for bits in args.bits:
        for b, hq, hkv, d, length in args.shapes:
            codec = KVCodec(d, *bits, scale_dtype=getattr(torch, args.scale_dtype))
            cache = fill_cache(codec, b, hkv, length, device, exact_first=args.exact_first,
                               exact_recent=args.exact_recent)
            plan = plan_decode(device, d, *bits, b * hkv, hq // hkv, length, kernel="cuda",
                               exact_rows=args.exact_first + args.exact_recent)
            exact_ctas = b * hkv * (plan.exact_parts or 0)
            q = torch.randn(b, hq, 1, d, device=device, dtype=torch.bfloat16)
            for _ in range(3):
                stamped_call(q, cache)   # build, warm up
            row = {"B": b, "Hq": hq, "Hkv": hkv, "D": d, "L": length, "k_bits": bits[0], "v_bits": bits[1],
                   "exact_first": args.exact_first, "exact_recent": args.exact_recent,
                   "scale_dtype": args.scale_dtype, **summarize(stamped_call(q, cache), exact_ctas)}
            results.append(row)
            del cache
            torch.cuda.empty_cache()
    cols = ["B", "Hq", "Hkv", "D", "L", "bits", "CTAs", "per SM", "start spread", "staged", "tables", "q", "loop",
            "loop max", "warps", "combine", "parts median", "parts last", "arrive", "merge",
            "weights", "sum", "out", "end"]
    rows = [[r["B"], r["Hq"], r["Hkv"], r["D"], r["L"], f"k{r['k_bits']}v{r['v_bits']}", r["ctas"],
             f"{r['ctas_per_sm']['min']}-{r['ctas_per_sm']['max']}", r["start_spread_us"], r["staged_us"],
             r["tables_us"], r["q_us"], r["loop_us"], r["loop_max_us"], r["warps_us"], r["combine_us"],
             r["parts_median_us"], r["parts_last_us"], r["arrive_us"], r["merge_us"],
             r["merge_weights_us"], r["merge_sum_us"], r["merge_out_us"], r["end_us"]] for r in results]
    if any(r["exact_ctas"] for r in results):   # the exact rows' CTAs: median time to their part, and the last one
        cols += ["exact", "exact: set-up", "scores", "rows", "out", "exact last"]
        for row, r in zip(rows, results):
            row += ([r[k] for k in ("exact_us", "exact_setup_us", "exact_scores_us", "exact_rows_us", "exact_out_us",
                                    "exact_last_us")] if r["exact_ctas"] else [""] * 6)
    env = environment()
    print_table(f"CUDA decode phases (µs; medians over CTAs unless 'last' / 'max'), {env['gpu']}", cols, rows)
    write_results(args.out, "phases", {"env": env, "shapes": results})
    return 0
