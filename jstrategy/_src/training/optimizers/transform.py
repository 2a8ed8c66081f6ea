"""The optax transformation behind the Keras-named optimizers: Keras 3's ``apply``, in order.

Each `jstrategy.optimizers` object names an `UpdateRule` (its slots and its per-variable
formula, copied from Keras 3's ``update_step``) and `KerasOptions` (the arguments of Keras's
``BaseOptimizer``); `keras_transform` turns both into an ``optax.GradientTransformation``
that does what Keras 3's JAX backend does in ``BaseOptimizer.apply`` and
``JaxOptimizer._backend_apply_gradients``, in the same order:

1. gradients divided by ``loss_scale_factor``;
2. with ``gradient_accumulation_steps`` k: the gradient added to the accumulators, and on
   every k-th call (``(iterations + 1) % k == 0``) their mean used; the other calls leave
   variables and slots as they were;
3. one clipping (``clipnorm``, ``global_clipnorm`` or ``clipvalue``, Keras's formulas);
4. decoupled weight decay: ``variable -= variable * weight_decay * learning_rate``;
5. the rule's update, with Keras's ``self.iterations`` (``iterations // k`` under
   accumulation) for bias corrections;
6. with ``use_ema``: the moving average of the variables, and every
   ``ema_overwrite_frequency``-th step the variables replaced by it;
7. ``iterations`` plus one.

The learning rate is this transformation's argument: ``optax.inject_hyperparams`` keeps it
in the optimizer state (settable, or set from a schedule at each call), so it is a value a
compiled step reads, the rate Keras's ``optimizer.learning_rate`` would hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["KerasOptimizerState", "KerasOptions", "UpdateRule", "keras_transform"]

#: ``leaf(gradient, variable, slots, learning_rate, iterations, extra) -> (variable, slots)``
LeafUpdate = Callable[[Any, Any, tuple[Any, ...], Any, Any, Any], tuple[Any, tuple[Any, ...]]]


class KerasOptimizerState(NamedTuple):
    """The state of a Keras-named optimizer (Keras's optimizer variables).

    Attributes:
      iterations: Keras's ``optimizer._iterations``: the calls of ``update`` so far (with
        ``gradient_accumulation_steps``, micro-batches), an int32 scalar.
      slots: one tree shaped like the parameters per slot of the rule (momentums,
        velocities, ...), in the rule's order.
      extra: a rule's scalar state (Nadam's product of momentum factors), or an empty
        state.
      accumulated: ``gradient_accumulation_steps``'s gradient sums, or an empty state.
      average: ``use_ema``'s moving average of the variables, or an empty state.
    """

    iterations: jax.Array
    slots: tuple[Any, ...]
    extra: Any
    accumulated: Any
    average: Any


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """An optimizer's own part: its slots and its per-variable update (Keras's
    ``build`` and ``update_step``).

    Attributes:
      slots: ``(name, initial value)`` of each slot, one tree like the parameters each.
      leaf: the update of one variable, given its gradient (cast to its dtype by the
        rule), its slots, the learning rate, Keras's ``self.iterations`` and `extra`;
        returns the new variable and slots.
      init_extra: the rule's scalar state, from the first parameter's dtype (None: none).
      prepare: `extra` before the per-variable updates of a step, from Keras's
        ``self.iterations`` (Nadam's ``_backend_update_step``); None: unchanged.
    """

    slots: tuple[tuple[str, float], ...]
    leaf: LeafUpdate
    init_extra: Callable[[Any], Any] | None = None
    prepare: Callable[[Any, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class KerasOptions:
    """The arguments of Keras 3's ``BaseOptimizer`` that act in the update (validated by
    `jstrategy.optimizers.Optimizer`)."""

    weight_decay: float | None = None
    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None
    use_ema: bool = False
    ema_momentum: float = 0.99
    ema_overwrite_frequency: int | None = None
    loss_scale_factor: float | None = None
    gradient_accumulation_steps: int | None = None


def _clip_by_norm(g: jax.Array, clipnorm: float) -> jax.Array:
    # Keras's BaseOptimizer._clip_by_norm, with its guard for an all-zero gradient.
    l2sum = jnp.sum(jnp.square(g), keepdims=True)
    pred = l2sum > 0
    l2sum_safe = jnp.where(pred, l2sum, jnp.ones_like(l2sum))
    l2norm = jnp.where(pred, jnp.sqrt(l2sum_safe), l2sum)
    return g * clipnorm / jnp.maximum(l2norm, clipnorm)


def _clip_by_global_norm(grads: list[jax.Array], clip: float) -> list[jax.Array]:
    # Keras's clip_by_global_norm: a non-finite norm makes every gradient NaN.
    norm = jnp.sqrt(jnp.sum(jnp.stack([jnp.sum(jnp.square(g)) for g in grads])))
    scale = clip * jnp.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
    return [g * scale for g in grads]


def _clip(grads: list[jax.Array], options: KerasOptions) -> list[jax.Array]:
    if options.clipnorm:
        return [_clip_by_norm(g, options.clipnorm) for g in grads]
    if options.global_clipnorm:
        return _clip_by_global_norm(grads, options.global_clipnorm)
    if options.clipvalue:
        v = options.clipvalue
        return [jnp.clip(g, -v, v) for g in grads]
    return grads


def _flat(treedef: Any, tree: Any) -> list[Any]:
    """`tree`'s subtrees at the leaves of `treedef` (the parameters' structure)."""
    return treedef.flatten_up_to(tree)  # type: ignore[no-any-return]


def _select(pred: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def keras_transform(
    rule: UpdateRule, options: KerasOptions, learning_rate: Any
) -> optax.GradientTransformation:
    """The optax transformation that updates as Keras 3's optimizer of `rule` and `options`.

    Args:
      rule: the optimizer's slots and per-variable update.
      options: Keras's base-optimizer arguments.
      learning_rate: this step's learning rate (a float32 scalar, traced).

    Returns:
      A transformation whose ``update`` needs the parameters, and returns updates whose
      sum with them is the variables Keras's optimizer would hold.

    Example:

    >>> import jax.numpy as jnp
    >>> sgd = UpdateRule((), lambda g, v, s, lr, t, e: (v - g * lr, s))
    >>> tx = keras_transform(sgd, KerasOptions(clipvalue=0.5), jnp.float32(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.array([1.0, -0.2])}, tx.init(params), params)
    >>> [round(float(u), 3) for u in updates["w"]]
    [-0.05, 0.02]
    """
    k = options.gradient_accumulation_steps

    def init(params: Any) -> KerasOptimizerState:
        leaves = jax.tree.leaves(params)
        slots = tuple(
            jax.tree.map(lambda p, v=value: jnp.full(p.shape, v, p.dtype), params)
            for _, value in rule.slots
        )
        dtype = leaves[0].dtype if leaves else jnp.float32
        zeros = jax.tree.map(jnp.zeros_like, params)
        return KerasOptimizerState(
            iterations=jnp.zeros((), jnp.int32),
            slots=slots,
            extra=rule.init_extra(dtype) if rule.init_extra is not None else optax.EmptyState(),
            accumulated=zeros if k else optax.EmptyState(),
            average=zeros if options.use_ema else optax.EmptyState(),
        )

    def update(grads: Any, state: KerasOptimizerState, params: Any = None) -> Any:
        if params is None:
            raise ValueError(
                "A jstrategy.optimizers optimizer updates as Keras's, from the variables' "
                "values (weight decay, EMA): pass `params` to `update`."
            )
        treedef = jax.tree.structure(params)
        variables = _flat(treedef, params)
        g_leaves = _flat(treedef, grads)
        slot_leaves = [_flat(treedef, s) for s in state.slots]
        iterations = state.iterations
        if options.loss_scale_factor is not None:
            g_leaves = [g / options.loss_scale_factor for g in g_leaves]
        if k:
            acc = _flat(treedef, state.accumulated)
            is_update = (iterations + 1) % k == 0
            summed = [g + a.astype(g.dtype) for g, a in zip(g_leaves, acc, strict=True)]
            new_acc = [jnp.where(is_update, jnp.zeros_like(s), s) for s in summed]
            g_leaves = [
                jnp.where(is_update, s / k, g) for s, g in zip(summed, g_leaves, strict=True)
            ]
            keras_iterations = iterations // k
        else:
            keras_iterations = iterations
        g_leaves = _clip(g_leaves, options)
        decayed = variables
        if options.weight_decay is not None:
            wd = options.weight_decay
            decayed = [
                v - v * jnp.asarray(wd, v.dtype) * jnp.asarray(learning_rate, v.dtype)
                for v in variables
            ]
        extra = state.extra
        if rule.prepare is not None:
            extra = rule.prepare(extra, keras_iterations)
        new_vars, new_slots = [], []
        for i, (g, v) in enumerate(zip(g_leaves, decayed, strict=True)):
            own = tuple(s[i] for s in slot_leaves)
            nv, ns = rule.leaf(g, v, own, learning_rate, keras_iterations, extra)
            new_vars.append(nv.astype(v.dtype))
            new_slots.append(ns)
        slots_out = [[ns[j] for ns in new_slots] for j in range(len(rule.slots))]
        if k:
            new_vars = _select(is_update, new_vars, variables)
            slots_out = _select(is_update, slots_out, slot_leaves)
            extra = _select(is_update, extra, state.extra)
        average = state.average
        if options.use_ema:
            avg = _flat(treedef, state.average)
            not_first = (keras_iterations != 0).astype(jnp.float32)
            avg = [
                (m := not_first.astype(v.dtype) * options.ema_momentum) * a + (1 - m) * v
                for a, v in zip(avg, new_vars, strict=True)
            ]
            if options.ema_overwrite_frequency is not None:
                overwrite = (keras_iterations + 1) % options.ema_overwrite_frequency == 0
                new_vars = _select(overwrite, avg, new_vars)
            average = jax.tree.unflatten(treedef, avg)
        updates = [(n - v).astype(v.dtype) for n, v in zip(new_vars, variables, strict=True)]
        new_state = KerasOptimizerState(
            iterations=iterations + 1,
            slots=tuple(jax.tree.unflatten(treedef, s) for s in slots_out),
            extra=extra,
            accumulated=jax.tree.unflatten(treedef, new_acc) if k else state.accumulated,
            average=average,
        )
        return jax.tree.unflatten(treedef, updates), new_state

    return optax.GradientTransformation(init, update)  # type: ignore[arg-type]
