"""Fine-tuning from released weights end to end: `mxflux train --set model.init_from=...` starts
from them (its step-0 eval loss is `mxflux eval --weights` of them), check-config refuses a
checkpoint of another shape, 2 FSDP2 ranks load what 1 rank loads, and `mxflux sample` samples
straight from weights and decodes with a saved diffusers AutoencoderKL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxflux.cli import main
from mxflux.data import build_demo_dataset
from mxflux.model import flux_config, load_flux_weights

diffusers = pytest.importorskip("diffusers", reason="pip install -e '.[test]' installs diffusers")

from test_model_diffusers_equivalence import random_diffusers_flux  # noqa: E402

SMALL = ["--set", "batch.global_batch_size=8", "--set", "batch.micro_batch_size=8", "--set", "train.eval_samples=16",
         "--set", "train.log_every=1", "--set", "train.sample_prompts=[]", "--set", "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_demo_dataset(tmp_path_factory.mktemp("d") / "demo", n_train=32, n_eval=16)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A random flux-tiny FluxTransformer2DModel saved in shards in a diffusers pipeline folder.

    Scaled down from the unit-gain weights of the equivalence test so that the tiny model's
    velocity is of the order of the targets (a loss near 2, not 1e3)."""
    model = random_diffusers_flux(flux_config("flux-tiny"), torch.Generator().manual_seed(17))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(0.5)
    root = tmp_path_factory.mktemp("w") / "FLUX.1-tiny"
    model.save_pretrained(root / "transformer", max_shard_size="1MB")
    return root


def eval_rows(run: Path) -> list[tuple[int, float]]:
    rows = [r.split(",") for r in (run / "metrics.csv").read_text().splitlines()[1:]]
    return [(int(r[0]), float(r[3])) for r in rows if r[2] == "eval"]


