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
