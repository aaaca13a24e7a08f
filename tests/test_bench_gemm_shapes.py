"""The GEMMs' device time by problem shape (`mxflux.bench.gemm_shapes`): each GEMM kernel charged to
the GEMM op whose span holds its launch, on a hand-built Chrome trace of the profiler's format, and
the recorded input dims read as the profiler writes them (a real CPU profile of torch's and the MX
GEMM op)."""

from __future__ import annotations

import json

import pytest
import torch

from mxflux.bench.device_time import GEMM_OPS
from mxflux.bench.gemm_shapes import NO_OP, PACKER_OPS, _ops_by_thread, gemm_shapes, packer_shapes, problem
from mxflux.bench.report import print_table


def _op(name, ts, dur, dims, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur,
            "args": {"Input Dims": dims}}


def _launch(corr, ts, tid=1, driver=False):
    return {"ph": "X", "cat": "cuda_driver" if driver else "cuda_runtime",
            "name": "cuLaunchKernelEx" if driver else "cudaLaunchKernel", "pid": 7, "tid": tid, "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def _kernel(name, corr, ts, dur, device=0):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": device, "tid": 9, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "device": device, "stream": 9}}


CUTE = "kernel_cutlass_kernel_mxfluxkernelscute_rowwise_gemmRowScaledFP8Gemm_object_at__CopyAtom_ThrID10"
NVJET = "nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN"


def _trace():
    """Two steps: per step the MX fprop (CuTe DSL's kernel, a driver launch, a bias), an FP8 dgrad
    (torch's _scaled_mm), a bf16 addmm inside aten::linear, a GEMM kernel launched outside any GEMM op,
    a packer kernel, and a GEMM kernel of another device."""
    ev = []
    for step, t0 in enumerate((0.0, 10_000.0)):
        c = 100 * step
        ev += [_op("mxflux::scaled_gemm", t0 + 10, 50, [[32768, 3072], [32768, 96], [9216, 3072], [9216, 96], [],
                                                           [9216], []]),
               _launch(c + 1, t0 + 40, driver=True), _kernel(CUTE, c + 1, t0 + 100, 1000),
               _op("aten::_scaled_mm", t0 + 200, 30, [[32768, 9216], [9216, 3072], [], [], [], [], [], []]),
               _launch(c + 2, t0 + 220), _kernel(NVJET, c + 2, t0 + 1200, 700),
               _op("aten::linear", t0 + 300, 80, [[4, 256, 3072], [64, 3072], [64]]),
               _op("aten::addmm", t0 + 310, 60, [[64], [1024, 3072], [3072, 64], [], []]),
               _launch(c + 3, t0 + 350), _kernel("nvjet_sm90_tst_64x64_bias_TNN", c + 3, t0 + 2000, 10),
               _launch(c + 4, t0 + 500), _kernel("sm90_xmma_gemm_orphan", c + 4, t0 + 2100, 5),
               _launch(c + 5, t0 + 600), _kernel("_pack_kernel", c + 5, t0 + 2200, 300),
               _kernel(NVJET, c + 6, t0 + 2600, 999, device=1)]  # another device's: not counted
    return {"traceEvents": ev}


def test_each_gemm_kernel_is_charged_to_the_innermost_gemm_op_around_its_launch():
    rows = gemm_shapes(_trace(), 2, device=0)
    by = {(r["m"], r["n"], r["k"]): r for r in rows}
    fprop = by[(32768, 9216, 3072)]
    assert fprop["ops"] == ["mxflux::scaled_gemm"] and fprop["bias"] and fprop["calls_per_step"] == 1
    assert fprop["ms_per_step"] == pytest.approx(1.0)
    assert fprop["tflops"] == pytest.approx(2 * 32768 * 9216 * 3072 / 1e9 / 1.0)
    assert fprop["kernels"] == ["kernel_cutlass_kernel_mxfluxkernelscute_rowwise_gemmRowScaledFP8Gemm"]
    dgrad = by[(32768, 3072, 9216)]
    assert dgrad["ops"] == ["aten::_scaled_mm"] and not dgrad["bias"] and dgrad["ms_per_step"] == pytest.approx(0.7)
    small = by[(1024, 64, 3072)]  # addmm inside linear: the inner op, its [K, N] operand
    assert small["ops"] == ["aten::addmm"] and small["bias"]
    orphan = by[(None, None, None)]
    assert orphan["ops"] == [NO_OP] and orphan["kernels"] == ["sm90_xmma_gemm_orphan"] and orphan["tflops"] is None
    assert len(rows) == 4  # the packer is no GEMM; device 1's kernel is not device 0's
    assert [r["ms_per_step"] for r in rows] == sorted((r["ms_per_step"] for r in rows), reverse=True)
    everywhere = gemm_shapes(_trace(), 2)
    assert sum(r["ms_per_step"] for r in everywhere) == pytest.approx(sum(r["ms_per_step"] for r in rows) + 0.999)


