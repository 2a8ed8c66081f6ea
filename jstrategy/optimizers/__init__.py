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
from jstrategy._src.training.optimizers.adagrad import Adadelta
from jstrategy._src.training.optimizers.adagrad import Adagrad
from jstrategy._src.training.optimizers.adam import Adam
from jstrategy._src.training.optimizers.adam import Adamax
from jstrategy._src.training.optimizers.adam import AdamW
from jstrategy._src.training.optimizers.adam import Nadam
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.optimizers.lion import Lion
from jstrategy._src.training.optimizers.rmsprop import RMSprop
from jstrategy._src.training.optimizers.serialization import deserialize
from jstrategy._src.training.optimizers.serialization import get
from jstrategy._src.training.optimizers.serialization import serialize
from jstrategy._src.training.optimizers.sgd import SGD
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
