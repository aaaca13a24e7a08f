"""The FP8 cast kernels compile for sm_90 (Hopper) ahead of time, with no GPU: Triton's CPU
interpreter runs kernels that the compiler would reject (it once accepted a `PropagateNan`
held in a local variable), so the compile is checked on its own. Skipped without Triton.
The PTX must use IEEE division (no approximate or flush-to-zero forms), NaN-propagating
max/min for the saturation, and the hardware's saturating FP8 conversions."""

from __future__ import annotations

import os

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


def _ptx(fn, sig, consts):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    opts = {"num_warps": 8, "enable_fp_fusion": False, "enable_reflect_ftz": False}
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
