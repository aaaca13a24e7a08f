"""MXFP6 and FP8 layers and the precision policy that installs them."""

from .linear import FP8Linear, MXFP6Linear
from .mlp import FusedMXFP6MLP
from .precision import PrecisionConfig, PrecisionReport, apply_precision

__all__ = ["FP8Linear", "FusedMXFP6MLP", "MXFP6Linear", "PrecisionConfig", "PrecisionReport",
           "apply_precision"]
