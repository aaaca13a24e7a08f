"""Recipes: typed schema, clear errors, overrides, and the MLPerf recipes' one-block difference."""

from importlib import resources

import pytest
import yaml

from mxflux.train import RecipeError, load_recipe, recipe_names

EXPECTED = {"tiny-bf16", "tiny-mxfp6", "flux535m-bf16", "flux535m-mxfp6", "flux12b-bf16-mlperf",
            "flux12b-fp8-mlperf", "flux12b-mxfp6-mlperf", "flux12b-mxfp6-dev"}


def test_every_built_in_recipe_validates():
    assert EXPECTED <= set(recipe_names())
    for name in recipe_names():
        cfg = load_recipe(name)
        assert cfg.name == name


def test_precision_of_each_recipe():
    assert load_recipe("tiny-mxfp6").precision.name == "mxfp6"
    assert load_recipe("tiny-bf16").precision.name == "bf16"
    assert load_recipe("flux12b-fp8-mlperf").precision.name == "fp8"
    assert load_recipe("flux12b-mxfp6-mlperf").precision.fused_mlp == "off"  # measured slower, RESULTS.md


def _raw(name):
    return yaml.safe_load((resources.files("mxflux.recipes") / f"{name}.yaml").read_text())


def test_mlperf_recipes_differ_only_in_the_precision_block():
    fp8, mx, bf = _raw("flux12b-fp8-mlperf"), _raw("flux12b-mxfp6-mlperf"), _raw("flux12b-bf16-mlperf")
    for other in (mx, bf):  # the description names the precision too (`mxflux recipes` tells them apart)
        assert ({k: v for k, v in other.items() if k not in ("precision", "description")}
                == {k: v for k, v in fp8.items() if k not in ("precision", "description")})
    assert [r["description"].rsplit("), ", 1)[1] for r in (fp8, mx, bf)] == [
        "torchao FP8 tensorwise", "MXFP6 linears", "bf16: the baseline"]
    cfg = load_recipe("flux12b-mxfp6-mlperf")
    # The MLPerf reference point for GBS 512 (rcps_flux1.json) and the rules' fixed constants.
    assert (cfg.batch.global_batch_size, cfg.optim.lr, cfg.optim.warmup_steps) == (512, 2e-4, 1600)
    assert (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps, cfg.optim.weight_decay, cfg.optim.grad_clip) == (
        0.9, 0.95, 1e-8, 0.1, 1.0)
    assert cfg.train.eval_every_samples == 262144 and cfg.train.eval_samples == 29696


def test_overrides():
    cfg = load_recipe("tiny-mxfp6", ["optim.lr=3e-4", "precision.mx_gemm=exact", "train.sample_prompts=[a, b]"])
    assert cfg.optim.lr == 3e-4 and cfg.precision.mx_gemm == "exact" and cfg.train.sample_prompts == ("a", "b")


