"""Where a profiled step's time went: every device activity counted exactly once.

The device side of a profile is a list of `Activity` intervals: every kernel (cuBLAS, cuDNN,
NCCL, our Triton packers, inductor's generated Triton kernels alike), every memcpy and every
memset. `split_device_time` turns them into

- busy time: the union of the intervals, so that activities overlapping on several streams
  (NCCL next to compute, a copy next to a kernel) count once; and
- a split of exactly that busy time into CATEGORIES: each stretch of time is shared equally among
  the categories active during it (two GEMMs on two streams are one category; a GEMM next to an
  all-gather gives each half). The categories therefore sum to busy time, with no "overlap"
  remainder and no double counting. The raw sum of each category's own durations is reported too.

The source of the activities is the profiler's Chrome trace (`activities_from_chrome_trace`): its
`kernel`, `gpu_memcpy` and `gpu_memset` events are the device's activities as CUPTI recorded them,
while `gpu_user_annotation` events (the device-side mirrors of `record_function` ranges and
compiled regions, which span whole regions) are not activities and are skipped. Matching device
events against host-op names is not used: inductor launches each generated Triton kernel inside a
host range of the same name, so such a filter silently drops every inductor kernel (torchao's
float8 casts, fused elementwise ops).

Categories, first matching rule wins (by activity kind, then by kernel name):
  memcpy_memset  every memcpy and memset activity
  communication  NCCL kernels
  attention      flash / fused-attention / SDPA kernels (cuDNN's contain "wgmma", hence before gemm)
  mx_quant       MX quantization: our packers and the 6-bit compaction of saved operands
                 (MX_QUANT_KERNELS) and, best effort, the amax and
                 cast kernels of FP8 recipes (FP8_CAST_KERNELS): torchao's float8 casts are
                 inductor-generated Triton kernels whose names list the fused aten ops, and an
                 amax reduction or a clamp (saturation to the FP8 range) among them marks a cast;
                 a cast fused into an unrelated elementwise kernel without either stays in "other"
  gemm           cuBLAS / cuBLASLt (gemm, nvjet, sm90_xmma), CUTLASS, inductor GEMM templates
  optimizer      the optimizer step (OPTIMIZER_KERNELS): our AdamW kernels (one also computes the MX
                 weights' e_ref, the pass 1 the packer then skips) and torch's
                 multi_tensor_apply kernels, which in a training step are the fused AdamW, the
                 gradient norm and clipping, the step counts and the weight EMA (FSDP2's copy-in
                 may use one too)
  other          everything else: elementwise, reductions, norms

On the CPU (no device activities) `split_host_time` splits the ops' self CPU time instead, each
op going to the category of the innermost enclosing op that has one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Activity", "CATEGORIES", "GEMM_OPS", "MX_QUANT_KERNELS", "FP8_CAST_KERNELS", "OPTIMIZER_KERNELS",
           "kernel_category", "category_of", "split_device_time", "activities_from_chrome_trace",
           "exposed_communication_us", "idle_gaps", "split_host_time", "host_top"]

CATEGORIES = ("gemm", "mx_quant", "attention", "communication", "optimizer", "other", "memcpy_memset")

# Our MX quantization kernels by their Triton function names (mxflux.kernels); the one place to
# rename them.
# (The fix-up pass of the weights' operands the optimizer step writes is packing; the step that
# writes them, `_adamw_operands_kernel`, is counted as the optimizer's.)
MX_QUANT_KERNELS = (r"_pack_kernel|_prologue_kernel|_dequant_kernel|_fp8_amax_kernel|_fp8_cast_kernel"
                    r"|_compact_kernel|_expand_kernel|_operands_fixup_kernel")
# The optimizer step's kernels (mxflux.train.adamw_cuda's, torch's foreach and fused optimizer ops).
OPTIMIZER_KERNELS = (r"_adamw_kernel|_adamw_erefs_kernel|_adamw_operands_kernel|multi_tensor_apply_kernel"
                     r"|FusedOptimizer|fused_adamw?_")
# Inductor-generated kernels of FP8 amax/cast work (see the module docstring: a name heuristic).
FP8_CAST_KERNELS = r"^triton_(poi|red|per)_\w*(amax|to_float8|clamp)"

_KERNEL_RULES = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("mx_quant", re.compile(MX_QUANT_KERNELS)),
    ("mx_quant", re.compile(FP8_CAST_KERNELS)),
    ("optimizer", re.compile(OPTIMIZER_KERNELS)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cublas|cutlass|triton_tem_", re.I)),
)

# Chrome-trace categories of device activities, and the kind each becomes.
_TRACE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


@dataclass(frozen=True)
class Activity:
    """One device activity: a kernel, memcpy or memset, [start, end) in microseconds."""

    name: str
    start: float
    end: float
    kind: str = "kernel"  # "kernel" | "memcpy" | "memset"
    stream: int | None = None
    device: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


def kernel_category(name: str) -> str:
    """A kernel's category by its name (see the module docstring)."""
    for category, rule in _KERNEL_RULES:
        if rule.search(name):
            return category
    return "other"


