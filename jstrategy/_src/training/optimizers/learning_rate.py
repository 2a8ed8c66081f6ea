"""The learning rate's one slot: ``hyperparams["learning_rate"]`` of an optimizer state.

``optax.inject_hyperparams`` keeps a transformation's learning rate in its state, as
``hyperparams["learning_rate"]`` beside the update ``count`` (and, for a schedule, the
schedule's state in ``hyperparams_states["learning_rate"]``). That entry is the slot that
`Model.learning_rate`, ``jstrategy.optimizers`` objects' ``learning_rate``, the callbacks
that read or set it (`LearningRateScheduler`, `ReduceLROnPlateau`, `TensorBoard` through
the model) and the parameter servers' copies all read and write, here and nowhere else,
with ``optax.tree_utils.tree_get`` / ``tree_set``. The optimizer state may be optax's own
tree or an `nnx.Optimizer`'s ``nnx.State`` (dicts of variables), the train state's, a
custom loop's, or one per variable on the parameter servers.

``tree_get``/``tree_set`` behave the same from optax 0.2.5 (the oldest supported) to 0.2.8;
both rebuild a dict they change as a plain ``dict`` (``_set_children``), so `write` puts the
tree back into its own structure (an ``nnx.State`` stays one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jstrategy._src.values import local_copy

__all__ = ["NOT_SETTABLE", "SCHEDULE_NOT_SETTABLE", "fill", "read", "stored", "with_count", "write"]

NOT_SETTABLE = (
    "The model was compiled with a plain optax transformation (e.g. optax.sgd(0.1)), whose "
    "learning rate is fixed inside it: it can be neither read nor set, so "
    "model.learning_rate, LearningRateScheduler and ReduceLROnPlateau cannot work with it. "
    "Compile with a jstrategy.optimizers object, e.g. "
    "jstrategy.optimizers.SGD(learning_rate=0.1) (Keras's names and defaults: Adam, "
    "RMSprop, ...), or with optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)."
)

SCHEDULE_NOT_SETTABLE = (
    "This optimizer was created with a learning-rate schedule, so its rate follows the "
    "step count and cannot be set (as in Keras). Create it with a float learning_rate to "
    "set the rate, e.g. from LearningRateScheduler or ReduceLROnPlateau."
)

_RATE = "learning_rate"


def _name(entry: Any) -> Any:
    """The name of a key-path entry: a named tuple's field (optax's ``NamedTupleKey``,
    ``GetAttrKey``) or a dict's key (``DictKey``, also in an ``nnx.State``)."""
    return getattr(entry, "name", getattr(entry, "key", None))


def _under(parent: str) -> Callable[[Any, Any], bool]:
    """``tree_get``'s filter for a value whose parent is named `parent`."""
    return lambda path, _: len(path) >= 2 and _name(path[-2]) == parent


def _slots(tree: Any) -> list[tuple[Any, Any]]:
    """``(path, node)`` of every ``hyperparams["learning_rate"]`` in `tree` (a node is the
    array, or the NNX variable holding it)."""
    return optax.tree_utils.tree_get_all_with_path(tree, _RATE, _under("hyperparams"))


def _one_slot(opt_state: Any) -> tuple[Any, Any] | None:
    found = _slots(opt_state)
    return found[0] if len(found) == 1 else None


def _array(node: Any) -> Any:
    """The array of a slot: the node itself, or the one array an NNX variable holds."""
    (leaf,) = jax.tree.leaves(node)
    return leaf


def _host_float(node: Any) -> float:
    return float(np.asarray(local_copy(_array(node))))


def _like(value: Any, node: Any) -> Any:
    """`value` as a new `node`: the same kind of node, dtype and placement (the sharding of
    a placed array; traced inside a program; numpy on the host)."""

    def put(old: Any) -> Any:
        if isinstance(old, jax.core.Tracer):
            return jnp.asarray(value, old.dtype)
        if isinstance(old, jax.Array):
            return jax.device_put(np.asarray(value, old.dtype), old.sharding)
        return np.asarray(value, np.asarray(old).dtype)

    return jax.tree.map(put, node)


def _count(opt_state: Any, rate_path: Any) -> Any:
    """The update count beside the slot at `rate_path` (what a schedule reads)."""
    owner = tuple(rate_path[:-2])  # the path of the inject_hyperparams state
    return optax.tree_utils.tree_get(
        opt_state, "count", filtering=lambda path, _: tuple(path[:-1]) == owner
    )


