"""Layers to JSON and back: how `Model.save` records a `jstrategy.Sequential`'s layers.

A layer's config is its class name and its constructor's arguments (Keras's
``{"class_name": ..., "config": ...}``); regularizers and constraints are nested configs. Only the classes
registered here are rebuilt, so loading never imports or calls anything a file names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jstrategy._src.layers import constraints
from jstrategy._src.layers import conv
from jstrategy._src.layers import core
from jstrategy._src.layers import normalization
from jstrategy._src.layers import pooling
from jstrategy._src.layers import regularizers
from jstrategy._src.layers import reshaping
from jstrategy._src.layers.base import Layer

__all__ = ["LAYER_CLASSES", "class_name", "deserialize", "serialize"]

#: The layer classes a saved config may name.
LAYER_CLASSES: dict[str, type[Layer]] = {
    cls.__name__: cls
    for cls in (
        core.InputLayer,
        core.Dense,
        core.Embedding,
        core.Activation,
        core.Dropout,
        reshaping.Flatten,
        reshaping.Reshape,
        conv.Conv2D,
        pooling.MaxPooling2D,
        pooling.AveragePooling2D,
        pooling.GlobalAveragePooling2D,
        normalization.BatchNormalization,
        normalization.LayerNormalization,
    )
}
# The objects a layer's config nests (regularizers, constraints), by class name.
_NESTED: dict[str, type[Any]] = {
    **{cls.__name__: cls for cls in (regularizers.L1, regularizers.L2, regularizers.L1L2)},
    **constraints.CLASSES,
}


class NotSerializable(ValueError):
    """A layer (or one of its arguments) that has no JSON config."""


def _value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_value(v, where) for v in value]
    if _NESTED.get(type(value).__name__) is type(value):
        return {"class_name": type(value).__name__, "config": value.get_config()}
    raise NotSerializable(
        f"{where} is {type(value).__name__} {value!r}, which has no JSON config; give it by "
        "name (e.g. activation='relu') to save the layer's config"
    )


def class_name(layer: Any) -> str:
    """How a saved `Sequential` records `layer`'s class: ``"jstrategy.layers.Dense"`` for
    jstrategy's layers, the class's qualified name for others (``"Dense"`` for Flax's)."""
    cls = type(layer)
    if LAYER_CLASSES.get(cls.__name__) is cls:
        return f"jstrategy.layers.{cls.__name__}"
    return cls.__qualname__


def serialize(layer: Any) -> dict[str, Any]:
    """``{"class_name", "config"}`` for a `jstrategy.layers` layer.

    Raises:
      NotSerializable: for another kind of module, or an argument given as an object
        with no config (a function).

    Example:

    >>> serialize(core.Dense(4, activation="relu", name="dense"))["config"]["units"]
    4
    """
    cls = type(layer)
    if LAYER_CLASSES.get(cls.__name__) is not cls:
        raise NotSerializable(
            f"{cls.__module__}.{cls.__qualname__} is not a jstrategy.layers layer"
        )
    config = {}
    for field in dataclasses.fields(layer):
        if field.name == "parent":
            continue
        config[field.name] = _value(getattr(layer, field.name), f"{cls.__name__}.{field.name}")
    return {"class_name": cls.__name__, "config": config}


def _restore(value: Any) -> Any:
    if isinstance(value, dict) and value.get("class_name") in _NESTED:
        return _NESTED[value["class_name"]](**value["config"])
    if isinstance(value, list):
        return tuple(_restore(v) for v in value)
    return value


def deserialize(config: dict[str, Any]) -> Layer:
    """The layer `serialize` described.

    Raises:
      ValueError: for a class name that is not a registered layer.
    """
    name = config.get("class_name")
    if name not in LAYER_CLASSES:
        raise ValueError(
            f"The saved layer class {name!r} is not one of jstrategy.layers "
            f"({sorted(LAYER_CLASSES)})."
        )
    return LAYER_CLASSES[name](**{k: _restore(v) for k, v in config["config"].items()})
