"""MLPerf logging: the logs MLPerfLogger writes pass (or fail) the REAL mlperf-logging checker.

The checker is run as a subprocess exactly as a submitter would:
    python -m mlperf_logging.compliance_checker --usage training --ruleset 6.1.0 LOGFILE
(plus --log_output into the tmp dir so it does not drop compliance_checker.log in the cwd).
The compliance checker needs only the log file; the system-description JSON belongs to the
package checker (mlperf_logging.package_checker), which this test does not run.

These tests drive MLPerfLogger through the event sequence of a run; they do not train anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mxflux.train.config import load_recipe
from mxflux.train.mlperf import (
    FLUX1_EVAL_SAMPLES,
    MLPerfLogger,
    TARGET_EVAL_LOSS,
    closed_division_problems,
    evaluation_frequency,
)

pytest.importorskip("mlperf_logging")

SEPARATOR = "-" * 30

# A scripted sequence of eval losses, NOT a trained model's losses: decreasing, last one ≤ 0.586.
CONVERGING = [0.95, 0.81, 0.72, 0.66, 0.62, 0.60, 0.59, 0.585]
# Never reaches the target (the run is cut off: status "aborted").
NOT_CONVERGING = [0.95, 0.81, 0.72, 0.66, 0.62, 0.60, 0.59, 0.587]


def run_checker(log: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
           "--ruleset", "6.1.0", "--log_output", str(log.parent / "compliance_checker.log"), str(log)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=log.parent, timeout=120)


def checker_messages(out: str) -> list[str]:
    """The checker's failure/warning messages (it joins them with a line of 30 dashes)."""
    marker = "WARNING - "
    if marker not in out:
        return []
    body = out.split(marker, 1)[1]
    body = body.split("ERROR - FAILED", 1)[0].split("** Logging output", 1)[0]
    return [m.strip() for m in body.split(SEPARATOR) if m.strip()]


def simulate_run(log: Path, cfg, losses, *, rank=0, world_size=8, **kwargs) -> MLPerfLogger:
    """The event sequence a real run makes: init, (warm-up), run_start, one block of
    evaluation_frequency samples per eval, stop at the first eval ≤ target, run_stop."""
    mll = MLPerfLogger(log, cfg, rank=rank, world_size=world_size, **kwargs)
    mll.init_start()
    mll.init_stop()
    mll.run_start()
    samples, every, converged = 0, evaluation_frequency(cfg.batch.global_batch_size), False
    for loss in losses:
        mll.block_start(samples)
        for _ in range(every // cfg.batch.global_batch_size):  # train steps
            samples += cfg.batch.global_batch_size
            if samples % (50 * cfg.batch.global_batch_size) == 0:
                mll.train_loss(loss + 0.01, samples)
        mll.block_stop(samples)
        mll.eval_start(samples)
        mll.eval_stop(samples)
        mll.eval_accuracy(loss, samples)
        if loss <= TARGET_EVAL_LOSS:
            converged = True
            break
    mll.run_stop(samples, status="success" if converged else "aborted")
    mll.close()
    return mll


def read_log(log: Path) -> list[dict]:
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith(":::MLLOG ")]
    return [json.loads(ln[len(":::MLLOG "):]) for ln in lines]


def values(log: Path) -> dict:
    return {r["key"]: r["value"] for r in read_log(log) if r["event_type"] == "POINT_IN_TIME"}


@pytest.fixture(scope="module")
def mxfp6_cfg():
    return load_recipe("flux12b-mxfp6-mlperf")


def test_converging_run_passes_real_checker(tmp_path, mxfp6_cfg):
    log = tmp_path / "result_0.txt"
    simulate_run(log, mxfp6_cfg, CONVERGING)
    res = run_checker(log)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "SUCCESS" in out and "training_6.1.0/closed_flux1.yaml" in out, out
    assert checker_messages(out) == [], out  # not even a warning

    recs = read_log(log)
    v = values(log)
    assert v["submission_benchmark"] == "flux1" and v["submission_division"] == "closed"
    assert v["evaluation_frequency"] == 262144
    assert v["global_batch_size"] == 512 and v["gradient_accumulation_steps"] == 1  # 512/(64·8)
    assert v["lowest_numerical_precision_in_linear"] == "mxfp6"
    assert v["eval_samples"] == FLUX1_EVAL_SAMPLES
    keys = [r["key"] for r in recs]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1
    assert keys.count("eval_accuracy") == len(CONVERGING) == keys.count("block_start")
    stop = next(r for r in recs if r["key"] == "run_stop")
    assert stop["metadata"]["status"] == "success"
    assert stop["metadata"]["samples_count"] == 262144 * len(CONVERGING)
    # config keys are logged exactly once even though init_stop and run_start both ask for them
    assert keys.count("opt_base_learning_rate") == 1


