"""Layers to JSON and back: how `Model.save` records a `jstrategy.Sequential`'s layers.

A layer's config is its class name and its constructor's arguments (Keras's
``{"class_name": ..., "config": ...}``); regularizers and constraints are nested configs. Only the classes
registered (`jstrategy._src.registry`) are rebuilt, so loading never imports or calls anything a file names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Each module registers its layers, regularizers and constraints as it is imported: these
# imports make every saveable class of `jstrategy.layers` known before a config is read.
from jstrategy._src.layers import activations  # noqa: F401
from jstrategy._src.layers import constraints  # noqa: F401
from jstrategy._src.layers import conv  # noqa: F401
from jstrategy._src.layers import core  # noqa: F401
from jstrategy._src.layers import merging  # noqa: F401
from jstrategy._src.layers import normalization  # noqa: F401
from jstrategy._src.layers import pooling  # noqa: F401
from jstrategy._src.layers import regularizers  # noqa: F401
from jstrategy._src.layers import reshaping  # noqa: F401
from jstrategy._src.layers.base import Layer
from jstrategy._src.registry import saveable_class
from jstrategy._src.registry import saveable_name
from jstrategy._src.registry import saved_class

__all__ = ["class_name", "deserialize", "serialize"]

# The kinds of object a layer's config nests (their names do not clash).
_NESTED_KINDS = ("regularizer", "constraint")


def _nested_name(value: Any) -> str | None:
    for kind in _NESTED_KINDS:
        name = saveable_name(value, kind)
        if name is not None:
            return name
    return None


def _nested_class(name: Any) -> type | None:
    for kind in _NESTED_KINDS:
        cls = saveable_class(kind, name) if isinstance(name, str) else None
        if cls is not None:
            return cls
    return None


class NotSerializable(ValueError):
    """A layer (or one of its arguments) that has no JSON config."""


def _value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_value(v, where) for v in value]
    name = _nested_name(value)
    if name is not None:
        return {"class_name": name, "config": value.get_config()}
    raise NotSerializable(
        f"{where} is {type(value).__name__} {value!r}, which has no JSON config; give it by "
        "name (e.g. activation='relu') to save the layer's config"
    )


def class_name(layer: Any) -> str:
    """How a saved `Sequential` records `layer`'s class: ``"jstrategy.layers.Dense"`` for
    jstrategy's layers, the class's qualified name for others (``"Dense"`` for Flax's)."""
    cls = type(layer)
    name = saveable_name(layer, "layer")
    if name is not None:
        return f"jstrategy.layers.{name}"
    return cls.__qualname__


def serialize(layer: Any) -> dict[str, Any]:
    """``{"class_name", "config"}`` for a `jstrategy.layers` layer.

    Raises:
      NotSerializable: for another kind of module, or an argument given as an object
        with no config (a function).

    Example:

    >>> from jstrategy._src.layers.core import Dense
    >>> serialize(Dense(4, activation="relu", name="dense"))["config"]["units"]
    4
    """
    cls = type(layer)
    name = saveable_name(layer, "layer")
    if name is None:
        raise NotSerializable(
            f"{cls.__module__}.{cls.__qualname__} is not a jstrategy.layers layer"
        )
    config = {}
    for field in dataclasses.fields(layer):
        if field.name == "parent":
            continue
        config[field.name] = _value(getattr(layer, field.name), f"{cls.__name__}.{field.name}")
    return {"class_name": name, "config": config}


def _restore(value: Any) -> Any:
    cls = _nested_class(value.get("class_name")) if isinstance(value, dict) else None
    if cls is not None:
        return cls(**value["config"])
    if isinstance(value, list):
        return tuple(_restore(v) for v in value)
    return value


def deserialize(config: dict[str, Any]) -> Layer:
    """The layer `serialize` described.

    Raises:
      ValueError: for a class name that is not a registered layer.
    """
    name = config.get("class_name")
    cls = saved_class(
        "layer",
        name,
        lambda known: f"The saved layer class {name!r} is not one of jstrategy.layers ({known}).",
    )
    return cls(**{k: _restore(v) for k, v in config["config"].items()})
