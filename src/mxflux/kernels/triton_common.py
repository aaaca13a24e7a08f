"""Triton helpers shared by the MX packer kernels (`operands_cuda`): the Triton import guard,
the interpreter switch and launch options, tuples of tensors, and bit-exact conversions.

Every conversion here has two forms selected by the HW constexpr: the hardware instruction
(HW=True, what runs on the GPU) and an integer emulation of the same rounding (HW=False): Triton's
CPU interpreter rounds FP8 and bf16 casts half-up and mangles subnormals, so the interpreter tests
run the emulation, and the GPU tests check that both forms agree bit for bit.

Importing this module never needs Triton or CUDA: without Triton, HAS_TRITON is False and none
of the @triton.jit functions exist.
"""

from __future__ import annotations

import functools
import math
import os
import re

import torch

try:  # Triton is optional: CPU-only installs have none.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
except Exception:  # ImportError, or a Triton that cannot initialise on this machine
    triton = tl = libdevice = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "PAIR_SHUFFLE_ASM", "PROLOGUE_IDS", "CompiledLaunch", "compiled_launch", "interpreting", "lane_pair_shuffles_hold",
           "launch_options", "num_sms"]

# The prologue constexpr of the kernels, by the name `mxflux.mx.operands.PROLOGUES` uses.
PROLOGUE_IDS = {"none": 0, "gelu_tanh": 1, "gelu_tanh_grad": 2}

# torch's CUDA tanh-GELU constants (ActivationGeluKernel.cu): double expressions rounded to fp32.
_K_BETA = float(torch.tensor(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, dtype=torch.float32))
_K_KAPPA = float(torch.tensor(0.044715, dtype=torch.float32))
_K_3KAPPA = float(torch.tensor(3.0, dtype=torch.float32) * torch.tensor(_K_KAPPA, dtype=torch.float32))


@functools.cache
def interpreting() -> bool:
    """Triton's CPU interpreter. Read once, as Triton itself reads it when the kernels are defined
    (an environment lookup per call is a measurable part of the launch path's host time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_options(num_warps: int) -> dict:
    """Compile options of every packer launch (none under the interpreter)."""
    if interpreting():
        return {}
    # No FMA contraction (the FMAs of the prologues are written out) and IEEE subnormals in
    # libdevice, as nvcc builds torch's kernels.
    return {"num_warps": num_warps, "enable_fp_fusion": False, "enable_reflect_ftz": False}


# ------------------------------------------------------------------ launching compiled kernels
# Triton versions whose compiled-kernel launch convention `CompiledLaunch` is written against (read
# from triton/runtime/jit.py `JITFunction.run` and the CUDA launcher of that version): the launcher
# takes (grid x, y, z, stream, function, packed metadata, launch metadata, enter hook, exit hook,
# every kernel parameter in order, constexprs included). Any other version uses the normal launch.
_COMPILED_LAUNCH_VERSIONS = ((3, 6),)


@functools.cache
def _triton_version() -> tuple[int, int]:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return (0, 0)


def compiled_launch_supported() -> bool:
    """Whether `compiled_launch` may build launchers here: a Triton whose launch convention it
    knows, compiling for a GPU (not the interpreter), and MXFLUX_COMPILED_LAUNCH not 0 (the
    switch that puts every launch back on Triton's normal path, for A/B runs and as a way out)."""
    return (HAS_TRITON and not interpreting() and os.environ.get("MXFLUX_COMPILED_LAUNCH", "1") != "0"
            and _triton_version() in _COMPILED_LAUNCH_VERSIONS and hasattr(triton, "knobs"))


class CompiledLaunch:
    """Launches one compiled Triton kernel again, skipping `JITFunction.run`'s per-call work
    (argument binding and specialisation, the cache-key computation, the launch-metadata dict):
    what is left is the C launcher itself.

    Only valid for calls whose non-pointer arguments equal those of the call the kernel was
    compiled for and whose pointers keep its 16-byte alignment: the caller's launch plan is keyed
    on exactly that (shapes, strides, flags). Pointer arguments are passed as integer addresses
    (the launcher takes ints as raw device pointers and skips its per-pointer driver query)."""

    __slots__ = ("_fn", "_pre", "_function", "_tail", "device", "_stream", "_hooks", "_current_device")

    def __init__(self, compiled, device: int, tail: tuple, *, get_stream, hooks, current_device):
        run = compiled.run  # the launcher object (initialised by the first launch)
        self._function = compiled.function
        # (grid x, y, z, stream, function, *_pre, *kernel arguments) is the call of `_fn`
        self._fn, self._pre = run, (compiled.packed_metadata, None, None, None)
        if (getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0
                and callable(getattr(run, "launch", None)) and hasattr(run, "launch_cooperative_grid")
                and hasattr(run, "launch_pdl")):
            # the C function the launcher object calls, with the no-scratch arguments it would pass
            self._fn = run.launch
            self._pre = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
                         None, None, None)
        self._tail = tail  # the constexpr parameters, after the runtime ones
        self.device = device
        self._stream = get_stream  # device index -> the current raw stream (Triton's own getter)
        self._hooks = hooks  # the object holding launch_enter_hook / launch_exit_hook
        self._current_device = current_device

    def usable(self) -> bool:
        """False when the normal path must launch instead: another current device than the one the
        kernel was loaded on, or a launch hook installed (a profiler wants Triton's metadata)."""
        hooks = self._hooks
        for hook in (hooks.launch_enter_hook, hooks.launch_exit_hook):
            if hook is not None and getattr(hook, "calls", True):  # 3.6: an empty HookChain is idle
                return False
        return self._current_device() == self.device

    def __call__(self, grid: tuple[int, int], args: tuple) -> None:
        self._fn(grid[0], grid[1], 1, self._stream(self.device), self._function, *self._pre, *args, *self._tail)


