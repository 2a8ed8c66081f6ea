"""`jstrategy.config`: mirrors the cluster setup call of `tf.config`."""

from jstrategy._src.tpu import experimental_connect_to_cluster

__all__ = ["experimental_connect_to_cluster"]
