"""Keras's weight constraints (`jstrategy.constraints`), for a layer's ``kernel_constraint=``.

A constraint is a projection applied to a weight after each optimizer update, as Keras 3's
optimizer applies ``variable.constraint`` after its update: the train step of a model
compiled after the layer was made (`training/trainable.py`) projects each constrained
weight once its update is applied. The formulas are Keras 3's (``keras/src/constraints``),
with Keras's epsilon 1e-7.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.registry import register_kind
from jstrategy._src.registry import register_saveable
from jstrategy._src.registry import saveable_classes
from jstrategy._src.validation import check_number
from jstrategy._src.validation import is_int
from jstrategy._src.validation import named_object

__all__ = ["Constraint", "MaxNorm", "MinMaxNorm", "NonNeg", "UnitNorm", "get"]

_EPSILON = 1e-7  # keras.backend.epsilon()


def _axis(value: Any) -> Any:
    if is_int(value):
        return value
    if isinstance(value, (tuple, list)) and value and all(is_int(a) for a in value):
        return tuple(value)
    raise ValueError(
        f"`axis` must be an int or a list of ints (the axes of each weight vector); got "
        f"{value!r}. E.g. 0 for a Dense kernel, [0, 1, 2] for a Conv2D kernel."
    )


def _number(value: Any, name: str) -> float:
    return check_number(value, name, low=0, expected="a non-negative number")


def _norms(w: jax.Array, axis: Any) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(w), axis=axis, keepdims=True))


class Constraint:
    """The base of weight constraints: ``constraint(weight) -> projected weight``.

    Subclass it (a frozen dataclass, so `get_config` saves its arguments) and override
    ``__call__``; the optimizer applies it after each update, as Keras does.

    Example:

    >>> import dataclasses, jax.numpy as jnp
    >>> @dataclasses.dataclass(frozen=True)
    ... class Clip(Constraint):
    ...     limit: float = 1.0
    ...     def __call__(self, w):
    ...         return jnp.clip(w, -self.limit, self.limit)
    >>> Clip(0.5)(jnp.array([-2.0, 0.25])).tolist(), Clip(0.5).get_config()
    ([-0.5, 0.25], {'limit': 0.5})
    """

    def __call__(self, w: jax.Array) -> jax.Array:
        return w

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as Keras's ``get_config``."""
        config = dataclasses.asdict(self)  # type: ignore[call-overload]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


register_kind("constraint", Constraint)


@register_saveable(kind="constraint")
@dataclasses.dataclass(frozen=True)
class MaxNorm(Constraint):
    """Keras's ``MaxNorm``: each weight vector's norm along `axis` at most `max_value`.

    Example:

    >>> import jax.numpy as jnp
    >>> [round(v, 4) for v in MaxNorm(1.0)(jnp.array([3.0, 4.0])).tolist()]
    [0.6, 0.8]
    """

    max_value: float = 2.0
    axis: Any = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_value", _number(self.max_value, "max_value"))
        object.__setattr__(self, "axis", _axis(self.axis))

    def __call__(self, w: jax.Array) -> jax.Array:
        norms = _norms(w, self.axis)
        desired = jnp.clip(norms, 0, self.max_value)
        return w * (desired / (_EPSILON + norms))


@register_saveable(kind="constraint")
@dataclasses.dataclass(frozen=True)
class MinMaxNorm(Constraint):
    """Keras's ``MinMaxNorm``: norms moved (at `rate`) into ``[min_value, max_value]``.

    Example:

    >>> import jax.numpy as jnp
    >>> [round(v, 4) for v in MinMaxNorm(1.0, 2.0)(jnp.array([0.3, 0.4])).tolist()]
    [0.6, 0.8]
    """

    min_value: float = 0.0
    max_value: float = 1.0
    rate: float = 1.0
    axis: Any = 0

    def __post_init__(self) -> None:
        for name in ("min_value", "max_value", "rate"):
            object.__setattr__(self, name, _number(getattr(self, name), name))
        object.__setattr__(self, "axis", _axis(self.axis))

    def __call__(self, w: jax.Array) -> jax.Array:
        norms = _norms(w, self.axis)
        desired = (
            self.rate * jnp.clip(norms, self.min_value, self.max_value) + (1 - self.rate) * norms
        )
        return w * (desired / (_EPSILON + norms))


@register_saveable(kind="constraint")
@dataclasses.dataclass(frozen=True)
class NonNeg(Constraint):
    """Keras's ``NonNeg``: negative entries set to 0.

    Example:

    >>> import jax.numpy as jnp
    >>> NonNeg()(jnp.array([-1.0, 2.0])).tolist()
    [0.0, 2.0]
    """

    def __call__(self, w: jax.Array) -> jax.Array:
        return jnp.maximum(w, 0)


@register_saveable(kind="constraint")
@dataclasses.dataclass(frozen=True)
class UnitNorm(Constraint):
    """Keras's ``UnitNorm``: each weight vector along `axis` scaled to norm 1.

    Example:

    >>> import jax.numpy as jnp
    >>> [round(v, 4) for v in UnitNorm()(jnp.array([3.0, 4.0])).tolist()]
    [0.6, 0.8]
    """

    axis: Any = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _axis(self.axis))

    def __call__(self, w: jax.Array) -> jax.Array:
        return w / (_EPSILON + _norms(w, self.axis))


# Keras's names: a registered class name, or its snake-case alias (the class's defaults).
_BY_NAME: dict[str, type[Constraint]] = {
    **saveable_classes("constraint"),
    "max_norm": MaxNorm,
    "min_max_norm": MinMaxNorm,
    "non_neg": NonNeg,
    "unit_norm": UnitNorm,
}


def get(identifier: Any, argument: str = "kernel_constraint") -> Any:
    """A constraint from a Keras name (``"non_neg"``), an object or a callable, or None.

    Raises:
      ValueError: for an unknown name or a value that is none of these, naming `argument`.

    Example:

    >>> get("max_norm")
    MaxNorm(max_value=2.0, axis=0)
    """
    return named_object(
        identifier, _BY_NAME, argument, "constraint", "jstrategy.constraints", "MaxNorm(2.0)"
    )
