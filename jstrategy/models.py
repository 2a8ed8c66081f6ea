"""`jstrategy.models`: Keras's ``load_model`` for models written by `jstrategy.Model.save`.

Example:

>>> import jstrategy
>>> callable(jstrategy.models.load_model)
True
"""

from jstrategy._src.training.loading import load_model

__all__ = ["load_model"]
