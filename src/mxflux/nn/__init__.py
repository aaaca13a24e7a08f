"""MXFP6 layers and the precision converters that install them (and torchao's FP8) in a model."""

from .linear import MXFP6Linear, rowwise_mx_linears
from .mlp import FusedMXFP6MLP, linears_with_own_forward
from .precision import (PrecisionConfig, PrecisionConverter, PrecisionReport, apply_precision,
                        register_precision)
from .weight_state import MXWeightState

__all__ = ["FusedMXFP6MLP", "MXFP6Linear", "MXWeightState", "PrecisionConfig", "PrecisionConverter", "PrecisionReport",
           "apply_precision", "linears_with_own_forward", "register_precision", "rowwise_mx_linears"]
