"""LoRA on a frozen MXFP6 base: the frozen layer's numerics, a run whose loss falls and whose base does
not move, exact resume, the adapters file loaded by diffusers' own loader, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxflux.cli import main
from mxflux.data import build_demo_dataset
from mxflux.mx.granularity import FoldGranularity
from mxflux.mx.hadamard import hadamard32, hadamard32_by_gemm
from mxflux.mx.metrics import snr_db
from mxflux.mx.operands import transposed_operand
from mxflux.mx.scaled_gemm import dequantize_operand, scaled_gemm_reference
from mxflux.model import Flux, diffusers_to_bfl, flux_config, image_ids
from mxflux.model.lora_file import load_lora_deltas, read_lora_metadata, save_lora_file
from mxflux.nn import MXFP6Linear
from mxflux.nn.frozen import FrozenMXFP6Linear, freeze_base
from mxflux.nn.lora import merge_lora
from mxflux.ops import mx_operands

diffusers = pytest.importorskip("diffusers", reason="pip install -e '.[test]' installs diffusers")
pytest.importorskip("peft", reason="pip install -e '.[test]' installs peft (diffusers' LoRA loader needs it)")

from test_model_diffusers_equivalence import random_diffusers_flux  # noqa: E402

SMALL = ["--set", "batch.global_batch_size=8", "--set", "batch.micro_batch_size=8", "--set", "train.eval_samples=16",
         "--set", "train.log_every=1", "--set", "train.sample_prompts=[]", "--set", "optim.warmup_steps=1",
         "--set", "train.eval_every_samples=48", "--set", "train.checkpoint_every=3", "--no-progress",
         "--device", "cpu"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_demo_dataset(tmp_path_factory.mktemp("d") / "demo", n_train=32, n_eval=16)


BASE_SEED = 17


def diffusers_base(seed: int):
    """A random flux-tiny FluxTransformer2DModel (non-zero everywhere, so gradients reach every block)."""
    model = random_diffusers_flux(flux_config("flux-tiny"), torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(0.5)
    return model


def base_file(path: Path, seed: int) -> Path:
    """`diffusers_base(seed)` in BFL's layout, as a LoRA run's model.init_from."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in diffusers_to_bfl(diffusers_base(seed).state_dict()).items()}, str(path))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_file(tmp_path_factory.mktemp("w") / "base.safetensors", BASE_SEED)


