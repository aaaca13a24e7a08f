"""Training-step throughput: the one harness behind every throughput number we publish.

`bench_step(cfg)` builds the `Trainer` of a recipe exactly as `mxflux train` does (FSDP2/DDP
under torchrun), runs `warmup` optimizer steps, then times `steps` optimizer steps with one
device synchronisation at the end (a training loop that reads nothing back runs ahead of the
device; a sync per step would add one pipeline drain per step), and optionally profiles
`profile_steps` more for the device-time split (`mxflux.bench.device_time`). With
`bare_loop=True` it then times the bare loop of the same recipe (`mxflux.bench.bare_loop`: same
model, precision, compile, optimizer; random on-device inputs) the same way, so that the
trainer's own cost per step is their difference (the bare loop runs after the trainer in the
same process, the trainer freed first; its memory figures are for reference, the trainer's are
the measurement). Warm-up and profiled steps are not timed. It reports:

- images/s (global) and images/s per device (`images_per_s_per_gpu`, also on the CPU) = global
  images/s / world size;
- ms per 512 images = 512 / global images/s (one MLPerf flux1 global batch on this job);
- MFU = images/s/GPU x training FLOPs per sample / the device's peak dense bf16 rate, with the
  FLOPs from `mxflux.model.configs.flops_per_sample` for the model and token counts of the data
  (flux-12b at 256 image + 256 text tokens: 20.4 TFLOP); the peak is 989 TFLOP/s on H100/H200,
  `peak_tflops` elsewhere, and MFU is null without one (CPU);
- memory over the timed steps (the largest over ranks): CUDA's max allocated (tensors), max
  reserved (the caching allocator's segments: fragmentation and CUDA-graph pools too) and the
  device's used memory (`mem_get_info`: everything on the device, CUDA contexts included); on
  the CPU the process's peak resident set size (ru_maxrss, whole process lifetime);
- with profiling, the device-time split: busy time (the union of all kernels, memcpys and
  memsets) divided exactly among gemm / mx_quant / attention / communication / other /
  memcpy_memset, next to the profiled steps' wall time (busy <= wall is checked), and the GEMMs'
  and packers' device time by problem shape (`mxflux.bench.gemm_shapes`). On the CPU, the split of the host
  ops' self time;
- with `memory_path`, one more step recorded for `mxflux.bench.memory` (what is alive at the
  peak, by allocating frame; what autograd saved, by dtype and module).

The batches of the first (at most) two steps are read before anything is timed and reused, so
data loading is not in the timing; the host-to-device copy of each batch is. The training noise
is keyed by the step, so reused batches still get fresh noise. Synthetic data (`synthetic=True`,
or whenever the recipe's data is missing or does not fit the model) is MLPerf-shaped random
shards with the model's dims, written once per shape under the system temp dir and reused.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..model import flux_config
from ..model.configs import flops_per_sample
from ..train.config import RunConfig, load_recipe
from .device_time import (activities_from_chrome_trace, device_breakdown, host_top, split_host_time)
from .gemm_shapes import gemm_shapes, packer_shapes

__all__ = ["bench_step", "bench_settings", "load_bench_recipe", "PEAK_BF16_TFLOPS"]

# Peak dense (non-sparse) bf16 tensor-core rates, TFLOP/s, by a substring of the device name.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def load_bench_recipe(recipe: str, overrides=()) -> RunConfig:
    """A recipe for benchmarking: as `load_recipe`, with MLPerf logging off (no mlperf.log)."""
    return load_recipe(recipe, ["mlperf.enabled=false", *overrides])


def _model_config(cfg: RunConfig):
    fn = getattr(cfg.model, "flux_config", None)  # the config with `model.overrides`, where supported
    return fn() if callable(fn) else flux_config(cfg.model.name)


def _synthetic_reason(cfg: RunConfig, mc) -> str | None:
    """Why the recipe's own data cannot be benchmarked on (None: it can)."""
    from ..data.fit import data_model_mismatch

    root = cfg.data.root
    if root is not None and not (Path(root) / "meta.json").is_file():
        return f"data.root {root!r} not found"
    return data_model_mismatch(root, mc, model_name=cfg.model.name, recipe=cfg.name)


