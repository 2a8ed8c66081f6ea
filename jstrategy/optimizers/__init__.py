"""Keras-named optimizers over optax, whose learning rate is the rate applied.

Use them in `jstrategy.Model.compile`, `jstrategy.training.create_train_state` (through
their ``.tx``) and custom loops (`Optimizer.apply_gradients` inside `Strategy.run`).

Example:

>>> import jstrategy
>>> opt = jstrategy.optimizers.SGD(learning_rate=0.1, momentum=0.9)
>>> opt.learning_rate, jstrategy.optimizers.get("adam").get_config()["epsilon"]
(0.1, 1e-07)
"""

from typing import TYPE_CHECKING

from jstrategy._src.keras_names import missing_attribute
from jstrategy._src.training.keras_optimizers import SGD
from jstrategy._src.training.keras_optimizers import Adadelta
from jstrategy._src.training.keras_optimizers import Adagrad
from jstrategy._src.training.keras_optimizers import Adam
from jstrategy._src.training.keras_optimizers import Adamax
from jstrategy._src.training.keras_optimizers import AdamW
from jstrategy._src.training.keras_optimizers import Lion
from jstrategy._src.training.keras_optimizers import Nadam
from jstrategy._src.training.keras_optimizers import Optimizer
from jstrategy._src.training.keras_optimizers import RMSprop
from jstrategy._src.training.keras_optimizers import deserialize
from jstrategy._src.training.keras_optimizers import get
from jstrategy._src.training.keras_optimizers import serialize
from jstrategy.optimizers import schedules

__all__ = [
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Lion",
    "Nadam",
    "Optimizer",
    "RMSprop",
    "deserialize",
    "get",
    "schedules",
    "serialize",
]

if not TYPE_CHECKING:  # for type checkers, a missing name stays an error

    def __getattr__(name: str):
        raise missing_attribute(__name__, name)
