"""The packers' machine code, counted on a CPU: what each kernel's main loop issues per tile and thread.

The packers are bound by instruction issue, not by memory (benchmarks/NOTES.md, "The two-pass row
packer is issue-bound"), so the instructions of their main loop are the one speed measure a machine
without a GPU can take. This compiles each kernel for sm_90 ahead of time (Triton's compiler and the
Triton wheel's ptxas and cuobjdump; no GPU, no CUDA driver), specialised as a launch specialises it
(16-byte aligned pointers, row lengths and strides multiples of 16), finds the main loop in the SASS
(the longest backward branch: the persistent programs' walk over row tiles) and counts its
instructions by opcode and by kind:

- arithmetic the numerics need: the butterflies (FADD), the 1/sqrt(32) and 2^-e multiplies (FMUL),
  the FP8 conversions (F2FP), the f16x2 saturate and re-scale (HMNMX2, HMUL2, HFMA2), the amax
  (FMNMX), and the prologue's where there is one (MUFU, FFMA, ...);
- memory: global, shared and shuffle instructions;
- the rest: integer, layout and address work (PRMT, SHF, LOP3, IMAD, IADD3, LEA, SEL, ISETP, ...)
  and control. That is what a rewrite with explicit layouts could remove; the arithmetic stays.

    PYTHONPATH=src python3 benchmarks/sass_census.py [--json PATH]

Needs Triton 3.6 (`make .kernel-deps/.installed`; PYTHONPATH=.kernel-deps:src). Per element of the
tile, a pass's loop count divided by 32 (one row block and one column block per thread) is its
instructions per element and orientation pair; the H200 issues about 33.4 T thread-instructions/s.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ARITHMETIC = {"FADD", "FMUL", "FFMA", "F2FP", "HMNMX2", "HMUL2", "HFMA2", "HADD2", "FMNMX", "MUFU", "FSETP", "FSEL",
              "FCHK", "FRND", "F2F", "I2F", "F2I"}
MEMORY = {"LDG", "STG", "LDS", "STS", "LDSM", "STSM", "SHFL", "RED", "REDG", "ATOM", "ATOMG", "LDC", "ULDC"}
CONTROL = {"BRA", "BAR", "EXIT", "NOP", "BSSY", "BSYNC", "WARPSYNC", "CALL", "RET", "DEPBAR"}

# (name, granularity, pass, prologue, fp32 input, column sums): the kernels a training step launches
VARIANTS = (
    ("row pass 1 (X, dY)", "rowwise", 1, "none", False, False),
    ("row pass 2 (X)", "rowwise", 2, "none", False, False),
    ("row pass 2 (dY, column sums)", "rowwise", 2, "none", False, True),
    ("row pass 2 (W fp32)", "rowwise", 2, "none", True, False),
    ("row pass 1, GELU prologue", "rowwise", 1, "gelu_tanh", False, False),
    ("row pass 2, GELU prologue", "rowwise", 2, "gelu_tanh", False, False),
    ("1x128 (one pass)", "blockwise", 2, "none", False, False),
    ("32 (one pass)", "exact", 2, "none", False, False),
)

_PACK_SIG = {"x_ptr": "*bf16", "aux_ptr": "*bf16", "stride_x": "i32", "stride_aux": "i32", "R": "i32", "C": "i32",
             "Rp": "i32", "row_data_ptr": "*i32", "row_scale_ptr": "*fp32", "col_data_ptr": "*i32",
             "col_scale_ptr": "*fp32", "colsum_ptr": "*fp32", "outside_ptr": "*i64", "row_eref_ptr": "*i32",
             "col_eref_ptr": "*i32", "n_row_tiles": "i32", "n_prog_r": "i32"}
# the integers a launch passes as multiples of 16 (Triton specialises on that; R and the loop bounds
# are not specialised)
_DIVISIBLE = ("stride_x", "stride_aux", "C", "Rp")


def compile_packer(granularity: str, pass_: int, prologue: str = "none", x_f32: bool = False,
                   colsum: bool = False):
    """The packer kernel `mx_operands_cuda` launches for these flags (both orientations, the
    Hadamard rotation on), compiled for sm_90 with the plan's options: Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mxflux.kernels import operands_cuda, operands_plan
    from mxflux.mx import FoldGranularity

    g = FoldGranularity(granularity)
    consts = {"PASS": pass_, "DO_ROW": True, "DO_COL": True, "DO_COLSUM": colsum, "HADAMARD": True, "HW": True,
              **operands_plan.kernel_constexprs(g, prologue, x_f32=x_f32)}
    sig = dict(_PACK_SIG, x_ptr="*fp32") if x_f32 else dict(_PACK_SIG)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty.startswith("*") or name in _DIVISIBLE}
    src = ASTSource(fn=operands_cuda._pack_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                    constexprs=consts, attrs=attrs)
    options = {"num_warps": operands_plan.kernel_num_warps(g), "enable_fp_fusion": False,
               "enable_reflect_ftz": False}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


