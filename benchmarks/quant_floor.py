"""What the MX packers cost against their floor, and what MXFP6 would reach at each packer speed.

    python3 benchmarks/quant_floor.py --kernels benchmarks/results/bench_kernels_2026-12-03.json \
        --layers benchmarks/results/bench_layers_2026-12-03.json \
        --step benchmarks/results/bench_step_proxy_mbs64_erefs_2026-12-02.json [--json out.json]

Reads committed GPU results; needs no GPU. Two tables:

Layers (bench_layers: forward + backward of one linear at M tokens, bf16 / MXFP6 row-wise /
torchao FP8; bench_kernels: the packer of X and of dY alone at the same M, the same kernels the
layer runs). "MXFP6 without its activation packers" is the layer's time less those two packer
calls; the weight's packer stays in it, as measured. From there, MXFP6 / bf16 with the
activation packers (a) as measured, (b) at copy bandwidth with the row granularity's 6 bytes per
element (two passes: the bf16 tensor read twice, one E4M3 byte written per orientation),
(c) at copy bandwidth with a one-pass granularity's 4 bytes, (d) free.

Step (`mxflux bench step` JSON with bf16, fp8 and mxfp6 settings of one call): the packers'
bytes per step from the model's shape (every MX linear: X [M, K] and dY [M, N] at 6 bytes per
element, the fp32 weight [N, K] at 6: pass 2 only, its row exponents come from the optimizer
step), their time at copy bandwidth, and the MXFP6 step with its measured quantization time
replaced by that floor, against bf16 and FP8 of the same call.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys

from mxflux.bench.report import is_bf16, is_fp8_tensorwise
from mxflux.model import flux_config

ROW_BYTES = 6  # two-pass row granularity per element: 2 + 2 read, 1 + 1 written
ONE_PASS_BYTES = 4  # granularity 32 or 1x128: 2 read, 1 + 1 written
WEIGHT_BYTES = 6  # fp32 weight, pass 2 only: 4 read, 1 + 1 written
_KERNEL_NAMES = {"single.linear1": "linear1", "single.linear2": "linear2", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}


def _load(path: str):
    with open(path) as f:
        return json.load(f)


def layer_rows(kernels: dict, layers: dict) -> list[dict]:
    """One row per linear of the layer benchmark, with the packer's standalone times at its M."""
    copy_bps = kernels["copy_GBps"] * 1e9
    rows = []
    for lin in layers["linear"]:
        name, m, k, n = _KERNEL_NAMES.get(lin["layer"], lin["layer"]), lin["M"], lin["K"], lin["N"]
        packs = {p["tensor"]: p["ms"] for p in kernels["pack"]
                 if p["linear"] == name and p["M"] == m and p["gran"] == "rowwise"}
        if set(packs) != {"X", "dY"}:
            raise ValueError(f"kernels: no row-granularity packer times of X and dY for {lin['layer']} "
                             f"at M={m} (found {sorted(packs)})")
        bf16, mx, fp8 = lin["ms_bf16"], lin["ms_mxfp6-rowwise"], lin["ms_fp8"]
        packers = packs["X"] + packs["dY"]
        rest = mx - packers
        elements = m * k + m * n

        def at_copy(bytes_per_element: int) -> float:
            return bytes_per_element * elements / copy_bps * 1e3

        rows.append(dict(
            layer=lin["layer"], M=m, K=k, N=n, bf16_ms=bf16, mxfp6_ms=mx, fp8_ms=fp8,
            packers_ms=packers, packers_pct_of_row_floor=100 * at_copy(ROW_BYTES) / packers,
            mxfp6_without_packers_ms=rest,
            vs_bf16_measured=bf16 / mx, vs_bf16_row_at_copy=bf16 / (rest + at_copy(ROW_BYTES)),
            vs_bf16_one_pass_at_copy=bf16 / (rest + at_copy(ONE_PASS_BYTES)),
            vs_bf16_packers_free=bf16 / rest, fp8_vs_bf16=bf16 / fp8))
    return rows


def mx_linears(result: dict) -> list[tuple[str, int, int, int]]:
    """(name, tokens per sample, fan_in, fan_out) of every linear the result's precision made MX."""
    c = flux_config(result["model"], **(result.get("model_overrides") or {}))
    d, mlp = c.hidden_size, c.mlp_hidden_dim
    img, txt = result["image_tokens"], result["text_tokens"]
    candidates = []
    for i in range(c.depth):
        for stream, tokens in (("img", img), ("txt", txt)):
            candidates += [(f"double_blocks.{i}.{stream}_attn.qkv", tokens, d, 3 * d),
                           (f"double_blocks.{i}.{stream}_attn.proj", tokens, d, d),
                           (f"double_blocks.{i}.{stream}_mlp.0", tokens, d, mlp),
                           (f"double_blocks.{i}.{stream}_mlp.2", tokens, mlp, d)]
    for i in range(c.depth_single_blocks):
        candidates += [(f"single_blocks.{i}.linear1", img + txt, d, 3 * d + mlp),
                       (f"single_blocks.{i}.linear2", img + txt, d + mlp, d)]
    pc = result["precision_config"]

    def chosen(name: str) -> bool:
        return (any(fnmatch.fnmatchcase(name, p) for p in pc["include"])
                and not any(fnmatch.fnmatchcase(name, p) for p in pc["exclude"]))

    return [lin for lin in candidates if chosen(lin[0])]


