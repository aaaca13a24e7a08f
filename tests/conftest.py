"""Shared fixtures: fresh random inputs every run, with the seed printed so a failure can be replayed."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded freshly per test (MXFLUX_TEST_SEED replays a failing run)."""
    seed = int(os.environ.get("MXFLUX_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"[{request.node.name}] MXFLUX_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)
