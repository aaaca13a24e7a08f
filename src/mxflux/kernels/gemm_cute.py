"""The row-granularity MX GEMM on CuTe DSL's kernel (`cute_rowwise_gemm`: CUTLASS's persistent Hopper FP8
GEMM with the row and column scales and the bias in its epilogue), where CuTe DSL is installed (`pip install
.[cute]`) and a Hopper GPU is present. MXFLUX_CUTE_GEMM says which GEMMs it takes: `auto` (the default) every
GEMM of at least MXFLUX_CUTE_MIN_TOKENS tokens (2048 with apache-tvm-ffi installed, 8192 without; see the floor
below); or, at any size, those named by what they compute:
`bias` (bf16 out with a bias: the forward GEMMs), `bf16` (bf16 out, no bias: the input gradients), `fp32`
(fp32 out: the weight gradients), a comma-separated list of them, or `all`; `off`: none (cuBLAS's GEMMs).

Why: cuBLAS offers one row-scaled FP8 algorithm (128x128 tiles, no clusters), slower in the step than its
tensor-wise kernels, and the scales cannot be deferred to the next op without the partitioner writing the
scaled output whole (benchmarks/NOTES.md, "The fprop GEMMs unit-scaled"). This one applies them where
the accumulator is, with the tensor-wise kernels' class of tiles. Its epilogue is the GEMM contract's (the
power-of-two scales exact, the bias added in fp32, one rounding), and so, by default, is its main loop:
each k-tile's partial sums (K 128) are added into fp32 registers, as cuBLAS's GEMMs without fast
accumulation do; on an H100 its outputs equalled cuBLAS's row-scaled GEMM's bit for bit at every Flux
GEMM (tests/gpu/test_gemm_cuda.py). MXFLUX_CUTE_ACCUMULATE=fast sums all of K in the tensor cores' FP8
accumulator instead (cuBLAS's fast accumulation, which torchao's FP8 recipe runs in its forward GEMMs):
faster, outside the contract, opt-in. Eager and compiled calls both take it for the GEMMs it is on for,
and a run names it (`train.step_path`).

Why the token floor: a call costs more host time than cuBLAS's, which a step of small GEMMs cannot hide.
Through the DSL's own calling convention (the six tensors wrapped per call) the 6+12-block model at 2048-4096
tokens ran 0.70x bf16 on it, 43 % of the step idle, while the proxy at 8192-32768 tokens gained 5-7 %; through
TVM-FFI's (apache-tvm-ffi installed: the torch tensors as they are, a sixth of the host time) the same model
ran 1.19x bf16 (benchmarks/RESULTS.md). So the floor is 2048 tokens with TVM-FFI, 8192 without.

Tiles are visited in bands of SWIZZLE tile columns (MXFLUX_CUTE_SWIZZLE, at most; the largest power of
two that divides the problem's tile columns): within a band the persistent CTAs walk down M, so A is read
from memory once per band rather than once per tile column, while the band's B stays in L2.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import torch

from ..switches import SwitchError, choice, positive_int, subset
from . import gemm_quack

CUTE_GEMM_KINDS = ("bias", "bf16", "fp32")
# `auto`'s floor in tokens, by calling convention (`prepared_gemm`): through TVM-FFI's, the smallest GEMMs
# measured gained (the 6+12-block model's, 2048 and 4096 tokens: its step 1.124x FP8's on an H100, against 1.091x
# with them on cuBLAS); through the DSL's own, whose call costs ~120 µs of host time, only the proxy's at MBS 32
# and up (8192 and 16384 tokens; benchmarks/RESULTS.md)
MIN_TOKENS_TVM_FFI, MIN_TOKENS_DSL = 2048, 8192


@functools.cache
def tvm_ffi_present() -> bool:
    """apache-tvm-ffi importable: the kernel is then compiled with CuTe DSL's TVM-FFI calling convention,
    which takes torch tensors as they are (DLPack in C) and the stream from torch's current one."""
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    except Exception as e:  # installed but broken: the DSL's own convention still works
        warnings.warn(f"apache-tvm-ffi is installed but does not import ({type(e).__name__}: {e}); the CuTe GEMM is "
                      "called through CuTe DSL's own convention (more host time per call)", stacklevel=2)
        return False
    return True


