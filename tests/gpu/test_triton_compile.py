"""The Triton kernels (FP8 casts, MX packer) compile for sm_90 (Hopper) ahead of time, with no GPU: Triton's CPU
interpreter runs kernels that the compiler would reject (it once accepted a `PropagateNan`
held in a local variable), so the compile is checked on its own. Skipped without Triton.
The PTX must use IEEE division (no approximate or flush-to-zero forms), NaN-propagating
max/min for the saturation, and the hardware's saturating FP8 conversions."""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("under TRITON_INTERPRET=1 the kernels are interpreted functions, not compilable",
                allow_module_level=True)

from mxflux.kernels import fp8_cast  # noqa: E402

_CAST_SIG = {"x_ptr": "*bf16", "sx": "i32", "R": "i32", "C": "i32", "Rp": "i32", "row_amax": "*i32",
             "col_amax": "*i32", "row_data": "*u8", "row_scale": "*fp32", "col_data": "*u8", "col_scale": "*fp32"}
_AMAX_SIG = {"x_ptr": "*bf16", "sx": "i32", "R": "i32", "C": "i32", "row_amax": "*i32", "col_amax": "*i32",
             "sums": "*fp32", "n_rt": "i32"}


def _ptx(fn, sig, consts, num_warps=8):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    opts = {"num_warps": num_warps, "enable_fp_fusion": False, "enable_reflect_ftz": False}
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    except RuntimeError as e:  # no CUDA toolchain (ptxas) in this Triton install
        if "ptxas" in str(e).lower():
            pytest.skip(f"Triton cannot compile for sm_90 here: {e}")
        raise


@pytest.mark.parametrize("fmt, fmax, cvt", [(0, 448.0, "e4m3x2"), (1, 57344.0, "e5m2x2")], ids=["e4m3", "e5m2"])
def test_fp8_cast_kernel_compiles_for_sm90(fmt, fmax, cvt):
    ptx = _ptx(fp8_cast._fp8_cast_kernel, _CAST_SIG,
               {"DO_ROW": True, "DO_COL": True, "FMT": fmt, "FMAX": fmax, "HW": True, "BR": 64, "BC": 128})
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert ".ftz" not in ptx
    assert "max.NaN.f32" in ptx and "min.NaN.f32" in ptx
    assert f"cvt.rn.satfinite.{cvt}.f32" in ptx


def test_fp8_amax_kernel_compiles_for_sm90():
    ptx = _ptx(fp8_cast._fp8_amax_kernel, _AMAX_SIG,
               {"DO_ROW": True, "DO_COL": True, "DO_COLSUM": True, "HW": True, "BR": 64, "BC": 128})
    assert "atom" in ptx and "max" in ptx


_PACK_SIG = {"x_ptr": "*bf16", "aux_ptr": "*bf16", "stride_x": "i32", "stride_aux": "i32", "R": "i32", "C": "i32",
             "Rp": "i32", "row_data_ptr": "*u8", "row_scale_ptr": "*fp32", "col_data_ptr": "*u8",
             "col_scale_ptr": "*fp32", "colsum_ptr": "*fp32", "ninexact_ptr": "*i64", "row_eref_ptr": "*i32",
             "col_eref_ptr": "*i32", "n_row_tiles": "i32", "n_prog_r": "i32"}


@pytest.mark.parametrize("granularity, prologue, colsum, pass_, hw", [
    ("row", "none", False, 1, True), ("row", "none", False, 2, True), (32, "gelu_tanh", False, 2, True),
    (128, "gelu_tanh_grad", True, 2, True), ("row", "none", True, 2, False),
])
def test_mx_pack_kernel_compiles_for_sm90(granularity, prologue, colsum, pass_, hw):
    """The MX packer with the constexprs `pack_cuda` launches it with; hw=False is the integer
    emulation of the FP8 conversions, which the GPU tests also run."""
    from mxflux.kernels import pack

    g = pack._GRAN_IDS[granularity]
    nb, warps = pack._TILE[g]
    consts = {"PASS": pass_, "DO_ROW": True, "DO_COL": True, "DO_COLSUM": colsum, "GRAN": g, "HADAMARD": True,
              "PROLOGUE": pack._PROLOGUE_IDS[prologue], "HW": hw, "BR": pack._BR, "NB": nb,
              "COAL": pack._coalesced(prologue)}
    ptx = _ptx(pack._pack_kernel, _PACK_SIG, consts, num_warps=warps)
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (hw and pass_ == 2)
    # no flush-to-zero arithmetic, except the approximate exp2 / reciprocal inside libdevice's
    # tanhf (the GELU prologue), which torch's own CUDA GELU runs too (bit-exact on the H200)
    assert set(re.findall(r"[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz\.f32", ptx)) <= {"ex2.approx.ftz.f32", "rcp.approx.ftz.f32"}
    assert ("ex2.approx" in ptx) == (prologue != "none")


@pytest.mark.parametrize("fmt, fmax", [(0, 448.0), (1, 57344.0)], ids=["e4m3", "e5m2"])
def test_fp8_cast_emulation_compiles_for_sm90(fmt, fmax):
    """The FP8 casts with hw=False (the integer emulation the interpreter runs) compile too."""
    ptx = _ptx(fp8_cast._fp8_cast_kernel, _CAST_SIG,
               {"DO_ROW": True, "DO_COL": True, "FMT": fmt, "FMAX": fmax, "HW": False, "BR": 64, "BC": 128})
    assert "cvt.rn.satfinite" not in ptx and "div.rn.f32" in ptx
