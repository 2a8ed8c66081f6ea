"""Keras-compatible metrics: per-example values for `jstrategy.Model.compile`, and Keras's
stateful `update_state` / `result` / `reset_state` for custom loops (inside `Strategy.run`
or outside).

Example:

>>> import jstrategy.metrics as metrics
>>> type(metrics.get("accuracy", loss="sparse_categorical_crossentropy")).__name__
'SparseCategoricalAccuracy'
"""

from jstrategy._src.training.metrics import Accuracy
from jstrategy._src.training.metrics import BinaryAccuracy
from jstrategy._src.training.metrics import CategoricalAccuracy
from jstrategy._src.training.metrics import Mean
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
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "get",
]
