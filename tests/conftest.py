"""Shared test set-up: fresh random inputs each run, reproducible from the printed seed.

Every test that asks for `gen` gets a torch.Generator seeded from the run's
base seed and the test's id.  The base seed is random unless
TURBOATTN_TEST_SEED is set; it is printed in pytest's header, so a failure
on one run's inputs can be replayed with `TURBOATTN_TEST_SEED=<seed> make test`.
"""

from __future__ import annotations

import os
import secrets
import zlib

import pytest
import torch
from hypothesis import settings

BASE_SEED = int(os.environ.get("TURBOATTN_TEST_SEED", secrets.randbelow(2**31)))

# A shared 2-core machine makes wall-clock deadlines meaningless.
settings.register_profile("turboattn", deadline=None)
settings.load_profile("turboattn")

# Test tensors are small: intra-op threads buy little, and when the cores are busy with other
# work OpenMP's spin-waiting makes the CPU tests ~10x slower (measured on a shared 2-core machine).
torch.set_num_threads(int(os.environ.get("TURBOATTN_TEST_THREADS", "1")))


def pytest_report_header(config):
    return f"turboattn test seed: TURBOATTN_TEST_SEED={BASE_SEED}"


@pytest.fixture
def seed(request) -> int:
    return (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % (2**63)


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
