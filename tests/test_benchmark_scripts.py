"""The GPU study scripts run end to end at toy size on the CPU, so a device call never finds them broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_convergence_study_runs_both_precisions_and_writes_curves(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--steps", "4", "--width", "128",
           "--depth", "1", "--single", "1", "--batch", "4", "--eval-every", "2", "--eval-samples", "8",
           "--warmup", "1", "--no-compile", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=600)
    (result,) = tmp_path.glob("convergence_*.json")
    r = json.loads(result.read_text())
    assert [s for s, _ in r["curves"]["bf16"]] == [2, 4] == [s for s, _ in r["curves"]["mxfp6"]]
    first, last = r["curves"]["mxfp6"][0][1], r["curves"]["mxfp6"][-1][1]
    assert last < first  # the loss falls
    assert abs(r["final_ratio_mxfp6_over_bf16"] - r["curves"]["mxfp6"][-1][1] / r["curves"]["bf16"][-1][1]) < 1e-12
    assert (tmp_path / result.name.replace(".json", ".png")).stat().st_size > 1000