class CuteGemm(NamedTuple):
    """Which GEMMs the kernel takes: those of `kinds` with at least `min_tokens` tokens."""
    kinds: frozenset
    min_tokens: int


def cute_gemm_choice(value: str) -> CuteGemm:
    """What MXFLUX_CUTE_GEMM=`value` means (tests set it by this)."""
    if value == "auto":
        floor = MIN_TOKENS_TVM_FFI if tvm_ffi_present() else MIN_TOKENS_DSL
        return CuteGemm(frozenset(CUTE_GEMM_KINDS), positive_int("MXFLUX_CUTE_MIN_TOKENS", floor, "tokens"))
    try:
        return CuteGemm(subset("MXFLUX_CUTE_GEMM", "off", CUTE_GEMM_KINDS, value), 0)
    except SwitchError:
        raise SwitchError(f"MXFLUX_CUTE_GEMM: expected auto, off, all or a comma-separated list of "
                          f"{', '.join(CUTE_GEMM_KINDS)}; got {value!r}") from None


CUTE_GEMM = cute_gemm_choice(os.environ.get("MXFLUX_CUTE_GEMM", "auto"))
# How the kernel sums K: `fp32`, each k-tile's partial sums added into fp32 registers (the GEMM contract's:
# cuBLAS's bits on an H100), `fp32h`, `fp32p3`, `fp32p4` the same sums with each k-tile's WGMMAs in 2, 3 or 4
# groups, one per part of the tile's N, a part's adds under the later parts' WGMMAs (`promotion_parts`: A/Bs; on an
# H100 the same bits, no faster in the step), or `fast`, every WGMMA into one accumulator (the tensor cores' FP8
# accumulation, outside the contract). Its tile (M, N) and cluster (M, N): the tensor-wise kernels' class; N 192
# where the second accumulator needs the registers.
# the parts of N each k-tile's promotion is split into (`RowScaledFP8Gemm`'s promotion_parts)
PROMOTION_PARTS = {"fp32h": 2, "fp32p3": 3, "fp32p4": 4}
ACCUMULATION = choice("MXFLUX_CUTE_ACCUMULATE", "fp32", ("fp32", *PROMOTION_PARTS, "fast"))
# Block scales at the promotion, by the output columns one B scale covers (`RowScaledFP8Gemm`'s block_scale_columns):
# scales per k-tile, a_scale [M, K/128] and b_scale [N/64, K/128] (no packer writes those yet: the probe's trial) or
# [N, K/128] (the 1x128 packers' of `mx_gemm: blockwise`, see BLOCKWISE); not an MXFLUX_CUTE_ACCUMULATE choice
BLOCK_SCALES = {"fp32-bs64": 64, "fp32-bscol": 1}
# `mx_gemm: blockwise`'s GEMM (1x128 scales on both operands, which its one-pass packers write) on the CuTe kernel
# with block scales per column (`fp32-bscol`) in place of cuBLAS's 1x128 kernel: a trial, opt-in (`on`); on an H100
# 5-7x slower than the row-scaled kernel, the step 3.6x slower (benchmarks/NOTES.md, "Block scales at the promotion,
# measured"; tests/gpu/test_gemm_cuda.py checks its bound and bits)
BLOCKWISE = choice("MXFLUX_CUTE_BLOCKWISE", "off", ("off", "on"))
CONFIGS = {"fast": ((128, 256), (2, 1)), "fp32": ((128, 192), (2, 1)), "fp32k2": ((128, 192), (2, 1)),
           **{name: ((128, 192), (2, 1)) for name in (*PROMOTION_PARTS, *BLOCK_SCALES)}}
CONFIG = CONFIGS[ACCUMULATION]
SWIZZLE = positive_int("MXFLUX_CUTE_SWIZZLE", 8, "tile columns")
# Whose kernel runs the GEMMs taken: `rowwise`, ours (`cute_rowwise_gemm`), or one of quack-kernels' schedules with
# our contract's epilogue (`gemm_quack`: ping-pong 64x192 or cooperative 128x192 tiles, 2x1 clusters; opt-in, an A/B
# of the schedule, fp32 accumulation only; measured no faster in the step)
KERNEL = choice("MXFLUX_CUTE_KERNEL", "rowwise", ("rowwise", *gemm_quack.CONFIGS))
if KERNEL != "rowwise" and ACCUMULATION != "fp32":
    raise SwitchError(f"MXFLUX_CUTE_KERNEL={KERNEL} sums K in fp32 only: expected MXFLUX_CUTE_ACCUMULATE=fp32 "
                      f"with it, got {ACCUMULATION}")


