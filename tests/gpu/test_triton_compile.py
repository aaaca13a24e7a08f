"""The Triton MX packer compiles for sm_90 (Hopper) ahead of time, with no GPU: Triton's CPU
interpreter runs kernels that the compiler would reject (it once accepted a `PropagateNan` held in
a local variable), so the compile is checked on its own. Skipped without Triton. The PTX must use
the hardware's saturating FP8 conversions (or none, in the integer emulation) and no flush-to-zero
arithmetic outside libdevice's tanhf."""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
tl = triton.language
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("under TRITON_INTERPRET=1 the kernels are interpreted functions, not compilable",
                allow_module_level=True)

from mxflux.kernels import operands_cuda  # noqa: E402
from mxflux.kernels import operands_plan  # noqa: E402
from mxflux.kernels.triton_common import PAIR_SHUFFLE_ASM, lane_pair_shuffles_hold  # noqa: E402
from mxflux.mx import FoldGranularity as G  # noqa: E402


def _compile(fn, sig, consts, num_warps=8, aligned=False, divisible=(), options=None):
    """The sm_90 compile's assembly (ttgir, ptx, ...). `aligned`: every pointer 16-byte aligned
    (what Triton specialises on at a launch with torch.empty outputs), so the vector accesses
    show; `divisible`: integer parameters a launch passes as multiples of 16 (Triton specialises
    on that too)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if (aligned and ty.startswith("*")) or name in divisible} or None
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts, attrs=attrs)
    opts = {"num_warps": num_warps, "enable_fp_fusion": False, "enable_reflect_ftz": False} if options is None \
        else {"num_warps": num_warps, **options}
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm
    except RuntimeError as e:  # no CUDA toolchain (ptxas) in this Triton install
        if "ptxas" in str(e).lower():
            pytest.skip(f"Triton cannot compile for sm_90 here: {e}")
        raise


def test_pair_layout_check_rejects_a_kernel_whose_layout_does_not_pair_lanes():
    """Compiled without alignment, the stores are bytewise and the lanes run along a block's
    bytes: the layout check (which decides PAIRS before a plan's first launch) must say no."""
    consts = {"PASS": 2, "DO_ROW": True, "DO_COL": True, "DO_COLSUM": False, "HADAMARD": True, "HW": True,
              **operands_plan.kernel_constexprs(G.ROWWISE, "none")}
    asm = _compile(operands_cuda._pack_kernel, _PACK_SIG, consts, num_warps=8)
    assert lane_pair_shuffles_hold(asm["ttgir"], PAIR_SHUFFLE_ASM) == [False, False]


def _ptx(fn, sig, consts, num_warps=8):
    return _compile(fn, sig, consts, num_warps)["ptx"]


def _ptx_aligned(fn, sig, consts, num_warps):
    return _compile(fn, sig, consts, num_warps, aligned=True)["ptx"]


_PACK_SIG = {"x_ptr": "*bf16", "aux_ptr": "*bf16", "stride_x": "i32", "stride_aux": "i32", "R": "i32", "C": "i32",
             "Rp": "i32", "row_data_ptr": "*i32", "row_scale_ptr": "*fp32", "col_data_ptr": "*i32",
             "col_scale_ptr": "*fp32", "colsum_ptr": "*fp32", "outside_ptr": "*i64", "row_eref_ptr": "*i32",
             "col_eref_ptr": "*i32", "n_row_tiles": "i32", "n_prog_r": "i32"}


@pytest.mark.parametrize("granularity, prologue, colsum, pass_, hw", [
    (G.ROWWISE, "none", False, 1, True), (G.ROWWISE, "none", False, 2, True), (G.EXACT, "gelu_tanh", False, 2, True),
    (G.BLOCKWISE, "gelu_tanh_grad", True, 2, True), (G.ROWWISE, "none", True, 2, False),
    (G.ROWWISE, "none", False, 1, "fp32"), (G.ROWWISE, "none", False, 2, "fp32"),
], ids=lambda v: getattr(v, "value", str(v)))
def test_mx_operands_kernel_compiles_for_sm90(granularity, prologue, colsum, pass_, hw):
    """The MX packer with the constexprs `mx_operands_cuda` launches it with; hw=False is the
    integer emulation of the FP8 conversions, which the interpreter tests run; "fp32" the
    hardware kernel reading fp32 master weights (rounded to bf16 by cvt.rn as read)."""
    x_f32 = hw == "fp32"
    hw = bool(hw)
    consts = {"PASS": pass_, "DO_ROW": True, "DO_COL": True, "DO_COLSUM": colsum, "HADAMARD": True, "HW": hw,
              **operands_plan.kernel_constexprs(granularity, prologue, x_f32=x_f32)}
    sig = dict(_PACK_SIG, x_ptr="*fp32") if x_f32 else _PACK_SIG
    # specialised as a launch is: 16-byte aligned pointers, C and Rp multiples of 32
    asm = _compile(operands_cuda._pack_kernel, sig, consts, num_warps=operands_plan.kernel_num_warps(granularity),
                   aligned=True, divisible=("C", "Rp"))
    ptx = asm["ptx"]
    # pass 2 stores both orientations by lane pairs (a shuffle per orientation and 4 bytes), in
    # the layout that shuffle needs, so launches keep PAIRS on
    found = lane_pair_shuffles_hold(asm["ttgir"], PAIR_SHUFFLE_ASM)
    assert found == ([True, True] if hw and pass_ == 2 else [])
    if hw and pass_ == 2:
        assert "st.global.v4.b32" in ptx
    if prologue == "none":  # (the GELU prologues round their result to bf16 with the same instruction)
        assert ("cvt.rn.bf16" in ptx) == x_f32
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (hw and pass_ == 2)
    # no flush-to-zero arithmetic, except the approximate exp2 / reciprocal inside libdevice's
    # tanhf (the GELU prologue), which torch's own CUDA GELU runs too (bit-exact on the H200)
    assert set(re.findall(r"[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz\.f32", ptx)) <= {"ex2.approx.ftz.f32", "rcp.approx.ftz.f32"}
    assert ("ex2.approx" in ptx) == (prologue != "none")


@pytest.mark.parametrize("hw", [True, False])
@pytest.mark.parametrize("which", ["compact", "expand"])
def test_compact_kernels_compile_for_sm90(which, hw):
    """The saved-operand kernels: the hardware form converts E4M3 pairs to f16x2 and back (and
    takes the block maxima with sm_90's max.u16x2); both forms move whole words with vector loads
    and stores (16 bytes where a block's 32 E4M3 bytes are read or written)."""
    from mxflux.kernels import compact_cuda

    if which == "compact":
        fn = compact_cuda._compact_kernel
        sig = {"data_ptr": "*i32", "nib_ptr": "*i16", "crumb_ptr": "*u8", "shift_ptr": "*u8", "n_blocks": "i32"}
    else:
        fn = compact_cuda._expand_kernel
        sig = {"nib_ptr": "*i16", "crumb_ptr": "*u8", "shift_ptr": "*u8", "out_ptr": "*i32", "n_blocks": "i32"}
    ptx = _ptx_aligned(fn, sig, {"BB": compact_cuda._BB, "HW": hw}, compact_cuda._WARPS)
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == hw
    assert ("cvt.rn.satfinite.e4m3x2.f16x2" in ptx) == hw
    assert ("max.u16x2" in ptx) == (hw and which == "compact")
    assert ("ld.global.v4.b32" if which == "compact" else "st.global.v4.b32") in ptx
    assert ("st.global.v2.b32" if which == "compact" else "ld.global.v2.b32") in ptx
    assert not re.findall(r"\.ftz\.", ptx)


def test_the_adamw_step_compiles_with_vector_accesses_and_ieee_division():
    """The optimizer kernel (`mxflux.train.adamw_cuda`): 16-byte loads and stores of the four
    streams when the tensors are aligned (as torch allocates them), and correctly rounded square
    root and division (no approximate forms), so that it is fp32 AdamW as torch's kernel is."""
    from mxflux.kernels import adamw_cuda

    sig = {"p_ptr": "*fp32", "g_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", "n": "i64", "factor_ptr": "*fp32",
           "lr_ptr": "*fp32", "step_size_ptr": "*fp32", "bc2_sqrt_ptr": "*fp32", "weight_decay": "fp32",
           "beta1": "fp32", "beta2": "fp32", "eps": "fp32"}
    ptx = _compile(adamw_cuda.adamw_kernel, sig, {"BLOCK": adamw_cuda.BLOCK}, num_warps=adamw_cuda.NUM_WARPS,
                   aligned=True, divisible=("n",))["ptx"]
    assert len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.(?:b32|f32)", ptx)) >= 4
    assert len(re.findall(r"st\.global(?:\.\w+)*\.v4\.(?:b32|f32)", ptx)) >= 3
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx
    assert "sqrt.approx" not in ptx and "div.full" not in ptx and "div.approx" not in ptx


def test_the_adamw_step_with_the_erefs_compiles_small_enough_for_several_programs_per_sm():
    """The step that also computes the MX weights' e_ref (`adamw_erefs_kernel`) at its shipped
    tile: vector accesses, IEEE division, the maxima as atomic max, and (read from the cubin with
    the Triton wheel's cuobjdump) at most 128 registers, so that its row slices keep several
    programs on an SM (at 168 registers, one 8-warp program per SM, the step measured 15 % slower)."""
    from mxflux.kernels import adamw_cuda

    W = adamw_cuda.OperandTile
    sig = {"p_ptr": "*fp32", "g_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", "R": "i32", "C": "i32",
           "factor_ptr": "*fp32", "lr_ptr": "*fp32", "step_size_ptr": "*fp32", "bc2_sqrt_ptr": "*fp32",
           "row_eref_ptr": "*i32", "col_eref_ptr": "*i32", "weight_decay": "fp32", "beta1": "fp32", "beta2": "fp32",
           "eps": "fp32"}
    consts = {"HADAMARD": True, "HW": True, "BR": W.BR, "NB": W.NB, "SLICES": W.SLICES}
    asm = _compile(adamw_cuda.adamw_erefs_kernel, sig, consts, num_warps=W.NUM_WARPS, aligned=True,
                   divisible=("C",))
    ptx = asm["ptx"]
    assert len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.(?:b32|f32)", ptx)) >= 4
    assert len(re.findall(r"st\.global(?:\.\w+)*\.v4\.(?:b32|f32)", ptx)) >= 3
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx
    assert re.search(r"atom\.global(?:\.\w+)*\.max", ptx) or re.search(r"red\.global(?:\.\w+)*\.max", ptx)
    assert _registers(asm) <= 128


def test_the_adamw_step_that_writes_the_operands_compiles_small_enough_for_several_programs_per_sm():
    """The step that also writes the MX weights' operands (`adamw_operands_kernel`) and its fix-up
    pass, at the shipped tile: vector loads of the four fp32 streams, 16-byte stores of the operand
    words, IEEE division, hardware E4M3 conversions, and at most 128 registers (several programs per
    SM, as the step without the operands). Without the col operand (`COL=False`,
    `precision.kept_weight_cols: false`) half the E4M3 conversions remain, fewer stores, no more registers."""
    from mxflux.kernels import adamw_cuda

    W = adamw_cuda.OperandTile
    sig = {"p_ptr": "*fp32", "g_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", "R": "i32", "C": "i32",
           "Rp": "i32", "factor_ptr": "*fp32", "lr_ptr": "*fp32", "step_size_ptr": "*fp32", "bc2_sqrt_ptr": "*fp32",
           "held_row_ptr": "*i32", "held_col_ptr": "*i32", "row_eref_ptr": "*i32", "col_eref_ptr": "*i32",
           "row_data_ptr": "*i32", "row_scale_ptr": "*fp32", "col_data_ptr": "*i32", "col_scale_ptr": "*fp32",
           "unheld_ptr": "*i32", "weight_decay": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32"}
    consts = {"HEADROOM": W.HEADROOM, "HADAMARD": True, "HW": True, "BR": W.BR, "NB": W.NB, "SLICES": W.SLICES}
    stores, conversions = {}, {}
    for col in (True, False):
        asm = _compile(adamw_cuda.adamw_operands_kernel, sig, {**consts, "COL": col}, num_warps=W.NUM_WARPS,
                       aligned=True, divisible=("C", "Rp"))
        ptx = asm["ptx"]
        assert len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.(?:b32|f32)", ptx)) >= 4
        stores[col] = len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", ptx))  # the operand words, 16 B each
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f16x2" in ptx
        conversions[col] = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx))
        assert _registers(asm) <= 128
    assert stores[True] >= 4 and stores[False] < stores[True], stores
    assert conversions[False] * 2 == conversions[True], conversions
    fix_sig = {"p_ptr": "*fp32", "R": "i32", "C": "i32", "Rp": "i32", "unheld_ptr": "*i32", "row_eref_ptr": "*i32",
               "col_eref_ptr": "*i32", "row_data_ptr": "*i32", "row_scale_ptr": "*fp32", "col_data_ptr": "*i32",
               "col_scale_ptr": "*fp32", "outside_ptr": "*i64", "fixups_ptr": "*i64", "n_col_tiles": "i32",
               "n_tiles": "i32"}
    for col in (True, False):
        fix = _compile(adamw_cuda.operands_fixup_kernel, fix_sig,
                       {"HADAMARD": True, "HW": True, "BR": W.BR, "NB": W.NB, "COL": col},
                       num_warps=W.NUM_WARPS, aligned=True, divisible=("C", "Rp"))
        assert "cvt.rn.satfinite.e4m3x2.f16x2" in fix["ptx"]


