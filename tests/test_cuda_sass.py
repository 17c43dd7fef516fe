"""The CUDA decode kernel as the extension's own nvcc flags build it, read from a cubin's SASS (no GPU needed;
skipped without nvcc or cuobjdump): three properties that cost time, not correctness, so no output test would see
them go (BENCHMARKS.md).

A lookup of a code is a byte-permute and a shared load whose base, the code table's shared-memory address, ptxas
keeps in a uniform register (`LDS R, [R + UR]`).  Under nvcc's -split-compile it kept that base in a regular register
in k4v4's two-team kernels and added it to every key lookup's offset (`LDS R, [R]`): 46 more instructions per tile
at D = 128, 4.6% of the kernel's time on an H200.  From the `code_tables` symbol it rebuilt that address in every
tile of k3v3's two-team kernel, with an add per key lookup (6% of its time), until the address came through a shuffle
(`uniform_code_tables`).  At D = 512 two set-up orders tried on 2026-11-29 made ptxas do the same to every lookup of
k4v4's loop (128 per two-tile step, 1,467 -> 1,565 and 1,608 instructions).

Below D = 512 the set-up converts the query rows only after the first tiles' loads are issued: converted where they
were loaded, each row's conversion waited on its load ahead of the tiles' loads (one sequence at D = 128 3.7%
slower, H200).

D = 128's plain kernels on 3 CTAs per SM, but k4v3's, skew their steps, a tile's PV product beside the next tile's
scores (1.1-4.5% faster, H200).
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
# <D, KB, VB, EXACT, GA, KB2, SMALL_GRID>, and one-team builds beside them.
BUILDS = {
    "two teams, D = 128": "128, 4, 4, false, 0, 0, false",
    "two teams, D = 64 with exact rows": "64, 4, 4, true, 0, 0, false",
    "two teams, k2v2 at D = 128": "128, 2, 2, false, 0, 0, false",
    "one team, k5v4 at D = 128, interleaved tables": "128, 5, 4, false, 0, 0, false",
    "sliced, k4v4 at D = 512": "512, 4, 4, false, 0, 0, false",
    "two teams, k3v3 at D = 128": "128, 3, 3, false, 0, 0, false",
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


def instructions(sass: str) -> list[tuple[int, str]]:
    """The SASS's instructions in order, as (address, text)."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(SASS_LINE.search, sass.splitlines()) if m]


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a backward branch's span) that holds MMAs: the kernel's main loop."""
    code = instructions(sass)
    best: list[str] = []
    for address, text in code:
        branch = BACKWARD_BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= address]
            if len(body) > len(best) and any("HMMA" in t for t in body):
                best = body
    return best


def sass_of(build: str, tmp_path: Path) -> str:
    """The SASS of decode<build> (its template arguments), compiled for sm_90 with the extension's flags."""
    nvcc, cuobjdump = tools()
    source = tmp_path / "kernel.cu"
    source.write_text('#include "decode.cuh"\n'
                      f"template __global__ void turboattn::decode<{build}>(const turboattn::DecodeParams);\n")
    cubin = tmp_path / "kernel.cubin"
    built = subprocess.run([nvcc, "-std=c++17", "-cubin", *COMMON_NVCC_FLAGS, *cuda_extension.nvcc_flags([(9, 0)]),
                            f"-I{CSRC}", "-o", str(cubin), str(source)], capture_output=True, text=True)
    if "Unsupported gpu architecture" in built.stderr:
        pytest.skip("this nvcc does not build sm_90")
    assert built.returncode == 0, built.stderr[-3000:]
    return subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


@pytest.mark.parametrize("build", BUILDS)
def test_code_lookups_take_the_table_base_from_a_uniform_register(build, tmp_path):
    loop = main_loop(sass_of(BUILDS[build], tmp_path))
    assert loop, "no main loop found in the SASS"
    # Entries are 4 or 8 bytes; 16-byte shared loads are other arrays (D = 512's partial scores, by a register).
    lookups = [t for t in loop if re.match(r"(@!?U?P\w+\s+)?LDS(\.64)?\s", t)]
    assert len(lookups) >= 32, f"{len(lookups)} shared loads in the main loop"
    apart = [t for t in lookups if not re.search(r"\[R\d+(\.\w+)?\+UR\d+", t)]
    assert not apart, f"{len(apart)} of {len(lookups)} lookups without a uniform base, e.g. {apart[0]}"


# Wide tables (decode.cuh's CodeTable::BYTE_ROWS) make a lookup's offset in one byte-permute, the code byte and the
# lane's column its bytes 1 and 0: the 3, 5 and 6-bit ones too, with a row for every byte (EVERY_BYTE), where a
# narrow table masks the byte (a shift and a lop3).  Two-side tables interleaved (Shape::INTERLEAVED) and the teams'
# shared tables (Shape::TEAMS), as template arguments.
BYTE_ROW_BUILDS = {
    "k5v4 at D = 128, interleaved": "128, 5, 4, false, 0, 0, false",
    "k6v6 at D = 128": "128, 6, 6, false, 0, 0, false",
    "k4v3 at D = 128 with exact rows, interleaved": "128, 4, 3, true, 0, 0, false",
    "k3v3 at D = 128, two teams": "128, 3, 3, false, 0, 0, false",
    "k2v2 at D = 128, two teams": "128, 2, 2, false, 0, 0, false",
}
WRITES = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s+(R\d+)\b")


