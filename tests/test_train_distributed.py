"""Two CPU ranks under torchrun (gloo): FSDP2 and DDP agree; a run's losses do not depend on
its world size; sharded checkpoints resume exactly, also onto another number of ranks, and an
interrupted checkpoint write leaves the previous checkpoint loadable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxflux.data import build_demo_dataset
from mxflux.train.checkpoint import (CheckpointWriteError, load_checkpoint, load_sharded_checkpoint,
                                     resolve_checkpoint, save_sharded_checkpoint)

COMMON = ["--no-progress", "--set", "batch.global_batch_size=8", "--set", "batch.micro_batch_size=4",
          "--set", "train.log_every=1", "--set", "train.eval_samples=8", "--set", "train.sample_prompts=[]",
          "--set", "optim.warmup_steps=1", "--set", "train.ema_decay=0.9"]  # the EMA rides along: sharded too


def ema_of(run: Path) -> dict:
    """The weight EMA in a run directory's checkpoint (either format), whole tensors."""
    return load_checkpoint(run)["ema"]


def train(nproc: int | None, out: Path, data: Path, *extra: str, port: int = 0,
          recipe: str = "tiny-mxfp6") -> list[float]:
    """Train under torchrun with `nproc` ranks, or (None) as one plain process without a process group."""
    return train_result(nproc, out, data, *extra, port=port, recipe=recipe)[0]


def train_result(nproc: int | None, out: Path, data: Path, *extra: str, port: int = 0,
                 recipe: str = "tiny-mxfp6") -> tuple[list[float], dict]:
    """`train`'s losses and the run's result (the JSON line it prints last)."""
    launch = [] if nproc is None else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                       "--master_port", str(port)]
    cmd = [sys.executable, *launch, "-m", "mxflux.cli", "train", recipe, "--out", str(out),
           "--device", "cpu", "--set", f"data.root={data}", *COMMON, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r.split(",") for r in (out / "metrics.csv").read_text().splitlines()[1:]]
    return [float(r[3]) for r in rows if r[2] == "train"], json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_demo_dataset(tmp_path_factory.mktemp("d") / "demo", n_train=64, n_eval=16)


@pytest.mark.slow
def test_fsdp_and_ddp_agree_and_resume_exactly(data, tmp_path):
    full = train(2, tmp_path / "full", data, "--max-steps", "4", "--set", "distributed.strategy=fsdp", port=29611)
    ddp = train(2, tmp_path / "ddp", data, "--max-steps", "4", "--set", "distributed.strategy=ddp", port=29612)
    assert len(full) == 4
    assert ddp == pytest.approx(full, rel=1e-5)  # same samples, same noise, same reduction
    # FSDP2 units of 2 blocks (fewer, bigger collectives): the same arithmetic per element
    grouped = train(2, tmp_path / "grouped", data, "--max-steps", "4", "--set", "distributed.strategy=fsdp",
                    "--set", "distributed.fsdp_blocks_per_unit=2", port=29616)
    assert grouped == pytest.approx(full, rel=1e-6)

    half = train(2, tmp_path / "half", data, "--max-steps", "2", "--set", "distributed.strategy=fsdp", port=29613)
    resumed = train(2, tmp_path / "half", data, "--max-steps", "4", "--resume", str(tmp_path / "half"),
                    "--set", "distributed.strategy=fsdp", port=29614)
    assert half[:2] == full[:2] and resumed[2:] == full[2:]  # bit for bit across the restart
    want, got = ema_of(tmp_path / "full"), ema_of(tmp_path / "half")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)  # the EMA too
    assert sorted(p.name for p in (tmp_path / "half").glob("latest*")) == ["latest.dcp"]  # sharded

    # The 2-rank checkpoint (whole tensors) loads onto one rank and keeps training.
    one = train(1, tmp_path / "half", data, "--max-steps", "5", "--resume", str(tmp_path / "half"), port=29615)
    assert len(one) == 5 and 0 < one[-1] < 3


