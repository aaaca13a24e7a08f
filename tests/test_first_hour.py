"""The first hour of a newcomer on a CPU: each command the README shows does what it says, run
through the real `mxflux` command (a subprocess where the exit status and both streams matter):
`bench step` skips what needs a GPU in one line, `data synth --for` writes data the recipe trains
on and mismatched data is one line naming both sides, recipe descriptions differ and the README
lists every recipe, `check-config` warns about missing paths, the progress bar's time left is a
mean over minutes, prompt words the demo encoder does not know are named, and `make run`
installs no test extras."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# A 1+1-block tiny-mxfp6, 4 images a step, logging each step, no evaluation, no samples.
SMALL = ["--set", "model.overrides={depth: 1, depth_single_blocks: 1}", "--set", "batch.global_batch_size=4",
         "--set", "batch.micro_batch_size=4", "--set", "train.log_every=1", "--set", "train.eval_samples=4",
         "--set", "train.eval_every_samples=100000", "--set", "train.sample_prompts=[]",
         "--set", "optim.warmup_steps=1", "--set", "train.train_samples=8"]


def mxflux(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    return subprocess.run([sys.executable, "-m", "mxflux.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if ": error: " in line]


# ------------------------------------------------------------------------------------------
# bench step


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA does")
def test_bench_step_on_a_cpu_runs_what_can_run_and_names_the_skipped_in_one_line(tmp_path):
    out = tmp_path / "b.json"
    proc = mxflux("bench", "step", "tiny-mxfp6", "--steps", "1", "--warmup", "0", "--synthetic", "--image-size", "32",
                  "--text-len", "8", "--data-dir", tmp_path / "data", "--json", out,
                  "--set", "model.overrides={depth: 1, depth_single_blocks: 1}", "--set", "batch.global_batch_size=2",
                  "--set", "batch.micro_batch_size=2", cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "Traceback" not in text
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("skipped")]
    assert skipped == ["skipped fp8-tensorwise, fp8-rowwise: torchao FP8 needs a CUDA GPU of compute capability "
                       "8.9+ (the model is on cpu, not a CUDA GPU)"], text
    assert "images/s/CPU" in proc.stdout and "images/s/GPU" not in proc.stdout
    results = {r["label"]: r for r in json.loads(out.read_text())}
    assert list(results) == ["bf16", "fp8-tensorwise", "fp8-rowwise", "mxfp6"]  # the default settings
    assert results["bf16"]["images_per_s_per_gpu"] > 0 and results["mxfp6"]["images_per_s_per_gpu"] > 0
    assert results["mxfp6"]["precision"] == "mxfp6" and results["bf16"]["device"].startswith("cpu")
    assert set(results["fp8-rowwise"]) == {"label", "skipped", "wall_s_including_compile", "provenance",
                                           "child_provenance", "comparison_warnings"}
    # three timed CPU steps in one round: the ratios carry their warning, in the JSON and under the table
    assert any("timed CPU steps in one round" in w for w in results["mxfp6"]["comparison_warnings"])
    assert "timed CPU steps in one round: use --steps 10 or more" in " ".join(proc.stdout.split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA does")
def test_bench_step_of_one_setting_that_cannot_run_here_is_one_line_and_exit_2(tmp_path):
    proc = mxflux("bench", "step", "tiny-mxfp6", "--settings", "fp8-rowwise", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert error_lines(proc) == ["mxflux bench step: error: --settings fp8-rowwise: cannot run here: torchao FP8 "
                                 "needs a CUDA GPU of compute capability 8.9+ (the model is on cpu, not a CUDA GPU)"]


def test_the_table_says_per_gpu_for_gpu_results_and_per_cpu_for_cpu_ones():
    from rich.console import Console

    from mxflux.bench.report import print_table

    def printed(results):
        console = Console(file=io.StringIO(), width=200)
        print_table(results, console=console)
        return console.file.getvalue()

    gpu = json.loads((ROOT / "benchmarks/results/bench_step_deep6x12_mbs8_graph_2026-12-03b.json").read_text())
    assert "images/s/GPU" in printed(gpu) and "images/s/CPU" not in printed(gpu)
    cpu = [{**gpu[0], "device": "cpu (x86_64, 2 threads)"}, {"label": "fp8-rowwise", "skipped": "no CUDA"}]
    text = printed(cpu)
    assert "images/s/CPU" in text and "skipped fp8-rowwise: no CUDA" in text and text.count("fp8-rowwise") == 1


# ------------------------------------------------------------------------------------------
# data synth --for, and data that does not fit


def test_data_synth_for_a_recipe_writes_data_it_trains_on(tmp_path):
    data = tmp_path / "d"
    proc = mxflux("data", "synth", "--for", "tiny-mxfp6", "--out", data, "--train", "8", "--eval", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"wrote 8 train + 4 eval random samples (T5 32x64, CLIP 32, latent 16x16x16) to "
                                   f"{data}; train on it: mxflux train tiny-mxfp6 --set data.root={data}")
    proc = mxflux("train", "tiny-mxfp6", "--set", f"data.root={data}", "--out", tmp_path / "run", "--no-progress",
                  *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout[proc.stdout.index("{"):])["step"] == 2


def test_data_synth_for_a_recipe_refuses_widths_the_model_sets(tmp_path):
    proc = mxflux("data", "synth", "--for", "tiny-mxfp6", "--t5-dim", "4096", "--out", tmp_path / "d",
                  "--train", "1", "--eval", "1", cwd=tmp_path)
    assert proc.returncode == 2 and error_lines(proc) == [
        "mxflux data synth: error: --t5-dim: --for tiny-mxfp6 takes it from the recipe's model; give one of them"]
    assert not (tmp_path / "d").exists()


def test_data_that_does_not_fit_the_model_is_one_line_naming_both_in_check_config_and_train(tmp_path):
    from mxflux.data import write_synthetic

    data = write_synthetic(tmp_path / "mlperf", n_train=4, n_eval=2)  # the MLPerf dims: the flux12b recipes'
    expected = (f"data.root '{data}' (T5 256x4096, CLIP 768, latent 16x32x32) does not fit model flux-tiny of "
                f"recipe tiny-mxfp6: T5 width 4096 vs context_in_dim 64; CLIP width 768 vs vec_in_dim 32; "
                f"`mxflux data synth --for tiny-mxfp6` writes random data that fits")
    for command in ("check-config", "train"):
        proc = mxflux(command, "tiny-mxfp6", "--set", f"data.root={data}", cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert error_lines(proc) == [f"mxflux {command}: error: {expected}"]
    assert not (tmp_path / "runs").exists()  # train refused before making its run directory


def test_the_fit_check_names_every_differing_dim():
    from mxflux.data.fit import DataDims, _differences, dims_for_model
    from mxflux.model import flux_config

    tiny = flux_config("flux-tiny")
    assert dims_for_model(tiny, l_txt=32, latent_hw=16) == DataDims(32, 64, 32, 16, 16)
    assert _differences(DataDims(32, 64, 32, 16, 16), tiny) == []
    assert _differences(DataDims(32, 64, 32, 8, 15), tiny) == [
        "latent channels 8 x 4 vs in_channels 64", "latent side 15 is odd (the model patchifies 2x2)"]


# ------------------------------------------------------------------------------------------
# recipes, the README's list of them, check-config of the fine-tune recipe


def test_recipe_descriptions_differ(tmp_path):
    from mxflux.train.config import recipe_descriptions

    proc = mxflux("recipes", cwd=tmp_path)
    assert proc.returncode == 0
    described = [line.split(None, 1)[1] for line in proc.stdout.splitlines()]
    assert len(described) == len(recipe_descriptions()) and len(set(described)) == len(described), described


def _expand(name: str) -> list[str]:
    """`flux12b-{bf16,fp8}-mlperf` -> the names it stands for."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [n for part in m.group(1).split(",") for n in _expand(name[:m.start()] + part + name[m.end():])]