def _follows_schedule(opt_state: Any) -> bool:
    """Whether the rate is set from a schedule at every update (``inject_hyperparams``
    keeps a schedule's state beside the rate), overwriting a rate set in the state."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, _RATE, _under("hyperparams_states"))
    return bool(found)


def stored(opt_state: Any) -> float | None:
    """The rate as the slot holds it (for a schedule, the latest update's), or None where
    `opt_state` has no single slot.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    >>> stored(tx.init(jnp.zeros(2))), stored(optax.sgd(0.5).init(jnp.zeros(2)))
    (0.5, None)
    """
    found = _one_slot(opt_state)
    return None if found is None else _host_float(found[1])


def read(opt_state: Any, schedule: Callable[[Any], Any] | None = None) -> float:
    """The rate the next update applies.

    Args:
      opt_state: an optimizer state with one ``inject_hyperparams`` learning rate.
      schedule: the schedule of a ``jstrategy.optimizers`` object (``update_schedule``),
        read at the state's update count as Keras reads its schedule; None: the rate the
        slot holds (for an optax schedule, the latest update's; before any, the first).

    Raises:
      TypeError: if `opt_state` has no single learning-rate slot (the message shows the
        fix).

    Example:

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    >>> round(read(tx.init(jnp.zeros(2))), 6)
    0.1
    >>> read(tx.init(jnp.zeros(2)), schedule=lambda count: 0.5 / (count + 1))
    0.5
    """
    found = _one_slot(opt_state)
    if found is None:
        raise TypeError(NOT_SETTABLE)
    path, node = found
    if schedule is not None:
        count = _count(opt_state, path)
        if count is not None:
            return float(schedule(np.asarray(local_copy(_array(count)))))
    return _host_float(node)


def _check_rate(value: Any) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"`learning_rate` must be a non-negative finite float; got {value}.")
    return value


def _set_all(tree: Any, value: float, node: Any) -> Any:
    """`tree` with every slot set to `value`, each made like `node`, in its own structure."""
    new = optax.tree_utils.tree_set(tree, _under("hyperparams"), **{_RATE: _like(value, node)})
    return jax.tree.unflatten(jax.tree.structure(tree), jax.tree.leaves(new))


def write(opt_state: Any, value: float) -> Any:
    """`opt_state` with its rate set to `value`, in the old value's dtype and placement.

    Raises:
      TypeError: if `opt_state` has no single learning-rate slot, or the rate follows a
        schedule (the messages show the fix).
      ValueError: if `value` is negative or not finite.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    >>> read(write(tx.init(jnp.zeros(2)), 0.25))
    0.25
    """
    found = _one_slot(opt_state)
    if found is None:
        raise TypeError(NOT_SETTABLE)
    if _follows_schedule(opt_state):
        raise TypeError(SCHEDULE_NOT_SETTABLE)
    return _set_all(opt_state, _check_rate(value), found[1])


def fill(tree: Any, value: float) -> Any:
    """`tree` with every learning-rate slot in it set to `value` (the parameter servers
    keep one optimizer state, so one slot, per variable); `tree` as it is without one.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    >>> states = fill([tx.init(jnp.zeros(2)), tx.init(jnp.zeros(3))], 0.5)
    >>> [stored(s) for s in states]
    [0.5, 0.5]
    """
    found = _slots(tree)
    if not found:
        return tree
    return _set_all(tree, value, found[0][1])


def with_count(opt_state: Any, count: int) -> Any:
    """`opt_state` whose learning rate's update count is `count` (so a schedule reads the
    rate at `count`); `opt_state` as it is without a single slot.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    >>> state = with_count(tx.init(jnp.zeros(2)), 7)
    >>> read(state, schedule=lambda count: float(count))
    7.0
    """
    found = _one_slot(opt_state)
    if found is None:
        return opt_state
    owner = tuple(found[0][:-2])
    old = _count(opt_state, found[0])
    new = optax.tree_utils.tree_set(
        opt_state, lambda path, _: tuple(path[:-1]) == owner, count=_like(count, old)
    )
    return jax.tree.unflatten(jax.tree.structure(opt_state), jax.tree.leaves(new))
