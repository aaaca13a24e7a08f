"""The trainer on the CPU: objective, validation loss, LR schedule, checkpoints, resume, CLI run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mxflux.train import RecipeError, load_recipe
from mxflux.train.checkpoint import save_checkpoint
from mxflux.train.ema import ema_decay_at
from mxflux.train.flow import cfg_dropout, euler_sample, noised, per_sample_mse, shift_time
from mxflux.train.trainer import Trainer, lr_factor


def make_trainer(demo_root, tmp_path, *extra, recipe="tiny-mxfp6"):
    cfg = load_recipe(recipe, [f"data.root={demo_root}", f"train.out_dir={tmp_path}/run",
                               "batch.global_batch_size=8", "batch.micro_batch_size=4", "train.eval_batch_size=8",
                               "train.eval_samples=16", "train.log_every=1", "train.sample_prompts=[]",
                               "optim.warmup_steps=2", *extra])
    return Trainer(cfg, device="cpu")


def test_flow_pieces(gen):
    x0 = torch.randn(4, 16, 8, 8, generator=gen)
    eps = torch.randn(4, 16, 8, 8, generator=gen)
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    xt, target = noised(x0, eps, t)
    assert torch.equal(xt[0], x0[0]) and torch.equal(xt[3], eps[3])
    assert torch.allclose(xt[1], 0.75 * x0[1] + 0.25 * eps[1]) and torch.equal(target, eps - x0)
    # Euler integration of the exact velocity field of one straight path recovers x0 exactly.
    out = euler_sample(lambda x, t_: eps - x0, eps, steps=8)
    assert torch.allclose(out, x0, atol=1e-5)
    assert torch.allclose(per_sample_mse(xt, xt + 2.0), torch.full((4,), 4.0))


def test_time_shift_moves_training_and_sampling_times_towards_the_noise(demo_root, tmp_path):
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert torch.equal(shift_time(t, 1.0), t)
    assert torch.allclose(shift_time(t, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    # The sampler visits the shifted grid: record the times it asks for.
    seen = []
    x = torch.zeros(1, 4)
    euler_sample(lambda x_, t_: seen.append(float(t_[0])) or torch.zeros_like(x_), x, steps=4, shift=3.0)
    assert seen == pytest.approx(shift_time(torch.tensor([1.0, 0.75, 0.5, 0.25]), 3.0).tolist())
    # Training: the model sees shift_time of the uniform draw, for the same draws as unshifted.
    times = {}
    for shift in (1.0, 3.0):
        tr = make_trainer(demo_root, tmp_path, f"train.timestep_shift={shift}")
        def forward(*args, _shift=shift, **kw):
            times[_shift] = kw["timesteps"]
            return torch.zeros_like(kw["img"], dtype=torch.float32)

        tr.model.forward = forward
        batch = next(tr.batches())
        tr.training_loss(tr._to_device(batch))
    assert torch.allclose(times[3.0], shift_time(times[1.0], 3.0)) and not torch.equal(times[3.0], times[1.0])


def test_cfg_dropout_uses_the_empty_encodings(gen):
    t5, clip = torch.randn(64, 3, 5, generator=gen), torch.randn(64, 7, generator=gen)
    e5, ec = torch.zeros(3, 5), torch.zeros(7)
    a, b = cfg_dropout(t5, clip, e5, ec, 1.0, gen)
    assert (a == 0).all() and (b == 0).all()
    a, b = cfg_dropout(t5, clip, e5, ec, 0.0, gen)
    assert a is t5 and b is clip
    a, b = cfg_dropout(t5, clip, e5, ec, 0.5, gen)
    dropped = (a == 0).flatten(1).all(1)
    assert torch.equal(dropped, (b == 0).all(1)) and 10 < int(dropped.sum()) < 54


def test_setup_places_empty_encodings_once_and_swaps_mx_linears(demo_root, tmp_path):
    tr = make_trainer(demo_root, tmp_path)
    assert tr.t5_empty.dtype == torch.bfloat16 and tr.t5_empty.device.type == "cpu"
    assert tr.precision_report.count("mxfp6") + tr.precision_report.count("mxfp6-fused") == 20
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())  # fp32 master weights
    assert tr.accum == 2


def test_lr_warms_up_linearly_then_stays_constant(demo_root, tmp_path):
    tr = make_trainer(demo_root, tmp_path, "optim.lr=1e-3", "optim.warmup_steps=4", "optim.decay=none")
    batches = tr.batches()
    lrs = [tr.train_step([next(batches) for _ in range(2)]).lr for _ in range(7)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3])


def test_lr_factor_decays_after_the_warm_up():
    # constant: the MLPerf schedule, whatever the run length
    assert [lr_factor(4, "none", None, 0.0, 10, s) for s in range(6)] == pytest.approx([.25, .5, .75, 1, 1, 1])
    # cosine over all 8 steps after a 2-step warm-up of a 10-step run: 1 at step 2, never 0
    got = [lr_factor(2, "cosine", None, 0.0, 10, s) for s in range(10)]
    want = [.5, 1] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert got == pytest.approx(want) and got[-1] > 0
    # linear over the last 4 steps towards 0.1
    got = [lr_factor(0, "linear", 4, 0.1, 10, s) for s in range(10)]
    assert got == pytest.approx([1] * 6 + [1, 0.775, 0.55, 0.325])
    # a decay longer than the run after the warm-up overlaps the warm-up: the factors multiply
    assert lr_factor(4, "linear", 10, 0.0, 10, 1) == pytest.approx(0.5 * 0.9)


def test_lr_decays_to_the_end_of_the_run_and_resumes_on_schedule(demo_root, tmp_path):
    extra = ("optim.lr=1e-3", "optim.warmup_steps=2", "optim.decay=cosine", "optim.min_lr_ratio=0",
             "train.train_samples=48")
    tr = make_trainer(demo_root, tmp_path, *extra)
    assert tr.total_steps == 6
    batches = tr.batches()
    lrs = [tr.train_step([next(batches) for _ in range(2)]).lr for _ in range(3)]
    path = tr.save(tmp_path / "mid.pt")
    lrs += [tr.train_step([next(batches) for _ in range(2)]).lr for _ in range(3)]
    assert lrs == pytest.approx([1e-3 * lr_factor(2, "cosine", None, 0.0, 6, s) for s in range(6)])
    assert lrs[1] == lrs[2] == pytest.approx(1e-3) and lrs[2] > lrs[3] > lrs[4] > lrs[5] > 0
    again = make_trainer(demo_root, tmp_path, *extra)
    again.resume(path)
    batches = again.batches()
    assert [again.train_step([next(batches) for _ in range(2)]).lr for _ in range(3)] == pytest.approx(lrs[3:])


def test_reported_losses_are_not_rescaled_by_micro_batching(demo_root, tmp_path):
    """The seed's bug: a reported loss aliasing the tensor that is divided by the number of
    micro-batches came out halved at 2 micro-batches. Here: 2 micro-batches per step."""
    tr = make_trainer(demo_root, tmp_path)
    batches = tr.batches()
    micro = [next(batches) for _ in range(2)]
    with torch.no_grad():  # the noise is a function of (seed, step, index): the step redraws the same
        direct = [float(tr.training_loss(tr._to_device(b))) for b in micro]
    reported = tr.train_step(micro).read()["loss"]
    assert reported == pytest.approx(sum(direct) / 2, rel=1e-6)

    # Validation: Σloss/Σcount over two eval batches equals the per-sample mean computed directly.
    v2 = tr.evaluate()
    tr_one = make_trainer(demo_root, tmp_path, "train.eval_batch_size=16")
    tr_one.model.load_state_dict(tr.model.state_dict())
    v1 = tr_one.evaluate()
    assert isinstance(v2, float) and v2 == pytest.approx(v1, rel=1e-6)
    assert v2 == tr.evaluate()  # fixed t = k/8 and fixed noise: deterministic


def test_checkpoints_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"v": 1})

    def broken_save(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"v": 2})
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temp file left behind


def test_resume_continues_exactly(demo_root, tmp_path):
    a = make_trainer(demo_root, tmp_path / "a")
    batches = a.batches()
    a.train_step([next(batches) for _ in range(2)])
    a.train_step([next(batches) for _ in range(2)])
    ck = a.save(tmp_path / "ck.pt")
    want = [a.train_step([next(batches) for _ in range(2)]).read()["loss"] for _ in range(3)]

    b = make_trainer(demo_root, tmp_path / "b")
    b.resume(ck)
    assert (b.step, b.samples, b.batch_in_epoch) == (2, 16, 4)
    nb = b.batches()
    got = [b.train_step([next(nb) for _ in range(2)]).read()["loss"] for _ in range(3)]
    assert got == want  # bit for bit: weights, optimizer, LR, data order and RNG all resumed


def test_ema_of_the_weights_follows_its_formula_and_resumes_exactly(demo_root, tmp_path):
    """train.ema_decay: after step n the average moves (1 − d_n) of the way to the weights, d_n =
    min(decay, (1 + n)/(10 + n)); a checkpoint keeps it, and a resumed run's averages (and losses)
    are the uninterrupted run's bit for bit."""
    assert [ema_decay_at(0.9, n) for n in (1, 10, 80, 81, 1000)] == pytest.approx([2 / 11, 11 / 20, 81 / 90, 0.9, 0.9])
    a = make_trainer(demo_root, tmp_path / "a", "train.ema_decay=0.9")
    name, param = next(iter(a.ema.params.items()))
    assert torch.equal(a.ema.averages[name], param.detach())  # starts at the initial weights
    batches = a.batches()
    for _ in range(2):
        before = a.ema.averages[name].clone()
        a.train_step([next(batches) for _ in range(2)])
        d = ema_decay_at(0.9, a.step)
        assert torch.allclose(a.ema.averages[name], before + (1 - d) * (param.detach() - before), atol=1e-7)
    ck = a.save(tmp_path / "ck.pt")
    assert set(torch.load(ck, weights_only=False)["ema"]) == set(a.ema.averages)
    want = [a.train_step([next(batches) for _ in range(2)]).read()["loss"] for _ in range(3)]

    b = make_trainer(demo_root, tmp_path / "b", "train.ema_decay=0.9")
    b.resume(ck)
    nb = b.batches()
    got = [b.train_step([next(nb) for _ in range(2)]).read()["loss"] for _ in range(3)]
    assert got == want
    assert all(torch.equal(a.ema.averages[k], b.ema.averages[k]) for k in a.ema.averages)

    # Samples are drawn with the averages; the weights are the trained ones again afterwards.
    trained = param.detach().clone()
    with a.sampling_weights():
        assert torch.equal(param, a.ema.averages[name]) and not torch.equal(param, trained)
    assert torch.equal(param, trained)
    # A checkpoint without averages does not resume a recipe that keeps them (nor silently restart them).
    plain = make_trainer(demo_root, tmp_path / "c")
    plain.save(tmp_path / "plain.pt")
    plain.save(tmp_path / "plain.dcp", sharded=True)
    for ck in ("plain.pt", "plain.dcp"):
        with pytest.raises(ValueError, match="holds none"):
            make_trainer(demo_root, tmp_path / "d", "train.ema_decay=0.9").resume(tmp_path / ck)
    # A sharded directory written by one process holds the averages too.
    a.save(tmp_path / "ck.dcp", sharded=True)
    e = make_trainer(demo_root, tmp_path / "e", "train.ema_decay=0.9")
    e.resume(tmp_path / "ck.dcp")
    assert all(torch.equal(a.ema.averages[k], e.ema.averages[k]) for k in a.ema.averages)
    with plain.sampling_weights():  # no average: the weights themselves
        pass


