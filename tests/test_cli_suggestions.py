"""A mistyped recipe name, recipe key or command is refused in one line that names the closest valid one,
through the real CLI (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (["train", "tiny-mxfp7"], "unknown recipe 'tiny-mxfp7' (did you mean 'tiny-mxfp6'?)"),
    (["check-config", "tiny-mxfp6", "--set", "optim.lrr=1"], "optim.lrr: unknown key (did you mean 'lr'?)"),
    (["check-config", "tiny-mxfp6", "--set", "train.ema_decy=0.9"], "train.ema_decy: unknown key (did you mean 'ema_decay'?)"),
    (["check-config", "tiny-mxfp6", "--set", "modle.name=flux-tiny"], "modle: unknown key (did you mean 'model'?)"),
    (["check-config", "tiny-mxfp6", "--set", "precision.hadamrd=false"], "(did you mean 'hadamard'?)"),
    (["trian"], "invalid choice: 'trian'; did you mean 'train'?"),
    (["data", "sinth"], "did you mean 'synth'?"),
    (["bench", "stp"], "did you mean 'step'?"),
]


@pytest.mark.parametrize("argv, expected", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_typo_names_the_closest_valid_name(argv, expected):
    p = subprocess.run([sys.executable, "-m", "mxflux.cli", *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert expected in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_nothing_close_suggests_nothing():
    p = subprocess.run([sys.executable, "-m", "mxflux.cli", "check-config", "tiny-mxfp6", "--set", "optim.zzzzzz=1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "optim.zzzzzz: unknown key" in p.stderr and "did you mean" not in p.stderr