def swizzle_for(tiles_n: int, most: int) -> int:
    """The band width in tile columns: the largest power of two <= `most` that divides `tiles_n` (the
    scheduler rounds the band count up, and a band past the last column would read scales past the end)."""
    s = 1
    while s * 2 <= most and tiles_n % (s * 2) == 0:
        s *= 2
    return s


def kind(has_bias: bool, out_dtype: torch.dtype) -> str:
    return "bias" if has_bias else "fp32" if out_dtype == torch.float32 else "bf16"


def gemm_tokens(a_data: torch.Tensor, out_dtype: torch.dtype) -> int:
    """The tokens of an MX linear's GEMM with A = `a_data`: its M, but for the weight gradient (fp32 out),
    which contracts over them: its K."""
    return a_data.shape[1] if out_dtype == torch.float32 else a_data.shape[0]


@torch.compiler.assume_constant_result
def available() -> bool:
    """CuTe DSL importable and a Hopper GPU present. Traced by torch.compile (every compiled MX GEMM asks,
    through `takes`) it is called, not traced, and its answer taken as a constant: traced, a failed import is
    a graph break, which would split every compiled block at each GEMM where CuTe DSL is not installed."""
    return _cute_dsl_runs_here()


@functools.cache
def _cute_dsl_runs_here() -> bool:
    if KERNEL != "rowwise" and not gemm_quack.installed():  # asked for by name: say why it does not run
        warnings.warn(f"MXFLUX_CUTE_KERNEL={KERNEL} needs quack-kernels, which does not import here; the MX GEMMs "
                      "run on cuBLAS", stacklevel=2)
        return False
    try:
        import cutlass.cute  # noqa: F401
    except ImportError:
        return False
    except Exception as e:  # installed but broken (a missing CUDA-version library): say so once, use cuBLAS
        warnings.warn(f"CuTe DSL (nvidia-cutlass-dsl) is installed but does not import ({_what(e)}); the MX GEMMs "
                      "run on cuBLAS", stacklevel=2)
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _what(e: Exception) -> str:
    """An exception in one line: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class CuteGemmUnusable(RuntimeError):
    """The kernel could not be built or loaded here (warned once): the caller runs cuBLAS's GEMM instead."""


# Why the kernel does not run in this process, once a build or a first launch failed (None: it may).
_UNUSABLE: str | None = None


def _give_up(e: Exception) -> CuteGemmUnusable:
    """Stop taking GEMMs for the rest of the process, saying why once (a toolkit or driver the DSL's
    build does not suit: the whole step should not fail for a kernel cuBLAS can stand in for)."""
    global _UNUSABLE
    _UNUSABLE = _what(e)
    warnings.warn(f"the CuTe-DSL GEMM does not run here ({_UNUSABLE}); the MX GEMMs run on cuBLAS from now on",
                  stacklevel=3)
    return CuteGemmUnusable(_UNUSABLE)


def takes(a_data: torch.Tensor, b_data: torch.Tensor, has_bias: bool, out_dtype: torch.dtype,
          config=None) -> bool:
    """Whether this row-granularity GEMM runs here: `CUTE_GEMM` names its kind and it has the tokens
    `CUTE_GEMM` asks for, the kernel builds and loads here, and M and N are whole clusters of tiles (the
    epilogue reads each row's and column's scale unguarded; K needs 16 bytes, as cuBLAS's FP8 GEMMs).
    `config`: the tile and cluster asked about (`CONFIG`, the accumulation's, by default)."""
    if (kind(has_bias, out_dtype) not in CUTE_GEMM.kinds or gemm_tokens(a_data, out_dtype) < CUTE_GEMM.min_tokens
            or not a_data.is_cuda or not available() or _UNUSABLE is not None):
        return False
    (tile_m, tile_n), (cluster_m, cluster_n) = CONFIG if config is None else config  # whole clusters
    return (a_data.shape[0] % (tile_m * cluster_m) == 0 and b_data.shape[0] % (tile_n * cluster_n) == 0
            and a_data.shape[1] % 16 == 0)


