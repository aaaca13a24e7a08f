"""Never lose a run, round two: the real `mxflux` CLI in subprocesses, as a hostile user would use
it. One run per directory (two processes at once, repeated), resume only the run it was, stop
signals at every phase, and every user mistake one line with exit 2, checked on disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mxflux.data import build_demo_dataset
from mxflux.train.checkpoint import read_checkpoint_meta

SMALL = ["--no-progress", "--set", "model.overrides={depth: 1, depth_single_blocks: 1}",
         "--set", "batch.global_batch_size=4", "--set", "batch.micro_batch_size=4", "--set", "train.log_every=1",
         "--set", "train.eval_samples=4", "--set", "train.eval_every_samples=100000", "--set",
         "train.sample_prompts=[]", "--set", "optim.warmup_steps=1", "--set", "train.train_samples=8"]
SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SRC, *sys.path])}


def cli(*argv, cwd=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mxflux.cli", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=kw.pop("env", ENV), cwd=cwd, **kw)


def run(*argv, cwd=None, **kw) -> tuple[int, str, str]:
    proc = cli(*argv, cwd=cwd, **kw)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def one_line_error(err: str) -> str:
    """The error line (exactly one), with no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def train_steps(run_dir: Path) -> list[int]:
    import csv

    with open(run_dir / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r["split"] == "train"]


