"""Run under torchrun (2 CPU ranks, gloo, Triton's interpreter) by tests/gpu/test_adamw_fsdp.py: the MX weights'
e_ref kept by the Triton step on FSDP2 shards (`nn.weight_state`, `train.adamw_cuda`) are the whole weights'.

    TRITON_INTERPRET=1 python -m torch.distributed.run --nproc_per_node 2 tests/weight_state_fsdp_worker.py OUT

Each rank writes what it found to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from mxflux.kernels.weight_erefs import rows_and_columns
from mxflux.mx import rowwise_erefs_reference
from mxflux.nn import MXFP6Linear, MXWeightState
from mxflux.train import adamw_cuda
from mxflux.train.clipping import clip_and_step
from mxflux.train.distributed import cleanup
from mxflux.train.optimizer import ClippingAdamW

import triton_interpreter_fix  # beside this script: numpy 2.4 under Triton 3.6's interpreter

triton_interpreter_fix.apply()


def whole_weights_erefs(state: MXWeightState) -> list[bool]:
    """For each kept weight: its buffer equals the reference e_ref of the whole (gathered) weight."""
    same = []
    for p, (hadamard, view) in state.of.items():
        full = p.full_tensor().detach().bfloat16()  # (a collective: every rank runs the same loop)
        rows, cols = rowwise_erefs_reference(full, hadamard=hadamard)
        got_rows, got_cols = rows_and_columns(view, *p.shape)
        same.append(torch.equal(got_rows[:p.shape[0]], rows) and torch.equal(got_cols, cols))
    return same


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    adamw_cuda.on_kernel_device = lambda t: t.device.type == "cpu"  # the interpreter runs the kernels here
    torch.manual_seed(0)
    model = torch.nn.Sequential(MXFP6Linear(256, 512), torch.nn.GELU(approximate="tanh"), MXFP6Linear(512, 256))
    with torch.no_grad():
        model[0].weight[:, :32] *= 2.0**12  # columns far above the rest: their e_ref stand out
        model[0].weight[300:] *= 2.0**-9  # rows on rank 1 only far below
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = ClippingAdamW(model.parameters(), kernel="triton", lr=1e-2, weight_decay=0.1, fused=True)
    opt.weight_state = state = MXWeightState.of_model(model, keep_operands=True, min_elements=1024)
    state.install(model)
    report = {"rank": rank, "tracked": len(state.of), "kept": len(state.kept), "after_steps": [], "used": []}
    used = []
    for m in (model[0], model[2]):
        m.register_forward_pre_hook(lambda mod, args: used.append(mod.kept_weight_state()[0] is not None))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(64, 256, generator=gen)
        model(x).float().square().mean().backward()
        clip_and_step(opt, model.parameters(), 1.0)
        opt.zero_grad(set_to_none=True)
        report["after_steps"].append(whole_weights_erefs(state))
    report["used"] = used  # eager forward hands each layer its kept e_ref while current
    with torch.no_grad():  # a write through torch: the next forward's refresh recomputes them
        model[0].weight.mul_(2.0**5)
    report["current_after_write"] = state.is_current(model[0].weight)
    model(torch.randn(64, 256, generator=gen))
    report["after_refresh"] = whole_weights_erefs(state)
    with torch.no_grad():  # a write into the shard's local tensor (as the weight EMA swaps its averages in)
        model[2].weight.to_local().mul_(2.0**-7)
    report["current_after_local_write"] = state.is_current(model[2].weight)
    model(torch.randn(64, 256, generator=gen))
    report["after_local_refresh"] = whole_weights_erefs(state)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    del opt, model, state
    cleanup()


if __name__ == "__main__":
    main(sys.argv[1])