def _registers(asm) -> int:
    """Registers per thread of a compiled kernel, read from its cubin with the Triton wheel's cuobjdump."""
    import subprocess
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("no cuobjdump in this Triton wheel to read the register count")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = [int(r) for r in re.findall(r"REG:(\d+)", usage)]
    assert regs, usage
    return max(regs)


# What inductor compiles a user-defined kernel with (torch/_inductor/runtime/triton_heuristics.py): Triton's
# defaults for FMA contraction and flush-to-zero libdevice, device asserts on, no overflow checks.
_INDUCTOR_OPTIONS = {"num_stages": 3, "debug": True, "sanitize_overflow": False}


@pytest.mark.parametrize("granularity, pass_, colsum, x_f32", [
    (G.ROWWISE, 1, False, False), (G.ROWWISE, 2, True, False), (G.ROWWISE, 2, False, True),
    (G.BLOCKWISE, 2, True, False), (G.EXACT, 2, False, False),
], ids=str)
def test_the_inlined_packer_compiles_to_the_same_sass_under_inductors_options(granularity, pass_, colsum, x_f32):
    """Compiled regions launch the prologue-free packer from inductor's code
    (`kernels.operands_inline`), which compiles it with its own options; the sm_90 machine code
    must be the one our launches run, instruction for instruction (so the same bits)."""
    consts = {"PASS": pass_, "DO_ROW": True, "DO_COL": True, "DO_COLSUM": colsum, "HADAMARD": True, "HW": True,
              **operands_plan.kernel_constexprs(granularity, "none", x_f32=x_f32)}
    sig = dict(_PACK_SIG, x_ptr="*fp32") if x_f32 else _PACK_SIG
    kw = dict(num_warps=operands_plan.kernel_num_warps(granularity), aligned=True, divisible=("C", "Rp"))
    ours = _sass(_compile(operands_cuda._pack_kernel, sig, consts, **kw))
    # (the inlined packer hands the kernel its E4M3 outputs, which it stores to as int32 words)
    inlined = dict(sig, row_data_ptr="*fp8e4nv", col_data_ptr="*fp8e4nv")
    inductors = _sass(_compile(operands_cuda._pack_kernel, inlined, consts, options=_INDUCTOR_OPTIONS, **kw))
    assert len(ours) > 500 and ours == inductors


