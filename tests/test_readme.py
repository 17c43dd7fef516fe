"""README.md: its example runs as written and prints what it says; its tables match the code."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import turboattn as ta
from turboattn.format import codebook

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README, flags=re.S | re.M)


def markdown_table(header_start: str) -> list[list[str]]:
    lines = README[README.index(header_start):].splitlines()
    rows = []
    for line in lines[2:]:  # skip the header and the --- line
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_example_runs_as_written():
    blocks = python_blocks()
    assert len(blocks) == 3
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(blocks[0], "README.md", "exec"), {"__name__": "__readme__"})
    # The comment line after the print shows its output.
    promised = re.search(r"^print\(.*\n# (.*)$", blocks[0], flags=re.M).group(1)
    assert stdout.getvalue().strip() == promised


def test_setup_commands_are_documented():
    assert "make demo" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_formats_table_matches_the_codec():
    rows = markdown_table("| preset | D=64")
    assert len(rows) >= 5
    for preset, *cells, bpe in rows:
        kb, vb = map(int, re.fullmatch(r"k(\d)v(\d)", preset).groups())
        for d, cell in zip((64, 128, 256, 512), cells):
            codec = ta.KVCodec(d, kb, vb)
            nbytes, ratio = re.fullmatch(r"(\d+) B \(([\d.]+)x\)", cell).groups()
            assert int(nbytes) == codec.bytes_per_token()
            assert float(ratio) == pytest.approx(4 * d / codec.bytes_per_token(), abs=0.005)
        assert float(bpe) == pytest.approx(ta.KVCodec(128, kb, vb).bits_per_element(), abs=0.005)


def test_mse_table_matches_the_codebooks():
    lines = README[README.index("| bits | 2"):].splitlines()
    bits = [int(c) for c in lines[0].strip("|").split("|")[1:]]
    values = [float(c) for c in lines[2].strip("|").split("|")[1:]]
    assert bits == [2, 3, 4, 5, 6, 8] and len(values) == len(bits)
    for b, value in zip(bits, values):
        assert value == pytest.approx(codebook.expected_mse(b), rel=1e-3)  # printed to 4 digits


def test_design_page_is_in_the_repo():
    assert "docs/design.md" in README and (ROOT / "docs" / "design.md").is_file()


@pytest.mark.slow
def test_transformers_example_runs():
    """The Hugging Face block loads the packaged model and generates with a 4-bit cache; the static-cache
    block continues it (on a CPU transformers skips the compile and generates eagerly)."""
    namespace = {"__name__": "__readme__"}
    for block in python_blocks()[1:]:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(block, "README.md", "exec"), namespace)
        assert stdout.getvalue().strip()
    assert stdout.getvalue().strip().endswith("False")  # 8 new tokens fit in max_cache_len
