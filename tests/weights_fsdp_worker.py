"""Run under torchrun (2 CPU ranks, gloo) by tests/test_finetune.py: released weights loaded into
FSDP2-sharded models, each rank holding (and reading) only its shards, equal the weights one
process loads; the Trainer's step-0 eval loss of them is printed for the 1-rank comparison.

    python -m torch.distributed.run --nproc_per_node 2 tests/weights_fsdp_worker.py DATA WEIGHTS
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mxflux.model import Flux, init_from_checkpoint, load_flux_weights
from mxflux.nn import apply_precision
from mxflux.train import load_recipe
from mxflux.train.distributed import cleanup, init_distributed
from mxflux.train.parallelize import parallelize
from mxflux.train.trainer import Trainer


def recipe(data: str, weights: str):
    """tiny-mxfp6 from `weights`, in fp32, evaluating 16 samples in batches of 8: 1 rank and each of
    2 ranks then run the same eval batches (the MX fold's window depends on the batch's tensors)."""
    return load_recipe("tiny-mxfp6", [f"data.root={data}", f"model.init_from={weights}", "train.eval_samples=16",
                                      "train.eval_batch_size=8", "batch.micro_batch_size=8",
                                      "train.compute_dtype=float32", "train.sample_prompts=[]"])


def check_sharded(model, reference: dict, label: str) -> None:
    """Every parameter is a DTensor shard of this rank holding less than the whole, and the
    shards together are the reference weights bit for bit."""
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{label}: {name} is not sharded"
        if p.shape[0] > 1:
            assert p.to_local().numel() < p.numel(), f"{label}: {name} holds the whole tensor on rank {dist.get_rank()}"
        full = p.full_tensor()  # a collective: every rank runs the same loop
        assert torch.equal(full, reference[name].to(full.dtype)), f"{label}: {name} differs from the checkpoint"


def main(data: str, weights: str) -> None:
    ctx = init_distributed("cpu")
    reference = load_flux_weights(weights)
    cfg = recipe(data, weights)

    # The Trainer: built, wrapped in FSDP2, then loaded shard by shard.
    trainer = Trainer(cfg, ctx=ctx, device="cpu")
    check_sharded(trainer.model, reference, "trainer")
    loss = trainer.evaluate()

    # Meta-device construction: nothing is allocated before sharding; each rank allocates and
    # fills only its own shards.
    with torch.device("meta"):
        model = Flux(cfg.model.flux_config())
    apply_precision(model, cfg.precision)
    parallelize(model, cfg, ctx)
    model.to_empty(device="cpu")
    init_from_checkpoint(model, weights)
    check_sharded(model, reference, "meta")

    if ctx.is_main:
        print("OK " + json.dumps({"eval_loss": loss, "world": ctx.world_size}))
    # both ranks done before the group is torn down: a rank destroying its gloo group while the
    # other is still in its last collective aborted once ("terminate called without an active
    # exception", exit -6) after printing OK
    dist.barrier()
    # and nothing holding the group (the sharded modules' meshes) outlives it into interpreter exit,
    # where gloo's threads are torn down in no defined order: freed first, as `mxflux train` does
    del trainer, model
    cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:])
