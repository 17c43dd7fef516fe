"""`turboattn bench decode-sweep`: the compressed-cache decode kernel under explicit launch plans.

Each variant is one combination of the swept values; it starts from the
library's own plan for the shape (ops/cached/config.py: plan_decode, which
also picks the split count from --programs-per-sm or takes --num-splits) and
replaces the swept fields, so a field left unswept keeps its default.  Every
variant runs `cached_attention(q, cache, plan=plan)` for one query token as a
CUDA-graph replay; one that does not compile or fit is reported and skipped.
torch SDPA on bf16 K/V of the same shape is timed once per shape.  Results:
a table, and OUT/decode_sweep.json.

  turboattn bench decode-sweep --block-n 32,64 --warps 4 --stages 2,3 \\
      --programs-per-sm 2,4,8 --lookup lut,gather --shapes 8,32,8,128,32768 1,32,8,128,32768

--lookup only matters where K or V has 4 bits (the register LUT decodes 4-bit codes), so other
presets run each variant once, with the plan's own lookup.
"""

from __future__ import annotations

import itertools

import torch

from ... import KVCodec, cached_attention
from .args import add_out, choices, positive_ints, powers_of_two, presets, shape
from .common import copy_bandwidth_tbs, environment, print_table, require_cuda, time_us_graph, write_results
from .decode import dense_decode_us, fill_cache

DEFAULT_SHAPES = [(8, 32, 8, 128, 32768), (1, 32, 8, 128, 32768)]
LOOKUPS = ("lut", "gather")
SWEPT = ("block_n", "num_warps", "num_stages", "lookup")   # DecodePlan fields replaced by the sweep


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", nargs="+", type=shape, default=DEFAULT_SHAPES, metavar="B,Hq,Hkv,D,L",
                        help="decode shapes (default: 8,32,8,128,32768 1,32,8,128,32768)")
    parser.add_argument("--presets", type=presets, default=[(4, 4), (8, 8)], help="comma list (default k4v4,k8v8)")
    parser.add_argument("--block-n", type=powers_of_two, help="keys per tile, e.g. 32,64 (default: the plan's)")
    parser.add_argument("--warps", type=powers_of_two, help="num_warps values, e.g. 4,8 (default: the plan's)")
    parser.add_argument("--stages", type=positive_ints, help="num_stages values, e.g. 2,3 (default: the plan's)")
    parser.add_argument("--lookup", type=choices(*LOOKUPS), help="lut and/or gather (default: the plan's)")
    splits = parser.add_mutually_exclusive_group()
    splits.add_argument("--programs-per-sm", type=positive_ints,
                        help="split-count targets, e.g. 2,4,8 (default: the library's)")
    splits.add_argument("--num-splits", type=positive_ints, help="fixed split counts instead, e.g. 16,64")
    add_out(parser)


def variants(args, bits: tuple[int, int]) -> list[dict]:
    """Every combination of the swept values for one preset; None keeps the plan's own value."""
    lookups = (args.lookup or [None]) if 4 in bits else [None]
    split_key, split_values = (("num_splits", args.num_splits) if args.num_splits
                               else ("programs_per_sm", args.programs_per_sm or [None]))
    out = []
    for block_n, warps, stages, lookup, split in itertools.product(
            args.block_n or [None], args.warps or [None], args.stages or [None], lookups, split_values):
        out.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "lookup": lookup,
                    split_key: split})
    return out


def make_plan(device, shape_, bits, variant: dict):
    """plan_decode's plan for the shape, with the variant's fields replaced."""
    from dataclasses import replace

    from ...ops.cached.config import plan_decode
    b, hq, hkv, d, length = shape_
    plan = plan_decode(device, d, bits[0], bits[1], b * hkv, hq // hkv, length,
                       num_splits=variant.get("num_splits"), programs_per_sm=variant.get("programs_per_sm"))
    return replace(plan, **{k: variant[k] for k in SWEPT if variant[k] is not None})


def run(args) -> int:
    from dataclasses import asdict
    device = require_cuda()
    copy_tbs = copy_bandwidth_tbs()
    rows = []
    for shape_ in args.shapes:
        b, hq, hkv, d, length = shape_
        q = torch.randn(b, hq, 1, d, device=device, dtype=torch.bfloat16)
        sdpa_us, _, _ = dense_decode_us(q, hkv, length, with_ours=False)
        for bits in args.presets:
            codec = KVCodec(d, *bits)
            cache = fill_cache(codec, b, hkv, length, device)
            nbytes = b * hkv * length * codec.bytes_per_token()
            for variant in variants(args, bits):
                row = {"B": b, "Hq": hq, "Hkv": hkv, "D": d, "L": length, "k_bits": bits[0], "v_bits": bits[1],
                       "sdpa_us": sdpa_us, "programs_per_sm": variant.get("programs_per_sm")}
                try:
                    plan = make_plan(device, shape_, bits, variant)
                    row.update(asdict(plan))
                    row["us"] = time_us_graph(lambda: cached_attention(q, cache, plan=plan))
                    row["frac_copy"] = nbytes / row["us"] / 1e6 / copy_tbs
                    row["speedup"] = sdpa_us / row["us"]
                except Exception as e:  # a variant may not compile or not fit: report it, go on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
            cache = None   # freed before the next preset's cache is filled
            torch.cuda.empty_cache()
    env = environment()
    cols = ["B", "Hq", "Hkv", "D", "L", "bits", "block_m", "block_n", "warps", "stages", "splits", "lookup",
            "µs", "of copy", "vs SDPA"]
    print_table(f"decode plans, {env['gpu']}, copy {copy_tbs:.2f} TB/s (CUDA-graph time)", cols,
                [[r["B"], r["Hq"], r["Hkv"], r["D"], r["L"], f"k{r['k_bits']}v{r['v_bits']}",
                  *[r.get(k, "") for k in ("block_m", "block_n", "num_warps", "num_stages", "num_splits", "lookup")],
                  *((r["us"], f"{100 * r['frac_copy']:.0f}%", f"{r['speedup']:.2f}x") if "us" in r
                    else (r["error"][:60], "", ""))] for r in rows])
    path = write_results(args.out, "decode_sweep", {"env": env, "copy_tbs": copy_tbs, "rows": rows})
    print(f"wrote {path}")
    return 0
