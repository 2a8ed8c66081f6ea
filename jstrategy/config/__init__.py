"""`jstrategy.config`: mirrors the cluster setup call of `tf.config`, and debug switches."""

from jstrategy._src.mirrored_check import experimental_check_mirrored
from jstrategy._src.tpu import experimental_connect_to_cluster

__all__ = ["experimental_check_mirrored", "experimental_connect_to_cluster"]