def _synthetic_root(mc, *, n_train: int, image_size: int, text_len: int, data_dir: str | None,
                    local_rank: int) -> Path:
    """MLPerf-shaped random shards with the model's dims: written by each node's local rank 0
    (into a temporary sibling, then renamed), reused when already there."""
    from ..data import read_meta, write_synthetic

    if image_size % 16:
        raise ValueError(f"image size {image_size} must be a multiple of 16 (VAE /8, then 2x2 patches)")
    dims = dict(l_txt=text_len, d_t5=mc.context_in_dim, d_clip=mc.vec_in_dim,
                latent_channels=mc.in_channels // 4, latent_hw=image_size // 8)
    key = "synth-t{l_txt}x{d_t5}-c{d_clip}-z{latent_channels}x{latent_hw}".format(**dims) + f"-n{n_train}"
    root = Path(data_dir) if data_dir else Path(tempfile.gettempdir()) / "mxflux-bench-data" / key
    if local_rank == 0 and not (root / "meta.json").is_file():
        tmp = root.with_name(f".{root.name}.{os.getpid()}.tmp")
        root.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(tmp, n_train=n_train, n_eval=8, seed=0, **dims)
        try:
            os.replace(tmp, root)
        except OSError:  # another writer got there first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    meta = read_meta(root)
    have = {k: meta.source.get(k) for k in dims}
    if meta.splits["train"].num_samples < n_train or have != dims:
        raise ValueError(f"{root}: existing data ({meta.splits['train'].num_samples} samples of {have}) does "
                         f"not fit this benchmark ({n_train} samples of {dims})")
    return root


def _peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None:
        return float(given)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops
    return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(ctx) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def _release(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Free a finished run's parameters, gradients and optimizer state now, whatever still holds
    the module (deleting the trainer was not enough: on the H200 the bare loop's peak was the
    trainer's plus the trainer's whole state, 114 GiB against 57 for the same model), and the MX
    weights' kept operands, which the layers hold too (on the H100 they stood under the bare loop's peak:
    38.77 GiB against the trainer's 37.05 at MBS 64)."""
    optimizer.state.clear()
    weight_state = getattr(optimizer, "weight_state", None)
    if weight_state is not None:
        weight_state.free()
    for p in model.parameters():
        p.grad = None
        p.data = p.data.new_empty(0)


def _timed(step, *, warmup: int, steps: int, device: torch.device, ctx) -> tuple[float, object, float]:
    """(seconds for `steps` calls of `step` after `warmup` untimed ones, the last call's result, seconds
    of the warm-up calls: compilation included, what a user waits before the first logged step);
    one synchronisation after the timed steps, none between them."""
    out = None
    w0 = time.perf_counter()
    for _ in range(warmup):
        out = step()
    _sync(device)
    warmup_s = time.perf_counter() - w0
    _barrier(ctx)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
    _sync(device)
    elapsed = time.perf_counter() - t0
    _barrier(ctx)
    return elapsed, out, warmup_s


def _memory(device: torch.device) -> dict:
    """Memory over the steps since the last peak reset (see the module docstring)."""
    gib = 2.0**30
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
                "max_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
                "device_used_gib": (total - free) / gib, "source": "cuda"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"max_allocated_gib": rss / gib, "max_reserved_gib": None, "device_used_gib": None,
            "source": "cpu ru_maxrss (whole process)"}


def _profiled(step, n: int, device: torch.device) -> dict:
    """The device-time split of `n` profiled calls of `step` (on the CPU: of the host ops)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    _sync(device)
    # (the ops' input shapes: each GEMM kernel's problem, `gemm_shapes`; they cost host time in the
    # profiled steps only, whose idle time is not reported against the timed steps')
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 record_shapes=cuda) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        _sync(device)
        wall = time.perf_counter() - t0
    if not cuda:
        out = split_host_time(prof.events(), n)
        out["wall_ms_per_step"] = wall * 1e3 / n
        return out
    with tempfile.TemporaryDirectory(prefix="mxflux-trace-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    index = device.index if device.index is not None else torch.cuda.current_device()
    out = device_breakdown(activities_from_chrome_trace(trace, device=index), n, wall_s=wall)
    out["gemm_shapes"] = gemm_shapes(trace, n, device=index)
    out["packer_shapes"] = packer_shapes(trace, n, device=index)
    out["host_top"] = host_top(prof.events())
    return out


def _throughput(step_s: float, g: int, world: int, flops: float, peak: float | None) -> dict:
    images_per_s = g / step_s
    per_gpu = images_per_s / world
    return {"step_ms": step_s * 1e3, "images_per_s": images_per_s, "images_per_s_per_gpu": per_gpu,
            "ms_per_512": 512 / images_per_s * 1e3, "achieved_tflops_per_gpu": per_gpu * flops / 1e12,
            "mfu": per_gpu * flops / (peak * 1e12) if peak else None}


def _over_ranks(mem: dict, elapsed: float, device: torch.device) -> tuple[dict, float]:
    keys = ["max_allocated_gib", "max_reserved_gib", "device_used_gib"]
    vals = _max_over_ranks([elapsed] + [mem[k] if mem[k] is not None else -1.0 for k in keys], device)
    return {**mem, **{k: (v if mem[k] is not None else None) for k, v in zip(keys, vals[1:])}}, vals[0]


def _bare_loop(cfg, ctx, device, latent_hw, text_tokens, g, flops, peak, *, warmup, steps, profile_steps,
               cuda_graph=False) -> dict:
    """Time the bare loop of `cfg` (`cuda_graph`: captured, replayed) as `bench_step` times the trainer."""
    from .bare_loop import BareLoop

    loop = BareLoop(cfg, ctx, device, latent_hw=latent_hw, text_tokens=text_tokens, cuda_graph=cuda_graph)
    elapsed, last, warmup_s = _timed(loop.step, warmup=warmup, steps=steps, device=device, ctx=ctx)
    memory, elapsed = _over_ranks(_memory(device), elapsed, device)
    out = {**_throughput(elapsed / steps, g, ctx.world_size, flops, peak), "memory": memory, "loss": float(last),
           "warmup_s": warmup_s,
           "breakdown": _profiled(loop.step, profile_steps, device) if profile_steps else None}
    _release(loop.model, loop.optimizer)
    del loop, last
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def captured_step_error(cfg: RunConfig, *, cuda_graph: bool, warmup: int, device_type: str,
                        world_size: int) -> str | None:
    """Why a captured step cannot be benchmarked as asked (None when it can): the captured bare
    loop (`cuda_graph`) needs one process on a CUDA device, and a captured trainer step
    (`train.cuda_graph`) more warm-up steps than its eager ones, so that every timed step is a
    replay. `bench_step` raises it; the command line says it before any work."""
    from ..train.captured import WARMUP_STEPS

    if cuda_graph and (device_type != "cuda" or world_size > 1):
        return (f"cuda_graph: the captured bare loop needs one process on a CUDA device (--cuda-graph); got "
                f"{device_type} with world size {world_size}")
    if cfg.train.cuda_graph and warmup <= WARMUP_STEPS:
        return (f"warmup: a captured trainer step (train.cuda_graph) needs more than {WARMUP_STEPS} warm-up steps "
                f"({WARMUP_STEPS} eager, then the capture), got {warmup}")
    return None


def bench_step(cfg: RunConfig, *, steps: int = 8, warmup: int = 3, profile_steps: int = 0, bare_loop: bool = False,
               cuda_graph: bool = False, memory_path: str | os.PathLike | None = None, synthetic: bool = False,
               image_size: int = 256, text_len: int = 256, data_dir: str | None = None,
               peak_tflops: float | None = None, device: str | torch.device | None = None,
               recipe: str | None = None, label: str | None = None, distributed: bool = True) -> dict | None:
    """Time `steps` optimizer steps of `cfg`'s trainer (and, with `bare_loop`, of its bare loop; with
    `cuda_graph`, of the bare loop captured as one CUDA graph per step); the result on rank 0 (None
    elsewhere). `memory_path`: write the memory breakdown of one more trainer step there as JSON
    (and print it).

    `distributed`: join the torchrun process group when the environment describes one (the
    model is then wrapped as `mxflux train` wraps it). See the module docstring for the fields.
    """
    from ..train.distributed import alone, init_distributed
    from ..train.step_path import step_path
    from ..train.trainer import Trainer

    if steps <= 0 or warmup < 0 or profile_steps < 0:
        raise ValueError(f"need steps > 0, warmup >= 0, profile_steps >= 0; got {steps}, {warmup}, {profile_steps}")
    gc.collect()  # a previous run's trainer must not count in this one's memory (cyclic garbage)
    device_type = torch.device(device).type if device is not None else None
    ctx = init_distributed(device_type) if distributed else alone(device_type)
    device = torch.device(device) if device is not None else ctx.device
    refused = captured_step_error(cfg, cuda_graph=cuda_graph, warmup=warmup, device_type=device.type,
                                  world_size=ctx.world_size)
    if refused:  # before the trainer's run, not after it
        raise ValueError(refused)
    mc = _model_config(cfg)
    cycle = min(warmup + steps + profile_steps + (1 if memory_path else 0), 2)  # batches read up front, reused
    reason = "--synthetic" if synthetic else _synthetic_reason(cfg, mc)
    if reason:
        root = _synthetic_root(mc, n_train=cfg.batch.global_batch_size * cycle, image_size=image_size,
                               text_len=text_len, data_dir=data_dir, local_rank=ctx.local_rank)
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"root": str(root)})})
    g = cfg.batch.global_batch_size
    peak = _peak_tflops(device, peak_tflops)

    with tempfile.TemporaryDirectory(prefix="mxflux-bench-") as out_dir:
        tr = Trainer(cfg, ctx=ctx, device=device, out_dir=out_dir)
        batches = tr.batches()
        pool = [[next(batches) for _ in range(tr.accum)] for _ in range(cycle)]
        batches.close()  # shuts the loader's workers down
        c, h, w = tr.train_set.latent_shape
        image_tokens, text_tokens = (h // 2) * (w // 2), tr.train_set.t5_shape[0]
        flops = flops_per_sample(mc, image_tokens, text_tokens)
        calls = iter(range(1 << 62))

        def trainer_step():
            return tr.train_step(pool[next(calls) % cycle])

        elapsed, last, warmup_s = _timed(trainer_step, warmup=warmup, steps=steps, device=device, ctx=ctx)
        memory, elapsed = _over_ranks(_memory(device), elapsed, device)
        loss = last.read()["loss"]
        breakdown = _profiled(trainer_step, profile_steps, device) if profile_steps else None
        mem_report = None
        if memory_path:
            from .memory import memory_breakdown

            mem_report = memory_breakdown(trainer_step, model=tr.model, optimizer=tr.optimizer, device=device)
        precision = cfg.precision.name
        kept = _kept_weight_operands(tr.optimizer)
        path = step_path(tr)  # how the timed steps ran (every rank: a collective under torchrun)
        _release(tr.model, tr.optimizer)
        del tr, pool, last
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    bare = bare_graph = None
    if bare_loop:
        bare = _bare_loop(cfg, ctx, device, (h, w), text_tokens, g, flops, peak, warmup=warmup, steps=steps,
                          profile_steps=profile_steps)
    if cuda_graph:
        bare_graph = _bare_loop(cfg, ctx, device, (h, w), text_tokens, g, flops, peak, warmup=warmup, steps=steps,
                                profile_steps=profile_steps, cuda_graph=True)
    _barrier(ctx)
    if ctx.rank != 0:
        return None

    result = {
        "label": label or precision,
        "recipe": recipe or cfg.name,
        "name": cfg.name,
        "model": cfg.model.name,
        "model_overrides": dict(cfg.model.overrides),
        "precision": precision,
        "precision_config": cfg.precision.model_dump(mode="json"),
        "compile": cfg.model.compile,
        # how the step ran besides its precision (mxflux.bench.fairness: settings compared must agree)
        "run_mode": {"compile": cfg.model.compile, "compile_mode": cfg.model.compile_mode,
                     "cuda_graph": bool(cuda_graph or cfg.train.cuda_graph), "optimizer": cfg.optim.implementation,
                     "activation_checkpointing": cfg.model.activation_checkpointing},
        "device": _device_name(device),
        "world_size": ctx.world_size,
        "distributed": cfg.distributed.model_dump() if ctx.world_size > 1 else None,
        "global_batch_size": g,
        "micro_batch_size": cfg.batch.micro_batch_size,
        "accumulation_steps": cfg.batch.accumulation_steps(ctx.world_size),
        "image_tokens": image_tokens,
        "text_tokens": text_tokens,
        "synthetic_data": bool(reason),
        "data": cfg.data.root,
        "steps": steps,
        "warmup_steps": warmup,
        "warmup_s": warmup_s,
        "profile_steps": profile_steps,
        **_throughput(elapsed / steps, g, ctx.world_size, flops, peak),
        "flops_per_sample": flops,
        "peak_tflops": peak,
        "memory": memory,
        "loss": loss,
        "breakdown": breakdown,
        **kept,
        "step_path": path,
        "bare_loop": bare,
        "trainer_over_bare_loop": (elapsed / steps * 1e3) / bare["step_ms"] if bare else None,
        "bare_loop_graph": bare_graph,
        "trainer_over_bare_loop_graph": (elapsed / steps * 1e3) / bare_graph["step_ms"] if bare_graph else None,
        "torch": torch.__version__,
        "pid": os.getpid(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if memory_path and mem_report is not None:
        from .memory import print_memory_report
        from .report import write_json

        write_json(memory_path, {result["label"]: mem_report})
        print_memory_report(mem_report, title=f"{result['label']}: ")
    return result


def _kept_weight_operands(optimizer) -> dict:
    """How many MX layers took their weight's operands from the optimizer step, and how many fix-up
    passes the trainer's steps (warm-up, timed and profiled) ran (docs/design.md, "The weights'
    operands from the optimizer step"); None where the step keeps none. Read once, after the timing."""
    state = getattr(optimizer, "weight_state", None)
    if state is None or not state.kept:
        return {"weight_operands_kept": None, "weight_operand_fixups": None}
    return {"weight_operands_kept": len(state.kept), "weight_operand_fixups": int(state.fixups)}


def bench_settings(recipe: str, settings: list[tuple[str, list[str]]], *, common=(), **kwargs) -> list[dict]:
    """`bench_step` for every (label, overrides) setting of `recipe`, one after the other in THIS
    process (`common` overrides apply to all, `kwargs` go to `bench_step`); the results on rank 0
    ([] on the other ranks). For settings that share compiled code and precision, e.g. FSDP
    wrapping variants under one torchrun job; settings of different precisions belong in
    separate processes (`mxflux.bench.compare`)."""
    from .report import per_device_unit

    results = []
    for label, overrides in settings:
        cfg = load_bench_recipe(recipe, [*overrides, *common])
        r = bench_step(cfg, recipe=recipe, label=label, **kwargs)
        if r is not None:
            results.append(r)
            print(f"{label}: {r['images_per_s_per_gpu']:.2f} images/s/{per_device_unit([r])}, {r['step_ms']:.1f} ms/step, "
                  f"peak {r['memory']['max_allocated_gib']:.1f} GiB", flush=True)
    return results
