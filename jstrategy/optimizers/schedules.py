"""Keras's learning-rate schedules, for `jstrategy.optimizers`' ``learning_rate``.

Example:

>>> from jstrategy.optimizers import schedules
>>> round(float(schedules.PiecewiseConstantDecay([100], [0.1, 0.01])(150)), 6)
0.01
"""

from jstrategy._src.training.optimizers.schedules import CosineDecay
from jstrategy._src.training.optimizers.schedules import ExponentialDecay
from jstrategy._src.training.optimizers.schedules import InverseTimeDecay
from jstrategy._src.training.optimizers.schedules import LearningRateSchedule
from jstrategy._src.training.optimizers.schedules import PiecewiseConstantDecay
from jstrategy._src.training.optimizers.schedules import deserialize
from jstrategy._src.training.optimizers.schedules import serialize

__all__ = [
    "CosineDecay",
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "deserialize",
    "serialize",
]
