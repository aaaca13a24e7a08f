"""mxflux: train Flux diffusion transformers with MXFP6 linear layers.

MXFP6 here is OCP MX with E2M3 elements and one E8M0 scale per block of 32 elements, optionally
rotated by a 32-point Walsh-Hadamard transform. ``mxflux.mx`` holds the pure-PyTorch reference
numerics (quantize, dequantize, MX GEMM) and the exact fold of MXFP6 operands into row-scaled FP8
(E4M3), which lets Hopper GPUs run MXFP6 GEMMs on FP8 tensor cores. Importing ``mxflux`` itself is
cheap: it does not import torch.
"""

__all__ = ["__version__"]


def __getattr__(name: str):
    """`__version__`, looked up when first asked for: importlib.metadata costs ~25 ms, and the command
    line installs its stop-signal handlers right after this package is imported (`mxflux.cli`), so
    importing it first would leave a signal in that window to kill the process without a word."""
    if name != "__version__":
        raise AttributeError(f"module 'mxflux' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("mxflux")
    except PackageNotFoundError:  # running from a source tree that was never pip-installed
        value = "0.1.0"
    globals()["__version__"] = value
    return value
