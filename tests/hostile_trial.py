"""A hostile trial of the CLI: adversarial cases through the real `mxflux` command, each judged on what
a user sees and what is left on disk.

    PYTHONPATH=src python tests/hostile_trial.py --out /tmp/trial [--jobs 2] [--kills 32] [--seed 0]

Cases (132 with the defaults):
- kill -9 at a random moment of a run that checkpoints every step, then resume: the resume must run to
  the end, the checkpoint load, and the training rows be every step once (no row lost or repeated);
- SIGINT / SIGTERM / SIGHUP at a random moment: exit 0 (finished first) or 128+signal, one line, and a
  resume that finishes;
- user mistakes (recipe fields of the wrong type or range, paths that cannot be, commands given
  nonsense), resume mistakes (another run's checkpoint, changed fields, damaged checkpoints of every
  kind, a foreign metrics file, a linked lock) and file-system trouble: exit 2 with one line naming
  the problem, and every file that was there before left byte for byte.

A case fails on a traceback, on an exit code other than the expected ones, or on a file changed or
deleted that the case did not allow. Writes trial.json (every case: command, exit code, last line,
verdict) and prints the failures; exit 1 if any. Not part of `make test` (minutes on 2 cores): the
tests that guard each class run there; this is the trial they are checked against.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SRC, *sys.path])}
SMALL = ["--no-progress", "--set", "model.overrides={depth: 1, depth_single_blocks: 1}",
         "--set", "batch.global_batch_size=4", "--set", "batch.micro_batch_size=4", "--set", "train.log_every=1",
         "--set", "train.eval_samples=4", "--set", "train.eval_every_samples=100000", "--set",
         "train.sample_prompts=[]", "--set", "optim.warmup_steps=1"]


KILL_STEPS = 60  # the killed runs: long enough that most signals land mid-run, a checkpoint every step


def mxflux(*argv, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mxflux.cli", *map(str, argv)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (not following links) and its sha256."""
    out = {}
    for p in sorted(root.rglob("*")) if root.exists() else ():
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def verdict(proc, allowed: tuple[int, ...]) -> str | None:
    err = proc.stderr
    if "Traceback" in err:
        return "traceback"
    if proc.returncode not in allowed:
        return f"exit {proc.returncode}, expected {allowed}"
    if proc.returncode == 2:
        lines = [x for x in err.strip().splitlines() if "error:" in x]
        if len(lines) != 1:
            return f"{len(lines)} error lines"
    return None


def train_rows(run: Path) -> list[int]:
    import csv

    with open(run / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r["split"] == "train"]


