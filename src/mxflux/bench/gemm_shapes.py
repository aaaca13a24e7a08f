"""A profiled step's GEMM and packer device time by problem shape: which GEMMs one recipe loses to another,
which packer calls cost what.

The device-time split (`mxflux.bench.device_time`) says how much of a step the GEMMs take, and its
kernel names say which kernels ran, but the MX GEMM runs one kernel for every shape, so two
recipes' GEMM totals cannot be compared GEMM by GEMM from it. Here each GEMM kernel of the
profiler's Chrome trace (recorded with `record_shapes=True`) is charged to the GEMM op that launched
it, and the op's operand shapes give the problem (M, N, K): the kernel event and the host launch
(`cudaLaunchKernel`, `cuLaunchKernelEx`, ...) share a correlation id, and the innermost GEMM op on
the launching thread whose span holds the launch is the caller. (CuTe DSL's kernels are launched
inside the `mxflux::scaled_gemm` op, cuBLAS's inside `aten::_scaled_mm` or `aten::mm`, also when
inductor's generated code calls them.)

The shapes mean the same in every recipe, so rows line up across settings: torchao's FP8 linears
and the MX linears both run fprop as (tokens, out, in), dgrad as (tokens, in, out) and wgrad as
(out, in, tokens); bf16's `mm` / `addmm` likewise. (A GEMM with a bias and one without at the same shape,
fc1's fprop and fc2's dgrad, are two rows where the op records the bias; the table sums them by shape.)

The MX quantization kernels are charged the same way to the packer op that launched them, by the shape of
the tensor it was given (`packer_shapes`).
"""

from __future__ import annotations

import bisect
import re

from .device_time import GEMM_OPS, kernel_category

__all__ = ["gemm_shapes", "gemm_tflops", "packer_gb_per_s", "packer_shapes", "problem"]

_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# Where each GEMM op's A and B are among its inputs, and whether B is [N, K] (the MX op's weight-like
# operand) or [K, N] (torch's); and where its bias is, if it takes one
# (2-D GEMMs only: matmul and linear may be batched, and call mm or addmm, which are charged instead)
_OPERANDS = {"mxflux::scaled_gemm": (0, 2, "nk", 5), "aten::_scaled_mm": (0, 1, "kn", 4),
             "aten::addmm": (1, 2, "kn", 0), "aten::mm": (0, 1, "kn", None)}
NO_OP = "(no op found)"
# The packer ops, whose first input is the tensor packed
PACKER_OPS = re.compile(r"^mxflux::mx_operands(_inline)?$")


def problem(op: str, dims: list) -> tuple[int, int, int, bool] | None:
    """(M, N, K, has bias) of GEMM op `op` from its recorded input dims, or None where the op is not
    a plain 2-D GEMM (batched, or the dims not recorded)."""
    where = _OPERANDS.get(op)
    if where is None or not dims:
        return None
    ia, ib, b_layout, ibias = where
    try:
        (m, k), b = dims[ia], dims[ib]
    except (IndexError, TypeError, ValueError):
        return None
    if len(b) != 2:
        return None
    n, kb = (b[0], b[1]) if b_layout == "nk" else (b[1], b[0])
    if kb != k:
        return None
    bias = ibias is not None and ibias < len(dims) and bool(dims[ibias])
    return int(m), int(n), int(k), bias


def _ops_by_thread(events: list[dict], ops: re.Pattern) -> dict:
    """Per host thread, its ops named by `ops` as sorted (start, end, name, dims) tuples."""
    by_tid: dict = {}
    for ev in events:
        if ev.get("cat") == "cpu_op" and ev.get("ph") == "X" and ops.search(ev.get("name", "")):
            start = float(ev["ts"])
            by_tid.setdefault((ev.get("pid"), ev.get("tid")), []).append(
                (start, start + float(ev.get("dur", 0.0)), ev["name"], (ev.get("args") or {}).get("Input Dims")))
    for these in by_tid.values():
        these.sort(key=lambda o: o[0])
    return by_tid


def _caller(ops: list, starts: list, t: float):
    """The innermost op of `ops` (sorted by start) whose span holds time `t`: of those that started
    by `t` and have not ended, the one that started last, as (name, dims, start)."""
    i = bisect.bisect_right(starts, t)
    while i > 0:
        i -= 1
        start, end, name, dims = ops[i]
        if end >= t:
            return name, dims, start
    return None


