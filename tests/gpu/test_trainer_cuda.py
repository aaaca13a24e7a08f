"""The trainer on CUDA: compiled blocks and the MX kernels train the tiny model (loss falls)."""

import pytest
import torch

from mxflux.data import build_demo_dataset
from mxflux.train import load_recipe
from mxflux.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("recipe", ["tiny-mxfp6", "tiny-bf16"])
def test_compiled_training_on_gpu_lowers_the_loss(tmp_path, recipe):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # this test's compiles only
    root = build_demo_dataset(tmp_path / "data", n_train=512, n_eval=32)
    cfg = load_recipe(recipe, [f"data.root={root}", f"train.out_dir={tmp_path}/run", "model.compile=true",
                               "batch.global_batch_size=32", "batch.micro_batch_size=32", "train.eval_samples=32"])
    tr = Trainer(cfg, device="cuda")
    before = tr.evaluate()
    batches = tr.batches()
    for _ in range(60):
        tr.train_step([next(batches)])
    after = tr.evaluate()
    print(f"{recipe}: eval loss {before:.4f} -> {after:.4f}, fold outside window {tr.blocks_outside_window()}")
    assert after < 0.7 * before
    # the fast step's parts on one GPU: compiled without breaks, GEMMs inline, weights' state kept
    from mxflux.train.step_path import step_path

    path = step_path(tr)
    assert path["graph_breaks"] == [0] and path["graphs"][0] >= 1
    assert path["optimizer"] == "our Triton AdamW, the clipping factor applied in its pass"
    if recipe == "tiny-mxfp6":
        assert path["mx_gemm"].startswith("inline") and path["mx_weights"].startswith("kept by the optimizer step")
