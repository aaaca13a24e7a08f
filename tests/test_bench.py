"""`mxflux bench step` on the CPU: the harness runs a recipe's trainer and its bare loop, reports
consistent numbers, compares settings each in its own process, and accounts for saved tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxflux.bench.provenance import check_provenance
import torch
from torch import nn

from mxflux.bench.device_time import CATEGORIES
from mxflux.bench.step import _peak_tflops
from mxflux.cli import main
from mxflux.model import flux_config
from mxflux.model.configs import flops_per_sample

ROOT = Path(__file__).resolve().parents[1]
# The smallest run that still has every part: 1 double + 1 single block, 4x4 image tokens, 16 text tokens.
TINY = ["--synthetic", "--image-size", "64", "--text-len", "16", "--peak-tflops", "2",
        "--set", "model.overrides={depth: 1, depth_single_blocks: 1}"]


def test_one_setting_in_process_with_bare_loop_breakdown_and_memory(tmp_path, capsys):
    out, mem = tmp_path / "bench.json", tmp_path / "memory.json"
    rc = main(["bench", "step", "--recipe", "tiny-bf16", "--settings", "recipe", "--steps", "2", "--warmup", "1",
               "--profile-steps", "1", "--bare-loop", "--memory", str(mem), *TINY,
               "--data-dir", str(tmp_path / "data"), "--json", str(out),
               "batch.global_batch_size=8", "batch.micro_batch_size=4"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "images/s/CPU" in printed and "trainer / bare loop" in printed and "saved for backward" in printed
    assert "warm-up s (compiles)" in printed
    (r,) = json.loads(out.read_text())

    assert (r["model"], r["precision"], r["world_size"], r["steps"], r["warmup_steps"]) == ("flux-tiny", "bf16", 1, 2, 1)
    assert (r["global_batch_size"], r["micro_batch_size"], r["accumulation_steps"]) == (8, 4, 2)
    assert (r["image_tokens"], r["text_tokens"], r["synthetic_data"]) == (16, 16, True)  # 64 px → 8² latents → 4² tokens
    assert r["images_per_s"] > 0 and r["images_per_s_per_gpu"] == r["images_per_s"]
    assert r["images_per_s"] == pytest.approx(8 * 1e3 / r["step_ms"], rel=1e-9)
    assert r["ms_per_512"] == pytest.approx(512 / r["images_per_s"] * 1e3, rel=1e-9)
    assert r["model_overrides"] == {"depth": 1, "depth_single_blocks": 1}
    assert r["flops_per_sample"] == flops_per_sample(flux_config("flux-tiny", depth=1, depth_single_blocks=1), 16, 16)
    assert r["mfu"] == pytest.approx(r["images_per_s_per_gpu"] * r["flops_per_sample"] / 2e12, rel=1e-9)
    assert 0 < r["mfu"] < 1
    assert r["memory"]["max_allocated_gib"] > 0 and r["memory"]["source"].startswith("cpu")
    assert 0 < r["loss"] < 10 and r["pid"] == os.getpid()
    assert r["warmup_s"] > 0 and r["bare_loop"]["warmup_s"] > 0  # the warm-up step's wall time
    # how the timed steps ran, as `mxflux train` reports it
    assert r["step_path"]["world_size"] == 1 and r["step_path"]["accumulation"] == 2
    # where the number came from (mxflux.bench.provenance), and how the step ran besides its precision
    assert check_provenance(r) == [] and r["provenance"]["card"].startswith("cpu")
    assert "bench step --recipe tiny-bf16" in r["provenance"]["command"]
    assert r["run_mode"] == {"compile": False, "compile_mode": "default", "cuda_graph": False, "optimizer": "auto",
                             "activation_checkpointing": "none"}
    assert r["step_path"]["mx_gemm"] == "none (bf16)" and r["step_path"]["optimizer"].startswith("torch's fused AdamW")

    b = r["breakdown"]  # the CPU: host ops' self time, split into the same categories
    assert b["steps"] == 1 and set(b["categories"]) == set(CATEGORIES)
    assert sum(c["ms_per_step"] for c in b["categories"].values()) == pytest.approx(b["busy_ms_per_step"])
    assert b["categories"]["gemm"]["fraction"] > 0.1 and b["categories"]["attention"]["ms_per_step"] > 0
    assert b["categories"]["mx_quant"]["ms_per_step"] == 0  # bf16: no MX packers
    assert b["busy_ms_per_step"] <= b["wall_ms_per_step"]

    bare = r["bare_loop"]
    assert bare["step_ms"] > 0 and 0 < bare["loss"] < 10 and bare["breakdown"]["busy_ms_per_step"] > 0
    assert bare["images_per_s"] == pytest.approx(8 * 1e3 / bare["step_ms"], rel=1e-9)
    assert r["trainer_over_bare_loop"] == pytest.approx(r["step_ms"] / bare["step_ms"], rel=1e-9)

    m = json.loads(mem.read_text())["bf16"]
    s = m["saved_for_backward"]
    assert m["allocator"] is None  # the allocator trace is CUDA's
    assert s["bytes"] > 0 and s["by_dtype"]["bfloat16"] > 0  # autocast saves bf16 activations
    assert sum(s["by_dtype"].values()) == s["bytes"]
    names = {e["name"] for e in s["by_module"]}  # eager: down to the linears inside the blocks
    assert "double_blocks.0.img_mlp.0" in names and "single_blocks.0.linear1" in names
    assert {"Linear", "RMSNorm", "DoubleStreamBlock", "SingleStreamBlock"} <= {e["name"] for e in s["by_module_type"]}


def test_saved_tensors_are_counted_once_per_storage_by_module_and_dtype():
    from mxflux.bench.memory import record_saved_tensors

    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(4, 16)
    with record_saved_tensors(model) as saved:
        model(x).sum().backward()
    r = saved.report()
    # Linear 0 saves its input x; GELU its input (linear 0's output); linear 2 its input (GELU's output)
    assert {e["name"]: e["bytes"] for e in r["by_module"]} == {"0": 4 * 16 * 4, "1": 4 * 32 * 4, "2": 4 * 32 * 4}
    assert r["by_dtype"] == {"float32": (64 + 128 + 128) * 4}
    # linear 2's weight, for its input's gradient (x needs none, so linear 0 saves no weight)
    assert r["parameter_bytes_saved_by_reference"] == 8 * 32 * 4
    assert {e["name"] for e in r["by_module_type"]} == {"Linear", "GELU"}


def test_peak_rate_is_null_on_cpu_unless_given():
    assert _peak_tflops(torch.device("cpu"), None) is None
    assert _peak_tflops(torch.device("cpu"), 123.0) == 123.0


def test_bench_requires_a_recipe_and_checks_overrides(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--settings", "bf16"])
    assert exc.value.code == 2 and "--recipe" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--recipe", "tiny-bf16", "--settings", "bf16", "batch.micro_batchsize=4"])
    assert exc.value.code == 2 and "micro_batchsize" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--recipe", "tiny-bf16", "--settings", "bf16,fp9"])
    assert exc.value.code == 2 and "fp9" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # a whole precision block would make the settings identical
        main(["bench", "step", "--recipe", "tiny-bf16", "--settings", "bf16,mxfp6", "precision={}"])
    assert exc.value.code == 2 and "--settings recipe" in capsys.readouterr().err


def test_the_graph_settings_are_their_precisions_with_the_step_captured():
    from mxflux.bench.compare import PROXY_OVERRIDES, PROXY_RECIPE, SETTINGS, parse_settings
    from mxflux.bench.step import load_bench_recipe

    assert parse_settings("mxfp6,mxfp6-graph") == ["mxfp6", "mxfp6-graph"]
    for name in ("bf16", "fp8-tensorwise", "mxfp6"):
        eager = load_bench_recipe(PROXY_RECIPE, [*SETTINGS[name], *PROXY_OVERRIDES])
        graph = load_bench_recipe(PROXY_RECIPE, [*SETTINGS[f"{name}-graph"], *PROXY_OVERRIDES])
        assert graph.train.cuda_graph and not eager.train.cuda_graph
        assert graph.precision == eager.precision and graph.model == eager.model
    from mxflux.bench.step import bench_step

    with pytest.raises(ValueError, match="warmup: a captured trainer step .* needs more than 2 warm-up steps"):
        bench_step(load_bench_recipe(PROXY_RECIPE, [*SETTINGS["mxfp6-graph"]]), warmup=2, distributed=False)


def test_fp8_at_mxfp6s_accumulation_is_a_setting_but_not_the_fp8_baseline():
    """fp8-tensorwise-exact loads as torchao's tensor-wise recipe without fast accumulation; the ratios stay
    held against the recipe as torchao ships it (fast accumulation in the forward GEMM), also in results
    written before the field existed."""
    from mxflux.bench.compare import PROXY_OVERRIDES, PROXY_RECIPE, SETTINGS
    from mxflux.bench.report import is_fp8_tensorwise
    from mxflux.bench.step import load_bench_recipe

    exact = load_bench_recipe(PROXY_RECIPE, [*SETTINGS["fp8-tensorwise-exact"], *PROXY_OVERRIDES]).precision
    shipped = load_bench_recipe(PROXY_RECIPE, [*SETTINGS["fp8-tensorwise"], *PROXY_OVERRIDES]).precision
    assert (exact.fp8_fast_accumulation, shipped.fp8_fast_accumulation) == (False, True)
    assert exact.model_copy(update={"fp8_fast_accumulation": True}) == shipped

    def result(cfg):
        return {"precision": "fp8", "precision_config": cfg}

    assert is_fp8_tensorwise(result(shipped.model_dump()))
    assert not is_fp8_tensorwise(result(exact.model_dump()))
    assert is_fp8_tensorwise(result({"fp8": "hybrid", "fp8_scaling": "tensorwise"}))  # before the field


def test_a_captured_bare_loop_is_refused_without_a_cuda_device(capsys):
    """--cuda-graph needs one process on a CUDA device: a clear error before any run, never a
    trainer run first and a failure after it."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--recipe", "tiny-bf16", "--settings", "bf16", "--device", "cpu", "--cuda-graph",
              *TINY])
    assert exc.value.code == 2 and "--cuda-graph" in capsys.readouterr().err
    from mxflux.bench.step import bench_step, load_bench_recipe

    cfg = load_bench_recipe("tiny-bf16", [])
    with pytest.raises(ValueError, match="cuda_graph: the captured bare loop needs one process on a CUDA device"):
        bench_step(cfg, cuda_graph=True, device="cpu", distributed=False)