def exit_code(argv) -> int:
    """`mxflux ARGV`'s exit code, whether the CLI returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def eval_rows(run: Path) -> list[tuple[int, float]]:
    rows = [r.split(",") for r in (run / "metrics.csv").read_text().splitlines()[1:]]
    return [(int(r[0]), float(r[3])) for r in rows if r[2] == "eval"]


# --- the frozen layer -------------------------------------------------------------------------------


def _layers(gen, n=96, k=128):
    lin = MXFP6Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k ** 0.5)
        lin.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return lin, FrozenMXFP6Linear.from_mx_linear(lin, torch.float32)


def test_frozen_layer_keeps_one_byte_per_weight_and_its_forward_is_the_mx_layers_bit_for_bit(gen):
    lin, frozen = _layers(gen)
    assert not list(frozen.parameters())  # no master weight, no bf16 copy
    assert frozen.w_data.dtype == torch.float8_e4m3fn and frozen.w_data.numel() == 96 * 128
    assert frozen.w_scale.numel() == 96  # the fold's row scale: 4 bytes per row
    assert not frozen.state_dict()  # nothing of the base goes into checkpoints
    x = torch.randn(40, 128, generator=gen).bfloat16()
    with torch.no_grad():
        assert torch.equal(frozen(x), lin(x))


def test_frozen_layer_dgrad_is_dy_times_the_weight_its_bytes_hold(gen):
    """dX = dY·Wq: dY packed along N unrotated, Wᵀ's operand the same values re-scaled per column,
    the GEMM, and the rotation undone on dX; step by step from the references, bit for bit."""
    lin, frozen = _layers(gen)
    x = torch.randn(40, 128, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(40, 96, generator=gen).bfloat16()
    frozen(x).backward(dy)
    counter = torch.zeros(1, dtype=torch.int64)
    dy_data, dy_scale = mx_operands(dy, None, counter, True, False, "rowwise", False, "none", False)[:2]
    col_data, col_scale = transposed_operand(frozen.w_data, frozen.w_scale, FoldGranularity.ROWWISE)
    rotated = scaled_gemm_reference(dy_data, dy_scale, col_data, col_scale)
    assert torch.equal(x.grad, hadamard32_by_gemm(rotated))
    wq = hadamard32(dequantize_operand(frozen.w_data, frozen.w_scale), axis=-1)  # the frozen weight
    exact = dy.double() @ wq.double()
    assert snr_db(exact, x.grad.double()) > 25  # MXFP6 dY: ~30 dB
    assert snr_db(exact, rotated.double()) < 3  # the rotation left on: no gradient at all


def test_the_transposed_operand_holds_the_row_operands_values(gen):
    """Wᵀ's operand for the frozen dgrad holds exactly the values of W's row operand while a column
    spans at most 13 binades below its largest value; smaller ones round to E4M3's subnormal grid.
    Compiled (the CUDA path runs it through inductor), the same bits."""
    _, frozen = _layers(gen, n=64, k=256)
    values = dequantize_operand(frozen.w_data, frozen.w_scale)
    data, scale = transposed_operand(frozen.w_data, frozen.w_scale, FoldGranularity.ROWWISE)
    assert data.shape == (256, 64) and data.dtype == torch.float8_e4m3fn and scale.shape == (256, 1)
    assert torch.equal(dequantize_operand(data, scale), values.t())
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    compiled = torch.compile(transposed_operand, dynamic=False)
    got = compiled(frozen.w_data, frozen.w_scale, FoldGranularity.ROWWISE)
    assert torch.equal(got[0].view(torch.uint8), data.view(torch.uint8)) and torch.equal(got[1], scale)
    assert got[0].is_contiguous()  # row-major, as the GEMM takes it (inductor's own choice was column-major)
    # the column scale the frozen layer found once is the one a backward would find: the same bits from it
    assert torch.equal(frozen.w_column_scale, scale[:, 0])
    given = compiled(frozen.w_data, frozen.w_scale, FoldGranularity.ROWWISE, frozen.w_column_scale)
    assert torch.equal(given[0].view(torch.uint8), data.view(torch.uint8)) and torch.equal(given[1], scale)
    # a row 20 binades below the others: its values round, within 2^-17 of their column's largest
    w_data, w_scale = frozen.w_data.clone(), frozen.w_scale.clone()
    w_scale[5] *= 2.0**-20
    values = dequantize_operand(w_data, w_scale)
    data, scale = transposed_operand(w_data, w_scale, FoldGranularity.BLOCKWISE)
    assert data.shape == (256, 128) and scale.shape == (256, 1)  # rows padded to a whole group of 128
    got = dequantize_operand(data, scale)[:, :64].t()
    assert not torch.equal(got[5], values[5]) and torch.equal(got[:5], values[:5])
    assert ((got - values).abs() <= values.abs().amax(0) * 2.0**-17).all()


def test_freeze_base_leaves_no_trainable_or_fp32_tensor(base):
    model = Flux(flux_config("flux-tiny"))
    from mxflux.nn import apply_precision

    apply_precision(model, "mxfp6")
    frozen = freeze_base(model)
    assert len(frozen) == 20 and not any(p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(isinstance(m, MXFP6Linear) for m in model.modules())


# --- a LoRA run --------------------------------------------------------------------------------------


def test_lora_run_trains_the_adapters_only_and_writes_a_file_diffusers_loads(data, base, tmp_path, capsys):
    from mxflux.train import load_recipe
    from mxflux.train.adapters import adapter_tensors
    from mxflux.train.trainer import Trainer

    cfg = load_recipe("tiny-mxfp6-lora", [f"model.init_from={base}", f"data.root={data}", "batch.global_batch_size=8",
                                          "batch.micro_batch_size=8", "train.eval_samples=16", "optim.lr=1e-2",
                                          "train.sample_prompts=[]"])
    trainer = Trainer(cfg, device="cpu", out_dir=tmp_path / "run")
    frozen_before = {n: t.clone() for n, t in trainer.model.named_buffers() if n.endswith(("w_data", "w_scale"))}
    frozen_before.update({n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad})
    trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_down." in n or ".lora_up." in n for n in trained)
    assert len(trained) == 2 * 20  # every MX linear of flux-tiny carries an adapter
    first = trainer.evaluate()
    trainer.fit(progress=False, max_steps=30)
    last = trainer.evaluate()
    assert last < first * 0.97, (first, last)  # the loss falls
    for n, t in frozen_before.items():  # the base did not move, bit for bit
        now = dict(trainer.model.named_buffers()).get(n, dict(trainer.model.named_parameters()).get(n))
        assert torch.equal(now.view(torch.uint8) if now.dtype == torch.float8_e4m3fn else now,
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), n
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, trained[n])]
    assert len(changed) == len(trained)  # every adapter trained

    # The checkpoint holds the adapters (and their optimizer state) only; the file beside it, their values
    state = torch.load(tmp_path / "run" / "latest.pt", weights_only=False)
    assert set(state["model"]) == set(trained) and state["base_fingerprint"]
    meta = read_lora_metadata(tmp_path / "run" / "lora.safetensors")
    assert (meta["lora.rank"], meta["lora.alpha"], meta["base_model"]) == ("8", "8.0", "flux-tiny")
    assert meta["base_weights"] == str(base) and meta["step"] == "30"

    # Loaded by diffusers' own loader into diffusers' model of the same base: our merged model's output
    adapters = adapter_tensors(trainer.model)
    _compare_with_diffusers(base, tmp_path / "run" / "lora.safetensors", adapters, bf16_file=True)


def _inputs(config, gen):
    batch, h, w, txt_len = 2, 4, 6, 7
    return dict(img=torch.randn(batch, h * w, config.in_channels, generator=gen),
                txt=torch.randn(batch, txt_len, config.context_in_dim, generator=gen),
                y=torch.randn(batch, config.vec_in_dim, generator=gen), t=torch.rand(batch, generator=gen),
                txt_pos=torch.randint(0, 9, (txt_len, 3), generator=gen).float(), img_pos=image_ids(1, h, w)[0])


def _compare_with_diffusers(base: Path, lora_file: Path, adapters: dict, *, bf16_file: bool) -> None:
    """diffusers' model of the base (`diffusers_base(BASE_SEED)`, which `base` holds) with `lora_file`
    loaded by diffusers' own loader, against our Flux of `base` with `adapters` merged: the same output."""
    from safetensors.torch import load_file

    config = flux_config("flux-tiny")
    ours, plain = Flux(config), Flux(config)
    ours.load_state_dict(load_file(str(base)), strict=True)
    plain.load_state_dict(load_file(str(base)), strict=True)
    if bf16_file:  # the file holds the adapters rounded to bf16 (alpha/rank folded into up first)
        adapters = {n: (d.bfloat16().float(), (u.float() * s).bfloat16().float(), 1.0) for n, (d, u, s) in adapters.items()}
    merge_lora(ours, adapters)
    reference = diffusers_base(BASE_SEED).eval()
    reference.load_lora_adapter(diffusers.FluxPipeline.lora_state_dict(str(lora_file)), prefix="transformer",
                                adapter_name="mxflux")
    x = _inputs(config, torch.Generator().manual_seed(3))
    ours_in = dict(img=x["img"], img_ids=x["img_pos"].expand(2, -1, -1), txt=x["txt"],
                   txt_ids=x["txt_pos"].expand(2, -1, -1), timesteps=x["t"], y=x["y"])
    with torch.no_grad():
        expected = reference(hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["y"],
                             timestep=x["t"], img_ids=x["img_pos"], txt_ids=x["txt_pos"], return_dict=False)[0]
        got, without = ours.eval()(**ours_in), plain.eval()(**ours_in)
    scale = expected.abs().max()
    assert (got - without).abs().max() / scale > 1e-3  # the adapters change the output
    error = (got - expected).abs().max() / scale
    assert error < 1e-5, f"max |ours merged - diffusers with the LoRA| / max = {error:.3g}"


