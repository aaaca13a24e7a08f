"""Never lose a run, round three, through the real CLI: a damaged checkpoint is never deleted unasked,
the lock never opens through a link, a resume may change only what RESUME_MAY_CHANGE lists (logged),
the data root is stored absolute and a replaced dataset is refused, optimizer fields are range-checked
where the recipe is read, and flipped bytes inside a checkpoint are named on load."""

from __future__ import annotations

import shutil
import signal
import sys
import time
import zipfile
from pathlib import Path

import pytest

from mxflux.data import build_demo_dataset
from mxflux.train.checkpoint import read_checkpoint_meta

sys.path.insert(0, str(Path(__file__).parent))
from test_run_safety import SMALL, cli, one_line_error, run, train_steps  # noqa: E402


def test_a_damaged_checkpoint_is_refused_and_kept(tmp_path):
    for make in (lambda p: p.mkdir(), lambda p: (p.mkdir(), (p / "__0_0.distcp").write_bytes(b"x"))):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        (out / "metrics.csv").write_text("step,samples,split,loss\n1,4,train,0.5\n")
        make(out / "latest.pt") if not (out / "latest.dcp").exists() else None
        rc, _, err = run("train", *SMALL, "--out", out)
        line = one_line_error(err)
        assert rc == 2 and "latest.pt, which is not a readable checkpoint" in line and "--overwrite" in line
        assert (out / "latest.pt").exists() and (out / "metrics.csv").exists()  # nothing deleted


