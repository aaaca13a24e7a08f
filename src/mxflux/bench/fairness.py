"""Whether the settings of one `mxflux bench step` comparison may be divided by one another
(torch-free: the parent process of a comparison imports it).

A ratio between two settings means something only when they differ in what the comparison is
about and nothing else: both compiled alike, both with or without CUDA graphs, both with the same
optimizer and recompute policy, on one card in one call, each measured steadily on a host that was
not busy with other work. `comparison_warnings(results)` names every way a set of results falls
short of that; `mxflux bench step` prints them under its table and writes them into its JSON, and
the results generator (benchmarks/results_tables.py) refuses a claim that has any.
"""

from __future__ import annotations

__all__ = ["RUN_MODE_KEYS", "comparison_warnings", "spread"]

# The ways a setting may run that are not its precision (`mxflux.bench.step` writes them as
# result["run_mode"]); a setting named for one of them ("-graph", "-torch-adamw", ...) says so, and a
# comparison of settings that differ in one must say which.
RUN_MODE_KEYS = ("compile", "compile_mode", "cuda_graph", "optimizer", "activation_checkpointing")

# The spread of a setting's rounds (max/min - 1) above which a difference of that size is noise, and the
# host load (1-minute average per core, before the run) above which CPU timings are not steady.
BUSY_LOAD_PER_CORE = 0.5


def spread(result: dict) -> float | None:
    """The relative spread of a result's round step times (max / min - 1), None without rounds."""
    ms = [m for m in (result.get("rounds") or {}).get("step_ms") or [] if m]
    return max(ms) / min(ms) - 1 if len(ms) > 1 else None


def comparison_warnings(results: list[dict]) -> list[str]:
    """Every reason the ratios between these results (one comparison) could mislead; [] when none."""
    ok = [r for r in results if not r.get("failed") and not r.get("skipped")]
    warnings = []
    for key in RUN_MODE_KEYS:
        values = {r["label"]: (r.get("run_mode") or {}).get(key) for r in ok}
        if len(set(map(repr, values.values()))) > 1:
            listed = ", ".join(f"{label} {value}" for label, value in values.items())
            warnings.append(f"settings differ in {key} ({listed}): their ratios compare that as well as the precision")
    cards = {r.get("device") for r in ok}
    if len(cards) > 1:
        listed = ", ".join(sorted(map(str, cards)))
        warnings.append(f"settings ran on different cards ({listed}): no ratio between them")
    steps = [r["step_ms"] for r in ok if r.get("step_ms")]
    if len(steps) > 1:
        gap = max(steps) / min(steps) - 1
        spreads = [(r["label"], s) for r in ok if (s := spread(r)) is not None]
        noisy = [(label, s) for label, s in spreads if s > gap]
        if noisy:
            warnings.append("the rounds' spread (" + ", ".join(f"{label} {100 * s:.1f}%" for label, s in noisy)
                            + f") is larger than the largest difference between settings ({100 * gap:.1f}%)")
    for r in ok:
        prov = r.get("provenance") or r.get("child_provenance") or {}
        load, cores = prov.get("load_average"), prov.get("cpu_count")
        on_cpu = str(r.get("device", "")).startswith("cpu")
        if on_cpu and load and cores and load[0] / cores > BUSY_LOAD_PER_CORE:
            warnings.append(f"{r['label']}: the host was busy (load {load[0]:.1f} on {cores} cores when it started): "
                            "CPU timings on shared cores can move by 10x; rerun on idle cores")
        if on_cpu and r.get("steps", 0) < 10 and not r.get("rounds"):
            warnings.append(f"{r['label']}: {r.get('steps')} timed CPU steps in one round: use --steps 10 or more "
                            "and --rounds 3 before reading a ratio")
    return warnings
