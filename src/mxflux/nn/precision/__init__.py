"""Precisions as registered converters: which linears of a model run in which number format.

`apply_precision(model, cfg)` converts the linears a recipe's `precision:` block chooses and
returns a `PrecisionReport`. Each precision is one module here that registers a
`PrecisionConverter`: bf16 (the default), mxfp6, fp8 (torchao.float8). A new precision is a new
module with its converter plus its selector field and options in `PrecisionConfig`, imported below.
"""

# Registration, in the order PrecisionConfig checks the selector fields (isort: skip).
from . import bf16  # noqa: F401  isort: skip
from . import mxfp6  # noqa: F401  isort: skip
from . import fp8  # noqa: F401  isort: skip
from .apply import apply_precision
from .config import PrecisionConfig
from .registry import PrecisionConverter, converter_class, register_precision, registered_precisions
from .report import PrecisionReport

__all__ = ["PrecisionConfig", "PrecisionConverter", "PrecisionReport", "apply_precision",
           "converter_class", "register_precision", "registered_precisions"]
