"""The `turboattn` command: `info` and `demo` run, and print numbers that agree with the codec."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import turboattn as ta
from turboattn.cli import main as cli
from turboattn.format import codebook
from turboattn.format.codec import SUPPORTED_BITS
from turboattn.cli.info import TABLE_HEAD_DIMS


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich must not wrap or elide table cells


def table_rows(text: str) -> list[list[str]]:
    """Cells of the body rows of rich tables in `text`."""
    return [[c.strip() for c in line.strip().strip("│").split("│")]
            for line in text.splitlines() if line.strip().startswith("│")]


def test_info(capsys, wide):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"turboattn {ta.__version__}" in out and "torch" in out and "device:" in out
    rows = table_rows(out)
    seen = set()
    for row in rows:
        kb, vb = int(row[0]), int(row[1])
        for d, cell in zip(TABLE_HEAD_DIMS, row[2:]):
            codec = ta.KVCodec(d, kb, vb)
            nbytes, ratio = re.fullmatch(r"(\d+) B\s+([\d.]+)x", cell).groups()
            assert int(nbytes) == codec.bytes_per_token()
            assert float(ratio) == pytest.approx(4 * d / codec.bytes_per_token(), abs=0.005)
        seen.add((kb, vb))
    assert seen == {(kb, vb) for kb in SUPPORTED_BITS for vb in SUPPORTED_BITS}  # every K/V pair


def test_demo(capsys, wide):
    from turboattn.cli.demo import PRESETS
    assert cli.main(["demo", "--synthetic"]) == 0
    rows = {row[0]: row[1:] for row in table_rows(capsys.readouterr().out)}
    assert set(rows) == {f"k{kb}v{vb}" for kb, vb in PRESETS}
    for kb, vb in PRESETS:
        nbytes, ratio, k_err, v_err = rows[f"k{kb}v{vb}"]
        assert int(nbytes) == ta.KVCodec(128, kb, vb).bytes_per_token()
        assert float(ratio.rstrip("x")) == pytest.approx(512 / int(nbytes), abs=0.005)
        # The demo's V is Gaussian: its relative error is sqrt(relative MSE), within 5% of the
        # codebook's sqrt(MSE) (tests/test_codec.py bounds the MSE; the printout has 4 decimals).
        assert float(v_err) == pytest.approx(math.sqrt(codebook.expected_mse(vb)), rel=0.05, abs=5e-5)
        assert 0 < float(k_err) < 1


def test_console_script_runs():
    script = Path(sys.executable).with_name("turboattn")
    assert script.exists(), "the package is not installed with its console script (pip install -e .)"
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    out = subprocess.run([str(script), "info"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Cache formats" in out.stdout


def test_unknown_command_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_info_prints_plain_text_without_rich(monkeypatch, capsys):
    """torch is the one required dependency: `turboattn info` must not need rich."""
    import sys

    from turboattn.cli.info import print_info
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich...` raise ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setitem(sys.modules, "rich.table", None)
    print_info()
    out = capsys.readouterr().out
    assert "k_bits" in out and "136 B  3.76x" in out  # k4v4 at D=128


BENCH_SUITES = ("decode", "quantize", "prefill", "decode-sweep", "key-transform", "sanitize-cases", "generate",
                "host", "phases", "ab")


def test_bench_lists_its_suites(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and all(s in out for s in BENCH_SUITES)


@pytest.mark.parametrize("suite", BENCH_SUITES)
def test_bench_suite_help(suite, capsys):
    """Every suite parses its options and describes itself without a GPU."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", suite, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and f"turboattn bench {suite}" in out


def test_bench_generate_takes_key_groups():
    from turboattn.cli.bench.generate import coded_preset
    assert coded_preset("k112x6+144x4v3") == ("k112x6+144x4v3", ((112, 6), (144, 4)), 3)
    assert coded_preset("k5v3") == ("k5v3", 5, 3)


@pytest.mark.parametrize("argv, message", [
    (["decode-sweep", "--lookup", "lut,foo"], "'foo' is not one of lut, gather"),
    (["decode-sweep", "--block-n", "48"], "powers of two"),
    (["decode-sweep", "--stages", "two"], "positive ints"),
    (["decode-sweep", "--shapes", "8,32,8,128"], "B,Hq,Hkv,D,L"),
    (["decode-sweep", "--shapes", "8,32,6,128,1024"], "multiple of Hkv"),
    (["decode-sweep", "--presets", "k7v4"], "bits of 'k7v4'"),
    (["decode-sweep", "--num-splits", "8", "--programs-per-sm", "4"], "not allowed with"),
    (["prefill", "--configs", "m64n64w8q1"], "cannot read 'q1'"),
    (["prefill", "--configs", "n64w8s1"], "lacks BLOCK_M"),
    (["prefill", "--decode-configs", "n32w4s2tma"], "tma does not apply to the decode kernel"),
    (["key-transform", "--preset", "k4v4,k8v8"], "one preset"),
    (["sanitize-cases", "--cases", "all"], "'all' is not one of small, passkey, cuda, options, groups, flash"),
    (["generate", "--bits", "k4vq"], "preset must look like k4v4"),
    (["quantize", "--cases", "groups"], "invalid choice: 'groups'"),
])
def test_bench_rejects_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {argv[1]}" in err and message in err