def compiled_launch(compiled, runtime_names: tuple, runtime_args: tuple, constexprs: dict, device: int, *,
                    _env: dict | None = None):
    """A `CompiledLaunch` for what `kernel[grid](*runtime_args, **constexprs, **options)` just
    returned (`runtime_names`: the kernel's runtime parameters, in order), or None where this is
    not a Triton whose launch convention is known, or its compiled kernel is not the form this
    was written against: then the caller keeps launching the normal way. Checks that the kernel's
    parameters are the runtime ones then the constexprs, that every value the compiler baked in
    equals what will be passed, and that exactly the tensor arguments are pointer parameters.
    `_env` (tests) replaces Triton's stream getter, hook holder and current-device getter, and
    skips the version check."""
    if _env is None:
        if not compiled_launch_supported():
            return None
        # torch.cuda.current_device without its lazy-init check (CUDA is initialised: a kernel ran)
        _env = dict(get_stream=triton.runtime.driver.active.get_current_stream, hooks=triton.knobs.runtime,
                    current_device=getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device))
    try:
        if hasattr(compiled, "result"):  # an asynchronous compile: leave it to Triton
            return None
        src = compiled.src
        names = tuple(src.fn.arg_names)
        n = len(runtime_args)
        if names[:n] != tuple(runtime_names) or len(names) != n + len(constexprs) or set(names[n:]) != set(constexprs):
            return None
        tail = tuple(constexprs[k] for k in names[n:])
        values = tuple(runtime_args) + tail
        for path, value in src.constants.items():
            i = path[0] if isinstance(path, tuple) and len(path) == 1 else None
            if (i is None or isinstance(values[i], torch.Tensor) or type(values[i]) is not type(value)
                    or values[i] != value):
                return None
        for i, name in enumerate(names):
            ty = src.signature[name]
            pointer = isinstance(ty, str) and ty.startswith("*")
            if isinstance(values[i], torch.Tensor) != pointer or (i >= n and ty != "constexpr"):
                return None
        launch = CompiledLaunch(compiled, device, tail, **_env)
    except (AttributeError, KeyError, TypeError, IndexError):
        return None
    return launch if callable(launch._fn) and launch._function is not None else None


# The warp shuffle of the packers' `_swap_lane_pairs` (4 bytes with lane ^ 1): the inline asm the
# device code emits and the text the launch plan looks for in a compiled kernel. Plain Python, so
# the launch plan's checks import it without Triton.
PAIR_SHUFFLE_ASM = "shfl.sync.bfly.b32 $0, $1, 1, 0x1f, -1;"

_BLOCKED_LAYOUT = re.compile(r"^(#blocked\d*) = #ttg\.blocked<\{(.*)\}>", re.M)
_LIST_FIELD = re.compile(r"(\w+) = \[([\d, ]*)\]")


