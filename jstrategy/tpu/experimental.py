"""`jstrategy.tpu.experimental`: mirrors `tf.tpu.experimental`."""

from jstrategy._src.strategies.tpu import Topology
from jstrategy._src.strategies.tpu import initialize_tpu_system

__all__ = ["Topology", "initialize_tpu_system"]
