"""Two CPU ranks under torchrun (gloo): FSDP2 and DDP agree, and checkpoints resume exactly,
also onto another number of ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxflux.data import build_demo_dataset

COMMON = ["--no-progress", "--set", "batch.global_batch_size=8", "--set", "batch.micro_batch_size=4",
          "--set", "train.log_every=1", "--set", "train.eval_samples=8", "--set", "train.sample_prompts=[]",
          "--set", "optim.warmup_steps=1"]


def train(nproc: int, out: Path, data: Path, *extra: str, port: int) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(port), "-m", "mxflux.cli", "train", "tiny-mxfp6", "--out", str(out),
           "--device", "cpu", "--set", f"data.root={data}", *COMMON, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r.split(",") for r in (out / "metrics.csv").read_text().splitlines()[1:]]
    return [float(r[3]) for r in rows if r[2] == "train"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_demo_dataset(tmp_path_factory.mktemp("d") / "demo", n_train=64, n_eval=16)


def test_fsdp_and_ddp_agree_and_resume_exactly(data, tmp_path):
    full = train(2, tmp_path / "full", data, "--max-steps", "4", "--set", "distributed.strategy=fsdp", port=29611)
    ddp = train(2, tmp_path / "ddp", data, "--max-steps", "4", "--set", "distributed.strategy=ddp", port=29612)
    assert len(full) == 4
    assert ddp == pytest.approx(full, rel=1e-5)  # same samples, same noise, same reduction

    half = train(2, tmp_path / "half", data, "--max-steps", "2", "--set", "distributed.strategy=fsdp", port=29613)
    resumed = train(2, tmp_path / "half", data, "--max-steps", "2", "--resume", str(tmp_path / "half"),
                    "--set", "distributed.strategy=fsdp", port=29614)
    assert half[:2] == full[:2] and resumed[2:] == full[2:]  # bit for bit across the restart

    # The 2-rank checkpoint (whole tensors) loads onto one rank and keeps training.
    one = train(1, tmp_path / "half", data, "--max-steps", "1", "--resume", str(tmp_path / "half"), port=29615)
    assert len(one) == 5 and 0 < one[-1] < 3