def test_non_converging_run_fails_on_the_convergence_rule_only(tmp_path, mxfp6_cfg):
    log = tmp_path / "result_0.txt"
    simulate_run(log, mxfp6_cfg, NOT_CONVERGING)
    res = run_checker(log)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "FAILED" in out
    msgs = checker_messages(out)
    assert len(msgs) == 1, out
    assert msgs[0].startswith("Failed checks for eval_accuracy"), out
    assert "<= 0.586" in msgs[0], out


@pytest.mark.parametrize(
    "recipe, overrides, linear, comm",
    [
        ("flux12b-mxfp6-mlperf", [], "mxfp6", "fp32"),
        ("flux12b-fp8-mlperf", [], "fp8", "fp32"),
        ("flux12b-bf16-mlperf", [], "bfloat16", "fp32"),
        ("flux12b-mxfp6-mlperf", ["distributed.reduce_dtype=bfloat16"], "mxfp6", "bfloat16"),
    ],
)
def test_precision_keys(tmp_path, recipe, overrides, linear, comm):
    cfg = load_recipe(recipe, overrides)
    log = tmp_path / "result_0.txt"
    simulate_run(log, cfg, CONVERGING[-2:])
    v = values(log)
    assert v["lowest_numerical_precision_in_linear"] == linear
    assert v["lowest_numerical_precision_in_attn"] == "bfloat16"
    assert v["lowest_numerical_precision_in_comm"] == comm
    res = run_checker(log)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_checker_reads_the_linear_precision_and_accepts_only_allowed_formats(tmp_path, mxfp6_cfg):
    """mxfp6 passes because the rules list it (mlperf-logging >= 4.1.65), not because the key goes
    unchecked: the same log claiming a format the rules do not list fails on that key alone."""
    log = tmp_path / "result_0.txt"
    simulate_run(log, mxfp6_cfg, CONVERGING[-2:])
    assert run_checker(log).returncode == 0
    forged = tmp_path / "forged.txt"
    forged.write_text(log.read_text().replace('"value": "mxfp6"', '"value": "mxfp5"'))
    assert forged.read_text().count('"mxfp5"') == 1
    res = run_checker(forged)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    msgs = checker_messages(out)
    assert len(msgs) == 1 and msgs[0].startswith("CHECK for 'lowest_numerical_precision_in_linear' failed"), out
    assert '"value": "mxfp5"' in msgs[0] and "'mxfp6', 'nvfp4'" in msgs[0], out  # the rule's own list


def test_rank_nonzero_writes_nothing(tmp_path, mxfp6_cfg):
    log = tmp_path / "sub" / "result_0.txt"
    simulate_run(log, mxfp6_cfg, CONVERGING, rank=3)
    assert not log.exists() and not log.parent.exists()


def test_two_loggers_do_not_share_output(tmp_path, mxfp6_cfg):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    la = MLPerfLogger(a, mxfp6_cfg, world_size=8)
    lb = MLPerfLogger(b, mxfp6_cfg, world_size=8)
    la.init_start()
    lb.eval_accuracy(0.5, 0)
    la.close(), lb.close()
    assert [r["key"] for r in read_log(a)] == ["init_start"]
    assert [r["key"] for r in read_log(b)] == ["eval_accuracy"]


def test_evaluation_frequency_rounds_up_to_the_global_batch(tmp_path):
    assert evaluation_frequency(512) == evaluation_frequency(4096) == 262144
    assert evaluation_frequency(3072) == 264192  # ceil(262144/3072)·3072
    cfg = load_recipe("flux12b-mxfp6-mlperf",
                      ["batch.global_batch_size=3072", "train.eval_every_samples=264192"])
    assert closed_division_problems(cfg, world_size=8) == []
    log = tmp_path / "result_0.txt"
    simulate_run(log, cfg, CONVERGING[-2:])
    assert values(log)["evaluation_frequency"] == 264192
    res = run_checker(log)
    assert res.returncode == 0, res.stdout + res.stderr


def test_closed_division_problems_names_the_offending_fields(mxfp6_cfg):
    assert closed_division_problems(mxfp6_cfg, world_size=8) == []
    bad = load_recipe("flux12b-mxfp6-mlperf", ["optim.weight_decay=0.01", "train.eval_every_samples=1024"])
    problems = closed_division_problems(bad, world_size=8)
    assert any("weight_decay" in p for p in problems) and any("eval_every_samples" in p for p in problems)


def test_run_stop_rejects_unknown_status(tmp_path, mxfp6_cfg):
    with MLPerfLogger(tmp_path / "x.txt", mxfp6_cfg) as mll, pytest.raises(ValueError):
        mll.run_stop(0, status="done")
