"""What a run says in words, through the real `mxflux train` with stdout not a terminal (a pipe, as
under a batch system or nohup): plain progress lines, train.log in the run directory, the start-up
phases, and the closing summary before the JSON; and the thread pools sized from free cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxflux.cli import threads
from mxflux.train.eta import SmoothedETA
from mxflux.train.runlog import LogLines, RunLog, progress_line

SMALL = ["--set", "model.overrides={depth: 1, depth_single_blocks: 1}", "--set", "batch.global_batch_size=4",
         "--set", "batch.micro_batch_size=4", "--set", "train.log_every=1", "--set", "train.eval_samples=4",
         "--set", "train.eval_every_samples=16", "--set", "train.sample_prompts=[]",
         "--set", "optim.warmup_steps=1", "--set", "train.train_samples=32"]


def mxflux(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "mxflux.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_run_into_a_pipe_prints_plain_lines_writes_train_log_and_ends_in_words(tmp_path):
    out = tmp_path / "run"
    proc = mxflux("train", *SMALL, "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # before the training line: the run's header, and a start-up phase's line where it took over a second
    # (on a loaded machine the set-up does)
    start = next(i for i, x in enumerate(lines) if x.startswith("training tiny-mxfp6: steps 1 to 8 of 4 images"))
    assert all(x.startswith(("tiny-mxfp6: ", "set up: ")) for x in lines[:start]) and 1 <= start <= 2
    progress = [x for x in lines if x.startswith("step ") and "/8 (" in x]
    assert progress[0].startswith("step 1/8 (12.5 %)  loss ") and progress[-1].startswith("step 8/8 (100.0 %)")
    assert sum("eval loss" in x for x in lines) == 2  # at 16 and 32 images
    done = next(i for i, x in enumerate(lines) if x.startswith("done: step 8 (32 images) in 0:00:"))
    assert lines[done + 1].startswith("  last training loss ") and "validation loss" in lines[done + 1]
    assert f"  checkpoint:  {out / 'latest.pt'}" in lines and f"  log:         {out / 'train.log'}" in lines
    assert any(x.startswith(f"  next: mxflux sample {out}") for x in lines)
    assert json.loads(lines[-1])["step"] == 8  # the JSON last, for scripts
    log = (out / "train.log").read_text().splitlines()
    # the file has every console line, time-stamped, and the command and step line besides
    assert log[0].endswith(f"mxflux train {' '.join(SMALL)} --out {out}")
    for line in lines[:-1]:
        assert any(entry.endswith(line) for entry in log), line
    assert any("step: on the CPU" in entry for entry in log)
    assert "step: on the CPU" in proc.stderr and "Triton" not in proc.stderr


def test_a_resumed_run_appends_to_its_log_and_overwrite_removes_it(tmp_path):
    out = tmp_path / "run"
    assert mxflux("train", *SMALL, "--out", out, "--max-steps", "4", cwd=tmp_path).returncode == 0
    first = (out / "train.log").read_text()
    proc = mxflux("train", "--resume", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = (out / "train.log").read_text()
    assert text.startswith(first) and "resuming at step 4" in text[len(first):]
    assert mxflux("train", *SMALL, "--out", out, "--overwrite", "--max-steps", "1", cwd=tmp_path).returncode == 0
    assert "resuming" not in (out / "train.log").read_text()


def test_log_lines_come_at_the_interval_with_speed_and_time_left_from_one_window(tmp_path):
    now = [0.0]
    log = RunLog(tmp_path, echo=False)
    cb = LogLines(log, interval_s=30, clock=lambda: now[0])

    class T:
        step, cfg = 0, type("C", (), {"name": "r", "batch": type("B", (), {"global_batch_size": 16})(),
                                      "model": type("M", (), {"compile": True})()})()

    cb.on_fit_start(T(), 100)
    now[0] = 1.5  # the first step, compiling
    cb.on_step_end(T(), None)
    cb.on_step_end(T(), None)  # only the first one is a phase
    for step in range(1, 101):
        now[0] = step * 2.0  # 2 s a step: 8 images/s, a line every 15 steps (30 s)
        cb.on_log(T(), {"step": step, "loss": 1.0, "lr": 1e-3})
    lines = (tmp_path / "train.log").read_text().splitlines()[1:]
    assert lines.pop(0).endswith("first step (compiled): 1.5 s")
    assert [int(x.split("step ")[1].split("/")[0]) for x in lines] == [1, 16, 31, 46, 61, 76, 91, 100]
    assert "8.0 img/s  0:00:00 left" in lines[-1] and "8.0 img/s  0:00:18 left" in lines[-2]
    eta = SmoothedETA()
    assert progress_line({"step": 1, "loss": 2.0, "lr": 1e-3}, 10, eta, 4).endswith("– img/s  -:--:-- left")


def test_numbas_pool_takes_the_free_cores_and_torchs_the_usable_ones(tmp_path, monkeypatch):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("1.00 0.50 0.20 2/345 999\n")  # two runnable: this reader and one other
    assert threads.other_runnable(samples=1, loadavg=loadavg) == 1.0
    assert threads.free_cpus(usable=2, others=1.0) == 1 and threads.free_cpus(usable=2, others=0.0) == 2
    assert threads.free_cpus(usable=4, others=9.0) == 1
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "other_runnable", lambda: 1.0)
    env = {}
    assert threads.configure_threads(env) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "1"}
    env = {"NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"}  # the user's choice stands
    assert threads.configure_threads(env) == {"MKL_NUM_THREADS": "2"} and env["NUMBA_NUM_THREADS"] == "2"
    assert threads.configure_threads({"MXFLUX_THREADS": "off"}) == {}


@pytest.mark.parametrize("quota, expected", [("max 100000", None), ("150000 100000", 1.5)])
def test_the_cgroup_quota_caps_the_usable_cores(tmp_path, quota, expected):
    (tmp_path / "cpu.max").write_text(quota + "\n")
    assert threads._cgroup_quota(tmp_path) == expected
    if expected:
        assert threads.usable_cpus(tmp_path) == 1
