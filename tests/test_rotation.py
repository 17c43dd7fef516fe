"""Randomized Hadamard rotation: the sign table of DESIGN.md, orthogonality, round trips; the Hartley
factor of head dims that are not powers of two."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from turboattn.format import rotation

DIMS = (64, 128, 256, 512)
# Not powers of two: D = P * m with m = 3, 5, 7, 15, 17, 31 (P from 16 to 64), plus the smallest power of two.
OTHER_DIMS = (32, 48, 80, 96, 112, 160, 192, 240, 272, 320, 480, 496)
# DESIGN.md's table, copied as printed there (not from rotation.py).
SIGN_TABLE_HEX = """a7 3b 91 f4 6d c2 58 0e b3 7f 24 d6 89 45 ea 1c 63 af d8 52 97 0b e1 3d
    76 c4 19 fe 4a 85 2c db d3 4e a8 17 9c 5b e6 31 72 b9 0d f5 43 8a 6e c7
    58 2f 94 e1 b6 3d 0a 7c c5 61 d8 4f a3 97 1e 85"""
U32, U64 = 2.0**-24, 2.0**-53


def design_signs(d: int) -> torch.Tensor:
    # Least significant bit first within each byte = bit j of the little-endian integer.
    table = int.from_bytes(bytes.fromhex(SIGN_TABLE_HEX.replace("\n", " ")), "little")
    return torch.tensor([-1.0 if (table >> j) & 1 else 1.0 for j in range(d)], dtype=torch.float64)


def sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_sign_table_first_byte():
    # 0xa7 = 0b10100111: bits 0, 1, 2, 5, 7 set.
    assert rotation.signs(64)[:8].tolist() == [-1, -1, -1, 1, 1, -1, 1, -1]
    assert len(bytes.fromhex(SIGN_TABLE_HEX.replace("\n", " "))) * 8 == 512


@pytest.mark.parametrize("d", DIMS)
def test_signs_follow_design_table(d):
    s = rotation.signs(d, dtype=torch.float64)
    assert torch.equal(s, design_signs(d))
    assert torch.equal(s, rotation.signs(512, dtype=torch.float64)[:d])  # a smaller D uses the first D bits


@pytest.mark.parametrize("d", DIMS)
def test_walsh_hadamard_is_sylvester(d):
    assert torch.equal(rotation.walsh_hadamard(torch.eye(d, dtype=torch.float64)), sylvester(d))


@pytest.mark.parametrize("d", DIMS)
def test_rotation_matrix_is_orthogonal_and_matches_definition(d, gen):
    r = rotation.rotation_matrix(d)
    expected = sylvester(d) @ torch.diag(design_signs(d)) / math.sqrt(d)
    torch.testing.assert_close(r, expected, rtol=0, atol=4 * U64)
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=2 * d * U64)
    x = torch.randn(5, d, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(rotation.rotate(x), x @ r.T, rtol=0, atol=d * U64 * float(x.abs().max()))
    torch.testing.assert_close(rotation.unrotate(x), x @ r, rtol=0, atol=d * U64 * float(x.abs().max()))


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_within_rounding(d, dtype, gen):
    """Each of the log2(D) butterfly stages, the sign flip and the 1/sqrt(D) scaling rounds once
    per coordinate, relative to the vector's norm: bound 2 * (log2 D + 2) * u * ||x||."""
    u = U32 if dtype == torch.float32 else U64
    x = torch.randn(64, d, generator=gen, dtype=torch.float64).to(dtype)
    y = rotation.rotate(x)
    assert y.dtype == dtype
    back = rotation.unrotate(y)
    err = (back.double() - x.double()).norm(dim=-1) / x.double().norm(dim=-1)
    assert float(err.max()) <= 2 * (math.log2(d) + 2) * u
    # Norm preservation, same budget.
    ratio = y.double().norm(dim=-1) / x.double().norm(dim=-1)
    assert float((ratio - 1).abs().max()) <= (math.log2(d) + 2) * u


@pytest.mark.parametrize("d", [64, 256])
def test_round_trip_is_bitwise_exact_on_integers(d, gen):
    # For D a power of 4, 1/sqrt(D) is a power of two and H applied to small integers is exact.
    x = torch.randint(-1000, 1000, (16, d), generator=gen).double()
    assert torch.equal(rotation.unrotate(rotation.rotate(x)), x)
    assert torch.equal(rotation.rotate(rotation.unrotate(x)), x)


