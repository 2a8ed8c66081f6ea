"""Keras 3's layers as Flax linen modules, with Keras's signatures and defaults.

Each layer is a `flax.linen.Module`: use them in a `jstrategy.Sequential` (which names
them as Keras does: ``dense``, ``dense_1``, ...) or inside your own Flax modules.

Example:

>>> import jstrategy
>>> model = jstrategy.Sequential([
...     jstrategy.layers.Dense(16, activation="relu", input_shape=(10,)),
...     jstrategy.layers.Dense(1),
... ])
>>> model.count_params()
193
"""

from typing import TYPE_CHECKING

from jstrategy._src.keras_names import missing_attribute
from jstrategy._src.layers.activations import ReLU
from jstrategy._src.layers.base import Layer
from jstrategy._src.layers.conv import Conv1D
from jstrategy._src.layers.conv import Conv2D
from jstrategy._src.layers.core import Activation
from jstrategy._src.layers.core import Dense
from jstrategy._src.layers.core import Dropout
from jstrategy._src.layers.core import Embedding
from jstrategy._src.layers.core import Input
from jstrategy._src.layers.core import InputLayer
from jstrategy._src.layers.core import Lambda
from jstrategy._src.layers.merging import Add
from jstrategy._src.layers.merging import Concatenate
from jstrategy._src.layers.normalization import BatchNormalization
from jstrategy._src.layers.normalization import LayerNormalization
from jstrategy._src.layers.pooling import AveragePooling1D
from jstrategy._src.layers.pooling import AveragePooling2D
from jstrategy._src.layers.pooling import GlobalAveragePooling1D
from jstrategy._src.layers.pooling import GlobalAveragePooling2D
from jstrategy._src.layers.pooling import GlobalMaxPooling1D
from jstrategy._src.layers.pooling import GlobalMaxPooling2D
from jstrategy._src.layers.pooling import MaxPooling1D
from jstrategy._src.layers.pooling import MaxPooling2D
from jstrategy._src.layers.reshaping import Flatten
from jstrategy._src.layers.reshaping import Reshape

__all__ = [
    "Activation",
    "Add",
    "AveragePooling1D",
    "AveragePooling2D",
    "BatchNormalization",
    "Concatenate",
    "Conv1D",
    "Conv2D",
    "Dense",
    "Dropout",
    "Embedding",
    "Flatten",
    "GlobalAveragePooling1D",
    "GlobalAveragePooling2D",
    "GlobalMaxPooling1D",
    "GlobalMaxPooling2D",
    "Input",
    "InputLayer",
    "Lambda",
    "Layer",
    "LayerNormalization",
    "MaxPooling1D",
    "MaxPooling2D",
    "ReLU",
    "Reshape",
]

if not TYPE_CHECKING:  # for type checkers, a missing name stays an error

    def __getattr__(name: str):
        raise missing_attribute(__name__, name)