def test_a_launch_after_its_op_ended_is_not_charged_to_it():
    ev = [_op("aten::mm", 0, 10, [[8, 4], [4, 2]]), _launch(1, 20), _kernel(NVJET, 1, 30, 5)]
    (row,) = gemm_shapes({"traceEvents": ev}, 1)
    assert row["m"] is None and row["ops"] == [NO_OP]


@pytest.mark.parametrize("op, dims, want", [
    ("aten::mm", [[8, 4], [4, 2]], (8, 2, 4, False)),
    ("aten::addmm", [[2], [8, 4], [4, 2], [], []], (8, 2, 4, True)),
    ("aten::_scaled_mm", [[8, 4], [4, 2], [], [], [2], [], [], []], (8, 2, 4, True)),
    ("mxflux::scaled_gemm", [[8, 4], [8, 1], [2, 4], [2, 1], [], [], []], (8, 2, 4, False)),
    ("aten::mm", [[8, 4], [5, 2]], None),  # K disagrees: not read as a GEMM
    ("aten::bmm", [[3, 8, 4], [3, 4, 2]], None),
    ("aten::mm", None, None),  # shapes not recorded
])
def test_problem_reads_each_ops_operands(op, dims, want):
    assert problem(op, dims) == want


def test_the_profilers_recorded_dims_give_the_problems(tmp_path):
    """A real CPU profile: torch's mm, addmm and linear, the MX GEMM op and the packer op, exported as Chrome
    trace; every GEMM op found with the problem it ran, the packer with the tensor it packed."""
    from mxflux.ops.custom_ops import mx_operands_op, scaled_gemm_op
    from torch.profiler import ProfilerActivity, profile

    a, b, bias = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16)
    a8 = torch.zeros(64, 32, dtype=torch.float8_e4m3fn)
    b8 = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mm(a, b)
        torch.addmm(bias, a, b)
        scaled_gemm_op(a8, torch.ones(64, 1), b8, torch.ones(16, 1), "rowwise", bias, torch.bfloat16)
        mx_operands_op(torch.randn(64, 96, dtype=torch.bfloat16), None, torch.zeros(1, dtype=torch.int64), True, True,
                       "rowwise", True, "none", False)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    (ops,) = _ops_by_thread(events, GEMM_OPS).values()
    found = {(name, problem(name, dims)) for _, _, name, dims in ops}
    assert ("aten::mm", (64, 16, 32, False)) in found
    assert ("aten::addmm", (64, 16, 32, True)) in found
    assert ("mxflux::scaled_gemm", (64, 16, 32, True)) in found
    (packers,) = _ops_by_thread(events, PACKER_OPS).values()
    assert [(name, dims[0]) for _, _, name, dims in packers] == [("mxflux::mx_operands", [64, 96])]


