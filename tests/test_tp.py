"""The tensor-parallel check (turboattn.cli.tp): its comparison rule, and a 2-rank run on the CPU (gloo).

On GPUs the same script runs under `torchrun --nproc-per-node 2 -m turboattn.cli.tp` (README: Several GPUs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import turboattn
from turboattn.cli.tp import LOGIT_TOL, Run, compare_greedy

pytest.importorskip("transformers")



def logits_for(tokens, vocab=4, margin=1.0):
    """[steps, B, vocab]: each step's token ahead of the others by `margin` (per step: a list of margins)."""
    steps = len(tokens[0])
    out = torch.zeros(steps, len(tokens), vocab)
    for b, seq in enumerate(tokens):
        for s, t in enumerate(seq):
            out[s, b, t] = margin[s] if isinstance(margin, list) else margin
    return out


def test_equal_runs_pass():
    tokens = [[1, 2, 3], [0, 0, 1]]
    run = Run(torch.tensor(tokens), logits_for(tokens))
    ok, msg = compare_greedy(run, Run(torch.tensor(tokens), logits_for(tokens)))
    assert ok and "tokens equal" in msg


def test_logit_error_before_parting_fails():
    tokens = [[1, 2, 3]]
    got = logits_for(tokens)
    got[1, 0, 0] += 5 * LOGIT_TOL        # same tokens, but the logits moved
    ok, msg = compare_greedy(Run(torch.tensor(tokens), got), Run(torch.tensor(tokens), logits_for(tokens)))
    assert not ok and "before the tokens part" in msg


def test_parting_at_a_near_tie_passes_and_elsewhere_fails():
    want_tokens, got_tokens = [[1, 2, 3]], [[1, 0, 0]]
    # Step 1: want's top-2 gap is tiny, got's logits differ by less than the tolerance: a near-tie.
    want = logits_for(want_tokens, margin=[1.0, 0.3 * LOGIT_TOL, 1.0])
    got = want.clone()
    got[1, 0, 0] += 0.5 * LOGIT_TOL
    got[2] = logits_for(got_tokens)[2]   # after parting: anything
    ok, msg = compare_greedy(Run(torch.tensor(got_tokens), got), Run(torch.tensor(want_tokens), want))
    assert ok and "parts at step 1" in msg
    # The same parting where want's choice was clear: the logits must have moved by more than the tolerance.
    clear = logits_for(want_tokens, margin=1.0)
    moved = clear.clone()
    moved[1, 0, 0] += 2.0
    ok, msg = compare_greedy(Run(torch.tensor(got_tokens), moved), Run(torch.tensor(want_tokens), clear))
    assert not ok


def test_two_ranks_on_the_cpu():
    """torchrun with 2 gloo ranks: tokens, per-rank heads and bytes, gathered keys (the script's own checks)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    src = str(Path(turboattn.__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "turboattn.cli.tp", "--layers", "2", "--new-tokens", "12"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout
    assert "PASS" in lines and lines.count(": ok:") == 2
    assert "rank 1: KV heads per layer [2]" in lines and "(0.500 of the single-device" in lines


def test_outside_torchrun_says_how_to_run(capsys, monkeypatch):
    from turboattn.cli import tp
    monkeypatch.delenv("RANK", raising=False)
    assert tp.main([]) == 2
    assert "torchrun --nproc-per-node 2 -m turboattn.cli.tp" in capsys.readouterr().err
