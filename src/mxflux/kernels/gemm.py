"""Scaled FP8 GEMMs on cuBLAS: `scaled_gemm_cuda`, the fast twin of
`mxflux.mx.scaled_gemm.scaled_gemm_reference` (docs/design.md, "The three GEMMs and their operands").

out = (A ⊙ scale_a)(B ⊙ scale_b)ᵀ + bias, fp32 accumulation, one rounding to out_dtype. A is
[M, K] and B is [N, K], float8_e4m3fn, contiguous along K (what `mx_operands_cuda` writes). The
caller names the operands' `FoldGranularity`, which picks the GEMM:

- ROWWISE   a_scale [M, 1], b_scale [N, 1]: `torch._scaled_mm`, row-wise fp32 scales, bias in the
  cuBLAS epilogue, `use_fast_accum=False` (Hopper's fast FP8 accumulation keeps ~14 bits).
- BLOCKWISE a_scale [M, K/128], b_scale [N, K/128]: cuBLAS 1x128 block scaling (CUDA >= 12.9),
  scales passed outer-dim-major as cuBLAS wants them.
- EXACT     a_scale [M, K/32], b_scale [N, K/32]: dequantized to bf16 (exact: E2M3 values have 4
  significant bits and the scales are powers of two) and a bf16 GEMM with fp32 output.

Where the epilogue cannot take the bias for the requested output, the GEMM writes fp32 and the
bias is added in fp32 before the one rounding. What each torch build accepts is found once per
device and cached (`_capabilities`). Shape rules measured on the H200: GEMM_SHAPE_RULES.
"""

from __future__ import annotations

import functools

import torch

from ..mx.constants import FP8_GEMM_ALIGN, MX_BLOCK
from ..mx.granularity import FoldGranularity
from ..mx.matmul import true_fp32
from ..switches import choice
from . import gemm_cute
from .triton_common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    _BLOCK = tl.constexpr(MX_BLOCK)

__all__ = ["DEFER_BIAS_MAX_N", "DEFER_MIN_TOKENS", "DEFER_SCALES", "DEFER_SCALES_MODES", "GEMM_SHAPE_RULES", "defers_scales",
           "deferred_scale_gemm", "scaled_gemm_cuda", "scaled_gemm_cuda_traceable"]

# What cuBLAS (through torch 2.11 + CUDA 13 on an H200) needs; see benchmarks/RESULTS.md.
GEMM_SHAPE_RULES = {
    FoldGranularity.ROWWISE: "K % 16 == 0 and N % 16 == 0 (FP8 leading dimensions in 16-byte multiples); M any",
    FoldGranularity.BLOCKWISE: "K % 128 == 0 (one scale per 128 of K), N % 16 == 0; M % 4 == 0 (else A is padded)",
    FoldGranularity.EXACT: "K % 32 == 0; bf16 GEMM: any M, N (cuBLAS pads internally)",
}


def _check_scales(a_data, a_scale, b_data, b_scale, granularity: FoldGranularity) -> None:
    """The scale shapes `granularity` implies for A [M, K] and B [N, K]."""
    (m, k), n = a_data.shape, b_data.shape[0]
    if k % granularity.row_multiple:
        raise ValueError(f"a_data: {granularity.value} GEMMs need K to be a multiple of "
                         f"{granularity.row_multiple}, got K={k}")
    g = granularity.groups(k)
    if tuple(a_scale.shape) != (m, g) or tuple(b_scale.shape) != (n, g):
        raise ValueError(f"a_scale, b_scale: a {granularity.value} GEMM of A [{m}, {k}] and B [{n}, {k}] "
                         f"takes scales [{m}, {g}] and [{n}, {g}], got {tuple(a_scale.shape)} and "
                         f"{tuple(b_scale.shape)}")


