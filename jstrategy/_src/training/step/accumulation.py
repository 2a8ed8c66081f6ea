"""Gradient accumulation: k micro-batches give the update of one k-times-larger batch.

The step body (`step.py`) hands each micro-batch's all-reduced gradient *sum* and its count
of real rows to `accumulate`, which adds them to a `GradientAccumulator` kept in the train
state (``state.grad_accumulator``). On the k-th micro-batch of a cycle it divides the sums
by the cycle's count of real rows and applies the optimizer once; on the others it only
keeps the sums (and the model state the forward pass updated, such as BatchNorm
statistics). The update is therefore the gradient of the mean loss over every real row of
the k micro-batches: a padded micro-batch (the partial last batch of an epoch) weighs by
its real rows, not as a whole batch. (Keras and ``optax.MultiSteps`` average the k
micro-batch means, which is the same only when every micro-batch is full.)

Everything is in the state, so checkpoints carry a cycle in progress and a resume in its
middle is exact, and there is no host synchronization: the choice between updating and
accumulating is a ``lax.cond`` on the replicated count, taken identically on every replica.

Counting: ``state.step`` counts micro-batches (Keras's ``optimizer.iterations`` does the
same), like the progress bar and ``steps_per_epoch``; the optimizer's own state (its
``count``, and so an optax learning-rate schedule) advances once per update.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["GradientAccumulator", "GradientSums", "accumulate"]


class GradientSums(NamedTuple):
    """One micro-batch's gradients as the step body passes them to `accumulate`.

    Attributes:
      sums: the gradient of the loss *sum* over the global micro-batch's real rows
        (all-reduced, identical on every replica), shaped like the parameters.
      rows: the micro-batch's number of real rows (a float32 scalar).
    """

    sums: Any
    rows: jax.Array


def _accumulator_dtype(dtype: Any) -> Any:
    # bfloat16 or float16 variables still accumulate in float32: k additions in 8 bits of
    # mantissa would lose the small micro-batches' contributions.
    return jnp.promote_types(dtype, jnp.float32)


class GradientAccumulator(struct.PyTreeNode):
    """The running sums of a gradient-accumulation cycle, kept in the train state.

    Attributes:
      grad_sums: the sum of the cycle's micro-batch gradient sums, shaped like the
        parameters (float32, or the parameters' dtype if wider).
      count: the cycle's real rows so far (a float32 scalar).
      micro_steps: the micro-batches accumulated in this cycle (an int32 scalar); the
        update happens on the one that makes it ``gradient_accumulation_steps``.

    Example:

    >>> import jax.numpy as jnp
    >>> acc = GradientAccumulator.zeros({"w": jnp.ones(2, jnp.bfloat16)})
    >>> str(acc.grad_sums["w"].dtype), int(acc.micro_steps)
    ('float32', 0)
    """

    grad_sums: Any
    count: jax.Array
    micro_steps: jax.Array

    @classmethod
    def zeros(cls, params: Any) -> GradientAccumulator:
        """An empty cycle for parameters like `params` (arrays or shape-dtype structs)."""
        return cls(
            grad_sums=jax.tree.map(
                lambda p: jnp.zeros(p.shape, _accumulator_dtype(p.dtype)), params
            ),
            count=jnp.zeros((), jnp.float32),
            micro_steps=jnp.zeros((), jnp.int32),
        )

    def add(self, grads: GradientSums) -> GradientAccumulator:
        """The cycle with one more micro-batch."""
        return GradientAccumulator(
            grad_sums=jax.tree.map(lambda a, g: a + g.astype(a.dtype), self.grad_sums, grads.sums),
            count=self.count + grads.rows,
            micro_steps=self.micro_steps + 1,
        )


def accumulate(state: Any, grads: GradientSums, model_state: Any, steps: int) -> Any:
    """The state after one micro-batch: its gradients kept, and every `steps`-th the update.

    Args:
      state: the train state (`TrainStateProtocol`) with a `GradientAccumulator` in
        ``state.grad_accumulator``.
      grads: the micro-batch's gradient sums and count of real rows.
      model_state: the model state its forward pass produced (e.g. BatchNorm statistics),
        kept in either case.
      steps: ``gradient_accumulation_steps``.

    Returns:
      The new state; its ``step`` is one more in either case.
    """
    cycle = state.grad_accumulator.add(grads)

    def update(_: None) -> Any:
        denom = jnp.maximum(cycle.count, 1.0)
        mean = jax.tree.map(lambda s, p: (s / denom).astype(p.dtype), cycle.grad_sums, state.params)
        new = state.apply_update(mean, model_state)
        return new.replace(grad_accumulator=GradientAccumulator.zeros(cycle.grad_sums))

    def keep(_: None) -> Any:
        new = state.with_variables(state.params, model_state).with_step(state.step + 1)
        return new.replace(grad_accumulator=cycle)

    return jax.lax.cond(cycle.micro_steps >= steps, update, keep, None)
