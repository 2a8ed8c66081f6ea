"""Optimizers for `jstrategy.Model`: what `compile` takes, to optax; and the learning rate.

`resolve_optimizer` turns what `Model.compile` accepts (a Keras name such as ``"adam"``, a
`jstrategy.optimizers` object, or an optax transformation) into the optimizer object and
the optax transformation to apply. `LearningRate` reads and sets the rate that the
transformation keeps in the optimizer state, so changing it (`Model.learning_rate`,
`LearningRateScheduler`, `ReduceLROnPlateau`) recompiles nothing and is the rate applied.
A plain optax transformation (``optax.sgd(0.1)``) keeps its rate inside its code, where it
can be neither read nor set: `LearningRate` says so, and how to get a settable one.

The Keras-named optimizers themselves live in `keras_optimizers.py`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jstrategy._src.names import path_names
from jstrategy._src.training import keras_optimizers
from jstrategy._src.values import local_copy

__all__ = ["LearningRate", "resolve_optimizer"]


def resolve_optimizer(optimizer: Any) -> tuple[Any, optax.GradientTransformation]:
    """``(the optimizer object, its optax transformation)`` for what `compile` was given.

    A Keras name gives the `jstrategy.optimizers` object with Keras's defaults (as
    ``model.optimizer`` in Keras is an object); an optax transformation is its own object.

    Raises:
      ValueError: for an unknown name.
      TypeError: for anything else.

    Example:

    >>> obj, tx = resolve_optimizer("adam")
    >>> type(obj).__name__, isinstance(tx, optax.GradientTransformation)
    ('Adam', True)
    """
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer, optimizer
    if isinstance(optimizer, (str, dict, keras_optimizers.Optimizer)):
        obj = keras_optimizers.get(optimizer)
        return obj, obj.tx
    raise TypeError(
        f"`optimizer` must be a jstrategy.optimizers object (e.g. Adam(learning_rate=1e-3)), "
        f"a Keras name (e.g. 'adam') or an optax.GradientTransformation; got "
        f"{type(optimizer).__name__} {optimizer!r}."
    )


def _rate_leaf(state: Any) -> tuple[int, int] | None:
    """``(rate leaf, step-count leaf)`` of the one injected learning rate in a train state's
    optimizer state, if there is exactly one."""
    found = []
    counts = {}
    for i, (keypath, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        names = list(path_names(keypath))
        if names and names[-1] == "value":  # an NNX variable's array
            names.pop()
        if not names or "opt_state" not in names:
            continue
        if names[-1] == "learning_rate" and "hyperparams" in names:
            found.append((i, tuple(names[: names.index("hyperparams")])))
        elif names[-1] == "count":
            counts[tuple(names[:-1])] = i
    if len(found) != 1:
        return None
    index, prefix = found[0]
    return index, counts.get(prefix, -1)


def _scheduled(tx: optax.GradientTransformation) -> bool:
    """Whether `tx` (an ``inject_hyperparams`` transformation) sets its learning rate from a
    schedule at every update, overwriting a rate set in its state.

    Tried on a scalar parameter; a transformation that needs other parameters counts as
    not scheduled (its rate is then settable, as far as can be told).
    """
    params = jnp.zeros((), jnp.float32)
    try:
        state = tx.init(params)
        found = _rate_leaf({"opt_state": state})
        if found is None:
            return False
        leaves, treedef = jax.tree.flatten(state)
        marker = -12345.0
        leaves[found[0]] = jnp.asarray(marker, leaves[found[0]].dtype)
        _, new = tx.update(params, jax.tree.unflatten(treedef, leaves), params)
        return float(jax.tree.leaves(new)[found[0]]) != marker
    except Exception:  # an unknown transformation: assume its rate is settable
        return False


_NOT_SETTABLE = (
    "The model was compiled with a plain optax transformation (e.g. optax.sgd(0.1)), whose "
    "learning rate is fixed inside it: it can be neither read nor set, so "
    "model.learning_rate, LearningRateScheduler and ReduceLROnPlateau cannot work with it. "
    "Compile with a jstrategy.optimizers object, e.g. "
    "jstrategy.optimizers.SGD(learning_rate=0.1) (Keras's names and defaults: Adam, "
    "RMSprop, ...), or with optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)."
)


class LearningRate:
    """Reads and sets the learning rate kept in a train state's optimizer state.

    Args:
      state: the train state.
      optimizer: what `compile` was given, resolved (`resolve_optimizer`'s first value).
    """

    def __init__(self, state: Any, optimizer: Any):
        self._leaf = _rate_leaf(state)
        self._schedule = None
        self._scheduled = False
        if isinstance(optimizer, keras_optimizers.Optimizer):
            self._schedule = optimizer.update_schedule
        elif self._leaf is not None and isinstance(optimizer, optax.GradientTransformation):
            self._scheduled = _scheduled(optimizer)

    def _index(self) -> tuple[int, int]:
        if self._leaf is None:
            raise TypeError(_NOT_SETTABLE)
        return self._leaf

    def get(self, state: Any) -> float:
        """The rate the next step applies.

        With a schedule given to a `jstrategy.optimizers` object, the schedule at the
        current step; for ``optax.inject_hyperparams`` with a schedule, the rate of the
        latest step (before any step, the first).
        """
        index, count = self._index()
        leaves = jax.tree.leaves(state)
        if self._schedule is not None and count >= 0:
            return float(self._schedule(np.asarray(local_copy(leaves[count]))))
        return float(np.asarray(local_copy(leaves[index])))

    def set(self, state: Any, value: float) -> Any:
        """`state` with the rate set to `value`, in place of the old value's buffer.

        Raises:
          TypeError: if the rate follows a schedule or cannot be set.
          ValueError: if `value` is negative or not finite.
        """
        index, _ = self._index()
        if self._schedule is not None or self._scheduled:
            raise TypeError(keras_optimizers._SCHEDULE_NOT_SETTABLE)
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"`learning_rate` must be a non-negative finite float; got {value}.")
        leaves, treedef = jax.tree.flatten(state)
        old = leaves[index]
        leaves[index] = jax.device_put(np.asarray(value, old.dtype), old.sharding)
        return jax.tree.unflatten(treedef, leaves)
