"""quack-kernels' Hopper FP8 GEMM as the row-granularity MX GEMM's kernel, with our GEMM contract's epilogue: an
opt-in alternative to `cute_rowwise_gemm` (MXFLUX_CUTE_KERNEL=quack-pingpong or quack-cooperative; `gemm_cute`
says which GEMMs take it).

Why it was built: our kernel is cooperative (two consumer warp groups share one 128x192 tile, so the epilogue of a
tile stalls the tensor cores). quack's ping-pong schedule gives each consumer warp group a tile of its own (64x192),
one warp group's epilogue overlapping the other's main loop, which is how CUTLASS's fastest Hopper GEMMs hide it.
Its main loop promotes each k-tile's FP8 partial sums into fp32 registers, as ours and cuBLAS's without fast
accumulation do; promoted sums need twice the accumulator registers, so 64x192 is the widest ping-pong tile that
builds for sm_90a without spills (64x256 spills 1056 bytes a thread). Measured on an H200 (benchmarks/NOTES.md,
"quack-kernels' ping-pong and cooperative GEMMs in the step"): both give cuBLAS's row-scaled bits; ping-pong's GEMMs
are 1.36x slower in the step (likely its 64-row tile, reading B twice as often), the cooperative one's 0.5 %
faster, with more host time a call. So it stays an A/B, not the default.

The epilogue is written for quack's epilogue front end (`quack.epilogue.frontend.gemm_epilogue`): per accumulator
element `acc * row_scale * col_scale (+ bias)` in fp32, then one rounding to the output type; the scales are
powers of two, so the products are exact and the bias is added to the exact scaled sum, as in the contract.
"""

from __future__ import annotations

import functools

# (tile M, tile N), cluster (M, N), ping-pong, of each schedule MXFLUX_CUTE_KERNEL can name
CONFIGS = {"quack-pingpong": ((64, 192), (2, 1), True), "quack-cooperative": ((128, 192), (2, 1), False)}


def row_scaled(acc, row_scale, col_scale):
    """The contract's epilogue as a quack epilogue function, per accumulator element: the row's and the column's
    power-of-two scales (exact), then the one rounding to the output type."""
    return {"D": acc * row_scale * col_scale}


def row_scaled_bias(acc, row_scale, col_scale, bias):
    """`row_scaled` and the bias, added in fp32 before the one rounding (ptxas contracts the last multiply and
    the add into an FMA: the same bits, the product by a power of two being exact)."""
    return {"D": acc * row_scale * col_scale + bias}


def installed() -> bool:
    """quack-kernels importable (it needs CuTe DSL, apache-tvm-ffi, einops and torch-c-dlpack-ext)."""
    try:
        import quack.epilogue.frontend  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def scaled_epilogues() -> dict:
    """quack epilogue modules of `row_scaled` and `row_scaled_bias` by whether a bias is added, the operands'
    kinds pinned (the scales' lengths M and N alone would not tell them apart where M = N)."""
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import ColVecLoad, RowVecLoad

    pins = {"row_scale": ColVecLoad("row_scale"), "col_scale": RowVecLoad("col_scale")}
    return {False: gemm_epilogue(ops=pins)(row_scaled),
            True: gemm_epilogue(ops={**pins, "bias": RowVecLoad("bias")})(row_scaled_bias)}


def prepared_gemm(config: str, a_data, a_scale, b_data, b_scale, bias, out, launch: bool = True):
    """A call with no arguments that writes out [M, N] (bf16 or fp32) = (A ⊙ a_scale)(B ⊙ b_scale)ᵀ + bias on
    quack's GEMM in `CONFIGS[config]`: a_data [M, K], b_data [N, K] E4M3 (contiguous), a_scale [M, 1] and
    b_scale [N, 1] (or [1, N]) fp32, bias [N] or None. Static persistent schedule, tile columns in bands of up to
    8 (as ours). quack compiles once per signature and caches the plan; `launch` False only builds it."""
    (tile_m, tile_n), (cluster_m, cluster_n), pingpong = CONFIGS[config]
    mod = scaled_epilogues()[bias is not None]
    epi_args = {"row_scale": a_scale.float().reshape(1, -1), "col_scale": b_scale.float().reshape(1, -1)}
    if bias is not None:
        epi_args["bias"] = bias.float().reshape(1, -1)
    return lambda: mod.gemm(a_data, b_data, out, epi_args=epi_args, tile_M=tile_m, tile_N=tile_n,
                            cluster_M=cluster_m, cluster_N=cluster_n, pingpong=pingpong, persistent=True,
                            is_dynamic_persistent=False, max_swizzle_size=8, _launch=launch)
