"""`jstrategy.experimental.partitioners`: mirrors `tf.distribute.experimental.partitioners`.

Example:

>>> from jstrategy.experimental.partitioners import MinSizePartitioner
>>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
[2, 1]
"""

from jstrategy._src.parameter_server.partitioners import FixedShardsPartitioner
from jstrategy._src.parameter_server.partitioners import MaxSizePartitioner
from jstrategy._src.parameter_server.partitioners import MinSizePartitioner
from jstrategy._src.parameter_server.partitioners import Partitioner

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
]
