"""The GPU study scripts run end to end at toy size on the CPU, so a device call never finds them broken."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _benchmark_module(name: str):
    """A script of benchmarks/ imported as a module (they import their siblings by bare name)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.slow
def test_convergence_study_runs_precisions_and_seeds_and_summarizes_the_spread(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--steps", "4", "--width", "64",
           "--depth", "1", "--single", "1", "--batch", "4", "--eval-every", "2", "--eval-samples", "8",
           "--warmup", "1", "--no-compile", "--seeds", "0,1", "--parallel", "2", "--out", str(tmp_path),
           "--runs", str(tmp_path / "curves")]
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=600)
    (result,) = tmp_path.glob("convergence_*.json")
    r = json.loads(result.read_text())
    assert r["provenance"]["commit"] and set(r["curves"]) == {"bf16", "mxfp6"}
    for p in ("bf16", "mxfp6"):
        assert set(r["curves"][p]) == {"0", "1"}
        assert all([s for s, _ in pts] == [2, 4] for pts in r["curves"][p].values())
    assert r["curves"]["mxfp6"]["0"] != r["curves"]["mxfp6"]["1"]  # the seeds differ
    last = r["summary"]["mxfp6"][-1]
    vals = [r["curves"]["mxfp6"][s][-1][1] for s in ("0", "1")]
    base = [r["curves"]["bf16"][s][-1][1] for s in ("0", "1")]
    assert last["seeds"] == 2 and abs(last["mean"] - sum(vals) / 2) < 1e-12
    assert (last["min"], last["max"]) == (min(vals), max(vals))
    assert abs(last["ratio_to_bf16_mean"] - sum(vals) / sum(base)) < 1e-12
    ratios = [v / b for v, b in zip(vals, base)]
    assert (last["ratio_to_bf16_min"], last["ratio_to_bf16_max"]) == (min(ratios), max(ratios))
    assert "ratio_to_bf16_mean" not in r["summary"]["bf16"][-1]
    assert all(p["mean"] < r["summary"][k][0]["mean"] * 1.5 for k in r["summary"] for p in r["summary"][k])
    assert (tmp_path / result.name.replace(".json", ".png")).stat().st_size > 1000
    # --runs: each run's metrics.csv as it trained (the curves above are its eval rows)
    assert sorted(q.name for q in (tmp_path / "curves").iterdir()) == [
        "bf16-seed0.csv", "bf16-seed1.csv", "mxfp6-seed0.csv", "mxfp6-seed1.csv"]
    rows = (tmp_path / "curves" / "mxfp6-seed1.csv").read_text().splitlines()
    evals = [x.split(",") for x in rows if ",eval," in x]
    assert [(int(e[0]), float(e[3])) for e in evals] == [tuple(x) for x in r["curves"]["mxfp6"]["1"]]


def test_convergence_compares_the_held_variant_with_mxfp6_seed_by_seed(tmp_path):
    """mxfp6-held: the recipe its workers train (the switch on, the MLPs unfused so that it reaches them), its
    ratios to mxfp6 as well as to bf16, and the blocks below the fold window each run logged."""
    conv = _benchmark_module("convergence")
    from mxflux.train import load_recipe

    cfg = load_recipe(conv.RECIPES["mxfp6-held"], conv.PRECISION_OVERRIDES["mxfp6-held"])
    assert cfg.precision.held_col_erefs and cfg.precision.fused_mlp == "off"
    assert not load_recipe(conv.RECIPES["mxfp6"], conv.PRECISION_OVERRIDES.get("mxfp6", [])).precision.held_col_erefs
    curves = {"bf16": {"0": [(10, 1.0)], "1": [(10, 2.0)]}, "mxfp6": {"0": [(10, 1.1)], "1": [(10, 2.0)]},
              "mxfp6-held": {"0": [(10, 1.21)], "1": [(10, 1.9)]}}
    (last,) = conv.summarize(curves)["mxfp6-held"]
    assert last["ratio_to_mxfp6_min"] == pytest.approx(0.95) and last["ratio_to_mxfp6_max"] == pytest.approx(1.1)
    assert last["ratio_to_mxfp6_mean"] == pytest.approx(3.11 / 3.1)
    assert last["ratio_to_bf16_min"] == pytest.approx(0.95) and last["ratio_to_bf16_max"] == pytest.approx(1.21)
    assert not any(k.startswith("ratio_to_mxfp6") for k in conv.summarize(curves)["mxfp6"][0])
    logged = tmp_path / "mxfp6.csv"
    logged.write_text("step,samples,split,loss,lr,grad_norm,images_per_s,blocks_outside_window\n"
                      "10,160,train,1.5,0.1,0.3,14.5,120\n20,320,train,0.9,0.1,1.4,17.7,127\n20,320,eval,0.8,,,,\n")
    assert conv.blocks_outside_window(logged) == 127  # cumulative: the last training row's
    plain = tmp_path / "bf16.csv"
    plain.write_text("step,samples,split,loss,lr,grad_norm,images_per_s,blocks_outside_window\n"
                     "10,160,train,1.5,0.1,0.3,14.5,\n")
    assert conv.blocks_outside_window(plain) is None


@pytest.mark.slow
def test_comm_sweep_runs_every_setting_on_two_ranks(tmp_path):
    """benchmarks/sweep_comm.py under torchrun with 2 gloo ranks: FSDP units 1 and 2 and one DDP
    bucket size, each through the harness, and a JSON with one result per setting."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29631",
           str(ROOT / "benchmarks" / "sweep_comm.py"), "--recipe", "tiny-bf16", "--units", "1,2",
           "--ddp-buckets", "1", "--mbs", "2", "--steps", "1", "--warmup", "1", "--profile-steps", "0",
           "--image-size", "128", "--text-len", "64", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["label"] for r in results] == ["fsdp u1", "fsdp u2", "ddp 1MB"]
    assert all(r["world_size"] == 2 and r["global_batch_size"] == 4 and r["images_per_s_per_gpu"] > 0
               for r in results)
    assert [(r["distributed"]["strategy"], r["distributed"]["fsdp_blocks_per_unit"], r["distributed"]["ddp_bucket_mb"])
            for r in results] == [("fsdp", 1, 25.0), ("fsdp", 2, 25.0), ("ddp", 1, 1.0)]
    assert "optimum: " in proc.stdout


def test_host_overhead_benchmark_runs(tmp_path):
    """benchmarks/bench_host.py on the CPU: the op dispatch around a stubbed packer, as JSON (and, with
    Triton under its interpreter, the CUDA packer's Python around stubbed launches)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host.py"), "--device", "cpu", "--calls", "50",
                    "--rows", "64", "--cols", "128", "--json", str(out)], check=True, env=env, timeout=300)
    r = json.loads(out.read_text())["us_per_call"]
    assert {"elementwise op (calibration)", "mx_operands op, packer stubbed"} <= set(r)
    assert set(r) - {"elementwise op (calibration)", "mx_operands op, packer stubbed"} <= {
        "mx_operands_cuda, launches stubbed", "mx_operands_cuda, launches stubbed, no plan cache"}
    assert all(v > 0 for v in r.values())


