"""How fast the CPU training path runs: the MX packer and scaled GEMM kernels against their
references, and one step of the default job (`tiny-mxfp6`, batch 16).

    PYTHONPATH=src python3 benchmarks/cpu_path.py [--json out.json] [--steps 5] [--repeats 3]

Times are the best of `--repeats` runs of a few calls each (the development VM is shared, so the
best run is the least disturbed one), in the threads torch and numba are given
(OMP_NUM_THREADS / NUMBA_NUM_THREADS). Shapes are the demo model's: 1536 tokens (16 samples of
64 image + 32 text tokens), the single block's linear1 output width 896 and the width 128.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from mxflux.kernels import mx_operands_cpu
from mxflux.mx import mx_operands_reference, scaled_gemm_reference

try:  # the numba GEMM (absent in trees older than it, which this script also times)
    from mxflux.kernels import scaled_gemm_cpu
except ImportError:  # pragma: no cover
    scaled_gemm_cpu = None


def best_ms(fn, calls: int, repeats: int) -> float:
    fn()  # compile / warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e3)
    return round(best, 3)


def kernels(repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(1536, 896, generator=g).bfloat16()  # a gradient, packed in both orientations
    res = {"pack_1536x896_row_col": {
        "numba_ms": best_ms(lambda: mx_operands_cpu(dy), 10, repeats),
        "reference_ms": best_ms(lambda: mx_operands_reference(dy), 2, repeats)}}
    a = mx_operands_cpu(dy, col=False)
    b = mx_operands_cpu(torch.randn(128, 896, generator=g).bfloat16(), col=False)
    args = (a.row_data, a.row_scale, b.row_data, b.row_scale, None, torch.bfloat16)
    res["gemm_1536x128x896"] = {"reference_ms": best_ms(lambda: scaled_gemm_reference(*args), 10, repeats)}
    if scaled_gemm_cpu is not None:
        res["gemm_1536x128x896"]["numba_ms"] = best_ms(lambda: scaled_gemm_cpu(*args), 10, repeats)
    return res


def train_step(steps: int, repeats: int) -> dict:
    from mxflux.train.config import load_recipe
    from mxflux.train.distributed import alone
    from mxflux.train.trainer import Trainer

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the demo dataset and run files go to a scratch directory
        try:
            tr = Trainer(load_recipe("tiny-mxfp6"), ctx=alone("cpu"), device="cpu")
            batches = tr.batches()
            ms = best_ms(lambda: tr.train_step([next(batches)]), steps, repeats)
        finally:
            os.chdir(cwd)
    return {"recipe": "tiny-mxfp6", "micro_batch": 16, "ms_per_step": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--steps", type=int, default=5, help="training steps per timed run")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    res = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(),
           "numba_threads": int(os.environ.get("NUMBA_NUM_THREADS", os.cpu_count() or 1)),
           "kernels": kernels(args.repeats), "train_step": train_step(args.steps, args.repeats)}
    print(json.dumps(res, indent=1))
    if args.json:
        from mxflux.bench.provenance import provenance
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), **res}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
