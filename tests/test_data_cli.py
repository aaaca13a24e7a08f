"""`mxflux data synth | demo | info | bench | prepare --help` through `add_data_parser`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from mxflux.cli.data import add_data_parser
from mxflux.data.shards import LatentDataset, load_empty_encodings


def run(argv: list[str]) -> int:
    """Parse and run like `mxflux` does (the lead's cli.main wires add_data_parser the same way)."""
    parser = argparse.ArgumentParser(prog="mxflux")
    add_data_parser(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.handler(args)


def test_synth_writes_a_dataset_with_the_asked_dims(tmp_path, gen, capsys):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    out = tmp_path / "synth"
    assert run(["data", "synth", "--out", str(out), "--train", "10", "--eval", "9", "--t5-len", "6",
                "--t5-dim", "16", "--clip-dim", "8", "--latent-size", "4", "--seed", str(seed),
                "--shard-size", "4"]) == 0
    assert "wrote 10 train + 9 eval" in capsys.readouterr().out
    train, ev = LatentDataset(out, "train"), LatentDataset(out, "eval")
    assert (len(train), len(ev)) == (10, 9)
    assert train.t5_shape == (6, 16) and train.clip_dim == 8 and train.latent_shape == (16, 4, 4)
    assert len(train.meta.splits["train"].shards) == 3
    assert [int(ev[i]["timestep_index"]) for i in range(9)] == [i % 8 for i in range(9)]
    t5_empty, clip_empty = load_empty_encodings(out)
    assert t5_empty.shape == (6, 16) and clip_empty.shape == (8,)
    # Realistic statistics: normalised latents about unit normal, log-variances in [-6, -2].
    batch = train.gather(range(10))
    x = (batch["vae_mean"].float() - train.latent_shift) * train.latent_scale
    assert abs(x.mean()) < 0.2 and 0.8 < x.std() < 1.2
    assert batch["vae_logvar"].min() >= -6 and batch["vae_logvar"].max() <= -2

    again = tmp_path / "again"
    run(["data", "synth", "--out", str(again), "--train", "10", "--eval", "9", "--t5-len", "6", "--t5-dim", "16",
         "--clip-dim", "8", "--latent-size", "4", "--seed", str(seed)])
    assert torch.equal(LatentDataset(again, "train").gather(range(10))["t5"], batch["t5"])  # seeded


def test_synth_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "synth"
    run(["data", "synth", "--out", str(out), "--train", "2", "--eval", "1", "--t5-len", "2", "--t5-dim", "4",
         "--clip-dim", "2", "--latent-size", "2"])
    with pytest.raises(SystemExit) as exc:
        run(["data", "synth", "--out", str(out), "--train", "2", "--eval", "1"])
    assert exc.value.code == 2
    assert "never overwrites" in capsys.readouterr().err


def test_bad_numbers_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run(["data", "synth", "--out", str(tmp_path / "x"), "--train", "-3", "--eval", "1"])
    assert exc.value.code == 2
    assert "--train" in capsys.readouterr().err


def test_demo_info_and_bench(tmp_path, capsys):
    out = tmp_path / "demo"
    assert run(["data", "demo", "--out", str(out), "--train", "40", "--eval", "8"]) == 0
    capsys.readouterr()
    assert run(["data", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "source demo" in text and "train: 40 samples" in text and "with captions" in text
    assert run(["data", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["splits"]["eval"]["tensors"]["timestep_index"] == {"shape": [], "dtype": "int64"}
    assert info["splits"]["train"]["bytes_per_sample"] == 2 * (2 * 16 * 16 * 16 + 32 * 64 + 32)
    assert run(["data", "bench", str(out), "--batch-size", "4", "--workers", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] == 40 - 4 * 4 and result["samples_per_s"] > 0


def test_info_reports_a_broken_dataset(tmp_path, capsys):
    (tmp_path / "bare").mkdir()
    with pytest.raises(SystemExit) as exc:
        run(["data", "info", str(tmp_path / "bare")])
    assert exc.value.code == 2
    assert "has no meta.json" in capsys.readouterr().err


def test_prepare_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exc:
        run(["data", "prepare", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--images", "--out", "--vae", "--t5", "--clip", "--t5-tokenizer", "--clip-tokenizer",
                   "--eval-images", "--num-eval", "--t5-len", "--image-size", "--batch-size", "--device"):
        assert option in out


def test_data_without_subcommand_prints_help(capsys):
    assert run(["data"]) == 2
    assert "synth" in capsys.readouterr().err


def test_parser_imports_no_torch():
    code = ("import argparse, sys; from mxflux.cli.data import add_data_parser; "
            "add_data_parser(argparse.ArgumentParser().add_subparsers()); import mxflux.data; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"
