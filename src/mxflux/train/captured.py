"""The trainer's optimizer step captured once as a CUDA graph and replayed (`train.cuda_graph`).

Eagerly, every op of a step costs host time (dispatch, our packers' Python, a launch), and at
small micro-batches the device waits for it: on the H200 the bare loop of the flux-12b-width
proxy at micro-batch 16 ran 2.9 % (MXFP6), 2.6 % (FP8) and 0.9 % (bf16) faster captured than
eager (benchmarks/RESULTS.md). Replayed, a step costs the host one graph launch and a few copies.

What a replay needs that an eager step gets from Python:
- the micro-batches in static device buffers, refilled from the loader's batches before each
  step (a captured host-to-device copy would read the same host addresses every time);
- the step number as a device tensor, which the training noise reads (`training_draws`);
- the learning rate as one device tensor per parameter group, written before each step from the
  schedule's float: AdamW is `capturable` (its step counts live on the device, its bias
  corrections are taken there in fp32), and reads the rate from that tensor while being captured.
  The optimizer's own parameter groups keep their floats, so the schedule, checkpoints and the
  step results see what an eager run sees;
- gradients that are None at capture, so that backward allocates them in the graph's memory
  pool and each replay rewrites them.

The first `WARMUP_STEPS` steps (by default) run eagerly (they compile and allocate; they are real training
steps), on the stream the graph is then captured on, so that every library's per-stream state
exists before capture. Everything of a step runs on that stream; the caller's stream waits for it
after each step and it waits for the caller's stream before the next, and the step's outputs are
marked as used on the caller's stream. One process only: FSDP2 and DDP issue their collectives
from hooks on streams of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["CapturedStep", "WARMUP_STEPS", "one_process_error"]

WARMUP_STEPS = 2  # eager steps before the capture: the first compiles, the second runs warm


def one_process_error(field: str, device_type: str, world_size: int) -> str | None:
    """Why a captured step cannot run here, prefixed by the `field` that asked for it (None when
    it can): it needs one process on a CUDA device."""
    if device_type == "cuda" and world_size == 1:
        return None
    return (f"{field}: a captured step needs one process on a CUDA device; got {device_type} with world size "
            f"{world_size} (FSDP2 and DDP issue collectives from hooks on streams of their own)")


class CapturedStep:
    """Runs a step function `core(device_batches, step_tensor) -> tuple of tensors` (one optimizer
    step, gradients None on entry) eagerly for the first `warmup` calls, then captures it and
    replays it. `core` comes with every call (holding it would tie its owner into a reference
    cycle, and a dropped trainer's memory would wait for the garbage collector). The trainer's
    `train.cuda_graph` and the captured bare loop of `mxflux bench step --cuda-graph` both run
    on it."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, *, warmup: int = WARMUP_STEPS):
        if device.type != "cuda":
            raise ValueError(f"train.cuda_graph: a captured step needs a CUDA device, got {device}")
        if warmup < 1:
            raise ValueError(f"warmup: a captured step needs at least one eager step first (it compiles and "
                             f"allocates the gradients' shapes), got {warmup}")
        self.optimizer, self.device, self.warmup = optimizer, device, warmup
        self.stream = torch.cuda.Stream(device)
        self.step_t = torch.zeros((), dtype=torch.int64, device=device)
        self.lr_t = [torch.zeros((), dtype=torch.float32, device=device) for _ in optimizer.param_groups]
        self.static: list[dict[str, torch.Tensor]] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self.eager_steps = 0

    def invalidate(self) -> None:
        """Forget the graph (the optimizer's state or the parameters were replaced: a resume)."""
        self.graph = self.outputs = None
        self.eager_steps = 0

    def run(self, core: Callable, micro_batches: Sequence[dict], step: int) -> tuple[torch.Tensor, ...]:
        """One optimizer step over `micro_batches` (the loader's host tensors) as optimizer step
        `step`; returns `core`'s outputs (for the trainer: mean loss, gradient norm) as device
        tensors the caller may keep. The graph, once captured, replays what `core` did at capture."""
        caller = torch.cuda.current_stream(self.device)
        s = self.stream
        s.wait_stream(caller)
        with torch.cuda.stream(s):
            self._fill(micro_batches)
            self.step_t.fill_(step)
            for t, group in zip(self.lr_t, self.optimizer.param_groups):
                t.fill_(float(group["lr"]))
            if self.graph is None and self.eager_steps >= self.warmup:
                self._capture(core)
            if self.graph is not None:
                refresh = getattr(self.optimizer, "refresh_weight_state", None)
                if refresh is not None:  # the replayed forward reads the MX weights' state unchecked
                    refresh()
                self.graph.replay()
                outputs = tuple(t.clone() for t in self.outputs)  # the next replay overwrites them
            else:
                self.optimizer.zero_grad(set_to_none=True)
                outputs = core(self.static, self.step_t)
                self.eager_steps += 1
        caller.wait_stream(s)
        for t in outputs:  # allocated on the step's stream, read on the caller's
            t.record_stream(caller)
        return outputs

    def _fill(self, micro_batches: Sequence[dict]) -> None:
        if self.static is None:
            self.static = [{k: torch.empty_like(v, device=self.device) for k, v in b.items()} for b in micro_batches]
        if len(micro_batches) != len(self.static):
            raise ValueError(f"train.cuda_graph: {len(micro_batches)} micro-batches in this step, the captured "
                             f"step takes {len(self.static)}")
        for i, (batch, static) in enumerate(zip(micro_batches, self.static)):
            if batch.keys() != static.keys():
                raise ValueError(f"train.cuda_graph: micro-batch {i} has fields {sorted(batch)}, the captured "
                                 f"step's have {sorted(static)}")
            for k, v in batch.items():
                dst = static[k]
                if v.shape != dst.shape or v.dtype != dst.dtype:
                    raise ValueError(f"train.cuda_graph: micro-batch {i} field {k!r} is {v.dtype} "
                                     f"{tuple(v.shape)}, the captured step's is {dst.dtype} {tuple(dst.shape)}")
                dst.copy_(v, non_blocking=True)

    def _capture(self, core: Callable) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        groups = self.optimizer.param_groups
        rates = [g["lr"] for g in groups]
        graph = torch.cuda.CUDAGraph()
        try:
            for g, t in zip(groups, self.lr_t):
                g["lr"] = t
            # thread_local: the data loader's pin-memory thread may touch CUDA meanwhile
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                outputs = core(self.static, self.step_t)
        finally:
            for g, lr in zip(groups, rates):
                g["lr"] = lr
        self.graph, self.outputs = graph, outputs
