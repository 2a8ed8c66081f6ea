"""Keras's weight regularizers (`jstrategy.regularizers`) and how a layer reports them.

A layer given ``kernel_regularizer=`` sows the penalty of its weight into the ``"losses"``
collection during every forward pass of the train and evaluation steps; the step adds
their sum to the mean loss over the global batch, as Keras adds ``model.losses`` to the
loss it reports and differentiates. Nothing is sown while the module is initialized, so
the collection never becomes a variable.
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
from jstrategy._src.validation import named_object

__all__ = ["L1", "L1L2", "L2", "LOSSES", "Regularizer", "add_weight_loss", "get"]

#: The Flax collection layers sow their regularization penalties into.
LOSSES = "losses"


def _factor(value: Any, name: str) -> float:
    return check_number(
        value,
        name,
        low=0,
        expected="a non-negative number (the penalty's factor)",
        fix="E.g. 0.01.",
    )


class Regularizer:
    """The base of weight regularizers: ``regularizer(weight) -> scalar penalty``.

    Example:

    >>> import jax.numpy as jnp
    >>> from jstrategy.regularizers import L2, Regularizer
    >>> isinstance(L2(0.1), Regularizer), float(L2(0.1)(jnp.ones((2, 2))))
    (True, 0.4000000059604645)
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, as Keras's ``get_config``."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]


register_kind("regularizer", Regularizer)


@register_saveable(kind="regularizer")
@dataclasses.dataclass(frozen=True)
class L1L2(Regularizer):
    """``l1 * sum(|x|) + l2 * sum(x ** 2)``, Keras's ``L1L2`` (both factors default to 0).

    Example:

    >>> import jax.numpy as jnp
    >>> round(float(L1L2(l1=0.1, l2=0.5)(jnp.array([1.0, -2.0]))), 6)
    2.8
    """

    l1: float = 0.0
    l2: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "l1", _factor(self.l1, "l1"))
        object.__setattr__(self, "l2", _factor(self.l2, "l2"))

    def __call__(self, x: jax.Array) -> jax.Array:
        penalty = jnp.zeros((), x.dtype)
        if self.l1:
            penalty += self.l1 * jnp.sum(jnp.abs(x))
        if self.l2:
            penalty += self.l2 * jnp.sum(jnp.square(x))
        return penalty


@register_saveable(kind="regularizer")
@dataclasses.dataclass(frozen=True)
class L1(Regularizer):
    """``l1 * sum(|x|)``, Keras's ``L1`` (default 0.01).

    Example:

    >>> import jax.numpy as jnp
    >>> float(L1(0.5)(jnp.array([1.0, -2.0])))
    1.5
    """

    l1: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(self, "l1", _factor(self.l1, "l1"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l1 * jnp.sum(jnp.abs(x))


@register_saveable(kind="regularizer")
@dataclasses.dataclass(frozen=True)
class L2(Regularizer):
    """``l2 * sum(x ** 2)``, Keras's ``L2`` (default 0.01; no factor 1/2).

    Example:

    >>> import jax.numpy as jnp
    >>> round(float(L2(0.01)(jnp.array([1.0, -2.0]))), 6)
    0.05
    """

    l2: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(self, "l2", _factor(self.l2, "l2"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2 * jnp.sum(jnp.square(x))


# Keras's names: a registered class name, or its snake-case form (built with the class's defaults).
_BY_NAME: dict[str, type[Regularizer]] = {
    **saveable_classes("regularizer"),
    "l1": L1,
    "l2": L2,
    "l1_l2": L1L2,
}


def get(identifier: Any, argument: str = "kernel_regularizer") -> Any:
    """A regularizer from a Keras name (``"l2"``: ``L2(0.01)``), an object, or None.

    A callable ``weight -> scalar`` is used as it is.

    Raises:
      ValueError: for an unknown name or a non-callable, naming `argument`.

    Example:

    >>> get("l2")
    L2(l2=0.01)
    """
    return named_object(
        identifier, _BY_NAME, argument, "regularizer", "jstrategy.regularizers", "L2(0.01)"
    )


def add_weight_loss(module: Any, weight_name: str, weight: jax.Array, regularizer: Any) -> None:
    """Sows `regularizer`'s penalty of `weight` into ``"losses"`` when the step collects it.

    The penalty is computed in float32 (a weight cast to a lower compute dtype by a
    precision policy is read back at float32, as Keras reads the variable).
    """
    if regularizer is None or module.is_initializing():
        return
    if not module.is_mutable_collection(LOSSES):
        return  # prediction and custom calls: nothing adds it to a loss
    penalty = regularizer(jnp.asarray(weight, jnp.float32))
    module.sow(LOSSES, f"{weight_name}_regularizer", penalty)
