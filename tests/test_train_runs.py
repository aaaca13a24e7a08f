"""Never lose a run: real `mxflux` runs of a small tiny-mxfp6 in temp dirs, each checking the
message, the exit code and that nothing on disk was lost (run directory ownership, resume in
place, SIGINT then resume, truncated checkpoints, YAML errors, empty or non-finite data)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mxflux.cli import main
from mxflux.data import build_demo_dataset
from mxflux.train.checkpoint import load_checkpoint, read_checkpoint_meta

SMALL = ["--no-progress", "--set", "model.overrides={depth: 1, depth_single_blocks: 1}",
         "--set", "batch.global_batch_size=4", "--set", "batch.micro_batch_size=4", "--set", "train.log_every=1",
         "--set", "train.eval_samples=4", "--set", "train.eval_every_samples=100000", "--set",
         "train.sample_prompts=[]", "--set", "optim.warmup_steps=1", "--set", "train.train_samples=8"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_demo_dataset(tmp_path_factory.mktemp("d") / "demo", n_train=32, n_eval=8, seed=3)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """A finished 2-step run directory (copy it before changing anything)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "tiny-mxfp6", "--out", str(out), "--set", f"data.root={data}", *SMALL]) == 0
    return out


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def train_rows(run: Path) -> list[dict]:
    import csv

    with open(run / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r["split"] == "train"]