def test_bench_arguments_parse():
    from turboattn.cli.bench import decode_sweep
    from turboattn.cli.bench.prefill_configs import parse_config
    args = cli.build_parser().parse_args(
        ["bench", "decode-sweep", "--block-n", "32,64", "--warps", "4", "--stages", "2,3", "--programs-per-sm",
         "2,4,8", "--lookup", "lut,gather", "--shapes", "8,32,8,128,32768", "1,32,8,128,4096"])
    assert args.shapes == [(8, 32, 8, 128, 32768), (1, 32, 8, 128, 4096)] and args.presets == [(4, 4), (8, 8)]
    assert len(decode_sweep.variants(args, (4, 4))) == 2 * 2 * 3 * 2
    assert len(decode_sweep.variants(args, (8, 8))) == 2 * 2 * 3   # the LUT only serves 4-bit codes
    assert {v["lookup"] for v in decode_sweep.variants(args, (8, 8))} == {None}
    assert parse_config("m64n32w8s2tma_ws", "prefill") == dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2,
                                                              tma=True, warp_specialize=True)
    assert parse_config("m64n32w8s2", "prefill")["tma"] is False   # pointer loads, not the default's TMA
    assert parse_config("n16w4s2sp198", "decode") == dict(BLOCK_N=16, num_warps=4, num_stages=2, splits=198)


def test_bench_host_runs_anywhere(tmp_path, capsys, wide):
    """The host-overhead bench stubs the kernels out, so it runs on a CPU; and it leaves the backends as they were."""
    import json

    import torch

    from turboattn.cli.bench.host import PIECES
    from turboattn.ops import backend
    from turboattn.ops.backend import choose, load
    before = {op: dict(impls) for op, impls in backend._REGISTRY.items()}
    assert cli.main(["bench", "host", "--layers", "1", "--steps", "2", "--head-dim", "64", "--out",
                     str(tmp_path)]) == 0
    assert backend._REGISTRY == before   # every field of every implementation restored (key groups included)
    us = json.loads((tmp_path / "host.json").read_text())["us"]
    assert set(us) == set(PIECES) and all(us[name] > 0 for name in PIECES if name != "glue")
    assert "cuda wrapper" in capsys.readouterr().out
    cpu = torch.device("cpu")
    assert choose("cached_attention", "auto", cpu, 64) == "torch" and choose("quantize_append", "auto", cpu, 64) == "torch"
    assert load("cached_attention", "cuda").__name__ == "cached_attention_cuda"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_gpu_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        cli.main(["bench", "sanitize-cases"])


# -- what a new user meets: one-line errors before any work, defaults shown, fresh result paths ----------------

def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of `turboattn <argv>` run in this process."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: bad arguments must be refused before."""
    from turboattn.cli import models

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(models, "load_model", load_model)


