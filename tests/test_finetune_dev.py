"""Fine-tuning guidance-distilled weights (FLUX.1-dev): `train.distilled_guidance` is required for a
model with a guidance embedder and refused for one without; a tiny guidance-embedded diffusers
FluxTransformer2DModel saved here loads, trains with a falling loss, resumes bit for bit and
samples, each with the recipe's guidance value (and `mxflux sample --distilled-guidance` overrides
it); `flux12b-mxfp6-finetune-dev` checks against a header-only 12B FLUX.1-dev file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxflux.cli import main
from mxflux.data import build_demo_dataset
from mxflux.model import Flux, flux_config, load_flux_weights

diffusers = pytest.importorskip("diffusers", reason="pip install -e '.[test]' installs diffusers")

from test_finetune import SMALL, eval_rows, header_only_checkpoint  # noqa: E402
from test_model_diffusers_equivalence import random_diffusers_flux  # noqa: E402

PROMPT = "a large red circle in the center"
# tiny-mxfp6 with the tiny model's guidance embedder on: 4 steps of 8 samples, evaluated (on 8
# samples) before and after, and one prompt sampled (2 Euler steps) into the run's samples.png.
DEV = ["--set", "model.overrides.guidance_embed=true", *SMALL, "--set", "train.train_samples=32",
       "--set", "train.eval_every_samples=32", "--set", "train.eval_samples=8",
       "--set", f"train.sample_prompts=[{PROMPT}]", "--set", "train.sample_steps=2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_demo_dataset(tmp_path_factory.mktemp("d") / "demo", n_train=32, n_eval=16)


@pytest.fixture(scope="module")
def dev_weights(tmp_path_factory):
    """A random guidance-embedded flux-tiny FluxTransformer2DModel in a diffusers transformer/ folder,
    scaled down (as test_finetune's) so that its loss on the demo data is of the order of 1."""
    model = random_diffusers_flux(flux_config("flux-tiny", guidance_embed=True), torch.Generator().manual_seed(23))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(0.5)
    assert model.config.guidance_embeds
    root = tmp_path_factory.mktemp("w") / "FLUX.1-dev-tiny" / "transformer"
    model.save_pretrained(root)
    return root


def train(out: Path, data: Path, weights: Path, *extra: str) -> int:
    return main(["train", "tiny-mxfp6", "--out", str(out), "--device", "cpu", "--no-progress",
                 "--set", f"data.root={data}", "--set", f"model.init_from={weights}", *DEV, *extra])


def train_losses(run: Path) -> list[str]:
    rows = [r.split(",") for r in (run / "metrics.csv").read_text().splitlines()[1:]]
    return [r[3] for r in rows if r[2] == "train"]


def error_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_the_guidance_value_is_required_for_dev_weights_and_refused_without_an_embedder(data, dev_weights, capsys):
    init = ["--set", f"model.init_from={dev_weights}", "--set", f"data.root={data}"]
    # The schnell-shaped recipe does not fit dev weights: the hint names the embedder.
    err = error_of(["check-config", "tiny-mxfp6", *init], capsys)
    assert "guidance_embed=True (model: False)" in err and "model.overrides.guidance_embed=true" in err
    # With the embedder but no value: one error naming the field and the fix, for check-config and train.
    for command in (["check-config"], ["train", "--device", "cpu", "--no-progress", "--out", "/nonexistent/run"]):
        err = error_of([*command, "tiny-mxfp6", *init, "--set", "model.overrides.guidance_embed=true"], capsys)
        assert "train.distilled_guidance: required: model flux-tiny has a guidance embedder" in err, err
        assert "--set train.distilled_guidance=1.0" in err
    assert main(["check-config", "tiny-mxfp6", *init, "--set", "model.overrides.guidance_embed=true",
                 "--set", "train.distilled_guidance=1.0"]) == 0
    assert "guidance_embed: true" in capsys.readouterr().out  # a bool in the printed config, not 1
    # A value for a model without the embedder would be read by nothing: refused, not ignored.
    err = error_of(["check-config", "tiny-mxfp6", "--set", "train.distilled_guidance=1.0"], capsys)
    assert "train.distilled_guidance: 1.0 is set, but model flux-tiny has no guidance embedder" in err
    err = error_of(["check-config", "tiny-mxfp6", "--set", "train.distilled_guidance=-1"], capsys)
    assert "train.distilled_guidance" in err and "greater than or equal to 0" in err


def test_dev_weights_train_resume_bit_for_bit_and_sample_with_the_recipes_guidance(data, dev_weights, tmp_path,
                                                                                  capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, data, dev_weights, "--set", "train.distilled_guidance=1.0") == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    evals = eval_rows(straight)
    assert [step for step, _ in evals] == [0, 4]
    losses = [e for _, e in evals]
    assert losses[1] < 0.95 * losses[0], losses  # the loaded weights' loss first, then after 4 steps
    train_loss = [float(x) for x in train_losses(straight)]
    assert sum(train_loss[2:]) < sum(train_loss[:2]), train_loss

    # The step-0 eval is that of the weights fed guidance 1.0 (`mxflux eval --weights`, bit for bit);
    # another value gives another loss: the input is really fed, and it matters.
    weights_eval = ["eval", "--weights", str(dev_weights), "--recipe", "tiny-mxfp6", "--device", "cpu",
                    "--set", f"data.root={data}", *DEV]
    assert main([*weights_eval, "--set", "train.distilled_guidance=1.0"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_loss"] == losses[0]
    assert main([*weights_eval, "--set", "train.distilled_guidance=3.5"]) == 0
    assert abs(json.loads(capsys.readouterr().out)["eval_loss"] - losses[0]) > 1e-4

    # Interrupted after 2 steps and resumed: the same losses and the same final weights, bit for bit.
    assert train(split, data, dev_weights, "--set", "train.distilled_guidance=1.0", "--max-steps", "2") == 0
    assert main(["train", "--resume", str(split), "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert len(train_losses(straight)) == 4
    assert train_losses(split) == train_losses(straight)
    assert eval_rows(split)[::2] == evals  # and an eval where the first part stopped
    a = torch.load(straight / "latest.pt", map_location="cpu", weights_only=False)
    b = torch.load(split / "latest.pt", map_location="cpu", weights_only=False)
    assert a["config"]["train"]["distilled_guidance"] == 1.0 and a["config"]["model"]["overrides"] == {
        "guidance_embed": True}
    model_a, model_b = a["model"], b["model"]
    assert model_a.keys() == model_b.keys() and "guidance_in.in_layer.weight" in model_a
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    loaded = load_flux_weights(dev_weights)
    assert not torch.equal(model_a["guidance_in.in_layer.weight"], loaded["guidance_in.in_layer.weight"])  # trained

    # Sampling: the run's samples.png and `mxflux sample` draw with the recipe's value by default;
    # --distilled-guidance overrides it.
    import matplotlib.image

    def sample(*extra) -> torch.Tensor:
        out = tmp_path / f"s{len(list(tmp_path.glob('s*.png')))}.png"
        assert main(["sample", str(straight), "--prompt", PROMPT, "--steps", "2", "--device", "cpu",
                     "--out", str(out), *extra]) == 0
        assert json.loads(capsys.readouterr().out)["samples"] == str(out)
        return torch.from_numpy(matplotlib.image.imread(out))

    assert Path(result["samples_png"]).is_file()
    run_samples = torch.from_numpy(matplotlib.image.imread(result["samples_png"]))
    default, same, dev_default = sample(), sample("--distilled-guidance", "1.0"), sample("--distilled-guidance", "3.5")
    assert torch.equal(default, run_samples) and torch.equal(default, same)
    assert not torch.equal(default, dev_default)


def test_sampling_a_model_without_an_embedder_refuses_a_guidance_value(data, tmp_path, capsys):
    from safetensors.torch import save_file

    schnell = tmp_path / "flux1-tiny.safetensors"
    save_file({k: v.contiguous() for k, v in Flux(flux_config("flux-tiny")).state_dict().items()}, schnell)
    err = error_of(["sample", "--weights", str(schnell), "--data", str(data), "--prompt", PROMPT, "--steps", "1",
                    "--device", "cpu", "--distilled-guidance", "3.5", "--out", str(tmp_path / "x.png")], capsys)
    assert "--distilled-guidance 3.5: this model has no guidance embedder" in err
    assert not (tmp_path / "x.png").exists()


def test_finetune_dev_recipe_checks_against_a_header_only_12b_dev_file(tmp_path, capsys):
    from mxflux.train import load_recipe

    dev, schnell = load_recipe("flux12b-mxfp6-finetune-dev"), load_recipe("flux12b-mxfp6-finetune")
    assert dev.model.flux_config() == flux_config("flux-12b", guidance_embed=True)
    assert dev.train.distilled_guidance == 1.0 and schnell.train.distilled_guidance is None
    # Only what dev needs differs from the schnell fine-tune: the model, its weights, its data, the guidance.
    assert dev.model.model_copy(update={"name": "flux-12b", "init_from": schnell.model.init_from}) == schnell.model
    assert dev.train.model_copy(update={"distilled_guidance": None}) == schnell.train
    assert (dev.precision, dev.optim, dev.batch, dev.distributed, dev.mlperf) == (
        schnell.precision, schnell.optim, schnell.batch, schnell.distributed, schnell.mlperf)

    dev_file = header_only_checkpoint(tmp_path / "flux1-dev.safetensors", flux_config("flux-12b-dev"))
    assert dev_file.stat().st_size < 200_000  # the header of 12B parameters, no data
    assert main(["check-config", "flux12b-mxfp6-finetune-dev", "--set", f"model.init_from={dev_file}"]) == 0
    err = capsys.readouterr().err
    assert "# OK: flux12b-mxfp6-finetune-dev is valid (mxfp6, model flux-12b-dev" in err
    schnell_file = header_only_checkpoint(tmp_path / "flux1-schnell.safetensors", flux_config("flux-12b"))
    err = error_of(["check-config", "flux12b-mxfp6-finetune-dev", "--set", f"model.init_from={schnell_file}"],
                   capsys)
    assert "guidance_embed=False (model: True)" in err and "a recipe that fits it: --set model.name=flux-12b\n" in err