def takes_blockwise(a_data: torch.Tensor, b_data: torch.Tensor, has_bias: bool, out_dtype: torch.dtype) -> bool:
    """Whether this 1x128 block-scaled GEMM (`mx_gemm: blockwise`) runs here on the kernel with block scales per
    column: `BLOCKWISE` on, and what `takes` asks of a row-granularity GEMM, on that kernel's tiles (K comes in
    whole 128-wide groups, as the granularity has it)."""
    return BLOCKWISE == "on" and takes(a_data, b_data, has_bias, out_dtype, CONFIGS["fp32-bscol"])


def _tensor(t: torch.Tensor, dtype, leading_dim: int, tvm_ffi: bool = False):
    """`t` as the DSL takes it (FP8 viewed as bytes, the DSL's DLPack not knowing torch's FP8 dtypes;
    TVM-FFI's does), its element type `dtype`, its layout dynamic but for the unit stride."""
    from cutlass.cute.runtime import from_dlpack

    if tvm_ffi:
        ct = from_dlpack(t, assumed_align=16, enable_tvm_ffi=True)
    else:
        ct = from_dlpack(t.view(torch.uint8) if t.element_size() == 1 else t, assumed_align=16)
    ct.element_type = dtype
    return ct.mark_layout_dynamic(leading_dim=leading_dim)


_COMPILED: dict = {}


def kernel_for(n: int, config, most_swizzle: int | None = None, accumulation: str = ACCUMULATION):
    """The kernel for N output columns: `config`'s tile and cluster, tiles visited in bands of the widest
    power of two of tile columns, at most `most_swizzle` (SWIZZLE by default), that divides them; K summed
    as `accumulation` says: `fast`, `fp32` (promoted every k-tile of K 128), `fp32h`, `fp32p3`, `fp32p4` (the
    same, in 2, 3 or 4 parts of N), `fp32k2` (every two: the probe's trial; K a multiple of 256) or `fp32-bs64`,
    `fp32-bscol` (every k-tile, times its block scales: the probe's trial, `BLOCK_SCALES`)."""
    import cutlass

    from .cute_rowwise_gemm import RowScaledFP8Gemm

    tile, cluster = config
    return RowScaledFP8Gemm(cutlass.Float32, tile, cluster, _band_width(n, config, most_swizzle), True,
                            accumulation != "fast", 2 if accumulation == "fp32k2" else 1,
                            PROMOTION_PARTS.get(accumulation, 1), BLOCK_SCALES.get(accumulation))