def test_the_readme_training_section_lists_every_shipped_recipe():
    from mxflux.train.config import recipe_names

    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("\nRecipes (`src/mxflux/recipes/`"):]  # the Training section's list
    paragraph = paragraph[:paragraph.index("\n\n")]
    listed = {n for quoted in re.findall(r"`((?:tiny|flux)[a-z0-9{},-]*)`", paragraph) for n in _expand(quoted)}
    assert listed == set(recipe_names())


def test_check_config_of_the_fine_tune_recipe_warns_about_its_missing_paths(tmp_path):
    proc = mxflux("check-config", "flux12b-mxfp6-finetune", "--set", f"model.init_from={tmp_path / 'no-weights'}",
                  "--set", f"data.root={tmp_path / 'no-data'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"# warning: model.init_from '{tmp_path / 'no-weights'}' does not exist" in proc.stderr.splitlines()
    assert f"# warning: data.root '{tmp_path / 'no-data'}' does not exist" in proc.stderr.splitlines()
    assert "# OK: flux12b-mxfp6-finetune is valid" in proc.stderr


# ------------------------------------------------------------------------------------------
# the progress bar's time left


def test_the_time_left_is_the_mean_speed_over_minutes_not_the_last_seconds():
    """Synthetic timings of a shared machine: 120 fast steps (0.1 s) then 120 slow ones (0.4 s), over
    and over (mean 0.25 s). The bar's estimate stays within 12 % of the true time left; rich's own
    (the speed of its last 30 s, on the same clock) is off by up to 77 %."""
    from rich.console import Console
    from rich.progress import Progress

    from mxflux.train.callbacks import ProgressBar

    end, log_every = 2300, 10
    at = [0.0]
    for i in range(end):
        at.append(at[-1] + (0.1 if (i // 120) % 2 == 0 else 0.4))
    now = [0.0]
    bar = ProgressBar("tiny", clock=lambda: now[0], console=Console(file=io.StringIO()))

    class Trainer:
        step = 0
        cfg = type("Cfg", (), {"model": type("M", (), {"compile": False}), "batch": type("B", (), {"global_batch_size": 4})})

    bar.on_fit_start(Trainer, end)
    rich_own = Progress(get_time=lambda: now[0], console=Console(file=io.StringIO()))
    task = rich_own.add_task("rich", total=end)
    ours, theirs = [], []
    for step in range(log_every, end, log_every):
        now[0] = at[step]
        bar.on_log(Trainer, {"step": step, "loss": 0.5, "lr": 1e-3, "images_per_s": 40.0})
        rich_own.update(task, completed=step)
        left = at[end] - at[step]
        if step >= 600 and left > 120:  # past the first 5 minutes' window, while minutes are left
            ours.append(abs(bar.eta.remaining_s(end) - left) / left)
            theirs.append(abs(rich_own.tasks[0].time_remaining - left) / left)
    shown = bar.bar.tasks[0].fields["left"]
    bar.on_fit_end(Trainer)
    assert max(ours) < 0.12 and max(theirs) > 0.7
    assert re.fullmatch(r"0:00:0\d left", shown)  # the last log: seconds left, as H:MM:SS


def test_the_time_left_is_unknown_until_two_logs_and_restarts_when_the_step_goes_back():
    from mxflux.train.eta import SmoothedETA, format_remaining

    eta = SmoothedETA(window_s=60)
    eta.update(10, now=100.0)
    assert eta.remaining_s(100) is None and format_remaining(None) == "-:--:--"
    eta.update(20, now=105.0)
    assert eta.remaining_s(100) == pytest.approx(40.0) and format_remaining(3725.4) == "1:02:05"
    eta.update(5, now=106.0)
    assert eta.remaining_s(100) is None


# ------------------------------------------------------------------------------------------
# prompt words the demo text encoder does not know


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from mxflux.cli import main
    from mxflux.data import build_demo_dataset

    root = tmp_path_factory.mktemp("run")
    data = build_demo_dataset(root / "demo", n_train=8, n_eval=4, seed=1)
    assert main(["train", "tiny-mxfp6", "--out", str(root / "run"), "--set", f"data.root={data}", *SMALL,
                 "--no-progress"]) == 0
    return root / "run"


def test_sample_names_the_prompt_words_the_demo_encoder_does_not_know(tiny_run, tmp_path):
    proc = mxflux("sample", tiny_run, "--prompt", "a purple star in the sky", "--prompt", "a small red circle",
                  "--steps", "2", "--out", tmp_path / "grid.png", cwd=tmp_path)
    assert proc.returncode == 0 and (tmp_path / "grid.png").is_file(), proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "demo text encoder" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: the demo text encoder does not know purple, star, sky (in 'a purple star in the sky'): ")
    proc = mxflux("sample", tiny_run, "--prompt", "a large green square at the bottom right", "--steps", "2",
                  "--out", tmp_path / "known.png", cwd=tmp_path)
    assert proc.returncode == 0 and "demo text encoder" not in proc.stderr


def test_train_and_check_config_name_unknown_words_in_the_recipes_sample_prompts(tmp_path):
    from mxflux.data.demo import unknown_prompt_words_warning

    recipe = tmp_path / "stars.yaml"
    recipe.write_text((ROOT / "src/mxflux/recipes/tiny-mxfp6.yaml").read_text()
                      .replace("- a large red circle in the center", "- a large red star in the centre"))
    proc = mxflux("check-config", recipe, cwd=tmp_path)
    assert proc.returncode == 0
    assert unknown_prompt_words_warning(["a large red star in the centre"]) in proc.stderr.splitlines()
    assert "star, centre (in 'a large red star in the centre')" in proc.stderr
    assert unknown_prompt_words_warning(["a large red circle in the center", "a small blue square at the top left",
                                         "a large yellow triangle at the bottom right"]) is None


# ------------------------------------------------------------------------------------------
# make run installs the runtime, make test the test extras


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_installs_only_the_runtime_and_make_test_then_adds_the_test_extras(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)

    # CI runs this suite from inside `make test`: a nested make would announce its directory and inherit flags
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}

    def dry_run(target: str) -> str:
        return subprocess.run(["make", "--no-print-directory", "-n", target], cwd=tmp_path, env=env,
                              capture_output=True, text=True, check=True).stdout

    def planned(target: str) -> list[str]:  # what make would run, and then pretend it ran
        out = dry_run(target)
        for line in out.splitlines():
            if line.startswith("touch "):
                stamp = tmp_path / line.split()[1]
                stamp.parent.mkdir(parents=True, exist_ok=True)
                stamp.touch()
        return [line for line in out.splitlines() if "pip install" in line or line.startswith(".venv/bin/")]

    assert planned("run") == [".venv/bin/pip install torch==2.13.0", ".venv/bin/pip install -e .",
                              ".venv/bin/mxflux train"]
    assert planned("test") == [".venv/bin/pip install -e '.[test]'", ".venv/bin/python -m pytest -q -n auto"]
    assert planned("run") == [".venv/bin/mxflux train"]
    # the kernels' CPU tests: Triton in a folder of its own, never in the venv
    kernels = dry_run("test-kernels").splitlines()
    assert kernels == [".venv/bin/pip install --no-deps --target .kernel-deps triton==3.6.0",
                       "touch .kernel-deps/.installed",
                       "TRITON_INTERPRET=1 PYTHONPATH=.kernel-deps .venv/bin/python -m pytest -q tests/gpu",
                       "PYTHONPATH=.kernel-deps .venv/bin/python -m pytest -q tests/gpu/test_triton_compile.py"]
    os.utime(tmp_path / "pyproject.toml", (2e9, 2e9))  # changed after both installs: both are redone
    assert planned("test") == [".venv/bin/pip install torch==2.13.0", ".venv/bin/pip install -e .",
                               ".venv/bin/pip install -e '.[test]'", ".venv/bin/python -m pytest -q -n auto"]
