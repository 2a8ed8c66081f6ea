"""What every `jstrategy.layers` layer shares: Keras's names, ``input_shape``, the train flag.

Each layer is a `flax.linen.Module` whose fields are Keras 3's constructor arguments (with
Keras's defaults) and whose ``__call__(inputs, training=None)`` takes Keras's training
flag: `jstrategy.Sequential` passes the train step's flag down, and a Flax module that
holds these layers passes its own.
"""

from __future__ import annotations

import inspect
import re
from typing import Any
from typing import ClassVar

import flax.linen as nn

from jstrategy._src.validation import check_row_shape

__all__ = ["Layer", "call_layer", "keras_name", "train_keyword"]

# Keyword arguments by which Flax modules take the training mode, and their training value.
_TRAIN_KEYWORDS = {"training": True, "train": True, "deterministic": False}


def keras_name(class_name: str) -> str:
    """A layer class's name as Keras names its instances: ``"Conv2D"`` -> ``"conv2d"``.

    Keras's ``to_snake_case`` (digits stay with the word before them).

    Example:

    >>> keras_name("MaxPooling2D"), keras_name("BatchNormalization"), keras_name("Dense")
    ('max_pooling2d', 'batch_normalization', 'dense')
    """
    name = re.sub(r"\W+", "", class_name)
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


class Layer(nn.Module):
    """The base of `jstrategy.layers`: a linen module with Keras's conventions.

    Subclasses declare Keras's arguments as fields (``input_shape`` last, the shape of one
    input row, read by `jstrategy.Sequential` from its first layer) and check them in
    `validate`, so a bad argument fails when the layer is made.

    Example:

    >>> from jstrategy.layers import Dense, Layer
    >>> isinstance(Dense(4), Layer)
    True
    >>> try:
    ...     Dense(0)
    ... except ValueError as error:
    ...     print(str(error)[:30])
    `units` must be a positive int
    """

    #: The dtype of the sample row a `Sequential` starting with this layer is built from.
    sample_dtype: ClassVar[str] = "float32"

    def __post_init__(self) -> None:
        shape = getattr(self, "input_shape", None)
        if shape is not None:
            object.__setattr__(self, "input_shape", check_row_shape(shape, "input_shape"))
        type(self).validate(self)
        super().__post_init__()

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        """Checks the constructor's arguments (raises `ValueError` naming the argument)."""


def train_keyword(layer: Any) -> str | None:
    """The keyword by which `layer` (a linen module) takes the training mode, or None."""
    if isinstance(layer, Layer):
        return "training"
    try:
        params = inspect.signature(type(layer).__call__).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in _TRAIN_KEYWORDS if k in params), None)


def call_layer(layer: Any, x: Any, training: bool) -> Any:
    """``layer(x)`` in training mode `training`, given the way `layer` takes the mode.

    `jstrategy.layers` take Keras's ``training``; Flax modules ``train``, ``training`` or
    ``deterministic`` (negated) when their ``__call__`` has one; plain functions nothing.
    """
    if not isinstance(layer, nn.Module):
        return layer(x)
    keyword = train_keyword(layer)
    if keyword is None:
        return layer(x)
    return layer(x, **{keyword: training if _TRAIN_KEYWORDS[keyword] else not training})
