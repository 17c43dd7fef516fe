"""Every kernel under NVIDIA compute-sanitizer (pytest -m gpu; a few minutes on an H100).

`turboattn bench sanitize-cases` launches small cases of every kernel: quantize-append, the Triton cached attention
and its merge, the CUDA decode kernel at every head dim and bit pair it serves, the cache options, keys in channel
groups on the CUDA kernels, the dense prefill kernel with its tile classification, and the dense split-K decode
kernel with its reduction (see its docstring).  Each case set runs in its own process under memcheck (out-of-bounds
and misaligned accesses) and racecheck (shared-memory hazards).  A run passes when the sanitizer reports no error
and the command exits 0, which it does only if every output was finite.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer")]

CASE_SETS = ("small", "passkey", "cuda", "options", "groups", "flash")


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("cases", CASE_SETS)
def test_kernels_are_clean_under_compute_sanitizer(tool, cases):
    command = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "3",
               sys.executable, "-m", "turboattn.cli.main", "bench", "sanitize-cases", "--cases", cases,
               *(["--prompt", "600"] if cases == "passkey" else [])]
    # The CUDA kernel's extension and Triton's cache are built before (by the other GPU tests or the first
    # case): a cold build under the sanitizer is only slower, not different.
    run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    report = run.stdout + run.stderr
    summaries = re.findall(r"(ERROR|RACECHECK) SUMMARY: (\d+) (errors?|hazards?)", report)
    assert run.returncode == 0, f"exit status {run.returncode}:\n{report[-4000:]}"
    assert summaries and all(count == "0" for _, count, _ in summaries), report[-4000:]