_ONEPASS_SIG = {"x_ptr": "*bf16", "stride_x": "i32", "R": "i32", "C": "i32", "Rp": "i32", "row_data_ptr": "*fp8e4nv",
                "row_scale_ptr": "*fp32", "col_data_ptr": "*fp8e4nv", "col_scale_ptr": "*fp32", "colsum_ptr": "*fp32",
                "outside_ptr": "*i64", "held_ptr": "*i32", "cmax_ptr": "*u8", "rexp_ptr": "*i8", "pmax_ptr": "*i16",
                "helped_ptr": "*i32", "n_stripes": "i32", "n_prog": "i32"}


def compile_onepass(colsum: bool = False, headroom: int = 1):
    """The one-pass packer's kernel (`mx_operands_onepass_cuda`) for sm_90, specialised as a launch is."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mxflux.kernels import operands_onepass

    consts = {"HEADROOM": headroom, "DO_COLSUM": colsum, "HADAMARD": True, "HW": True,
              **operands_onepass.onepass_constexprs()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(_ONEPASS_SIG.items())
             if ty.startswith("*") or name in ("stride_x", "C", "Rp")}
    signature = {**_ONEPASS_SIG, **dict.fromkeys(consts, "constexpr")}
    src = ASTSource(fn=operands_onepass._onepass_kernel, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": operands_onepass.ONEPASS_WARPS, "enable_fp_fusion": False, "enable_reflect_ftz": False,
               "maxnreg": operands_onepass.ONEPASS_MAXNREG}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise RuntimeError(f"this Triton wheel has no {name} ({path}): install triton==3.6.0 (make .kernel-deps/.installed)")
    return path


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction of a cubin, by the Triton wheel's cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*(?:/\*.*)?$", line)
        if m:
            found.append((int(m.group(1), 16), m.group(2).rstrip(" ;")))
    return found


def opcode(instruction: str) -> str:
    """The base opcode of one SASS instruction: predicate and modifiers dropped (`@!P3 BRA 0xe00` -> BRA,
    `LDG.E.128` -> LDG)."""
    text = re.sub(r"^@!?U?P[T\d]+\s+", "", instruction.strip())
    return text.split()[0].split(".")[0] if text else ""


def _loop_spans(instructions: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) index of every loop: from the target of a backward branch to that branch."""
    spans = []
    for i, (addr, text) in enumerate(instructions):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text) if opcode(text) == "BRA" else None
        if m and int(m.group(1), 16) < addr:
            target = int(m.group(1), 16)
            spans.append((next(j for j, (a, _) in enumerate(instructions) if a >= target), i))
    return spans


def main_loop(instructions: list[tuple[int, str]]) -> list[str]:
    """The instructions of the longest loop. In the packers that is the persistent programs' walk over
    their row tiles (one tile per trip)."""
    spans = _loop_spans(instructions)
    if not spans:
        raise ValueError("no backward branch in this kernel: no loop to count")
    s, e = max(spans, key=lambda se: se[1] - se[0])  # (the first of equally long ones)
    return [text for _, text in instructions[s:e + 1]]