def _check(a_data, a_scale, b_data, b_scale, bias, out_dtype):
    for name, t in (("a_data", a_data), ("b_data", b_data)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn or t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D torch.float8_e4m3fn tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if not t.is_cuda:
            raise ValueError(f"{name}: scaled_gemm_cuda needs CUDA tensors, got device {t.device}")
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D float32 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"a_data, b_data: contraction lengths differ ({a_data.shape[1]} vs {b_data.shape[1]})")
    if a_scale.shape[0] != a_data.shape[0] or b_scale.shape[0] != b_data.shape[0]:
        raise ValueError(f"a_scale, b_scale: need one row per operand row, got {tuple(a_scale.shape)} for "
                         f"A {tuple(a_data.shape)} and {tuple(b_scale.shape)} for B {tuple(b_data.shape)}")
    n = b_data.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n,)):
        raise ValueError(f"bias: expected a tensor of shape ({n},), got {getattr(bias, 'shape', bias)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")


@functools.lru_cache(maxsize=None)
def _capabilities(device_index: int) -> dict:
    """What this torch/cuBLAS accepts, probed once with tiny operands (host-side checks only)."""
    dev = torch.device("cuda", device_index)
    m, n, k = 64, 64, 256
    a = torch.ones(m, k, device=dev).to(torch.float8_e4m3fn)
    b = torch.ones(n, k, device=dev).to(torch.float8_e4m3fn)
    caps = {}

    def tries(fn):
        try:
            fn()
            torch.cuda.synchronize(dev)
            return True
        except Exception:  # torch raises RuntimeError/NotImplementedError/TypeError for unsupported forms
            return False

    sa = torch.ones(m, 1, device=dev)
    sb = torch.ones(1, n, device=dev)
    bias16 = torch.zeros(n, device=dev, dtype=torch.bfloat16)
    caps["rowwise_fp32_out"] = tries(lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float32))
    caps["rowwise_bias_fp32_out"] = tries(
        lambda: torch._scaled_mm(a, b.t(), sa, sb, bias=bias16.float(), out_dtype=torch.float32))
    sa128 = torch.ones(k // 128, m, device=dev).t()  # [M, K/128], outer-dim-major
    sb128 = torch.ones(k // 128, n, device=dev)  # [K/128, N] contiguous: B's 1x128 scales, outer-dim-major
    caps["blockwise"] = tries(lambda: torch._scaled_mm(a, b.t(), sa128, sb128, out_dtype=torch.bfloat16))
    caps["blockwise_bias"] = caps["blockwise"] and tries(
        lambda: torch._scaled_mm(a, b.t(), sa128, sb128, bias=bias16, out_dtype=torch.bfloat16))
    caps["blockwise_fp32_out"] = caps["blockwise"] and tries(
        lambda: torch._scaled_mm(a, b.t(), sa128, sb128, out_dtype=torch.float32))
    ab = torch.ones(m, k, device=dev, dtype=torch.bfloat16)
    caps["mm_out_dtype"] = tries(lambda: torch.mm(ab, ab.t(), out_dtype=torch.float32))
    return caps


def _caps(t: torch.Tensor) -> dict:
    return _capabilities(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _finish(out32: torch.Tensor, bias, out_dtype):
    if bias is not None:
        out32 = out32 + bias.float()
    return out32 if out_dtype == torch.float32 else out32.to(out_dtype)


def _rowwise(a_data, a_scale, b_data, b_scale, bias, out_dtype):
    if gemm_cute.takes(a_data, b_data, bias is not None, out_dtype):  # MXFLUX_CUTE_GEMM, where installed
        try:
            return gemm_cute.cute_scaled_gemm(a_data, a_scale, b_data, b_scale, bias, out_dtype)
        except gemm_cute.CuteGemmUnusable:
            pass  # warned once; cuBLAS from now on
    sb = b_scale.t()  # [1, N]
    if out_dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16):
        # bias (exact in fp32) is added to the fp32 accumulator in the epilogue: one rounding
        return torch._scaled_mm(a_data, b_data.t(), a_scale, sb, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=False)
    if _caps(a_data)["rowwise_fp32_out"]:
        out = torch._scaled_mm(a_data, b_data.t(), a_scale, sb, out_dtype=torch.float32, use_fast_accum=False)
        return _finish(out, bias, out_dtype)
    raise RuntimeError("scaled_gemm_cuda: this torch has no fp32-output row-wise _scaled_mm; "
                       "pass a bfloat16 bias and out_dtype=torch.bfloat16")


def _blockwise(a_data, a_scale, b_data, b_scale, bias, out_dtype):
    if gemm_cute.takes_blockwise(a_data, b_data, bias is not None, out_dtype):  # MXFLUX_CUTE_BLOCKWISE=on
        try:
            return gemm_cute.cute_scaled_gemm(a_data, a_scale, b_data, b_scale, bias, out_dtype, "fp32-bscol")
        except gemm_cute.CuteGemmUnusable:
            pass  # warned once; cuBLAS from now on
    caps = _caps(a_data)
    if not caps["blockwise"]:
        raise RuntimeError("scaled_gemm_cuda: cuBLAS 1x128 block scaling is unavailable "
                           "(needs CUDA >= 12.9 and a torch that exposes it); use mode 'rowwise' or 'exact'")
    m = a_data.shape[0]
    if m % 4 and m > 1:
        # cuBLAS rejects outer-dim-major scales whose leading dimension is not a multiple of 4
        # (CUBLAS_STATUS_NOT_SUPPORTED at M=1001 on the H200): pad A with zero rows
        pad = -m % 4
        a_data = torch.cat([a_data, a_data.new_zeros(pad, a_data.shape[1])])
        a_scale = torch.cat([a_scale, a_scale.new_ones(pad, a_scale.shape[1])])
        return _blockwise(a_data, a_scale, b_data, b_scale, bias, out_dtype)[:m]
    sa = a_scale.t().contiguous().t()  # outer-dim-major [M, K/128]
    sb = b_scale.t().contiguous()  # [K/128, N]
    if out_dtype == torch.bfloat16 and (bias is None or (bias.dtype == torch.bfloat16 and caps["blockwise_bias"])):
        return torch._scaled_mm(a_data, b_data.t(), sa, sb, bias=bias, out_dtype=out_dtype, use_fast_accum=False)
    if caps["blockwise_fp32_out"]:
        out = torch._scaled_mm(a_data, b_data.t(), sa, sb, out_dtype=torch.float32, use_fast_accum=False)
        return _finish(out, bias, out_dtype)
    # Neither the bias nor fp32 output fits this epilogue: bf16 GEMM, then the bias in fp32.
    # That is a second rounding; RESULTS.md records when this path is taken.
    out = torch._scaled_mm(a_data, b_data.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=False)
    return _finish(out.float(), bias, out_dtype)


if HAS_TRITON:  # one-pass dequantization kernel; torch ops otherwise

    @triton.jit
    def _dequant_kernel(d_ptr, s_ptr, o_ptr, n_blocks, BLOCKS: tl.constexpr):
        b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        m = b < n_blocks
        off = b[:, None] * _BLOCK + tl.arange(0, _BLOCK)[None, :]
        q = tl.load(d_ptr + off, mask=m[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        sc = tl.load(s_ptr + b, mask=m, other=1.0)
        # E4M3 -> fp32 is exact, times a power of two is exact, and the E2M3-derived value has 4
        # significant bits, so the bf16 cast is exact too
        tl.store(o_ptr + off, (q.to(tl.float32) * sc[:, None]).to(tl.bfloat16), mask=m[:, None])


def _dequant_bf16(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact bf16 values of a [R, K] E4M3 operand with [R, K/MX_BLOCK] power-of-two scales."""
    r, k = data.shape
    if HAS_TRITON:
        out = torch.empty(r, k, dtype=torch.bfloat16, device=data.device)
        n = r * k // MX_BLOCK
        blocks = 64
        _dequant_kernel[(-(-n // blocks),)](data.view(torch.uint8), scale, out, n, BLOCKS=blocks, num_warps=4)
        return out
    v = data.to(torch.bfloat16).view(r, k // MX_BLOCK, MX_BLOCK) * scale.to(torch.bfloat16).unsqueeze(-1)
    return v.view(r, k)


def _exact(a_data, a_scale, b_data, b_scale, bias, out_dtype):
    a = _dequant_bf16(a_data, a_scale)
    b = _dequant_bf16(b_data, b_scale)
    if out_dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16):
        # cuBLAS adds the bias to the fp32 accumulator and rounds once; no bf16 split-K reduction
        flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            return torch.nn.functional.linear(a, b, bias)
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
    # true fp32 accumulation: no TF32, and not the bf16 of an enclosing autocast region
    with true_fp32(a.device.type):
        if _caps(a_data)["mm_out_dtype"]:
            out = torch.mm(a, b.t(), out_dtype=torch.float32)
        else:  # an fp32 GEMM on the exact values: correct, slower
            out = a.float() @ b.float().t()
    return _finish(out, bias, out_dtype)


def _gemm_plan(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype):
    """Validate a call and pick its route: (GEMM function, whether each of A, scale_a, B, scale_b
    needs a contiguous copy). Depends only on `_gemm_key`'s parts."""
    if not isinstance(granularity, FoldGranularity):
        raise ValueError(f"granularity: expected a FoldGranularity, got {granularity!r}")
    _check(a_data, a_scale, b_data, b_scale, bias, out_dtype)
    _check_scales(a_data, a_scale, b_data, b_scale, granularity)
    k, n = a_data.shape[1], b_data.shape[0]
    if granularity is not FoldGranularity.EXACT and (k % FP8_GEMM_ALIGN or n % FP8_GEMM_ALIGN):
        raise ValueError(f"a_data, b_data: cuBLAS FP8 GEMMs need K and N multiples of {FP8_GEMM_ALIGN}, got "
                         f"K={k}, N={n} (use the 'exact' mode or pad)")
    one_group = granularity is FoldGranularity.BLOCKWISE and a_scale.shape[1] == 1
    if granularity is FoldGranularity.ROWWISE or one_group:
        # BLOCKWISE at K = 128 has one group per row: torch reads [M, 1] scales as row-wise.
        fn = _rowwise
    elif granularity is FoldGranularity.BLOCKWISE:
        fn = _blockwise
    else:
        fn = _exact
    copies = tuple(not t.is_contiguous() for t in (a_data, a_scale, b_data, b_scale))
    return fn, copies if any(copies) else None


def _tensor_key(t) -> tuple:
    if not isinstance(t, torch.Tensor):
        return (type(t),)
    return (t.shape, t.stride(), t.dtype, t.device)


_GEMM_PLANS: dict[tuple, tuple] = {}


def _gemm_key(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype) -> tuple:
    """What validation and the route depend on: each tensor's shape, strides, dtype and device
    (the bias's too), the granularity and the output dtype."""
    return (_tensor_key(a_data), _tensor_key(a_scale), _tensor_key(b_data), _tensor_key(b_scale),
            None if bias is None else _tensor_key(bias), granularity, type(granularity), out_dtype)


def scaled_gemm_cuda(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    granularity: FoldGranularity,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """out[M, N] = (A ⊙ scale_a)(B ⊙ scale_b)ᵀ + bias on cuBLAS, for operands folded at `granularity`.

    Validation and the choice of GEMM are made once per key (`_gemm_key`: shapes, strides, dtypes,
    devices, granularity, output dtype) and cached: host time per call bounds small micro-batches."""
    key = _gemm_key(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype)
    plan = _GEMM_PLANS.get(key)
    if plan is None:
        plan = _gemm_plan(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype)
        if len(_GEMM_PLANS) >= 4096:
            _GEMM_PLANS.clear()
        _GEMM_PLANS[key] = plan
    fn, copies = plan
    return fn(*_contiguous(copies, a_data, a_scale, b_data, b_scale), bias, out_dtype)


def _contiguous(copies, *operands):
    """The operands, each copied contiguous where the plan says it must be (`_gemm_plan`)."""
    return operands if copies is None else tuple(t.contiguous() if c else t for t, c in zip(operands, copies))


# Where compiled code runs a row-granularity GEMM as the unit-scaled (tensor-wise) FP8 GEMM with its
# row and column scales applied by the code that reads the output (`deferred_scale_gemm`): "auto" (the
# default) by `defers_scales`' shape rule, "all" every bias-free GEMM, "none" never (cuBLAS's row-scaled
# GEMM, as before; A/B runs). Two trial modes take the GEMMs with a bias too, by auto's shape rule: "bias"
# writes their unit-scaled sums in fp32 (the contract's one rounding kept, twice the output's bytes), and
# "bias-rounded" writes them in the output dtype and adds the bias after that rounding (torchao's FP8
# linears do so; outside this GEMM's contract). Read once, at import: MXFLUX_DEFER_SCALES.
DEFER_SCALES_MODES = ("auto", "all", "bias", "bias-rounded", "none")
DEFER_SCALES = choice("MXFLUX_DEFER_SCALES", "auto", DEFER_SCALES_MODES)

# The smallest N or K from which cuBLAS's row-scaled FP8 kernels fall behind its tensor-wise ones
# (torch._scaled_mm alone, H100, torch 2.11, M = 32768, 2026-12-06): row-scaled runs 128x128 tiles where
# tensor-wise runs 192x192 or 128x160, 7-16 % slower at N or K >= 9216, and the two tie at 3072 x 3072
# (proj). The step it gives: benchmarks/RESULTS.md, "Current headline".
DEFER_MIN_DIM = 8192
# ... and the fewest tokens: the faster tiles save time in proportion to the tokens, while a weight
# gradient's scaling pass is weight-sized whatever their number. On the 6+12-block model at 4096 tokens
# (H100, 2026-12-06) the step without deferred scales ran 1 % faster (2 % less device time).
DEFER_MIN_TOKENS = 8192

# In the "bias" trial modes a GEMM with a bias and more output columns than this keeps the row-scaled
# kernel. Flux has one: a single block's linear1 (N = 21504), whose output four readers take apart (q, k,
# v, the MLP input); deferred, inductor wrote its scaled output in a pass of its own (a standalone
# `to_copy_add_mul` kernel, 4.5 ms of the proxy's MBS-64 step on an H100, more than its faster tiles saved).
DEFER_BIAS_MAX_N = 16384


def defers_scales(n: int, k: int, tokens: int, has_bias: bool, mode: str | None = None) -> bool:
    """Whether a compiled row-granularity GEMM with N output columns, contraction K and `tokens` tokens
    (`gemm_cute.gemm_tokens`) runs as `deferred_scale_gemm`: by default where N or K >= `DEFER_MIN_DIM` and
    the tokens >= `DEFER_MIN_TOKENS`. With a bias only in the trial modes "bias" and "bias-rounded": the
    bias belongs before the one rounding, inside the epilogue that only the row-scaled kernel offers,
    unless the unit-scaled sums are written in fp32 ("bias"; adding it to the rounded result,
    "bias-rounded", rounds twice), and then only up to `DEFER_BIAS_MAX_N` output columns. `mode` defaults
    to `DEFER_SCALES`."""
    mode = DEFER_SCALES if mode is None else mode
    if mode == "none" or (has_bias and (mode not in ("bias", "bias-rounded") or n > DEFER_BIAS_MAX_N)):
        return False
    return mode == "all" or (max(n, k) >= DEFER_MIN_DIM and tokens >= DEFER_MIN_TOKENS)


def deferred_scale_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                        out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                        bias_after_rounding: bool = False) -> torch.Tensor:
    """(A ⊙ a_scale)(B ⊙ b_scale)ᵀ for row-granularity operands (a_scale [M, 1], b_scale [N, 1], powers
    of two), as the unit-scaled FP8 GEMM, rounded to `out_dtype`, times a_scale · b_scaleᵀ.

    With a `bias`: the unit-scaled sums in fp32 (the accumulator as it is), times the scales (exact),
    plus the bias in fp32, rounded once to `out_dtype`: the row-scaled kernel's bias epilogue, step by
    step. With `bias_after_rounding` the sums are rounded to `out_dtype` as without a bias and the
    bias is added to that (in fp32, rounded again): half the bytes, not the GEMM contract's bits.

    Bit-identical to the row-scaled GEMM wherever the output is a normal number of `out_dtype`:
    rounding commutes with multiplication by a power of two, so round(acc) · 2^e = round(acc · 2^e).
    The unit-scaled sums themselves are always normal: every E4M3 product is a multiple of 2^-18 and
    at most 448², so |acc| < K · 2^18 (< 2^32 at K = 15360), far inside bf16's range. Only an output
    that is itself subnormal (below 2^-126) can differ in its last bits.
    Traced by torch.compile, the multiplication is an elementwise op on the GEMM's output, which
    inductor fuses into whatever reads the output next (what a dgrad result feeds, the weight
    gradient's cast): the GEMM runs cuBLAS's tensor-wise kernels, which pick larger tiles than its
    row-scaled ones."""
    one = torch.ones((), dtype=torch.float32, device=a_data.device)
    if bias is not None and not bias_after_rounding:
        acc = torch._scaled_mm(a_data, b_data.t(), one, one, out_dtype=torch.float32, use_fast_accum=False)
        return (acc * (a_scale * b_scale.t()) + bias.float()).to(out_dtype)
    acc = torch._scaled_mm(a_data, b_data.t(), one, one, out_dtype=out_dtype, use_fast_accum=False)
    out = (acc.float() * (a_scale * b_scale.t())).to(out_dtype)
    return out if bias is None else (out.float() + bias.float()).to(out_dtype)


def scaled_gemm_cuda_traceable(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    granularity: FoldGranularity,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor | None:
    """`scaled_gemm_cuda` as torch ops that torch.compile can trace, for the row granularity;
    None for any other (the caller then uses the opaque op).

    Traced, the GEMM is `aten._scaled_mm` in the graph, which inductor launches from its generated
    code like any other GEMM: no custom-op dispatch and none of our Python per call (about a third
    of an MX GEMM's host time). With a bias, or where `defers_scales` says no, it is the same cuBLAS
    call with the same arguments as `_rowwise`, so the same bits; a bias-free GEMM that
    `defers_scales` names runs as `deferred_scale_gemm`, the same bits from cuBLAS's faster
    tensor-wise kernels (its docstring says where and why). Validation runs once, while tracing;
    there is no plan cache and no capability probe (a probe would run GEMMs inside the trace): the
    fp32-output form that `_rowwise` probes for is taken as present, as it is on every CUDA build of
    the torch versions this package supports (>= 2.11)."""
    fn, copies = _gemm_plan(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype)
    if fn is not _rowwise or gemm_cute.takes(a_data, b_data, bias is not None, out_dtype):  # the op runs the CuTe GEMM
        return None
    a_data, a_scale, b_data, b_scale = _contiguous(copies, a_data, a_scale, b_data, b_scale)
    if defers_scales(b_data.shape[0], a_data.shape[1], gemm_cute.gemm_tokens(a_data, out_dtype), bias is not None):
        return deferred_scale_gemm(a_data, a_scale, b_data, b_scale, out_dtype, bias, DEFER_SCALES == "bias-rounded")
    sb = b_scale.t()
    if out_dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16):
        return torch._scaled_mm(a_data, b_data.t(), a_scale, sb, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=False)
    out = torch._scaled_mm(a_data, b_data.t(), a_scale, sb, out_dtype=torch.float32, use_fast_accum=False)
    return _finish(out, bias, out_dtype)
