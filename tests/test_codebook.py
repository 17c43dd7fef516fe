"""Codebooks of N(0,1): Lloyd–Max (the published tables, the Lloyd conditions, convergence) and the 8-bit uniform
levels.

The checks that do not go through codebook.py's own formulas integrate the
normal density with Gauss–Legendre quadrature per cell (the integrand is
smooth inside a cell, so 200 nodes are exact to float64 precision).
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from turboattn.format import codebook

ALL_BITS = range(codebook.MIN_BITS, codebook.MAX_BITS + 1)
LLOYD_MAX_FORMAT_BITS = [b for b in ALL_BITS if b not in codebook.UNIFORM_BITS]
TABLE_4BIT = (0.1283950, 0.3880483, 0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172, 2.7325896)
# Published MSEs (Max 1960; 1 bit exact): each to half a unit in its last printed digit.
KNOWN_MSE = {1: (1 - 2 / math.pi, 1e-14), 2: (0.1175, 0.5e-4), 3: (0.03455, 0.5e-5), 4: (0.009501, 0.5e-6)}
# Beyond +-12 the normal density is below 1e-31: truncating there is exact in float64.
FAR = 12.0
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(200)


def _pdf(x):
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def cell_moments(table: np.ndarray):
    """Per nearest-centroid cell of `table`: probability, first and second moment of N(0,1)."""
    edges = np.concatenate([[-FAR], 0.5 * (table[1:] + table[:-1]), [FAR]])
    lo, hi = edges[:-1, None], edges[1:, None]
    x = 0.5 * (hi - lo) * _NODES + 0.5 * (hi + lo)  # [cells, nodes]
    w = 0.5 * (hi - lo) * _WEIGHTS * _pdf(x)
    return w.sum(1), (w * x).sum(1), (w * x * x).sum(1)


def quadrature_mse(table: np.ndarray) -> float:
    p, m1, m2 = cell_moments(table)
    return float((m2 - 2 * table * m1 + table**2 * p).sum())


def plain_lloyd(bits: int, checkpoints) -> list[np.ndarray]:
    """Textbook Lloyd iteration from the normal quantiles of the cell midpoints (independent of
    codebook.py); returns the table after each number of iterations in `checkpoints`."""
    from statistics import NormalDist
    n = 1 << bits
    c = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    tables = []
    for it in range(1, max(checkpoints) + 1):
        p, m1, _ = cell_moments(c)
        c = m1 / p
        if it in checkpoints:
            tables.append(c)
    return tables


def test_4bit_table_matches_published_values():
    for dtype in (torch.float64, torch.float32):
        c = codebook.centroids(4, dtype).double()
        assert c.shape == (16,)
        torch.testing.assert_close(c[8:], torch.tensor(TABLE_4BIT, dtype=torch.float64), atol=1e-6, rtol=0)
        torch.testing.assert_close(c[:8], -torch.tensor(TABLE_4BIT[::-1], dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits", LLOYD_MAX_FORMAT_BITS)
def test_table_shape_order_symmetry_and_boundaries(bits):
    c = codebook.centroids(bits, torch.float64)
    assert torch.equal(c, codebook.lloyd_max(bits, torch.float64))
    t = codebook.boundaries(bits, torch.float64)
    assert c.shape == (2**bits,) and t.shape == (2**bits - 1,)
    assert bool((c[1:] > c[:-1]).all())
    assert torch.equal(c, -c.flip(0))  # exactly symmetric, so a sign bit + magnitude lookup is exact
    torch.testing.assert_close(t, 0.5 * (c[1:] + c[:-1]), rtol=0, atol=0)
    # The float32 tables are the float64 ones rounded once.
    assert torch.equal(codebook.centroids(bits), c.float())
    assert torch.equal(codebook.boundaries(bits), t.float())


@pytest.mark.parametrize("bits", ALL_BITS)
def test_lloyd_conditions_hold(bits):
    c = codebook.lloyd_max(bits, torch.float64)
    assert codebook.lloyd_residual(c) < codebook.CONVERGED_RESIDUAL
    # Independently: every centroid is the conditional mean of its cell.
    p, m1, _ = cell_moments(c.numpy())
    np.testing.assert_allclose(c.numpy(), m1 / p, rtol=0, atol=1e-9)
    assert abs(p.sum() - 1) < 1e-13


@pytest.mark.parametrize("bits", ALL_BITS)
def test_mse_matches_quadrature(bits):
    c = codebook.centroids(bits, torch.float64)
    mse = codebook.expected_mse(bits)
    assert mse == pytest.approx(quadrature_mse(c.numpy()), rel=1e-10, abs=1e-15)
    assert codebook.quantizer_mse(c) == mse


@pytest.mark.parametrize("bits", sorted(KNOWN_MSE))
def test_known_mse(bits):
    value, tol = KNOWN_MSE[bits]
    assert abs(codebook.expected_mse(bits) - value) <= tol


def test_mse_falls_about_fourfold_per_bit():
    # Panter–Dite: MSE ~ (pi*sqrt(3)/2) 4^-b at high rate; each extra bit cuts it by 3..4.
    mse = [codebook.quantizer_mse(codebook.lloyd_max(b, torch.float64)) for b in ALL_BITS]
    ratios = [a / b for a, b in zip(mse, mse[1:])]
    assert all(3.0 < r < 4.0 for r in ratios), ratios
    assert mse[-1] == pytest.approx(math.pi * math.sqrt(3) / 2 * 4.0**-8, rel=0.05)


@pytest.mark.parametrize("bits", [6, 7, 8])
def test_tables_beat_plain_lloyd_which_crawls(bits):
    """Plain Lloyd's MSE decreases toward ours but is still above it after 300 iterations."""
    ours = codebook.quantizer_mse(codebook.lloyd_max(bits, torch.float64))
    tables = plain_lloyd(bits, (10, 30, 100, 300))
    history = [quadrature_mse(c) for c in tables]
    assert all(a > b for a, b in zip(history, history[1:])), history
    assert history[-1] > ours * (1 + 1e-9), (history, ours)
    # ... and its tables are visibly not converged, while ours are to float64 noise.
    assert codebook.lloyd_residual(torch.from_numpy(tables[-1])) > 1e3 * codebook.CONVERGED_RESIDUAL


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_table_is_a_local_minimum(bits, gen):
    """Moving any centroid (keeping the order) raises the MSE: our tables sit at the optimum."""
    c = codebook.lloyd_max(bits, torch.float64)
    ours = codebook.quantizer_mse(c)
    gaps = torch.cat([c[1:] - c[:-1], c[-1:] - c[-2:-1]])
    for _ in range(5):
        step = 1e-3 * gaps * (2 * torch.rand(c.shape, generator=gen, dtype=torch.float64) - 1)
        assert codebook.quantizer_mse(c + step) > ours
    for i in (0, len(c) // 2, len(c) - 1):
        for sign in (-1, 1):
            moved = c.clone()
            moved[i] += sign * 1e-3 * gaps[i]
            assert codebook.quantizer_mse(moved) > ours


@pytest.mark.parametrize("bits", codebook.UNIFORM_BITS)
def test_uniform_levels_are_exact_steps_of_a_32nd(bits):
    c = codebook.centroids(bits, torch.float64)
    half = 1 << (bits - 1)
    assert torch.equal(c, (torch.arange(1 << bits, dtype=torch.float64) - half) / 32)
    assert c[half] == 0 and c[0] == -half / 32
    torch.testing.assert_close(codebook.boundaries(bits, torch.float64), 0.5 * (c[1:] + c[:-1]), rtol=0, atol=0)
    # Every level is a float16 number, and the float32 table is the float64 one.
    assert torch.equal(c.half().double(), c)
    assert torch.equal(codebook.centroids(bits), c.float())


def test_8bit_levels_from_the_code_byte_in_float16():
    """The CUDA kernel's conversion (decode.cuh: CodeTable<8>): the byte under exponent bits 0x64 is the float16
    1024 + i, and one float16 fma (1/32, -36) makes level i exactly; emulated here by rounding the exact fma
    result once to float16."""
    i = torch.arange(256, dtype=torch.int32)
    biased = ((0x64 << 8) | i).to(torch.int16).view(torch.float16)
    assert torch.equal(biased.double(), 1024.0 + i.double())
    one_rounding = (biased.double() * (1 / 32) - 36.0).half()   # the product and sum exact in float64
    assert torch.equal(one_rounding.double(), codebook.centroids(8, torch.float64))


def test_8bit_step_is_near_the_best_uniform_step_and_beats_7_bit_lloyd_max():
    def mse(step):
        return codebook.quantizer_mse((torch.arange(256, dtype=torch.float64) - 128) * step)
    ours = codebook.expected_mse(8)
    assert ours == pytest.approx(mse(1 / 32), rel=1e-12)
    best = min(mse(s) for s in torch.linspace(0.028, 0.034, 121).tolist())
    assert ours <= best * 1.005   # 1.0037: the best step is about 0.0308
    lloyd7 = codebook.quantizer_mse(codebook.lloyd_max(7, torch.float64))
    lloyd8 = codebook.quantizer_mse(codebook.lloyd_max(8, torch.float64))
    assert lloyd8 < ours < lloyd7 / 1.8


def test_returned_tables_are_copies():
    for bits in (4, 8):
        c = codebook.centroids(bits, torch.float64)
        top = c[-1].item()
        c.mul_(2)
        assert codebook.centroids(bits, torch.float64)[-1].item() == top
    c = codebook.centroids(4, torch.float64)
    assert c[-1].item() == pytest.approx(TABLE_4BIT[-1], abs=1e-6)


def test_no_table_is_computed_at_import():
    code = "import turboattn, turboattn.format.codebook as c; print(c._solve.cache_info().currsize)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


@pytest.mark.parametrize("bits", [0, 9, -1, 4.0, "4", True, None])
def test_bad_bits_raise(bits):
    with pytest.raises(ValueError, match="bits"):
        codebook.centroids(bits)


def test_the_cuda_kernels_codebooks_match():
    """ops/cached/csrc/codebooks.h (the decode kernel's table build reads its constants) is cuda_header()'s text:
    the codebooks as float16, rounded from float32 as the kernel rounded the device tables."""
    from pathlib import Path

    import turboattn.ops.cached as cached
    header = Path(cached.__file__).parent / "csrc" / "codebooks.h"
    assert header.read_text() == codebook.cuda_header()
    for bits in (2, 4, 6):
        halves = codebook.centroids(bits, torch.float32).to(torch.float16).view(torch.int16).tolist()
        assert f"0x{halves[0] & 0xFFFF:04x}" in header.read_text()
