"""A training step never waits for the device: after warm-up, the trainer's full `train_step`
(forward, backward, clipping, AdamW, the step's metrics) runs under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any host-device synchronisation
(`.item()`, `float(t)`, `bool(t)`, `nonzero`, a blocking copy to the host, ...). Reading the
step's values afterwards (`StepResult.read()`) is the one synchronisation, outside the step."""

import math

import pytest
import torch

from mxflux.data import build_demo_dataset
from mxflux.train import load_recipe
from mxflux.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["tiny-bf16", "tiny-mxfp6"])
def test_train_step_does_not_synchronize(tmp_path, recipe, compile):
    root = build_demo_dataset(tmp_path / "data", n_train=128, n_eval=16)
    cfg = load_recipe(recipe, [f"data.root={root}", f"train.out_dir={tmp_path}/run", f"model.compile={str(compile).lower()}",
                               "batch.global_batch_size=16", "batch.micro_batch_size=8", "data.num_workers=0"])
    tr = Trainer(cfg, device="cuda")
    batches = tr.batches()
    steps = [[next(batches) for _ in range(tr.accum)] for _ in range(4)]
    for mbs in steps[:3]:  # warm-up: compilation, autotuning, lazy initialisation may synchronise
        first = tr.train_step(mbs).read()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = tr.train_step(steps[3])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    values = result.read()
    assert tr.accum == 2 and result.step == 4
    assert math.isfinite(values["loss"]) and 0 < values["loss"] < 10 and values["loss"] != first["loss"]
    assert math.isfinite(values["grad_norm"]) and values["grad_norm"] > 0