def _band_width(n: int, config, most_swizzle: int | None) -> int:
    (_, tile_n), (_, cluster_n) = config
    return swizzle_for(n // (tile_n * cluster_n), SWIZZLE if most_swizzle is None else most_swizzle)


def prepared_gemm(a_data, a_scale, b_data, b_scale, bias, out, config=None, most_swizzle=None,
                  accumulation=ACCUMULATION, tvm_ffi=None):
    """A call with no arguments that writes out [M, N] (bf16 or fp32) = (A ⊙ a_scale)(B ⊙ b_scale)ᵀ + bias:
    a_data [M, K], b_data [N, K] E4M3 (contiguous), a_scale [M, 1], b_scale [N, 1] fp32, bias [N] or None.
    `kernel_for`'s kernel is compiled once per bias, output dtype, tile, cluster, band width and calling
    convention (layouts are dynamic); `config` None: the accumulation's own tile and cluster.

    The calling convention (`tvm_ffi` None: TVM-FFI's where apache-tvm-ffi is installed): through TVM-FFI
    the call takes the torch tensors; through the DSL's own the six tensors are wrapped here first
    (`_tensor`), which on an H100 host measured 74 µs of a 120 µs call against 16 µs for TVM-FFI's whole
    call, with the same output bits (benchmarks/bench_host.py): the host time that made small GEMMs' steps
    idle (see the module's note on the token floor)."""
    config = CONFIGS[accumulation] if config is None else config
    if accumulation == "fp32k2" and a_data.shape[1] % 256:  # K in pairs of 128-wide k-tiles: no tile left over
        raise ValueError(f"fp32k2 accumulation needs K a multiple of 256, got {a_data.shape[1]}")
    tvm_ffi = tvm_ffi_present() if tvm_ffi is None else tvm_ffi
    import cutlass
    import cutlass.cute as cute

    if accumulation in BLOCK_SCALES:  # [M, K/128] and [groups, K/128], row-major
        a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    else:
        a_scale, b_scale = a_scale.reshape(-1).contiguous(), b_scale.reshape(-1).contiguous()
    # without a bias the kernel reads none (a compile-time flag): b_scale stands in, no tensor made per call
    tensors = (a_data.unsqueeze(-1), b_data.unsqueeze(-1), out.unsqueeze(-1), a_scale, b_scale,
               bias.float().contiguous() if bias is not None else b_scale)
    key = (bias is not None, out.dtype, *config, _band_width(b_data.shape[0], config, most_swizzle), accumulation,
           tvm_ffi)
    compiled = _COMPILED.get(key)
    if tvm_ffi and compiled is not None:  # the torch tensors are the arguments: nothing to wrap
        return lambda: compiled(*tensors)
    out_type = cutlass.Float32 if out.dtype == torch.float32 else cutlass.BFloat16
    types = (cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, out_type, cutlass.Float32, cutlass.Float32, cutlass.Float32)
    args = tuple(_tensor(t, dtype, 0 if t.dim() == 1 else 1, tvm_ffi) for t, dtype in zip(tensors, types))
    stream = _stream(tvm_ffi)
    if compiled is None:  # the kernel object is built only to compile (host time per call: bench_host.py)
        kernel = kernel_for(b_data.shape[0], config, most_swizzle, accumulation)
        cluster = config[1]
        clusters = cutlass.utils.HardwareInfo().get_max_active_clusters(cluster[0] * cluster[1])
        compiled = _COMPILED[key] = cute.compile(kernel, *args, bias is not None, clusters, stream,
                                                 **({"options": "--enable-tvm-ffi"} if tvm_ffi else {}))
    if tvm_ffi:
        return lambda: compiled(*tensors)
    # the wrappers only point at the tensors' memory: the call keeps the tensors made here alive
    return lambda tensors=tensors: compiled(*args, stream)


def _stream(tvm_ffi: bool):
    """The stream argument: for TVM-FFI a placeholder that makes the call take torch's current stream; for the
    DSL's own convention torch's current stream itself."""
    if tvm_ffi:
        from cutlass.cute.runtime import make_fake_stream

        return make_fake_stream(use_tvm_ffi_env_stream=True)
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


# The signatures quack's kernel has run (MXFLUX_CUTE_KERNEL=quack-*): quack compiles and caches per signature
# inside its call, so a signature's first call is where a build or load fails
_QUACK_RAN: set = set()


def cute_scaled_gemm(a_data, a_scale, b_data, b_scale, bias, out_dtype, accumulation=ACCUMULATION) -> torch.Tensor:
    """(A ⊙ a_scale)(B ⊙ b_scale)ᵀ + bias: a_data [M, K], b_data [N, K] E4M3 (contiguous), a_scale [M, 1],
    b_scale [N, 1] fp32, bias [N] or None, out bf16 or fp32; K summed as `accumulation` says, on its tiles
    (MXFLUX_CUTE_KERNEL's: ours, or quack's schedule with fp32 sums).
    CuteGemmUnusable where the kernel cannot be built, or a kernel built by this call fails its first launch
    (which loads it: where a driver or toolkit mismatch shows)."""
    out = torch.empty(a_data.shape[0], b_data.shape[0], dtype=out_dtype, device=a_data.device)
    quack = KERNEL != "rowwise" and accumulation not in BLOCK_SCALES  # (quack's epilogue takes row scales)
    signature = (a_data.shape, b_data.shape, bias is not None, out_dtype)
    built = len(_COMPILED)
    try:
        call = (gemm_quack.prepared_gemm(KERNEL, a_data, a_scale, b_data, b_scale, bias, out) if quack else
                prepared_gemm(a_data, a_scale, b_data, b_scale, bias, out, accumulation=accumulation))
    except ValueError:  # a call the kernel does not take: the caller's mistake, not the machine's
        raise
    except Exception as e:
        raise _give_up(e) from e
    # this call's kernel not run before: ours compiled it just now, quack compiles in its call
    first = signature not in _QUACK_RAN if quack else len(_COMPILED) != built
    if not first:  # built and run before: an error now is an error
        call()
        return out
    try:
        call()
    except Exception as e:
        raise _give_up(e) from e
    if quack:
        _QUACK_RAN.add(signature)
    return out
