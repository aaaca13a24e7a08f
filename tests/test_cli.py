"""The `mxflux` entry point: version, help, and a light package import."""

import subprocess
import sys

import pytest

import mxflux
from mxflux.cli import main


def test_version_prints_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"mxflux {mxflux.__version__}"
    assert mxflux.__version__ == "0.1.0"


def test_help_lists_numerics(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "numerics" in capsys.readouterr().out


def test_numerics_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["numerics", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--dist", "--file", "--key", "--shape", "--formats", "--weight-rows", "--json"):
        assert option in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "numerics" in capsys.readouterr().err


def test_unknown_command_fails(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "frobnicate" in capsys.readouterr().err


def test_package_and_cli_import_without_torch():
    # `mxflux --help` must start fast: neither the package nor the parser may import torch.
    code = "import sys, mxflux, mxflux.cli; mxflux.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_console_script_runs():
    # The installed entry point (pyproject [project.scripts]) resolves to mxflux.cli:main.
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "mxflux"]
    assert ep.value == "mxflux.cli:main"


@pytest.mark.parametrize("argv, message", [
    (["data", "synth", "--out", "{file}/sub", "--train", "2", "--eval", "1"],
     "mxflux data synth: error: file exists: '{file}': it stands where this command writes"),
    (["train", "tiny-mxfp6", "--max-steps", "1", "--no-progress", "--out", "{file}/run"],
     "mxflux train: error: not a directory: '{file}/run': a file stands where a directory is needed"),
])
def test_an_output_path_through_a_file_is_one_line_naming_it(argv, message, tmp_path, capsys):
    """An output directory asked for under an existing file: the path named in one line, exit 2,
    nothing written."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("a file, not a directory")
    assert main([a.format(file=a_file) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message.format(file=a_file) in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("var, value, message", [
    ("MXFLUX_CUTE_GEMM", "bogus", "MXFLUX_CUTE_GEMM: expected auto, off, all or a comma-separated list of bias, "
                                  "bf16, fp32; got 'bogus'"),
    ("MXFLUX_CUTE_MIN_TOKENS", "0", "MXFLUX_CUTE_MIN_TOKENS: expected a positive whole number of tokens, got '0'"),
    ("MXFLUX_CUTE_SWIZZLE", "0", "MXFLUX_CUTE_SWIZZLE: expected a positive whole number of tile columns, got '0'"),
    ("MXFLUX_CUTE_ACCUMULATE", "fp16", "MXFLUX_CUTE_ACCUMULATE: expected one of fp32, fp32h, fp32p3, fp32p4, fast, got 'fp16'"),
    ("MXFLUX_DEFER_SCALES", "x", "MXFLUX_DEFER_SCALES: expected one of auto, all, bias, bias-rounded, none, got 'x'"),
    ("MXFLUX_CUTE_BLOCKWISE", "yes", "MXFLUX_CUTE_BLOCKWISE: expected one of off, on, got 'yes'"),
])
def test_a_kernel_switch_set_wrong_is_one_line_naming_it(var, value, message, tmp_path):
    """The MXFLUX_* kernel switches (mxflux.switches) are read as the kernels are imported, inside the command:
    a value one does not take is one line naming the variable and what it takes, exit 2, no traceback."""
    import os

    env = {**os.environ, var: value}
    r = subprocess.run([sys.executable, "-m", "mxflux.cli", "train", "tiny-mxfp6", "--max-steps", "1", "--no-progress",
                        "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stderr.strip()) == (2, f"mxflux train: error: {message}")
