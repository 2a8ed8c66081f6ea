"""`jstrategy.models`: Keras's ``load_model`` for models written by `jstrategy.Model.save`.

Example:

>>> import jstrategy
>>> callable(jstrategy.models.load_model)
True
"""

from typing import TYPE_CHECKING

from jstrategy._src.keras_names import missing_attribute
from jstrategy._src.training.loading import load_model

__all__ = ["load_model"]

if not TYPE_CHECKING:  # for type checkers, a missing name stays an error

    def __getattr__(name: str):
        raise missing_attribute(__name__, name)
