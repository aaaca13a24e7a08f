"""The clipped Triton AdamW step on FSDP2 shards (`train.adamw_cuda`, `train.clipping`): two CPU ranks
under torchrun (gloo), the kernels run by Triton's interpreter (tests/adamw_fsdp_worker.py, and a whole
`mxflux train` run: tests/adamw_train_worker.py). Skipped without Triton; it needs no GPU (`make
test-kernels` runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TESTS = Path(__file__).resolve().parents[1]
# the workers run the Triton kernels under the interpreter, on the CPU: no GPU visible to them (on a
# one-GPU machine the second rank's CUDA device did not exist, and fully_shard failed on it)
ENV = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
       "CUDA_VISIBLE_DEVICES": ""}


def _two_ranks(worker: str, port: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """tests/`worker` under torchrun on two ranks (gloo), stdout and stderr captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(TESTS / worker), *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_the_triton_step_updates_fsdp2_shards_as_it_updates_the_whole_tensors(tmp_path):
    """Sharded over two ranks (uneven shards), the clipping folds into the Triton step (six sharded
    steps, none through torch's separate pass), the shards' step equals the plain model's bit for bit
    when nothing clips (the kernel is elementwise; the biases' torch kernel within one ulp), and
    within fp32 rounding of the factor when it clips (the norm of all shards is reduced in another
    order); the norms agree to that rounding."""
    out = _two_ranks("adamw_fsdp_worker.py", 29653, str(tmp_path))
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


def test_a_sharded_training_run_takes_the_triton_step_and_the_losses_of_one_process(tmp_path):
    """`mxflux train` on the tiny MXFP6 recipe, the Triton step on the CPU (tests/adamw_train_worker.py): under
    FSDP2 on two gloo ranks the run reports the Triton step on each rank's shards and its losses are one
    process's (which reports the Triton step on whole tensors) to the world-size tolerance."""
    from test_train_distributed import COMMON, FP32, WORLD_RTOL

    from mxflux.data import build_demo_dataset

    data = build_demo_dataset(tmp_path / "demo", n_train=64, n_eval=16)
    runs = {}
    for ranks in (1, 2):
        out = tmp_path / f"run{ranks}"
        args = ("tiny-mxfp6", "--out", str(out), "--device", "cpu", "--set", f"data.root={data}", "--max-steps", "2",
                *COMMON, *FP32)
        if ranks == 1:
            proc = subprocess.run([sys.executable, str(TESTS / "adamw_train_worker.py"), *args], env=ENV,
                                  capture_output=True, text=True, timeout=900)
        else:
            proc = _two_ranks("adamw_train_worker.py", 29654, *args, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [r.split(",") for r in (out / "metrics.csv").read_text().splitlines()[1:]]
        runs[ranks] = ([float(r[3]) for r in rows if r[2] == "train"],
                       json.loads(proc.stdout.strip().splitlines()[-1])["step_path"])
    (one, one_path), (two, two_path) = runs[1], runs[2]
    assert len(one) == 2 and two == pytest.approx(one, rel=WORLD_RTOL)
    assert one_path["optimizer"] == "our Triton AdamW, the clipping factor applied in its pass"
    assert two_path["optimizer"] == "our Triton AdamW on each rank's shards, the clipping factor applied in its pass"


def test_the_step_keeps_the_whole_weights_e_ref_on_fsdp2_shards(tmp_path):
    """Two gloo ranks (tests/weight_state_fsdp_worker.py): the MX weights' state over FSDP2 shards keeps their
    e_ref (not their operands); after each Triton step, every rank holds the whole weights' e_ref (each rank's
    rows, the columns reduced over the ranks; a weight with far-apart columns and rows), eager forward hands
    each layer those e_ref while current (the shard's version, not the gathered weight's), and after a write
    through torch, to the DTensor or into its local tensor (as the weight EMA's swap writes), the next
    forward's refresh recomputes them."""
    out = _two_ranks("weight_state_fsdp_worker.py", 29656, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    for r in (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)):
        assert (r["tracked"], r["kept"]) == (2, 0)
        assert r["after_steps"] == [[True, True], [True, True]] and r["after_refresh"] == [True, True]
        assert r["used"] == [True] * 8 and r["current_after_write"] is False  # (4 forwards x 2 layers)
        assert r["current_after_local_write"] is False and r["after_local_refresh"] == [True, True]
