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
from turboattn.format.rotation import SUPPORTED_HEAD_DIMS


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
        for d, cell in zip(SUPPORTED_HEAD_DIMS, row[2:]):
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


BENCH_SUITES = ("decode", "quantize", "prefill", "decode-sweep", "key-transform", "sanitize-cases", "generate")


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
    (["sanitize-cases", "--cases", "all"], "'all' is not one of small, passkey"),
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


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_gpu_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        cli.main(["bench", "sanitize-cases"])
