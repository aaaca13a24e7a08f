"""torch's CUTLASS row-wise scaled FP8 GEMM, built as a tiny op library against the running torch.

`torch._scaled_mm` with [M, 1] and [1, N] fp32 scales runs cuBLASLt's row-wise kernel on sm_90
whenever cuBLASLt is 12.9 or newer. torch also ships a CUTLASS kernel for the same GEMM
(`at::cuda::detail::f8f8bf16_rowwise`: 128x128 or 64x128 tiles with 2x1 or 1x2 clusters, bias in
bf16 or fp32, bf16 out), exported with a public header but taken only where cuBLASLt lacks
row-wise scaling. `cutlass_rowwise.cpp` registers that entry point as the op
`torch.ops.mxflux_cutlass.rowwise_scaled_mm`; this module compiles it with the host C++ compiler
(no nvcc: the library holds no device code, it calls torch's) into a cache directory keyed by the
torch version, loads it, and calls it. `probe_rowwise_gemm.py` times it beside cuBLASLt's.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import torch

__all__ = ["SOURCE", "compile_command", "load", "rowwise_scaled_mm"]

SOURCE = Path(__file__).with_name("cutlass_rowwise.cpp")


def compile_command(output: Path | None = None, *, syntax_only: bool = False) -> list[str]:
    """The compiler's command line for the op library (at `output`) against the running torch's
    headers; `syntax_only` checks the source without building (no CUDA libraries needed)."""
    root = Path(torch.__file__).parent
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("cutlass_rowwise: needs a C++ compiler (g++ or $CXX)")
    cmd = [cxx, "-std=c++20", "-O2", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", str(SOURCE)]
    if syntax_only:
        return [*cmd, "-fsyntax-only"]
    if output is None:
        raise ValueError("compile_command: name the library's output path")
    return [*cmd, "-shared", f"-L{root / 'lib'}", "-ltorch_cuda", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{root / 'lib'}", "-o", str(output)]


@functools.lru_cache(maxsize=None)
def load() -> str | None:
    """Build (once per torch version) and load the op library; None when it is usable, else why not."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return "needs a CUDA device of sm_90 or later"
    cache = Path(os.environ.get("MXFLUX_CACHE", Path.home() / ".cache" / "mxflux"))
    lib = cache / f"cutlass_rowwise-{torch.__version__}" / "libcutlass_rowwise.so"
    try:
        if not lib.is_file() or lib.stat().st_mtime < SOURCE.stat().st_mtime:
            lib.parent.mkdir(parents=True, exist_ok=True)
            r = subprocess.run(compile_command(lib), capture_output=True, text=True)
            if r.returncode != 0:
                return f"the op library did not build: {r.stderr.strip().splitlines()[-1:]}"
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        return f"the op library did not load: {e}"
    return None


def rowwise_scaled_mm(a, b, scale_a, scale_b, bias, out, *, use_fast_accum: bool = False):
    """out [M, N] bf16 = (a [M, K] · b [N, K]ᵀ) * scale_a [M, 1] * scale_b [1, N] + bias, on torch's
    CUTLASS kernel (`load()` first)."""
    torch.ops.mxflux_cutlass.rowwise_scaled_mm(a, b.t(), scale_a, scale_b, bias, use_fast_accum, out)
    return out
