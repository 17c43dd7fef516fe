"""`turboattn bench key-transform`: a decode step's cost with and without the key transform.

The key transform (format/key_transform.py) adds work inside the kernels: q
times 1/gain in the attention kernel, (k - shift) * gain in the quantize
kernel.  One decode step here is `cached_attention` with the step's fresh
K/V, then `append` of them, as a CUDA-graph replay; the cache's device
length is stepped back after each append, so every replay sees the same
length.  Runs alternate plain / fitted (--repeats pairs) so that drift
between runs shows up as a difference between repeats; the table keeps the
best of each.  Results: a table, and OUT/key_transform.json.
"""

from __future__ import annotations

import torch

import turboattn as ta

from ...format.key_transform import fit_key_transform
from .args import add_out, positive_int, preset, shape
from .common import environment, print_table, require_cuda, time_us_graph, write_results

DEFAULT_SHAPES = [(8, 32, 8, 128, 32768), (1, 32, 8, 128, 32768), (32, 32, 8, 128, 8192), (8, 32, 8, 256, 8192)]
CHUNK = 512        # tokens per append while filling (and the tokens the transform is fitted to)
HEADROOM = 64      # capacity beyond L: Python runs the step 1 + replays times around the capture


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", nargs="+", type=shape, default=DEFAULT_SHAPES, metavar="B,Hq,Hkv,D,L",
                        help="decode shapes (default: the decode benchmark's D=128 shapes and one D=256)")
    parser.add_argument("--preset", type=preset, default=(4, 4), help="a kKvV preset (default k4v4)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="plain / fitted pairs (default 2)")
    add_out(parser)


def step_us(shape_, bits, fitted: bool, device) -> float:
    """CUDA-graph time of one decode step (attention + append) on a filled cache."""
    b, hq, hkv, d, length = shape_
    torch.manual_seed(0)
    cache = ta.QuantizedKVCache(ta.KVCodec(d, *bits), b, hkv, capacity=length + HEADROOM, device=device)
    k = torch.randn(b, hkv, CHUNK, d, device=device, dtype=torch.bfloat16)
    if fitted:
        q = torch.randn(b, hq, CHUNK, d, device=device, dtype=torch.bfloat16)
        cache.set_key_transform(*fit_key_transform(q, k))
    for t0 in range(0, length, CHUNK):
        part = k[:, :, :min(CHUNK, length - t0)]
        cache.append(part, part)
    q = torch.randn(b, hq, 1, d, device=device, dtype=torch.bfloat16)
    kn = torch.randn(b, hkv, 1, d, device=device, dtype=torch.bfloat16)

    def step():
        ta.cached_attention(q, cache, kn, kn)
        cache.append(kn, kn)
        cache.seen -= 1   # on the device, so replays keep the length fixed
    return time_us_graph(step)


def run(args) -> int:
    device = require_cuda()
    bits, repeats = args.preset, args.repeats
    rows = []
    for shape_ in args.shapes:
        times = {False: [], True: []}
        for _ in range(repeats):
            for fitted in (False, True):
                times[fitted].append(step_us(shape_, bits, fitted, device))
                torch.cuda.empty_cache()
        plain, fitted = min(times[False]), min(times[True])
        rows.append({"shape": dict(zip(("B", "Hq", "Hkv", "D", "L"), shape_)), "k_bits": bits[0], "v_bits": bits[1],
                     "plain_us": plain, "fitted_us": fitted, "ratio": fitted / plain,
                     "runs_plain_us": times[False], "runs_fitted_us": times[True]})
    env = environment()
    print_table(f"decode step (attention + append), k{bits[0]}v{bits[1]}, {env['gpu']}, CUDA-graph time",
                ["B", "Hq", "Hkv", "D", "L", "no transform µs", "key transform µs", "ratio", "all runs (plain; fitted)"],
                [[*r["shape"].values(), r["plain_us"], r["fitted_us"], f"{r['ratio']:.3f}",
                  ", ".join(f"{t:.1f}" for t in r["runs_plain_us"]) + "; "
                  + ", ".join(f"{t:.1f}" for t in r["runs_fitted_us"])] for r in rows])
    path = write_results(args.out, "key_transform", {"env": env, "rows": rows})
    print(f"wrote {path}")
    return 0