def _charged(trace: dict, device: int | None, category: str, ops: re.Pattern, problem_of) -> dict:
    """The `category` kernels of `trace` charged to the innermost op named by `ops` around their launch:
    {problem_of(op, dims) or (None, kernel name): {"problem", "ops", "kernels", "calls", "us"}}. `calls`
    counts op calls, not kernels (a packer call launches one kernel a pass); kernels launched outside any
    such op count one each."""
    events = trace.get("traceEvents", [])
    launches = {}
    for ev in events:
        if ev.get("cat") in _LAUNCH_CATS and "correlation" in (ev.get("args") or {}):
            launches[ev["args"]["correlation"]] = ((ev.get("pid"), ev.get("tid")), float(ev["ts"]))
    by_tid = _ops_by_thread(events, ops)
    starts = {tid: [o[0] for o in these] for tid, these in by_tid.items()}
    rows: dict = {}
    for ev in events:
        if ev.get("cat") != "kernel" or ev.get("ph") != "X" or kernel_category(ev.get("name", "")) != category:
            continue
        args = ev.get("args") or {}
        if device is not None and args.get("device", device) != device:
            continue
        launch = launches.get(args.get("correlation"))
        caller = _caller(by_tid[launch[0]], starts[launch[0]], launch[1]) if launch and launch[0] in by_tid else None
        problem = problem_of(*caller[:2]) if caller else None
        key = problem if problem is not None else (None, ev.get("name", "")[:80])
        row = rows.setdefault(key, {"problem": problem, "ops": set(), "kernels": set(), "launched_by": set(),
                                    "us": 0.0})
        row["ops"].add(caller[0] if caller else NO_OP)
        row["kernels"].add(_short_kernel_name(ev.get("name", "")))
        # the op call (its thread and start) that launched the kernel, or the kernel itself where none did
        row["launched_by"].add((launch[0], caller[2]) if caller else (None, ev.get("ts"), ev.get("name")))
        row["us"] += float(ev.get("dur", 0.0))
    for row in rows.values():
        row["calls"] = len(row.pop("launched_by"))
    return rows


def gemm_tflops(m: int, n: int, k: int, calls: float, ms: float) -> float:
    """TFLOP/s of `calls` GEMMs of M x N x K (2·M·N·K each) in `ms` milliseconds."""
    return 2 * m * n * k * calls / (ms * 1e9)


def packer_gb_per_s(rows: int, cols: int, calls: float, ms: float) -> float:
    """GB/s of bf16 input (2 B an element) consumed by `calls` packer calls on [rows, cols] in `ms` milliseconds."""
    return 2 * rows * cols * calls / (ms * 1e6)


def gemm_shapes(trace: dict, steps: int, *, device: int | None = None, top: int = 40) -> list[dict]:
    """The GEMM kernels' device time per step, by (M, N, K) (see the module docstring), largest first:
    each row the problem, the ops that ran it, calls and ms per step, and TFLOP/s (2·M·N·K per call).
    Kernels no GEMM op could be found for are one row per kernel name, M, N and K None."""
    rows = _charged(trace, device, "gemm", GEMM_OPS, problem)
    out = []
    for row in sorted(rows.values(), key=lambda r: -r["us"])[:top]:
        m, n, k, bias = row["problem"] if row["problem"] is not None else (None, None, None, False)
        ms, calls = row["us"] / 1e3 / steps, row["calls"] / steps
        out.append({"m": m, "n": n, "k": k, "bias": bias, "ops": sorted(row["ops"]),
                    "kernels": sorted(row["kernels"]), "calls_per_step": calls, "ms_per_step": ms,
                    "tflops": gemm_tflops(m, n, k, calls, ms) if m is not None and ms > 0 else None})
    return out


def _packed_tensor(op: str, dims: list) -> tuple[int, int] | None:
    """The [rows, columns] of the tensor a packer op was given (its first input), None where not recorded."""
    try:
        rows, cols = dims[0]
    except (IndexError, TypeError, ValueError):
        return None
    return int(rows), int(cols)


def packer_shapes(trace: dict, steps: int, *, device: int | None = None, top: int = 40) -> list[dict]:
    """The MX quantization kernels' device time per step, by the shape of the tensor each packer call was given
    (`mxflux::mx_operands`, or its inlined form), largest first: calls and ms per step, and the bf16 input's
    bytes over the time (GB/s: the rate at which the call consumed its input, whatever its passes moved).
    Kernels launched outside a packer op (the optimizer step's fix-ups, the saved operands' compaction) are
    one row per kernel name, rows and columns None."""
    rows = _charged(trace, device, "mx_quant", PACKER_OPS, _packed_tensor)
    out = []
    for row in sorted(rows.values(), key=lambda r: -r["us"])[:top]:
        r, c = row["problem"] if row["problem"] is not None else (None, None)
        ms, calls = row["us"] / 1e3 / steps, row["calls"] / steps
        out.append({"rows": r, "cols": c, "ops": sorted(row["ops"]), "kernels": sorted(row["kernels"]),
                    "calls_per_step": calls, "ms_per_step": ms,
                    "input_gb_per_s": packer_gb_per_s(r, c, calls, ms) if r is not None and ms > 0 else None})
    return out


def _short_kernel_name(name: str) -> str:
    """A kernel's name without the template arguments CuTe DSL and CUTLASS append (their names run to
    hundreds of characters): enough to tell the kernels apart."""
    return re.split(r"_object_at_|<", name, maxsplit=1)[0][:80]