@pytest.mark.parametrize("overrides, message", [
    (["optim.lrr=1"], "optim.lrr: unknown key"),
    (["optim.lr=fast"], "optim.lr: Input should be a valid number"),
    (["precision.fp8=hybrid"], "precision: fp6 and fp8 are both set"),
    (["batch.global_batch_size=100", "batch.micro_batch_size=32"], "global_batch_size 100 is not divisible by micro_batch_size 32"),
    (["model.name=flux-99b"], "model.name: unknown model 'flux-99b'"),
    (["lr"], "expected key=value"),
    (["train.ema_decay=1"], "train.ema_decay: Input should be less than 1"),
    (["train.cuda_graph=true", "model.compile=true", "model.compile_mode=reduce-overhead"],
     "train.cuda_graph: true captures the whole step, which cannot hold the per-block CUDA graphs"),
])
def test_bad_recipes_name_the_field(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("tiny-mxfp6", overrides)


def test_unknown_recipe_and_file(tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe 'nope'"):
        load_recipe("nope")
    p = tmp_path / "mine.yaml"
    p.write_text("model: {name: flux-tiny}\nprecision: {fp6: e2m3}\n")
    assert load_recipe(str(p)).name == "mine"
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(str(tmp_path / "missing.yaml"))


def test_world_size_divisibility():
    cfg = load_recipe("flux12b-mxfp6-mlperf")
    assert cfg.batch.accumulation_steps(8) == 1 and cfg.batch.accumulation_steps(2) == 4
    # a RecipeError: every command reports it as one line naming the field, not a traceback
    with pytest.raises(RecipeError, match="batch.global_batch_size 512 is not divisible by micro_batch_size × world "
                                          "size = 64 × 3"):
        cfg.batch.accumulation_steps(3)


def test_model_overrides_replace_config_fields_and_reject_unknown_ones():
    cfg = load_recipe("tiny-bf16", ["model.overrides={hidden_size: 768, num_heads: 12, depth: 1}"])
    fc = cfg.model.flux_config()
    assert (fc.hidden_size, fc.num_heads, fc.depth, fc.depth_single_blocks) == (768, 12, 1, 2)
    with pytest.raises(RecipeError, match="overrides: .*hiden"):
        load_recipe("tiny-bf16", ["model.overrides={hiden: 768}"])
    with pytest.raises(RecipeError, match="overrides: hidden_size 128 is not divisible by num_heads 5"):
        load_recipe("tiny-bf16", ["model.overrides={num_heads: 5}"])


def test_block_cuda_graphs_are_refused_for_several_processes_with_the_reason():
    import torch

    from mxflux.train.build import build_model
    from mxflux.train.distributed import DistContext
    from mxflux.train.parallelize import parallelize

    cfg = load_recipe("tiny-mxfp6", ["model.compile=true", "model.compile_mode=reduce-overhead"])
    model, _ = build_model(cfg, torch.device("cpu"))
    for world in (2, 8):
        ctx = DistContext(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"))
        with pytest.raises(ValueError, match=f"model.compile_mode: reduce-overhead .* one process only, got world "
                                             f"size {world}: under FSDP2"):
            parallelize(model, cfg, ctx)


def test_the_mx_weights_optimizer_flags_are_mxfp6_options_and_old_recipes_still_load():
    from mxflux.train.config import config_from_dict
    from mxflux.train.identity import run_identity

    mx = load_recipe("tiny-mxfp6", ["precision.weight_operands_in_optimizer=false"])
    assert mx.precision.weight_operands_in_optimizer is False and mx.precision.weight_exponents_in_optimizer
    with pytest.raises(RecipeError, match="weight_operands_in_optimizer: an option of precision mxfp6, but this "
                                          "recipe runs bf16"):
        load_recipe("tiny-bf16", ["precision.weight_operands_in_optimizer=false"])

    # a checkpoint's config from before the move: the value moves under MXFP6, is dropped elsewhere
    old = load_recipe("tiny-mxfp6").model_dump(mode="json")
    for k in ("weight_exponents_in_optimizer", "weight_operands_in_optimizer"):
        del old["precision"][k]
    old["optim"]["weight_exponents_in_optimizer"] = False
    assert config_from_dict(old, "old").precision.weight_exponents_in_optimizer is False
    old_bf16 = {**load_recipe("tiny-bf16").model_dump(mode="json"), "optim": old["optim"]}
    for k in ("weight_exponents_in_optimizer", "weight_operands_in_optimizer"):
        del old_bf16["precision"][k]
    assert config_from_dict(old_bf16, "old").precision.weight_exponents_in_optimizer is True
    both = {**old, "precision": {**old["precision"], "weight_exponents_in_optimizer": True}}
    with pytest.raises(RecipeError, match="optim.weight_exponents_in_optimizer and precision."
                                          "weight_exponents_in_optimizer are both set"):
        config_from_dict(both, "both")

    # options that keep the values leave the run's identity as it is; the others change it
    base = run_identity(load_recipe("tiny-mxfp6"))
    for same in ("precision.repack_weights=true", "precision.saved_operands=e2m3",
                 "precision.weight_exponents_in_optimizer=false"):
        assert run_identity(load_recipe("tiny-mxfp6", [same])) == base, same
    assert run_identity(load_recipe("tiny-mxfp6", ["precision.mx_gemm=blockwise"])) != base
