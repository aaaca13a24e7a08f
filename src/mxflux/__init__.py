"""mxflux: train Flux diffusion transformers with MXFP6 linear layers.

MXFP6 here is OCP MX with E2M3 elements and one E8M0 scale per block of 32 elements, optionally
rotated by a 32-point Walsh-Hadamard transform. ``mxflux.mx`` holds the pure-PyTorch reference
numerics (quantize, dequantize, MX GEMM) and the exact fold of MXFP6 operands into row-scaled FP8
(E4M3), which lets Hopper GPUs run MXFP6 GEMMs on FP8 tensor cores. Importing ``mxflux`` itself is
cheap: it does not import torch.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mxflux")
except PackageNotFoundError:  # running from a source tree that was never pip-installed
    __version__ = "0.1.0"

__all__ = ["__version__"]