def test_step_benchmark_is_the_proxy_comparison_unless_given_a_recipe(tmp_path):
    """benchmarks/bench_step.py = `mxflux bench step --proxy`; with --recipe, that recipe (run here on
    the CPU at toy size, one setting in process)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "benchmarks" / "bench_step.py")
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, script, "--recipe", "tiny-bf16", "--settings", "bf16", "--mbs", "2", "--steps", "1",
                    "--warmup", "0", "--synthetic", "--image-size", "64", "--text-len", "16",
                    "--set", "model.overrides={depth: 1, depth_single_blocks: 1}", "--json", str(out)],
                   check=True, cwd=tmp_path, env=env, timeout=600)
    (r,) = json.loads(out.read_text())
    assert (r["label"], r["precision"], r["global_batch_size"]) == ("bf16", "bf16", 2) and r["images_per_s_per_gpu"] > 0
    # without --recipe: the proxy recipe (an unknown field stops it at validation, naming the recipe)
    proc = subprocess.run([sys.executable, script, "--settings", "bf16", "--set", "model.no_such_field=1"],
                          cwd=tmp_path, env=env, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and "flux12b-mxfp6-dev" in proc.stderr and "no_such_field" in proc.stderr


@pytest.mark.slow
def test_saved_bytes_benchmark_counts_what_a_compiled_block_keeps(tmp_path):
    """benchmarks/saved_bytes.py: MXFP6 keeps less than bf16, and repack_weights less than MXFP6."""
    out = tmp_path / "saved.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "saved_bytes.py"), "--json", str(out), "--tokens", "96",
                    "--blocks", "single", "--precisions", "bf16,mxfp6,mxfp6-repack"],
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, cwd=tmp_path, timeout=600)
    got = {r["precision"]: r for r in json.loads(out.read_text())["blocks"]}
    assert got["mxfp6-repack"]["bytes"] < got["mxfp6"]["bytes"] < got["bf16"]["bytes"]
    assert got["bf16"]["by_dtype"].get("float8_e4m3fn", 0) == 0 < got["mxfp6"]["by_dtype"]["float8_e4m3fn"]


def test_cpu_path_benchmark_times_the_kernels_and_a_default_job_step(tmp_path):
    """benchmarks/cpu_path.py: the numba kernels beside their references, and a tiny-mxfp6 step."""
    out = tmp_path / "cpu.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_path.py"), "--json", str(out), "--steps", "1",
                    "--repeats", "1"], check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, cwd=tmp_path,
                   timeout=600, capture_output=True)
    r = json.loads(out.read_text())
    for name in ("pack_1536x896_row_col", "gemm_1536x128x896"):
        assert 0 < r["kernels"][name]["numba_ms"] and 0 < r["kernels"][name]["reference_ms"]
    assert r["train_step"]["recipe"] == "tiny-mxfp6" and r["train_step"]["ms_per_step"] > 0


def test_probe_pack_passes_loads_a_variant_packer_beside_the_trees_own():
    """benchmarks/probe_pack_passes.py --variant FILE: another copy of operands_cuda.py (another
    branch's) loads as its own module of mxflux.kernels, its relative imports resolved in this tree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("probe_pack_passes", ROOT / "benchmarks" / "probe_pack_passes.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    own = probe.load_packer(None)
    variant = probe.load_packer(str(ROOT / "src" / "mxflux" / "kernels" / "operands_cuda.py"))
    assert own.__name__ == "mxflux.kernels.operands_cuda" and variant.__name__ == "mxflux.kernels._probe_variant"
    assert variant is not own and variant.mx_operands_cuda is not own.mx_operands_cuda
    assert variant.persistent_row_programs(192, 128, 264) == own.persistent_row_programs(192, 128, 264) == 4
    with pytest.raises(SystemExit, match="--variant"):
        probe.load_packer(str(ROOT / "README.md"))


def test_probe_scaled_mm_autotune_contract_check_accepts_cublas_and_rejects_a_wrong_output(monkeypatch):
    """benchmarks/probe_scaled_mm_autotune.py's check of a compiled GEMM against cuBLAS's, on the
    CPU's `_scaled_mm` at toy size: the same output passes, one output off by more than the
    summation bound fails, for the bf16 (fprop, bias) and the fp32 (wgrad) GEMM."""
    import importlib.util

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run as a script: its shapes from bench_kernels
    spec = importlib.util.spec_from_file_location("probe_scaled_mm_autotune",
                                                  ROOT / "benchmarks" / "probe_scaled_mm_autotune.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    m, k, n = 48, 96, 32
    a = (4 * torch.randn(m, k, generator=g)).to(torch.float8_e4m3fn)
    b = (4 * torch.randn(n, k, generator=g)).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())
    sb = torch.exp2(torch.randint(-6, 6, (1, n), generator=g).float())
    bias = torch.randn(n, generator=g).bfloat16()
    for fn in (probe.fprop, probe.wgrad):
        y = fn(a, b, sa, sb, bias)
        assert y.dtype == (torch.bfloat16 if fn is probe.fprop else torch.float32)
        assert probe._within_contract(y, y.clone(), a, b, sa, sb) == (True, 1.0, 0.0)
        wrong = y.clone()
        wrong[3, 5] = wrong[3, 5] + 1e6 * (wrong[3, 5].abs() + 1)  # far beyond K·2^-24·Σ|a·b|
        ok, equal, worst = probe._within_contract(wrong, y, a, b, sa, sb)
        assert not ok and equal < 1.0 and worst > 1.0


def test_rowwise_gemm_probe_says_what_it_needs_without_a_gpu(tmp_path):
    """benchmarks/probe_rowwise_gemm.py (cuBLASLt's candidates through ctypes) imports on a CPU
    machine and stops with one line naming what it needs, not a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probe_rowwise_gemm.py"), "--json",
                        str(tmp_path / "x.json")], cwd=ROOT / "benchmarks", env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "needs a CUDA device of sm_90 or later and cuBLASLt" in r.stderr
    assert not (tmp_path / "x.json").exists()


def test_optimizer_benchmark_builds_its_shapes_and_says_what_it_needs_without_a_gpu(tmp_path):
    """benchmarks/bench_optimizer.py: the parameter shapes of the model it names (the proxy's
    1.30 B elements, 0.91 B of them in MX weights), and on a CPU machine one line naming what it
    needs."""
    bench_optimizer = _benchmark_module("bench_optimizer")
    shapes = bench_optimizer._model_shapes(2, 4)
    assert len(shapes) == 96 and sum(s.numel() for s, _ in shapes) == 1_299_925_056
    mx = [s for s, h in shapes if h is not None]  # the recipe's 24 MXFP6 linears' weights
    assert len(mx) == 24 and sum(s.numel() for s in mx) == 905_969_664
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_optimizer.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "needs a CUDA device" in r.stderr


def test_quant_floor_bounds_the_packers_from_the_committed_results(tmp_path):
    """benchmarks/quant_floor.py on the committed H200 results: the proxy's packer bytes per step
    equal the count by hand (6 bytes per activation and dY element of every MX linear, 6 per fp32
    weight element), MXFP6 / bf16 only grows as the packers get cheaper, and a results file
    missing a packer time is refused by name."""
    quant_floor = _benchmark_module("quant_floor")
    results = ROOT / "benchmarks" / "results"
    kernels, layers = results / "bench_kernels_2026-12-03.json", results / "bench_layers_2026-12-03.json"
    step64 = results / "bench_step_proxy_mbs64_erefs_2026-12-02.json"
    out = tmp_path / "floor.json"
    assert quant_floor.main(["--kernels", str(kernels), "--layers", str(layers), "--step", str(step64),
                             "--json", str(out)]) == 0
    floor = json.loads(out.read_text())

    mx = [r for r in json.loads(step64.read_text()) if r["precision"] == "mxfp6"][0]
    linears = quant_floor.mx_linears(mx)
    assert len(linears) == 24 and sum(k * n for _, _, k, n in linears) == 905_969_664  # = bench_optimizer's
    # per sample: 2 double blocks x 2 streams x 256 tokens x (12288 + 6144 + 15360 + 15360) elements
    # + 4 single blocks x 512 tokens x (24576 + 18432)
    per_sample = 2 * 2 * 256 * 49152 + 4 * 512 * 43008
    assert floor["steps"][0]["packer_gb"] * 1e9 == pytest.approx(6 * 64 * per_sample + 6 * 905_969_664)
    step = floor["steps"][0]
    assert step["vs_bf16"] == pytest.approx(step["bf16_ms"] / step["mxfp6_ms"])
    assert step["vs_bf16"] < step["vs_bf16_at_floor"] and step["vs_fp8"] < step["vs_fp8_at_floor"]

    assert len(floor["layers"]) == 6
    for r in floor["layers"]:
        assert (r["vs_bf16_measured"] < r["vs_bf16_row_at_copy"] < r["vs_bf16_one_pass_at_copy"]
                < r["vs_bf16_packers_free"]), r["layer"]
        assert 0 < r["packers_pct_of_row_floor"] < 100

    broken = json.loads(kernels.read_text())
    broken["pack"] = [p for p in broken["pack"] if not (p["linear"] == "proj" and p["tensor"] == "dY")]
    (tmp_path / "k.json").write_text(json.dumps(broken))
    with pytest.raises(SystemExit, match="quant_floor: kernels: no row-granularity packer times .* proj at M=32768"):
        quant_floor.main(["--kernels", str(tmp_path / "k.json"), "--layers", str(layers)])
    no_fp8 = results / "bench_step_deep6x12_mbs8_graph_2026-12-03b.json"  # bf16-graph and mxfp6-graph only
    with pytest.raises(SystemExit, match=r"no \['fp8'\] setting that ran"):
        quant_floor.main(["--kernels", str(kernels), "--step", str(no_fp8)])


def test_cutlass_rowwise_op_library_compiles_against_the_installed_torch():
    """benchmarks/cutlass_rowwise.cpp (torch's CUTLASS row-wise FP8 GEMM registered as an op) compiles
    against this torch's headers, so the device call that builds and times it does not find it
    broken; on a machine without CUDA, loading it says why instead of failing."""
    import torch

    cutlass_rowwise = _benchmark_module("cutlass_rowwise")
    try:
        cmd = cutlass_rowwise.compile_command(syntax_only=True)
    except RuntimeError as e:
        pytest.skip(str(e))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with pytest.raises(ValueError, match="output path"):
        cutlass_rowwise.compile_command()
    if not torch.cuda.is_available():
        assert cutlass_rowwise.load() == "needs a CUDA device of sm_90 or later"


_SASS_LOOP = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/              @P6 BRA 0x40 ;                              /* 0x0000000000346947 */
        /*0020*/                   FADD R2, R3, R4 ;                      /* 0x0000000403027221 */
        /*0030*/                   LDG.E.128 R4, desc[UR4][R6.64] ;       /* 0x0000000406047981 */
        /*0040*/                   FADD R2, R3, -R4 ;                     /* 0x8000000403027221 */
        /*0050*/                   PRMT R7, R2, 0x5410, R3 ;              /* 0x0000541002077816 */
        /*0060*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB R8, R2, R3 ; /* 0x0000000302087304 */
        /*0070*/              @!P3 BRA 0x20 ;                             /* 0xffffffbc0074b947 */
        /*0080*/              @P0 BRA `(.L_x_1) 0x10 ;                    /* 0xfffffffc00fc7947 */
        /*0090*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_sass_census_counts_the_longest_loop_by_opcode_and_kind(tmp_path, monkeypatch):
    """The census reads cuobjdump's listing: the main loop is the longest backward branch's span
    (0x20-0x70 here, not the forward branch nor the shorter one), opcodes lose predicates and
    modifiers, and the kinds add up to the loop."""
    census = _benchmark_module("sass_census")

    class _Done:
        stdout = _SASS_LOOP

    monkeypatch.setattr(census, "_tool", lambda name: name)
    monkeypatch.setattr(census.subprocess, "run", lambda *a, **k: _Done())
    listing = census.sass(b"cubin")
    assert [a for a, _ in listing] == list(range(0, 0xA0, 0x10))
    assert census.opcode("@!P3 BRA 0x20") == "BRA" and census.opcode("LDG.E.128 R4, desc[UR4][R6.64]") == "LDG"
    loop = census.main_loop(listing)
    assert len(loop) == 8  # 0x10 .. 0x80: the `(.L_x_1)` branch back to 0x10
    assert loop[0].startswith("@P6 BRA") and loop[-1].startswith("@P0 BRA")
    counts = census.census(census.main_loop(listing[:8]))  # without it: 0x20 .. 0x70
    assert counts["loop"] == 6
    assert counts["opcodes"] == {"FADD": 2, "LDG": 1, "PRMT": 1, "F2FP": 1, "BRA": 1}
    assert counts["kinds"] == {"arithmetic": 3, "memory": 1, "integer and layout": 1, "control": 1}
    with pytest.raises(ValueError, match="no backward branch"):
        census.main_loop(listing[:3])
    # the loops holding no other loop: here the inner one alone, so no second walk of the one-pass packer
    assert census.inner_loops(listing) == [census.main_loop(listing[:8])]
    assert census.inner_loops(listing[:3]) == []
    with pytest.raises(ValueError, match="re-scaling the rows beside walk 1, found 0"):
        census.onepass_walks(listing)


def test_onepass_bench_says_what_it_needs_without_a_gpu(tmp_path):
    """benchmarks/bench_onepass.py on a CPU machine: one line naming what it needs, exit 2, no JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_onepass.py"), "--out", str(tmp_path),
                        "--profile-one", "64,96"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "bench_onepass: needs a CUDA device"
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_convergence_study_cut_at_its_deadline_summarizes_the_steps_every_run_reached(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--steps", "100000", "--width", "64",
           "--depth", "1", "--single", "1", "--batch", "4", "--eval-every", "5", "--eval-samples", "4",
           "--warmup", "1", "--no-compile", "--seeds", "0", "--parallel", "2", "--out", str(tmp_path),
           "--deadline", "45"]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=600)
    assert time.monotonic() - t0 < 120  # stopped, not trained to the end
    (result,) = tmp_path.glob("convergence_*_width64.json")
    r = json.loads(result.read_text())
    assert r["complete"] is False
    steps = {p: [[s for s, _ in pts] for pts in by_seed.values()] for p, by_seed in r["curves"].items()}
    assert steps["bf16"] == steps["mxfp6"] and steps["bf16"][0][:2] == [5, 10]  # the same steps, several
    assert [row["step"] for row in r["summary"]["mxfp6"]] == steps["mxfp6"][0]


@pytest.mark.slow
def test_lora_bench_times_every_setting_and_compares_them(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_lora.py"), "--model", "flux-tiny", "--image", "64",
           "--txt", "8", "--rank", "4", "--steps", "2", "--warmup", "1", "--device", "cpu", "--no-compile",
           "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=600, capture_output=True)
    (result,) = tmp_path.glob("bench_lora_*.json")
    r = json.loads(result.read_text())
    assert r["provenance"]["commit"] and [row["setting"] for row in r["rows"]] == ["mxfp6", "bf16", "peft"]
    by = {row["setting"]: row for row in r["rows"]}
    assert all(len(row["ms_all"]) == 2 and row["ms_mean"] > 0 for row in by.values())
    assert abs(by["mxfp6"]["speedup_vs_peft"] - statistics.median(by["peft"]["ms_all"])
               / statistics.median(by["mxfp6"]["ms_all"])) < 1e-12  # by the median step
    assert abs(by["mxfp6"]["speedup_vs_peft_by_mean"] - by["peft"]["ms_mean"] / by["mxfp6"]["ms_mean"]) < 1e-12
    # the same linears adapted: ours one adapter per fused qkv / linear1, peft one per q, k, v (, MLP in)
    assert 0 < by["mxfp6"]["trained_parameters"] == by["bf16"]["trained_parameters"] < by["peft"]["trained_parameters"]
    # the checkpointing settings, compiled (eager selective checkpointing keeps its tensors apart from
    # autograd's saved ones): attention's outputs kept add to the block inputs full checkpointing keeps,
    # and blocks keeping their base GEMMs' outputs add more
    compiled = [c for c in cmd if c != "--no-compile"]
    subprocess.run([*compiled, "--impls", "mxfp6-full,mxfp6-attention,mxfp6-attention-keep1-1"], check=True,
                   cwd=tmp_path, env=env, timeout=900, capture_output=True)
    full, attention, kept = (row["memory"]["saved_for_backward"]["by_dtype"]
                             for row in json.loads(result.read_text())["rows"])
    assert kept["bfloat16"] > attention["bfloat16"] > full["bfloat16"] > 0, (full, attention, kept)
    bad = subprocess.run([*cmd, "--impls", "mxfp6-keep1"], cwd=tmp_path, env=env, timeout=60, capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "--impls: unknown setting 'mxfp6-keep1'" in bad.stderr


def test_user_loop_bench_times_each_setting_with_its_optimizer(tmp_path):
    """benchmarks/bench_user_loop.py on the CPU (tiny recipe, eager): each setting in its own process,
    torch's AdamW for the precisions, mxflux.optim.AdamW for the last; ratios by the median; a misspelt
    setting refused before any starts."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_user_loop.py"), "--recipe", "tiny-mxfp6", "--device", "cpu",
           "--no-compile", "--mbs", "2", "--image", "64", "--txt", "8", "--steps", "2", "--warmup", "1",
           "--out", str(tmp_path)]
    subprocess.run([*cmd, "--settings", "bf16,mxfp6-mxflux-adamw"], check=True, cwd=tmp_path, env=env, timeout=300,
                   capture_output=True)
    (result,) = tmp_path.glob("bench_user_loop_mbs2_*.json")
    r = json.loads(result.read_text())
    assert r["provenance"]["commit"] and [row["setting"] for row in r["rows"]] == ["bf16", "mxfp6-mxflux-adamw"]
    bf16, ours = r["rows"]
    assert bf16["optimizer"] == "torch.optim.adamw.AdamW" and ours["optimizer"] == "mxflux.optim.AdamW"
    assert len(ours["ms_all"]) == 2 and ours["ms_median"] == statistics.median(ours["ms_all"])
    assert abs(ours["speedup_vs_bf16"] - bf16["ms_median"] / ours["ms_median"]) < 1e-12
    bad = subprocess.run([*cmd, "--settings", "mxfp6-adamw"], cwd=tmp_path, env=env, timeout=60, capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "--settings: unknown 'mxfp6-adamw'" in bad.stderr


def _cute_dsl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None


def test_cute_rowwise_probe_summarizes_nvidia_smis_clock_samples():
    """`--clock`: the median SM clock and power of nvidia-smi's samples, its first third dropped (the load still
    starting), lines it could not read skipped; none left is None, not a crash."""
    probe = _benchmark_module("probe_cute_rowwise_gemm")
    text = "345, 80.1\n1410, 400.0\n1980, 690.5\n1755, 699.0\n[N/A], [N/A]\n1830, 700.2\n1755, 698.0\n17"
    assert probe.clock_summary(text) == {"sm_clock_mhz": 1792.5, "power_w": 698.5, "samples": 4}
    assert probe.clock_summary("") == {"sm_clock_mhz": None, "power_w": None, "samples": 0}


def test_cute_rowwise_probe_casts_tensorwise_as_torchao_does():
    """`--operands packed`: the tensor-wise GEMMs' operands are the bf16 tensors cast with their amax mapped to
    E4M3's 448 (torchao's tensor-wise recipe), the returned scale multiplying them back to within E4M3's rounding."""
    import torch

    probe = _benchmark_module("probe_cute_rowwise_gemm")
    t = (0.02 * torch.randn(64, 96, generator=torch.Generator().manual_seed(0))).bfloat16()
    cast, scale = probe.tensorwise_cast(t)
    assert cast.dtype == torch.float8_e4m3fn and scale.dim() == 0
    assert cast.float().abs().max().item() == 448.0
    back = cast.float() * scale
    normal = t.float().abs() >= 2.0**-6 * scale  # E4M3 normals after the scaling: relative error at most 2^-4
    assert ((back - t.float()).abs()[normal] <= 2.0**-4 * t.float().abs()[normal]).all()


@pytest.mark.skipif(_cute_dsl_installed(), reason="CuTe DSL is installed here")
def test_cute_rowwise_probe_runs_a_configuration_only_on_whole_tile_clusters():
    """The probe gives the kernel only the problems the step would (its epilogue reads the scales at every
    coordinate of its tiles): 160-wide tiles cover linear2's dgrad (N 15360), not N 3072."""
    probe = _benchmark_module("probe_cute_rowwise_gemm")
    assert probe.whole_clusters(32768, 15360, "128x160-2x1-s8-fp32")
    assert not probe.whole_clusters(32768, 3072, "128x160-2x1-s8-fp32")
    assert probe.whole_clusters(32768, 3072, "128x192-2x1-s8-fp32")
    assert not probe.whole_clusters(32768 - 128, 3072, "128x192-2x1-s8-fp32")  # 2x1 clusters: M in 256s


def test_cute_rowwise_probe_says_what_it_needs_without_cute_dsl(tmp_path):
    """benchmarks/probe_cute_rowwise_gemm.py where nvidia-cutlass-dsl is not installed (CI): one line naming
    it, exit 2, no traceback and no JSON."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probe_cute_rowwise_gemm.py"), "--compile-only",
                        "--json", str(tmp_path / "x.json")], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "probe_cute_rowwise_gemm: needs nvidia-cutlass-dsl (CuTe DSL; pip install nvidia-cutlass-dsl)"
    assert not (tmp_path / "x.json").exists()


def _compile_only_rows(probe: str, tmp_path) -> list[dict]:
    """The rows of benchmarks/`probe`.py --compile-only (each configuration built for sm_90a, no GPU)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{probe}.py"), "--compile-only",
                        "--json", str(tmp_path / "x.json")], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((tmp_path / "x.json").read_text())["rows"]


