"""Run under torchrun (2 CPU ranks, gloo) by tests/test_train_distributed.py: a sharded checkpoint
write that fails on rank 1 halfway raises on every rank and leaves the previous checkpoint
loadable, and resuming from it continues exactly.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_checkpoint_worker.py DATA OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.tensor import DTensor

from mxflux.train import load_recipe
from mxflux.train.distributed import cleanup, init_distributed
from mxflux.train.trainer import Trainer


def main(data: str, out: str) -> None:
    ctx = init_distributed("cpu")
    rank = ctx.rank

    def make() -> Trainer:
        cfg = load_recipe("tiny-bf16", [f"data.root={data}", f"train.out_dir={out}", "batch.global_batch_size=8",
                                        "batch.micro_batch_size=4", "train.compute_dtype=float32",
                                        "optim.warmup_steps=1", "train.sample_prompts=[]"])
        return Trainer(cfg, ctx=ctx, device="cpu")

    def local(p):
        return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()

    a = make()
    batches = a.batches()
    a.train_step([next(batches) for _ in range(a.accum)])
    ck = a.save()
    assert ck == Path(out) / "latest.dcp", ck
    saved = [local(p) for p in a.model.parameters()]
    want = a.train_step([next(batches) for _ in range(a.accum)]).read()["loss"]

    original = FileSystemWriter.write_data

    def fail_on_rank1(self, plan, planner):  # rank 1 writes part of its shard file, then the disk is full
        if rank == 1:
            (Path(self.path) / "__1_0.distcp").write_bytes(b"partial")
            raise OSError("disk full (injected)")
        return original(self, plan, planner)

    FileSystemWriter.write_data = fail_on_rank1
    try:
        a.save()
    except Exception as e:  # every rank sees the failure (DCP gathers the write results)
        assert "disk full (injected)" in str(e), repr(e)
    else:
        raise AssertionError(f"rank {rank}: the failed write did not raise")
    finally:
        FileSystemWriter.write_data = original
    dist.barrier()
    names = sorted(p.name for p in Path(out).iterdir())
    assert ".latest.dcp.tmp" not in names and "latest.dcp" in names, names

    b = make()
    b.resume(out)  # the previous checkpoint: step 1, its weights, and the same continuation
    assert (b.step, b.samples) == (1, 8), (b.step, b.samples)
    assert all(torch.equal(local(p), s) for p, s in zip(b.model.parameters(), saved))
    nb = b.batches()
    got = b.train_step([next(nb) for _ in range(b.accum)]).read()["loss"]
    assert got == want, (got, want)
    if rank == 0:
        print(f"OK interrupted write: previous checkpoint intact, resumed loss {got} == {want}")
    cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # Every check above has passed. Leave without the interpreter's teardown: with the process
    # group destroyed, torch's C++ static destructors at exit sometimes meet a still-joinable
    # thread and abort ("terminate called without an active exception", seen once in CI after the
    # OK line), which would fail the test on a run whose checks all held.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
