"""Each setting of a benchmark script in its own process, one after another: the script runs itself
with `--worker SETTING` and the same arguments, and prints its result as one `RESULT <json>` line.
Shared by bench_lora.py and bench_user_loop.py: `add_arguments` on the parser, `answered_as_worker`
right after parsing, `run_settings` for the rest."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def add_arguments(parser, *, timeout: float) -> None:
    """The arguments every such script takes: --timeout (seconds per setting), --out, and the hidden
    --worker its own processes are started with."""
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per setting")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)


def answered_as_worker(args, worker) -> bool:
    """In a setting's own process (--worker): run `worker(args)`, print its result line, True."""
    if not args.worker:
        return False
    print("RESULT " + json.dumps(worker(args)), flush=True)
    return True


def run_settings(script: str, settings: list[str], passthrough: list[str], timeout: float) -> list[dict]:
    """One row per setting: the worker's result, or {"setting", "error"} (its stderr's tail, or the
    timeout) where it gave none."""
    rows = []
    for setting in settings:
        cmd = [sys.executable, script, "--worker", setting, *passthrough]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            rows.append({"setting": setting, "error": f"timed out after {timeout:.0f} s"})
            continue
        found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        rows.append(json.loads(found[0]) if found else {"setting": setting, "error": proc.stderr[-3000:]})
        print(json.dumps(rows[-1])[:400], flush=True)
    return rows
