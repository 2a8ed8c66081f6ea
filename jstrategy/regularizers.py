"""Keras's weight regularizers, for the ``kernel_regularizer=`` of `jstrategy.layers`.

Example:

>>> import jstrategy
>>> layer = jstrategy.layers.Dense(4, kernel_regularizer=jstrategy.regularizers.L2(0.01))
>>> layer.kernel_regularizer
L2(l2=0.01)
"""

from jstrategy._src.layers.regularizers import L1
from jstrategy._src.layers.regularizers import L1L2
from jstrategy._src.layers.regularizers import L2
from jstrategy._src.layers.regularizers import Regularizer
from jstrategy._src.layers.regularizers import get

__all__ = [
    "L1",
    "L1L2",
    "L2",
    "Regularizer",
    "get",
]
