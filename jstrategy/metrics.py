"""Keras-compatible metrics as per-example values (see `jstrategy.Model.compile`).

Example:

>>> import jstrategy.metrics as metrics
>>> type(metrics.get("accuracy", loss="sparse_categorical_crossentropy")).__name__
'SparseCategoricalAccuracy'
"""

from jstrategy._src.training.metrics import Accuracy
from jstrategy._src.training.metrics import BinaryAccuracy
from jstrategy._src.training.metrics import CategoricalAccuracy
from jstrategy._src.training.metrics import MeanAbsoluteError
from jstrategy._src.training.metrics import MeanMetricWrapper
from jstrategy._src.training.metrics import MeanSquaredError
from jstrategy._src.training.metrics import Metric
from jstrategy._src.training.metrics import SparseCategoricalAccuracy
from jstrategy._src.training.metrics import get

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "get",
]
