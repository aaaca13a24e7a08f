"""Training-step throughput: the one harness behind every throughput number we publish.

`bench_step(cfg)` builds the `Trainer` of a recipe exactly as `mxflux train` does (FSDP2/DDP
under torchrun), runs `warmup` optimizer steps, then times `steps` optimizer steps with the
device synchronised around each, and optionally profiles `profile_steps` more with
torch.profiler for a breakdown of device time. Warm-up and profiled steps are excluded from the
timing. It reports:

- images/s (global) and images/s/GPU = global images/s / world size;
- ms per 512 images = 512 / global images/s (one MLPerf flux1 global batch on this job);
- MFU = images/s/GPU x training FLOPs per sample / the device's peak dense bf16 rate, with the
  FLOPs from `mxflux.model.configs.flops_per_sample` for the model and token counts of the data
  (flux-12b at 256 image + 256 text tokens: 20.4 TFLOP); the peak is 989 TFLOP/s on H100/H200,
  `peak_tflops` elsewhere, and MFU is null without one (CPU);
- peak memory: CUDA's max allocated over the timed steps (the largest over ranks), or on the CPU
  the process's peak resident set size (ru_maxrss, whole process lifetime);
- with profiling, device time per step split into GEMMs (cuBLAS kernels), MX and FP8 packers
  (our Triton kernels), attention (flash/SDPA kernels), communication (NCCL) and the rest, each
  kernel counted once from the device side and classified by its name, next to the device's
  busy time (the union of its activity). On the CPU the split is of the ops' self CPU time,
  each op going to the category of the innermost op around it that has one.

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
import re
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..model import flux_config
from ..model.configs import flops_per_sample
from ..train.config import RunConfig, load_recipe

__all__ = ["bench_step", "bench_settings", "load_bench_recipe", "device_time_breakdown", "print_table", "write_json",
           "PEAK_BF16_TFLOPS", "CATEGORIES"]

# Peak dense (non-sparse) bf16 tensor-core rates, TFLOP/s, by a substring of the device name.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}

CATEGORIES = ("gemm", "mx_pack", "attention", "communication", "other")

# On the CPU, the first profiled op (walking outward from an op) that matches a rule gives the
# op's category.
_OP_RULES = (
    ("mx_pack", re.compile(r"mxflux::mx_operands")),
    ("gemm", re.compile(r"^(aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm|_scaled_grouped_mm|matmul|linear)"
                        r"|mxflux::scaled_gemm)$")),
    ("attention", re.compile(r"attention|sdpa|flash", re.I)),
    ("communication", re.compile(r"nccl|gloo|c10d::|all_gather|allgather|reduce_scatter|all_reduce|allreduce"
                                 r"|broadcast", re.I)),
)
# On CUDA, every kernel by its own name (first match; attention before gemm: cuDNN's attention
# kernels contain "wgmma"). The exact mode's dequantize kernel counts as MX quantization work.
_KERNEL_RULES = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("mx_pack", re.compile(r"_pack_kernel|_prologue_kernel|_dequant_kernel")),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cublas|triton_tem_", re.I)),
)


def load_bench_recipe(recipe: str, overrides=()) -> RunConfig:
    """A recipe for benchmarking: as `load_recipe`, with MLPerf logging off (no mlperf.log)."""
    return load_recipe(recipe, ["mlperf.enabled=false", *overrides])


def _model_config(cfg: RunConfig):
    fn = getattr(cfg.model, "flux_config", None)  # the config with `model.overrides`, where supported
    return fn() if callable(fn) else flux_config(cfg.model.name)


def _synthetic_reason(cfg: RunConfig, mc) -> str | None:
    """Why the recipe's own data cannot be benchmarked on (None: it can)."""
    root = cfg.data.root
    if root is None:
        from ..data.demo import DEMO_CLIP_DIM, DEMO_T5_DIM

        if (mc.context_in_dim, mc.vec_in_dim) != (DEMO_T5_DIM, DEMO_CLIP_DIM):
            return f"the built-in demo data does not fit {cfg.model.name}"
        return None
    if not (Path(root) / "meta.json").is_file():
        return f"data.root {root!r} not found"
    return None


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


def _classify(event) -> str:
    """A host op's category: the first op (walking outward from it) that matches an _OP_RULES rule."""
    e = event
    while e is not None:
        for category, rule in _OP_RULES:
            if rule.search(e.name):
                return category
        e = e.cpu_parent
    return "other"


