"""The harness's accounting on synthetic inputs: the device-time split (every activity once, the
categories summing to busy time) against a brute-force reference, and the allocator-trace replay
behind `--memory` against a hand-built trace."""

from __future__ import annotations

import random

import pytest

from mxflux.bench.device_time import (CATEGORIES, Activity, activities_from_chrome_trace, category_of,
                                      device_breakdown, exposed_communication_us, kernel_category,
                                      split_device_time)
from mxflux.bench.memory import NO_FRAME, alive_at_peak, group_blocks

NAMES = {  # one real-looking kernel name per category, the kind it must land in
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "gemm",
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1": "gemm",
    "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x2x1_0_tnn_align8": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "_pack_kernel": "mx_quant",
    "_prologue_kernel": "mx_quant",
    "_dequant_kernel": "mx_quant",
    "_compact_kernel": "mx_quant",
    "_expand_kernel": "mx_quant",
    "triton_red_fused_abs_amax_0": "mx_quant",
    "triton_poi_fused__to_copy_clamp_mul_reciprocal_1": "mx_quant",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(Flash_fwd_params)":
        "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "triton_poi_fused_add_mul_silu_2": "other",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_3": "other",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)"
    "::FusedOptimizerTensorListMetadata<4>, ...>": "optimizer",
    "_adamw_kernel": "optimizer",
    "_adamw_erefs_kernel": "optimizer",  # the step that also computes the MX weights' e_ref
    "_adamw_operands_kernel": "optimizer",  # the step that also writes the MX weights' operands
    "_operands_fixup_kernel": "mx_quant",  # their fix-up: packing
    "triton_poi_fused_add_mul_sqrt_div_5": "other",
}


def test_kernel_names_land_in_their_category():
    assert {n: kernel_category(n) for n in NAMES} == NAMES
    assert category_of(Activity("Memset (Device)", 0, 1, "memset")) == "memcpy_memset"
    assert category_of(Activity("Memcpy DtoD (Device -> Device)", 0, 1, "memcpy")) == "memcpy_memset"


def _brute_force(acts: list[Activity], horizon: int) -> tuple[float, dict[str, float]]:
    """Unit ticks [t, t+1) of integer-aligned activities: a tick is busy when any activity covers
    it, and is shared equally among the categories of the activities covering it."""
    busy, per = 0.0, dict.fromkeys(CATEGORIES, 0.0)
    for t in range(horizon):
        cats = {category_of(a) for a in acts if a.start <= t < a.end}
        if cats:
            busy += 1
            for c in cats:
                per[c] += 1 / len(cats)
    return busy, per


def _random_activities(rng: random.Random, n: int, horizon: int) -> list[Activity]:
    names = list(NAMES)
    acts = []
    for _ in range(n):
        start = rng.randrange(horizon)
        end = min(horizon, start + rng.choice([0, 1, 2, 5, 13, 40]))  # zero-length ones too
        kind = rng.choice(["kernel"] * 6 + ["memcpy", "memset"])
        acts.append(Activity(rng.choice(names) if kind == "kernel" else kind.title(), start, end, kind,
                             stream=rng.choice([7, 13, 21])))
    # nested: a short kernel inside a long one of another category, and of the same category
    acts += [Activity("nvjet_big_gemm", 10, 90), Activity("_pack_kernel", 20, 30),
             Activity("nvjet_small_gemm", 40, 50, stream=13)]
    return acts


@pytest.mark.parametrize("trial", range(20))
def test_split_matches_brute_force_and_sums_to_busy(trial):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    horizon = 200
    acts = _random_activities(rng, rng.randrange(1, 60), horizon)
    busy, per = split_device_time(acts)
    want_busy, want = _brute_force(acts, horizon)
    assert busy == pytest.approx(want_busy, abs=1e-9), f"seed {seed}"
    assert per == pytest.approx(want, abs=1e-9), f"seed {seed}"
    assert sum(per.values()) == pytest.approx(busy, abs=1e-9)


def test_split_of_hand_made_overlaps():
    acts = [
        Activity("nvjet_gemm", 0, 100),                       # [0, 100) gemm
        Activity("nvjet_gemm_stream2", 20, 40, stream=2),     # nested, same category: no change
        Activity("ncclDevKernel_AllGather", 50, 150, stream=3),  # overlaps: [50, 100) shared gemm/comm
        Activity("Memset (Device)", 160, 170, "memset"),      # alone
        Activity("Memcpy HtoD (Pageable -> Device)", 165, 175, "memcpy"),  # same category as the memset
        Activity("_pack_kernel", 200, 200),                   # zero length: nothing
    ]
    busy, per = split_device_time(acts)
    assert busy == 165  # [0, 150) and [160, 175)
    assert per == {"gemm": 75, "communication": 75, "memcpy_memset": 15, "mx_quant": 0, "attention": 0, "optimizer": 0,
                   "other": 0}
    assert exposed_communication_us(acts) == 50