@pytest.mark.slow
def test_settings_run_side_by_side_each_in_its_own_process(tmp_path):
    """The CI smoke test of the default comparison's machinery: two settings, bare loop included."""
    out = tmp_path / "cmp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mxflux.cli", "bench", "step", "--recipe", "tiny-bf16", "--settings", "mxfp6,bf16",
         "--mbs", "2", "--steps", "1", "--warmup", "1", "--bare-loop", *TINY, "--data-dir", str(tmp_path / "data"),
         "--json", str(out)], cwd=tmp_path, env=env, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [(r["label"], r["precision"]) for r in results] == [("mxfp6", "mxfp6"), ("bf16", "bf16")]
    assert len({r["pid"] for r in results}) == 2 and os.getpid() not in {r["pid"] for r in results}
    assert all(r["global_batch_size"] == 2 and r["bare_loop"]["step_ms"] > 0 for r in results)
    assert "vs bf16" in proc.stdout and "[mxfp6] " in proc.stdout  # one table; the children's output, prefixed


@pytest.mark.slow
def test_one_setting_under_torchrun_on_two_ranks_and_a_batch_the_world_cannot_split(tmp_path):
    """`mxflux bench step` under torchrun (2 gloo ranks): the whole run, rank 0's JSON with the world
    size, exit 0 (the group torn down before exit); and a global batch that 2 ranks cannot split is
    one line naming the field on each rank, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}

    def run(port, out, *extra):
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
             "-m", "mxflux.cli", "bench", "step", "--recipe", "tiny-mxfp6", "--settings", "mxfp6", "--steps", "1",
             "--warmup", "1", *TINY, "--data-dir", str(tmp_path / "data"), "--json", str(out), *extra],
            cwd=tmp_path, env=env, timeout=300, capture_output=True, text=True)

    ok = run(29657, tmp_path / "two.json", "batch.global_batch_size=8", "batch.micro_batch_size=4")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    (r,) = json.loads((tmp_path / "two.json").read_text())
    assert (r["world_size"], r["global_batch_size"], r["accumulation_steps"]) == (2, 8, 1) and r["step_ms"] > 0
    assert r["step_path"]["world_size"] == 2 and len(r["step_path"]["graph_breaks"]) == 2  # every rank's

    bad = run(29658, tmp_path / "bad.json", "batch.global_batch_size=4", "batch.micro_batch_size=4")
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and not (tmp_path / "bad.json").exists()
    assert out.count("mxflux bench step: error: batch.global_batch_size 4 is not divisible by micro_batch_size "
                     "× world size = 4 × 2") == 2, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out


@pytest.mark.slow
def test_rounds_alternate_the_settings_and_report_each_settings_median_round(tmp_path):
    """`--rounds 2`: every setting runs once per round, each time in a fresh process, and the JSON
    holds each setting's median round with every round's step time."""
    out = tmp_path / "cmp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mxflux.cli", "bench", "step", "--recipe", "tiny-bf16", "--settings", "bf16,mxfp6",
         "--rounds", "2", "--mbs", "2", "--steps", "1", "--warmup", "1", *TINY, "--data-dir", str(tmp_path / "data"),
         "--json", str(out)], cwd=tmp_path, env=env, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.index("=== round 1 of 2") < proc.stdout.index("=== round 2 of 2")
    assert proc.stdout.count("=== bf16: ") == 2 and proc.stdout.count("=== mxfp6: ") == 2
    results = json.loads(out.read_text())
    assert [r["label"] for r in results] == ["bf16", "mxfp6"]
    for r in results:
        ms = r["rounds"]["step_ms"]
        assert len(ms) == 2 and all(m > 0 for m in ms) and r["step_ms"] == min(ms)  # the lower median of two
    assert "vs bf16, per round" in proc.stdout and "rounds: min–max" in proc.stdout


def test_combined_rounds_keep_the_median_round_and_refuse_mismatched_rounds():
    from mxflux.bench.compare import combine_rounds

    def res(label, ms):
        return {"label": label, "step_ms": ms, "images_per_s_per_gpu": 1000 / ms, "breakdown": {"ms": ms}}

    rounds = [[res("bf16", 131.0), res("mxfp6", 109.8)], [res("bf16", 130.0), {"label": "mxfp6", "failed": "boom"}],
              [res("bf16", 132.0), res("mxfp6", 109.1)]]
    bf16, mx = combine_rounds(rounds)
    assert bf16["step_ms"] == 131.0 and bf16["breakdown"] == {"ms": 131.0}  # the median round, whole
    assert bf16["rounds"]["step_ms"] == [131.0, 130.0, 132.0]
    assert mx["step_ms"] == 109.1 and mx["rounds"]["step_ms"] == [109.8, None, 109.1]  # lower median of two
    failed = combine_rounds([[{"label": "mxfp6", "failed": "a"}], [{"label": "mxfp6", "failed": "b"}]])
    assert failed == [{"label": "mxfp6", "failed": "round 1: a; round 2: b"}]
    with pytest.raises(ValueError, match="the same settings in every round"):
        combine_rounds([[res("bf16", 1.0)], [res("bf16", 1.0), res("mxfp6", 1.0)]])
    with pytest.raises(ValueError, match="one setting per position"):
        combine_rounds([[res("bf16", 1.0)], [res("mxfp6", 1.0)]])


def test_the_table_divides_within_rounds_on_the_h200_deep_model_calls():
    """Two H200 calls of the 6+12-block model at micro-batch 8 (committed JSON) as two rounds: the
    per-round ratio of the captured settings is each call's own (1.191x and 1.193x), and the baselines
    are found by precision, so the "-graph" settings get their "vs" rows too."""
    from mxflux.bench.compare import combine_rounds

    calls = [json.loads((ROOT / "benchmarks/results" / f).read_text()) for f in
             ("bench_step_deep6x12_mbs8_graph_bare_2026-12-03.json", "bench_step_deep6x12_mbs8_graph_2026-12-03b.json")]
    rounds = [[r for r in call if r["label"] in ("bf16-graph", "mxfp6-graph")] for call in calls]
    results = combine_rounds(rounds)
    rows = _table_rows(results)
    ratios = [bf16["step_ms"] / mx["step_ms"] for bf16, mx in rounds]
    assert [round(x, 3) for x in ratios] == [1.191, 1.193]
    assert rows["vs bf16-graph, per round"][1] == f"{sum(ratios) / 2:.3f}x (1.191–1.193)"
    assert rows["ms / step, rounds: min–max"] == ["130.0–131.0 (2 of 2)", "109.1–109.8 (2 of 2)"]
    assert rows["ms / step"] == ["130.0", "109.1"]  # the lower median of two rounds


def test_a_failing_setting_is_reported_and_the_others_still_run(tmp_path):
    from mxflux.bench.compare import run_in_subprocesses

    def child_argv(name, json_path, memory_path):
        recipe = "tiny-bf16" if name == "bf16" else "no-such-recipe"
        return ["--recipe", recipe, "--settings", name, "--mbs", "2", "--steps", "1", "--warmup", "0", *TINY,
                "--data-dir", str(tmp_path / "data"), "--json", str(json_path)]

    results, memory = run_in_subprocesses(["mxfp6", "bf16"], child_argv)
    assert [r["label"] for r in results] == ["mxfp6", "bf16"] and memory == {}
    assert "exit status 2" in results[0]["failed"] and "no-such-recipe" in results[0]["failed"]
    assert results[1]["precision"] == "bf16" and results[1]["images_per_s"] > 0


def test_a_settings_environment_reaches_its_process_only(monkeypatch):
    """`mxfp6-inline-pack` runs its process with MXFLUX_INLINE_PACK=1 (read at import); the next
    setting's process does not inherit it."""
    from mxflux.bench import compare

    envs = {}

    class _Exits:  # a child that prints nothing and fails at once
        def __init__(self, cmd, env, **kw):
            envs[cmd[cmd.index("--settings") + 1]] = env
            self.stdout = iter(())

        def wait(self):
            return 1

    monkeypatch.setattr(compare.subprocess, "Popen", _Exits)
    monkeypatch.delenv("MXFLUX_INLINE_PACK", raising=False)
    results, _ = compare.run_in_subprocesses(["mxfp6-inline-pack", "mxfp6"],
                                             lambda name, j, m: ["--settings", name, "--json", str(j)])
    assert envs["mxfp6-inline-pack"]["MXFLUX_INLINE_PACK"] == "1" and "MXFLUX_INLINE_PACK" not in envs["mxfp6"]
    assert all("exit status 1" in r["failed"] for r in results)
    assert compare.SETTINGS["mxfp6-inline-pack"] == compare.SETTINGS["mxfp6"]


