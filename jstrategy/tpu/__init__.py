"""`jstrategy.tpu`: mirrors `tf.tpu`."""

from jstrategy.tpu import experimental

__all__ = ["experimental"]
