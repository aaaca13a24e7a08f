"""Run under torchrun (2 CPU ranks, gloo) by tests/test_train_distributed.py: under DDP each rank's
module buffers stay its own through a training step. The MX layers' buffers are per-rank state (the
fold-window counters, the held column e_refs of that rank's own data) or, in a LoRA run, the frozen
base every rank loads itself; DDP's default broadcast of rank 0's buffers before every forward would
overwrite the first and send the whole base between the ranks each step. The checkpoint then carries
each rank's predictions (`mxflux.train.held_erefs`).

    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_buffers_worker.py DATA OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from mxflux.train import load_recipe
from mxflux.train.checkpoint import read_checkpoint_meta
from mxflux.train.distributed import cleanup, init_distributed
from mxflux.train.held_erefs import held_snapshot
from mxflux.train.trainer import Trainer

SENTINEL = 10**12  # a count no step of the tiny model reaches


def _digest(snapshot: dict) -> list:
    """A rank's held predictions, comparable across processes: (name, sum of the bytes) per buffer."""
    return sorted((k, int(v.sum())) for k, v in snapshot.items())


def main(data: str, out: str) -> None:
    ctx = init_distributed("cpu")
    cfg = load_recipe("tiny-mxfp6", [f"data.root={data}", f"train.out_dir={out}", "distributed.strategy=ddp",
                                     "batch.global_batch_size=8", "batch.micro_batch_size=4",
                                     "precision.held_col_erefs=true", "precision.fused_mlp='off'"])
    trainer = Trainer(cfg, ctx=ctx, device="cpu")
    if ctx.rank == 1:  # a value only this rank holds: kept through the steps unless rank 0's replaces it
        for counter in trainer.window_counters:
            counter.fill_(SENTINEL)
    batches = trainer.batches()
    for _ in range(2):
        trainer.train_step([next(batches)])
    counts = [int(c) for c in trainer.window_counters]
    held = [int(m.x_col_erefs.ne(0).sum()) for m in trainer.mx_modules() if hasattr(m, "x_col_erefs")]
    mine = _digest(held_snapshot(trainer.model))
    checkpoint = trainer.save()  # sharded (a collective): the meta, rank 0's, holds every rank's predictions
    saved = [_digest(d) for d in read_checkpoint_meta(checkpoint)["held_col_erefs"]]  # (a collective too)
    # a file per rank: the ranks' stdout lines interleave under torchrun
    (Path(out) / f"rank{ctx.rank}.json").write_text(json.dumps(
        {"rank": ctx.rank, "min_count": min(counts), "held_columns": sum(held), "held": mine, "saved": saved}))
    dist.barrier()
    del trainer, batches
    cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:3])
