"""Steps captured as one CUDA graph and replayed train as the eager steps do.

- The bare loop (`mxflux bench step --cuda-graph`): the replays go on from where the warm-up
  steps left the parameters, and their losses follow the eager loop's, step for step.
- The trainer (`train.cuda_graph: true`): the same losses, gradient norms and learning rates as
  the eager trainer (up to AdamW's bias corrections, taken on the device in fp32 when capturable),
  replays that never synchronise, the fold-window counts carried on, and a clear error for a
  micro-batch of another shape."""

import math

import pytest
import torch

from mxflux.bench.bare_loop import BareLoop
from mxflux.data import build_demo_dataset
from mxflux.train import load_recipe
from mxflux.train.captured import WARMUP_STEPS
from mxflux.train.distributed import alone
from mxflux.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _losses(cfg, cuda_graph: bool, steps: int) -> list[float]:
    loop = BareLoop(cfg, alone("cuda"), torch.device("cuda"), latent_hw=(8, 8), text_tokens=16,
                    cuda_graph=cuda_graph, graph_warmup=3)
    return [float(loop.step()) for _ in range(steps)]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["tiny-bf16", "tiny-mxfp6"])
def test_captured_steps_follow_the_eager_loop(recipe, compile):
    # accumulation over two micro-batches: the second backward accumulates into the graph's gradients
    cfg = load_recipe(recipe, [f"model.compile={str(compile).lower()}", "batch.global_batch_size=8",
                               "batch.micro_batch_size=4", "optim.lr=1e-3"])
    eager = _losses(cfg, False, 7)
    captured = _losses(cfg, True, 4)  # 3 warm-up steps run before the capture, then replays 4..7
    assert eager[-1] < eager[0]  # the inputs repeat every step: the loss must fall
    # the capturable AdamW takes its bias corrections on the device in fp32: a rounding apart
    assert captured == pytest.approx(eager[3:], rel=2e-3), (eager, captured)
    assert captured[-1] < captured[0]


def test_a_captured_loop_needs_one_process_on_a_cuda_device():
    cfg = load_recipe("tiny-bf16", [])
    with pytest.raises(ValueError, match="cuda_graph"):
        BareLoop(cfg, alone("cpu"), torch.device("cpu"), latent_hw=(8, 8), text_tokens=16, cuda_graph=True)


def _trainer(tmp_path, recipe, cuda_graph, *extra):
    root = tmp_path / "data"
    if not root.exists():
        build_demo_dataset(root, n_train=128, n_eval=16)
    cfg = load_recipe(recipe, [f"data.root={root}", f"train.out_dir={tmp_path}/run-{cuda_graph}", "model.compile=true",
                               "batch.global_batch_size=16", "batch.micro_batch_size=8", "data.num_workers=0",
                               "optim.warmup_steps=3", f"train.cuda_graph={str(cuda_graph).lower()}", *extra])
    return Trainer(cfg, device="cuda")


@pytest.mark.parametrize("recipe", ["tiny-bf16", "tiny-mxfp6"])
def test_the_captured_trainer_trains_as_the_eager_one(tmp_path, recipe):
    eager, captured = _trainer(tmp_path, recipe, False), _trainer(tmp_path, recipe, True)
    steps = 7
    rows = {}
    for name, tr in (("eager", eager), ("captured", captured)):
        batches = tr.batches()
        micro = [[next(batches) for _ in range(tr.accum)] for _ in range(steps)]
        results = []
        for i, mbs in enumerate(micro):
            if name == "captured" and i == WARMUP_STEPS + 1:  # a replay: no synchronisation at all
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    results.append(tr.train_step(mbs))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            else:
                results.append(tr.train_step(mbs))
        rows[name] = [r.read() for r in results]
        if name == "captured":
            assert tr.captured.graph is not None and tr.captured.eager_steps == WARMUP_STEPS
    for e, c in zip(rows["eager"], rows["captured"]):
        assert c["lr"] == e["lr"]  # the schedule's floats, warm-up included
        assert math.isfinite(c["loss"]) and c["loss"] == pytest.approx(e["loss"], rel=2e-3)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=2e-2)
    assert rows["captured"][-1]["loss"] != rows["captured"][-2]["loss"]  # the replays see new batches
    if recipe == "tiny-mxfp6":
        # the packers' counters keep counting inside the graph: 5 of the 7 steps are replays (WARMUP_STEPS
        # eager), so a graph whose counters stood still would read ~2/7 of the eager count. The two trainings
        # agree only to rounding (the losses above to 2e-3), so the counts need not be equal: an H100 run at
        # a9fc004 gave 30803 against 30794 (a rerun on the same machine was within 2;
        # benchmarks/results/gpu_tests1_h100_2026-12-07d.log)
        assert captured.blocks_outside_window() == pytest.approx(eager.blocks_outside_window(), rel=1e-3)


def test_a_captured_step_refuses_a_micro_batch_of_another_shape(tmp_path):
    tr = _trainer(tmp_path, "tiny-bf16", True)
    batches = tr.batches()
    tr.train_step([next(batches) for _ in range(tr.accum)])
    short = [{k: v[:4] for k, v in next(batches).items()} for _ in range(tr.accum)]
    with pytest.raises(ValueError, match="train.cuda_graph: micro-batch 0 field '.*' is .* the captured step's is"):
        tr.train_step(short)