def test_adapters_file_roundtrips_through_our_loader_and_diffusers_fp32(base, tmp_path):
    """Every linear kind, the fused ones and the final layer's half-swapped modulation among them, in
    fp32: diffusers' model with the file loaded equals our merged model to fp32 summation order."""
    config = flux_config("flux-tiny")
    g = torch.Generator().manual_seed(5)
    names = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_attn.qkv", "double_blocks.0.img_attn.proj",
             "double_blocks.1.txt_mlp.0", "double_blocks.0.img_mlp.2", "double_blocks.0.img_mod.lin",
             "single_blocks.0.linear1", "single_blocks.1.linear2", "single_blocks.1.modulation.lin",
             "final_layer.adaLN_modulation.1", "txt_in"]
    model = Flux(config)
    adapters = {}
    for n in names:
        lin = model.get_submodule(n)
        adapters[n] = (torch.randn(4, lin.in_features, generator=g) * 0.05,
                       torch.randn(lin.out_features, 4, generator=g) * 0.05, 0.5)
    path = save_lora_file(tmp_path / "a.safetensors", adapters, config, {"base_model": "flux-tiny"},
                          dtype=torch.float32)
    deltas = dict(load_lora_deltas(path, config))
    assert set(deltas) == set(names)
    for n, (down, up, s) in adapters.items():
        torch.testing.assert_close(deltas[n], (up @ down) * s, rtol=1e-6, atol=1e-7)
    _compare_with_diffusers(base, path, adapters, bf16_file=False)


