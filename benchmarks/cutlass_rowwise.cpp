// torch's own CUTLASS row-wise scaled FP8 GEMM (at::cuda::detail::f8f8bf16_rowwise) registered as an
// op, for benchmarks/probe_rowwise_gemm.py. torch._scaled_mm runs cuBLASLt's kernel instead on sm_90
// with CUDA >= 12.9, so the CUTLASS one (128x128 or 64x128 tiles with 2x1 / 1x2 clusters) is
// reachable only through its exported C++ entry point.
#include <ATen/core/Tensor.h>
#include <ATen/native/cuda/RowwiseScaledMM.h>
#include <torch/library.h>

namespace {
// out = (a · b) * scale_a * scale_b + bias, a [M, K] row-major E4M3, b [K, N] column-major E4M3,
// scale_a [M, 1] and scale_b [1, N] fp32, bias [N] bf16 or fp32, out [M, N] bf16.
void rowwise_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                       const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, bool use_fast_accum,
                       at::Tensor& out) {
  at::cuda::detail::f8f8bf16_rowwise(a, b, scale_a, scale_b, bias, use_fast_accum, out);
}
}  // namespace

TORCH_LIBRARY(mxflux_cutlass, m) {
  m.def("rowwise_scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, bool use_fast_accum, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(mxflux_cutlass, CUDA, m) {
  m.impl("rowwise_scaled_mm", &rowwise_scaled_mm);
}
