"""Keras's ``keras.utils`` helpers a porting program calls first.

Example:

>>> import jstrategy
>>> jstrategy.utils.to_categorical([0, 2], num_classes=3).tolist()
[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
"""

from typing import TYPE_CHECKING

from jstrategy._src.keras_names import missing_attribute
from jstrategy._src.utils.numerical_utils import normalize
from jstrategy._src.utils.numerical_utils import to_categorical
from jstrategy._src.utils.random_seed import get_random_seed
from jstrategy._src.utils.random_seed import set_random_seed

__all__ = [
    "get_random_seed",
    "normalize",
    "set_random_seed",
    "to_categorical",
]

if not TYPE_CHECKING:  # for type checkers, a missing name stays an error

    def __getattr__(name: str):
        raise missing_attribute(__name__, name)
