"""`jstrategy.config`: mirrors the cluster setup call of `tf.config`, the numerics check
of `tf.debugging`, and debug switches."""

from jstrategy._src.run.mirrored_check import experimental_check_mirrored
from jstrategy._src.strategies.tpu import experimental_connect_to_cluster
from jstrategy._src.training.step.check_numerics import check_numerics_enabled
from jstrategy._src.training.step.check_numerics import disable_check_numerics
from jstrategy._src.training.step.check_numerics import enable_check_numerics

__all__ = [
    "check_numerics_enabled",
    "disable_check_numerics",
    "enable_check_numerics",
    "experimental_check_mirrored",
    "experimental_connect_to_cluster",
]