def category_of(act: Activity) -> str:
    return "memcpy_memset" if act.kind in ("memcpy", "memset") else kernel_category(act.name)


def activities_from_chrome_trace(trace: dict | str | Path, device: int | None = None) -> list[Activity]:
    """The device activities of a profiler Chrome trace (`prof.export_chrome_trace`), each once.

    `device`: keep only that device's activities (None: all). Identical duplicate records (same
    name, kind, device, stream and interval) are one activity.
    """
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    seen, out = set(), []
    for ev in trace.get("traceEvents", []):
        kind = _TRACE_KINDS.get(ev.get("cat"))
        if kind is None or ev.get("ph") != "X":
            continue
        args = ev.get("args") or {}
        if device is not None and args.get("device", device) != device:
            continue
        start = float(ev["ts"])
        act = Activity(ev.get("name", ""), start, start + float(ev.get("dur", 0.0)), kind, args.get("stream"),
                       args.get("device"))
        if act not in seen:
            seen.add(act)
            out.append(act)
    return out


def _merged(spans) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def split_device_time(acts: list[Activity]) -> tuple[float, dict[str, float]]:
    """(busy µs, µs per category) with the categories summing to busy (see the module docstring).

    One sweep over the sorted interval boundaries: between two consecutive boundaries the set of
    active categories is constant, and that stretch is shared equally among them.
    """
    points: list[tuple[float, int, str]] = []
    for a in acts:
        if a.end > a.start:
            cat = category_of(a)
            points.append((a.start, 1, cat))
            points.append((a.end, -1, cat))
    points.sort(key=lambda p: p[0])
    per_cat = dict.fromkeys(CATEGORIES, 0.0)
    active: dict[str, int] = {}
    busy, i, n = 0.0, 0, len(points)
    while i < n:
        t = points[i][0]
        while i < n and points[i][0] == t:  # every boundary at t before measuring the next stretch
            _, delta, cat = points[i]
            active[cat] = active.get(cat, 0) + delta
            if active[cat] == 0:
                del active[cat]
            i += 1
        if i < n and active:
            length = points[i][0] - t
            busy += length
            share = length / len(active)
            for cat in active:
                per_cat[cat] += share
    return busy, per_cat


def exposed_communication_us(acts: list[Activity]) -> float:
    """Microseconds in which communication kernels ran and nothing else did: the collective time
    that compute did not hide (the union of NCCL intervals minus its overlap with all others)."""
    comm, rest = [], []
    for a in acts:
        (comm if category_of(a) == "communication" else rest).append((a.start, a.end))
    comm, rest = _merged(comm), _merged(rest)
    overlap, j = 0.0, 0
    for a, b in comm:  # both lists sorted and disjoint: one sweep
        while j < len(rest) and rest[j][1] <= a:
            j += 1
        k = j
        while k < len(rest) and rest[k][0] < b:
            overlap += min(b, rest[k][1]) - max(a, rest[k][0])
            k += 1
    return sum(b - a for a, b in comm) - overlap


def idle_gaps(acts: list[Activity], top: int = 6) -> list[dict]:
    """The longest stretches with no device activity, with the activities either side of each
    (where a host-bound step waits: a sync, a slow launch, Python between compiled regions)."""
    gaps, end, last = [], None, None
    for a in sorted(acts, key=lambda a: a.start):
        if end is not None and a.start > end:
            gaps.append((a.start - end, last.name, a.name))
        if end is None or a.end > end:
            end, last = a.end, a
    gaps.sort(key=lambda g: -g[0])
    return [{"ms": g / 1e3, "after": x[:80], "before": y[:80]} for g, x, y in gaps[:top]]


