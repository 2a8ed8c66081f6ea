"""Mixed precision, as `tf.keras.mixed_precision`: dtype policies and loss scaling.

Example:

>>> import jstrategy
>>> jstrategy.mixed_precision.Policy("mixed_bfloat16").compute_dtype
'bfloat16'
"""

from jstrategy._src.precision.loss_scale import DynamicLossScale
from jstrategy._src.precision.loss_scale import LossScaleFloorWarning
from jstrategy._src.precision.loss_scale import all_finite
from jstrategy._src.precision.loss_scale import select_if_finite
from jstrategy._src.precision.policy import Policy
from jstrategy._src.precision.policy import cast_to_compute
from jstrategy._src.precision.policy import cast_to_float32
from jstrategy._src.precision.policy import cast_to_variable
from jstrategy._src.precision.policy import global_policy
from jstrategy._src.precision.policy import set_global_policy

__all__ = [
    "DynamicLossScale",
    "LossScaleFloorWarning",
    "Policy",
    "all_finite",
    "cast_to_compute",
    "cast_to_float32",
    "cast_to_variable",
    "global_policy",
    "select_if_finite",
    "set_global_policy",
]
