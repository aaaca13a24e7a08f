"""The headline tables of benchmarks/RESULTS.md and the README are what their result JSON says
(benchmarks/results_tables.py), and the generator refuses results it cannot stand behind."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_tables", ROOT / "benchmarks" / "results_tables.py")
tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)


def test_the_committed_tables_are_what_their_json_says():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results_tables.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _copy(tmp_path: Path) -> Path:
    """The generator's inputs and targets in a directory of their own (no git there)."""
    spec = yaml.safe_load((ROOT / "benchmarks" / "claims.yaml").read_text())
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for rel in ("benchmarks/claims.yaml", "benchmarks/RESULTS.md", "README.md",
                *{f"benchmarks/{c['file']}" for key in ("claims", "cute_claims") for c in spec.get(key, ())},
                *(f"benchmarks/{f}" for key in ("cpu_threads", "convergence", "convergence_variants", "lora", "user_loop")
                  for f in spec.get(key, ())),
                *(f"benchmarks/{call['file']}" for call in spec.get("settings", ()))):
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert tables.main(["--base", str(tmp_path)]) == 0  # regenerated there ("code unknown to git here")
    return tmp_path


def test_a_number_edited_by_hand_fails_the_check(tmp_path):
    base = _copy(tmp_path)
    assert tables.main(["--check", "--base", str(base)]) == 0
    readme = base / "README.md"
    text = readme.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 2+4-block proxy (flux-12b width), MBS 64"))
    vs_fp8 = row.split("|")[5].strip()
    readme.write_text(text.replace(row, row.replace(vs_fp8, "**1.100x**")))
    assert tables.main(["--check", "--base", str(base)]) == 1


def test_a_convergence_or_lora_number_edited_by_hand_fails_the_check(tmp_path):
    base = _copy(tmp_path)
    for target, prefix in (("README.md", "| width 3072, 1+2 blocks"), ("benchmarks/RESULTS.md", "| mxfp6 | H100"),
                           ("benchmarks/RESULTS.md", "| width 128, 2+2 blocks, batch 16, 600 steps, cpu")):
        path = base / target
        text = path.read_text()
        row = next(line for line in text.splitlines() if line.startswith(prefix))
        path.write_text(text.replace(row, row.replace("|", "| 9", 3)[:-1] + "|"))
        assert tables.main(["--check", "--base", str(base)]) == 1
        path.write_text(text)
    assert tables.main(["--check", "--base", str(base)]) == 0


def _edit_results(base: Path, claim_id: str, edit) -> None:
    spec = yaml.safe_load((base / "benchmarks" / "claims.yaml").read_text())
    path = base / "benchmarks" / next(c["file"] for c in spec["claims"] if c["id"] == claim_id)
    results = json.loads(path.read_text())
    edit(results)
    path.write_text(json.dumps(results))


def test_a_trial_or_user_loop_number_edited_by_hand_fails_the_check(tmp_path):
    """The settings table (trials, memory settings) and the user-loop table are generated too."""
    base = _copy(tmp_path)
    path = base / "benchmarks" / "RESULTS.md"
    text = path.read_text()
    for prefix in ("| [4bcb084]", "| 64 | mxfp6-mxflux-adamw"):
        row = next(line for line in text.splitlines() if line.startswith(prefix))
        vs_fp8 = row.split("|")[4].strip() if prefix.startswith("| [") else row.split("|")[5].strip()
        path.write_text(text.replace(row, row.replace(vs_fp8, "1.100x")))
        assert tables.main(["--check", "--base", str(base)]) == 1
    path.write_text(text)
    assert tables.main(["--check", "--base", str(base)]) == 0


def test_a_trial_call_without_fp8_is_refused(tmp_path, capsys):
    base = _copy(tmp_path)
    claims = yaml.safe_load((base / "benchmarks" / "claims.yaml").read_text())
    headline = {c["file"] for c in claims["claims"]}  # (a headline claim's file fails on its claim first)
    rel = next(entry["file"] for entry in claims["settings"] if entry["file"] not in headline)
    path = base / "benchmarks" / rel
    path.write_text(json.dumps([r for r in json.loads(path.read_text()) if r["label"] != "fp8-tensorwise"]))
    assert tables.main(["--check", "--base", str(base)]) == 2
    assert "no torchao FP8 tensor-wise setting" in capsys.readouterr().err


def _claim_setting(claim_id: str) -> str:
    return next(c["setting"] for c in yaml.safe_load((ROOT / "benchmarks" / "claims.yaml").read_text())["claims"]
                if c["id"] == claim_id)


MBS64 = _claim_setting("proxy-mbs64")  # the headline's MXFP6 setting


@pytest.mark.parametrize("edit, message", [
    (lambda rs: [r.pop("provenance") for r in rs], "lacks provenance"),
    (lambda rs: [r["provenance"].pop("driver") for r in rs], "lacks provenance.driver"),
    (lambda rs: [r["run_mode"].update(cuda_graph=True) for r in rs if r["label"] == "bf16"],
     f"lacks a bf16 or torchao FP8 tensor-wise result run like '{MBS64}'"),
    (lambda rs: [r.update(device="NVIDIA H200") for r in rs if r["label"] == MBS64], "different cards"),
    (lambda rs: [r.update(failed="exit status 1") for r in rs if r["label"] == MBS64], "did not run"),
])
def test_results_it_cannot_stand_behind_are_refused(tmp_path, capsys, edit, message):
    base = _copy(tmp_path)
    _edit_results(base, "proxy-mbs64", edit)
    assert tables.main(["--check", "--base", str(base)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("results_tables: claim proxy-mbs64:") and message in err, err


def test_a_result_measured_before_the_code_changed_says_so(tmp_path):
    (commit,) = {c for c in [json.loads((ROOT / "benchmarks/results/bench_step_proxy_mbs64_h100_2026-12-06.json")
                                        .read_text())[0]["provenance_correction"]["commit"]]}
    changed = tables._changed_since(commit, ["src/mxflux/kernels"], ROOT)
    assert changed is not None  # the result's commit is in this checkout's history
    assert tables._changed_since("0" * 40, ["src"], ROOT) is None  # a commit git does not know
    row = tables.claim_row({"id": "x", "what": "w", "file": "results/bench_step_proxy_mbs64_h100_2026-12-06.json",
                            "setting": "mxfp6", "code": ["README.md"]}, ROOT)
    assert row["current"] == "code changed since: `README.md`"  # the README was rewritten after it


def test_comments_and_docstrings_are_not_code_changes():
    code = tables._code_of
    assert code('def f():\n    """doc"""\n    return 1  # one\n') == code("def f():\n    return 1\n")
    assert code("def f():\n    return 1\n") != code("def f():\n    return 2\n")
    assert code("def f(:\n") is None


def test_the_cpu_threads_table_is_generated_and_needs_provenance(tmp_path, capsys):
    base = _copy(tmp_path)
    results = (base / "benchmarks" / "RESULTS.md").read_text()
    assert "| mxflux | [c1b842c+dirty](results/cpu_threads_2026-12-06.json) | 17.4 | 33.4 | 1.92x |" in results
    path = base / "benchmarks" / "results" / "cpu_threads_2026-12-06.json"
    data = json.loads(path.read_text())
    del data["provenance"]
    path.write_text(json.dumps(data))
    assert tables.main(["--check", "--base", str(base)]) == 2
    assert "results/cpu_threads_2026-12-06.json: lacks provenance" in capsys.readouterr().err