def _sass(asm) -> list[str]:
    """The cubin's instructions (addresses and encodings stripped), by the Triton wheel's cuobjdump."""
    import subprocess
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"\s*/\*.*?\*/\s*", " ", line).strip() for line in out.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def _pack_kwargs(pass_, **changes):
    """A packer launch's arguments as inductor's analysis sees them (CPU tensors stand in for the
    device's: only their dtypes count)."""
    import torch

    def t(dtype):
        return torch.empty(64, dtype=dtype)

    kw = dict(x_ptr=t(torch.bfloat16), aux_ptr=t(torch.bfloat16), stride_x=512, stride_aux=512, R=300, C=512,
              Rp=320, row_data_ptr=t(torch.float8_e4m3fn), row_scale_ptr=t(torch.float32),
              col_data_ptr=t(torch.float8_e4m3fn), col_scale_ptr=t(torch.float32), colsum_ptr=t(torch.float32),
              outside_ptr=t(torch.int64), row_eref_ptr=t(torch.int32), col_eref_ptr=t(torch.int32), n_row_tiles=3,
              n_prog_r=3, PASS=pass_, DO_ROW=True, DO_COL=True, DO_COLSUM=pass_ == 2, HADAMARD=True, HW=True,
              **operands_plan.kernel_constexprs(G.ROWWISE, "none"))
    return {**kw, **changes}


