"""The harness's device-time split on a real CUDA profile: its busy time equals the union of the
device activities as the profiler itself lists them (the raw kineto events), every activity is
counted once (inductor's Triton kernels and memsets included), the categories sum to busy time,
and busy <= wall."""

import tempfile
import time
from pathlib import Path

import pytest
import torch

from mxflux.bench.device_time import activities_from_chrome_trace, device_breakdown, split_device_time
from mxflux.data import build_demo_dataset
from mxflux.train import load_recipe
from mxflux.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE_KINDS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _union_ns(spans) -> int:
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


@pytest.mark.parametrize("recipe", ["tiny-mxfp6", "tiny-bf16"])
def test_split_busy_time_equals_the_raw_trace_union(tmp_path, recipe):
    root = build_demo_dataset(tmp_path / "data", n_train=64, n_eval=16)
    cfg = load_recipe(recipe, [f"data.root={root}", f"train.out_dir={tmp_path}/run", "model.compile=true",
                               "batch.global_batch_size=16", "batch.micro_batch_size=16", "data.num_workers=0"])
    tr = Trainer(cfg, device="cuda")
    batches = tr.batches()
    pool = [[next(batches)] for _ in range(4)]
    for mbs in pool[:2]:
        tr.train_step(mbs).read()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for mbs in pool[2:]:
            tr.train_step(mbs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "t.json"))
        acts = activities_from_chrome_trace(Path(tmp) / "t.json", device=torch.cuda.current_device())

    raw = [e for e in prof.profiler.kineto_results.events()
           if e.device_type() == torch.autograd.DeviceType.CUDA and not e.is_user_annotation()]
    if hasattr(raw[0], "activity_type"):
        raw = [e for e in raw if e.activity_type() in DEVICE_KINDS]
    raw_union_us = _union_ns((e.start_ns(), e.end_ns()) for e in raw) / 1e3

    busy, per_cat = split_device_time(acts)
    assert len(acts) == len({(e.name(), e.start_ns(), e.end_ns(), e.device_resource_id()) for e in raw})
    assert busy == pytest.approx(raw_union_us, rel=1e-6, abs=0.01 * len(acts))  # trace timestamps: 1 ns steps
    assert sum(per_cat.values()) == pytest.approx(busy, rel=1e-9)
    assert any(a.name.startswith("triton_") for a in acts), "inductor's Triton kernels must be counted"
    if recipe == "tiny-mxfp6":
        assert per_cat["mx_quant"] > 0
    b = device_breakdown(acts, 2, wall_s=wall)  # raises if busy > wall
    assert 0 < b["busy_ms_per_step"] <= b["wall_ms_per_step"]
    print(f"{recipe}: busy {b['busy_ms_per_step']:.2f} of {b['wall_ms_per_step']:.2f} ms/step, "
          f"{b['activities_per_step']:.0f} activities/step", {c: round(v["ms_per_step"], 3)
                                                            for c, v in b["categories"].items()})
