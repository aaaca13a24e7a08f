"""How the CPU path shares a machine: a short `mxflux train` of the default recipe alone, then next to
one busy process (a pure-Python loop on one core), under each thread configuration named.

On 2 cores a second busy process leaves the run about one core, so the run should take at most ~2.5x
as long beside it as alone ("shares gracefully", issue 51); thread pools that spin while they wait for
a descheduled peer take far longer. Each configuration is a set of environment variables for the
run's process: "mxflux" is what `mxflux` sets by itself (mxflux.cli.threads), "spinning" the
thread pools as torch and numba start them when nothing is set (MXFLUX_THREADS=off), the others
single knobs, for comparison (names without commas: --configs is a comma-separated list).

    python3 benchmarks/cpu_threads.py --json benchmarks/results/cpu_threads_<date>.json

Each run: 1600 images (100 steps of 16), no evaluation or samples, its own output directory; wall,
user and system CPU seconds of the whole process (its start-up included), best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "mxflux": {},
    "spinning": {"MXFLUX_THREADS": "off"},
    "passive": {"MXFLUX_THREADS": "off", "OMP_WAIT_POLICY": "PASSIVE"},
    "numba-workqueue": {"MXFLUX_THREADS": "off", "NUMBA_THREADING_LAYER": "workqueue"},
    "numba-1-thread": {"MXFLUX_THREADS": "off", "NUMBA_NUM_THREADS": "1"},
    "torch-1-thread": {"MXFLUX_THREADS": "off", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
}


def _run(env: dict, out: Path) -> dict:
    cmd = [sys.executable, "-m", "mxflux.cli", "train", "--no-progress", "--set", f"train.out_dir={out}",
           "--set", "train.train_samples=1600", "--set", "train.eval_every_samples=1000000",
           "--set", "train.sample_prompts=[]"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mxflux-threads-") as tmp:
        for name in names:
            row = {"config": name, "env": CONFIGS[name]}
            for busy in (False, True):
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                time.sleep(1.0 if busy else 0.0)  # the other process is running before the run starts
                try:
                    runs = [_run(CONFIGS[name], Path(tmp) / f"{len(rows)}-{busy}-{i}") for i in range(args.repeats)]
                finally:
                    if hog:
                        hog.kill()
                        hog.wait()
                row["busy" if busy else "alone"] = min(runs, key=lambda r: r["wall_s"])
            row["busy_over_alone"] = row["busy"]["wall_s"] / row["alone"]["wall_s"]
            rows.append(row)
            print(f"{name:32s} alone {row['alone']['wall_s']:6.1f} s ({row['alone']['user_s']:6.1f} s user)   "
                  f"beside a busy process {row['busy']['wall_s']:6.1f} s ({row['busy']['user_s']:6.1f} s user)   "
                  f"{row['busy_over_alone']:.2f}x", flush=True)
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from mxflux.bench.provenance import provenance

        Path(args.json).write_text(json.dumps({"provenance": provenance(), "cores": os.cpu_count(), "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