def test_breakdown_per_step_fields_and_the_busy_le_wall_check():
    acts = [Activity("nvjet_gemm", 0, 3000), Activity("triton_poi_fused_add_0", 3000, 4000),
            Activity("triton_poi_fused_add_0", 5000, 6000)]
    b = device_breakdown(acts, steps=2, wall_s=0.008)
    assert b["busy_ms_per_step"] == pytest.approx(2.5) and b["wall_ms_per_step"] == pytest.approx(4.0)
    assert b["idle_ms_per_step"] == pytest.approx(1.5)
    assert b["categories"]["gemm"]["ms_per_step"] == pytest.approx(1.5)
    assert b["categories"]["other"]["raw_ms_per_step"] == pytest.approx(1.0)
    assert sum(c["fraction"] for c in b["categories"].values()) == pytest.approx(1.0)
    assert b["span_ms_per_step"] == pytest.approx(3.0) and b["activities_per_step"] == 1.5
    assert b["idle_gaps"] == [{"ms": 1.0, "after": "triton_poi_fused_add_0", "before": "triton_poi_fused_add_0"}]
    assert b["top"][0] == {"name": "nvjet_gemm", "category": "gemm", "ms_per_step": 1.5}
    with pytest.raises(RuntimeError, match="exceeds the profiled wall time"):
        device_breakdown(acts, steps=2, wall_s=0.004)


def test_chrome_trace_gives_each_device_activity_once_and_skips_annotations():
    def x(cat, name, ts, dur, device=0, stream=7):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": device, "stream": stream}}

    trace = {"traceEvents": [
        x("cpu_op", "aten::mm", 0, 50),
        x("user_annotation", "Torch-Compiled Region", 0, 1000),
        x("gpu_user_annotation", "Torch-Compiled Region", 0, 1000),   # spans the region: not an activity
        x("cuda_runtime", "cudaLaunchKernel", 1, 2),
        x("cpu_op", "triton_poi_fused_add_0", 3, 4),                  # inductor's host range of the same name
        x("kernel", "triton_poi_fused_add_0", 10, 5),                 # ... and its kernel: kept
        x("kernel", "nvjet_gemm", 20, 30), x("kernel", "nvjet_gemm", 20, 30),  # listed twice: once
        x("gpu_memset", "Memset (Device)", 60, 2),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 70, 3),
        x("kernel", "nvjet_gemm", 20, 30, device=1),                  # another device
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 10},
    ]}
    acts = activities_from_chrome_trace(trace, device=0)
    assert [(a.name, a.kind, a.start, a.end) for a in acts] == [
        ("triton_poi_fused_add_0", "kernel", 10, 15), ("nvjet_gemm", "kernel", 20, 50),
        ("Memset (Device)", "memset", 60, 62), ("Memcpy DtoH (Device -> Pinned)", "memcpy", 70, 73)]
    assert len(activities_from_chrome_trace(trace)) == 5
    assert split_device_time(acts)[0] == 40


def _frames(*names):
    return [{"filename": f, "line": i + 1, "name": n} for i, (f, n) in enumerate(names)]


