"""The side-by-side table of `mxflux bench step` results, and their JSON (torch-free: the
parent process of a multi-setting comparison never initialises CUDA)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .fairness import comparison_warnings
from .gemm_shapes import gemm_tflops, packer_gb_per_s

__all__ = ["print_table", "write_json", "skipped_line", "per_device_unit", "CATEGORY_ORDER", "is_bf16",
           "is_fp8_tensorwise"]

# The device-time categories in table order (mxflux.bench.device_time.CATEGORIES; repeated here so
# that this module stays torch-free).
CATEGORY_ORDER = ("gemm", "mx_quant", "attention", "communication", "optimizer", "other", "memcpy_memset")


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _get(r: dict, *keys):
    for k in keys:
        if not isinstance(r, dict):
            return None
        r = r.get(k)
    return r


def per_device_unit(results: list[dict]) -> str:
    """What "per device" is in these results: GPU, or CPU where every one ran on the CPU (the JSON
    key stays `images_per_s_per_gpu` for either, so that saved results and scripts keep reading)."""
    ran = [r for r in results if r.get("device")]
    return "CPU" if ran and all(r["device"].startswith("cpu") for r in ran) else "GPU"


def skipped_line(results: list[dict]) -> str:
    """The skipped settings in one line, grouped by their reason: "a, b: why; c: why"."""
    by_reason: dict[str, list[str]] = {}
    for r in results:
        if r.get("skipped"):
            by_reason.setdefault(r["skipped"], []).append(r["label"])
    return "; ".join(f"{', '.join(labels)}: {why}" for why, labels in by_reason.items())


def is_bf16(r: dict) -> bool:
    return r.get("precision") == "bf16"


def is_fp8_tensorwise(r: dict) -> bool:
    """torchao's FP8 tensor-wise recipe as torchao ships it (fast accumulation in the forward GEMM; results
    from before that was a field have it), the baseline every claim is held against."""
    return (r.get("precision") == "fp8" and _get(r, "precision_config", "fp8_scaling") == "tensorwise"
            and _get(r, "precision_config", "fp8_fast_accumulation") is not False)


# The baselines every MXFP6 number is held against: bf16 and torchao FP8 tensorwise, whichever
# setting ran them (bf16, bf16-graph, ...: the first of each in the table).
BASELINES = (is_bf16, is_fp8_tensorwise)


def _ratio_rows(ok: list[dict]) -> list:
    """"vs <baseline>" rows (throughput ratio of each column to the baseline's); with rounds also
    "vs <baseline>, per round": the ratios of step times within each round (settings of one round
    run back to back, so the card's drift between rounds cancels), as mean (min–max)."""
    rows = []
    for is_base in BASELINES:
        base = next((r for r in ok if is_base(r)), None)
        if base is None:
            continue
        b = base["images_per_s_per_gpu"]
        rows.append((f"vs {base['label']}", lambda r, b=b: f"{r['images_per_s_per_gpu'] / b:.3f}x"))
        if base.get("rounds"):
            def per_round(r, base=base):
                ratios = [bm / m for bm, m in zip(base["rounds"]["step_ms"], _get(r, "rounds", "step_ms") or [])
                          if bm and m]
                if not ratios:
                    return "–"
                return f"{sum(ratios) / len(ratios):.3f}x ({min(ratios):.3f}–{max(ratios):.3f})"
            rows.append((f"vs {base['label']}, per round", per_round))
    return rows


def _rounds_cell(r: dict) -> str:
    ms = [m for m in _get(r, "rounds", "step_ms") or [] if m]
    if not ms:
        return "–"
    return f"{min(ms):.1f}–{max(ms):.1f} ({len(ms)} of {len(r['rounds']['step_ms'])})"


def _split_rows(results: list[dict], which: str, title: str, *, idle_of_profiled: bool = False) -> list:
    """Rows of the device-time split of the trainer (`which` = "breakdown") or of a bare loop
    (`which` = its result's key: "bare_loop", "bare_loop_graph"). `idle_of_profiled`: idle against
    the profiled step's wall instead of the timed one's (a replayed graph's kernels run slower under
    the profiler: against the timed step the busy time would exceed it)."""
    def bd(r):
        return r.get("breakdown") if which == "breakdown" else _get(r, which, "breakdown")

    if not any(bd(r) for r in results if not r.get("failed")):
        return []

    def wall_ms(r):
        if idle_of_profiled:
            return bd(r)["wall_ms_per_step"]
        return r["step_ms"] if which == "breakdown" else _get(r, which, "step_ms")

    rows = [(f"{title}: device busy ms / step", lambda r: _fmt(_get(bd(r), "busy_ms_per_step"), ".1f")),
            ("  profiled wall ms / step", lambda r: _fmt(_get(bd(r), "wall_ms_per_step"), ".1f")),
            # device profiles only: a CPU "busy" is the ops' self time summed over threads
            ("  idle % of profiled step" if idle_of_profiled else "  idle % of timed step",
             lambda r: "–" if _get(bd(r), "idle_ms_per_step") is None
             else f"{100 * (1 - bd(r)['busy_ms_per_step'] / wall_ms(r)):.1f}%")]
    for cat in CATEGORY_ORDER:
        # "–" also for a category a result predates (results written before "optimizer" existed)
        rows.append((f"  {cat}", lambda r, c=cat: "–" if not bd(r) or c not in bd(r)["categories"] else
                     f"{bd(r)['categories'][c]['ms_per_step']:.1f} ({100 * bd(r)['categories'][c]['fraction']:.0f}%)"))
    rows.append(("  exposed comm. ms", lambda r: _fmt(_get(bd(r), "exposed_communication_ms_per_step"), ".1f")))
    return rows


def print_table(results: list[dict], *, console=None) -> None:
    """One column per result: throughput, ratios vs bf16 and vs FP8 tensorwise (where those ran),
    MFU, memory, the bare loop and the device-time splits. Failed settings show their error."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(160, Console().width))
    skipped = skipped_line(results)
    results = [r for r in results if not r.get("skipped")]
    ok = [r for r in results if not r.get("failed")]
    unit = per_device_unit(ok)
    rounds = max((len(r["rounds"]["step_ms"]) for r in ok if r.get("rounds")), default=0)
    if ok:
        r0 = ok[0]
        console.print(f"{r0['model']} · {r0['device']} x{r0['world_size']} · global batch {r0['global_batch_size']} "
                      f"(micro {r0['micro_batch_size']}) · {r0['image_tokens']}+{r0['text_tokens']} tokens · "
                      f"compile {r0['compile']} · {r0['steps']} timed steps after {r0['warmup_steps']} warm-up"
                      + (f" · {rounds} rounds, each setting's median round shown" if rounds else ""),
                      style="bold")
    table = Table()
    table.add_column("metric")
    for r in results:
        table.add_column(r["label"], justify="right")
    gib = "{:.2f}"
    rows = [
        ("ms / step", lambda r: _fmt(r["step_ms"], ".1f")),
        *([("ms / step, rounds: min–max", _rounds_cell)] if rounds else []),
        (f"images/s/{unit}", lambda r: _fmt(r["images_per_s_per_gpu"], ".1f")),
        *(_ratio_rows(ok) if len(results) > 1 else []),
        ("MFU", lambda r: "–" if r["mfu"] is None else f"{100 * r['mfu']:.1f}% of {r['peak_tflops']:.0f}"),
        ("ms per 512 images", lambda r: _fmt(r["ms_per_512"], ".0f")),
        ("peak allocated GiB", lambda r: gib.format(r["memory"]["max_allocated_gib"])),
        ("peak reserved GiB", lambda r: _fmt(r["memory"]["max_reserved_gib"], ".2f")),
        ("device used GiB", lambda r: _fmt(r["memory"]["device_used_gib"], ".2f")),
        ("last loss", lambda r: _fmt(r["loss"], ".4f")),
        # the warm-up steps' wall time: compilation is in it
        ("warm-up s (compiles)", lambda r: _fmt(r.get("warmup_s"), ".1f")),
    ]
    if any(r.get("weight_operands_kept") for r in ok):  # the optimizer step writes the MX weights' operands
        rows.append(("weight operands kept / fix-ups", lambda r: "–" if r.get("weight_operands_kept") is None
                     else f"{r['weight_operands_kept']} / {r['weight_operand_fixups']}"))
    if any(r.get("bare_loop") for r in ok):
        rows += [("bare loop ms / step", lambda r: _fmt(_get(r, "bare_loop", "step_ms"), ".1f")),
                 ("trainer / bare loop", lambda r: _fmt(r.get("trainer_over_bare_loop"), ".3f")),
                 ("bare peak allocated GiB", lambda r: _fmt(_get(r, "bare_loop", "memory", "max_allocated_gib"), ".2f"))]
    if any(r.get("bare_loop_graph") for r in ok):
        rows += [("captured bare loop ms / step", lambda r: _fmt(_get(r, "bare_loop_graph", "step_ms"), ".1f")),
                 ("trainer / captured bare loop", lambda r: _fmt(r.get("trainer_over_bare_loop_graph"), ".3f")),
                 # the graph's activations sit in its private pool, allocated at capture (before the
                 # timed steps' peak counters were reset): only the reserved peak counts them
                 ("captured peak reserved GiB",
                  lambda r: _fmt(_get(r, "bare_loop_graph", "memory", "max_reserved_gib"), ".2f"))]
    split = (_split_rows(results, "breakdown", "trainer") + _split_rows(results, "bare_loop", "bare loop")
             + _split_rows(results, "bare_loop_graph", "captured bare loop", idle_of_profiled=True))
    for i, (name, fn) in enumerate(rows + split):
        if i == len(rows) and split:
            table.add_section()
        table.add_row(name, *("failed" if r.get("failed") and i == 0 else "–" if r.get("failed") else fn(r)
                              for r in results))
    console.print(table)
    notes = [f"MFU = images/s/{unit} x FLOP/sample / peak dense bf16; device used = total - free (mem_get_info)"]
    if any(r.get("breakdown") for r in ok):
        notes.append("device split: the union of kernels, memcpy and memset over the profiled steps (excluded "
                     "from the timing), shared equally among the categories active at once, so they sum to busy")
    if any(r.get("synthetic_data") for r in ok):
        notes.append("data: synthetic MLPerf-shaped shards")
    console.print("; ".join(notes), style="dim")
    if skipped:
        console.print(f"skipped {skipped}", style="yellow")
    for r in results:
        if r.get("failed"):
            console.print(f"{r['label']} failed: {r['failed']}", style="red")
    if any(_get(r, "breakdown", "gemm_shapes") for r in ok):
        _print_gemm_shapes(ok, console)
    if any(_get(r, "breakdown", "packer_shapes") for r in ok):
        _print_packer_shapes(ok, console)
    if len(ok) > 1:
        for warning in comparison_warnings(ok):
            console.print(f"warning: {warning}", style="bold yellow")
        if not rounds:
            console.print("one round: no spread measured (--rounds 3 measures it)", style="dim")


def _print_by_problem(results: list[dict], console, field: str, dims: tuple[str, ...], title: str, rate,
                      unmatched: str, top: int = 24) -> None:
    """One table of the trainer's `breakdown[field]` rows (`mxflux.bench.gemm_shapes`) by their problem (the
    `dims` fields), one column per setting: ms per step and, in brackets, `rate(problem, ms, calls)`; the rows
    of kernels no op was found for summed in one line."""
    from rich.table import Table

    cells: dict = {}
    for i, r in enumerate(results):
        for row in _get(r, "breakdown", field) or []:
            key = tuple(row[d] for d in dims) if row[dims[0]] is not None else None
            ms, calls = cells.setdefault(key, {}).get(i, (0.0, 0.0))
            cells[key][i] = (ms + row["ms_per_step"], calls + row["calls_per_step"])
    keys = sorted((k for k in cells if k is not None), key=lambda k: -max(ms for ms, _ in cells[k].values()))[:top]
    table = Table(title=title)
    table.add_column(" x ".join(d.upper() if len(d) == 1 else d for d in dims))
    for r in results:
        table.add_column(r["label"], justify="right")

    def cell(key, i):
        if i not in cells.get(key, {}):
            return "–"
        ms, calls = cells[key][i]
        return f"{ms:.2f} ({rate(key, ms, calls):.0f})" if key is not None and ms > 0 else f"{ms:.2f}"

    for key in keys:
        table.add_row(" x ".join(map(str, key)), *(cell(key, i) for i in range(len(results))))
    if None in cells:
        table.add_row(unmatched, *(cell(None, i) for i in range(len(results))))
    console.print(table)


def _print_gemm_shapes(results: list[dict], console) -> None:
    """The trainer's GEMM device time by problem M x N x K: ms per step (TFLOP/s)."""
    _print_by_problem(results, console, "gemm_shapes", ("m", "n", "k"),
                      "trainer GEMMs by problem: device ms per step (TFLOP/s)",
                      lambda k, ms, calls: gemm_tflops(*k, calls, ms), "no GEMM op found")


def _print_packer_shapes(results: list[dict], console) -> None:
    """The trainer's MX packer device time by the tensor packed: ms per step (GB/s of its bf16 input)."""
    _print_by_problem(results, console, "packer_shapes", ("rows", "cols"),
                      "trainer MX packers by tensor packed: device ms per step (GB/s of bf16 input)",
                      lambda k, ms, calls: packer_gb_per_s(*k, calls, ms), "outside a packer op")


def write_json(path: str | os.PathLike, result) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
