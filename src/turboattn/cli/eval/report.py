"""`turboattn eval`'s output: rich tables, the perplexity-vs-bits plot and QUALITY.md's markdown tables."""

from __future__ import annotations

import math
from pathlib import Path

from .methods import FIT_SUFFIX, MAIN_PRESETS, RULES, bits_per_element, method_name


def print_table(report: dict, console) -> None:
    from rich.table import Table
    ref = report["results"]["reference"]
    t = Table(title=f"{report['model']}: {report['segments']}x{report['scored_per_segment']} scored tokens, "
                    f"reference ppl {ref['ppl']:.3f} ({report['corpus']['name']})")
    base = next((r["paired_against"] for r in report["results"].values() if "paired_against" in r), None)
    columns = ("method", "bits/el", "ppl change %", "95% interval", "argmax diff %", "cos mean", "cos p1")
    for col in columns + ((f"vs {base}, paired %",) if base else ()):
        t.add_column(col, justify="right")
    for name, r in report["results"].items():
        if name == "reference":
            continue
        lo, hi = r["ppl_change_ci95_pct"]
        bpe = f"{r['bits_per_element']:.3f}" if "bits_per_element" in r else ""
        cells = [name, bpe, f"{r['ppl_change_pct']:+.2f}", f"[{lo:+.2f}, {hi:+.2f}]",
                 f"{r['argmax_disagree_pct']:.2f}", f"{r['attn_cos_mean']:.5f}", f"{r['attn_cos_p1']:.4f}"]
        if base:
            cells.append(paired_cell(r))
        t.add_row(*cells)
    console.print(t)


def paired_cell(r: dict) -> str:
    """A row's perplexity against the run's first turboattn method on the same tokens, with its 95% interval."""
    if "ppl_vs_paired_pct" not in r:
        return ""
    lo, hi = r["ppl_vs_paired_ci95_pct"]
    return f"{r['ppl_vs_paired_pct']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


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


# Bits per element in the plot are those of a bf16 model (16-bit elements), counted as QUALITY.md does.
PLOT_ELEMENT_BITS = 16
# transformers' QuantizedCache (quanto, HQQ) stores a scale and a zero point in the model's dtype per group of
# this many elements; turboquant (TurboQuantMSE) one float32 norm per vector.
PEER_GROUP = 64
TURBOQUANT_NORM_BITS = 32
_MODEL_DTYPE_BITS = {"torch.float32": 32, "torch.bfloat16": 16, "torch.float16": 16}


def report_head_dim(report: dict) -> int:
    """The model's head_dim: the results file's, else the model's spec (files written outside `turboattn eval`)."""
    if report.get("head_dim"):
        return report["head_dim"]
    from ..models import MODELS
    return MODELS[report["model"]].head_dim


def turbo_plot_bits(row: dict, head_dim: int, model_dtype: str, element_bits: int = PLOT_ELEMENT_BITS) -> float:
    """A turboattn row's bits per element for a model of `element_bits`-bit elements.

    The row's own count (codes, scales, exact first tokens and window at the measured length) is in the measured
    model's dtype; the exact rows are the part beyond the codec's bits, and scale with the element width."""
    codec = bits_per_element(row["preset"], head_dim, row.get("scale_dtype", "float32"))
    measured = row.get("bits_per_element")
    if measured is None:
        return codec
    return codec + (measured - codec) * element_bits / _MODEL_DTYPE_BITS.get(model_dtype, element_bits)


def peer_plot_bits(row: dict, head_dim: int, length: int,
                   element_bits: int = PLOT_ELEMENT_BITS) -> tuple[float, float]:
    """(least, most) bits per element a peer's cache holds at `length` tokens, in a model of `element_bits`-bit
    elements: its codes at the nominal width, the metadata beside them (a scale and a zero per PEER_GROUP
    elements in the model's dtype; turboquant's float32 norm per vector), and its full-precision window in place
    of codes.  transformers' QuantizedCache quantizes its window whenever it fills, so it holds 0 to R tokens (a
    range); turboquant's window slides and always holds R."""
    bits, residual = row["bits"], row.get("residual", 0)
    if row.get("family") == "turboquant":
        coded = bits + TURBOQUANT_NORM_BITS / head_dim
    else:
        coded = bits + 2 * element_bits / PEER_GROUP
    full = min(residual, length) / length * (element_bits - coded)
    return (coded + full if row.get("family") == "turboquant" else coded), coded + full


