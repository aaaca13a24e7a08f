"""Whether a benchmark setting can run on this machine at all.

`mxflux bench step` compares several settings by default (bf16, torchao FP8 tensorwise and
rowwise, MXFP6). Some of them need hardware that a machine may lack: torchao float8 training runs
its GEMMs on `torch._scaled_mm`, which needs a CUDA GPU of compute capability 8.9 or newer, and a
captured trainer step (`train.cuda_graph`) needs a CUDA device, and quack-kernels' GEMM (MXFLUX_CUTE_KERNEL)
needs quack-kernels, CuTe DSL and a Hopper GPU. On a machine without them such a
setting is not a failure of the benchmark but a setting that does not apply there: the comparison
skips it, names it in one line with the reason, and runs the others.
"""

from __future__ import annotations

import torch

from ..train.config import RunConfig

__all__ = ["setting_unavailability"]


def setting_unavailability(cfg: RunConfig, device: torch.device) -> str | None:
    """Why `cfg` cannot be benchmarked on `device` (one short clause), or None when it can."""
    if cfg.precision.name == "fp8":
        from ..nn.precision.fp8 import fp8_unavailability

        why = fp8_unavailability(device)
        if why:
            return f"torchao FP8 needs a CUDA GPU of compute capability 8.9+ ({why})"
    if cfg.precision.name == "mxfp6":
        from ..kernels import gemm_cute, gemm_quack

        if gemm_cute.KERNEL != "rowwise" and not (gemm_quack.installed() and gemm_cute.available()):
            return (f"MXFLUX_CUTE_KERNEL={gemm_cute.KERNEL} needs quack-kernels, CuTe DSL and a Hopper GPU "
                    "(without them its GEMMs would run on cuBLAS)")
    if cfg.train.cuda_graph and device.type != "cuda":
        return f"train.cuda_graph captures the step as a CUDA graph, which needs a CUDA GPU (the device is {device})"
    return None
