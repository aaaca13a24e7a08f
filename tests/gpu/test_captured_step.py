"""The bare loop captured as one CUDA graph per step (`mxflux bench step --cuda-graph`) trains the
model as the eager bare loop does: the replays go on from where the warm-up steps left the
parameters, and their losses follow the eager loop's, step for step."""

import pytest
import torch

from mxflux.bench.bare_loop import BareLoop
from mxflux.train import load_recipe
from mxflux.train.distributed import alone

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
