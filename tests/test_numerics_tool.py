"""`mxflux numerics`: the JSON contract, plausible numbers, file inputs and argument errors."""

import json

import pytest
import torch

from mxflux.bench.numerics import KEYS, make_weight, run_numerics
from mxflux.cli import main

SMALL = ["--shape", "256x512", "--weight-rows", "64", "--device", "cpu"]


def run_json(capsys, *argv):
    assert main(["numerics", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, *argv):
    """Run with bad arguments; return stderr after checking the exit status is non-zero."""
    with pytest.raises(SystemExit) as exc:
        main(["numerics", *argv])
    assert exc.value.code != 0
    return capsys.readouterr().err


def test_json_rows_have_stable_keys_and_plausible_numbers(capsys):
    rows = run_json(capsys, *SMALL)
    assert [(r["format"], r["hadamard"]) for r in rows] == [("e2m3", True), ("e2m3", False)]
    for r in rows:
        assert tuple(r) == KEYS
        assert 25 < r["snr_db"] < 35  # E2M3 keeps ~31 dB of a normal signal
        assert 20 < r["gemm_snr_db"] < r["snr_db"]  # both operands add error
        assert 0 < r["saturated_frac"] < 0.05
        assert r["zero_block_frac"] == 0
        assert r["outside_window_frac"] == 0
        assert r["fold_error_ratio"] == pytest.approx(1.0, abs=1e-3)


def test_formats_order_by_mantissa_bits_and_fold_only_where_exact(capsys):
    rows = run_json(capsys, *SMALL, "--formats", "e2m3,e3m2,e2m1,e5m2", "--dist", "laplace")
    snr = {(r["format"], r["hadamard"]): r["snr_db"] for r in rows}
    for rot in (True, False):
        assert snr["e2m3", rot] > snr["e3m2", rot] > snr["e2m1", rot]
    for r in rows:
        folds = r["format"] != "e5m2"  # E5M2's small values have no E4M3 image
        assert (r["outside_window_frac"] is not None) == folds
        assert (r["fold_error_ratio"] is not None) == folds


def test_rotation_helps_on_outlier_channels(capsys):
    rows = run_json(capsys, *SMALL, "--dist", "outliers")
    on, off = (next(r["snr_db"] for r in rows if r["hadamard"] is h) for h in (True, False))
    assert on > off + 1.0  # the rotation spreads each outlier over its block


def test_same_seed_same_numbers(capsys):
    assert run_json(capsys, *SMALL, "--seed", "3") == run_json(capsys, *SMALL, "--seed", "3")


def test_human_output_has_table_and_interpretation(capsys):
    assert main(["numerics", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "SNR dB" in out and "e2m3" in out
    assert "rotation changes SNR by" in out and "fold is exact" in out


# --- file inputs --------------------------------------------------------------------------------


def expected_rows(x):
    x2 = x.reshape(-1, x.shape[-1]).float()
    return run_numerics(x2, make_weight(64, x2.shape[1], seed=0))


def test_reads_pt_tensor_as_rows_by_last_dim(tmp_path, capsys):
    x = torch.randn(4, 16, 96, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "act.pt")
    rows = run_json(capsys, "--file", str(tmp_path / "act.pt"), "--weight-rows", "64", "--device", "cpu")
    assert rows == json.loads(json.dumps(expected_rows(x)))


def test_reads_key_from_pt_dict_and_safetensors(tmp_path, capsys):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(8, 64, generator=g), "b": torch.randn(32, 128, generator=g).bfloat16()}
    torch.save(tensors, tmp_path / "acts.pt")
    save_file(tensors, str(tmp_path / "acts.safetensors"))
    want = json.loads(json.dumps(expected_rows(tensors["b"])))
    for name in ("acts.pt", "acts.safetensors"):
        rows = run_json(capsys, "--file", str(tmp_path / name), "--key", "b", "--weight-rows", "64", "--device", "cpu")
        assert rows == want


# --- the metrics on inputs whose answers are known --------------------------------------------------


def test_zero_blocks_and_saturation_are_counted_exactly():
    # Every block is -1 … 1 (amax 1 maps to 4.0: no element saturates) unless set below.
    x = torch.linspace(-1, 1, 32).repeat(64, 4)
    x[:8, :32] = 0.0
    x[8:16, :32] = -0.0  # a negative zero is still a zero block
    x[16:24, 32:64] = 7.5  # 8 blocks whose every element sits at E2M3's max (no rotation)
    (row,) = run_numerics(x, make_weight(32, 128), hadamard=[False])
    assert row["zero_block_frac"] == 16 / 256
    assert row["saturated_frac"] == 8 * 32 / x.numel()


def test_blocks_outside_the_fold_window_are_counted():
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    x[:, :32] *= 2.0**20  # each row's first block sets e_ref 20 binades above the rest (window: 11)
    (row,) = run_numerics(x, make_weight(32, 256), hadamard=[False])
    assert row["outside_window_frac"] == pytest.approx(7 / 8)
    assert row["fold_error_ratio"] >= 1.0  # the fold is no better than the exact MX GEMM


# --- argument errors name the argument ------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--formats", "e9m9"], "--formats"),
        (["--shape", "100x3072"], "--shape"),
        (["--shape", "4096"], "--shape"),
        (["--weight-rows", "0"], "--weight-rows"),
        (["--dist", "cauchy"], "--dist"),
        (["--df", "5"], "--df"),  # --df only applies to student-t
        (["--key", "x"], "--key"),  # --key only applies with --file
        (["--file", "/nonexistent/act.pt"], "--file"),
    ],
)
def test_bad_arguments_exit_nonzero_naming_the_argument(capsys, argv, name):
    assert name in run_error(capsys, *argv)


def test_bad_files_name_the_argument(tmp_path, capsys):
    torch.save({"a": torch.zeros(4, 64), "b": torch.zeros(4, 64)}, tmp_path / "two.pt")
    torch.save(torch.zeros(4, 48), tmp_path / "odd.pt")
    (tmp_path / "act.npy").write_bytes(b"\0")
    assert "--key" in run_error(capsys, "--file", str(tmp_path / "two.pt"))  # ambiguous
    assert "--key" in run_error(capsys, "--file", str(tmp_path / "two.pt"), "--key", "c")
    assert "--file" in run_error(capsys, "--file", str(tmp_path / "odd.pt"))  # 48 % 32 != 0
    assert "--file" in run_error(capsys, "--file", str(tmp_path / "act.npy"))
    assert "--shape" in run_error(capsys, "--file", str(tmp_path / "odd.pt"), "--shape", "32x32")


def test_linear_rows_report_each_gemm(capsys):
    rows = run_json(capsys, *SMALL, "--linear")
    layer_rows = {(r["format"], r["hadamard"]): r["gemm_snr_db"] for r in rows if "." in r["format"]}
    for rot in (True, False):
        for gemm in ("fprop", "dgrad", "wgrad"):
            assert 24.0 <= layer_rows[(f"MXFP6Linear.{gemm}", rot)] <= 32.0  # the seed's ~28 dB
    assert main(["numerics", *SMALL, "--linear"]) == 0
    assert "MXFP6Linear" in capsys.readouterr().out
