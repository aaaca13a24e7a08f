"""Settings compared by `mxflux bench step`, each in its own process (torch-free to import).

A setting is a named list of recipe overrides applied to the benchmarked recipe before the
user's own. The default comparison is bf16, torchao float8 with tensorwise and with rowwise
scaling, and MXFP6: the FP8 that people train with on Hopper is the baseline every MXFP6 number is
held against.

Why one process per setting: a torchao rowwise run right after a tensorwise run in the same
process died with an illegal memory access, while the same rowwise run alone was fine. Within one
process a setting leaves behind state that the next one inherits: dynamo's code caches and
guards, inductor's in-memory compiled graphs and autotuning results, Triton's loaded kernels,
CUDA-graph pools, library-global configuration, and the caching allocator's segments (with their
addresses). `torch._dynamo.reset()` clears only dynamo's own caches, not the rest. And an illegal
memory access is sticky: it poisons the CUDA context, so every later setting in that process fails
too. A fresh process per setting gives each its own CUDA context, compile caches and allocator:
the settings cannot influence each other's numbers or memory peaks, and a crash costs only its own
column. The crash itself (reproduced by benchmarks/probe_fp8_in_process.py, H200, torch 2.11) is in
cuDNN's attention backward: `_scaled_dot_product_cudnn_attention_backward` of the second compiled
model fails its cuDNN graph execution and then faults; with the cuDNN SDPA backend turned off the
same two settings run one after the other in one process. The likely mechanism (not proven) is
PyTorch's process-wide cache of cuDNN attention graphs, which the first model's run fills.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["SETTINGS", "SETTING_ENV", "DEFAULT_SETTINGS", "PROXY_RECIPE", "PROXY_OVERRIDES", "parse_settings",
           "run_in_subprocesses", "combine_rounds"]

SETTINGS: dict[str, tuple[str, ...]] = {
    "recipe": (),  # the recipe's own precision
    "bf16": ("precision={}",),
    "fp8-tensorwise": ("precision={fp8: hybrid}", "precision.fp8_scaling=tensorwise"),
    "fp8-rowwise": ("precision={fp8: hybrid}", "precision.fp8_scaling=rowwise"),
    # torchao's tensor-wise recipe with its forward GEMM's sums promoted to fp32 too (no fast accumulation):
    # FP8 at the accumulation MXFP6's GEMM contract has
    "fp8-tensorwise-exact": ("precision={fp8: hybrid}", "precision.fp8_scaling=tensorwise",
                             "precision.fp8_fast_accumulation=false"),
    "mxfp6": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off"}',),
    # mxfp6 with the saved col operands in 6 bits (bit-identical numerics, 25/32 the saved bytes)
    "mxfp6-6bit": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off", '
                   'saved_operands: e2m3}',),
    # mxfp6 keeping no Wᵀ: backward packs it again from the parameter (bit-identical numerics)
    "mxfp6-repack": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off", '
                     'repack_weights: true}',),
    # mxfp6-repack with the packer calls on activations recomputed in backward instead of keeping
    # their Xᵀ (`model.activation_checkpointing: mx_packers`; bit-identical numerics; needs
    # model.compile: true, which --proxy sets): the proxy's peak below torchao FP8's.
    "mxfp6-repack-sac": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off", '
                         'repack_weights: true}', "model.activation_checkpointing=mx_packers"),
    # keeping only GEMM and attention outputs (`model.activation_checkpointing: elementwise`: the
    # norms, RoPE, GELU, gates and packers recomputed in backward), in each precision
    "mxfp6-repack-elementwise": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off", '
                                 'repack_weights: true}', "model.activation_checkpointing=elementwise"),
    # mxfp6 keeping no Xᵀ of the inputs backward rebuilds from what it keeps anyway (proj, fc2, linear2;
    # `model.activation_checkpointing: mx_inputs`, bit-identical numerics, needs model.compile: true),
    # and the same keeping no Wᵀ either (nor the weights' operands between steps)
    "mxfp6-inputs": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off"}',
                     "model.activation_checkpointing=mx_inputs"),
    "mxfp6-repack-inputs": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off", '
                            'repack_weights: true}', "model.activation_checkpointing=mx_inputs"),
    # mx_inputs with the weights packed in each forward (their e_ref still from the optimizer step) instead of
    # their two operands kept between steps: the row operand then lives only through its GEMM (0.85 GiB less at
    # the proxy's peak, by count), for one pass over the weights per step
    "mxfp6-pack-weights-inputs": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off", '
                                  'weight_operands_in_optimizer: false}', "model.activation_checkpointing=mx_inputs"),
    # mx_inputs with the step keeping the weights' row operands alone (freed after forward by default) and
    # backward packing Wᵀ: nothing of the weights' operands alive in backward (precision.kept_weight_cols)
    "mxfp6-cols-packed-inputs": ('precision={fp6: e2m3, mx_gemm: rowwise, hadamard: true, fused_mlp: "off", '
                                 'kept_weight_cols: false}', "model.activation_checkpointing=mx_inputs"),
    "bf16-elementwise": ("precision={}", "model.activation_checkpointing=elementwise"),
    "fp8-tensorwise-elementwise": ("precision={fp8: hybrid}", "precision.fp8_scaling=tensorwise",
                                   "model.activation_checkpointing=elementwise"),
}
# Each of the three precisions with the trainer's step captured as one CUDA graph and replayed
# (`train.cuda_graph`; one process on a CUDA device): beside the eager settings, what the host's
# per-op cost costs the trainer.
SETTINGS.update({f"{name}-graph": (*SETTINGS[name], "train.cuda_graph=true")
                 for name in ("bf16", "fp8-tensorwise", "mxfp6")})
# A/B of the weights' e_ref computed by the optimizer step: with it off the packer runs its pass 1
# over every fp32 MX weight at each forward (precision.weight_exponents_in_optimizer)
SETTINGS["mxfp6-graph-pass1"] = (*SETTINGS["mxfp6-graph"], "precision.weight_exponents_in_optimizer=false")
# A/B of the weights' operands written by the optimizer step: with it off each forward packs the
# weights (pass 2 on the step's e_ref; precision.weight_operands_in_optimizer)
SETTINGS["mxfp6-graph-pack-weights"] = (*SETTINGS["mxfp6-graph"], "precision.weight_operands_in_optimizer=false")
# A/B of the weights' row operands freed from the last forward to the optimizer step
# (precision.release_weight_rows, on by default; the same bits): mxfp6 with them kept
SETTINGS["mxfp6-rows-kept"] = (*SETTINGS["mxfp6"], "precision.release_weight_rows=false")
# the step keeping the weights' row operands alone, Wᵀ packed in each backward from the weight
# (precision.kept_weight_cols: false; the same bits): 1 byte per MX weight element less at the peak
SETTINGS["mxfp6-cols-packed"] = (*SETTINGS["mxfp6"], "precision.kept_weight_cols=false")
# X's and dY's columns against the e_ref of their last step (one read of each: the one-pass packer)
SETTINGS["mxfp6-held"] = (*SETTINGS["mxfp6"], "precision.held_col_erefs=true")
# ... with no headroom above the last step's maxima (more columns fixed up, none placed higher than its own)
SETTINGS["mxfp6-held0"] = (*SETTINGS["mxfp6-held"], "precision.held_headroom_x=0", "precision.held_headroom_dy=0")
# the 1x128 fold (`mx_gemm: blockwise`: one-pass packers, the weights packed in each forward) on cuBLAS's 1x128 GEMM,
# and on the CuTe kernel with its block scales at the promotion (MXFLUX_CUTE_BLOCKWISE=on; opt-in, a trial)
SETTINGS["mxfp6-blockwise"] = ('precision={fp6: e2m3, mx_gemm: blockwise, hadamard: true, fused_mlp: "off"}',)
SETTINGS["mxfp6-blockwise-cute"] = SETTINGS["mxfp6-blockwise"]
# Each precision with every compiled block replayed as CUDA graphs of its own (torch.compile's
# cudagraph trees, `model.compile_mode: reduce-overhead`): the host's per-op cost without capturing
# the whole step, so with gradient accumulation too.
SETTINGS.update({f"{name}-block-graphs": (*SETTINGS[name], "model.compile_mode=reduce-overhead")
                 for name in ("bf16", "fp8-tensorwise", "mxfp6")})
# Each precision with torch's fused AdamW for every parameter (`optim.implementation: fused`): the loop
# a user writes around our layers, where no optimizer step keeps the MX weights' operands and every
# forward packs its weights; with and without the per-block CUDA graphs.
SETTINGS.update({f"{name}-torch-adamw": (*SETTINGS[name], "optim.implementation=fused")
                 for name in ("bf16", "fp8-tensorwise", "mxfp6", "bf16-block-graphs", "fp8-tensorwise-block-graphs",
                              "mxfp6-block-graphs")})
# A/B of the packers launched from inductor's code (opt-in): mxfp6 with every packer call it can inline
# so (MXFLUX_INLINE_PACK=1 in the setting's process; bit-identical numerics), with and without block graphs.
SETTINGS["mxfp6-inline-pack"] = SETTINGS["mxfp6"]
SETTINGS["mxfp6-inline-pack-block-graphs"] = SETTINGS["mxfp6-block-graphs"]
# mxfp6 as it runs without CuTe DSL: every MX GEMM on cuBLAS (MXFLUX_CUTE_GEMM=off; the same bits)
SETTINGS["mxfp6-cublas"] = SETTINGS["mxfp6"]
# A/B of the deferred scales: mxfp6 with every compiled MX GEMM on cuBLAS's row-scaled kernels
# (MXFLUX_DEFER_SCALES=none; bit-identical numerics, `kernels.gemm.deferred_scale_gemm`)
SETTINGS["mxfp6-rowscaled"] = SETTINGS["mxfp6"]
# trials of the GEMMs with a bias unit-scaled too (`kernels.gemm.defers_scales`): their sums in fp32
# (the same bits), or rounded before the bias is added (torchao's FP8 linears' order, not our contract)
SETTINGS["mxfp6-defer-bias"] = SETTINGS["mxfp6"]
SETTINGS["mxfp6-bias-rounded"] = SETTINGS["mxfp6"]
# the CuTe-DSL row-scaled GEMM (`kernels.gemm_cute`, needs nvidia-cutlass-dsl) at every size, with fast
# accumulation (outside the GEMM contract): for the GEMMs with a bias (fprop: fast accumulation where
# torchao's FP8 recipe has it too), those and the fp32-out ones (wgrad), or all
SETTINGS["mxfp6-cute-bias"] = SETTINGS["mxfp6"]
SETTINGS["mxfp6-cute-bias-fp32"] = SETTINGS["mxfp6"]
SETTINGS["mxfp6-cute-all"] = SETTINGS["mxfp6"]
# the same with its partial sums promoted to fp32 every k-tile (the GEMM contract's accumulation, the default's)
SETTINGS["mxfp6-cute-bias-promoted"] = SETTINGS["mxfp6"]
SETTINGS["mxfp6-cute-all-promoted"] = SETTINGS["mxfp6"]
# the CuTe GEMM's promotion in 2, 3 or 4 parts of N (MXFLUX_CUTE_ACCUMULATE=fp32h, fp32p3, fp32p4: the same sums,
# a part's adds under the later parts' WGMMAs)
SETTINGS["mxfp6-cute-halves"] = SETTINGS["mxfp6"]
SETTINGS["mxfp6-cute-parts3"] = SETTINGS["mxfp6"]
SETTINGS["mxfp6-cute-parts4"] = SETTINGS["mxfp6"]
# quack-kernels' schedules for the GEMMs the CuTe GEMM takes (`kernels.gemm_quack`, MXFLUX_CUTE_KERNEL; the same
# contract, fp32 sums): ping-pong 64x192 and cooperative 128x192 tiles
SETTINGS["mxfp6-quack-pingpong"] = SETTINGS["mxfp6"]
SETTINGS["mxfp6-quack-cooperative"] = SETTINGS["mxfp6"]
# Environment variables a setting's process runs with (the switches read at import, not recipe fields); the
# deferred-scales settings are cuBLAS's alone
_CUBLAS = {"MXFLUX_CUTE_GEMM": "off"}
SETTING_ENV = {"mxfp6-inline-pack": {"MXFLUX_INLINE_PACK": "1"},
               "mxfp6-inline-pack-block-graphs": {"MXFLUX_INLINE_PACK": "1"},
               "mxfp6-cublas": _CUBLAS,
               "mxfp6-rowscaled": {**_CUBLAS, "MXFLUX_DEFER_SCALES": "none"},
               "mxfp6-defer-bias": {**_CUBLAS, "MXFLUX_DEFER_SCALES": "bias"},
               "mxfp6-bias-rounded": {**_CUBLAS, "MXFLUX_DEFER_SCALES": "bias-rounded"},
               "mxfp6-cute-bias": {"MXFLUX_CUTE_GEMM": "bias", "MXFLUX_CUTE_ACCUMULATE": "fast"},
               "mxfp6-cute-bias-fp32": {"MXFLUX_CUTE_GEMM": "bias,fp32", "MXFLUX_CUTE_ACCUMULATE": "fast"},
               "mxfp6-cute-all": {"MXFLUX_CUTE_GEMM": "all", "MXFLUX_CUTE_ACCUMULATE": "fast"},
               "mxfp6-cute-bias-promoted": {"MXFLUX_CUTE_GEMM": "bias", "MXFLUX_CUTE_ACCUMULATE": "fp32"},
               "mxfp6-cute-all-promoted": {"MXFLUX_CUTE_GEMM": "all", "MXFLUX_CUTE_ACCUMULATE": "fp32"},
               "mxfp6-cute-halves": {"MXFLUX_CUTE_ACCUMULATE": "fp32h"},
               "mxfp6-cute-parts3": {"MXFLUX_CUTE_ACCUMULATE": "fp32p3"},
               "mxfp6-cute-parts4": {"MXFLUX_CUTE_ACCUMULATE": "fp32p4"},
               "mxfp6-quack-pingpong": {"MXFLUX_CUTE_KERNEL": "quack-pingpong"},
               "mxfp6-quack-cooperative": {"MXFLUX_CUTE_KERNEL": "quack-cooperative"},
               "mxfp6-blockwise-cute": {"MXFLUX_CUTE_BLOCKWISE": "on"}}
DEFAULT_SETTINGS = ("bf16", "fp8-tensorwise", "fp8-rowwise", "mxfp6")

# The throughput proxy of flux-12b (`--proxy`): its width (3072) and attention heads, 2 double + 4
# single blocks, compiled, on synthetic 256 image + 256 text tokens per sample (the bench's
# defaults); small enough to compile in a minute or two, wide enough that the GEMMs are 12B-shaped.
PROXY_RECIPE = "flux12b-mxfp6-dev"
PROXY_OVERRIDES = ("model.overrides={depth: 2, depth_single_blocks: 4}", "model.compile=true")


def parse_settings(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    if bad or not names:
        raise ValueError(f"--settings: expected a comma-separated list of {sorted(SETTINGS)}, got {text!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"--settings: {text!r} names a setting twice")
    return names


def run_in_subprocesses(settings: list[str], child_argv, *, timeout_s: float | None = None,
                        tail_lines: int = 25) -> tuple[list[dict], dict]:
    """Run `python -m mxflux.cli bench step <child_argv(setting, json_path, memory_path)>` once per
    setting, one after the other, streaming each child's output with its setting as prefix.

    Returns (results in setting order, {setting: memory report}); a setting whose process failed,
    timed out or wrote no result is {"label": setting, "failed": "<why and its last lines>"}, one
    that this machine cannot run (`mxflux.bench.availability`) {"label": setting, "skipped": "<why>"}.
    """
    results, memory = [], {}
    with tempfile.TemporaryDirectory(prefix="mxflux-bench-settings-") as tmp:
        for name in settings:
            json_path, mem_path = Path(tmp) / f"{name}.json", Path(tmp) / f"{name}.memory.json"
            cmd = [sys.executable, "-m", "mxflux.cli", "bench", "step", *child_argv(name, json_path, mem_path)]
            print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
            tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **SETTING_ENV.get(name, {})})
            timed_out = threading.Event()

            def kill(proc=proc, timed_out=timed_out):  # a hung child (no output) is stopped too
                timed_out.set()
                proc.kill()

            watchdog = threading.Timer(timeout_s, kill) if timeout_s else None
            if watchdog:
                watchdog.start()
            assert proc.stdout is not None
            for line in proc.stdout:  # the child's own output, as it comes
                print(f"[{name}] {line}", end="", flush=True)
                tail.append(line.rstrip("\n"))
            rc = proc.wait()
            if watchdog:
                watchdog.cancel()
            if rc == 0 and json_path.is_file():
                (result,) = json.loads(json_path.read_text())
                result["label"] = name
                result["wall_s_including_compile"] = time.monotonic() - t0
                results.append(result)
                if mem_path.is_file():
                    memory.update(json.loads(mem_path.read_text()))
            else:
                why = f"timed out after {timeout_s:.0f} s" if timed_out.is_set() else f"exit status {rc}"
                print(f"=== {name} failed: {why}", flush=True)
                results.append({"label": name, "failed": why + "\n    " + "\n    ".join(tail)})
    return results, memory


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One result per setting from several rounds of the same settings (`--rounds`).

    Each setting's result is its median round by step time (the lower median for an even
    count), whole (its split, memory and bare loops are that round's), with `rounds` added:
    `step_ms` and `images_per_s_per_gpu` of every round in order, None where that round's process
    failed. The report divides step times within a round, where the settings ran back to back,
    so that the card's drift between rounds does not enter a ratio. A setting that failed in
    every round is failed, with each round's reason; a skipped one is skipped.
    """
    if not rounds or any(len(r) != len(rounds[0]) for r in rounds):
        raise ValueError(f"rounds: expected the same settings in every round, got {[len(r) for r in rounds]}")
    combined = []
    for per_round in zip(*rounds):
        labels = {r["label"] for r in per_round}
        if len(labels) != 1:
            raise ValueError(f"rounds: one setting per position in every round, got {sorted(labels)}")
        if any(r.get("skipped") for r in per_round):  # the machine cannot run it: the same in every round
            combined.append(per_round[0])
            continue
        ok = [r for r in per_round if not r.get("failed")]
        if not ok:
            combined.append({"label": per_round[0]["label"], "failed": "; ".join(
                f"round {i + 1}: {r['failed']}" for i, r in enumerate(per_round))})
            continue
        median = sorted(ok, key=lambda r: r["step_ms"])[(len(ok) - 1) // 2]
        combined.append({**median, "rounds": {
            key: [None if r.get("failed") else r[key] for r in per_round]
            for key in ("step_ms", "images_per_s_per_gpu")}})
    return combined
