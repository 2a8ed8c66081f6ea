"""Optimizers for `jstrategy.Model`: names to optax, and control of the learning rate.

`resolve_optimizer` turns what `Model.compile` accepts (a Keras name such as ``"adam"``, or
an optax transformation) into an optax transformation; `with_rate_control` makes its
learning rate a value in the optimizer state, and `LearningRate` reads and sets it there,
so changing it (`Model.learning_rate`, `LearningRateScheduler`) recompiles nothing.

This module is the home of optimizer-side features: Keras-named optimizer objects and how
the rate they apply is reported belong here, behind the same two entry points.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jstrategy._src.names import path_names

__all__ = [
    "LearningRate",
    "LearningRateScaleState",
    "resolve_optimizer",
    "scale_by_learning_rate_scale",
    "with_rate_control",
]

# Keras's default learning rates for optimizers given by name.
_OPTIMIZERS: dict[str, tuple[Callable[..., optax.GradientTransformation], float]] = {
    "sgd": (optax.sgd, 0.01),
    "adam": (optax.adam, 1e-3),
    "adamw": (optax.adamw, 1e-3),
    "rmsprop": (optax.rmsprop, 1e-3),
    "adagrad": (optax.adagrad, 1e-3),
}


def resolve_optimizer(optimizer: Any) -> optax.GradientTransformation:
    """An optax transformation from a Keras name (with Keras's default rate) or itself.

    Raises:
      ValueError: for an unknown name.
      TypeError: for anything else.

    Example:

    >>> import optax
    >>> isinstance(resolve_optimizer("adam"), optax.GradientTransformation)
    True
    """
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in _OPTIMIZERS:
            raise ValueError(
                f"Unknown optimizer {optimizer!r}. Valid names: {sorted(_OPTIMIZERS)}; or pass "
                "an optax.GradientTransformation such as optax.adam(1e-3)."
            )
        factory, rate = _OPTIMIZERS[key]
        return optax.inject_hyperparams(factory)(learning_rate=rate)
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    raise TypeError(
        f"`optimizer` must be an optax.GradientTransformation or one of "
        f"{sorted(_OPTIMIZERS)}; got {type(optimizer).__name__} {optimizer!r}."
    )


class LearningRateScaleState(NamedTuple):
    """The factor `Model.learning_rate` multiplies an opaque optimizer's updates by."""

    learning_rate_scale: jax.Array


def scale_by_learning_rate_scale() -> optax.GradientTransformation:
    """Multiplies updates by a factor kept in the optimizer state (initially 1)."""

    def init(params: Any) -> LearningRateScaleState:
        del params
        return LearningRateScaleState(jnp.ones((), jnp.float32))

    def update(updates: Any, state: LearningRateScaleState, params: Any = None) -> Any:
        del params
        factor = state.learning_rate_scale
        return jax.tree.map(lambda u: u * factor.astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)  # type: ignore[arg-type]


def _rate_leaf(state: Any) -> tuple[int, str] | None:
    """Where the learning rate lives in a train state: (leaf index, kind), if unique."""
    found = []
    for i, (keypath, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        names = list(path_names(keypath))
        if names and names[-1] == "value":  # an NNX variable's array
            names.pop()
        if not names or "opt_state" not in names:
            continue
        if names[-1] == "learning_rate" and "hyperparams" in names:
            found.append((i, "absolute"))
        elif names[-1] == "learning_rate_scale":
            found.append((i, "scale"))
    return found[0] if len(found) == 1 else None


def with_rate_control(
    tx: optax.GradientTransformation, params: Any
) -> optax.GradientTransformation:
    """`tx`, followed by a scale kept in its state unless it keeps an absolute rate there.

    Optimizers given by name, or built with ``optax.inject_hyperparams``, keep their
    learning rate in their state; any other is followed by `scale_by_learning_rate_scale`.
    """
    opt_state = jax.eval_shape(tx.init, params)
    holder = _rate_leaf({"opt_state": opt_state})
    if holder is not None and holder[1] == "absolute":
        return tx
    return optax.chain(tx, scale_by_learning_rate_scale())


class LearningRate:
    """Reads and sets the learning rate kept in a train state's optimizer state.

    Args:
      state: a train state whose optimizer came from `with_rate_control`.
    """

    def __init__(self, state: Any):
        self._leaf = _rate_leaf(state)

    def _index(self) -> int:
        if self._leaf is None:
            raise RuntimeError(
                "The optimizer has no single learning rate to read or set (several were "
                "found). Build it with optax.inject_hyperparams for one learning_rate."
            )
        return self._leaf[0]

    def get(self, state: Any) -> float:
        """The rate (or, for an opaque optimizer, the factor on its own rate)."""
        return float(jax.tree.leaves(state)[self._index()])

    def set(self, state: Any, value: float) -> Any:
        """`state` with the rate set to `value`, in place of the old value's buffer.

        Raises:
          ValueError: if `value` is negative or not finite.
        """
        index = self._index()
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"`learning_rate` must be a non-negative finite float; got {value}.")
        leaves, treedef = jax.tree.flatten(state)
        old = leaves[index]
        leaves[index] = jax.device_put(np.asarray(value, old.dtype), old.sharding)
        return jax.tree.unflatten(treedef, leaves)