def test_train_starts_from_the_weights_and_check_config_validates_them(data, weights, tmp_path, capsys):
    init = ["--set", f"model.init_from={weights}", "--set", f"data.root={data}"]
    assert main(["check-config", "tiny-mxfp6", *init]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["check-config", "tiny-mxfp6", *init, "--set", "model.overrides.depth=3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "does not fit the model config" in err and "depth=2 (model: 3)" in err
    assert "missing from the checkpoint (24): double_blocks.2.* (24 tensors)" in err

    run = tmp_path / "run"
    assert main(["train", "tiny-mxfp6", "--out", str(run), "--device", "cpu", "--no-progress", "--max-steps", "2",
                 *init, *SMALL]) == 0
    capsys.readouterr()
    evals = eval_rows(run)
    assert [step for step, _ in evals] == [0, 2]  # the loaded weights' loss first, then after training

    # `mxflux eval --weights` of the same weights under the same recipe: the same number, bit for bit.
    assert main(["eval", "--weights", str(weights), "--recipe", "tiny-mxfp6", "--device", "cpu",
                 "--set", f"data.root={data}", *SMALL]) == 0
    loaded = json.loads(capsys.readouterr().out)
    assert loaded["eval_loss"] == evals[0][1] and loaded["step"] == 0

    # The weights were really loaded: a fresh MLPerf-initialised model outputs exactly 0, so its
    # loss is that of the zero velocity, not this one.
    from mxflux.train import load_recipe
    from mxflux.train.trainer import Trainer

    fresh = Trainer(load_recipe("tiny-mxfp6", [f"data.root={data}", "train.eval_samples=16"]), device="cpu")
    assert abs(fresh.evaluate() - evals[0][1]) > 1e-2

    # The run's checkpoint evaluates to its last logged loss (without reading init_from again).
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_loss"] == evals[-1][1]


@pytest.mark.slow
def test_two_fsdp_ranks_load_what_one_rank_loads(data, weights):
    """tests/weights_fsdp_worker.py: sharded parameters (Trainer-built and meta-built) equal the
    checkpoint bit for bit, each rank holding part; the 2-rank eval loss equals 1 rank's."""
    worker = Path(__file__).with_name("weights_fsdp_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29641",
           str(worker), str(data), str(weights)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(li for li in proc.stdout.splitlines() if li.startswith("OK "))
    two = json.loads(line[3:])
    assert two["world"] == 2

    sys.path.insert(0, str(worker.parent))
    try:
        from weights_fsdp_worker import recipe
    finally:
        sys.path.remove(str(worker.parent))
    from mxflux.train.trainer import Trainer

    one = Trainer(recipe(str(data), str(weights)), device="cpu")
    reference = load_flux_weights(weights)
    assert all(torch.equal(p, reference[n]) for n, p in one.model.named_parameters())
    # The same eval batches on either world size: only the order of the fp64 sum can differ.
    assert two["eval_loss"] == pytest.approx(one.evaluate(), rel=1e-12)


def tiny_autoencoder(root: Path) -> Path:
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 32),
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                  norm_num_groups=8, scaling_factor=0.5, shift_factor=0.1)
    vae.save_pretrained(root)
    return root


def test_sample_from_weights_decodes_with_a_saved_autoencoder(data, weights, tmp_path, capsys):
    from mxflux.train.sample import VaeDecoder

    vae_dir = tiny_autoencoder(tmp_path / "vae")
    bfl = tmp_path / "flux1-tiny.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in load_flux_weights(weights).items()}, bfl)

    out = tmp_path / "grid.png"
    prompts = ["a large red circle in the center", "a small blue square at the top left"]
    assert main(["sample", "--weights", str(bfl), "--vae", str(vae_dir), "--data", str(data), "--steps", "2",
                 "--device", "cpu", "--out", str(out), *[a for p in prompts for a in ("--prompt", p)]]) == 0
    assert json.loads(capsys.readouterr().out) == {"samples": str(out), "prompts": prompts}
    import matplotlib.image

    grid = matplotlib.image.imread(out)
    assert grid.ndim == 3 and grid.shape[0] > 100 and grid.shape[1] > 200  # two captioned panels

    # The decoder is the saved VAE with its own normalisation: 2x downsampling, latents un-normalised
    # by scaling_factor / shift_factor before the sampler returns them.
    decoder = VaeDecoder.from_pretrained(vae_dir, device="cpu", dtype=torch.float32)
    assert (decoder.downsample, decoder.latent_scale, decoder.latent_shift) == (2, 0.5, 0.1)
    assert decoder.latent_shape(32, 48) == (16, 16, 24)
    z = torch.randn(2, 16, 16, 16)
    reference = diffusers.AutoencoderKL.from_pretrained(vae_dir).eval()
    with torch.no_grad():
        expected = (reference.decode(z).sample + 1) / 2
    assert torch.equal(decoder.decode(z), expected)

    # A model whose text dims the demo encoder cannot feed is refused with the fix named.
    with pytest.raises(SystemExit):
        main(["sample", "--weights", str(bfl), "--model", "flux-small", "--data", str(data), "--prompt", "x",
              "--device", "cpu", "--out", str(tmp_path / "no.png")])
    assert "does not fit the model config" in capsys.readouterr().err


def header_only_checkpoint(path: Path, config) -> Path:
    """A BFL .safetensors file of `config`'s names and shapes with no tensor data: all that
    check-config reads, at 12B for the price of a few kilobytes."""
    from mxflux.model import Flux

    with torch.device("meta"):
        params = Flux(config).named_parameters()
    header, offset = {}, 0
    for name, p in params:
        shape = tuple(p.shape)
        size = 2 * p.numel()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    return path


def test_finetune_recipe_is_the_mlperf_model_with_fine_tune_optimisation(tmp_path, capsys):
    from mxflux.train import load_recipe

    tune, mlperf = load_recipe("flux12b-mxfp6-finetune"), load_recipe("flux12b-mxfp6-mlperf")
    assert tune.model.init_from and not tune.mlperf.enabled
    assert tune.model.model_copy(update={"init_from": None}) == mlperf.model
    assert (tune.precision, tune.distributed) == (mlperf.precision, mlperf.distributed)
    assert tune.optim.lr == 1e-5 and tune.optim.warmup_steps < mlperf.optim.warmup_steps

    schnell = header_only_checkpoint(tmp_path / "flux1-schnell.safetensors", flux_config("flux-12b"))
    assert main(["check-config", "flux12b-mxfp6-finetune", "--set", f"model.init_from={schnell}"]) == 0
    capsys.readouterr()
    dev = header_only_checkpoint(tmp_path / "flux1-dev.safetensors", flux_config("flux-12b", guidance_embed=True))
    with pytest.raises(SystemExit):
        main(["check-config", "flux12b-mxfp6-finetune", "--set", f"model.init_from={dev}"])
    err = capsys.readouterr().err
    assert "guidance_embed=True (model: False)" in err
    assert "a recipe that fits it: --set model.name=flux-12b-dev\n" in err  # flux12b-mxfp6-finetune-dev's model