class Trial:
    def __init__(self, out: Path, data: Path, finished: Path, seed: int):
        self.out, self.data, self.finished = out, data, finished
        self.rng = random.Random(seed)
        self.results: list[dict] = []

    def record(self, name: str, argv, proc, problem: str | None) -> None:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        self.results.append({"case": name, "argv": [str(a) for a in argv], "rc": proc.returncode,
                             "last_line": last[:300], "problem": problem})

    def copy(self, name: str) -> Path:
        d = self.out / "cases" / name
        shutil.copytree(self.finished, d / "run")
        return d / "run"

    # --- cases ---------------------------------------------------------------------------------------

    def refused(self, name: str, argv, *, keep: Path | None = None, cwd=None) -> None:
        """A mistake: one line, exit 2, nothing under `keep` changed."""
        before = snapshot(keep) if keep else None
        logs = {p: p.read_bytes() for p in keep.rglob("train.log")} if keep else {}
        proc = mxflux(*argv, cwd=cwd)
        problem = verdict(proc, (2,))
        if keep is not None:
            # the run's own log may say what was refused (appended); nothing else may change
            after = snapshot(keep)
            changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)
                       and not (k.endswith("train.log") and (keep / k).read_bytes().startswith(logs[keep / k]))}
            if changed:
                problem = (problem + "; " if problem else "") + f"files changed or deleted: {sorted(changed)}"
        self.record(name, argv, proc, problem)

    def killed(self, name: str, sig: int, delay: float) -> None:
        run = self.out / "cases" / name / "run"
        argv = ["train", "tiny-mxfp6", "--out", run, "--set", f"data.root={self.data}", *SMALL,
                "--set", f"train.train_samples={4 * KILL_STEPS}", "--set", "train.checkpoint_every=1"]
        proc = subprocess.Popen([sys.executable, "-m", "mxflux.cli", *map(str, argv)], env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
        first = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        allowed = (0, -9) if sig == signal.SIGKILL else (0, 128 + sig, 2)
        if sig != signal.SIGKILL and proc.returncode == -sig and '"eval_loss"' in out:
            # the command had finished (its result printed): the signal met the interpreter's own shutdown,
            # where Python has put the default handlers back; nothing of the run is at stake
            allowed = (-sig,)
        problem = None if sig == signal.SIGKILL else verdict(first, allowed)
        if problem is None and first.returncode == 2 and "interrupted" not in err:
            problem = "exit 2 without saying it was interrupted"
        if problem:
            self.record(name, argv, first, problem)
            return
        # then finish the run: a resume where a checkpoint exists, else a new start in the same directory
        resume = ["train", "--resume", run, "--no-progress"] if (run / "latest.pt").exists() else argv
        second = mxflux(*resume)
        problem = verdict(second, (0,))
        if problem is None:
            rows = train_rows(run)
            if rows != list(range(1, KILL_STEPS + 1)):
                problem = f"training rows {rows}: not every step once"
            else:
                check = mxflux("eval", run)
                problem = verdict(check, (0,)) and f"the final checkpoint does not evaluate: {check.stderr[-200:]}"
        self.record(name, resume, second, problem)

    def all_cases(self, kills: int) -> list[tuple[str, object]]:
        """(name, the case to run) for every case."""
        d, f = self.data, self.finished
        cases = []
        for i in range(kills):
            cases.append((f"kill9-{i}", lambda i=i: self.killed(f"kill9-{i}", signal.SIGKILL, self.rng.uniform(1.0, 9.0))))
        for i, sig in enumerate([signal.SIGINT, signal.SIGTERM, signal.SIGHUP] * 8):
            cases.append((f"signal-{sig.name}-{i}",
                          lambda i=i, sig=sig: self.killed(f"signal-{sig.name}-{i}", sig,
                                                           self.rng.uniform(0.03, 0.3) if i < 6 else  # start-up
                                                           self.rng.uniform(0.3, 8.0))))
        base = ["train", "tiny-mxfp6", "--set", f"data.root={d}", *SMALL]
        mistakes = [
            ("lr-string", ["--set", "optim.lr=fast"]), ("lr-negative", ["--set", "optim.lr=-1"]),
            ("lr-nan", ["--set", "optim.lr=nan"]), ("beta1-1", ["--set", "optim.beta1=1.0"]),
            ("eps-0", ["--set", "optim.eps=0"]), ("decay-negative", ["--set", "optim.weight_decay=-0.1"]),
            ("clip-0", ["--set", "optim.grad_clip=0"]), ("warmup-negative", ["--set", "optim.warmup_steps=-3"]),
            ("batch-0", ["--set", "batch.global_batch_size=0"]), ("mbs-bigger", ["--set", "batch.micro_batch_size=64"]),
            ("batch-not-multiple", ["--set", "batch.global_batch_size=6"]),
            ("batch-over-data", ["--set", "batch.global_batch_size=4096", "--set", "batch.micro_batch_size=4096"]),
            ("samples-0", ["--set", "train.train_samples=0"]), ("eval-samples-0", ["--set", "train.eval_samples=0"]),
            ("eval-every-0", ["--set", "train.eval_every_samples=0"]), ("log-every-0", ["--set", "train.log_every=0"]),
            ("ckpt-every-0", ["--set", "train.checkpoint_every=0"]), ("dtype-fp16", ["--set", "train.compute_dtype=float16"]),
            ("ema-1", ["--set", "train.ema_decay=1.0"]), ("shift-0", ["--set", "train.timestep_shift=0"]),
            ("unknown-key", ["--set", "train.learning_rate=1e-3"]), ("unknown-section", ["--set", "trian.seed=1"]),
            ("no-equals", ["--set", "optim.lr"]), ("yaml-broken", ["--set", "model.overrides={depth: "]),
            ("model-unknown", ["--set", "model.name=flux-99b"]), ("heads-odd", ["--set", "model.overrides.num_heads=3"]),
            ("precision-both", ["--set", "precision.fp8=hybrid"]), ("fp4", ["--set", "precision.fp4=mxfp4"]),
            ("include-typo", ["--set", "precision.include=[double_blocks.*.img_atn.qkv]"]),
            ("mx-gemm-bad", ["--set", "precision.mx_gemm=columnwise"]), ("ac-bad", ["--set", "model.activation_checkpointing=half"]),
            ("compile-mode-bad", ["--set", "model.compile_mode=fastest"]),
            ("data-missing", ["--set", "data.root=/nonexistent/data"]), ("data-file", ["--set", f"data.root={__file__}"]),
            ("data-proc", ["--set", "data.root=/proc/self"]), ("init-missing", ["--set", "model.init_from=/nonexistent.safetensors"]),
            ("init-not-weights", ["--set", f"model.init_from={__file__}"]), ("out-template", ["--set", "train.out_dir=runs/{nme}"]),
            ("out-under-file", ["--out", f"{__file__}/run"]), ("out-proc", ["--out", "/proc/self/run"]),
            ("device-bogus", ["--device", "tpu"]), ("max-steps-0", ["--max-steps", "0"]),
            ("guidance-no-embedder", ["--set", "train.distilled_guidance=3.5"]),
            ("lora-no-base", ["--set", "lora={rank: 4}"]), ("lora-rank-0", ["--set", "lora={rank: 0}"]),
            ("cuda-graph-cpu", ["--set", "train.cuda_graph=true"]), ("key-not-string", ["--set", "model.overrides={1: 2}"]),
            ("num-workers-negative", ["--set", "data.num_workers=-1"]), ("cfg-dropout-2", ["--set", "data.cfg_dropout=2"]),
        ]
        for name, extra in mistakes:
            cases.append((f"mistake-{name}", lambda name=name, extra=extra: self.refused(
                f"mistake-{name}", [*base, "--out", self.out / "cases" / name / "run", *extra])))
        commands = [
            ("recipe-missing", ["train", "no-such-recipe"]), ("recipe-file-missing", ["train", "/nonexistent/recipe.yaml"]),
            ("eval-nothing", ["eval", "/nonexistent/run"]), ("sample-nothing", ["sample", "/nonexistent/run", "--prompt", "x"]),
            ("sample-steps-0", ["sample", f, "--prompt", "x", "--steps", "0"]), ("sample-out-txt", ["sample", f, "--prompt", "x", "--out", "x.txt"]),
            ("sample-lora-without-weights", ["sample", f, "--prompt", "x", "--lora", "a.safetensors"]),
            ("export-exists", ["export", f, "--out", __file__]), ("export-not-safetensors", ["export", f, "--out", "x.bin"]),
            ("check-config-bad", ["check-config", "tiny-mxfp6", "--set", "optim.lr=-1"]),
            ("bench-unknown", ["bench", "step", "--settings", "fp5"]), ("data-prepare-nothing", ["data", "prepare", "--images", "/nonexistent", "--out", "x"]),
        ]
        for name, argv in commands:
            cases.append((f"command-{name}", lambda name=name, argv=argv: self.refused(
                f"command-{name}", argv, keep=self.finished, cwd=self.out / "cases")))
        resume_cases = [
            ("changed-lr", lambda r: ["train", "--resume", r, "--no-progress", "--set", "optim.lr=1"]),
            ("changed-batch", lambda r: ["train", "--resume", r, "--no-progress", "--set", "batch.global_batch_size=8"]),
            ("changed-seed", lambda r: ["train", "--resume", r, "--no-progress", "--set", "train.seed=5"]),
            ("changed-model", lambda r: ["train", "--resume", r, "--no-progress", "--set", "model.overrides.depth=2"]),
            ("add-lora", lambda r: ["train", "--resume", r, "--no-progress", "--set", "lora={rank: 4}"]),
            ("truncated", self._truncate), ("flipped", self._flip), ("latest-dir", self._latest_dir),
            ("latest-empty", self._latest_empty), ("foreign-checkpoint", self._foreign), ("foreign-metrics", self._foreign_metrics),
            ("linked-lock", self._linked_lock), ("sharded-no-metadata", self._sharded_no_metadata),
            ("plain-train-on-damaged", self._plain_train_damaged), ("run-id-missing-mismatch", self._run_id_changed),
            ("resume-nothing", lambda r: ["train", "--resume", r.parent / "nothing", "--no-progress"]),
        ]
        for name, make in resume_cases:
            cases.append((f"resume-{name}", lambda name=name, make=make: self._resume_case(name, make)))
        return cases

    def _resume_case(self, name, make) -> None:
        run = self.copy(f"resume-{name}")
        argv = make(run)
        self.refused(f"resume-{name}", argv, keep=run.parent)

    def _truncate(self, r):
        (r / "latest.pt").write_bytes((r / "latest.pt").read_bytes()[:5000])
        return ["train", "--resume", r, "--no-progress"]

    def _flip(self, r):
        data = bytearray((r / "latest.pt").read_bytes())
        data[len(data) // 2] ^= 0x40
        (r / "latest.pt").write_bytes(data)
        return ["eval", r]

    def _latest_dir(self, r):
        (r / "latest.pt").unlink()
        (r / "latest.pt").mkdir()
        return ["train", "--resume", r, "--no-progress"]

    def _latest_empty(self, r):
        (r / "latest.pt").write_bytes(b"")
        return ["train", "--resume", r, "--no-progress"]

    def _foreign(self, r):
        other = self.copy("resume-foreign-other-run")
        rid = other / "run_id"
        rid.write_text("0123456789abcdef0123456789abcdef\n")  # another run's id in the directory copied into
        shutil.copy(other / "latest.pt", r / "latest.pt")
        (r / "run_id").write_text("fedcba9876543210fedcba9876543210\n")
        return ["train", "--resume", r, "--no-progress"]

    def _foreign_metrics(self, r):
        (r / "metrics.csv").write_text("epoch,acc\n1,0.5\n")
        return ["train", "--resume", r, "--no-progress", "--set", "train.train_samples=16"]

    def _linked_lock(self, r):
        target = r.parent / "precious.txt"
        target.write_text("keep\n")
        (r / ".mxflux.lock").unlink(missing_ok=True)
        (r / ".mxflux.lock").symlink_to(target)
        return ["train", "--resume", r, "--no-progress"]

    def _sharded_no_metadata(self, r):
        (r / "latest.pt").unlink()
        (r / "latest.dcp").mkdir()
        (r / "latest.dcp" / "__0_0.distcp").write_bytes(b"\0" * 64)
        return ["train", "--resume", r, "--no-progress"]

    def _plain_train_damaged(self, r):
        (r / "latest.pt").write_bytes(b"not a checkpoint")
        return ["train", "tiny-mxfp6", "--out", r, "--set", f"data.root={self.data}", *SMALL]

    def _run_id_changed(self, r):
        (r / "run_id").write_text("ffffffffffffffffffffffffffffffff\n")
        return ["train", "--resume", r, "--no-progress"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--kills", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="run only the cases whose name contains this (debugging one class)")
    args = ap.parse_args(argv)
    sys.path.insert(0, SRC)
    from mxflux.data import build_demo_dataset

    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out}: not empty; the trial writes a fresh directory")
    (args.out / "cases").mkdir(parents=True)
    data = build_demo_dataset(args.out / "data", n_train=64, n_eval=8, seed=3)
    finished = args.out / "finished" / "run"
    proc = mxflux("train", "tiny-mxfp6", "--out", finished, "--set", f"data.root={data}", *SMALL,
                  "--set", "train.train_samples=8")
    if proc.returncode:
        raise SystemExit(f"the finished run the resume cases copy failed: {proc.stderr[-2000:]}")
    trial = Trial(args.out, data, finished, args.seed)
    cases = trial.all_cases(args.kills)
    if args.only:
        cases = [c for c in cases if args.only in c[0]]
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda case: case[1](), cases))
    failures = [r for r in trial.results if r["problem"]]
    summary = {"cases": len(cases), "results": len(trial.results), "failures": len(failures),
               "tracebacks": sum(r["problem"] == "traceback" for r in failures),
               "wall_s": time.monotonic() - t0, "seed": args.seed}
    from mxflux.bench.provenance import provenance

    (args.out / "trial.json").write_text(json.dumps({"provenance": provenance(), "summary": summary,
                                                     "results": trial.results}, indent=1))
    for r in failures:
        print(f"FAIL {r['case']}: {r['problem']}\n    mxflux {' '.join(r['argv'])[:200]}\n    {r['last_line']}")
    print(json.dumps(summary))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
