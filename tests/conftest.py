"""Shared fixtures: fresh random inputs every run, with the seed printed so a failure can be replayed;
a call counter for dispatch tests."""

from __future__ import annotations

import os

import pytest
import torch
import triton_interpreter_fix

# tests run under TRITON_INTERPRET=1 (`make test-kernels`) with any numpy (the module says why)
triton_interpreter_fix.apply()

# Under pytest-xdist (`make test`: one worker per core) each worker and every process it starts runs
# torch, MKL and numba on one thread. Two workers of two threads each on two cores oversubscribe them,
# and OpenMP's spin-waiting then made a 13 s training test take 150 s. The pinned losses are recorded
# per thread count (tests/test_regression_losses.py), so this keeps them bit for bit.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[_var] = "1"
    torch.set_num_threads(1)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded freshly per test (MXFLUX_TEST_SEED replays a failing run)."""
    seed = int(os.environ.get("MXFLUX_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"[{request.node.name}] MXFLUX_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory):
    """The demo dataset the trainer tests share (96 training and 24 evaluation samples, seed 1): built once."""
    from mxflux.data import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("demo") / "data", n_train=96, n_eval=24, seed=1)


@pytest.fixture
def count_calls(monkeypatch):
    """`count_calls(module, name)` replaces `module.name` by a wrapper that still calls it and
    appends 1 to the returned list per call: which kernel a dispatcher picked."""

    def spy(module, name: str) -> list[int]:
        calls, real = [], getattr(module, name)

        def counting(*args, **kw):
            calls.append(1)
            return real(*args, **kw)

        monkeypatch.setattr(module, name, counting)
        return calls

    return spy


# The compiled and distributed end-to-end tests that take up to minutes each on 2 CPU cores: `make test`
# (CI) skips them to keep its time under 20 minutes, `make test-slow` runs only them. Each covers a path that
# faster tests also reach in part (the same ops, checkpointing and sharding on smaller cases).
def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (make test-slow)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow on a CPU: `make test-slow` runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
