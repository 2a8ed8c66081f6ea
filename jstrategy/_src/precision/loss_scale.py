"""Dynamic loss scaling for float16, as Keras's `LossScaleOptimizer`, as an immutable pytree.

float16 has 5 exponent bits: gradients below about 6e-8 flush to zero. Multiplying the
loss by a large scale before differentiating lifts the gradients into float16's range;
dividing them by the same scale afterwards restores their value. When the scale is too
large, some gradient overflows to inf or NaN: the step is skipped and the scale halved.
After `dynamic_growth_steps` consecutive finite steps, the scale is doubled to probe for
a larger one. Keras's defaults: an initial scale of 2**15, doubling after 2000 steps.

`DynamicLossScale` is a `flax.struct.PyTreeNode`, so it lives in the train state, passes
through `jax.jit` and is saved and restored by checkpoints with the rest of the state.
One step with it (``params`` in float32, the model run in float16)::

    def loss_fn(params):
        return loss_scale.scale(compute_loss(params))

    grads = jax.grad(loss_fn)(params)
    grads = replica_context.all_reduce("SUM", grads)    # identical on every replica
    grads = loss_scale.unscale(grads)
    finite = loss_scale.all_finite(grads)
    new_state = select_if_finite(finite, state.apply_gradients(grads=grads), state)
    new_state = new_state.replace(loss_scale=loss_scale.adjust(finite))

Every replica takes the same decision in the same step: the decision is taken on the
all-reduced gradients, which are identical on every replica, so one replica's overflow
(which makes the sum inf or NaN) makes every replica skip. Where each replica holds
different gradients (a shard of them, or gradients not yet reduced), pass ``axis_name``
to `all_finite` and it combines the replicas' flags. Everything is traced: no host sync.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jstrategy._src.validation import check_number

__all__ = ["DynamicLossScale", "LossScaleFloorWarning", "all_finite", "select_if_finite"]

_INITIAL_SCALE = 2.0**15
_GROWTH_STEPS = 2000


class LossScaleFloorWarning(RuntimeWarning):
    """Training steps were skipped with the loss scale at its floor (`min_loss_scale`).

    Above the floor an overflow is how dynamic loss scaling finds its scale: the step is
    skipped and the scale halved. At the floor the scale cannot go lower, so gradients
    that still overflow float16 are skipped step after step, and the weights never move
    while the loss looks finite. `jstrategy.Model.fit` warns once per call when an epoch
    had such steps; under `jstrategy.config.enable_check_numerics` it raises a
    ``FloatingPointError`` at the first one. The fix: ``mixed_bfloat16`` (float32's
    range, no loss scale needed), or a loss whose gradients fit in float16 (e.g. inputs
    and targets of moderate size).

    Example:

    >>> issubclass(LossScaleFloorWarning, RuntimeWarning)
    True
    """


def _floating_leaves(tree: Any) -> list[Any]:
    return [
        x
        for x in jax.tree.leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]


def all_finite(tree: Any, *, axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
    """Whether every floating-point value in `tree` is finite (no inf, no NaN).

    Args:
      tree: a pytree, usually gradients; non-floating leaves are ignored.
      axis_name: inside `jax.shard_map` or `Strategy.run`, the mesh axis (or axes) over
        which to combine the replicas' answers, so that all of them get the same one.
        Not needed when `tree` is already identical on every replica (all-reduced
        gradients).

    Returns:
      A boolean scalar array; True for a tree without floating leaves.

    Example:

    >>> import jax.numpy as jnp
    >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves = _floating_leaves(tree)
    finite = functools.reduce(
        jnp.logical_and, (jnp.all(jnp.isfinite(x)) for x in leaves), jnp.bool_(True)
    )
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return jnp.asarray(finite, jnp.bool_)


def select_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """`new` where `finite` is True, else `old`: applies an update only when it is finite.

    Selects leaf by leaf with `jax.lax.select` on the traced flag, so there is no host
    sync and no branch: both versions are computed and one is kept.

    Args:
      finite: a boolean scalar (from `all_finite`).
      new: the updated pytree (e.g. the train state after ``apply_gradients``).
      old: the pytree before the update; same structure, shapes and dtypes as `new`.

    Returns:
      `new` or `old`, chosen on device.

    Raises:
      ValueError: if `new` and `old` differ in structure.

    Example:

    >>> import jax.numpy as jnp
    >>> select_if_finite(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"]
    Array([0., 0.], dtype=float32)
    """
    new_leaves, new_tree = jax.tree.flatten(new)
    old_leaves, old_tree = jax.tree.flatten(old)
    if new_tree != old_tree:  # type: ignore[operator]  # (PyTreeDef lacks stubs)
        raise ValueError(
            "`new` and `old` must have the same pytree structure (the state after and "
            f"before the update); got {new_tree} and {old_tree}."
        )
    finite = jnp.asarray(finite)
    if finite.shape != () or finite.dtype != jnp.bool_:
        raise ValueError(
            f"`finite` must be a boolean scalar (from all_finite); got dtype {finite.dtype} "
            f"and shape {finite.shape}."
        )

    def pick(n: Any, o: Any) -> Any:
        if n is o:
            return n
        return jax.lax.select(finite, n, o)

    return jax.tree.unflatten(
        new_tree, [pick(n, o) for n, o in zip(new_leaves, old_leaves, strict=True)]
    )


