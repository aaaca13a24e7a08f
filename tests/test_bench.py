"""`mxflux bench step` on the CPU: the harness runs a recipe's trainer and reports consistent numbers."""

from __future__ import annotations

import json

import pytest
import torch

from mxflux.bench.step import CATEGORIES, _peak_tflops
from mxflux.cli import main
from mxflux.model import flux_config
from mxflux.model.configs import flops_per_sample


def test_bench_step_reports_consistent_throughput_mfu_memory_and_breakdown(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "step", "--recipe", "tiny-bf16", "--synthetic", "--steps", "2", "--warmup", "1",
               "--profile-steps", "1", "--image-size", "128", "--text-len", "64", "--peak-tflops", "2",
               "--data-dir", str(tmp_path / "data"), "--json", str(out),
               "batch.global_batch_size=8", "batch.micro_batch_size=4"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "images/s/GPU" in printed and "MFU" in printed and "gemm" in printed
    r = json.loads(out.read_text())

    assert (r["model"], r["precision"], r["world_size"], r["steps"], r["warmup_steps"]) == ("flux-tiny", "bf16", 1, 2, 1)
    assert (r["global_batch_size"], r["micro_batch_size"], r["accumulation_steps"]) == (8, 4, 2)
    assert (r["image_tokens"], r["text_tokens"], r["synthetic_data"]) == (64, 64, True)  # 128 px → 16² latents → 8² tokens
    assert r["images_per_s"] > 0 and r["images_per_s_per_gpu"] == r["images_per_s"]
    assert r["images_per_s"] == pytest.approx(8 * 1e3 / r["step_ms"], rel=1e-9)
    assert r["ms_per_512"] == pytest.approx(512 / r["images_per_s"] * 1e3, rel=1e-9)
    assert len(r["step_ms_each"]) == 2 and sum(r["step_ms_each"]) / 2 == pytest.approx(r["step_ms"], rel=1e-9)
    assert r["flops_per_sample"] == flops_per_sample(flux_config("flux-tiny"), 64, 64)
    assert r["peak_tflops"] == 2.0
    assert r["mfu"] == pytest.approx(r["images_per_s_per_gpu"] * r["flops_per_sample"] / 2e12, rel=1e-9)
    assert 0 < r["mfu"] < 1
    assert r["peak_memory_gib"] > 0 and r["peak_memory_source"] == "cpu ru_maxrss"
    assert 0 < r["loss"] < 10

    b = r["breakdown"]
    assert b["steps"] == 1 and set(b["categories"]) == set(CATEGORIES)
    assert sum(c["fraction"] for c in b["categories"].values()) == pytest.approx(1.0)
    assert sum(c["ms_per_step"] for c in b["categories"].values()) == pytest.approx(b["total_ms_per_step"])
    assert b["categories"]["gemm"]["fraction"] > 0.1 and b["categories"]["attention"]["ms_per_step"] > 0
    assert b["categories"]["mx_pack"]["ms_per_step"] == 0  # bf16: no MX packers


def test_peak_rate_is_null_on_cpu_unless_given():
    assert _peak_tflops(torch.device("cpu"), None) is None
    assert _peak_tflops(torch.device("cpu"), 123.0) == 123.0


def test_bench_requires_a_recipe_and_checks_overrides(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step"])
    assert exc.value.code == 2 and "--recipe" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--recipe", "tiny-bf16", "batch.micro_batchsize=4"])
    assert exc.value.code == 2 and "micro_batchsize" in capsys.readouterr().err


def test_device_busy_time_skips_annotations_and_merges_overlaps():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from mxflux.bench.step import _busy_us, _device_activities

    def ev(i, name, start, end, device=DeviceType.CUDA, **kw):
        return FunctionEvent(i, name, 0, start, end, device_type=device, **kw)

    events = [
        ev(0, "aten::mm", 0, 50, DeviceType.CPU),
        ev(1, "Torch-Compiled Region", 0, 1000, DeviceType.CPU),
        ev(2, "Torch-Compiled Region", 0, 1000),  # the annotation's GPU mirror: spans the region
        ev(3, "ampere_gemm", 10, 40),
        ev(4, "ncclKernel_AllGather", 30, 60),  # overlaps the GEMM on another stream
        ev(5, "Memcpy HtoD", 100, 110),
        ev(6, "my_range", 0, 500, is_user_annotation=True),
    ]
    assert _busy_us(_device_activities(events)) == 60.0  # [10, 60] + [100, 110]


def test_cuda_breakdown_counts_each_kernel_once_by_its_name():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from mxflux.bench.step import device_time_breakdown

    def ev(i, name, start, end, device=DeviceType.CUDA, **kw):
        return FunctionEvent(i, name, 0, start, end, device_type=device, **kw)

    gemm = ev(3, "nvjet_sm90_qqtst_128x128_bias_TNT", 10, 40)
    events = [
        ev(0, "aten::_scaled_mm", 0, 50, DeviceType.CPU),
        ev(1, "Torch-Compiled Region", 0, 1000, DeviceType.CPU),
        ev(2, "Torch-Compiled Region", 0, 1000),
        gemm, gemm,  # the same device event listed twice is one kernel
        ev(4, "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", 40, 60),  # attention, not gemm
        ev(5, "_pack_kernel", 60, 70), ev(6, "_dequant_kernel", 70, 75),
        ev(7, "ncclDevKernel_AllGather_RING_LL", 50, 90),  # overlaps on another stream
        ev(8, "void at::native::multi_tensor_apply_kernel<...>", 100, 130),
        ev(9, "my_range", 0, 500, is_user_annotation=True),
    ]
    b = device_time_breakdown(events, 2)
    got = {c: v["ms_per_step"] * 2e3 for c, v in b["categories"].items()}
    assert got == pytest.approx({"gemm": 30, "attention": 20, "mx_pack": 15, "communication": 40, "other": 30})
    assert b["total_ms_per_step"] * 2e3 == pytest.approx(135)
    assert b["busy_ms_per_step"] * 2e3 == pytest.approx(110)  # [10, 90] + [100, 130]
    assert b["exposed_communication_ms_per_step"] * 2e3 == pytest.approx(15)  # NCCL [50, 90] alone in [75, 90]
    assert b["span_ms_per_step"] * 2e3 == pytest.approx(120) and b["activities_per_step"] == 3.0  # 6 kernels, the duplicate once
    assert b["top"][0]["category"] == "communication"
    assert b["idle_gaps"][0] == {"ms": pytest.approx(0.01), "after": "ncclDevKernel_AllGather_RING_LL",
                                 "before": "void at::native::multi_tensor_apply_kernel<...>"}
    assert [h["name"] for h in b["host_top"]] == ["Torch-Compiled Region", "aten::_scaled_mm"]


def test_exposed_communication_is_nccl_time_no_other_kernel_overlaps():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from mxflux.bench.step import _device_activities, _exposed_comm_us

    def ev(i, name, start, end):
        return FunctionEvent(i, name, 0, start, end, device_type=DeviceType.CUDA)

    events = [ev(0, "ncclKernel_AllGather", 0, 10), ev(1, "ncclKernel_ReduceScatter", 20, 30),
              ev(2, "ncclKernel_AllGather", 35, 50), ev(3, "nvjet_gemm", 5, 25), ev(4, "triton_poi", 28, 40)]
    # comm 35 us; overlapped [5,10] [20,25] [28,30] [35,40] = 17 us
    assert _exposed_comm_us(_device_activities(events)) == pytest.approx(18)
    assert _exposed_comm_us(_device_activities(events[3:])) == 0