# --- resume and refusals ----------------------------------------------------------------------------


def test_lora_resume_continues_exactly_and_refuses_a_changed_base(data, tmp_path, capsys):
    base = base_file(tmp_path / "base.safetensors", 23)
    common = ["tiny-mxfp6-lora", "--set", f"model.init_from={base}", "--set", f"data.root={data}", *SMALL]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", *common, "--out", str(straight), "--max-steps", "6"]) == 0
    assert main(["train", *common, "--out", str(split), "--max-steps", "3"]) == 0
    assert main(["train", "--resume", str(split), "--max-steps", "6", "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    # the split run also evaluated where its first session stopped (step 3); every other row is the same
    assert [r for r in eval_rows(split) if r[0] != 3] == eval_rows(straight)

    def train_rows(run):
        rows = [r.split(",") for r in (run / "metrics.csv").read_text().splitlines()[1:]]
        return [(r[0], r[3]) for r in rows if r[2] == "train"]

    assert train_rows(split) == train_rows(straight) and len(train_rows(straight)) == 6
    a = torch.load(straight / "latest.pt", weights_only=False)["model"]
    b = torch.load(split / "latest.pt", weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    from safetensors.torch import load_file

    fa, fb = load_file(str(straight / "lora.safetensors")), load_file(str(split / "lora.safetensors"))
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)

    base_file(base, 24)  # the base's weights replaced in place
    before = (split / "latest.pt").read_bytes()
    assert exit_code(["train", "--resume", str(split), "--max-steps", "8", "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "another base" in err and "Traceback" not in err
    assert (split / "latest.pt").read_bytes() == before  # nothing written


@pytest.mark.parametrize("sets, message", [
    (["precision={fp8: hybrid}"], "FP8 base"),
    (["model.init_from=null"], "adapts a trained base"),
    (["lora.include=[double_blocks.*.img_atn.qkv]"], "matches no linear"),
    (["lora.rank=0"], "lora.rank"),
    (["precision.fused_mlp=on"], "fused_mlp"),
])
def test_lora_recipe_mistakes_are_one_line_exit_2(data, base, sets, message, tmp_path, capsys):
    args = ["train", "tiny-mxfp6-lora", "--set", f"model.init_from={base}", "--set", f"data.root={data}",
            *[x for s in sets for x in ("--set", s)], "--out", str(tmp_path / "r"), *SMALL]
    assert exit_code(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()[-1]) > 20
    assert not (tmp_path / "r" / "latest.pt").exists()


def test_sample_merges_a_lora_file_into_the_weights(data, base, tmp_path, capsys):
    config = flux_config("flux-tiny")
    model = Flux(config)
    lin = model.get_submodule("single_blocks.0.linear2")
    lora = save_lora_file(tmp_path / "l.safetensors", {"single_blocks.0.linear2": (
        torch.ones(2, lin.in_features) * 0.1, torch.ones(lin.out_features, 2) * 0.1, 1.0)}, config, {})
    out = {}
    for name, extra in (("plain", []), ("lora", ["--lora", str(lora)]), ("half", ["--lora", f"{lora}:0.5"])):
        assert main(["sample", "--weights", str(base), "--data", str(data), "--prompt", "a red circle", "--steps", "2",
                     "--device", "cpu", "--out", str(tmp_path / f"{name}.png"), *extra]) == 0
        out[name] = json.loads(capsys.readouterr().out)["samples"]
    import numpy as np
    from PIL import Image

    pix = {k: torch.from_numpy(np.asarray(Image.open(v))) for k, v in out.items()}
    assert not torch.equal(pix["plain"], pix["lora"]) and not torch.equal(pix["lora"], pix["half"])
    with pytest.raises(SystemExit):
        main(["sample", "--weights", str(base), "--lora", str(tmp_path / "missing.safetensors"), "--prompt", "x",
              "--device", "cpu", "--out", str(tmp_path / "x.png")])
    assert "--lora" in capsys.readouterr().err


def test_a_lora_run_with_an_ema_writes_the_averaged_adapters(data, base, tmp_path):
    from safetensors.torch import load_file

    from mxflux.train import load_recipe
    from mxflux.train.adapters import adapter_tensors
    from mxflux.train.trainer import Trainer

    cfg = load_recipe("tiny-mxfp6-lora", [f"model.init_from={base}", f"data.root={data}", "batch.global_batch_size=8",
                                          "batch.micro_batch_size=8", "train.eval_samples=8", "optim.lr=1e-2",
                                          "train.sample_prompts=[]", "train.ema_decay=0.5"])
    trainer = Trainer(cfg, device="cpu", out_dir=tmp_path / "run")
    trainer.fit(progress=False, max_steps=4)
    written = load_file(str(tmp_path / "run" / "lora.safetensors"))
    key = "transformer.single_transformer_blocks.0.proj_out.lora_B.weight"  # single_blocks.0.linear2's up
    raw = [t.clone() for t in adapter_tensors(trainer.model)["single_blocks.0.linear2"][:2]]
    with trainer.sampling_weights():
        down, up, scale = adapter_tensors(trainer.model)["single_blocks.0.linear2"]
        averaged = (down.clone(), up.clone(), scale)
    assert not torch.equal(raw[1], averaged[1])
    assert torch.equal(written[key], (averaged[1].float() * averaged[2]).bfloat16())


def test_export_writes_the_runs_ema_weights_in_either_dtype(data, tmp_path, capsys):
    from safetensors.torch import load_file

    from mxflux.train.checkpoint import load_checkpoint

    run = tmp_path / "run"
    assert main(["train", "tiny-mxfp6", "--out", str(run), "--set", f"data.root={data}", "--set", "train.ema_decay=0.5",
                 "--max-steps", "3", *SMALL]) == 0
    state = load_checkpoint(run / "latest.pt")
    name = "single_blocks.0.linear2.weight"
    assert not torch.equal(state["ema"][name], state["model"][name])
    for dtype, extra in (("float32", []), ("bfloat16", []), ("float32", ["--no-ema"])):
        out = tmp_path / f"{dtype}{'-raw' if extra else ''}.safetensors"
        assert main(["export", str(run), "--out", str(out), "--dtype", dtype, "--device", "cpu", *extra]) == 0
        want = state["model" if extra else "ema"][name].to(getattr(torch, dtype))
        assert torch.equal(load_file(str(out))[name], want), (dtype, extra)
    capsys.readouterr()
    assert exit_code(["export", str(run), "--out", str(out)]) == 2  # never over an existing file


def test_check_config_names_the_adapters_and_refuses_what_train_refuses(capsys):
    assert main(["check-config", "flux12b-mxfp6-lora-dev"]) == 0
    err = capsys.readouterr().err
    # 228 MX linears of flux-12b; rank 16 x (in + out) summed is what bench_lora's H100 run trained
    assert "rank 16, alpha 16 on 228 linears: 56.0 M trained parameters" in err and "frozen base holds 14.1" in err
    assert exit_code(["check-config", "tiny-mxfp6-lora", "--set", "lora.include=[double_blocks.*.img_atn.qkv]"]) == 2
    assert "matches no linear" in capsys.readouterr().err