def test_the_lock_never_opens_through_a_symbolic_link(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("not the run's\n")
    (out / ".mxflux.lock").symlink_to(precious)
    rc, _, err = run("train", *SMALL, "--out", out)
    assert rc == 2 and "a symbolic link where the run's lock file belongs" in one_line_error(err)
    assert precious.read_text() == "not the run's\n"


def test_a_resume_may_change_how_long_it_runs_but_not_what_it_is(tmp_path):
    out = tmp_path / "run"
    rc, _, err = run("train", *SMALL, "--out", out, "--max-steps", "1")
    assert rc == 0, err
    before = (out / "latest.pt").read_bytes()
    for change, field in (("optim.lr=5e-3", "optim.lr"), ("batch.global_batch_size=8", "batch.global_batch_size"),
                          ("train.ema_decay=0.99", "train.ema_decay"), ("train.seed=3", "train.seed")):
        rc, _, err = run("train", "--resume", out, "--no-progress", "--set", change)
        line = one_line_error(err)
        assert rc == 2 and f"{field}: checkpoint" in line and "a resume may change only" in line, line
    assert (out / "latest.pt").read_bytes() == before and train_steps(out) == [1]
    rc, _, err = run("train", "--resume", out, "--no-progress", "--set", "train.train_samples=12",
                     "--set", "train.log_every=2")
    assert rc == 0, err
    assert "note: the resumed run changes train.log_every: 1 -> 2; train.train_samples: 8 -> 12" in err
    assert read_checkpoint_meta(out)["progress"]["step"] == 3


def test_the_data_root_is_stored_absolute_and_a_replaced_dataset_is_refused(tmp_path):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    build_demo_dataset(here / "data", n_train=16, n_eval=8, seed=1)
    build_demo_dataset(elsewhere / "data", n_train=16, n_eval=8, seed=2)  # same relative path, other data
    out = tmp_path / "run"
    rc, _, err = run("train", *SMALL, "--out", out, "--set", "data.root=data", "--set", "train.train_samples=16",
                     "--max-steps", "1", cwd=here)
    assert rc == 0, err
    cfg = read_checkpoint_meta(out)["config"]
    assert cfg["data"]["root"] == str(here / "data")
    rc, out_text, err = run("train", "--resume", out, "--no-progress", "--max-steps", "2", cwd=elsewhere)
    assert rc == 0, err  # from another directory it trains on the run's own data
    assert f"data {here / 'data'}" in out_text
    shutil.rmtree(here / "data")
    build_demo_dataset(here / "data", n_train=24, n_eval=8, seed=3)  # replaced in place
    rc, _, err = run("train", "--resume", out, "--no-progress")
    line = one_line_error(err)
    assert rc == 2 and "data.train_samples: checkpoint 16, now 24" in line and "replaced or changed" in line


def test_optimizer_fields_out_of_range_are_refused_by_check_config():
    for field, value in (("optim.eps", "0"), ("optim.beta1", "1.0"), ("optim.beta2", "-0.1"),
                         ("optim.weight_decay", "-1")):
        rc, _, err = run("check-config", "tiny-mxfp6", "--set", f"{field}={value}")
        assert rc == 2 and f"{field}:" in err and "Traceback" not in err, err


def test_flipped_bytes_in_a_checkpoint_are_named_on_resume_and_eval(tmp_path):
    out = tmp_path / "run"
    rc, _, err = run("train", *SMALL, "--out", out, "--max-steps", "1")
    assert rc == 0, err
    ckpt = out / "latest.pt"
    data = bytearray(ckpt.read_bytes())
    with zipfile.ZipFile(ckpt) as z:  # a byte in the middle of the largest tensor record
        info = max(z.infolist(), key=lambda i: i.file_size)
    data[info.header_offset + 30 + len(info.filename) + info.file_size // 2 + len(info.extra)] ^= 0x10
    ckpt.write_bytes(data)
    for argv in (("train", "--resume", out, "--no-progress"), ("eval", out)):
        rc, _, err = run(*argv)
        line = one_line_error(err) if "error:" in err else err.strip().splitlines()[-1]
        assert rc == 2 and "is damaged: its record" in line and "fails its CRC-32" in line and str(ckpt) in line, err
    assert ckpt.read_bytes() == bytes(data)  # left as it was


def test_a_sharded_checkpoint_carries_checksums_and_flipped_bytes_are_named(tmp_path):
    from mxflux.train import load_recipe
    from mxflux.train.checkpoint import MANIFEST
    from mxflux.train.trainer import Trainer

    out = tmp_path / "run"
    rc, _, err = run("train", *SMALL, "--out", out, "--max-steps", "1")
    assert rc == 0, err
    cfg = load_recipe("tiny-mxfp6", ["model.overrides={depth: 1, depth_single_blocks: 1}",
                                     "batch.global_batch_size=4", "batch.micro_batch_size=4"])
    trainer = Trainer(cfg, device="cpu", out_dir=out)
    trainer.resume(out / "latest.pt")
    sharded = trainer.save(sharded=True)  # as a run under torchrun writes it (latest.pt is then stale: removed)
    shards = sorted(sharded.glob("*.distcp"))
    assert shards and (sharded / MANIFEST).is_file()
    rc, _, err = run("eval", out)  # the intact directory reads
    assert rc == 0, err
    shard = max(shards, key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(data)
    for argv in (("train", "--resume", out, "--no-progress"), ("eval", out)):
        rc, _, err = run(*argv)
        line = one_line_error(err) if "error:" in err else err.strip().splitlines()[-1]
        assert rc == 2 and f"is damaged: {shard.name} fails its CRC-32" in line and str(sharded) in line, err
    assert shard.read_bytes() == bytes(data)  # left as it was


@pytest.mark.parametrize("delay", [0.15, 0.3, 0.6])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_while_starting_is_one_line(tmp_path, sig, delay):
    """In the first tenths of a second (parsing, importing torch, building the model): one line naming the
    signal, 128 + its number, no traceback, no checkpoint."""
    proc = cli("train", *SMALL, "--out", tmp_path / "run")
    time.sleep(delay)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert "Traceback" not in err and len(lines) == 1 and sig.name in lines[0], err
    assert not (tmp_path / "run" / "latest.pt").exists()


def test_a_checkpoint_copied_in_from_another_run_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        rc, _, err = run("train", *SMALL, "--out", out, "--max-steps", "1")
        assert rc == 0, err
    run_a, run_b = (a / "run_id").read_text().strip(), (b / "run_id").read_text().strip()
    assert run_a != run_b and read_checkpoint_meta(a)["run_id"] == run_a
    metrics = (b / "metrics.csv").read_bytes()
    shutil.copy(a / "latest.pt", b / "latest.pt")
    for argv in (("train", "--resume", b, "--no-progress"), ("eval", b)):
        rc, _, err = run(*argv)
        line = one_line_error(err)
        assert rc == 2 and f"belongs to run {run_a}, but {b} holds run {run_b}" in line, line
    assert (b / "metrics.csv").read_bytes() == metrics  # nothing spliced
    shutil.copytree(a, tmp_path / "a-copy")  # a whole run directory copied is the same run
    rc, _, err = run("train", "--resume", tmp_path / "a-copy", "--no-progress")
    assert rc == 0, err


def test_a_disk_that_fills_during_the_checkpoint_write_is_one_line_with_the_space_needed(tmp_path, monkeypatch,
                                                                                          capsys):
    """torch's zip writer hides the errno (RuntimeError "file write failed"); with less free space than the
    checkpoint needs it is the full disk it is: one line naming the file and the space, exit 2, the previous
    checkpoint intact, the command that resumes."""
    import mxflux.train.checkpoint as checkpoint
    from mxflux.cli import main

    out = tmp_path / "run"
    assert main(["train", *SMALL, "--out", str(out)]) == 0
    before = (out / "latest.pt").read_bytes()

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file "
                           "data/3: file write failed")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--no-progress", "--set", "train.train_samples=16"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"run directory {out}: no space left on device: the checkpoint needs about 0.0" in line
    assert "GB, 0.00 GB free writing" in line and str(out / "latest.pt") in line
    assert f"free some space, then continue with: mxflux train --resume {out}" in line
    assert (out / "latest.pt").read_bytes() == before and not list(out.glob(".latest.pt.*.tmp"))


def test_a_stop_during_the_final_evaluation_is_honoured(tmp_path):
    """The last step's evaluation runs while the stop arrives: the run saves its end, says how to go on,
    exits 128 + the signal, and draws no samples (before: exit 0, sampling went on)."""
    from test_run_safety import wait_for

    out = tmp_path / "run"
    slow_eval = ["--set", "train.eval_samples=512", "--set", "train.eval_batch_size=1",
                 "--set", "train.sample_prompts=[a red circle]"]
    proc = cli("train", *SMALL, *slow_eval, "--out", out)
    wait_for(lambda: (out / "metrics.csv").exists() and 2 in train_steps(out), proc)  # the last step is logged
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert f"SIGTERM: stopped after step 2; checkpoint {out / 'latest.pt'}; continue with: mxflux train --resume " \
           f"{out}" in err
    assert read_checkpoint_meta(out)["progress"]["step"] == 2 and not (out / "samples.png").exists()


@pytest.mark.parametrize("recipe_text, overrides, message", [
    ("1: foo\nmodel: {name: flux-tiny}\n", [], "the top level has the key 1 (int); expected a field name"),
    ("model: {name: flux-tiny, 2: x}\n", [], "section model has the key 2 (int)"),
    ("model: {name: flux-tiny}\n", ["--set", "train.out_dir=runs/{nme}"], "names {nme}; the only placeholder is {name}"),
    ("model: {name: flux-tiny}\n", ["--set", "train.out_dir=runs/{name"], "is not a valid template"),
    ("model: {name: flux-tiny}\n", ["--set", "batch.global_batch_size=4096", "--set", "batch.micro_batch_size=4096"],
     "batch.global_batch_size: 4096 images a step, but the built-in demo dataset holds 2048 training samples"),
    # evaluation settings that failed only after training (a traceback; 0 a NaN loss that lost the run)
    ("model: {name: flux-tiny}\n", ["--set", "train.eval_samples=-5"], "train.eval_samples: Input should be greater"),
    ("model: {name: flux-tiny}\n", ["--set", "train.eval_samples=0"], "train.eval_samples: Input should be greater"),
], ids=["int-key", "nested-int-key", "out-dir-placeholder", "out-dir-brace", "batch-over-dataset", "eval-samples-neg",
        "eval-samples-zero"])
def test_recipe_mistakes_check_config_calls_ok_are_refused_by_both(tmp_path, recipe_text, overrides, message):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(recipe_text)
    for argv in (("check-config", recipe, *overrides), ("train", recipe, *overrides, "--out", tmp_path / "run")):
        rc, _, err = run(*argv)
        assert rc == 2 and "Traceback" not in err and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content", [bytes(range(256)) * 2, b"a;b\n1;2\n"], ids=["binary", "another-csv"])
def test_a_metrics_file_that_is_not_ours_is_refused_on_resume_and_left_as_it_is(tmp_path, content):
    out = tmp_path / "run"
    rc, _, err = run("train", *SMALL, "--out", out, "--max-steps", "1")
    assert rc == 0, err
    (out / "metrics.csv").write_bytes(content)
    before = (out / "latest.pt").read_bytes()
    rc, _, err = run("train", "--resume", out, "--no-progress")
    line = one_line_error(err)
    assert rc == 2 and f"{out / 'metrics.csv'}: not an mxflux metrics file" in line, err
    assert (out / "metrics.csv").read_bytes() == content and (out / "latest.pt").read_bytes() == before


def test_an_output_under_a_special_file_system_is_one_line(tmp_path):
    for out, message in (("/proc/mxflux-run", "no such file or directory: '/proc/mxflux-run'"),
                         ("/dev/null", "file exists: '/dev/null'")):
        rc, _, err = run("train", *SMALL, "--out", out)
        assert rc == 2 and message in one_line_error(err), err


@pytest.mark.parametrize("error", [
    lambda: __import__("torch").OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                         "to allocate 51539607552 bytes"),
    lambda: MemoryError(),
], ids=["cuda", "cpu-allocator", "python"])
def test_running_out_of_memory_while_building_the_model_is_one_line(tmp_path, monkeypatch, capsys, error):
    from mxflux.cli import main
    from mxflux.train import build

    def no_memory(*args, **kwargs):
        raise error()

    monkeypatch.setattr(build, "build_model", no_memory)
    rc = main(["train", *[str(a) for a in SMALL], "--out", str(tmp_path / "run")])
    line = one_line_error(capsys.readouterr().err)
    assert rc == 2 and "out of memory" in line and "batch.micro_batch_size" in line
    monkeypatch.undo()  # with the memory there, the same command runs: nothing left behind blocks it
    assert main(["train", *[str(a) for a in SMALL], "--out", str(tmp_path / "run"), "--max-steps", "1"]) == 0


def test_a_stop_signal_is_held_back_at_a_modules_top_level(monkeypatch):
    """A handler that raises while a module's top level runs C code (an extension loading) could unwind
    through C++ that cannot pass the exception on (pybind11 aborts the process: seen once for a SIGINT
    0.3 s into `train`): there the signal is sent again a moment later instead, and raised once a
    function of the program runs."""
    import types

    from mxflux.train import stop

    def a_function():
        return sys._getframe()

    scope = {}
    exec(compile("import sys\nframe = sys._getframe()", "<m>", "exec"), scope)  # a module's top level
    assert stop.unsafe_to_raise(scope["frame"]) and stop.unsafe_to_raise(None)
    assert not stop.unsafe_to_raise(a_function())
    sent = []
    monkeypatch.setattr(stop, "os", types.SimpleNamespace(kill=lambda pid, s: sent.append(s), getpid=lambda: 0))
    monkeypatch.setattr(stop, "_DEFERRED_S", {})
    with stop.signals_raise():
        signal.getsignal(signal.SIGINT)(signal.SIGINT, scope["frame"])  # held back: no Interrupted here
        time.sleep(0.2)
    assert sent == [signal.SIGINT]
    with pytest.raises(stop.Interrupted), stop.signals_raise():
        signal.getsignal(signal.SIGINT)(signal.SIGINT, a_function())


def test_a_stop_signal_is_held_back_where_python_would_ignore_the_exception(monkeypatch):
    """Inside the import machinery (its module-lock weakref callbacks run with exceptions ignored) or a
    `__del__`, an exception raised by the handler would be printed as "Exception ignored in" and the
    command would run on (seen in CI for a SIGINT 0.15 s into `train`): there too the signal is sent
    again a moment later instead."""
    import importlib

    from mxflux.train import stop

    frames = []

    class Finder:  # importlib calls a finder from its own code: the caller's frame is the machinery's
        def find_spec(self, name, path=None, target=None):
            frames.append(sys._getframe(1))
            return None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mxflux_no_such_module")
    assert frames and frames[0].f_code.co_filename.startswith("<frozen importlib")
    assert stop.unsafe_to_raise(frames[0])

    class Finalized:
        def __del__(self):
            frames.append(sys._getframe())

    Finalized()
    assert frames[-1].f_code.co_name == "__del__" and stop.unsafe_to_raise(frames[-1])
