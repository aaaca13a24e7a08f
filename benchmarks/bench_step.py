"""End-to-end training-step throughput, bf16 vs FP8 vs MXFP6, side by side in one process.

    PYTHONPATH=src python benchmarks/bench_step.py [--model flux-535m] [--mbs 16] [--steps 8] [--compile]

Synthetic MLPerf-shaped data (256 image + 256 T5 tokens per sample). Warm-up steps are dropped;
images/s counts only timed optimizer steps (CUDA-synchronised wall clock).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from mxflux.data import write_synthetic
from mxflux.model import flux_config
from mxflux.model.configs import flops_per_sample
from mxflux.train import load_recipe
from mxflux.train.trainer import Trainer


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flux-535m")
    ap.add_argument("--mbs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "mxfp6"])
    args = ap.parse_args(argv)
    root = os.path.join(tempfile.mkdtemp(), "synth")
    write_synthetic(root, n_train=args.mbs * (args.steps + args.warmup + 1), n_eval=8, seed=0)
    flops = flops_per_sample(flux_config(args.model), 256, 256)
    rows = []
    for prec in args.precisions:
        block = {"bf16": "precision={}", "fp8": "precision={fp8: hybrid}",
                 "mxfp6": 'precision={fp6: e2m3, fused_mlp: "off"}'}[prec]
        cfg = load_recipe("flux535m-bf16", [block, f"model.name={args.model}", f"model.compile={str(args.compile).lower()}",
                                            f"data.root={root}", f"batch.global_batch_size={args.mbs}",
                                            f"batch.micro_batch_size={args.mbs}", "data.num_workers=2",
                                            f"train.out_dir={tempfile.mkdtemp()}"])
        tr = Trainer(cfg, device="cuda")
        batches = tr._train_batches()
        data = [next(batches) for _ in range(args.steps + args.warmup)]
        for b in data[: args.warmup]:
            tr.train_step([b])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for b in data[args.warmup:]:
            tr.train_step([b])
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        ips = args.mbs / dt
        rows.append({"precision": prec, "ms_per_step": dt * 1e3, "images_per_s": ips,
                     "ms_per_512": 512 / ips * 1e3, "mfu_vs_989": ips * flops / 989e12,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        print(json.dumps(rows[-1]), flush=True)
        del tr
        torch.cuda.empty_cache()
    base = rows[0]["images_per_s"]
    for r in rows:
        print(f"{r['precision']:6s} {r['images_per_s']:8.1f} img/s  {r['ms_per_step']:8.1f} ms/step  "
              f"{r['images_per_s'] / base:5.2f}x bf16  peak {r['peak_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