def test_a_second_run_into_a_finished_directory_is_refused(finished, data, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = snapshot(run)
    capsys.readouterr()
    rc = main(["train", "tiny-mxfp6", "--out", str(run), "--set", f"data.root={data}", *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "already holds a run at step 2" in err and f"--resume {run}" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert snapshot(run) == before  # not a byte changed
    # --overwrite starts over there explicitly.
    assert main(["train", "tiny-mxfp6", "--out", str(run), "--overwrite", "--set", f"data.root={data}", *SMALL]) == 0
    assert [r["step"] for r in train_rows(run)] == ["1", "2"]


def test_resume_continues_in_its_own_directory_and_a_finished_run_stays_as_it_is(data, tmp_path, monkeypatch,
                                                                                capsys):
    monkeypatch.chdir(tmp_path)  # the recipe's default out_dir (runs/...) would land here
    run = tmp_path / "mine"
    common = ["--set", f"data.root={data}", *SMALL, "--set", "train.train_samples=24"]
    assert main(["train", "tiny-mxfp6", "--out", str(run), "--max-steps", "4", *common]) == 0
    meta = read_checkpoint_meta(run)["progress"]
    assert meta["step"] == 4 and meta["blocks_outside_window"] > 0  # the zero-initialised model's first steps: 0
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0  # the checkpoint's own recipe
    assert not (tmp_path / "runs").exists()  # nothing written to the default directory
    rows = train_rows(run)
    assert [r["step"] for r in rows] == ["1", "2", "3", "4", "5", "6"]  # continued, no duplicates
    window = [int(r["blocks_outside_window"]) for r in rows]
    assert window[3] == meta["blocks_outside_window"] and window == sorted(window)  # continues, no restart
    assert read_checkpoint_meta(run)["progress"]["step"] == 6

    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "at step 6 of 6; nothing to train, nothing changed" in err
    assert snapshot(run) == before


def test_sigint_checkpoints_and_the_resumed_run_matches_an_uninterrupted_one(data, tmp_path, capsys):
    common = ["--set", f"data.root={data}", *SMALL, "--set", "train.train_samples=800"]
    run = tmp_path / "interrupted"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "mxflux.cli", "train", "tiny-mxfp6", "--out", str(run), *common],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 600
    while not ((run / "metrics.csv").exists() and len(train_rows(run)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    step = read_checkpoint_meta(run)["progress"]["step"]
    assert 2 <= step < 200 and "Traceback" not in err
    assert f"SIGINT: stopped after step {step}; checkpoint {run / 'latest.pt'}; " \
           f"continue with: mxflux train --resume {run}" in err
    assert [int(r["step"]) for r in train_rows(run)] == list(range(1, step + 1))  # every step logged, none lost

    assert main(["train", "--resume", str(run), "--max-steps", str(step + 2), "--no-progress"]) == 0
    ref = tmp_path / "uninterrupted"
    assert main(["train", "tiny-mxfp6", "--out", str(ref), "--max-steps", str(step + 2), *common]) == 0
    got, want = train_rows(run), train_rows(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [str(s) for s in range(1, step + 3)]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bit for bit (as logged)


def test_a_truncated_checkpoint_is_one_clear_error(finished, data, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ckpt = run / "latest.pt"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    before = snapshot(run)
    capsys.readouterr()
    for argv in (["eval", str(run)], ["train", "--resume", str(run), "--no-progress"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"checkpoint '{ckpt}' cannot be read" in err and "truncated" in err and "Traceback" not in err
    assert snapshot(run) == before


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "mine.yaml"
    bad.write_text("model:\n  name: flux-tiny\ntrain:\n  seed: [1, 2\n")
    for argv in (["train", str(bad)], ["check-config", str(bad)]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"recipe {bad}: YAML syntax error at line " in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]  # no run directory made


def test_an_empty_data_directory_is_one_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = tmp_path / "run"
    rc = main(["train", "tiny-mxfp6", "--out", str(run), "--set", f"data.root={empty}", *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and f"{empty} has no meta.json" in err and "Traceback" not in err
    assert not run.exists() or not any(run.iterdir())


def _poison(data: Path, out: Path, index: int) -> Path:
    """A copy of the dataset whose training sample `index` has NaN latents."""
    shutil.copytree(data, out)
    shard = out / "train" / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    begin, end = header["vae_mean"]["data_offsets"]
    per = (end - begin) // 32
    start = 8 + n + begin + index * per
    raw[start:start + per] = b"\xc0\x7f" * (per // 2)  # bf16 NaN
    shard.write_bytes(bytes(raw))
    return out


def test_non_finite_data_stops_the_run_naming_step_and_sample_and_keeps_the_good_checkpoint(data, tmp_path,
                                                                                           capsys):
    bad = _poison(data, tmp_path / "bad", index=13)
    run = tmp_path / "run"
    capsys.readouterr()
    rc = main(["train", "tiny-mxfp6", "--out", str(run), "--set", f"data.root={bad}", *SMALL,
               "--set", "train.train_samples=32", "--set", "train.checkpoint_every=1"])
    cap = capsys.readouterr()
    assert rc == 1 and "Traceback" not in cap.err, cap.err
    line = cap.err.strip().splitlines()[-1]
    indices = [i.strip() for i in line.split("dataset indices):")[1].split(";")[0].split(",")]
    assert "non-finite loss nan" in line and "13" in indices, line
    step = int(line.split("step ")[1].split(":")[0])
    assert "{" not in cap.out.splitlines()[-1]  # no summary JSON (it would have held NaN)
    if step == 1:
        assert not (run / "latest.pt").exists() and "no checkpoint was written" in line
    else:
        state = load_checkpoint(run)
        assert state["progress"]["step"] == step - 1 and f"the last good checkpoint, {run / 'latest.pt'}" in line
        assert all(torch.isfinite(t).all() for t in state["model"].values())
        assert [int(r["step"]) for r in train_rows(run)] == list(range(1, step))  # no row of the bad step


def test_cli_mistakes_exit_2_without_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--max-steps", "0"])
    assert exc.value.code == 2 and "--max-steps: expected a positive integer" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            main(["train", "--device", "cuda"])
        assert exc.value.code == 2 and "CUDA is not available" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step"])
    assert exc.value.code == 2 and "mxflux recipes" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_recipes_lists_every_recipe_and_check_config_warns_about_missing_paths(tmp_path, capsys):
    from mxflux.train.config import recipe_names

    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == recipe_names()
    assert any(line.startswith("tiny-mxfp6 ") and "MXFP6" in line for line in lines)
    assert main(["check-config", "tiny-mxfp6", "--set", f"data.root={tmp_path / 'nowhere'}"]) == 0
    assert f"warning: data.root '{tmp_path / 'nowhere'}' does not exist" in capsys.readouterr().err


def test_output_into_a_closed_pipe_ends_quietly():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "mxflux.cli", "recipes"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before anything is written (`| head` that already quit)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