def lane_pair_shuffles_hold(ttgir: str, asm_prefix: str) -> list[bool]:
    """For each inline-asm op of a compiled kernel (its TTGIR) whose text starts with asm_prefix, a
    warp shuffle with lane ^ 1 over a tensor's elements: whether that tensor's layout puts the
    lowest bit of dim 0 on lane bit 0 with one element per thread along dim 0, so that lane ^ 1
    holds the dim-0 neighbour (d0 ^ 1) in the same registers. In a blocked layout lanes fill the
    dims in `order`, fastest first: dim 0 must be the first dim with more than one lane. A layout
    of another kind counts as not holding."""
    layouts = dict(_BLOCKED_LAYOUT.findall(ttgir))
    op = re.compile(r'elementwise_inline_asm "' + re.escape(asm_prefix) + r'.*-> tensor<[^,>]*, (#\w+)>')
    found = []
    for name in op.findall(ttgir):
        spec = layouts.get(name)
        if spec is None:
            found.append(False)
            continue
        field = {k: [int(v) for v in re.findall(r"\d+", vals)] for k, vals in _LIST_FIELD.findall(spec)}
        lanes = [d for d in field["order"] if field["threadsPerWarp"][d] > 1]
        found.append(bool(lanes) and lanes[0] == 0 and field["sizePerThread"][0] == 1)
    return found