@pytest.fixture
def sm90_target():
    """Triton's active driver answering for an sm_90 GPU (no GPU here), restored after."""
    import torch
    from triton.backends.compiler import GPUTarget

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    config = triton.runtime.driver
    before = config._active
    config.set_active(_Sm90())
    yield
    config._active = before  # (reset_active would look for a GPU driver)


def _written(kernel, kw) -> set[str]:
    """The arguments inductor's analysis finds `kernel` writes (torch 2.11 and 2.13)."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_accessed_tensors"):  # torch 2.13
        return {d.name for d in wrap.identify_accessed_tensors(kernel, kw, {}).read_writes.writes}
    return set(wrap.identify_mutated_tensors(kernel, kw, {}))  # torch 2.11


@pytest.mark.parametrize("pass_, erefs", [(1, False), (2, False), (2, True)])
def test_inductors_mutation_analysis_finds_exactly_what_the_packer_writes(pass_, erefs, sm90_target):
    """Inductor works out which arguments of a user-defined kernel it writes from the kernel's TTIR;
    were the analysis to fail, it would take every argument as written and copy x on every call.
    It must find the packer's outputs, the e_ref maxima (pass 1) and the counter, and nothing it
    only reads. (Run against an sm_90 target with no GPU.)"""
    written = _written(operands_cuda._pack_kernel, _pack_kwargs(pass_))
    if pass_ == 1:
        assert written == {"row_eref_ptr", "col_eref_ptr"}
    else:
        assert written == {"row_data_ptr", "row_scale_ptr", "col_data_ptr", "col_scale_ptr", "colsum_ptr",
                           "outside_ptr"}


def test_the_analysis_runs_once_per_packer_variant_and_answers_as_torchs_own(sm90_target, monkeypatch):
    """`kernels.inductor_analysis`: once the inline packer has installed the memo, inductor's analysis
    of a packer launch converts the kernel to TTIR once per variant (constexprs, dtypes, scalar
    values), not once per call; the answers are those of torch's own analysis, each caller getting
    its own copy; other kernels and calls with arguments the memo cannot key are analysed as before."""
    import sympy
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    from mxflux.kernels import inductor_analysis

    pack = operands_cuda._pack_kernel
    name = "identify_accessed_tensors" if hasattr(wrap, "identify_accessed_tensors") else "identify_mutated_tensors"
    installed = getattr(wrap, name)  # (the inline packer's tests may have installed the memo already)
    monkeypatch.setattr(wrap, name, getattr(installed, "memoizes", installed))  # torch's own, restored after
    plain = {p: _written(pack, _pack_kwargs(p)) for p in (1, 2)}
    monkeypatch.setattr(inductor_analysis, "_memo", {})
    monkeypatch.setattr(inductor_analysis, "_kernels", set())
    conversions = []
    generate = wrap.generate_ttir
    monkeypatch.setattr(wrap, "generate_ttir", lambda k, *a: conversions.append(k.fn.__name__) or generate(k, *a))

    assert inductor_analysis.memoize_access_analysis(pack) and inductor_analysis.memoize_access_analysis(pack)
    assert getattr(wrap, name).memoizes is not None  # wrapped once, not twice
    for _ in range(3):
        assert _written(pack, _pack_kwargs(2)) == plain[2]
    assert conversions == ["_pack_kernel"]
    assert _written(pack, _pack_kwargs(1)) == plain[1]  # another variant: analysed
    assert _written(pack, _pack_kwargs(2, R=301)) == plain[2]  # another size: analysed (Triton specialises ints)
    assert conversions == ["_pack_kernel"] * 3
    # symbolic sizes (torch converts each to 2): one key for all of them
    assert _written(pack, _pack_kwargs(2, R=sympy.Symbol("s0"))) == plain[2]
    assert _written(pack, _pack_kwargs(2, R=sympy.Symbol("s1") + 1)) == plain[2]
    assert conversions == ["_pack_kernel"] * 4

    # a caller changing its answer changes no other caller's
    answer = getattr(wrap, name)(pack, _pack_kwargs(2), {})
    (answer.read_writes.writes.clear() if hasattr(answer, "read_writes") else answer.clear())
    assert _written(pack, _pack_kwargs(2)) == plain[2]

    # an argument the key cannot describe, and TMA descriptors: torch's analysis, every time
    assert inductor_analysis.analysis_key(pack, _pack_kwargs(2, R=object()), {}) is None
    assert inductor_analysis.analysis_key(pack, _pack_kwargs(2), {"x_ptr": ("stable", (16, 16))}) is None
    # another kernel: analysed by torch every time
    import torch

    copy_kw = dict(src=torch.empty(8), dst=torch.empty(8), n=8, BLOCK=8)
    assert _written(_copy_kernel, copy_kw) == _written(_copy_kernel, copy_kw) == {"dst"}
    assert conversions == ["_pack_kernel"] * 4 + ["_copy_kernel"] * 2
    assert inductor_analysis.memoized_kernels() == {id(pack)}


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


def _census_module():
    import importlib
    import pathlib
    import sys

    benchmarks = str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        return importlib.import_module("sass_census")
    finally:
        sys.path.remove(benchmarks)


@pytest.mark.parametrize("pass_, fadd, fmul, f2fp, budget", [(1, 288, 2, 0, 600), (2, 320, 128, 96, 1100)])
def test_the_row_packers_main_loop_issues_the_arithmetic_of_its_design_and_little_else(pass_, fadd, fmul, f2fp, budget):
    """The packers are bound by instruction issue, so the sm_90 instructions of their main loop (one
    row tile, per thread: a row block and a column block) are their speed as far as a CPU can tell
    (`benchmarks/sass_census.py`). The arithmetic is the design's: per orientation pass 2 runs five
    butterfly stages of 32 adds, two multiplies per element (1/sqrt(32), 2^-e) and 48 FP8
    conversions (E4M3 and back, for 32 elements in pairs); pass 1 four stages and 16 adds of
    magnitudes, and one multiply per block. The loop stays within a budget a few per cent above
    what it issues today (557 and 1059 instructions), so that an edit that adds layout work shows
    here before a device call times it."""
    census = _census_module()
    try:
        kernel = census.compile_packer("rowwise", pass_)
        loop = census.main_loop(census.sass(kernel.asm["cubin"]))
    except RuntimeError as e:  # no ptxas / cuobjdump in this Triton install
        pytest.skip(f"cannot compile and disassemble for sm_90 here: {e}")
    counts = census.census(loop)
    ops = counts["opcodes"]
    assert (ops.get("FADD", 0), ops.get("FMUL", 0), ops.get("F2FP", 0)) == (fadd, fmul, f2fp)
    assert counts["loop"] <= budget


@pytest.mark.parametrize("colsum, walk1_budget", [(False, 1110), (True, 1145)])
def test_the_one_pass_packer_compiles_and_issues_about_three_quarters_of_the_two_passes(colsum, walk1_budget):
    """The one-pass packer (`mx_operands_onepass_cuda`) is worth its complexity only in issue: its two walks
    over a piece of a stripe (walk 1 one tile per trip, as pass 2 encodes it; walk 2 re-scaling the rows'
    bytes) issue 1083 + 174 instructions per tile and thread where the two passes issue 557 + 1059 (1119 +
    174 against 557 + 1093 with column sums). It stores both orientations by lane pairs, in the layout the
    pair swap needs, with the hardware's FP8 conversions and no flush-to-zero arithmetic, in 128 registers
    without spilling in the walks: four programs of 4 warps on an SM (its first tile, 32 x 256 on 8 warps,
    took 168: one program per SM)."""
    census = _census_module()
    try:
        kernel = census.compile_onepass(colsum)
        walks = census.onepass_walks(census.sass(kernel.asm["cubin"]))
    except RuntimeError as e:  # no ptxas / cuobjdump in this Triton install
        pytest.skip(f"cannot compile and disassemble for sm_90 here: {e}")
    assert lane_pair_shuffles_hold(kernel.asm["ttgir"], PAIR_SHUFFLE_ASM) == [True, True]
    ptx = kernel.asm["ptx"]
    assert "st.global.v4.b32" in ptx and "cvt.rn.satfinite.e4m3x2.f16x2" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    assert not re.findall(r"[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz\.f32", ptx)
    # a piece's row maxima published by plain stores and read by volatile loads (another SM wrote them; 0 is
    # "not yet"), with no fence or acquire on the way
    assert re.search(r"ld\.volatile\.global\.", ptx)
    assert not re.search(r"\.(acquire|release)\.", ptx)
    walk1, walk2 = (census.census(w) for w in walks)
    ops = walk1["opcodes"]
    # the arithmetic of pass 2 (two rotations, the multiplies, the conversions), and the column sums' adds
    assert (ops.get("FADD", 0), ops.get("FMUL", 0), ops.get("F2FP", 0)) == (350 if colsum else 320, 128, 96)
    assert walk1["loop"] <= walk1_budget
    # per trip 8 words a thread: each 2 conversions to f16x2, 2 multiplies, 2 back, and their loads and stores
    assert walk2["opcodes"].get("F2FP", 0) == 32 and walk2["loop"] <= 180
    assert _registers(kernel.asm) <= 128
    for w in walks:  # (a few spills outside them, once per stripe)
        assert not {census.opcode(t) for t in w} & {"STL", "LDL"}