def device_breakdown(acts: list[Activity], steps: int, *, wall_s: float | None = None, top: int = 12) -> dict:
    """The per-step device-time split of `steps` profiled steps (all fields per step, ms).

    `wall_s`: the profiled steps' wall time; busy time above it means the activities were not
    collected once each (or the clocks disagree), and raises.
    """
    busy, per_cat = split_device_time(acts)
    raw = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[tuple[str, str], float] = {}
    for a in acts:
        cat = category_of(a)
        raw[cat] += a.duration
        by_name[(a.name, cat)] = by_name.get((a.name, cat), 0.0) + a.duration
    out = {
        "source": "device activities (kernels, memcpy, memset) from the profiler trace",
        "steps": steps,
        "busy_ms_per_step": busy / 1e3 / steps,
        "categories": {c: {"ms_per_step": per_cat[c] / 1e3 / steps,
                           "fraction": per_cat[c] / busy if busy else 0.0,
                           "raw_ms_per_step": raw[c] / 1e3 / steps} for c in CATEGORIES},
        "activity_ms_per_step": sum(raw.values()) / 1e3 / steps,  # durations summed, overlaps twice
        "activities_per_step": len(acts) / steps,
        "exposed_communication_ms_per_step": exposed_communication_us(acts) / 1e3 / steps,
        "top": [{"name": n[:120], "category": c, "ms_per_step": t / 1e3 / steps}
                for (n, c), t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]],
        "idle_gaps": idle_gaps(acts),
    }
    if acts:  # the device's first-to-last span: busy + the bubbles between activities
        out["span_ms_per_step"] = (max(a.end for a in acts) - min(a.start for a in acts)) / 1e3 / steps
    if wall_s is not None:
        wall_ms = wall_s * 1e3 / steps
        out["wall_ms_per_step"] = wall_ms
        out["idle_ms_per_step"] = wall_ms - out["busy_ms_per_step"]
        # CUPTI's timestamps are mapped onto the host clock; allow that mapping a hair of slack.
        if out["busy_ms_per_step"] > wall_ms * 1.002 + 1e-3:
            raise RuntimeError(f"device busy {out['busy_ms_per_step']:.3f} ms/step exceeds the profiled wall time "
                               f"{wall_ms:.3f} ms/step: device activities were counted more than once")
    return out


# --- the CPU: ops' self time -----------------------------------------------------------------------

# The host ops that run GEMMs (torch's, and the MX GEMM op), by name
GEMM_OPS = re.compile(r"^(aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm|_scaled_grouped_mm|matmul|linear)"
                      r"|mxflux::scaled_gemm)$")
_OP_RULES = (
    ("mx_quant", re.compile(r"mxflux::(mx_operands|compact_operand|expand_operand)")),
    ("gemm", GEMM_OPS),
    ("attention", re.compile(r"attention|sdpa|flash", re.I)),
    ("optimizer", re.compile(r"^Optimizer\.(step|zero_grad)|^aten::_fused_adamw?_|^aten::_foreach_")),
    ("communication", re.compile(r"nccl|gloo|c10d::|all_gather|allgather|reduce_scatter|all_reduce|allreduce"
                                 r"|broadcast", re.I)),
)


def _host_op_category(event) -> str:
    """A host op's category: attention when it runs inside an attention op or autograd node (the
    CPU's explicit attention is matmuls and a softmax under one); otherwise the first op, walking
    outward from it, that matches an _OP_RULES rule."""
    attention = dict(_OP_RULES)["attention"]
    e = event
    while e is not None:
        if attention.search(e.name):
            return "attention"
        e = e.cpu_parent
    e = event
    while e is not None:
        for category, rule in _OP_RULES:
            if rule.search(e.name):
                return category
        e = e.cpu_parent
    return "other"


def split_host_time(events, steps: int, *, top: int = 12) -> dict:
    """The per-step split of the host ops' self CPU time (`prof.events()`) into CATEGORIES."""
    from torch.autograd import DeviceType

    us = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[tuple[str, str], float] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0:
            cat = _host_op_category(e)
            us[cat] += e.self_cpu_time_total
            by_name[(e.name, cat)] = by_name.get((e.name, cat), 0.0) + e.self_cpu_time_total
    total = sum(us.values())
    return {
        "source": "CPU op self time",
        "steps": steps,
        "busy_ms_per_step": total / 1e3 / steps,
        "categories": {c: {"ms_per_step": us[c] / 1e3 / steps, "fraction": us[c] / total if total else 0.0}
                       for c in CATEGORIES},
        "top": [{"name": n[:120], "category": c, "ms_per_step": t / 1e3 / steps}
                for (n, c), t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]],
    }


def host_top(events, top: int = 8) -> list[dict]:
    """Host ops by self CPU time (what the CPU did while the device may have waited)."""
    from torch.autograd import DeviceType

    by_name: dict[str, float] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.self_cpu_time_total
    return [{"name": n[:80], "ms": t / 1e3} for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]
