"""One-call GPU check and timing for kernels/flash.py (run through the device tool).

  python scripts/flash_gpu.py [--workers 12] [--out DIR] [--tiny]

1. Correctness at real shapes, bf16 (and fp16), in parallel worker processes
   (which also pre-compiles every kernel variant into Triton's disk cache, so
   the timing phase compiles nothing): output poisoned with NaN, relative
   error vs a float64 reference, LSE error, fully masked rows exactly zero.
2. Timing, in this process: each candidate block configuration of the prefill
   and decode kernels, torch SDPA on the same inputs, and the window sweep.
Results go to DIR/flash_gpu.json; a short table is printed last.
--tiny runs the same logic on the CPU interpreter at toy sizes (fp16), to
check the script itself before spending device time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

TINY = "--tiny" in sys.argv
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

DEV = "cpu" if TINY else "cuda"
BF16 = torch.float16 if TINY else torch.bfloat16

# Candidate configurations (name -> config dict) timed per head dim.
PREFILL_VARIANTS = {
    512: {
        "m64n64w8s1tma": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, tma=True),
        "m64n64w16s1tma": dict(BLOCK_M=64, BLOCK_N=64, num_warps=16, num_stages=1, tma=True),
        "m64n64w8s2tma": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, tma=True),
        "m64n32w8s3tma": dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=3, tma=True),
        "m64n64w8s2tma_ws": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, tma=True, warp_specialize=True),
        "m64n32w8s2tma_ws": dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2, tma=True, warp_specialize=True),
        "m128n64w8s1tma_cta2": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=1, tma=True, num_ctas=2),
        "m64n128w8s1tma": dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=1, tma=True),
    },
    256: {
        "m128n64w8s2tma": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, tma=True),
        "m128n128w8s1tma": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=1, tma=True),
        "m128n64w8s2tma_ws": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, tma=True, warp_specialize=True),
    },
    128: {
        "m128n64w8s3tma": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True),
        "m128n128w8s2tma": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, tma=True),
        "m128n64w8s3tma_ws": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True, warp_specialize=True),
    },
    64: {
        "m128n64w4s3tma": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, tma=True),
        "m128n128w8s3tma": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True),
    },
}
DECODE_VARIANTS = {
    "n16w4s4": dict(BLOCK_N=16, num_warps=4, num_stages=4),
    "n16w4s3": dict(BLOCK_N=16, num_warps=4, num_stages=3),
    "n16w4s2sp198": dict(BLOCK_N=16, num_warps=4, num_stages=2, splits=198),
    "n16w4s3sp264": dict(BLOCK_N=16, num_warps=4, num_stages=3, splits=264),
    "n16w4s4sp256": dict(BLOCK_N=16, num_warps=4, num_stages=4, splits=256),
    "n32w4s3sp132": dict(BLOCK_N=32, num_warps=4, num_stages=3, splits=132),
}
TIME_LENGTHS = {512: (4096, 8192), 256: (4096, 8192), 128: (4096, 8192), 64: (4096,)}
TOKENS = 16384
HEADS = 16


def L(n: int) -> int:
    """Sequence lengths shrink in --tiny mode (interpreter)."""
    return max(1, n // 64) if TINY else n


def Dm(d: int) -> int:
    return min(d, 32) if TINY else d


# ------------------------------------------------------------------ correctness

def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def run_check(name: str, b, hq, hkv, lq, lk, d, dtype=None, kv_start=None, mask_kind=None, config=None,
              path=None, skip_compare=False, **kw) -> dict:
    from turboattn.ops.flash.triton import flash_attention_triton, flash_path
    from turboattn.ops.flash.naive import attention_reference
    dtype = dtype or BF16
    lq, lk, d = L(lq) if lq > 1 else lq, L(lk), Dm(d)
    g = torch.Generator(device=DEV).manual_seed(hash(name) % 2**31)
    q = torch.randn(b, hq, lq, d, device=DEV, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, device=DEV, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, d, device=DEV, generator=g).to(dtype)
    mask = None
    if mask_kind == "bool":
        # Block structure (whole tiles off) plus random holes.
        mask = torch.rand(b, 1, lq, lk, device=DEV, generator=g) < 0.8
        mask[..., :, lk // 3: lk // 2] = False
        mask[..., lq // 2:, : lk // 4] = True
    elif mask_kind == "additive":
        mask = torch.randn(1, hq, lq, lk, device=DEV, generator=g).to(dtype)
        mask[..., : lq // 2, lk // 2:] = -math.inf
        mask[..., lq // 2:, : lk // 2] = 0
        mask[..., 1, :] = -math.inf
    if kv_start is not None:
        kv_start = torch.tensor([min(s, lk) for s in kv_start], dtype=torch.int32, device=DEV)
    for opt in ("sinks", "alibi_slopes"):
        if kw.get(opt) is True:
            kw[opt] = torch.randn(hq, device=DEV, generator=g).abs() * (0.1 if opt == "alibi_slopes" else 2)
    out = torch.full_like(q, float("nan"))
    res = flash_attention_triton(q, k, v, mask=mask, kv_start=kv_start, return_lse=True, config=config,
                                 path=path, allow_sdpa=False, **kw)
    out.copy_(res[0])
    lse = res[1]
    ran = path or flash_path(q, k, mask=mask, kv_start=kv_start, return_lse=True, allow_sdpa=False, **{
        x: kw[x] for x in ("causal", "sliding_window", "softcap", "sinks", "alibi_slopes") if x in kw})
    row = {"name": name, "path": ran, "shape": [b, hq, hkv, lq, lk, d], "dtype": str(dtype)}
    if skip_compare:
        return row
    ref_mask = mask
    if kv_start is not None:
        keep = (torch.arange(lk, device=DEV)[None] >= kv_start[:, None].long())[:, None, None, :]
        ref_mask = keep if mask is None else (mask & keep if mask.dtype == torch.bool else
                                              mask.double() + torch.where(keep, 0.0, -math.inf))
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), mask=ref_mask, return_lse=True,
                                       compute_dtype=torch.float64, **kw)
    dead = ref_lse == -math.inf
    live = ~dead
    row.update(
        rel_err=rel_err(out, ref),
        nan=bool(torch.isnan(out).any()),
        lse_err=(lse[live].double() - ref_lse[live]).abs().max().item() if live.any() else 0.0,
        dead_rows=int(dead.sum()),
        dead_ok=bool((out[dead] == 0).all() and (lse[dead] == -math.inf).all()),
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    row["ok"] = (not row["nan"]) and row["rel_err"] < tol and row["lse_err"] < 1e-3 and row["dead_ok"]
    if "skip_tiles_equal" in kw:
        pass
    return row


def check_skip_equal(name, d) -> dict:
    """Tile skipping must not change results: the masked visit-all path gives identical numbers."""
    from turboattn.ops.flash.triton import flash_attention_triton
    lq = lk = L(2000)
    d = Dm(d)
    q = torch.randn(2, 4, lq, d, device=DEV).to(BF16)
    k = torch.randn(2, 2, lk, d, device=DEV).to(BF16)
    v = torch.randn(2, 2, lk, d, device=DEV).to(BF16)
    kw = dict(causal=True, sliding_window=L(700), kv_start=torch.tensor([0, L(300)], dtype=torch.int32, device=DEV))
    a = flash_attention_triton(q, k, v, return_lse=True, **kw)
    b = flash_attention_triton(q, k, v, return_lse=True, skip_tiles=False, **kw)
    causal_mask = torch.ones(lq, lk, dtype=torch.bool, device=DEV).tril()
    c = flash_attention_triton(q, k, v, mask=causal_mask)
    e = flash_attention_triton(q, k, v, causal=True)
    diff = (a[0].float() - b[0].float()).abs().max().item()
    same_dead = torch.equal(a[1] == -math.inf, b[1] == -math.inf)
    fin = a[1] > -math.inf
    lse_diff = (a[1][fin] - b[1][fin]).abs().max().item() if same_dead else float("inf")
    diff2 = (c.float() - e.float()).abs().max().item()
    return {"name": name, "path": "prefill", "max_diff_skip_vs_full": diff, "max_diff_mask_vs_causal": diff2,
            "lse_diff": lse_diff,
            "ok": rel_err(a[0], b[0].double()) < 5e-4 and rel_err(c, e.double()) < 5e-4 and lse_diff < 1e-4}


def correctness_jobs():
    jobs = []
    for d in (64, 128, 256, 512):
        jobs.append(("causal_d%d" % d, dict(b=2, hq=8, hkv=2, lq=1000, lk=1000, d=d, causal=True)))
    jobs += [
        ("causal_d512_fp16", dict(b=1, hq=4, hkv=4, lq=777, lk=777, d=512, causal=True, dtype=torch.float16)),
        ("full_d80", dict(b=1, hq=4, hkv=1, lq=300, lk=450, d=80)),
        ("causal_d192_gqa3", dict(b=1, hq=6, hkv=2, lq=500, lk=500, d=192, causal=True)),
        ("lq_lt_lk_d128", dict(b=2, hq=4, hkv=4, lq=300, lk=1100, d=128, causal=True)),
        ("lq_gt_lk_d512", dict(b=1, hq=2, hkv=1, lq=900, lk=400, d=512, causal=True)),
        ("window_d128", dict(b=1, hq=4, hkv=2, lq=1500, lk=1500, d=128, causal=True, sliding_window=256)),
        ("window_kvstart_d512", dict(b=2, hq=4, hkv=1, lq=1200, lk=1200, d=512, causal=True, sliding_window=300,
                                     kv_start=[0, 333])),
        ("bool_mask_d128", dict(b=2, hq=4, hkv=2, lq=700, lk=900, d=128, mask_kind="bool")),
        ("bool_mask_causal_d512", dict(b=2, hq=4, hkv=2, lq=700, lk=700, d=512, mask_kind="bool", causal=True)),
        ("additive_mask_d256", dict(b=1, hq=4, hkv=4, lq=640, lk=640, d=256, mask_kind="additive")),
        ("softcap_alibi_sinks_d256", dict(b=1, hq=8, hkv=2, lq=600, lk=600, d=256, causal=True, softcap=20.0,
                                          alibi_slopes=True, sinks=True)),
        ("softcap_sinks_window_d512", dict(b=1, hq=4, hkv=2, lq=800, lk=800, d=512, causal=True, softcap=30.0,
                                           sinks=True, sliding_window=200)),
        ("decode_d512_32k", dict(b=1, hq=16, hkv=2, lq=1, lk=32768, d=512, causal=True)),
        ("decode_d512_opts", dict(b=2, hq=16, hkv=2, lq=1, lk=5000, d=512, causal=True, sliding_window=3000,
                                  sinks=True, softcap=25.0, kv_start=[0, 1234])),
        ("decode_d128_lq4_g8", dict(b=2, hq=16, hkv=2, lq=4, lk=3000, d=128, causal=True, mask_kind="bool")),
        ("decode_d256_alibi", dict(b=1, hq=8, hkv=8, lq=1, lk=4100, d=256, alibi_slopes=True)),
    ]
    for d, variants in PREFILL_VARIANTS.items():
        for vname, cfg in variants.items():
            jobs.append((f"cfg_d{d}_{vname}", dict(b=1, hq=4, hkv=2, lq=1000, lk=1000, d=d, causal=True, config=cfg,
                                                   path="prefill")))
    for vname, cfg in DECODE_VARIANTS.items():
        jobs.append((f"cfg_decode_{vname}", dict(b=1, hq=16, hkv=2, lq=1, lk=32768, d=512, causal=True, config=cfg,
                                                 path="decode")))
    # Window-sweep specialization (no extras) at D=128 and D=512.
    jobs.append(("window_d512_plain", dict(b=1, hq=2, hkv=2, lq=2000, lk=2000, d=512, causal=True, sliding_window=1024)))
    return jobs


def worker(job_slice):
    out = []
    for name, kw in job_slice:
        t0 = time.time()
        try:
            if name.startswith("skip_equal"):
                row = check_skip_equal(name, kw["d"])
            else:
                row = run_check(name, **kw)
        except Exception as e:  # report, keep going
            row = {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:600],
                   "trace": traceback.format_exc()[-1500:]}
        row["seconds"] = round(time.time() - t0, 1)
        out.append(row)
        print(f"  [{os.getpid()}] {name}: ok={row.get('ok')} rel={row.get('rel_err', '')} {row['seconds']}s",
              flush=True)
    return out


# ------------------------------------------------------------------ timing

def tflops_causal(b, h, n, d):
    return 4 * d * b * h * n * (n + 1) / 2


def time_fn(fn, rep_ms=200):
    if TINY:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from turboattn.cli.bench.common import time_us
    return time_us(fn, warmup_ms=30, rep_ms=rep_ms)


def timing(results):
    import torch.nn.functional as F
    from turboattn.ops.flash.triton import flash_attention_triton
    rows = []
    dims = (64, 128) if TINY else (512, 256, 128, 64)
    for d in dims:
        for n in TIME_LENGTHS[d]:
            n = L(n)
            b = max(1, TOKENS // n) if not TINY else 1
            h = HEADS if not TINY else 2
            q = torch.randn(b, h, n, Dm(d), device=DEV, dtype=BF16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            flops = tflops_causal(b, h, n, Dm(d))
            sd = time_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            rows.append({"kind": "prefill", "D": d, "L": n, "variant": "sdpa", "us": sd, "tflops": flops / sd / 1e6})
            for vname, cfg in PREFILL_VARIANTS[d].items():
                try:
                    us = time_fn(lambda: flash_attention_triton(q, k, v, causal=True, config=cfg, path="prefill"))
                    rows.append({"kind": "prefill", "D": d, "L": n, "variant": vname, "us": us,
                                 "tflops": flops / us / 1e6, "x_sdpa": sd / us})
                except Exception as e:
                    rows.append({"kind": "prefill", "D": d, "L": n, "variant": vname, "error": str(e)[:300]})
            del q, k, v
            if not TINY:
                torch.cuda.empty_cache()
    # GQA prefill, D=128, 32 q / 8 KV heads: is SDPA (enable_gqa) still ahead?
    for n in (L(4096), L(8192)):
        b = max(1, TOKENS // n) if not TINY else 1
        q = torch.randn(b, 32, n, Dm(128), device=DEV, dtype=BF16)
        k = torch.randn(b, 8, n, Dm(128), device=DEV, dtype=BF16)
        v = torch.randn_like(k)
        flops = tflops_causal(b, 32, n, Dm(128))
        sd = time_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        us = time_fn(lambda: flash_attention_triton(q, k, v, causal=True, path="prefill"))
        rows.append({"kind": "prefill", "D": 128, "L": n, "variant": "gqa4_sdpa", "us": sd, "tflops": flops / sd / 1e6})
        rows.append({"kind": "prefill", "D": 128, "L": n, "variant": "gqa4_ours", "us": us, "tflops": flops / us / 1e6,
                     "x_sdpa": sd / us})
        del q, k, v
    # Decode: Lq=1, D=512, 16 q / 2 KV heads, 32K keys.
    n = L(32768)
    q = torch.randn(1, 16, 1, Dm(512), device=DEV, dtype=BF16)
    k = torch.randn(1, 2, n, Dm(512), device=DEV, dtype=BF16)
    v = torch.randn_like(k)
    sd = time_fn(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    nbytes = 2 * k.numel() * k.element_size()
    rows.append({"kind": "decode", "variant": "sdpa", "L": n, "us": sd, "tbs": nbytes / sd / 1e6})
    for vname, cfg in DECODE_VARIANTS.items():
        try:
            us = time_fn(lambda: flash_attention_triton(q, k, v, causal=True, config=cfg, path="decode"))
            rows.append({"kind": "decode", "variant": vname, "L": n, "us": us, "tbs": nbytes / us / 1e6,
                         "x_sdpa": sd / us})
        except Exception as e:
            rows.append({"kind": "decode", "variant": vname, "error": str(e)[:300]})
    del q, k, v
    # Window sweep at L=16384 (default configs), D=128 and D=512.
    for d in (128, 512):
        n = L(16384)
        q = torch.randn(1, HEADS if not TINY else 2, n, Dm(d), device=DEV, dtype=BF16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        for w in (256, 512, 1024, 2048, 4096, 8192, None):
            w = L(w) if w else None
            us = time_fn(lambda: flash_attention_triton(q, k, v, causal=True, sliding_window=w, path="prefill"))
            rows.append({"kind": "window", "D": d, "L": n, "window": w or n, "us": us})
        del q, k, v
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    env = {"torch": torch.__version__}
    import triton
    env["triton"] = triton.__version__
    if not TINY:
        env["gpu"] = torch.cuda.get_device_name(0)
    print("env", env, flush=True)

    jobs = correctness_jobs() + [("skip_equal_d128", {"d": 128}), ("skip_equal_d512", {"d": 512})]
    # Spread the expensive (D=512, long) jobs over workers round-robin.
    n_workers = 1 if TINY else max(1, min(args.workers, len(jobs)))
    slices = [jobs[i::n_workers] for i in range(n_workers)]
    if n_workers == 1:
        checks = worker(jobs)
    else:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(n_workers) as pool:
            checks = [r for part in pool.map(worker, slices) for r in part]
    t_checks = time.time() - t_start
    print(f"correctness done in {t_checks:.0f}s", flush=True)
    with open(os.path.join(args.out, "flash_gpu_checks.json"), "w") as f:
        json.dump({"env": env, "checks": checks}, f, indent=1, default=str)

    timings = [] if args.skip_timing else timing(checks)
    payload = {"env": env, "checks": checks, "timings": timings, "seconds": time.time() - t_start}
    with open(os.path.join(args.out, "flash_gpu.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)

    print("\n=== correctness ===")
    for r in checks:
        extra = r.get("error", "") or (f"rel={r.get('rel_err', 0):.2e} lse={r.get('lse_err', 0):.1e} "
                                        f"dead={r.get('dead_rows', '')}" if "rel_err" in r else
                                        str({k: v for k, v in r.items() if k.startswith("max_diff")}))
        print(f"{'PASS' if r.get('ok') else 'FAIL'} {r['name']:<28} {r.get('path', ''):<8} {extra}")
    print("\n=== timing ===")
    for r in timings:
        if "error" in r:
            print(f"{r['kind']} D={r.get('D', '')} L={r.get('L', '')} {r['variant']}: ERROR {r['error'][:150]}")
        elif r["kind"] == "prefill":
            print(f"prefill D={r['D']} L={r['L']} {r['variant']:<16} {r['us']:9.1f}us {r['tflops']:6.1f} TF/s"
                  f" x{r.get('x_sdpa', 1):.2f}")
        elif r["kind"] == "decode":
            print(f"decode L={r['L']} {r['variant']:<14} {r['us']:8.1f}us {r['tbs']:.2f} TB/s x{r.get('x_sdpa', 1):.1f}")
        else:
            print(f"window D={r['D']} L={r['L']} W={r['window']:<6} {r['us']:9.1f}us")
    print(f"total {time.time() - t_start:.0f}s; checks {sum(bool(r.get('ok')) for r in checks)}/{len(checks)} ok")


if __name__ == "__main__":
    main()