def test_under_ddp_each_rank_keeps_its_own_buffers(data, tmp_path):
    """DDP replicates parameters and reduces their gradients; the MX layers' buffers are no replica of rank
    0's (fold-window counts and held column e_refs of the rank's own data; a LoRA run's frozen base, which
    every rank loads): rank 1's survive two steps, its layers hold predictions of their own, and a checkpoint
    keeps every rank's."""
    worker = Path(__file__).with_name("ddp_buffers_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29647",
           str(worker), str(data), str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = {r["rank"]: r for r in (json.loads((tmp_path / "run" / f"rank{i}.json").read_text()) for i in (0, 1))}
    assert set(ranks) == {0, 1}
    assert ranks[1]["min_count"] >= 10**12 > ranks[0]["min_count"]
    assert ranks[0]["held_columns"] > 0 and ranks[1]["held_columns"] > 0
    # each rank predicts from its own data, and the checkpoint keeps both, in rank order
    assert ranks[0]["held"] != ranks[1]["held"] and ranks[0]["saved"] == [ranks[0]["held"], ranks[1]["held"]]


# fp32 compute and bf16 linears: a 1-rank and a 2-rank step then differ only in the order of
# floating-point sums (GEMM blocking at micro-batch 8 vs 4, the gradient reduction); measured
# ≤ 1e-7 relative over 4 steps (bit-identical at equal micro-batches), asserted at 1e-5.
FP32 = ["--set", "train.compute_dtype=float32"]
WORLD_RTOL = 1e-5


def test_losses_do_not_depend_on_world_size_and_resume_onto_any(data, tmp_path):
    """1 rank (micro-batch = global batch 8) vs 2 ranks (micro-batch 4) at the same global batch:
    the same samples and noise per step, so the same losses; and a checkpoint written by either
    resumes on the other (sharded directory → 1 rank, single file → 2 ranks) with the losses of
    the uninterrupted run."""
    one = ["--set", "batch.micro_batch_size=8", *FP32]
    run = lambda n, out, *x, port=0: train(n, out, data, *x, port=port, recipe="tiny-bf16")  # noqa: E731

    # The 1-process reference: 2 steps, a single-file checkpoint, 2 more steps from it.
    ref = run(None, tmp_path / "one", "--max-steps", "2", *one)
    shutil.copytree(tmp_path / "one", tmp_path / "one_to_two")
    ref = run(None, tmp_path / "one", "--max-steps", "4", "--resume", str(tmp_path / "one"), *one)
    assert len(ref) == 4

    # 2 ranks: the same losses; a sharded checkpoint at step 2.
    two = run(2, tmp_path / "two", "--max-steps", "2", *FP32, port=29623)
    assert (tmp_path / "two" / "latest.dcp" / ".metadata").is_file()
    assert two == pytest.approx(ref[:2], rel=WORLD_RTOL)
    shutil.copytree(tmp_path / "two", tmp_path / "two_to_one")

    # 2-rank sharded checkpoint → 1 process (no process group), and 1-rank file → 2 ranks: both
    # continue as the reference.
    two_to_one = run(None, tmp_path / "two_to_one", "--max-steps", "4", "--resume", str(tmp_path / "two_to_one"),
                     *one)
    one_to_two = run(2, tmp_path / "one_to_two", "--max-steps", "4", "--resume", str(tmp_path / "one_to_two"),
                     *FP32, port=29625)
    assert two_to_one[2:] == pytest.approx(ref[2:], rel=WORLD_RTOL)
    assert one_to_two[2:] == pytest.approx(ref[2:], rel=WORLD_RTOL)
    # The weight EMA crosses world sizes with the weights (whole in latest.pt, shards in latest.dcp/):
    # one process resuming the 2-rank sharded checkpoint holds exactly its averages,
    from mxflux.train import load_recipe
    from mxflux.train.trainer import Trainer

    args = [*COMMON, *one]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    probe = Trainer(load_recipe("tiny-bf16", [f"data.root={data}", f"train.out_dir={tmp_path / 'probe'}", *sets]),
                    device="cpu")
    probe.resume(tmp_path / "two")
    sharded, loaded = ema_of(tmp_path / "two"), probe.ema.state_dict(full=True)
    assert set(loaded) == set(sharded) and all(torch.equal(loaded[k], sharded[k]) for k in sharded)
    # and both resumed runs' averages go on as the reference's. Not element for element: Adam's
    # first step moves each weight by about lr·sign(gradient), and a gradient that is zero up to
    # summation order (which differs with the world size and with the machine's GEMM kernels)
    # takes either sign; measured ≤ 1.4e-8 mean difference per tensor, where a lost or restarted
    # average is 1e-4-1e-3 away.
    want = ema_of(tmp_path / "one")
    for run in ("two_to_one", "one_to_two"):
        got = ema_of(tmp_path / run)
        assert set(got) == set(want)
        assert all(float((got[k] - want[k]).abs().mean()) <= 1e-7 for k in want), run
    # Each run directory keeps one checkpoint, in the format of its last writer.
    assert [p.name for p in (tmp_path / "two_to_one").glob("latest*")] == ["latest.pt"]
    assert [p.name for p in (tmp_path / "one_to_two").glob("latest*")] == ["latest.dcp"]


@pytest.mark.slow
def test_fsdp2_takes_the_compiled_path_of_one_process_without_graph_breaks(data, tmp_path):
    """2 ranks under FSDP2 with compiled blocks: every rank compiles its blocks with no graph break
    (the MX ops are custom ops inside inductor's graphs, as in one process), the losses are those
    of the compiled single process, and the run says which parts of the fast step it runs and,
    for those it cannot on the CPU (the optimizer-kept MX weight state, our optimizer kernel), why."""
    compiled = ["--set", "model.compile=true", *FP32]
    one, one_path = train_result(None, tmp_path / "one", data, "--max-steps", "2", "--set",
                                 "batch.micro_batch_size=8", *compiled)
    two, two_path = train_result(2, tmp_path / "two", data, "--max-steps", "2", *compiled, port=29627)
    assert two == pytest.approx(one, rel=WORLD_RTOL) and len(two) == 2
    p1, p2 = one_path["step_path"], two_path["step_path"]
    assert p1["graph_breaks"] == [0] and p2["graph_breaks"] == [0, 0]
    assert min(p2["graphs"]) >= 1 and p2["graphs"][0] == p2["graphs"][1]  # both ranks compiled every block
    assert p2["compiled"] == p1["compiled"] == "per block, mode default" and p2["mx_gemm"] == p1["mx_gemm"]
    assert p2["mx_packers"] == p1["mx_packers"] == "opaque op (cpu kernels)"
    assert p2["world_size"] == 2 and p2["cuda_graphs"] == "none"
    assert "CUDA only" in p2["mx_weights"] and "CUDA only" in p1["mx_weights"]  # (FSDP2's shards qualify on CUDA)
    # on the CPU neither takes our Triton step: one process folds the clipping into torch's fused kernel,
    # the sharded one (whose DTensor gradients torch's kernels cannot take with the factor) clips first
    assert p1["optimizer"].startswith("torch's fused AdamW, the clipping factor as its grad_scale")
    assert p2["optimizer"].startswith("torch's AdamW (the gradients clipped before it")
    assert "needs fp32 parameters on one CUDA device" in p1["optimizer"] and "CUDA device" in p2["optimizer"]


def test_interrupted_sharded_write_on_two_ranks_keeps_the_previous_checkpoint(data, tmp_path):
    """Rank 1 fails halfway through writing its shards: both ranks raise, the previous
    checkpoint stays in place, and resuming from it continues exactly (tests/dist_checkpoint_worker.py)."""
    worker = Path(__file__).with_name("dist_checkpoint_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29626",
           str(worker), str(data), str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert proc.returncode == 0 and "OK interrupted write" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_sharded_checkpoint_is_atomic_in_one_process(tmp_path, monkeypatch):
    """The write protocol without a process group: a failed write, a crash between the two
    renames, and a leftover temporary directory all leave the last good checkpoint loadable."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    run = tmp_path / "run"
    ck = run / "latest.dcp"

    def load():
        w = {"w": torch.zeros(4)}
        meta = load_sharded_checkpoint(resolve_checkpoint(run), w)
        return meta["v"], w["w"].tolist()

    save_sharded_checkpoint(ck, {"w": torch.arange(4.0)}, {"v": 1}, rank=0)
    assert load() == (1, [0.0, 1.0, 2.0, 3.0])

    def broken(self, plan, planner):
        (Path(self.path) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    with pytest.raises(CheckpointWriteError, match="disk full"):
        save_sharded_checkpoint(ck, {"w": torch.ones(4)}, {"v": 2}, rank=0)
    monkeypatch.undo()
    assert load() == (1, [0.0, 1.0, 2.0, 3.0])
    assert sorted(p.name for p in run.iterdir()) == ["latest.dcp"]  # no temporary left behind

    # A crash between "move the old one aside" and "rename the new one in": the old one is found.
    os.replace(ck, run / ".latest.dcp.old")
    (run / ".latest.dcp.tmp").mkdir()  # and a killed writer's leftovers, ignored
    (run / ".latest.dcp.tmp" / "__0_0.distcp").write_bytes(b"junk")
    assert resolve_checkpoint(run) == resolve_checkpoint(ck) == run / ".latest.dcp.old"
    assert load() == (1, [0.0, 1.0, 2.0, 3.0])
    save_sharded_checkpoint(ck, {"w": torch.full((4,), 7.0)}, {"v": 3}, rank=0)
    assert load() == (3, [7.0] * 4)
    assert sorted(p.name for p in run.iterdir()) == ["latest.dcp"]

    # One process reads a sharded directory whole, too (torch.distributed.checkpoint.format_utils).
    state = load_checkpoint(run)
    assert state["v"] == 3 and torch.equal(state["w"], torch.full((4,), 7.0))


def test_fsdp_units_group_consecutive_blocks(monkeypatch):
    """`fsdp_blocks_per_unit=2`: each pair of consecutive blocks of a kind shares one FSDP2 unit
    (one all-gather, one reduce-scatter); 1 gives every block its own (one-process gloo group)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from mxflux.model import Flux, flux_config
    from mxflux.train import load_recipe
    from mxflux.train.distributed import DistContext
    from mxflux.train.parallelize import parallelize

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29617")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ctx = DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))  # "not alone"
        units = {}
        for n in (1, 2):
            model = Flux(flux_config("flux-tiny", depth=3, depth_single_blocks=4))
            cfg = load_recipe("tiny-bf16", [f"distributed.fsdp_blocks_per_unit={n}", "train.compute_dtype=float32"])
            assert parallelize(model, cfg, ctx) is model  # FSDP2 shards in place
            states = [fully_shard.state(b) for b in [*model.double_blocks, *model.single_blocks]]
            units[n] = len({id(s) for s in states})
        assert units == {1: 7, 2: 2 + 2}  # doubles (0,1)(2); singles (0,1)(2,3)
    finally:
        dist.destroy_process_group()
