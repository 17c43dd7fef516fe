"""`turboattn bench ab` (cli/bench/ab.py): each side's tree and build, the revision check before any GPU work, and
the run's bookkeeping (rounds, best times, the ratio, the outputs' difference) with the GPU side stubbed."""

import json
import os
from pathlib import Path

import pytest
import torch

from turboattn.cli import main as cli
from turboattn.cli.bench import ab


def test_this_side_is_the_running_tree():
    side = ab.this_side()
    assert (side.src / "turboattn" / "cli" / "bench" / "ab.py").resolve() == Path(ab.__file__).resolve()
    assert side.extensions is None   # torch's default build directory: the tree's usual build


def test_a_revision_is_extracted_once_with_its_own_builds(tmp_path):
    root = ab.repo_root()
    commit = ab.resolve(root, "HEAD")
    assert len(commit) == 40
    side = ab.archived_side(root, commit, tmp_path)
    assert (side.src / "turboattn" / "__init__.py").is_file()
    assert side.extensions == tmp_path / commit / "torch_extensions"
    marker = side.src / "marker"
    marker.write_text("kept")
    assert ab.archived_side(root, commit, tmp_path) == side and marker.exists()   # reused, not extracted again


def test_an_unknown_revision_stops_before_any_gpu_work(tmp_path, monkeypatch):
    monkeypatch.setattr(ab, "require_cuda", lambda: pytest.fail("reached the GPU check"))
    with pytest.raises(SystemExit, match="'no-such-revision' is not a commit"):
        cli.main(["bench", "ab", "--against", "no-such-revision", "--out", str(tmp_path)])


def test_each_side_finds_its_own_tree_and_build(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    side = ab.Side("old", Path("/trees/old/src"), Path("/trees/old/ext"))
    env = ab.side_env(side)
    assert env["PYTHONPATH"].split(os.pathsep) == ["/trees/old/src", "elsewhere"]
    assert env["TORCH_EXTENSIONS_DIR"] == "/trees/old/ext"
    monkeypatch.delenv("PYTHONPATH")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    env = ab.side_env(ab.Side("this tree", Path("/tree/src"), None))
    assert env["PYTHONPATH"] == "/tree/src" and "TORCH_EXTENSIONS_DIR" not in env


def test_a_run_alternates_the_sides_and_compares_them(tmp_path, monkeypatch):
    """Two rounds of two sides: the table's times by round, the best-over-best ratio and the outputs' relative
    difference come from what the sides reported."""
    other = ab.Side("other", tmp_path / "src", tmp_path / "ext")
    calls = []

    def fake_side(side, args):
        calls.append(side.name)
        times = {"this tree": [10.0, 9.0], "other": [12.0, 13.0]}[side.name]
        out = Path(args[args.index("--outputs") + 1])
        value = torch.ones(1, 2, 1, 4) * (1.0 if side.name == "this tree" else 1.01)
        torch.save({"1,8,2,64,128/4,4": value}, out)
        return [{"shape": "1,8,2,64,128", "bits": "4,4", "us": times[calls.count(side.name) - 1]}]

    monkeypatch.setattr(ab, "archived_side", lambda root, commit: other)   # the revision is still resolved
    monkeypatch.setattr(ab, "build_sides", lambda sides: None)
    monkeypatch.setattr(ab, "require_cuda", lambda: None)
    monkeypatch.setattr(ab, "environment", lambda: {"gpu": "a GPU"})
    monkeypatch.setattr(ab, "run_side", fake_side)
    assert cli.main(["bench", "ab", "--against", "HEAD", "--shapes", "1,8,2,64,128", "--bits", "k4v4",
                     "--rounds", "2", "--out", str(tmp_path / "out")]) == 0
    assert calls == ["this tree", "other", "this tree", "other"]
    result = json.loads((tmp_path / "out" / "ab.json").read_text())
    (row,) = result["rows"]
    assert row["this tree"] == [10.0, 9.0] and row["other"] == [12.0, 13.0]
    assert row["ratio"] == pytest.approx(9.0 / 12.0)
    assert row["rel_difference"] == pytest.approx(0.01 / 1.01, rel=1e-5)
    assert result["commit"] == ab.resolve(ab.repo_root(), "HEAD") and len(result["records"]) == 4


def test_relative_difference():
    b = torch.tensor([2.0, -4.0])
    assert ab.relative_difference(b + torch.tensor([0.0, 0.4]), b) == pytest.approx(0.1)
    assert ab.relative_difference(torch.zeros(2), torch.zeros(2)) == 0.0


def test_a_folder_holding_a_tree_is_a_side_too(tmp_path):
    """Where no .git travels, --against names a folder with another tree (its src/ or the package's parent)."""
    (tmp_path / "base" / "src" / "turboattn").mkdir(parents=True)
    (tmp_path / "base" / "src" / "turboattn" / "__init__.py").write_text("")
    side, commit = ab.other_side(str(tmp_path / "base"))
    assert commit is None and side.src == (tmp_path / "base" / "src").resolve()
    assert side.extensions == (tmp_path / "base" / "torch_extensions").resolve() and side.name == "base"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no turboattn tree"):
        ab.other_side(str(tmp_path / "empty"))


def test_cache_options_reach_each_side_only_when_set(tmp_path, monkeypatch):
    """--scale-dtype / --exact-first / --exact-recent go to both sides' scripts; at their defaults nothing is added,
    so a side older than an option still runs."""
    seen = []

    def fake_side(side, args):
        seen.append(args[args.index("--outputs") + 2:])
        torch.save({"1,8,2,64,128/4,3": torch.ones(1)}, Path(args[args.index("--outputs") + 1]))
        return [{"shape": "1,8,2,64,128", "bits": "4,3", "us": 1.0}]

    monkeypatch.setattr(ab, "archived_side", lambda root, commit: ab.Side("other", tmp_path, tmp_path))
    monkeypatch.setattr(ab, "build_sides", lambda sides: None)
    monkeypatch.setattr(ab, "require_cuda", lambda: None)
    monkeypatch.setattr(ab, "environment", lambda: {"gpu": "a GPU"})
    monkeypatch.setattr(ab, "run_side", fake_side)
    base = ["bench", "ab", "--against", "HEAD", "--shapes", "1,8,2,64,128", "--bits", "k4v3", "--rounds", "1"]
    assert cli.main(base + ["--out", str(tmp_path / "a")]) == 0
    assert cli.main(base + ["--scale-dtype", "bfloat16", "--exact-first", "4", "--exact-recent", "64",
                            "--out", str(tmp_path / "b")]) == 0
    options = ["--scale-dtype", "bfloat16", "--exact-first", "4", "--exact-recent", "64"]
    assert seen == [[], [], options, options]


def test_the_side_script_builds_only_the_options_set():
    """ab_side.py turns the options into KVCodec(scale_dtype=) and QuantizedKVCache(exact_first=, exact_recent=)."""
    from argparse import Namespace

    from turboattn.cli.bench import ab_side
    plain = Namespace(scale_dtype="float32", exact_first=0, exact_recent=0)
    assert ab_side.options_of(plain) == ({}, {})
    preset = Namespace(scale_dtype="bfloat16", exact_first=4, exact_recent=64)
    assert ab_side.options_of(preset) == ({"scale_dtype": torch.bfloat16}, {"exact_first": 4, "exact_recent": 64})
    assert ab_side.options_of(Namespace(scale_dtype="float32", exact_first=0, exact_recent=8)) == (
        {}, {"exact_recent": 8})