def wait_for(cond, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_demo_dataset(tmp_path_factory.mktemp("d") / "demo", n_train=32, n_eval=8, seed=3)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """A finished 2-step run directory (copy it before changing anything)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    rc, _, err = run("train", "tiny-mxfp6", "--out", out, "--set", f"data.root={data}", *SMALL)
    assert rc == 0, err
    return out


def copy_run(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    return run_dir


# --- one run per directory --------------------------------------------------------------------


@pytest.mark.parametrize("round_", range(3))
def test_two_trains_at_once_into_one_directory_exactly_one_runs(data, tmp_path, round_):
    out = tmp_path / "run"
    procs = [cli("train", "tiny-mxfp6", "--out", out, "--set", f"data.root={data}", *SMALL) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, _, err in results if rc == 2)
    line = one_line_error(loser)
    # The loser either found the directory locked, or (started after the winner finished) a finished run.
    assert f"run directory {out} is in use by process " in line or "already holds a run at step 2" in line, line
    assert "wait for it to end, or choose another --out" in line or "--resume" in line
    assert train_steps(out) == [1, 2]  # one run's rows, none mixed or repeated
    assert read_checkpoint_meta(out)["progress"]["step"] == 2
    assert not (out / ".mxflux.lock").exists()  # released by the run that held it


def test_two_resumes_at_once_continue_the_run_once(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    procs = [cli("train", "--resume", run_dir, "--set", "train.train_samples=16", "--no-progress") for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 0] or codes == [0, 2], results
    if codes == [0, 2]:
        assert f"run directory {run_dir} is in use by process " in one_line_error(
            next(err for rc, _, err in results if rc == 2))
    else:  # the second started after the first had finished: nothing left to train, it changed nothing
        assert any("nothing to train, nothing changed" in err for _, _, err in results), results
    assert train_steps(run_dir) == [1, 2, 3, 4]
    assert read_checkpoint_meta(run_dir)["progress"]["step"] == 4


def test_a_run_killed_before_its_first_checkpoint_leaves_a_directory_a_new_run_takes(data, tmp_path):
    out = tmp_path / "run"
    proc = cli("train", "tiny-mxfp6", "--out", out, "--set", f"data.root={data}", *SMALL,
               "--set", "train.train_samples=4000")
    wait_for(lambda: (out / "metrics.csv").exists() and len(train_steps(out)) >= 1, proc)
    dead = proc.pid
    proc.kill()  # SIGKILL: no handler runs, the lock file stays behind
    proc.communicate()
    assert (out / ".mxflux.lock").exists() and not (out / "latest.pt").exists()
    (out / ".latest.pt.abc123.tmp").write_bytes(b"half a checkpoint")  # a write cut short
    rc, _, err = run("train", "tiny-mxfp6", "--out", out, "--set", f"data.root={data}", *SMALL)  # no --overwrite
    assert rc == 0, err
    assert f"took over the stale lock of process {dead} " in err and "no longer running" in err
    assert "stopped before its first checkpoint" in err
    assert train_steps(out) == [1, 2] and read_checkpoint_meta(out)["progress"]["step"] == 2
    assert not list(out.glob(".latest.pt.*.tmp")) and not (out / ".mxflux.lock").exists()


def test_leftover_temp_files_go_on_start_and_with_overwrite(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    (run_dir / ".latest.pt.x1.tmp").write_bytes(b"partial")
    rc, _, err = run("train", "--resume", run_dir, "--set", "train.train_samples=12", "--no-progress")
    assert rc == 0, err
    assert not list(run_dir.glob(".latest.pt.*.tmp"))
    (run_dir / ".latest.pt.x2.tmp").write_bytes(b"partial")
    rc, _, err = run("train", "tiny-mxfp6", "--out", run_dir, "--overwrite", "--set",
                     f"data.root={read_checkpoint_meta(run_dir)['config']['data']['root']}", *SMALL)
    assert rc == 0, err
    assert not list(run_dir.glob(".latest.pt.*.tmp")) and train_steps(run_dir) == [1, 2]


# --- resume only what the run was ------------------------------------------------------------


def test_resume_refuses_another_precision_model_or_data_and_allows_a_precision_change_on_request(
        finished, data, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    before = (run_dir / "latest.pt").read_bytes()
    more = ["--set", "train.train_samples=16"]
    rc, _, err = run("train", "tiny-bf16", "--resume", run_dir, *SMALL, "--set", f"data.root={data}", *more)
    line = one_line_error(err)
    assert rc == 2 and 'precision.fp6: checkpoint "e2m3", now null' in line and "--allow-precision-change" in line
    rc, _, err = run("train", "--resume", run_dir, "--no-progress", *more,
                     "--set", "model.overrides={depth: 2, depth_single_blocks: 1}")
    line = one_line_error(err)
    assert rc == 2 and "model.depth: checkpoint 1, now 2" in line and "--allow-precision-change" not in line
    other = build_demo_dataset(tmp_path / "other", n_train=16, n_eval=8, seed=4)
    rc, _, err = run("train", "--resume", run_dir, "--no-progress", *more, "--set", f"data.root={other}")
    assert rc == 2 and f'data.root: checkpoint "{data}", now "{other}"' in one_line_error(err)
    assert (run_dir / "latest.pt").read_bytes() == before and train_steps(run_dir) == [1, 2]

    rc, _, err = run("train", "tiny-bf16", "--resume", run_dir, "--allow-precision-change", *SMALL,
                     "--set", f"data.root={data}", *more)
    assert rc == 0, err
    assert "note: the resumed run changes" in err and "precision.fp6: \"e2m3\" -> null" in err
    meta = read_checkpoint_meta(run_dir)
    assert meta["progress"]["step"] == 4 and meta["identity"]["precision"]["fp6"] is None


# --- stop signals at every phase -------------------------------------------------------------


def test_sighup_checkpoints_like_sigterm_and_the_run_resumes(data, tmp_path):
    out = tmp_path / "run"
    proc = cli("train", "tiny-mxfp6", "--out", out, "--set", f"data.root={data}", *SMALL,
               "--set", "train.train_samples=4000")
    wait_for(lambda: (out / "metrics.csv").exists() and len(train_steps(out)) >= 2, proc)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=300)
    step = read_checkpoint_meta(out)["progress"]["step"]
    assert proc.returncode == 128 + signal.SIGHUP and "Traceback" not in err
    assert f"SIGHUP: stopped after step {step}; checkpoint {out / 'latest.pt'}; " \
           f"continue with: mxflux train --resume {out}" in err
    rc, _, err = run("train", "--resume", out, "--max-steps", step + 1, "--no-progress")
    assert rc == 0, err
    assert train_steps(out) == list(range(1, step + 2))


def test_sigint_during_start_up_is_one_line_and_the_directory_stays_free(tmp_path):
    out = tmp_path / "run"
    # data.root null: start-up builds the demo dataset (seconds), which is where the signal lands
    proc = cli("train", "tiny-mxfp6", "--out", out, *SMALL, cwd=tmp_path)
    wait_for(lambda: (out / ".mxflux.lock").exists(), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == \
        f"SIGINT during start-up: stopped, without a new checkpoint; no checkpoint was written; {out} is free " \
        f"for a new run"
    assert not (out / "latest.pt").exists() and not (out / ".mxflux.lock").exists()


def test_a_second_sigint_stops_at_once_and_keeps_the_last_checkpoint(data, tmp_path):
    out = tmp_path / "run"
    proc = cli("train", "tiny-mxfp6", "--out", out, "--set", f"data.root={data}", *SMALL,
               "--set", "train.train_samples=4000", "--set", "train.checkpoint_every=1")
    wait_for(lambda: (out / "latest.pt").exists() and len(train_steps(out)) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("SIGINT again: stopped at once, without a new checkpoint; the last checkpoint, "
                           f"{out / 'latest.pt'}, is kept; continue with: mxflux train --resume {out}") \
        or last.startswith("SIGINT: stopped after step "), err
    step = read_checkpoint_meta(out)["progress"]["step"]  # loadable: nothing lost
    assert step >= 2 and not list(out.glob(".latest.pt.*.tmp"))
    assert train_steps(out)[:step] == list(range(1, step + 1))


def test_sigint_during_the_final_sampling_and_a_resume_draws_the_samples(data, tmp_path):
    out = tmp_path / "run"
    sampling = [*SMALL, "--set", "train.sample_prompts=[a red circle]", "--set", "train.sample_steps=100000"]
    proc = cli("train", "tiny-mxfp6", "--out", out, "--set", f"data.root={data}", *sampling)
    wait_for(lambda: (out / "latest.pt").exists(), proc)  # the final checkpoint: sampling follows it
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"SIGINT during the final sampling: the run is finished (the last checkpoint, {out / 'latest.pt'}, is "
        f"kept); samples.png was not written; draw it with: mxflux train --resume {out}")
    assert not (out / "samples.png").exists() and not list(out.glob(".samples.png.*.tmp"))
    before = (out / "latest.pt").read_bytes()
    rc, stdout, err = run("train", "--resume", out, "--no-progress", "--set", "train.sample_steps=2")
    assert rc == 0, err
    assert json.loads(stdout.splitlines()[-1])["samples_png"] == str(out / "samples.png")
    assert (out / "samples.png").stat().st_size > 0 and (out / "latest.pt").read_bytes() == before
    assert train_steps(out) == [1, 2]


# --- user errors: one line, exit 2, named ----------------------------------------------------


def test_data_that_does_not_fit_the_model_is_refused_by_train_and_check_config(data, tmp_path):
    wrong = ["--set", f"data.root={data}", "--set", "model.overrides={context_in_dim: 128}"]
    rc, _, err = run("check-config", "tiny-mxfp6", *wrong)
    line = one_line_error(err)
    assert rc == 2 and f"data.root '{data}' (T5 32x64, CLIP 32, latent 16x16x16) does not fit model flux-tiny" in line
    assert "T5 width 64 vs context_in_dim 128" in line
    rc, _, err = run("train", "tiny-mxfp6", "--out", tmp_path / "run", *SMALL, *wrong)
    assert rc == 2 and "T5 width 64 vs context_in_dim 128" in one_line_error(err)
    assert not (tmp_path / "run" / "latest.pt").exists()


def test_precision_include_matching_nothing_device_mps_and_an_empty_recipe(data, tmp_path):
    nothing = ["--set", "precision.include=[double_blocks.9.*]", "--set", f"data.root={data}"]
    for argv in (["check-config", "tiny-mxfp6", *nothing],
                 ["train", "tiny-mxfp6", "--out", tmp_path / "a", *SMALL, *nothing]):
        rc, _, err = run(*argv)
        assert rc == 2 and "precision.include: pattern 'double_blocks.9.*' matches no nn.Linear" in \
            one_line_error(err)
    rc, _, err = run("train", "tiny-mxfp6", "--out", tmp_path / "b", "--device", "mps", *SMALL)
    assert rc == 2 and "--device mps: mxflux runs on cpu or cuda (cuda:N); mps is not supported" in \
        one_line_error(err)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    for argv in (["check-config", empty], ["train", empty, "--out", tmp_path / "c"]):
        rc, _, err = run(*argv)
        assert rc == 2 and f"recipe {empty} is empty: expected a mapping of sections" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.yaml"]  # no run directory made


def test_a_full_disk_is_one_line_and_the_last_checkpoint_stays(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    before = (run_dir / "latest.pt").read_bytes()
    (run_dir / "loss_curve.png").unlink()
    (run_dir / "loss_curve.png").symlink_to("/dev/full")  # every write there: ENOSPC, from the kernel
    rc, _, err = run("train", "--resume", run_dir, "--set", "train.train_samples=16", "--no-progress")
    line = one_line_error(err)
    assert rc == 2 and f"run directory {run_dir}: no space left on device" in line
    assert f"its checkpoint at step 2 is as it was; free some space, then continue with: mxflux train " \
           f"--resume {run_dir}" in line
    assert (run_dir / "latest.pt").read_bytes() == before  # the last checkpoint, untouched
    assert not list(run_dir.glob(".latest.pt.*.tmp"))


def _without_root_powers() -> dict:
    """Popen arguments under which permissions apply: as root, the process gives up the two
    capabilities that let root read and write whatever it likes (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH), dropped from its bounding set before exec."""
    if os.geteuid() != 0:
        return {}

    def drop():
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return {"preexec_fn": drop}


def test_permission_problems_say_permission(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    plain = _without_root_powers()
    os.chmod(run_dir / "latest.pt", 0)
    try:
        for argv in (["eval", run_dir], ["train", "--resume", run_dir, "--no-progress"]):
            rc, _, err = run(*argv, **plain)
            line = one_line_error(err)
            assert rc == 2 and f"permission denied: '{run_dir / 'latest.pt'}'" in line, err
            assert "truncated" not in line and "No such file" not in line
    finally:
        os.chmod(run_dir / "latest.pt", 0o644)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    rc, _, err = run("train", "tiny-mxfp6", "--out", locked / "run", *SMALL, **plain)
    assert rc == 2 and f"permission denied: '{locked / 'run'}'" in one_line_error(err)
    assert list(locked.iterdir()) == []


def test_wrong_words_fixed_file_not_directory_resume_hints_and_refusals(finished, data, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a dataset")
    rc, _, err = run("train", "tiny-mxfp6", "--out", tmp_path / "x", *SMALL, "--set", f"data.root={a_file}")
    line = one_line_error(err)
    assert rc == 2 and f"dataset directory {a_file} is a file, expected a directory" in line
    assert "does not exist" not in line
    rc, _, err = run("check-config", "tiny-mxfp6", "--set", f"data.root={a_file}")
    assert rc == 0 and f"warning: data.root '{a_file}' is a file, expected a dataset directory" in err

    run_dir = copy_run(finished, tmp_path)  # at step 2 of 2
    rc, _, err = run("train", "--resume", run_dir, "--max-steps", "1", "--no-progress")
    assert rc == 0 and "at step 2 of 1; nothing to train, nothing changed. To train longer, raise --max-steps " \
                       "(now 1)." in err and "train_samples" not in err
    rc, _, err = run("train", "--resume", run_dir, "--no-progress")
    assert rc == 0 and "raise train.train_samples (now 8) with --set" in err

    ckpt = run_dir / "latest.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated: --resume cannot work, so it is not advised
    rc, _, err = run("train", "tiny-mxfp6", "--out", run_dir, *SMALL, "--set", f"data.root={data}")
    line = one_line_error(err)
    assert rc == 2 and "holds a run whose checkpoint cannot be read" in line and "--overwrite" in line
    assert "--resume" not in line


def test_sample_out_directory_and_eval_writes_nothing(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    grids = tmp_path / "grids"
    grids.mkdir()
    rc, out, err = run("sample", run_dir, "--prompt", "a red circle", "--steps", "1", "--out", f"{grids}/")
    assert rc == 0, err
    assert json.loads(out)["samples"] == str(grids / "samples.png") and (grids / "samples.png").is_file()
    rc, _, err = run("sample", run_dir, "--prompt", "a red circle", "--out", tmp_path / "grid.jpg")
    assert rc == 2 and "--out" in one_line_error(err) and "expected a .png file or a directory" in err

    # A run on the built-in demo (data.root null): eval reads the demo without building it in the cwd.
    state = torch.load(run_dir / "latest.pt", weights_only=False)
    state["config"]["data"]["root"] = None
    torch.save(state, run_dir / "latest.pt")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    rc, out, err = run("eval", run_dir, cwd=cwd)
    assert rc == 0, err
    assert json.loads(out)["step"] == 2 and list(cwd.iterdir()) == []


def test_a_short_captions_file_is_refused(data, tmp_path):
    short = tmp_path / "short"
    shutil.copytree(data, short)
    captions = short / "train" / "captions.jsonl"
    captions.write_text("".join(captions.read_text().splitlines(keepends=True)[:-3]))
    rc, _, err = run("train", "tiny-mxfp6", "--out", tmp_path / "run", *SMALL, "--set", f"data.root={short}")
    line = one_line_error(err)
    assert rc == 2 and f"{captions}: 29 captions for 32 train samples; expected one JSON string per sample" in line
    assert not (tmp_path / "run" / "latest.pt").exists()