def test_same_seed_same_run(demo_root, tmp_path):
    losses = []
    for run in ("x", "y"):
        tr = make_trainer(demo_root, tmp_path / run)
        b = tr.batches()
        losses.append(tr.train_step([next(b) for _ in range(2)]).read()["loss"])
    assert losses[0] == losses[1]


def test_mxflux_train_cli_loss_falls_and_leaves_artifacts(demo_root, tmp_path, capsys):
    from mxflux.cli import main

    out = tmp_path / "run"
    rc = main(["train", "tiny-mxfp6", "--out", str(out), "--no-progress", "--set", f"data.root={demo_root}",
               "--set", "batch.global_batch_size=8", "--set", "batch.micro_batch_size=8",
               "--set", "train.train_samples=160", "--set", "train.eval_every_samples=80",
               "--set", "train.eval_samples=16", "--set", "optim.lr=2e-3", "--set", "train.log_every=5",
               "--set", "train.sample_prompts=[a large red circle in the center]", "--set", "train.sample_steps=4",
               "--set", "train.ema_decay=0.9"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the JSON: the last line, after the summary
    assert result["step"] == 20
    for name in ("latest.pt", "loss_curve.png", "samples.png", "metrics.csv"):
        assert (out / name).stat().st_size > 0, name
    rows = [line.split(",") for line in (out / "metrics.csv").read_text().splitlines()[1:]]
    train = [float(r[3]) for r in rows if r[2] == "train"]
    assert len(train) == 4 and train[-1] < 0.85 * train[0], train  # starts near 2.0
    evals = [float(r[3]) for r in rows if r[2] == "eval"]
    assert len(evals) == 2 and evals[-1] < evals[0] and all(math.isfinite(v) for v in evals)
    # eval and sample work from the checkpoint
    assert main(["eval", str(out), "--samples", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 20
    assert main(["sample", str(out), "--prompt", "a small blue square at the top left", "--steps", "3",
                 "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").stat().st_size > 0
    # samples.png and `mxflux sample` draw with the EMA of the weights; --no-ema with the weights
    assert main(["sample", str(out), "--prompt", "a small blue square at the top left", "--steps", "3",
                 "--out", str(tmp_path / "raw.png"), "--no-ema"]) == 0
    assert (tmp_path / "raw.png").read_bytes() != (tmp_path / "s.png").read_bytes()


def test_activation_checkpointing_gives_the_same_step(demo_root, tmp_path):
    losses, grads = [], []
    for ac in ("false", "true"):
        tr = make_trainer(demo_root, tmp_path / ac, f"model.activation_checkpointing={ac}")
        b = tr.batches()
        losses.append(tr.train_step([next(b) for _ in range(2)]).read()["loss"])
        grads.append(torch.cat([p.detach().flatten() for p in tr.model.parameters()]))
    assert losses[0] == losses[1]
    assert torch.equal(grads[0], grads[1])  # weights after one AdamW step: recompute is exact


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mx_packers", "elementwise", "mx_inputs"])
def test_selective_checkpointing_gives_the_same_compiled_step(demo_root, tmp_path, mode):
    """`model.activation_checkpointing: mx_packers`, `elementwise` or `mx_inputs` through the Trainer (compiled
    blocks; the unfused MLP, as the benchmark settings run it): the same loss, weights and
    fold-window count as the compiled model without it, and fewer FP8 operands kept for backward
    (tests/test_nn_recompute.py checks the blocks in detail)."""
    from mxflux.bench.memory import record_saved_tensors

    results = []
    for ac in ("none", mode):
        torch._dynamo.reset()
        tr = make_trainer(demo_root, tmp_path / ac, f"model.activation_checkpointing={ac}", "model.compile=true",
                          "model.overrides={depth: 1, depth_single_blocks: 1}", 'precision.fused_mlp="off"')
        assert all(m.cfg.recomputed == (ac == mode) for m in tr.mx_modules())
        b = tr.batches()
        with record_saved_tensors(tr.model) as saved:
            loss = tr.train_step([next(b) for _ in range(2)]).read()["loss"]
        weights = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
        results.append((loss, weights, tr.blocks_outside_window(), saved.by_dtype.get("float8_e4m3fn", 0)))
    torch._dynamo.reset()
    (loss0, w0, n0, fp8_0), (loss1, w1, n1, fp8_1) = results
    assert loss0 == loss1
    assert torch.equal(w0, w1)
    assert n0 == n1
    assert fp8_1 < fp8_0, (fp8_0, fp8_1)


def test_mlperf_warmup_leaves_no_trace_and_the_log_fails_only_where_it_must(demo_root, tmp_path):
    """Warm-up steps before run_start change nothing (weights, optimizer, data order, RNG); the
    real compliance checker then rejects this CPU run's log on exactly two rules that belong to
    the real benchmark: the 262,144-sample evaluation interval and the 0.586 target."""
    import subprocess
    import sys

    def run(tag, warmup):
        from mxflux.train.mlperf import MLPerfCallback

        cfg = load_recipe("tiny-mxfp6", [f"data.root={demo_root}", f"train.out_dir={tmp_path / tag}/run",
                                         "batch.global_batch_size=8", "batch.micro_batch_size=4",
                                         "train.eval_batch_size=8", "train.eval_samples=16", "train.log_every=1",
                                         "train.sample_prompts=[]", "optim.warmup_steps=2", "mlperf.enabled=true",
                                         f"mlperf.warmup_steps={warmup}", "train.train_samples=48",
                                         "train.eval_every_samples=16", "mlperf.target_eval_loss=0.01"])
        mlperf = MLPerfCallback(cfg.out_dir, cfg)  # before the trainer: the timed init phase starts here
        Trainer(cfg, device="cpu", callbacks=[mlperf]).fit(progress=False)
        rows = (tmp_path / tag / "run" / "metrics.csv").read_text().splitlines()[1:]
        return [r.split(",")[3] for r in rows], tmp_path / tag / "run" / "mlperf.log"

    plain, _ = run("plain", 0)
    warmed, log = run("warmed", 2)
    assert warmed == plain  # bit-identical losses, train and eval
    text = log.read_text()
    for key in ("init_start", "init_stop", "run_start", "block_start", "eval_accuracy", "run_stop",
                '"lowest_numerical_precision_in_linear", "value": "mxfp6"'):
        assert key in text, key
    assert text.count('"eval_accuracy"') == 3 and '"status": "aborted"' in text
    # The sizes of the data the run read: the demo's 96 training samples, 16 of its 24 eval samples.
    assert '"key": "train_samples", "value": 96' in text and '"key": "eval_samples", "value": 16' in text
    out = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                          "--ruleset", "6.1.0", "--log_output", str(tmp_path / "cc.log"), str(log)],
                         capture_output=True, text=True)
    report = out.stdout + out.stderr
    assert out.returncode != 0
    import re

    failed = set(re.findall(r"CHECK for '(\w+)' failed", report)) | set(re.findall(r"Failed checks for (\w+)", report))
    assert failed == {"evaluation_frequency", "eval_accuracy"}, report


def test_classifier_free_guidance_mixes_prompt_and_empty_velocities(gen):
    from mxflux.model import Flux, flux_config
    from mxflux.train.sample import generate_latents

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = Flux(flux_config("flux-tiny", depth=1, depth_single_blocks=1))
    for p in model.parameters():  # break the zero init so that the prompt matters
        torch.nn.init.normal_(p, std=0.05)
    t5, clip = torch.randn(3, 8, 64, generator=gen), torch.randn(3, 32, generator=gen)
    empty = (torch.randn(8, 64, generator=gen), torch.randn(32, generator=gen))
    kw = dict(latent_shape=(16, 4, 4), steps=4, seed=3, shift=0.0, scale=1.0, dtype=torch.float32)
    plain = generate_latents(model, t5, clip, **kw)
    only_empty = generate_latents(model, empty[0].expand(3, 8, 64), empty[1].expand(3, 32), **kw)
    # g = 1 is the conditional model; g = 0 the empty prompt's; an empty prompt equal to the
    # prompt leaves any g without effect; and g = 3 is neither.
    torch.testing.assert_close(generate_latents(model, t5, clip, guidance=1.0, empty=empty, **kw), plain)
    torch.testing.assert_close(generate_latents(model, t5, clip, guidance=0.0, empty=empty, **kw), only_empty,
                               rtol=1e-5, atol=1e-5)
    same = (t5[0], clip[0])
    torch.testing.assert_close(generate_latents(model, t5[:1], clip[:1], guidance=3.0, empty=same, **kw), plain[:1],
                               rtol=1e-5, atol=1e-5)
    guided = generate_latents(model, t5, clip, guidance=3.0, empty=empty, **kw)
    assert (guided - plain).abs().max() > 1e-3 and (guided - only_empty).abs().max() > 1e-3
    with pytest.raises(ValueError, match="empty: classifier-free guidance"):
        generate_latents(model, t5, clip, guidance=3.0, **kw)


def test_adamw_implementation_is_chosen_and_validated(demo_root, tmp_path):
    """`optim.implementation`: auto is the fused AdamW on every device, with the Triton kernel for
    large CUDA parameters (`kernel`); fused and foreach are torch's kernels and train to the same
    weights (to fp32 rounding); anything else is rejected naming the field."""
    auto = make_trainer(demo_root, tmp_path / "a", recipe="tiny-bf16")
    assert auto.optimizer.defaults.get("fused") is True and auto.optimizer.kernel == "triton"
    weights = {}
    for impl in ("fused", "foreach"):
        tr = make_trainer(demo_root, tmp_path / impl, f"optim.implementation={impl}", recipe="tiny-bf16")
        assert tr.optimizer.defaults[impl] is True and tr.optimizer.kernel == "torch"
        batches = tr.batches()
        before = [p.detach().clone() for p in tr.model.parameters()]
        for _ in range(3):
            tr.train_step([next(batches)])
        weights[impl] = [p.detach().clone() for p in tr.model.parameters()]
        assert any(not torch.equal(a, p) for a, p in zip(before, weights[impl]))
    for a, b in zip(weights["fused"], weights["foreach"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="implementation"):
        load_recipe("tiny-bf16", ["optim.implementation=apex"])


def test_blocks_compile_with_the_recipe_mode(demo_root, tmp_path, monkeypatch):
    """`model.compile_mode` reaches torch.compile for every block, and inductor's static launch of
    user kernels is on (with MXFLUX_INLINE_PACK=1 the compiled blocks then inline the MX packers); a bad
    mode names the field."""
    from torch._inductor import config

    from mxflux.ops.custom_ops import static_launch_on

    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: modes.append(mode) or fn)
    with config.patch(static_launch_user_defined_triton_kernels=False):  # (restored after)
        tr = make_trainer(demo_root, tmp_path, "model.compile=true", "model.compile_mode=reduce-overhead",
                          recipe="tiny-bf16")
        assert static_launch_on()
    n_blocks = len(tr.model.double_blocks) + len(tr.model.single_blocks)
    assert modes == ["reduce-overhead"] * n_blocks and n_blocks > 0
    with pytest.raises(ValueError, match="compile_mode"):
        load_recipe("tiny-bf16", ["model.compile_mode=fast"])


def test_a_captured_step_needs_one_process_on_a_cuda_device(demo_root, tmp_path, capsys):
    """train.cuda_graph on a CPU: a clear error when the trainer is built, not a failure in a step."""
    from mxflux.train.captured import CapturedStep

    with pytest.raises(RecipeError, match="train.cuda_graph: a captured step needs one process on a CUDA device; "
                                          "got cpu with world size 1"):
        make_trainer(demo_root, tmp_path, "train.cuda_graph=true")
    # the command line says so in one line, exit status 2
    from mxflux.cli import main

    assert main(["train", "tiny-mxfp6", "--out", str(tmp_path / "cli"), "--device", "cpu", "--set",
                 f"data.root={demo_root}", "--set", "train.cuda_graph=true", "--max-steps", "1"]) == 2
    assert "mxflux train: error: train.cuda_graph: a captured step needs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="train.cuda_graph: a captured step needs a CUDA device"):
        CapturedStep(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), torch.device("cpu"))