def test_a_setting_that_needs_an_environment_says_so_when_run_alone(capsys, monkeypatch):
    from mxflux.cli import main

    monkeypatch.delenv("MXFLUX_INLINE_PACK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["bench", "step", "--recipe", "tiny-mxfp6", "--settings", "mxfp6-inline-pack"])
    assert e.value.code == 2
    assert "--settings mxfp6-inline-pack: needs MXFLUX_INLINE_PACK=1 in the environment" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--synthetic", "--image-size", "60"], "--image-size 60: synthetic images need a multiple of 16 pixels"),
    (["--device", "cuda:99"], "--device cuda:99: "),  # no CUDA here, or not 100 GPUs
    (["--device", "gpu"], "--device: expected cpu, cuda or cuda:N, got 'gpu'"),
])
def test_bad_sizes_and_devices_are_one_line_before_any_setting_runs(argv, message, capsys):
    from mxflux.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "step", "--recipe", "tiny-mxfp6", "--settings", "mxfp6,bf16", "--steps", "1", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"mxflux bench step: error: {message}" in err and "Traceback" not in err


def test_release_frees_a_finished_runs_state_even_while_the_module_is_still_held():
    from mxflux.bench.step import _release

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    holder = [model]  # e.g. compiled code that traced it
    assert sum(p.numel() for p in model.parameters()) > 0 and opt.state
    _release(model, opt)
    assert holder[0] is model
    assert all(p.numel() == 0 and p.grad is None for p in model.parameters())
    assert not opt.state