def packer_bytes_per_step(result: dict) -> int:
    """Bytes the row-granularity packers move in one training step of the result's MXFP6 setting."""
    mbs = result["micro_batch_size"] * result["accumulation_steps"]
    return sum(ROW_BYTES * mbs * tokens * (k + n) + WEIGHT_BYTES * k * n
               for _, tokens, k, n in mx_linears(result))


def step_row(results: list[dict], copy_gbps: float) -> dict:
    """The MXFP6 step of one `bench step` call with its quantization at the copy floor."""
    # the first setting that ran of each; FP8 is torchao's tensorwise recipe, as in the bench's table
    kinds = {"bf16": is_bf16, "fp8": is_fp8_tensorwise, "mxfp6": lambda r: r["precision"] == "mxfp6"}
    by_kind = {}
    for name, is_kind in kinds.items():
        first = next((r for r in results if not r.get("failed") and is_kind(r)), None)
        if first is not None:
            by_kind[name] = first
    missing = set(kinds) - set(by_kind)
    if missing:
        raise ValueError(f"step: the call has no {sorted(missing)} setting that ran (need bf16, fp8 tensorwise "
                         f"and mxfp6)")
    bf16, fp8, mx = by_kind["bf16"], by_kind["fp8"], by_kind["mxfp6"]
    if "breakdown" not in mx:
        raise ValueError(f"step: setting {mx['label']!r} has no device-time split (run with --profile-steps 1)")
    quant = mx["breakdown"]["categories"]["mx_quant"]["ms_per_step"]
    busy = mx["breakdown"]["busy_ms_per_step"]
    nbytes = packer_bytes_per_step(mx)
    floor = nbytes / (copy_gbps * 1e9) * 1e3
    at_floor = mx["step_ms"] - quant + floor
    return dict(
        label=mx["label"], micro_batch_size=mx["micro_batch_size"], bf16_ms=bf16["step_ms"],
        fp8_ms=fp8["step_ms"], mxfp6_ms=mx["step_ms"], quant_ms=quant, quant_pct_of_busy=100 * quant / busy,
        packer_gb=nbytes / 1e9, floor_ms=floor, floor_pct_of_busy=100 * floor / (busy - quant + floor),
        vs_bf16=bf16["step_ms"] / mx["step_ms"], vs_fp8=fp8["step_ms"] / mx["step_ms"],
        vs_bf16_at_floor=bf16["step_ms"] / at_floor, vs_fp8_at_floor=fp8["step_ms"] / at_floor)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", required=True, help="bench_kernels.py JSON (packer times, copy bandwidth)")
    ap.add_argument("--layers", help="bench_layers.py JSON")
    ap.add_argument("--step", nargs="*", default=[], help="`mxflux bench step` JSONs")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        return _report(args)
    except (ValueError, KeyError, OSError) as e:  # a results file that lacks what this needs
        sys.exit(f"quant_floor: {e}")


def _report(args) -> int:
    kernels = _load(args.kernels)
    out = {"copy_GBps": kernels["copy_GBps"], "layers": [], "steps": []}
    if args.layers:
        out["layers"] = layer_rows(kernels, _load(args.layers))
        print("layer (M)              bf16 ms  MXFP6 ms  packers ms (% of 6-B floor speed)  "
              "MXFP6/bf16: measured  row@copy  one-pass@copy  packers free | FP8/bf16")
        for r in out["layers"]:
            print(f"{r['layer']:15s} {r['M']:6d}  {r['bf16_ms']:7.3f}  {r['mxfp6_ms']:8.3f}  "
                  f"{r['packers_ms']:6.3f} ({r['packers_pct_of_row_floor']:4.1f} %)"
                  f"{r['vs_bf16_measured']:24.2f}x {r['vs_bf16_row_at_copy']:8.2f}x "
                  f"{r['vs_bf16_one_pass_at_copy']:13.2f}x {r['vs_bf16_packers_free']:13.2f}x | "
                  f"{r['fp8_vs_bf16']:.2f}x")
    for path in args.step:
        r = step_row(_load(path), kernels["copy_GBps"])
        out["steps"].append(dict(file=path, **r))
        print(f"{path}: MBS {r['micro_batch_size']}: MXFP6 {r['mxfp6_ms']:.1f} ms, quantization "
              f"{r['quant_ms']:.1f} ms ({r['quant_pct_of_busy']:.1f} % of busy); packers move "
              f"{r['packer_gb']:.1f} GB = {r['floor_ms']:.1f} ms at copy ({r['floor_pct_of_busy']:.1f} %); "
              f"vs bf16 {r['vs_bf16']:.3f}x -> {r['vs_bf16_at_floor']:.3f}x, vs FP8 {r['vs_fp8']:.3f}x -> "
              f"{r['vs_fp8_at_floor']:.3f}x at the floor")
    if args.json:
        from mxflux.bench.provenance import provenance
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
