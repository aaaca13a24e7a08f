"""Run torchao float8 tensorwise then rowwise in ONE process (what `mxflux bench step` no longer
does, since each setting gets its own process) to find why the rowwise run died with an illegal
memory access when it followed the tensorwise one.

    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=src python3 benchmarks/probe_fp8_in_process.py [--reset]

`--reset` calls torch._dynamo.reset() between the settings. Prints each setting's images/s or the
error (with the faulting kernel when CUDA_LAUNCH_BLOCKING=1 makes the failing launch report itself).
"""

from __future__ import annotations

import argparse
import traceback

import torch

from mxflux.bench.compare import PROXY_OVERRIDES, PROXY_RECIPE, SETTINGS
from mxflux.bench.step import bench_step, load_bench_recipe


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reset", action="store_true", help="torch._dynamo.reset() between the settings")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="torch.backends.cuda.enable_cudnn_sdp(False): attention on another SDPA backend")
    p.add_argument("--mbs", type=int, default=16)
    p.add_argument("--settings", default="fp8-tensorwise,fp8-rowwise")
    args = p.parse_args()
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    for i, name in enumerate(args.settings.split(",")):
        if i and args.reset:
            torch._dynamo.reset()
        cfg = load_bench_recipe(PROXY_RECIPE, [*SETTINGS[name], *PROXY_OVERRIDES,
                                               f"batch.micro_batch_size={args.mbs}",
                                               f"batch.global_batch_size={args.mbs}"])
        try:
            r = bench_step(cfg, steps=3, warmup=1, synthetic=True, bare_loop=True, profile_steps=1, label=name, device="cuda",
                           distributed=False)
            print(f"{name}: OK {r['images_per_s_per_gpu']:.1f} img/s", flush=True)
        except Exception:  # the point of the probe is to print whatever fails, then stop
            print(f"{name}: FAILED", flush=True)
            traceback.print_exc()
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