def last_writer(loop: list[str], i: int, register: str) -> int | None:
    """The index of the loop's instruction that last wrote `register` before instruction i (around the back edge)."""
    for j in range(1, len(loop) + 1):
        m = WRITES.match(loop[(i - j) % len(loop)])
        if m and m.group(2) == register and not m.group(1).startswith("ST"):
            return (i - j) % len(loop)
    return None


@pytest.mark.parametrize("build", BYTE_ROW_BUILDS)
def test_wide_lookups_take_their_offset_from_one_byte_permute(build, tmp_path):
    loop = main_loop(sass_of(BYTE_ROW_BUILDS[build], tmp_path))
    lookups = [(i, m.group(1)) for i, t in enumerate(loop)
               if (m := re.match(r"(?:@!?U?P\w+\s+)?LDS(?:\.64)?\s+R\d+,\s*\[(R\d+)", t))]
    assert len(lookups) >= 32, f"{len(lookups)} shared loads in the main loop"
    masked = []
    for i, register in lookups:
        w = last_writer(loop, i, register)
        writer = loop[w] if w is not None else ""
        if not writer.startswith("PRMT"):
            masked.append((loop[i], writer))
    assert not masked, f"{len(masked)} of {len(lookups)} lookups' offsets not one byte-permute, e.g. {masked[0]}"


# Builds whose set-up loads the queries ahead (below D = 512), as template arguments.
SET_UP_BUILDS = {
    "small-grid twin, D = 128": "128, 4, 4, false, 0, 0, true",
    "k2v2 at D = 128": "128, 2, 2, false, 0, 0, false",
    "D = 64": "64, 4, 4, false, 0, 0, false",
    "D = 256": "256, 4, 4, false, 0, 0, false",
}
# A 16-bit query element made a float: bfloat16 by a shift into the high half, float16 by a conversion.
QUERY_CONVERSION = re.compile(r"(IMAD\.U32|IMAD\.SHL\.U32) R\d+, R\d+, 0x10000\b"
                              r"|SHF\.L\.U32 R\d+, R\d+, 0x10\b|HADD2\.F32")


@pytest.mark.parametrize("build", SET_UP_BUILDS)
def test_the_set_up_converts_the_queries_after_the_tiles_loads_are_issued(build, tmp_path):
    code = [text for _, text in instructions(sass_of(SET_UP_BUILDS[build], tmp_path))]
    first_tile = next((i for i, t in enumerate(code) if "LDG.E.EF" in t), None)   # the codes' streamed loads
    assert first_tile is not None, "no streamed load of the codes in the SASS"
    ahead = code[:first_tile]
    assert any("LDG.E.U16" in t for t in ahead), "the 16-bit query loads are not issued before the tiles' loads"
    early = [t for t in ahead if QUERY_CONVERSION.search(t)]
    assert not early, f"{len(early)} query conversions before the tiles' loads, e.g. {early[0]}"


# Skewed steps (decode.cuh's Shape::SKEWED) compute a tile's scores beside the tile before's PV product: all of a
# step's MMAs lie in one branch-free stretch ahead of the vote on the row maximum, where ptxas interleaves the two
# chains; a one-tile step's PV MMAs follow its vote.  (build's template arguments, skewed)
SKEW_BUILDS = {
    "k5v4 at D = 128, skewed": ("128, 5, 4, false, 0, 0, false", True),
    "k8v8 at D = 128, skewed": ("128, 8, 8, false, 0, 0, false", True),
    "k4v4 at D = 128, one-tile steps": ("128, 4, 4, false, 0, 0, false", False),
}


@pytest.mark.parametrize("build", SKEW_BUILDS)
def test_skewed_steps_run_both_products_before_the_vote(build, tmp_path):
    arguments, skewed = SKEW_BUILDS[build]
    loop = main_loop(sass_of(arguments, tmp_path))
    mmas = [i for i, t in enumerate(loop) if "HMMA" in t]
    votes = [i for i, t in enumerate(loop) if "VOTE.ANY" in t]
    assert len(mmas) == 16 and len(votes) == 1, f"{len(mmas)} MMAs and {len(votes)} votes in the main loop"
    branches = [t for t in loop[mmas[0]:mmas[-1]] if re.search(r"\bBRA\b", t)]
    if skewed:
        assert mmas[-1] < votes[0], "MMAs after the vote"
        assert not branches, f"{len(branches)} branches between the MMAs, e.g. {branches[0]}"
    else:
        assert mmas[-1] > votes[0], "a one-tile step's PV MMAs follow its vote"
