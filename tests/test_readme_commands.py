"""Every command the README shows works as written: each `mxflux` (or `torchrun ... -m mxflux.cli`) line of its
bash blocks either runs here for real, in order, in one scratch directory (exit 0), or, where the line is
marked `# needs a GPU`, `# needs FLUX.1 weights` or `# minutes`, is parsed by the real argument parser (every
option it names exists and takes what it is given). The `make` lines are what CI itself runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mxflux.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
MARKS = ("# needs a GPU", "# needs FLUX.1 weights", "# minutes")


def readme_commands(text: str) -> list[tuple[list[str], str | None]]:
    """(argv after `mxflux`, its mark or None) for each command line of the README's bash blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            mark = next((m for m in MARKS if line.endswith(m) or f"{m} " in line), None)
            words = shlex.split(line, comments=True)
            if not words or words[0] == "make":
                continue
            if words[0] == "torchrun":
                words = ["mxflux", *words[words.index("mxflux.cli") + 1:]]
            assert words[0] == "mxflux", f"README command not run by this test: {line}"
            commands.append((words[1:], mark))
    return commands


COMMANDS = readme_commands((ROOT / "README.md").read_text())


def test_the_readme_shows_commands_and_marks_what_cannot_run_here():
    assert len(COMMANDS) >= 15
    assert sum(mark is None for _, mark in COMMANDS) >= 8  # most run for real


@pytest.mark.parametrize("argv", [argv for argv, mark in COMMANDS if mark], ids=lambda a: " ".join(a)[:60])
def test_marked_commands_parse(argv):
    args = build_parser().parse_args(argv)
    assert getattr(args, "handler", None) is not None


def test_the_unmarked_commands_run_in_order(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    # what the README's later lines assume: the default run (a short one) exists
    small = ["--set", "train.train_samples=32", "--set", "train.eval_every_samples=32", "--set", "train.eval_samples=8",
             "--set", "train.sample_prompts=[]", "--no-progress"]
    setup = subprocess.run([sys.executable, "-m", "mxflux.cli", "train", *small], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, setup.stderr
    for argv, mark in COMMANDS:
        if mark:
            continue
        proc = subprocess.run([sys.executable, "-m", "mxflux.cli", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (argv, proc.stderr[-2000:])
