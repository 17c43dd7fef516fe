"""The CUDA decode kernel's main loop as the extension's own nvcc flags build it, read from a cubin's SASS (no GPU
needed; skipped without nvcc or cuobjdump).

A lookup of a code is a byte-permute and a shared load whose base, the code table's shared-memory address, ptxas
keeps in a uniform register (`LDS R, [R + UR]`).  Under nvcc's -split-compile it kept that base in a regular register
in k4v4's two-team kernels and added it to every key lookup's offset (`LDS R, [R]`): 46 more instructions per tile
at D = 128, 4.6% of the kernel's time on an H200 (BENCHMARKS.md), with no change of output that a test would see.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

from turboattn.ops import cuda_extension

CSRC = Path(cuda_extension.__file__).parent / "cached" / "csrc"
# The builds whose CTAs hold two teams that share one table (decode.cuh's Shape::TEAMS), as template arguments
# <D, KB, VB, EXACT, GA, KB2, SMALL_GRID>, and a one-team build beside them.
BUILDS = {
    "two teams, D = 128": "128, 4, 4, false, 0, 0, false",
    "two teams, D = 64 with exact rows": "64, 4, 4, true, 0, 0, false",
    "one team, k2v2 at D = 128": "128, 2, 2, false, 0, 0, false",
}
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BACKWARD_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def tools() -> tuple[str, str]:
    nvcc = shutil.which("nvcc")
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:   # Triton's NVIDIA backend carries one
        try:
            from triton import knobs
            cuobjdump = knobs.nvidia.cuobjdump.path
        except (ImportError, AttributeError, RuntimeError):
            cuobjdump = None
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    return nvcc, cuobjdump


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a backward branch's span) that holds MMAs: the kernel's main loop."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(SASS_LINE.search, sass.splitlines()) if m]
    best: list[str] = []
    for address, text in code:
        branch = BACKWARD_BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= address]
            if len(body) > len(best) and any("HMMA" in t for t in body):
                best = body
    return best


@pytest.mark.parametrize("build", BUILDS)
def test_code_lookups_take_the_table_base_from_a_uniform_register(build, tmp_path):
    nvcc, cuobjdump = tools()
    source = tmp_path / "kernel.cu"
    source.write_text('#include "decode.cuh"\n'
                      f"template __global__ void turboattn::decode<{BUILDS[build]}>(const turboattn::DecodeParams);\n")
    cubin = tmp_path / "kernel.cubin"
    built = subprocess.run([nvcc, "-std=c++17", "-cubin", *COMMON_NVCC_FLAGS, *cuda_extension.nvcc_flags([(9, 0)]),
                            f"-I{CSRC}", "-o", str(cubin), str(source)], capture_output=True, text=True)
    if "Unsupported gpu architecture" in built.stderr:
        pytest.skip("this nvcc does not build sm_90")
    assert built.returncode == 0, built.stderr[-3000:]
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    loop = main_loop(sass)
    assert loop, "no main loop found in the SASS"
    lookups = [t for t in loop if re.match(r"(@!?U?P\w+\s+)?LDS\b", t)]
    assert len(lookups) >= 32, f"{len(lookups)} shared loads in the main loop"
    apart = [t for t in lookups if not re.search(r"\[R\d+(\.\w+)?\+UR\d+", t)]
    assert not apart, f"{len(apart)} of {len(lookups)} lookups without a uniform base, e.g. {apart[0]}"
