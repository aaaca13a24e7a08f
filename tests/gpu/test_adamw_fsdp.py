"""The clipped Triton AdamW step on FSDP2 shards (`train.adamw_cuda`, `train.clipping`): two CPU ranks
under torchrun (gloo), the kernels run by Triton's interpreter (tests/adamw_fsdp_worker.py). Skipped
without Triton; it needs no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_the_triton_step_updates_fsdp2_shards_as_it_updates_the_whole_tensors(tmp_path):
    """Sharded over two ranks (uneven shards), the clipping folds into the Triton step (six sharded
    steps, none through torch's separate pass), the shards' step equals the plain model's bit for bit
    when nothing clips (the kernel is elementwise; the biases' torch kernel within one ulp), and
    within fp32 rounding of the factor when it clips (the norm of all shards is reduced in another
    order); the norms agree to that rounding."""
    worker = Path(__file__).resolve().parents[1] / "adamw_fsdp_worker.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29653", str(worker),
           str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["shards"]["0.weight"] == [257 if r["rank"] == 0 else 256, 513]
        assert r["large_shards"] == [True, False, True, False]  # the weights' shards take the Triton kernel
        assert r["sharded_triton_steps"] == 6
        assert r["last_step"] == ["triton_shards", "triton"]  # what the run's step_path reports
        for phase, max_norm in (("unclipped", 1e9), ("clipped", 0.05)):
            for s in r[phase]:
                sharded, plain = s["norms"]
                assert abs(sharded - plain) <= 1e-5 * plain
                assert s["weights_equal"] == (phase == "unclipped")
                assert s["excess_over_1e-5_rel"] <= (0.0 if phase == "unclipped" else 1e-7)
        assert all(s["norms"][1] > 0.05 for s in r["clipped"])  # so the factor was below 1
