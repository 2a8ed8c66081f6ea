"""Keras-compatible losses: per-example values for the train step, Keras's `reduction` when
called (see `jstrategy.Model.compile` and `Reduction`).

Example:

>>> import jstrategy.losses as losses
>>> losses.get("sparse_categorical_crossentropy").name
'sparse_categorical_crossentropy'
"""

from jstrategy._src.training.losses import BinaryCrossentropy
from jstrategy._src.training.losses import CategoricalCrossentropy
from jstrategy._src.training.losses import Huber
from jstrategy._src.training.losses import Loss
from jstrategy._src.training.losses import LossFunctionWrapper
from jstrategy._src.training.losses import MeanAbsoluteError
from jstrategy._src.training.losses import MeanSquaredError
from jstrategy._src.training.losses import Reduction
from jstrategy._src.training.losses import SparseCategoricalCrossentropy
from jstrategy._src.training.losses import get
from jstrategy._src.training.step.probability_check import NotProbabilitiesWarning

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "NotProbabilitiesWarning",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "get",
]