@pytest.mark.skipif(not _cute_dsl_installed(), reason="needs nvidia-cutlass-dsl")
def test_cute_rowwise_gemm_builds_for_sm90_without_a_gpu(tmp_path):
    """The CuTe-DSL row-scaled GEMM compiles for sm_90a from fake tensors in every configuration, for each of
    the three GEMMs (bf16 out with and without the bias, fp32 out): what can be checked without a GPU; the
    probe's GPU run checks its numbers."""
    rows = _compile_only_rows("probe_cute_rowwise_gemm", tmp_path)
    probe = _benchmark_module("probe_cute_rowwise_gemm")
    assert {(row["config"], row["bias"], row["fp32_out"]) for row in rows if row["compiled"]} == {
        (c, *v) for c in probe.CONFIGS for v in ((True, False), (False, False), (False, True))}


def _quack_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("quack") is not None


@pytest.mark.skipif(_quack_installed(), reason="quack-kernels is installed here")
def test_quack_probe_says_what_it_needs_without_quack(tmp_path):
    """benchmarks/probe_quack_gemm.py where quack-kernels is not installed (CI): one line naming it, exit 2, no
    traceback and no JSON."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probe_quack_gemm.py"), "--compile-only",
                        "--json", str(tmp_path / "x.json")], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("probe_quack_gemm: needs quack-kernels (pip install quack-kernels;")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()


@pytest.mark.skipif(not _quack_installed(), reason="needs quack-kernels")
def test_quack_gemm_builds_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    """quack's Hopper FP8 GEMM with promoted sums compiles for sm_90a in every configuration the probe times,
    ping-pong and cooperative, bf16 and fp32 out: with a vector added along N and one along M (from fake tensors),
    and with our contract's epilogue (through quack's epilogue front end, as if on an H100): what can be checked
    without a GPU."""
    rows = _compile_only_rows("probe_quack_gemm", tmp_path)
    probe = _benchmark_module("probe_quack_gemm")
    assert {(row["config"], row["fp32_out"]) for row in rows if row["compiled"]} == {
        (c, fp32) for c in probe.ALL for fp32 in (False, True)}, rows
    # the GPU run's call, bound to quack's own signature (a call that does not fit fails here, not on the device)
    import inspect

    import quack.gemm

    signature, bound = inspect.signature(quack.gemm.gemm), []
    monkeypatch.setattr(quack.gemm, "gemm", lambda *a, **k: bound.append(signature.bind(*a, **k)))
    for name in probe.CONFIGS:
        probe.quack_call(name, "A", "B", "out", "rowvec", "colvec")()
    assert [(b.arguments["tile_M"], b.arguments["tile_N"], b.arguments["pingpong"], b.arguments["colvec_bias"])
            for b in bound] == [(*probe.CONFIGS[c][0], probe.CONFIGS[c][2], "colvec") for c in probe.CONFIGS]


@pytest.mark.skipif(not _quack_installed(), reason="needs quack-kernels")
def test_quack_scaled_epilogue_applies_both_scales_and_the_bias_to_promoted_sums(tmp_path):
    """The drop-in candidate (`-scaled`: quack's ping-pong GEMM with our contract's epilogue), in its sm_90a PTX:
    per thread, 96 promotion adds (each k-tile's sums into fp32, the contract's accumulation) and, per accumulator,
    both scales multiplied in (192 multiplies), or with the bias the second multiply and the add as one FMA (the
    same bits: the product by a power of two is exact)."""
    dump = _dsl_dump("probe_quack_gemm", "pingpong-64x192-2x1-scaled", tmp_path)
    counts = {}
    for ptx in dump.glob("*.ptx"):
        text = ptx.read_text()
        kind = "bias" if "row_scaled_bias" in ptx.name else "plain"
        counts[kind] = tuple(len(re.findall(p, text)) for p in (r"wgmma\.mma_async", r"\badd(?:\.rn)?\.f32\b",
                                                                r"\bmul(?:\.rn)?\.f32\b", r"\bfma\.rn\.f32\b"))
    assert counts == {"plain": (8, 96, 192, 0), "bias": (8, 96, 96, 96)}, counts


def _dsl_dump(script: str, config: str, tmp_path, keep: str = "ptx") -> Path:
    """The folder where CuTe DSL left the `keep` artifacts (ptx, cubin) of `benchmarks/<script>.py --compile-only
    --configs <config>`, built for sm_90a without a GPU."""
    dump = tmp_path / f"{config}-{keep}"
    dump.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "CUTE_DSL_KEEP": keep, "CUTE_DSL_DUMP_DIR": str(dump),
           "CUTE_DSL_DISABLE_FILE_CACHING": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--compile-only", "--configs",
                        config], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return dump


def _cute_ptx(config: str, tmp_path) -> str:
    """The PTX of the probe's configuration `config` built for sm_90a without a GPU: that of the last of its three
    GEMMs built (each overwrites the file), the fp32-out one."""
    (ptx,) = _dsl_dump("probe_cute_rowwise_gemm", config, tmp_path).glob("*.ptx")
    return ptx.read_text()


@pytest.mark.skipif(not _cute_dsl_installed(), reason="needs nvidia-cutlass-dsl")
def test_cute_fp32_accumulation_adds_each_k_tile_into_fp32_registers(tmp_path):
    """`MXFLUX_CUTE_ACCUMULATE=fp32` (the GEMM contract's accumulation): in the kernel's PTX, the k-tile's four
    WGMMAs write a partial tile that is then added into the fp32 accumulator, one add per accumulator element
    of a thread (64 x 192 / 128 = 96), where the same tile with fast accumulation has no add (the GEMM without
    a bias: its epilogue only multiplies)."""
    adds = {}
    for config in ("128x192-2x1-s8", "128x192-2x1-s8-fp32"):
        text = _cute_ptx(config, tmp_path)
        adds[config] = len(re.findall(r"\badd(?:\.rn)?\.f32\b", text))
        wgmmas = len(re.findall(r"wgmma\.mma_async", text))
        assert wgmmas == (4 if config.endswith("fp32") else 8)  # fast: the example's prologue and main loop
    # (the compiler peels the last k-tile into the epilogue: its 96 adds appear there a second time)
    assert adds["128x192-2x1-s8"] == 0 and adds["128x192-2x1-s8-fp32"] in (96, 192), adds


@pytest.mark.skipif(not _cute_dsl_installed(), reason="needs nvidia-cutlass-dsl")
@pytest.mark.parametrize("accumulation,parts", [("fp32h", 2), ("fp32p3", 3), ("fp32p4", 4)])
def test_cute_promotion_in_parts_adds_under_the_later_parts_wgmmas(accumulation, parts, tmp_path):
    """`fp32h`, `fp32p3`, `fp32p4` (`promotion_parts`), in the sm_90a SASS the DSL builds on the CPU: each k-tile's
    WGMMAs in `parts` groups of four over a part of N (QGMMA 64 x 192 / parts), then the waits and the 96 adds a
    thread, at least half of them before the wait for the last group (under its WGMMAs; with halves exactly the
    first half's 48), in the whole-tile kernel's 168 registers, nothing spilled. (Adds carried across the loop's
    back edge made ptxas serialize every WGMMA; waiting for every group before any add leaves all 96 under no
    MMA: either breaks this.)"""
    pytest.importorskip("triton", reason="cuobjdump comes with Triton's wheel (make test-cute installs it)")
    cuobjdump = _benchmark_module("sass_census")._tool("cuobjdump")
    (cubin,) = _dsl_dump("probe_cute_rowwise_gemm", f"128x192-2x1-s8-{accumulation}", tmp_path,
                         keep="cubin").glob("*.cubin")  # the last of the three GEMMs built: fp32 out
    usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"REG:168 .*LOCAL:0 ", usage), usage
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"QGMMA\.\S+|WARPGROUP\.(?:ARRIVE|DEPBAR\.LE gsb0, 0x\d)|\bFADD\b", sass)
    first = ops.index("WARPGROUP.ARRIVE")
    issue = ["WARPGROUP.ARRIVE", *[f"QGMMA.64x{192 // parts}x32.F32.E4M3.E4M3"] * 4] * parts
    assert ops[first:first + len(issue)] == issue, ops[first:first + len(issue)]
    rest = ops[first + len(issue):]
    drain = rest.index("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    hidden, exposed = rest[:drain].count("FADD"), rest[drain:drain + 1 + 96].count("FADD")
    assert hidden + exposed == 96 and hidden >= 48 and all(op.startswith(("FADD", "WARPGROUP.DEPBAR"))
                                                           for op in rest[:drain]), rest[:drain + 1 + 96]
    if parts == 2:
        assert hidden == 48 and rest[0] == "WARPGROUP.DEPBAR.LE gsb0, 0x1"
    assert sum(op.startswith("QGMMA") for op in ops) == 4 * parts


@pytest.mark.skipif(not _cute_dsl_installed(), reason="needs nvidia-cutlass-dsl")
@pytest.mark.parametrize("accumulation,loads", [("fp32-bs64", 2 + 3), ("fp32-bscol", 2 + 48)])
def test_cute_block_scales_enter_at_the_promotion_as_one_ffma(accumulation, loads, tmp_path):
    """The probe's block-scaled trial (`block_scale_columns`), in the sm_90a SASS built on the CPU: per k-tile a thread
    loads its two rows' A scales and its groups' B scales once (3 groups of 64 columns before the k-tile's WGMMAs,
    so the loads run under them; 48 columns after, where loaded before they spilled), and promotes each of its 96
    partial sums with one FFMA (no FADD), in the kernel's 168 registers, nothing spilled, no scale read in the
    epilogue. Register-level scale reads (96 a k-tile) or a per-element product break the counts."""
    pytest.importorskip("triton", reason="cuobjdump comes with Triton's wheel (make test-cute installs it)")
    cuobjdump = _benchmark_module("sass_census")._tool("cuobjdump")
    (cubin,) = _dsl_dump("probe_cute_rowwise_gemm", f"128x192-2x1-s8-{accumulation}", tmp_path,
                         keep="cubin").glob("*.cubin")  # the last of the three GEMMs built: fp32 out, no bias
    usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"REG:168 STACK:0 .*LOCAL:0 ", usage), usage
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"QGMMA\.\S+|WARPGROUP\.DEPBAR\.LE gsb0, 0x0|\bLDG\.E\b|\bFFMA\b|\bFADD\b|\bFMUL\b", sass)
    first = ops.index(next(op for op in ops if op.startswith("QGMMA")))
    drain = ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert ops.count("LDG.E") == loads and ops.count("FADD") == 0 and ops.count("FFMA") == 96
    if accumulation == "fp32-bs64":
        assert ops[:first].count("LDG.E") == loads and ops.count("FMUL") == 2 * 3
    else:
        assert ops[drain:].count("LDG.E") == loads and ops.count("FMUL") == 96


def test_bench_kernels_times_the_gemms_an_mx_linear_runs(monkeypatch):
    """bench_kernels' fprop, dgrad and wgrad problems are the GEMMs MXFP6Linear's forward and backward run
    (A rows, B rows, contraction, bias, out dtype), recorded from a CPU linear K -> N at M tokens."""
    import torch

    from mxflux.nn import MXFP6Linear
    from mxflux.ops import custom_ops

    bench_kernels = _benchmark_module("bench_kernels")
    m, k, n = 64, 96, 160
    ran = []
    real = custom_ops.scaled_gemm_cpu

    def recording(a_data, a_scale, b_data, b_scale, bias, out_dtype):
        ran.append((a_data.shape[0], b_data.shape[0], a_data.shape[1], bias is not None, out_dtype))
        return real(a_data, a_scale, b_data, b_scale, bias, out_dtype)

    monkeypatch.setattr(custom_ops, "scaled_gemm_cpu", recording)
    layer = MXFP6Linear(k, n, bias=True)
    x = torch.randn(m, k, requires_grad=True)
    layer(x).float().sum().backward()
    assert sorted(ran, key=str) == sorted((bench_kernels.gemm_problem(kind, m, k, n) for kind in
                                           bench_kernels.GEMM_KINDS), key=str)


def _ncu_csv(path, kernels):
    """ncu's `--csv --page details` layout: a log line, then one quoted row per (kernel, section, metric)."""
    import csv

    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
                    "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
        for i, (name, duration) in enumerate(kernels):
            for section, metric, unit, value in (("GPU Speed Of Light Throughput", "Duration", "us", duration),
                                                 ("GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%",
                                                  "81.5"),
                                                 ("Warp State Statistics", "Warp Cycles Per Issued Instruction",
                                                  "cycle", "9.1")):
                w.writerow([str(i), "1", "python3", "h", name, "1", "7", "(384, 1, 1)", "(132, 1, 1)", "0", "9.0",
                            section, metric, unit, value])


def test_the_ncu_summary_pairs_each_profiled_gemm_with_its_label(tmp_path, capsys):
    """probe_gemm_ncu.py's summary (CPU-side: ncu's CSV and the launch labels): GEMM kernels are matched to the
    labels in launch order, a kernel that is no GEMM (a cast torch launched) skipped, and a count that does not
    match is one line, not a wrong pairing."""
    probe = _benchmark_module("probe_gemm_ncu")
    labels = [dict(linear="linear1", kind="fprop", m=32768, n=21504, k=3072, bias=True, fp32_out=False, kernel=k)
              for k in ("cublas-tensorwise", "ours-fp32")]
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    _ncu_csv(tmp_path / "ncu.csv", [("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN", "3010"),
                                    ("triton_poi_fused__to_copy_0", "12"),
                                    ("kernel_cutlass_kernel_mxfluxkernelscute_rowwise_gemmRowScaledFP8Gemm", "3170")])
    rows = probe.summarize(str(tmp_path / "ncu.csv"), str(tmp_path / "labels.json"))
    assert [(r["kernel"], r["headline"]["Duration"]) for r in rows] == [("cublas-tensorwise", "3010 us"),
                                                                       ("ours-fp32", "3170 us")]
    assert rows[1]["sections"]["Warp State Statistics"]["Warp Cycles Per Issued Instruction"]["value"] == "9.1"
    _ncu_csv(tmp_path / "ncu.csv", [("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN", "3010")])
    with pytest.raises(SystemExit, match="1 GEMM kernels profiled, 2 launches labelled"):
        probe.summarize(str(tmp_path / "ncu.csv"), str(tmp_path / "labels.json"))
    with pytest.raises(SystemExit, match="--problems: expected linear:kind pairs"):
        probe.parse_problems("linear1:backward", 32768)


def _promoted_gemm(wrong_scales: bool = False):
    """A CPU stand-in for `gemm_cute.prepared_gemm` with the kernel's arithmetic: each k-tile's sums in fp32 added
    into an fp32 accumulator, times the k-tile's block scales there (block-scaled accumulations) or times the row
    and column scales at the end (`fp32`). `wrong_scales`: the block scales of k-tile 0 used for every k-tile."""
    import torch

    from mxflux.kernels.gemm_cute import BLOCK_SCALES

    def prepared(a, sa, b, sb, bias, out, config, most, accumulation):
        def call():
            acc = torch.zeros(out.shape, dtype=torch.float32)
            k_tiles = a.shape[1] // 128
            for t in range(k_tiles):
                part = a[:, 128 * t:128 * (t + 1)].float() @ b[:, 128 * t:128 * (t + 1)].float().t()
                if accumulation in BLOCK_SCALES:
                    u = 0 if wrong_scales else t
                    cols = sb[:, u].repeat_interleave(out.shape[1] // sb.shape[0])
                    part = part * sa[:, u:u + 1] * cols
                acc += part
            if accumulation not in BLOCK_SCALES:
                acc = acc * sa.reshape(-1, 1) * sb.reshape(1, -1)
            out.copy_(acc + (bias.float() if bias is not None else 0))
        return call
    return prepared


@pytest.mark.parametrize("config", ["128x192-2x1-s8-fp32-bs64", "128x192-2x1-s8-fp32-bscol"])
def test_block_scaled_probe_checks_hold_for_the_kernels_arithmetic_and_catch_wrong_scales(config, monkeypatch):
    """`block_scaled`'s two checks, on a CPU stand-in with the kernel's arithmetic: with k-tile-constant scales the
    block-scaled output equals the row-scaled one bit for bit, with random ones it lies within the fp32 bound of
    float64; the same stand-in using k-tile 0's scales throughout fails the bound (the checks can fail)."""
    import torch

    from mxflux.kernels import gemm_cute

    probe = _benchmark_module("probe_cute_rowwise_gemm")
    gen = torch.Generator().manual_seed(0)
    a = (4 * torch.randn(256, 512, generator=gen)).to(torch.float8_e4m3fn)
    b = (4 * torch.randn(384, 512, generator=gen)).to(torch.float8_e4m3fn)
    bias = torch.randn(384, generator=gen).bfloat16()
    monkeypatch.setattr(gemm_cute, "prepared_gemm", _promoted_gemm())
    checks, call = probe.block_scaled(config, a, b, bias, torch.bfloat16, gen, checked_rows=64)
    assert checks["bit_equal_to_row_scaled"] and checks["within_bound"] and checks["worst_over_bound"] <= 1
    assert ("cublas_blockwise" in checks) == config.endswith("bscol")
    monkeypatch.setattr(gemm_cute, "prepared_gemm", _promoted_gemm(wrong_scales=True))
    checks, _ = probe.block_scaled(config, a, b, bias, torch.bfloat16, gen, checked_rows=64)
    assert checks["bit_equal_to_row_scaled"] and not checks["within_bound"]


def test_probe_eref_drift_counts_fix_ups_by_value_and_the_window_against_the_prediction():
    """benchmarks/probe_eref_drift.py: a column needs a fix-up where a block's largest element, encoded
    against the predicted e_ref, would pass E4M3's 448 (7.5 one binade above the prediction does, 7.0 does
    not), or where it has no previous e_ref; a block exactly `window` binades below the prediction stays
    inside, one more falls outside, and a fixed-up column is counted against its own e_ref."""
    import torch

    probe = _benchmark_module("probe_eref_drift")
    none = -(2**20)
    e_block = torch.tensor([[5, 3], [5, 2], [5, 2], [7, 1], [10, -1], [0, 0], [5, -7]], dtype=torch.int32)
    live = torch.tensor([[True, True]] * 5 + [[False, False], [True, True]])
    qmax = torch.tensor([[7.5, 1.0], [7.5, 1.0], [7.0, 1.0], [2.0, 1.0], [4.0, 1.0], [0.0, 0.0], [7.5, 1.0]])
    e_prev = torch.tensor([5, 4, 4, none, 10, 3, 4], dtype=torch.int32)
    at = dict(shift=5, window=11)
    c0 = probe.drift_counts(e_block, live, qmax, e_prev, 0, **at)
    # fixed up: rows 1 and 6 (7.5 one binade above), 3 (no past); the last's -7 block 12 binades below its own 5
    assert c0 == {"columns": 6, "columns_to_fix_up": 3, "columns_above_prediction": 3, "blocks": 12,
                  "blocks_outside_window_exact": 1, "blocks_outside_window_predicted": 1}
    c1 = probe.drift_counts(e_block, live, qmax, e_prev, 1, **at)
    assert (c1["columns_to_fix_up"], c1["columns_above_prediction"]) == (1, 0)  # only the column without a past
    assert c1["blocks_outside_window_predicted"] == 2  # 10 + 1 - (-1) = 12 binades below, and the last row's
    assert c1["blocks_outside_window_exact"] == 1


def test_probe_eref_drift_exact_count_is_the_reference_packers():
    """The probe's exact-fold count of blocks outside the window on the col orientation equals what the
    reference packer counts for that orientation (columns with blocks far below their largest)."""
    import torch

    from mxflux.mx.operands import mx_operands_reference, rowwise_erefs_reference

    probe = _benchmark_module("probe_eref_drift")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 96, generator=g)
    x[:32, ::3] *= 2.0**14  # the first block of every third column far above the column's others
    e_block, live, qmax, f = probe.column_blocks(x)
    no_past = torch.full((96,), -(2**20), dtype=torch.int32)
    counts = probe.drift_counts(e_block, live, qmax, no_past, 0, f.fold_shift, f.fold_window)
    reference = int(mx_operands_reference(x, row=False, col=True).blocks_outside_window)
    assert counts["blocks_outside_window_exact"] == reference > 0
    assert counts["columns_to_fix_up"] == counts["columns"] == 96
    assert torch.equal(probe.column_erefs(e_block, live) + 128, rowwise_erefs_reference(x)[1])