class DynamicLossScale(struct.PyTreeNode):
    """A dynamic loss scale, Keras's `LossScaleOptimizer` rules, kept as a pytree.

    Create it with `DynamicLossScale.create`. Each step, `scale` the loss, differentiate,
    `unscale` the (all-reduced) gradients, check them with `all_finite`, apply the update
    only if they are finite (`select_if_finite`) and keep ``adjust(finite)`` for the next
    step:

    * non-finite gradients: the update is skipped, the scale halved (not below
      `min_loss_scale`) and the count of finite steps reset;
    * finite gradients: the count grows by one; on reaching `dynamic_growth_steps` the
      scale doubles (unless that overflows float32) and the count restarts.

    Attributes:
      loss_scale: the current scale, a float32 scalar array (TF's
        ``LossScaleOptimizer.loss_scale``).
      counter: consecutive finite steps since the scale last changed, an int32 scalar.
      dynamic_growth_steps: finite steps between doublings (Keras's name; default 2000).
      min_loss_scale: the floor when halving (TF's: 1).

    Example:

    >>> import jax.numpy as jnp
    >>> ls = DynamicLossScale.create()
    >>> float(ls.loss_scale), int(ls.counter)
    (32768.0, 0)
    >>> float(ls.adjust(ls.all_finite({"g": jnp.array([jnp.nan])})).loss_scale)
    16384.0
    """

    loss_scale: jax.Array
    counter: jax.Array
    dynamic_growth_steps: int = struct.field(pytree_node=False, default=_GROWTH_STEPS)
    min_loss_scale: float = struct.field(pytree_node=False, default=1.0)

    def __post_init__(self) -> None:
        # Only the static settings: the array fields may be placeholders inside JAX.
        check_number(
            self.dynamic_growth_steps,
            "dynamic_growth_steps",
            integer=True,
            low=1,
            fix=f"Keras's default is {_GROWTH_STEPS}.",
        )
        check_number(
            self.min_loss_scale,
            "min_loss_scale",
            low=0,
            low_open=True,
            expected="a positive number",
        )

    @classmethod
    def create(
        cls,
        *,
        initial_scale: float = _INITIAL_SCALE,
        dynamic_growth_steps: int = _GROWTH_STEPS,
        min_loss_scale: float = 1.0,
    ) -> DynamicLossScale:
        """A loss scale at its initial value, with Keras's arguments and defaults.

        Args:
          initial_scale: the first scale (Keras: 2**15).
          dynamic_growth_steps: consecutive finite steps before the scale doubles (Keras:
            2000).
          min_loss_scale: the scale is never halved below this (TF: 1).

        Returns:
          A `DynamicLossScale` with ``counter`` 0.

        Raises:
          ValueError: if a setting is not positive and finite.

        Example:

        >>> float(DynamicLossScale.create(initial_scale=1024.0).loss_scale)
        1024.0
        """
        check_number(
            initial_scale,
            "initial_scale",
            low=0,
            low_open=True,
            finite=True,
            expected="a positive finite number",
            fix=f"Keras's default is 2**15 = {_INITIAL_SCALE:g}.",
        )
        return cls(
            loss_scale=jnp.float32(initial_scale),
            counter=jnp.int32(0),
            dynamic_growth_steps=dynamic_growth_steps,
            min_loss_scale=min_loss_scale,
        )

    def scale(self, loss: Any) -> Any:
        """`loss` (a scalar or a pytree) times the scale, in its own dtype."""
        return jax.tree.map(lambda x: (x * self.loss_scale).astype(x.dtype), loss)

    def unscale(self, grads: Any) -> Any:
        """`grads` divided by the scale, each leaf in its own dtype; non-floats untouched."""
        inverse = 1.0 / self.loss_scale

        def unscale(g: Any) -> Any:
            if not (hasattr(g, "dtype") and jnp.issubdtype(g.dtype, jnp.inexact)):
                return g
            return (g * inverse).astype(g.dtype)

        return jax.tree.map(unscale, grads)

    def all_finite(self, grads: Any, *, axis_name: str | tuple[str, ...] | None = None) -> Any:
        """Whether every gradient is finite; see the module-level `all_finite`."""
        return all_finite(grads, axis_name=axis_name)

    def skipped_at_floor(self, finite: Any) -> jax.Array:
        """Whether a step with this scale and these gradients is skipped at the floor.

        True when `finite` is False while the scale is already at `min_loss_scale`: the
        scale cannot be halved further, so the step is skipped without any progress
        towards a scale that works (see `LossScaleFloorWarning`).

        Args:
          finite: a boolean scalar (from `all_finite`).

        Returns:
          A boolean scalar array.

        Example:

        >>> import jax.numpy as jnp
        >>> ls = DynamicLossScale.create(initial_scale=1.0)
        >>> bool(ls.skipped_at_floor(jnp.bool_(False))), bool(ls.skipped_at_floor(True))
        (True, False)
        """
        at_floor = self.loss_scale <= jnp.float32(self.min_loss_scale)
        return jnp.logical_and(at_floor, jnp.logical_not(jnp.asarray(finite, jnp.bool_)))

    def adjust(self, finite: Any) -> DynamicLossScale:
        """The loss scale for the next step, given whether this step's gradients were finite.

        Args:
          finite: a boolean scalar (from `all_finite`).

        Returns:
          A new `DynamicLossScale`: halved with the counter reset when not `finite`;
          otherwise the counter advanced, and the scale doubled (counter reset) when it
          reaches `dynamic_growth_steps`.
        """
        finite = jnp.asarray(finite, jnp.bool_)
        count = self.counter + 1
        grow = count >= self.dynamic_growth_steps
        doubled = self.loss_scale * 2.0
        grown = jnp.where(grow & jnp.isfinite(doubled), doubled, self.loss_scale)
        halved = jnp.maximum(self.loss_scale / 2.0, jnp.float32(self.min_loss_scale))
        return self.replace(
            loss_scale=jnp.where(finite, grown, halved).astype(jnp.float32),
            counter=jnp.where(finite & ~grow, count, 0).astype(jnp.int32),
        )