def test_the_table_shows_the_captured_loop_against_its_own_profiled_step():
    """The H200 run of 2026-12-02 (committed JSON): the captured loop's rows show its time, the
    trainer's ratio to it, its reserved peak (its activations sit in the graph's pool), and its idle
    share against the profiled step (a replayed graph runs slower under the profiler: against the
    timed step bf16's busy 88.1 ms would read as -13 % idle)."""
    results = json.loads((ROOT / "benchmarks/results/bench_step_proxy_mbs16_2026-12-02g.json").read_text())
    rows = _table_rows(results)
    assert rows["captured bare loop ms / step"] == ["77.7", "66.5", "64.3"]
    assert rows["trainer / captured bare loop"] == ["1.014", "1.036", "1.034"]
    assert rows["captured peak reserved GiB"] == ["26.04", "24.74", "24.53"]
    idle = [float(v.rstrip("%")) for v in rows["idle % of profiled step"]]
    assert idle == [1.9, 2.5, 2.4]


def test_results_written_before_the_optimizer_category_show_a_dash_for_it():
    """A committed result of the tenth session (no "optimizer" category: the optimizer was in
    "other") prints, with "–" in the optimizer row and its other rows as they were."""
    results = json.loads((ROOT / "benchmarks/results/bench_step_proxy_mbs16_2026-12-02g.json").read_text())
    assert all("optimizer" not in r["breakdown"]["categories"] for r in results)
    rows = _table_rows(results)
    assert rows["optimizer"] == ["–", "–", "–"]
    assert rows["other"][2] == "25.3 (40%)"


