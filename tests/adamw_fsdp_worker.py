"""Run under torchrun (2 CPU ranks, gloo, Triton's interpreter) by tests/gpu/test_adamw_fsdp.py: the clipped
Triton AdamW step on FSDP2 shards equals the same step on the whole, plain tensors of one process.

    TRITON_INTERPRET=1 python -m torch.distributed.run --nproc_per_node 2 tests/adamw_fsdp_worker.py OUT

Both models run forward and backward on the same batches; then each rank's gradient shards (FSDP2's
own DTensors) are overwritten with the plain model's gradient rows they hold, so that the two steps
start from the same numbers (a sharded forward can round its sums differently). The weights have
uneven shards (513 rows over two ranks), every shard large enough for the Triton kernel; the biases
go through torch's fused kernel on the shards. Each rank writes its findings to OUT/rank<r>.json.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mxflux.train import adamw_cuda
from mxflux.train.clipping import clip_and_step
from mxflux.train.distributed import cleanup
from mxflux.train.optimizer import ClippingAdamW

import triton_interpreter_fix  # beside this script: numpy 2.4 under Triton 3.6's interpreter

triton_interpreter_fix.apply()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 513), nn.GELU(), nn.Linear(513, 256))


def backward(net: nn.Module, x: torch.Tensor) -> None:
    net(x).square().mean().backward()


def step(net: nn.Module, opt: ClippingAdamW, max_norm: float) -> float:
    norm = clip_and_step(opt, net.parameters(), max_norm)
    opt.zero_grad(set_to_none=True)
    return float(norm)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    adamw_cuda.on_kernel_device = lambda t: t.device.type == "cpu"  # the interpreter runs the kernels here
    sharded_steps = []  # the Triton steps taken over DTensor parameters
    real = adamw_cuda.adamw_clipped_step

    def counted(optimizer, *args, **kwargs):
        sharded_steps.append(any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]))
        return real(optimizer, *args, **kwargs)

    adamw_cuda.adamw_clipped_step = counted

    plain = model()
    sharded = copy.deepcopy(plain)
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer)
    fully_shard(sharded)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opts = ClippingAdamW(sharded.parameters(), kernel="triton", **hyper)
    optp = ClippingAdamW(plain.parameters(), kernel="triton", **hyper)
    shards = {n: [p.to_local().shape[0], p.shape[0]] for n, p in sharded.named_parameters()}
    assert all(isinstance(p, DTensor) for p in sharded.parameters())

    report = {"rank": rank, "shards": shards, "unclipped": [], "clipped": []}
    gen = torch.Generator().manual_seed(1)
    # max_norm far above the norm: the factor is exactly 1, so the shards must equal the plain step bit
    # for bit; then a max_norm that clips, where the norms are reduced in another order (fp32 rounding)
    for phase, max_norm in (("unclipped", 1e9), ("clipped", 0.05)):
        for _ in range(3):
            x = torch.randn(16, 256, generator=gen)
            backward(sharded, x)
            backward(plain, x)
            for p, q in zip(sharded.parameters(), plain.parameters()):
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                p.grad.to_local().copy_(torch.chunk(q.grad, dist.get_world_size(), dim=0)[rank])  # FSDP2's rows
            norms = step(sharded, opts, max_norm), step(plain, optp, max_norm)
            # The weights' shards went through the Triton kernel, the biases through torch's fused CPU
            # kernel, whose vector loop and scalar tail round differently (a shard's elements sit at
            # other offsets than in the whole tensor): those may differ by an ulp.
            large, small = True, 0.0
            for p, q in zip(sharded.parameters(), plain.parameters()):
                full, q = p.full_tensor(), q.detach()  # (a collective: every rank runs the same loop)
                if p.to_local().numel() >= adamw_cuda.LARGE:
                    large &= torch.equal(full, q)
                err = float(((full - q).abs() - 1e-5 * q.abs()).max())
                small = max(small, err)
            report[phase].append({"norms": norms, "weights_equal": bool(large), "excess_over_1e-5_rel": small})
    report["sharded_triton_steps"] = sum(sharded_steps)
    report["last_step"] = [opts.last_step, optp.last_step]
    report["large_shards"] = [p.to_local().numel() >= adamw_cuda.LARGE for p in sharded.parameters()]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    del opts, optp, sharded
    cleanup()


if __name__ == "__main__":
    main(sys.argv[1])
