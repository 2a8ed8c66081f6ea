"""Keras's weight constraints, for the ``kernel_constraint=`` of `jstrategy.layers`.

A constrained weight is projected after each optimizer update of `Model.fit`, as Keras's
optimizer does.

Example:

>>> import jstrategy
>>> layer = jstrategy.layers.Dense(4, kernel_constraint=jstrategy.constraints.MaxNorm(2.0))
>>> layer.kernel_constraint
MaxNorm(max_value=2.0, axis=0)
"""

from jstrategy._src.layers.constraints import Constraint
from jstrategy._src.layers.constraints import MaxNorm
from jstrategy._src.layers.constraints import MinMaxNorm
from jstrategy._src.layers.constraints import NonNeg
from jstrategy._src.layers.constraints import UnitNorm
from jstrategy._src.layers.constraints import get

__all__ = [
    "Constraint",
    "MaxNorm",
    "MinMaxNorm",
    "NonNeg",
    "UnitNorm",
    "get",
]