BAD_ARGUMENTS = [
    (["demo", "--preset", "foo"], "argument --preset: presets look like k4v4, got 'foo'"),
    (["demo", "--preset", "k9v4"], "bits of 'k9v4' must be in (2, 3, 4, 5, 6, 8)"),
    (["demo", "--synthetic", "--preset", "k9v4"], "bits of 'k9v4'"),
    (["demo", "--synthetic", "--prompt", "hi"], "--prompt does not apply to --synthetic"),
    (["demo", "--synthetic", "--max-new-tokens", "8"], "--max-new-tokens does not apply to --synthetic"),
    (["demo", "--head-dim", "64"], "--head-dim does not apply to the model demo"),
    (["demo", "--synthetic", "--head-dim", "96"], "argument --head-dim: invalid choice: 96"),
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive int, got '0'"),
    (["demo", "--eval-tokens", "-1"], "argument --eval-tokens: expected an int >= 0, got '-1'"),
    (["demo", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["eval", "--presets", "k9v9"], "argument --presets: bits of 'k9v9' must be in"),
    (["eval", "--presets", "k4v4,"], "argument --presets: expected a comma list"),
    (["eval", "--prefill", "0"], "argument --prefill: expected a positive int, got '0'"),
    (["eval", "--scored", "x"], "argument --scored: expected a positive int, got 'x'"),
    (["eval", "--rules", "foo"], "argument --rules: 'foo' is not one of rms, corrected, lsq"),
    (["eval", "--modes", "fast"], "argument --modes: 'fast' is not one of decode, strict"),
    (["eval", "--key-fit", "center,x"], "argument --key-fit: 'x' is not one of"),
    (["eval", "--peers", "all,hqq-4"], "argument --peers: 'all' stands alone"),
    (["eval", "--passkey-lengths", "512,0"], "argument --passkey-lengths: expected positive ints"),
    (["eval", "--passkey-presets", "k4v4"], "--passkey-presets needs --passkey-lengths"),
    (["eval", "--out", "results.txt"], "--out names the results JSON"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_stop_with_one_line_before_loading_a_model(argv, message, capsys, no_model):
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err and "error:" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown without a GPU")
def test_demo_on_cuda_without_a_gpu_says_so(capsys, no_model):
    code, err = run_cli(["demo", "--device", "cuda"], capsys)
    assert code == 2 and err == "turboattn: error: --device cuda: no CUDA GPU is visible to torch\n"


def test_eval_markdown_of_a_missing_or_foreign_file(tmp_path, capsys, no_model):
    code, err = run_cli(["eval", "--markdown", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and err == f"turboattn: error: No such file or directory: {tmp_path / 'missing.json'}\n"
    (tmp_path / "notes.json").write_text("not json")
    code, err = run_cli(["eval", "--markdown", str(tmp_path / "notes.json")], capsys)
    assert code == 2 and err.startswith(f"turboattn: error: {tmp_path / 'notes.json'} is not JSON (")
    (tmp_path / "other.json").write_text('{"a": 1}')
    code, err = run_cli(["eval", "--markdown", str(tmp_path / "other.json")], capsys)
    assert code == 2 and "is not a `turboattn eval` results file" in err and len(err.splitlines()) == 1


def test_eval_markdown_keeps_an_existing_plot(tmp_path, capsys, no_model):
    """Printing QUALITY.md's tables from committed results must not redraw the committed plot."""
    saved = tmp_path / "quality_smollm2.json"
    saved.write_bytes((Path(__file__).resolve().parents[1] / "benchmarks" / "quality_smollm2.json").read_bytes())
    png = saved.with_suffix(".png")
    png.write_bytes(b"the committed plot")
    code, err = run_cli(["eval", "--markdown", str(saved)], capsys)
    assert code == 0 and png.read_bytes() == b"the committed plot" and "--overwrite redraws it" in err


def test_eval_refuses_to_overwrite_results(tmp_path, capsys, no_model):
    out = tmp_path / "quality.json"
    out.write_text("{}")
    code, err = run_cli(["eval", "--out", str(out)], capsys)
    assert code == 2 and err.startswith(f"turboattn: error: {out} already exists; pass --overwrite to replace")
    assert out.read_text() == "{}"


def test_bench_refuses_to_overwrite_results(tmp_path, capsys):
    (tmp_path / "decode.json").write_text("{}")
    code, err = run_cli(["bench", "decode", "--out", str(tmp_path)], capsys)
    assert code == 2 and f"{tmp_path / 'decode.json'} already exists; pass --overwrite" in err
    assert len(err.splitlines()) == 1


def test_results_go_to_a_fresh_path_by_default(tmp_path, monkeypatch):
    from turboattn.cli import eval as ev
    from turboattn.cli.args import RUNS_DIR, fresh_path
    monkeypatch.chdir(tmp_path)
    args = cli.build_parser().parse_args(["eval"])
    first = ev._out_path(args)
    assert args.out is None and first.parent == RUNS_DIR and first.name.startswith("quality_smollm2-")
    assert first.suffix == ".json" and not first.exists()
    first.parent.mkdir()
    first.write_text("{}")
    second = fresh_path("quality_smollm2", ".json")
    assert second != first and not second.exists() and second.parent == RUNS_DIR
    assert "/runs/" in (Path(__file__).resolve().parents[1] / ".gitignore").read_text().split()


def test_every_option_has_help_and_shows_its_default():
    import argparse

    def parsers(p, path):
        yield path, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from parsers(sub, f"{path} {name}")

    for path, p in parsers(cli.build_parser(), "turboattn"):
        text = " ".join(p.format_help().split())
        for a in p._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"{path} {a.option_strings[0]} has no help text"
            if a.default not in (None, False, []) and not isinstance(a.default, bool):
                assert "default:" in a.help or "(default: " in text, f"{path} {a.option_strings[0]}"
    demo_help = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["demo"].format_help().split())
    for shown in ("(default: k4v4;", "tokens each cache generates (default: 64)", "(default: corrected)",
                  "(default: 128)"):
        assert shown in demo_help


def test_demo_synthetic_uses_preset_and_scale_rule(capsys, wide):
    assert cli.main(["demo", "--synthetic", "--preset", "k5v3", "--scale-rule", "rms", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["k5v3"]
    assert int(rows[0][1]) == ta.KVCodec(64, 5, 3, "rms").bytes_per_token()
    text = " ".join(out.split())   # rich wraps the title and caption to the table's width
    assert "head_dim=64, 4096 tokens, scale rule rms" in text
    assert "K error" in text and "error: ||x̂ - x|| / ||x|| over all 4096 vectors" in text  # says what it measures


def test_a_missing_extra_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)   # `import transformers` raises ImportError
    code, err = run_cli(["demo", "--eval-tokens", "0"], capsys)
    assert code == 2 and err == ("turboattn: error: this command needs the 'transformers' package: "
                                 "pip install 'turboattn[hf]'\n")


def test_console_script_error_is_one_line():
    script = Path(sys.executable).with_name("turboattn")
    out = subprocess.run([str(script), "demo", "--preset", "foo"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("turboattn demo: error: argument --preset: presets look like k4v4, got 'foo' "
                          "(`turboattn demo --help` lists the options)\n")
