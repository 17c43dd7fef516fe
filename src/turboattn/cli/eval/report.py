"""`turboattn eval`'s output: rich tables, the perplexity-vs-bits plot and QUALITY.md's markdown tables."""

from __future__ import annotations

from pathlib import Path

from .methods import FIT_SUFFIX, RULES, bits_per_element, method_name


def print_table(report: dict, console) -> None:
    from rich.table import Table
    ref = report["results"]["reference"]
    t = Table(title=f"{report['model']}: {report['segments']}x{report['scored_per_segment']} scored tokens, "
                    f"reference ppl {ref['ppl']:.3f} ({report['corpus']['name']})")
    for col in ("method", "bits/el", "ppl change %", "95% interval", "argmax diff %", "cos mean", "cos p1"):
        t.add_column(col, justify="right")
    for name, r in report["results"].items():
        if name == "reference":
            continue
        lo, hi = r["ppl_change_ci95_pct"]
        bpe = f"{r['bits_per_element']:.3f}" if "bits_per_element" in r else ""
        t.add_row(name, bpe, f"{r['ppl_change_pct']:+.2f}", f"[{lo:+.2f}, {hi:+.2f}]",
                  f"{r['argmax_disagree_pct']:.2f}", f"{r['attn_cos_mean']:.5f}", f"{r['attn_cos_p1']:.4f}")
    console.print(t)


def print_passkey(report: dict, console) -> None:
    from rich.table import Table
    pk = report["passkey"]
    lengths = list(next(iter(pk.values())))
    t = Table(title=f"{report['model']}: passkey accuracy ({report['passkey_trials']} trials per length)")
    t.add_column("cache")
    for n in lengths:
        t.add_column(f"{n} tok", justify="right")
    for name, acc in pk.items():
        t.add_row(name, *[f"{acc[n]:.2f}" for n in lengths])
    console.print(t)


def plot(report: dict, path: Path) -> None:
    """Perplexity change (with its 95% interval) against bits per element, per mode and rule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = {}
    for name, r in report["results"].items():
        if r.get("family") == "turboattn":
            fit = {True: "balance", False: "off"}.get(r.get("fit_keys", "balance"), r.get("fit_keys"))
            fit = "" if fit == "balance" else f" key fit {fit}"
            window = f" exact first {r['exact_first']}" if r.get("exact_first") else ""
            window += f" exact {r['exact_recent']}" if r.get("exact_recent") else ""
            groups.setdefault(f"turboattn {r['mode']} {r['rule']}{fit}{window}", []).append(r)
    for label, rows in sorted(groups.items()):
        rows.sort(key=lambda r: r["bits_per_element"])
        x = [r["bits_per_element"] for r in rows]
        y = [max(r["ppl_change_pct"], 1e-3) for r in rows]
        ax.plot(x, y, marker="o", label=label)
    for name, r in report["results"].items():
        if r.get("family") not in (None, "turboattn", "reference"):
            ax.scatter([r["bits"]], [max(r["ppl_change_pct"], 1e-3)], marker="x", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("bits per element (scales counted for turboattn)")
    ax.set_ylabel("perplexity change vs reference cache (%)")
    ax.set_title(f"{report['model']}: {report['segments']}x{report['scored_per_segment']} scored tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_tables(report: dict) -> str:
    """QUALITY.md tables from a results JSON: presets x rules (both modes), then the peers."""
    res, hd = report["results"], report["head_dim"]
    lines = [f"Reference perplexity {res['reference']['ppl']:.3f}; {report['segments']} x "
             f"{report['scored_per_segment']} scored tokens; 95% intervals in brackets.", "",
             "| preset | bits/el | rule | key fit | decode: ppl change | strict: ppl change | argmax diff (decode) "
             "| attn cos mean / p1 (decode) |", "|---|---|---|---|---|---|---|---|"]

    def pct(r):
        lo, hi = r["ppl_change_ci95_pct"]
        return f"{r['ppl_change_pct']:+.2f}% [{lo:+.1f}, {hi:+.1f}]"
    presets = dict.fromkeys(r["preset"] for r in res.values() if r.get("family") == "turboattn")
    # Cache options beside the preset: exact first tokens, exact window (and whether sliding layers keep it), scales.
    options = sorted({(r.get("exact_first", 0), r.get("exact_recent", 0), r.get("recent_sliding", True),
                       r.get("scale_dtype", "float32")) for r in res.values() if r.get("family") == "turboattn"})
    for p, rule, fit, (first, w, sliding, scales) in ((p, rule, f, o) for p in presets for rule in RULES
                                                      for f in FIT_SUFFIX for o in options):
        d = res.get(method_name(p, rule, "decode", fit, w, first, scales, sliding))
        s = res.get(method_name(p, rule, "strict", fit, w, first, scales, sliding))
        if d is None and s is None:
            continue
        any_row = d or s
        # A window's bytes count in its row's own bits (measured); the codec's otherwise.
        bits = any_row["bits_per_element"] if w or first else bits_per_element(p, hd, scales)
        label = (p + (f" + first {first} exact" if first else "")
                 + (f" + {w} exact" + ("" if sliding else " (full layers)") if w else "")
                 + (" + bf16 scales" if scales == "bfloat16" else ""))
        lines.append(f"| {label} | {bits:.3f} | {rule} | {fit} | "
                     f"{pct(d) if d else ''} | {pct(s) if s else ''} | {any_row['argmax_disagree_pct']:.1f}% | "
                     f"{any_row['attn_cos_mean']:.4f} / {any_row['attn_cos_p1']:.3f} |")
    peers = {k: r for k, r in res.items() if r.get("family") not in (None, "turboattn")}
    if peers:
        lines += ["", "| peer | bits | residual | ppl change | argmax diff | attn cos mean / p1 |", "|---|---|---|---|---|---|"]
        for k, r in peers.items():
            lines.append(f"| {k} | {r['bits']} | {r['residual']} | {pct(r)} | {r['argmax_disagree_pct']:.1f}% | "
                         f"{r['attn_cos_mean']:.4f} / {r['attn_cos_p1']:.3f} |")
    if report.get("passkey"):
        pk = report["passkey"]
        lengths = list(next(iter(pk.values())))
        lines += ["", "| cache | " + " | ".join(f"passkey @{n}" for n in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for name, acc in pk.items():
            lines.append(f"| {name} | " + " | ".join(f"{acc[n]:.2f}" for n in lengths) + " |")
    if report.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in report["skipped"].items())]
    return "\n".join(lines)
