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