def inner_loops(instructions: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions of every loop that holds no other loop, in address order."""
    spans = _loop_spans(instructions)
    inner = [(s, e) for s, e in spans if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in spans)]
    return [[text for _, text in instructions[s:e + 1]] for s, e in sorted(inner)]


def onepass_walks(instructions: list[tuple[int, str]]) -> tuple[list[str], list[str]]:
    """The one-pass packer's walk 1 (its longest loop that holds no other) and walk 2 (the other such loop with
    conversions: the rows re-scaled); its other inner loops read a stripe's row maxima, published or from x."""
    loops = inner_loops(instructions)
    walk1 = max(loops, key=len)
    walk2 = [w for w in loops if w is not walk1 and any(opcode(t) == "F2FP" for t in w)]
    if len(walk2) != 1:
        raise ValueError(f"expected one loop re-scaling the rows beside walk 1, found {len(walk2)}")
    return walk1, walk2[0]


def census(loop: list[str]) -> dict:
    """Counts by opcode and by kind (arithmetic, memory, control, and integer / layout for the rest)."""
    ops = collections.Counter(opcode(t) for t in loop)
    kinds = collections.Counter()
    for op, n in ops.items():
        kinds["arithmetic" if op in ARITHMETIC else "memory" if op in MEMORY else "control" if op in CONTROL
              else "integer and layout"] += n
    return {"loop": len(loop), "kinds": dict(kinds), "opcodes": dict(ops.most_common())}


def measure(variants=VARIANTS) -> dict:
    import torch
    import triton

    rows = {}
    for name, granularity, pass_, prologue, x_f32, colsum in variants:
        kernel = compile_packer(granularity, pass_, prologue, x_f32, colsum)
        everything = sass(kernel.asm["cubin"])
        rows[name] = {"granularity": granularity, "pass": pass_, "prologue": prologue, "fp32 input": x_f32,
                      "column sums": colsum, "kernel": len(everything), **census(main_loop(everything))}
    for colsum in (False, True):
        everything = sass(compile_onepass(colsum).asm["cubin"])
        walk1, walk2 = onepass_walks(everything)
        rows[f"one-pass walk 1 ({'dY, column sums' if colsum else 'X'})"] = {
            "granularity": "rowwise", "pass": "one", "prologue": "none", "fp32 input": False, "column sums": colsum,
            "kernel": len(everything), **census(walk1)}
        if not colsum:
            rows["one-pass walk 2 (rows re-scaled)"] = {
                "granularity": "rowwise", "pass": "one", "prologue": "none", "fp32 input": False,
                "column sums": False, "kernel": len(everything), **census(walk2)}
    return {"target": "sm_90", "triton": triton.__version__, "torch": torch.__version__, "variants": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the counts as JSON")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("sass_census: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)", file=sys.stderr)
        return 2
    try:
        res = measure()
    except (ImportError, RuntimeError) as e:
        print(f"sass_census: {e}", file=sys.stderr)
        return 2
    print(f"sm_90 SASS of the packers' main loop, per tile and thread (Triton {res['triton']}):")
    print(f"  {'kernel':32s} {'loop':>5s} {'arith':>6s} {'memory':>6s} {'int/layout':>10s} {'control':>7s}  top opcodes")
    for name, r in res["variants"].items():
        k = r["kinds"]
        top = ", ".join(f"{op} {n}" for op, n in list(r["opcodes"].items())[:6])
        print(f"  {name:32s} {r['loop']:5d} {k.get('arithmetic', 0):6d} {k.get('memory', 0):6d} "
              f"{k.get('integer and layout', 0):10d} {k.get('control', 0):7d}  {top}")
    if args.json:
        from mxflux.bench.provenance import provenance
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
