"""Provenance in every result, and the fairness checks of a comparison (mxflux.bench.provenance,
mxflux.bench.fairness)."""

from __future__ import annotations

import subprocess

from mxflux.bench.fairness import comparison_warnings, spread
from mxflux.bench.provenance import REQUIRED_KEYS, check_provenance, git_state, provenance


def test_provenance_names_commit_card_versions_and_command(monkeypatch):
    monkeypatch.delenv("MXFLUX_GIT_COMMIT", raising=False)
    p = provenance(["mxflux", "bench", "step"])
    assert set(REQUIRED_KEYS) <= set(p) and p["command"] == "mxflux bench step"
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert p["commit"] == head and p["commit_source"] == "git" and isinstance(p["dirty"], bool)
    assert p["torch"] and p["date"].startswith("20") and p["card"]
    assert check_provenance({"provenance": p}) == []


def test_the_commit_the_caller_names_comes_before_git(tmp_path, monkeypatch):
    """A tree copied to a GPU machine may carry a stale .git (2026-12-06: the session's first commit,
    reported dirty); the commit the caller sent is named in the environment and wins."""
    monkeypatch.delenv("MXFLUX_GIT_COMMIT", raising=False)
    assert git_state(tmp_path) == (None, None, "unknown")
    assert git_state()[2] == "git"
    monkeypatch.setenv("MXFLUX_GIT_COMMIT", "abc123")
    monkeypatch.setenv("MXFLUX_GIT_DIRTY", "0")
    assert git_state(tmp_path) == ("abc123", False, "environment") and git_state() == ("abc123", False, "environment")


def test_missing_provenance_is_named():
    assert check_provenance({"step_ms": 1.0}) == ["provenance"]
    p = provenance()
    del p["driver"]
    p["commit"] = None
    assert check_provenance({"provenance": p}) == ["provenance.driver", "provenance.commit (unknown)"]


def _result(label, ms, *, mode=None, rounds=None, device="NVIDIA H100 80GB HBM3", load=None, steps=6):
    run_mode = {"compile": True, "compile_mode": "default", "cuda_graph": False, "optimizer": "auto",
                "activation_checkpointing": "none", **(mode or {})}
    r = {"label": label, "step_ms": ms, "run_mode": run_mode, "device": device, "steps": steps,
         "provenance": {"load_average": load or [0.1, 0.1, 0.1], "cpu_count": 2}}
    if rounds:
        r["rounds"] = {"step_ms": rounds}
    return r


def test_a_fair_comparison_has_no_warning():
    assert comparison_warnings([_result("bf16", 260.0), _result("fp8-tensorwise", 212.0), _result("mxfp6", 200.0)]) == []


def test_settings_that_differ_in_graphs_or_optimizer_are_named():
    w = comparison_warnings([_result("bf16", 150.0), _result("mxfp6-block-graphs", 120.0,
                                                             mode={"compile_mode": "reduce-overhead"})])
    assert len(w) == 1 and "compile_mode" in w[0] and "mxfp6-block-graphs reduce-overhead" in w[0]
    w = comparison_warnings([_result("fp8", 150.0), _result("mxfp6", 140.0, mode={"optimizer": "fused"})])
    assert "optimizer" in w[0]


def test_a_spread_larger_than_the_difference_is_named():
    a = _result("fp8-tensorwise", 100.0, rounds=[100.0, 104.0, 98.0])
    b = _result("mxfp6", 99.0, rounds=[99.0, 101.0, 97.0])
    assert spread(a) == 104.0 / 98.0 - 1
    (w,) = comparison_warnings([a, b])
    assert "spread" in w and "fp8-tensorwise 6.1%" in w and "(1.0%)" in w
    assert comparison_warnings([_result("x", 100.0, rounds=[100.0, 101.0]), _result("y", 80.0, rounds=[80.0, 81.0])]) == []


def test_a_busy_or_short_cpu_run_is_named():
    cpu = "cpu (torch 2.13.0+cpu, 2 threads)"
    w = comparison_warnings([_result("bf16", 30.0, device=cpu, load=[6.0, 6.0, 6.0], steps=3),
                             _result("mxfp6", 90.0, device=cpu, steps=3)])
    assert any("host was busy (load 6.0 on 2 cores" in x for x in w)
    assert sum("timed CPU steps in one round" in x for x in w) == 2
