"""MXFP6 layers and the precision policy that installs them."""

from .linear import MXFP6Linear
from .mlp import FusedMXFP6MLP
from .precision import PrecisionConfig, PrecisionReport, apply_precision

__all__ = ["FusedMXFP6MLP", "MXFP6Linear", "PrecisionConfig", "PrecisionReport",
           "apply_precision"]
