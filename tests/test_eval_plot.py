"""`turboattn eval`'s perplexity-vs-bits plot: which points it draws, where, and that it writes a PNG."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from turboattn.cli import main as cli  # noqa: E402
from turboattn.cli.eval.report import peer_plot_bits, plot, plot_points  # noqa: E402


def row(change, lo, hi, **info):
    return {"ppl_change_pct": change, "ppl_change_ci95_pct": [lo, hi], "argmax_disagree_pct": 1.0,
            "attn_cos_mean": 0.99, "attn_cos_p1": 0.9, **info}


def results():
    """A float32 model at 2,048 + 256 tokens, head_dim 64: two of our presets, an exact-row one, three peers, one
    peer that did not run."""
    turbo = dict(family="turboattn", rule="corrected", mode="decode", fit_keys="center", exact_recent=0,
                 exact_first=0, scale_dtype="float32")
    return {
        "model": "smollm2", "head_dim": 64, "dtype": "torch.float32", "device": "cpu", "segments": 2,
        "prefill": 2048, "scored_per_segment": 256,
        "results": {
            "reference": {"ppl": 30.0, "seconds": 1.0},
            "k4v4-corrected-decode-center": row(3.0, 1.0, 5.0, preset="k4v4", bits_per_element=4.5, **turbo),
            "k8v8-corrected-decode-center": row(0.1, -0.1, 0.3, preset="k8v8", bits_per_element=8.5, **turbo),
            # 69 float32 exact rows at 2,304 tokens: 3.75 + 69 * 32 / 2304 measured, 3.75 + 69 * 16 / 2304 in bf16.
            "k4v3-corrected-decode-center-s4-r64-bf16scales": row(
                0.24, -0.23, 0.71, **(turbo | dict(preset="k4v3", exact_recent=64, exact_first=4,
                                                   scale_dtype="bfloat16", bits_per_element=3.75 + 69 * 32 / 2304))),
            "k4v4-corrected-strict-center": row(3.5, 1.0, 6.0, **(turbo | dict(preset="k4v4", mode="strict",
                                                                               bits_per_element=4.5))),
            "quanto-int4-r128": row(0.8, 0.0, 1.6, family="quanto", peer="quanto-int4", bits=4, residual=128),
            "hqq-2-every-token": row(462.0, 400.0, 520.0, family="hqq", peer="hqq-2", bits=2, residual=0),
            "turboquant-4-r128": row(1.4, -1.0, 3.9, family="turboquant", peer="turboquant-4", bits=4,
                                     residual=128),
            "hqq-4-r128": {"skipped": "TypeError: not this transformers"},
        },
    }


def test_peer_bits_count_scales_zeros_and_their_window():
    # quanto/HQQ: 16-bit scale and zero per 64 elements; the window holds 0..R bf16 tokens in place of codes.
    lo, hi = peer_plot_bits({"family": "quanto", "bits": 4, "residual": 128}, 64, 2304)
    assert lo == 4.5 and hi == pytest.approx(4.5 + 128 / 2304 * (16 - 4.5))
    assert peer_plot_bits({"family": "hqq", "bits": 2, "residual": 0}, 64, 2304) == (2.5, 2.5)
    # turboquant: a float32 norm per vector, and a sliding window that always holds R tokens.
    lo, hi = peer_plot_bits({"family": "turboquant", "bits": 4, "residual": 128}, 256, 512)
    assert lo == hi == pytest.approx(4.125 + 128 / 512 * (16 - 4.125))


def test_plot_points_and_png(tmp_path):
    report = results()
    png = tmp_path / "quality.png"
    points = plot(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by_name = {p["name"]: p for p in points}
    # Every scored method, once; the reference and the peer that did not run are not points.
    assert len(points) == 7 and set(by_name) == set(report["results"]) - {"reference", "hqq-4-r128"}
    assert [p["kind"] for p in points].count("peer") == 3
    exact = by_name["k4v3-corrected-decode-center-s4-r64-bf16scales"]
    assert exact["x_lo"] == exact["x_hi"] == pytest.approx(3.75 + 69 * 16 / 2304)   # exact rows counted in bf16
    assert by_name["k4v4-corrected-decode-center"]["x_lo"] == 4.5                   # float32 scales as stored
    quanto = by_name["quanto-int4-r128"]
    assert quanto["x_lo"] == 4.5 and quanto["x_hi"] == pytest.approx(4.5 + 128 / 2304 * 11.5)
    assert (quanto["y"], quanto["y_lo"], quanto["y_hi"]) == (0.8, 0.0, 1.6)
    # The filters keep only the named key fits and modes of our methods; peers stay.
    assert len(plot_points(report, modes=["decode"])) == 6
    assert len(plot_points(report, fits=["balance"])) == 3


def test_plot_of_a_file_without_head_dim_uses_the_model_spec(tmp_path):
    report = results()
    del report["head_dim"]
    assert len(plot_points(report)) == 7


def test_eval_plot_command(tmp_path, capsys):
    saved = tmp_path / "quality_tiny.json"
    saved.write_text(json.dumps(results()))
    png = saved.with_suffix(".png")
    assert cli.main(["eval", "--plot", str(saved), "--modes", "decode"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    png.write_bytes(b"kept")
    assert cli.main(["eval", "--plot", str(saved)]) == 0
    assert png.read_bytes() == b"kept" and "--overwrite redraws it" in capsys.readouterr().err
    assert cli.main(["eval", "--plot", str(saved), "--overwrite"]) == 0 and png.read_bytes() != b"kept"


def test_tables_show_the_paired_comparison():
    """A run that compared its methods with its first turboattn one on the same tokens: the console table and the
    peers' markdown table show that column; a run without it shows neither."""
    import io

    from rich.console import Console

    from turboattn.cli.eval.report import markdown_tables, print_table

    report = results()
    report["results"] = {k: r for k, r in report["results"].items() if "skipped" not in r}
    report["corpus"] = {"name": "jargon"}
    base = "k4v4-corrected-decode-center"
    report["results"]["quanto-int4-r128"] |= {"paired_against": base, "ppl_vs_paired_pct": -2.1,
                                              "ppl_vs_paired_ci95_pct": [-2.9, -1.3]}
    out = io.StringIO()
    print_table(report, Console(file=out, width=300))
    assert f"vs {base}, paired %" in out.getvalue() and "-2.10 [-2.90, -1.30]" in out.getvalue()
    text = markdown_tables(report)
    assert f"against {base}, paired |" in text
    assert "| quanto-int4-r128 | 4 | 128 | +0.80% [+0.0, +1.6] | 1.0% | 0.9900 / 0.900 | -2.10% [-2.9, -1.3] |" in text
    del report["results"]["quanto-int4-r128"]["paired_against"]
    out = io.StringIO()
    print_table(report, Console(file=out, width=300))
    assert "paired" not in out.getvalue() and "paired" not in markdown_tables(report)