def _device_activities(events) -> list:
    """The device-side kernel and copy events of a profile, each once.

    Skips the GPU-side mirrors of user annotations (record_function, compiled regions): they
    span whole regions, overlapping the kernels inside them (an eager run once summed a 242 ms
    step to 1630 ms of device time that way).
    """
    from torch.autograd import DeviceType

    cpu_names = {e.name for e in events if e.device_type == DeviceType.CPU}
    seen, out = set(), []
    for e in events:
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False) or e.name in cpu_names:
            continue
        key = (e.name, e.time_range.start, e.time_range.end, e.device_index)
        if key not in seen:
            seen.add(key)
            out.append(e)
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


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _busy_us(acts) -> float:
    """Microseconds the device was busy: the union of the intervals of `acts` (its kernels and
    copies, from _device_activities), so that kernels overlapping on several streams (NCCL next
    to compute) count once."""
    return _length(_merged((e.time_range.start, e.time_range.end) for e in acts))


def _exposed_comm_us(acts) -> float:
    """Microseconds in which communication kernels ran and nothing else did: the collective time
    that compute did not hide (the union of NCCL intervals minus its overlap with all others)."""
    comm, rest = [], []
    for e in acts:
        (comm if _kernel_category(e.name) == "communication" else rest).append((e.time_range.start, e.time_range.end))
    comm, rest = _merged(comm), _merged(rest)
    overlap, j = 0.0, 0
    for a, b in comm:  # both lists sorted and disjoint: one sweep
        while j < len(rest) and rest[j][1] <= a:
            j += 1
        k = j
        while k < len(rest) and rest[k][0] < b:
            overlap += min(b, rest[k][1]) - max(a, rest[k][0])
            k += 1
    return _length(comm) - overlap


def _idle_gaps(acts, top: int = 6) -> list[dict]:
    """The longest stretches with no device activity, with the activities either side of each
    (where a host-bound step waits: a sync, a slow launch, Python between regions)."""
    acts = sorted(acts, key=lambda e: e.time_range.start)
    gaps, end, last = [], None, None
    for e in acts:
        if end is not None and e.time_range.start > end:
            gaps.append((e.time_range.start - end, last.name, e.name))
        if end is None or e.time_range.end > end:
            end, last = e.time_range.end, e
    gaps.sort(key=lambda g: -g[0])
    return [{"ms": g / 1e3, "after": a[:80], "before": b[:80]} for g, a, b in gaps[:top]]


def _host_top(events, top: int = 8) -> list[dict]:
    """Host ops by self CPU time (what the CPU did while the device may have waited)."""
    from torch.autograd import DeviceType

    by_name: dict[str, float] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.self_cpu_time_total
    return [{"name": n[:80], "ms": t / 1e3} for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]


def _kernel_category(name: str) -> str:
    for category, rule in _KERNEL_RULES:
        if rule.search(name):
            return category
    return "other"