@given(shape=st.lists(st.integers(1, 3), max_size=3), d=st.sampled_from(DIMS), seed=st.integers(0, 2**31))
def test_any_leading_shape(shape, d, seed):
    x = torch.randn(*shape, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    flat = rotation.rotate(x.reshape(-1, d))
    assert torch.equal(rotation.rotate(x), flat.reshape(*shape, d))


def test_signs_are_copies():
    s = rotation.signs(64)
    s.fill_(0)
    assert rotation.signs(64).abs().min().item() == 1


@pytest.mark.parametrize("d", [16, 100, 520, 1024, 128.0, True, "128"])
def test_bad_head_dim_raises(d):
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16 from 32 to 512"):
        rotation.signs(d)


@pytest.mark.parametrize("d", [0, 24, 100, 1024])
def test_rotate_unsupported_length_raises(d):
    for f in (rotation.rotate, rotation.unrotate):
        with pytest.raises(ValueError, match="head_dim"):
            f(torch.zeros(3, d))


def test_supported_head_dims():
    assert rotation.SUPPORTED_HEAD_DIMS == tuple(range(32, 513, 16))
    assert rotation.POWER_OF_TWO_HEAD_DIMS == (32, 64, 128, 256, 512)
    assert {rotation.odd_factor(d) for d in rotation.SUPPORTED_HEAD_DIMS} == set(range(1, 33, 2))


# -- head dims that are not powers of two: R = (H_P ⊗ Q_m) diag(s) / sqrt(P) ------------------------

def hartley_by_definition(m: int) -> torch.Tensor:
    """Q[k, n] = (cos + sin)(2 pi k n / m) / sqrt(m), computed here with numpy's float64 (not rotation.py)."""
    k = np.arange(m)[:, None] * np.arange(m)[None, :]
    t = 2 * np.pi * k / m
    return torch.from_numpy((np.cos(t) + np.sin(t)) / np.sqrt(m))


@pytest.mark.parametrize("m", range(1, 33, 2))
def test_hartley_is_symmetric_orthogonal_involution(m):
    q = rotation.hartley(m)
    # Each entry is one cos + one sin, rounded: a few ulps; the identity holds to float64 precision.
    torch.testing.assert_close(q, hartley_by_definition(m), rtol=0, atol=8 * m * U64)
    assert torch.equal(q, q.T)
    torch.testing.assert_close(q @ q, torch.eye(m, dtype=torch.float64), rtol=0, atol=4 * m * U64)


@pytest.mark.parametrize("d", OTHER_DIMS)
def test_other_rotation_is_orthogonal_and_matches_definition(d, gen):
    m = rotation.odd_factor(d)
    p = d // m
    assert p & (p - 1) == 0 and m % 2 == 1
    r = rotation.rotation_matrix(d)
    expected = torch.kron(sylvester(p), hartley_by_definition(m)) @ torch.diag(design_signs(d)) / math.sqrt(p)
    torch.testing.assert_close(r, expected, rtol=0, atol=16 * m * U64)
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=2 * d * U64)
    x = torch.randn(5, d, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(rotation.rotate(x), x @ r.T, rtol=0, atol=d * U64 * float(x.abs().max()))
    torch.testing.assert_close(rotation.unrotate(x), x @ r, rtol=0, atol=d * U64 * float(x.abs().max()))


@pytest.mark.parametrize("d", OTHER_DIMS)
def test_rotation_mixes_every_coordinate(d):
    """Every output depends on every input (no entry of R is zero), so an outlier channel is spread over all D
    outputs, none of which takes more than 2/D of its energy (|cas| <= sqrt 2)."""
    r = rotation.rotation_matrix(d).abs()
    assert float(r.min()) > 0.03 / math.sqrt(d)  # the smallest sqrt(m) |Q_kn| of any m <= 31 is 0.036 (m = 31)
    assert float(r.max()) <= math.sqrt(2 / d) * (1 + 1e-12)


@pytest.mark.parametrize("d", OTHER_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_other_round_trip_within_rounding(d, dtype, gen):
    """log2(P) butterfly stages, the m-term Hartley sums, the sign flip and the scaling each round once per
    coordinate, relative to the vector's norm: bound 2 * (log2 P + m + 2) * u * ||x||."""
    u = U32 if dtype == torch.float32 else U64
    m = rotation.odd_factor(d)
    budget = math.log2(d // m) + m + 2
    x = torch.randn(64, d, generator=gen, dtype=torch.float64).to(dtype)
    y = rotation.rotate(x)
    assert y.dtype == dtype
    err = (rotation.unrotate(y).double() - x.double()).norm(dim=-1) / x.double().norm(dim=-1)
    assert float(err.max()) <= 2 * budget * u
    ratio = y.double().norm(dim=-1) / x.double().norm(dim=-1)
    assert float((ratio - 1).abs().max()) <= budget * u


@given(shape=st.lists(st.integers(1, 3), max_size=3), d=st.sampled_from(OTHER_DIMS), seed=st.integers(0, 2**31))
def test_other_dims_any_leading_shape(shape, d, seed):
    x = torch.randn(*shape, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert torch.equal(rotation.rotate(x), rotation.rotate(x.reshape(-1, d)).reshape(*shape, d))
    assert torch.equal(rotation.unrotate(x), rotation.unrotate(x.reshape(-1, d)).reshape(*shape, d))