if HAS_TRITON:
    _KB = tl.constexpr(_K_BETA)
    _KK = tl.constexpr(_K_KAPPA)
    _K3K = tl.constexpr(_K_3KAPPA)

    # ---------------------------------------------------------------- tuples of tensors
    @triton.jit
    def unzip(t, LOGN: tl.constexpr):
        """[..., 2, ..., 2] (LOGN trailing 2s) -> tuple of 2^LOGN tensors, index = those bits."""
        level = (t,)
        for lev in tl.static_range(LOGN):
            lo = ()
            hi = ()
            for i in tl.static_range(1 << lev):
                a, b = tl.split(level[i])
                lo = lo + (a,)
                hi = hi + (b,)
            level = lo + hi
        return level

    @triton.jit
    def zip_tuple(xs, LOGN: tl.constexpr):
        """Inverse of unzip: tuple of 2^LOGN tensors -> [..., 2, ..., 2]."""
        level = xs
        for lev in tl.static_range(LOGN):
            nxt = ()
            for i in tl.static_range(1 << (LOGN - 1 - lev)):
                nxt = nxt + (tl.join(level[i], level[i + (1 << (LOGN - 1 - lev))]),)
            level = nxt
        return level[0]


    @triton.jit
    def pow2_f32(k):
        """Exact fp32 2^k for integer k in [-149, 127] (subnormals included)."""
        bits = tl.where(k >= -126, (k + 127) << 23, 1 << tl.minimum(tl.maximum(k + 149, 0), 22))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def f16_pow2_bits(k):
        """Bits of the f16 2^k (k <= 15), 0 below f16's smallest subnormal."""
        sub = tl.where(k >= -24, 1 << tl.minimum(tl.maximum(k + 24, 0), 9), 0)
        return tl.where(k >= -14, (k + 15) << 10, sub)

    @triton.jit
    def f32_to_fp8_bits(x, SHIFT: tl.constexpr, BIAS_OFF: tl.constexpr, MIN_NORMAL: tl.constexpr,
                         SUB_Q: tl.constexpr, SUB_R: tl.constexpr, MAX_CODE: tl.constexpr):
        """FP8 byte of fp32 x in integer arithmetic (the interpreter's own casts round half-up):
        nearest even, saturating at MAX_CODE, NaN -> 0x7F. SHIFT = 23 - mantissa bits, BIAS_OFF =
        (127 - bias) << mantissa bits; below MIN_NORMAL the fp32 quantum at SUB_Q is the format's
        subnormal step and SUB_R its reciprocal."""
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        a = mag.to(tl.float32, bitcast=True)
        # normal range: round the fp32 mantissa, ties to even (carries bump the exponent)
        normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - BIAS_OFF
        sub = (((a + SUB_Q) - SUB_Q) * SUB_R).to(tl.int32)
        code = tl.where(a < MIN_NORMAL, sub, tl.minimum(normal, MAX_CODE)) | sign
        code = tl.where(mag > 0x7F800000, 0x7F, code)
        return code.to(tl.uint8)

    @triton.jit
    def f32_to_e4m3(x, HW: tl.constexpr):
        """E4M3 byte of fp32 x: nearest even, saturating at ±448, NaN -> 0x7F."""
        if HW:
            return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:  # 3 mantissa bits, bias 7; subnormals below 2^-6 in steps of 2^-9 (the fp32 quantum at 2^14)
            return f32_to_fp8_bits(x, 20, 960, 0.015625, 16384.0, 512.0, 0x7E)


    @triton.jit
    def e4m3_byte_to_f32(b):
        """fp32 value of an E4M3 byte (int32 0..255), NaN excluded, in integer arithmetic: the
        interpreter's fp8 casts do not round as the hardware does."""
        ex = (b >> 3) & 15
        mant = b & 7
        mag = tl.where(ex == 0, mant.to(tl.float32) * 0.001953125, (mant + 8).to(tl.float32) * pow2_f32(ex - 10))
        # sign by bit (Triton's unary minus is 0 - x, which loses the sign of zero)
        return (mag.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)

    @triton.jit
    def widen_bf16(v, HW: tl.constexpr):
        """bf16 tensor (even element count per thread) -> fp32: one shift or mask per element."""
        if HW:
            return tl.inline_asm_elementwise(
                "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [v],
                dtype=tl.float32, is_pure=True, pack=2)
        else:
            return bf16_to_f32(v, False)

    @triton.jit
    def bf16_to_f32(v, HW: tl.constexpr):
        if HW:
            return v.to(tl.float32)
        else:  # the interpreter's bf16 cast mangles subnormals: widen by bits
            return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)

    # ---------------------------------------------------------------- prologues
    @triton.jit
    def tanh_f32(x, HW: tl.constexpr):
        if HW:
            return libdevice.tanh(x)
        else:
            # the interpreter maps libdevice calls to numpy; spelled out to stay version-proof
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            return tl.where(x < 0, -t, t)

    @triton.jit
    def round_to_bf16(x, HW: tl.constexpr):
        """fp32 -> the fp32 value of its bf16 rounding (nearest even)."""
        if HW:
            return x.to(tl.bfloat16).to(tl.float32)
        else:
            b = x.to(tl.int32, bitcast=True)
            r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, b | 0x400000, r)
            return (r & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def prologue_f32(x, aux, PROLOGUE: tl.constexpr, HW: tl.constexpr):
        """fp32 values of bf16 inputs -> fp32 value of the bf16 result torch's CUDA kernel computes
        (fp32 math, FMAs exactly where nvcc contracts, one rounding to bf16)."""
        if PROLOGUE == 0:
            return x
        elif PROLOGUE == 1:
            x_cube = x * x * x
            inner = _KB * tl.fma(_KK, x_cube, x)
            t = tanh_f32(inner, HW)
            return round_to_bf16((0.5 * x) * (1.0 + t), HW)
        else:
            dy = x
            xf = aux
            x_sq = xf * xf
            x_cube = x_sq * xf
            inner = _KB * tl.fma(_KK, x_cube, xf)
            t = tanh_f32(inner, HW)
            left = 0.5 * xf
            right = 1.0 + t
            left_derivative = 0.5 * right
            tanh_derivative = tl.fma(-t, t, 1.0)
            inner_derivative = _KB * tl.fma(_K3K, x_sq, 1.0)
            derivative = tl.fma(left * tanh_derivative, inner_derivative, left_derivative)
            return round_to_bf16(dy * derivative, HW)


    @triton.jit
    def f32_rounded_to_bf16(x, HW: tl.constexpr):
        """fp32 -> bf16 rounded to nearest even, as torch's `.to(torch.bfloat16)`: a NaN becomes
        bf16 NaN (the packers treat every NaN alike)."""
        if HW:
            return x.to(tl.bfloat16)
        else:
            return f32_to_bf16(round_to_bf16(x, HW), HW)

    @triton.jit
    def f32_to_bf16(x, HW: tl.constexpr):
        """fp32 holding a bf16 value -> that bf16 (exact)."""
        if HW:
            return x.to(tl.bfloat16)
        else:
            return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