def test_packer_kernels_are_charged_to_the_packer_call_by_the_tensor_it_packed():
    """Two packer calls per step on X [32768, 3072] (two passes each: two kernels a call) and one on dY
    [32768, 21504], one packer kernel launched by the optimizer step outside any packer op, a GEMM kernel (not
    a packer's): per step the time, the calls (op calls, not kernels) and the input's read rate."""
    ev = []
    for step, t0 in enumerate((0.0, 10_000.0)):
        c = 100 * step
        for call, t in enumerate((t0 + 10, t0 + 40)):  # the two calls on X, a kernel a pass each
            p1, p2, run = c + 10 + 2 * call, c + 11 + 2 * call, t0 + 100 + 400 * call
            ev += [_op("mxflux::mx_operands", t, 20, [[32768, 3072], [], [1], [], [], [], [], [], [], []]),
                   _launch(p1, t + 5), _kernel("_pack_kernel", p1, run, 150),
                   _launch(p2, t + 10), _kernel("_pack_kernel", p2, run + 200, 250)]
        ev += [_op("mxflux::mx_operands", t0 + 60, 20, [[32768, 21504], [], [1], [], [], [], [], [], [], []]),
               _launch(c + 3, t0 + 70), _kernel("_pack_kernel", c + 3, t0 + 1000, 2000),
               _op("Optimizer.step#ClippingAdamW.step", t0 + 90, 50, []),
               _launch(c + 4, t0 + 100), _kernel("_operands_fixup_kernel", c + 4, t0 + 3100, 50),
               _launch(c + 5, t0 + 110), _kernel(NVJET, c + 5, t0 + 3200, 700)]
    rows = packer_shapes({"traceEvents": ev}, 2)
    by = {(r["rows"], r["cols"]): r for r in rows}
    assert set(by) == {(32768, 21504), (32768, 3072), (None, None)}
    x = by[(32768, 3072)]
    assert (x["calls_per_step"], x["ms_per_step"], x["ops"]) == (2, pytest.approx(0.8), ["mxflux::mx_operands"])
    assert x["input_gb_per_s"] == pytest.approx(2 * 32768 * 3072 * 2 / (0.8 * 1e6))
    assert by[(None, None)]["kernels"] == ["_operands_fixup_kernel"] and by[(None, None)]["ops"] == [NO_OP]
    assert [r["rows"] for r in rows] == [32768, 32768, None]  # largest first: dY 2.0 ms, X 0.8, the fix-up
    assert PACKER_OPS.search("mxflux::mx_operands_inline") and not PACKER_OPS.search("mxflux::mx_erefs")


def test_the_table_lines_the_settings_up_by_problem():
    from rich.console import Console

    def result(label, rows, packers=()):
        return {"label": label, "step_ms": 10.0, "images_per_s_per_gpu": 1.0, "mfu": None, "ms_per_512": 1.0,
                "memory": {"max_allocated_gib": 1.0, "max_reserved_gib": None, "device_used_gib": None},
                "loss": 1.0, "model": "m", "device": "NVIDIA H100", "world_size": 1, "global_batch_size": 1,
                "micro_batch_size": 1, "image_tokens": 1, "text_tokens": 1, "compile": True, "steps": 1,
                "warmup_steps": 1, "breakdown": {"gemm_shapes": rows, "packer_shapes": list(packers),
                                                  "busy_ms_per_step": 9.0, "categories": {},
                                                  "wall_ms_per_step": 10.0}}

    row = {"m": 32768, "n": 9216, "k": 3072, "calls_per_step": 1, "ms_per_step": 1.0}
    console = Console(width=200, record=True)
    packer = {"rows": 32768, "cols": 3072, "calls_per_step": 2, "ms_per_step": 0.8}
    print_table([result("fp8", [row]), result("mxfp6", [{**row, "ms_per_step": 1.25},
                                                        {"m": None, "n": None, "k": None, "calls_per_step": 2,
                                                         "ms_per_step": 0.5}], [packer])], console=console)
    text = console.export_text()
    line = next(x for x in text.splitlines() if "32768 x 9216 x 3072" in x)
    assert "1.00 (1855)" in line and "1.25 (1484)" in line
    orphan = next(x for x in text.splitlines() if "no GEMM op found" in x)
    assert "–" in orphan and "0.50" in orphan
    packed = next(x for x in text.splitlines() if "32768 x 3072 " in x)
    assert "0.80 (503)" in packed and "–" in packed  # 2 calls x 32768 x 3072 x 2 B in 0.8 ms; FP8 packs none