def _fit_name(r: dict) -> str:
    # Early results files stored the key fit as a bool (True: "balance", False: "off").
    return {True: "balance", False: "off"}.get(r.get("fit_keys", "balance"), r.get("fit_keys"))


def _turbo_label(r: dict) -> str:
    parts = [f"turboattn {r['mode']}", r["rule"], f"key fit {_fit_name(r)}"]
    window = ([f"first {r['exact_first']}"] if r.get("exact_first") else []) + \
        ([f"recent {r['exact_recent']}"] if r.get("exact_recent") else [])
    if window:
        parts.append(" + ".join(window) + " exact")
    if r.get("scale_dtype", "float32") != "float32":
        parts.append(f"{r['scale_dtype']} scales")
    return ", ".join(parts)


def _peer_label(r: dict) -> str:
    width = f"int{r['bits']}" if r.get("family") == "quanto" else f"{r['bits']}-bit"
    residual = r.get("residual", 0)
    how = (f"full-precision window of {residual}" if r.get("family") == "turboquant" and residual
           else f"window 0-{residual} tokens" if residual else "every token quantized")
    return f"{r.get('family')} {width}, {how}"


def plot_points(report: dict, element_bits: int = PLOT_ELEMENT_BITS, fits=None, modes=None) -> list[dict]:
    """The points of `plot`: one per scored method, each {name, label, kind, family, preset, bits, x_lo, x_hi, y,
    y_lo, y_hi}: bits per element for a model of `element_bits`-bit elements at the measured length (prefill +
    scored tokens; a range for a peer whose window holds 0..R tokens), perplexity change % with its 95% interval.
    fits / modes (None: all) keep only the turboattn methods with those key fits and modes; rows without a
    perplexity change (peers that did not run) are left out."""
    head_dim, length = report_head_dim(report), report["prefill"] + report["scored_per_segment"]
    points = []
    for name, r in report["results"].items():
        if name == "reference" or "ppl_change_pct" not in r:
            continue
        if r.get("family") == "turboattn":
            if (fits is not None and _fit_name(r) not in fits) or (modes is not None and r["mode"] not in modes):
                continue
            x_lo = x_hi = turbo_plot_bits(r, head_dim, report.get("dtype", "torch.float32"), element_bits)
            kind, label = "turboattn", _turbo_label(r)
        elif r.get("family") and "bits" in r:
            (x_lo, x_hi), kind, label = peer_plot_bits(r, head_dim, length, element_bits), "peer", _peer_label(r)
        else:
            continue
        lo, hi = r["ppl_change_ci95_pct"]
        points.append(dict(name=name, label=label, kind=kind, family=r["family"], preset=r.get("preset"),
                           bits=r.get("bits"), x_lo=x_lo, x_hi=x_hi, y=r["ppl_change_pct"], y_lo=lo, y_hi=hi))
    return points


_PEER_STYLE = {"quanto": ("s", "tab:red"), "hqq": ("^", "tab:purple"), "turboquant": ("D", "tab:brown")}


def _pct(v: float, _pos=None) -> str:
    return "0%" if v == 0 else f"{v:+g}%"