def test_the_table_shows_the_kept_weight_operands_and_their_fix_ups_where_a_setting_had_them():
    """The A/B of the weights' operands from the optimizer step (committed, measured before the bench
    recorded them): no row; with the counts the bench now records on the MXFP6 result, the row shows
    them there and a dash for the settings whose step keeps none."""
    path = ROOT / "benchmarks/results/bench_step_deep6x12_mbs8_operands_ab_2026-12-03.json"
    results = json.loads(path.read_text())
    assert [r["label"] for r in results] == ["bf16-graph", "fp8-tensorwise-graph", "mxfp6-graph",
                                             "mxfp6-graph-pack-weights"]
    assert "weight operands kept / fix-ups" not in _table_rows(results)
    for r in results:
        r["weight_operands_kept"], r["weight_operand_fixups"] = (72, 0) if r["label"] == "mxfp6-graph" else (None, None)
    assert _table_rows(results)["weight operands kept / fix-ups"] == ["–", "–", "72 / 0", "–"]


def _table_rows(results: list[dict]) -> dict[str, list[str]]:
    """The printed comparison table as {row name: its cells}, the first row of each name."""
    from rich.console import Console

    from mxflux.bench.report import print_table

    console = Console(record=True, width=240)
    print_table(results, console=console)
    rows = {}
    for line in console.export_text().splitlines():
        if line.startswith("│"):
            rows.setdefault(line.split("│")[1].strip(), [c.strip() for c in line.split("│")[2:-1]])
    return rows