def device_time_breakdown(events, steps: int, *, device_type: str = "cuda", top: int = 12) -> dict:
    """Split a profile's device time per step into CATEGORIES (and the top kernels or ops).

    `events` is `prof.events()`. On CUDA every kernel and copy is counted once, from the device
    side, and classified by its own name (each kernel library names its kernels: cuBLAS nvjet /
    gemm, cuDNN and flash attention, NCCL, our Triton packers). Summing the kernels listed under
    each host op instead counted some kernels twice: 448 ms of "device time" for a 282 ms step.
    `busy_ms_per_step` is the union of the device's activity intervals (overlapping streams
    once); it is at most the step's wall time. On the CPU the split is the ops' self CPU time.
    """
    us = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[tuple[str, str], float] = {}
    acts = _device_activities(events) if device_type == "cuda" else []
    if device_type == "cuda":
        for e in acts:
            cat = _kernel_category(e.name)
            d = e.time_range.end - e.time_range.start
            us[cat] += d
            by_name[(e.name, cat)] = by_name.get((e.name, cat), 0.0) + d
    else:
        from torch.autograd import DeviceType

        for e in events:
            if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0:
                cat = _classify(e)
                us[cat] += e.self_cpu_time_total
                by_name[(e.name, cat)] = by_name.get((e.name, cat), 0.0) + e.self_cpu_time_total
    total = sum(us.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    out = {
        "source": "CUDA kernel time" if device_type == "cuda" else "CPU op self time",
        "steps": steps,
        "total_ms_per_step": total / 1e3 / steps,
        "categories": {c: {"ms_per_step": us[c] / 1e3 / steps, "fraction": us[c] / total if total else 0.0}
                       for c in CATEGORIES},
        "top": [{"name": n[:120], "category": c, "ms_per_step": t / 1e3 / steps} for (n, c), t in ranked],
    }
    if device_type == "cuda":
        out["busy_ms_per_step"] = _busy_us(acts) / 1e3 / steps
        out["exposed_communication_ms_per_step"] = _exposed_comm_us(acts) / 1e3 / steps
        if acts:  # the device's first-to-last span: busy + the bubbles between kernels
            span = max(e.time_range.end for e in acts) - min(e.time_range.start for e in acts)
            out["span_ms_per_step"] = span / 1e3 / steps
            out["activities_per_step"] = len(acts) / steps
        out["idle_gaps"] = _idle_gaps(acts)
        out["host_top"] = _host_top(events)
    return out


def bench_step(cfg: RunConfig, *, steps: int = 8, warmup: int = 3, profile_steps: int = 0,
               synthetic: bool = False, image_size: int = 256, text_len: int = 256, data_dir: str | None = None,
               peak_tflops: float | None = None, device: str | torch.device | None = None,
               recipe: str | None = None, label: str | None = None, distributed: bool = True) -> dict | None:
    """Time `steps` optimizer steps of `cfg`'s trainer; the result on rank 0 (None elsewhere).

    `distributed`: join the torchrun process group when the environment describes one (the
    model is then wrapped as `mxflux train` wraps it). See the module docstring for the fields.
    """
    from ..train.distributed import alone, init_distributed
    from ..train.trainer import Trainer

    if steps <= 0 or warmup < 0 or profile_steps < 0:
        raise ValueError(f"need steps > 0, warmup >= 0, profile_steps >= 0; got {steps}, {warmup}, {profile_steps}")
    gc.collect()  # a previous run's trainer must not count in this one's memory (cyclic garbage)
    device_type = torch.device(device).type if device is not None else None
    ctx = init_distributed(device_type) if distributed else alone(device_type)
    device = torch.device(device) if device is not None else ctx.device
    mc = _model_config(cfg)
    total_steps = warmup + steps + profile_steps
    cycle = min(total_steps, 2)  # distinct batches read up front, then reused
    reason = "--synthetic" if synthetic else _synthetic_reason(cfg, mc)
    if reason:
        root = _synthetic_root(mc, n_train=cfg.batch.global_batch_size * cycle, image_size=image_size,
                               text_len=text_len, data_dir=data_dir, local_rank=ctx.local_rank)
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"root": str(root)})})

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def barrier():
        if ctx.world_size > 1:
            dist.barrier()

    with tempfile.TemporaryDirectory(prefix="mxflux-bench-") as out_dir:
        tr = Trainer(cfg, ctx=ctx, device=device, out_dir=out_dir)
        batches = tr.batches()
        pool = [[next(batches) for _ in range(tr.accum)] for _ in range(cycle)]
        batches.close()  # shuts the loader's workers down
        train_set = tr.train_set
        c, h, w = train_set.latent_shape
        image_tokens, text_tokens = (h // 2) * (w // 2), train_set.t5_shape[0]

        for i in range(warmup):
            tr.train_step(pool[i % cycle])
        sync()
        barrier()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times, result = [], {}
        for i in range(warmup, warmup + steps):
            t0 = time.perf_counter()
            result = tr.train_step(pool[i % cycle])
            sync()
            times.append(time.perf_counter() - t0)
        barrier()
        if cuda:
            peak_bytes, peak_source = torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
        else:
            peak_bytes, peak_source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu ru_maxrss"
        elapsed, peak_bytes = _max_over_ranks([sum(times), float(peak_bytes)], device)

        last = result.read()
        breakdown = None
        if profile_steps:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for i in range(warmup + steps, total_steps):
                    tr.train_step(pool[i % cycle])
                sync()
            breakdown = device_time_breakdown(prof.events(), profile_steps, device_type="cuda" if cuda else "cpu")
            del prof
        precision = cfg.precision.name
        del tr, pool
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    barrier()
    if ctx.rank != 0:
        return None

    g = cfg.batch.global_batch_size
    images_per_s = g * steps / elapsed
    per_gpu = images_per_s / ctx.world_size
    flops = flops_per_sample(mc, image_tokens, text_tokens)
    peak = _peak_tflops(device, peak_tflops)
    return {
        "label": label or precision,
        "recipe": recipe or cfg.name,
        "name": cfg.name,
        "model": cfg.model.name,
        "precision": precision,
        "compile": cfg.model.compile,
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
        "profile_steps": profile_steps,
        "step_ms": elapsed / steps * 1e3,
        "step_ms_each": [t * 1e3 for t in times],  # rank 0's
        "images_per_s": images_per_s,
        "images_per_s_per_gpu": per_gpu,
        "ms_per_512": 512 / images_per_s * 1e3,
        "flops_per_sample": flops,
        "achieved_tflops_per_gpu": per_gpu * flops / 1e12,
        "peak_tflops": peak,
        "mfu": per_gpu * flops / (peak * 1e12) if peak else None,
        "peak_memory_gib": peak_bytes / 2**30,
        "peak_memory_source": peak_source,
        "loss": last["loss"],
        "breakdown": breakdown,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def print_table(results: list[dict], *, baseline: int | None = 0, console=None) -> None:
    """One column per result (rich); with several, a row of images/s/GPU relative to `baseline`."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    r0 = results[0]
    title = (f"{r0['model']} · {r0['device']} x{r0['world_size']} · global batch {r0['global_batch_size']} "
             f"(micro {r0['micro_batch_size']}) · {r0['image_tokens']}+{r0['text_tokens']} tokens · "
             f"{r0['steps']} timed steps after {r0['warmup_steps']} warm-up")
    console.print(title, style="bold")
    table = Table()
    table.add_column("metric")
    for r in results:
        table.add_column(r["label"], justify="right")
    rows = [
        ("ms / step", lambda r: _fmt(r["step_ms"], ".1f")),
        ("images/s (global)", lambda r: _fmt(r["images_per_s"], ".1f")),
        ("images/s/GPU", lambda r: _fmt(r["images_per_s_per_gpu"], ".1f")),
        ("ms per 512 images", lambda r: _fmt(r["ms_per_512"], ".0f")),
        ("TFLOP / sample", lambda r: _fmt(r["flops_per_sample"] / 1e12, ".3f")),
        ("TFLOP/s/GPU", lambda r: _fmt(r["achieved_tflops_per_gpu"], ".1f")),
        ("MFU", lambda r: "–" if r["mfu"] is None else f"{100 * r['mfu']:.1f}% of {r['peak_tflops']:.0f}"),
        ("peak memory GiB", lambda r: _fmt(r["peak_memory_gib"], ".2f")),
        ("last loss", lambda r: _fmt(r["loss"], ".4f")),
    ]
    if len(results) > 1 and baseline is not None:
        base = results[baseline]["images_per_s_per_gpu"]
        rows.insert(3, (f"vs {results[baseline]['label']}", lambda r: f"{r['images_per_s_per_gpu'] / base:.2f}x"))
    for name, fn in rows:
        table.add_row(name, *(fn(r) for r in results))
    if any(r.get("breakdown") for r in results):
        table.add_section()
        table.add_row("device ms / step", *(_fmt(r["breakdown"] and r["breakdown"]["total_ms_per_step"], ".1f")
                                            for r in results))
        if any(r.get("breakdown") and "busy_ms_per_step" in r["breakdown"] for r in results):
            table.add_row("  busy (union)", *(_fmt(r["breakdown"] and r["breakdown"].get("busy_ms_per_step"), ".1f")
                                              for r in results))
            table.add_row("  exposed comm.", *(
                _fmt(r["breakdown"] and r["breakdown"].get("exposed_communication_ms_per_step"), ".1f")
                for r in results))
        for cat in CATEGORIES:
            table.add_row(f"  {cat}", *(
                "–" if not r.get("breakdown") else
                f"{r['breakdown']['categories'][cat]['ms_per_step']:.1f} "
                f"({100 * r['breakdown']['categories'][cat]['fraction']:.0f}%)" for r in results))
    console.print(table)
    notes = ["ms per 512 images = 512 / global images/s; MFU = images/s/GPU x FLOP/sample / peak dense bf16"]
    if any(r.get("breakdown") for r in results):
        src = next(r["breakdown"]["source"] for r in results if r.get("breakdown"))
        notes.append(f"breakdown: {src} over the profiled steps (excluded from the timing)")
    if any(r["synthetic_data"] for r in results):
        notes.append("data: synthetic MLPerf-shaped shards")
    console.print("; ".join(notes), style="dim")


def bench_settings(recipe: str, settings: list[tuple[str, list[str]]], *, common=(), **kwargs) -> list[dict]:
    """`bench_step` for every (label, overrides) setting of `recipe`, one after the other in this
    process, so that their ratios are measured side by side; `common` overrides apply to all and
    `kwargs` go to `bench_step`. The results on rank 0 ([] on the other ranks)."""
    results = []
    for label, overrides in settings:
        cfg = load_bench_recipe(recipe, [*overrides, *common])
        r = bench_step(cfg, recipe=recipe, label=label, **kwargs)
        if r is not None:
            results.append(r)
            print(f"{label}: {r['images_per_s_per_gpu']:.2f} images/s/GPU, {r['step_ms']:.1f} ms/step, "
                  f"peak {r['peak_memory_gib']:.1f} GiB", flush=True)
    return results


def write_json(path: str | os.PathLike, result) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