def _symlog_ticks(lo: float, hi: float) -> list[float]:
    """Ticks of a symlog axis linear within +-1%: +-0.5 steps there, then 1-2-5 per decade (decades only when the
    axis spans more than three)."""
    ticks = [t for t in (-1.0, -0.5, 0.0, 0.5, 1.0) if lo <= t <= hi]
    decades = max(0, math.ceil(math.log10(max(hi, 1.0))))
    steps = (1, 2, 5) if decades <= 3 else (1,)
    ticks += [m * 10.0 ** k for k in range(decades + 1) for m in steps if 1 < m * 10.0 ** k <= hi]
    neg = max(0, math.ceil(math.log10(max(-lo, 1.0))))
    ticks += [-(10.0 ** k) for k in range(1, neg + 1) if -(10.0 ** k) >= lo]
    return sorted(set(ticks))


def plot(report: dict, path: Path, element_bits: int = PLOT_ELEMENT_BITS, fits=None, modes=None) -> list[dict]:
    """Perplexity change (95% interval as vertical bars) against bits per element, everything counted for a
    model of `element_bits`-bit elements, turboattn's methods and the peers on the same axes; a peer's window of
    0..R full-precision tokens is a horizontal bar.  A symmetric-log y axis (linear within +-1%) keeps sub-percent
    differences readable beside peers that lose hundreds of percent.  Each turboattn configuration is a line through
    its symmetric presets and k4v3 (MAIN_PRESETS; other presets are markers of its colour).  fits / modes filter
    the turboattn methods (plot_points).  Returns the points drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    points = plot_points(report, element_bits, fits, modes)
    fig, ax = plt.subplots(figsize=(8, 5.2))
    turbo = {}
    for p in points:
        if p["kind"] == "turboattn":
            turbo.setdefault(p["label"], []).append(p)
    few = len(points) <= 12
    cmap = plt.get_cmap("viridis")
    off_line = {}   # presets drawn as markers off their configuration's line (ordered set)
    for i, (label, rows) in enumerate(sorted(turbo.items())):
        rows.sort(key=lambda p: (p["x_lo"], p["y"]))
        color = cmap(i / (len(turbo) - 1) * 0.85) if len(turbo) > 1 else "tab:blue"
        main = [p for p in rows if p["preset"] in MAIN_PRESETS] or rows
        for group, line in ((main, "-"), ([p for p in rows if p not in main], "none")):
            if group:
                ax.errorbar([p["x_lo"] for p in group], [p["y"] for p in group],
                            yerr=[[p["y"] - p["y_lo"] for p in group], [p["y_hi"] - p["y"] for p in group]],
                            marker="o", ms=6 if few else 4, lw=1.2, ls=line, capsize=3 if few else 2, color=color,
                            label=label if group is main else None, zorder=3)
        for p in rows:   # values when the plot is sparse, else the presets of the first configuration
            if few:
                text = _pct(round(p["y"], 2)) if len(rows) == 1 else f"{p['preset']} {_pct(round(p['y'], 2))}"
            elif i == 0 and p in main:   # the other presets share a main one's bits: named in the notes
                text = p["preset"]
            else:
                continue
            ax.annotate(text, (p["x_lo"], p["y"]), textcoords="offset points", xytext=(6, -11),
                        fontsize=7 if few else 6, color=color if few else "dimgray")
        off_line.update(dict.fromkeys(p["preset"] for p in rows if p not in main))
    peers = [p for p in points if p["kind"] == "peer"]
    for p in peers:
        marker, color = _PEER_STYLE.get(p["family"], ("X", "tab:gray"))
        x = (p["x_lo"] + p["x_hi"]) / 2
        hollow = p["bits"] is not None and p["bits"] <= 2
        ax.errorbar([x], [p["y"]], xerr=[[x - p["x_lo"]], [p["x_hi"] - x]],
                    yerr=[[p["y"] - p["y_lo"]], [p["y_hi"] - p["y"]]], marker=marker, ms=8, capsize=3, ls="none",
                    color=color, mfc="white" if hollow else color, mew=1.5, label=p["label"], zorder=4)
        # Peers at the same bits: the highest one's value above its marker, the others' stacked below theirs.
        rank = sum(abs((q["x_lo"] + q["x_hi"]) / 2 - x) < 0.1 and q["y"] > p["y"] for q in peers if q is not p)
        ax.annotate(_pct(round(p["y"], 2 if abs(p["y"]) < 10 else 0)), (x, p["y"]), textcoords="offset points",
                    xytext=(8, 5 - 12 * rank), fontsize=7, color=color)
    ax.set_yscale("symlog", linthresh=1.0, linscale=1.0)
    lo, hi = ax.get_ylim()
    ax.set_yticks(_symlog_ticks(lo, hi))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(_pct))
    ax.set_ylim(lo, hi)
    ax.axhline(0, color="black", lw=0.8, zorder=1)
    length = report["prefill"] + report["scored_per_segment"]
    dtype_name = {16: "bf16"}.get(element_bits, f"{element_bits}-bit")
    ax.set_xlabel(f"bits per element, everything counted, {dtype_name} model at {length:,} tokens")
    ax.set_ylabel("perplexity change vs exact cache (95% interval)")
    scored = report["segments"] * report["scored_per_segment"]
    measured = " ".join(x for x in (report.get("dtype", "").removeprefix("torch."), report.get("device")) if x)
    ax.set_title(f"{report['model']}" + (f" ({measured.replace(' ', ' on ')})" if measured else "")
                 + f": {report['segments']} x {report['scored_per_segment']} scored tokens ({scored:,}) after "
                 f"{report['prefill']:,}-token prompts", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    notes = "Bits: codes, scales, full-precision tokens in place of codes"
    if peers:
        notes += (f"; the peers' {element_bits}-bit scale and zero per {PEER_GROUP} elements (turboquant: a "
                  f"{TURBOQUANT_NORM_BITS}-bit norm per vector)")
    notes += ".\n"
    if any(p["x_lo"] != p["x_hi"] for p in peers):
        notes += "Horizontal bars: a peer's full-precision window holds 0 to R tokens."
    if off_line and not few:
        notes += " Markers off the turboattn lines: " + ", ".join(off_line) + "."
    not_run = [k for k, r in report["results"].items() if k != "reference" and "ppl_change_pct" not in r]
    not_run += [k for k in report.get("skipped", {}) if k not in not_run and k not in report["results"]]
    if not_run:
        notes += " Not run: " + ", ".join(not_run) + "."
    fig.text(0.01, 0.01, notes, fontsize=6.5, color="dimgray", va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return points


def markdown_tables(report: dict) -> str:
    """QUALITY.md tables from a results JSON: presets x rules (both modes), then the peers."""
    res, hd = report["results"], report_head_dim(report)
    lines = [f"Reference perplexity {res['reference']['ppl']:.3f}; {report['segments']} x "
             f"{report['scored_per_segment']} scored tokens; 95% intervals in brackets.", "",
             "| preset | bits/el | rule | key fit | decode: ppl change | strict: ppl change | argmax diff (decode) "
             "| attn cos mean / p1 (decode) |", "|---|---|---|---|---|---|---|---|"]

    def pct(r, key="ppl_change"):
        lo, hi = r[f"{key}_ci95_pct"]
        return f"{r[f'{key}_pct']:+.2f}% [{lo:+.1f}, {hi:+.1f}]"
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
        base = next((r["paired_against"] for r in peers.values() if "paired_against" in r), None)
        paired = f" against {base}, paired |" if base else ""
        lines += ["", "| peer | bits | residual | ppl change | argmax diff | attn cos mean / p1 |" + paired,
                  "|---|---|---|---|---|---|" + ("---|" if base else "")]
        for k, r in peers.items():
            row = (f"| {k} | {r['bits']} | {r['residual']} | {pct(r)} | {r['argmax_disagree_pct']:.1f}% | "
                   f"{r['attn_cos_mean']:.4f} / {r['attn_cos_p1']:.3f} |")
            if base:
                row += f" {pct(r, 'ppl_vs_paired')} |" if "ppl_vs_paired_pct" in r else " |"
            lines.append(row)
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