def test_allocator_replay_finds_what_is_alive_at_the_peak():
    # before: a parameter (0x100, 1000 B) and an optimizer state block (0x1000, 500 B), plus an inactive block
    before = {"segments": [{"device": 0, "address": 0x100, "blocks": [
        {"size": 1000, "state": "active_allocated"}, {"size": 300, "state": "inactive"}]},
        {"device": 0, "address": 0x1000, "blocks": [{"size": 500, "state": "active_allocated"}]}],
        "device_traces": [[{"action": "alloc", "addr": 0x9, "size": 1}]]}  # recorded before `before`: ignored
    act = _frames(("/tmp/torchinductor_u/ab/cab.py", "call"), ("/x/torch/_dynamo/eval_frame.py", "_fn"),
                  ("/w/src/mxflux/model/flux.py", "forward"))
    trace = [
        {"action": "free_requested", "addr": 0x1000, "size": 500},
        {"action": "free_completed", "addr": 0x1000, "size": 500},               # a pre-existing block freed
        {"action": "alloc", "addr": 0x5000, "size": 4000, "frames": act},        # an activation
        {"action": "alloc", "addr": 0x9000, "size": 2000, "frames": []},         # autograd engine
        {"action": "alloc", "addr": 0xA000, "size": 100, "frames": act},         # peak: 1000 + 4000 + 2000 + 100
        {"action": "free_requested", "addr": 0x5000, "size": 4000},
        {"action": "free_completed", "addr": 0x5000, "size": 4000},
        {"action": "alloc", "addr": 0x5000, "size": 3000, "frames": []},        # same address, a new block
    ]
    after = {"segments": [], "device_traces": [before["device_traces"][0] + trace]}
    r = alive_at_peak(before, after, 0)
    assert (r["start_bytes"], r["peak_bytes"], r["end_bytes"]) == (1500, 7100, 6100)
    got = {b["addr"]: (b["size"], b["preexisting"], b["alive_at_end"]) for b in r["blocks"]}
    assert got == {0x100: (1000, True, True), 0x5000: (4000, False, False), 0x9000: (2000, False, True),
                   0xA000: (100, False, True)}
    groups = group_blocks(r["blocks"], {0x100: "parameters", 0x5000: "gradients"})
    label = "call (ab/cab.py:1) <- forward (mxflux/model/flux.py:3)"
    # 0x5000 at the peak is the freed activation, not the later block at its address
    assert groups == [{"holder": label, "bytes": 4100, "blocks": 2}, {"holder": NO_FRAME, "bytes": 2000, "blocks": 1},
                      {"holder": "parameters", "bytes": 1000, "blocks": 1}]


def test_the_breakdown_names_the_weights_kept_operands_while_they_are_allocated():
    """Blocks alive before the step are named by address: the parameters, gradients, optimizer state, and
    the weights' operands the optimizer step keeps, row and col; a released row operand has no address."""
    from types import SimpleNamespace

    import torch

    from mxflux.bench.memory import _known_tensors

    model = torch.nn.Linear(64, 32, bias=False)
    f8 = torch.float8_e4m3fn
    operands = (torch.empty(32, 64, dtype=f8), torch.empty(32, 1), torch.empty(64, 32, dtype=f8), torch.empty(64, 1))
    kept = SimpleNamespace(operands=operands)
    optimizer = SimpleNamespace(state={}, weight_state=SimpleNamespace(kept={model.weight: kept}))
    known = _known_tensors(model, optimizer)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert known[ptr(model.weight)] == "parameters"
    assert known[ptr(operands[0])] == "weights' row operands (kept by the optimizer step)"
    assert known[ptr(operands[2])] == "weights' col operands (kept by the optimizer step)"
    operands[0].untyped_storage().resize_(0)  # released between forward and the step
    assert "weights' row operands (kept by the optimizer step)" not in _known_tensors(model, optimizer).values()


def test_host_ops_inside_attention_are_attention():
    """On the CPU the eager attention is matmuls and a softmax inside one autograd node: its ops
    count as attention, not as GEMMs; elsewhere the op's own name decides first."""
    from types import SimpleNamespace as Event

    from mxflux.bench.device_time import _host_op_category

    fwd = Event(name="_ExplicitAttention", cpu_parent=Event(name="aten::linear", cpu_parent=None))
    bwd = Event(name="autograd::engine::evaluate_function: _ExplicitAttentionBackward", cpu_parent=None)
    mlp = Event(name="_MXLinear", cpu_parent=None)
    assert _host_op_category(Event(name="aten::bmm", cpu_parent=fwd)) == "attention"
    assert _host_op_category(Event(name="aten::_softmax", cpu_parent=fwd)) == "attention"
    assert _host_op_category(Event(name="aten::bmm", cpu_parent=bwd)) == "attention"
    assert _host_op_category(Event(name="aten::mm", cpu_parent=mlp)) == "gemm"
    assert _host_op_category(Event(name="mxflux::mx_operands", cpu_parent=mlp)) == "mx_quant"
    assert _host_op_category(Event(name="aten::add", cpu_parent=mlp)) == "other"
    step = Event(name="Optimizer.step#ClippingAdamW.step", cpu_parent=None)
    assert _host_op_category(Event(name="aten::_fused_adamw_", cpu_parent=step)) == "optimizer"
    assert _host_op_category(Event(name="aten::_foreach_norm", cpu_parent=None)) == "optimizer"
    assert _host_op_category(Event(name="aten::stack", cpu_parent=step)) == "optimizer"
