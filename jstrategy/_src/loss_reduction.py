"""Loss scaling for synchronous training, as `tf.nn.compute_average_loss` (aware of padding)
and `tf.nn.scale_regularization_loss`."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jstrategy._src import context
from jstrategy._src.validation import check_number

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(
    per_example_loss: Any,
    sample_weight: Any = None,
    global_batch_size: int | None = None,
) -> jnp.ndarray:
    """Scales a replica's per-example loss so that summing over replicas gives the mean.

    As `tf.nn.compute_average_loss`: returns ``sum(per_example_loss * sample_weight) /
    global_batch_size``. Inside `Strategy.run` on a padded batch from a distributed dataset,
    padding rows (``ReplicaContext.row_mask`` false) count for nothing, and when
    `global_batch_size` is None the divisor is the number of real rows across all replicas
    (one all-reduce of the mask count), so the SUM across replicas of the results (the
    gradient all-reduce, or ``strategy.reduce("SUM", ...)``) is the mean over real rows.
    Without a mask the divisor is ``rows_per_replica * num_replicas_in_sync``, as in TF.
    Outside `run` it is the single-replica case: the divisor is the rows given.

    Args:
      per_example_loss: the loss of each of this replica's rows, shape ``(rows, ...)``;
        extra dimensions are summed.
      sample_weight: optional weights broadcastable to `per_example_loss` (a scalar, a
        ``(rows,)`` vector, or the loss's shape).
      global_batch_size: the divisor; None: the real rows across all replicas.

    Returns:
      A scalar of `per_example_loss`'s dtype.

    Raises:
      ValueError: if `per_example_loss` is a scalar, its rows do not match the replica's
        row mask, or `global_batch_size` is not a positive int.
      RuntimeError: if called in a cross-replica context (inside `scope()` but outside
        `run`) without `global_batch_size`, as TF.

    Example:

    >>> import jax.numpy as jnp
    >>> float(compute_average_loss(jnp.array([1.0, 2.0, 3.0])))
    2.0
    >>> float(compute_average_loss(jnp.array([1.0, 3.0]), global_batch_size=4))
    1.0
    """
    loss = jnp.asarray(per_example_loss)
    dtype = loss.dtype
    if loss.ndim == 0:
        raise ValueError(
            "`per_example_loss` must have a leading row dimension (one loss per example); "
            "got a scalar. Compute the loss per example (e.g. without a final mean) and "
            "pass that."
        )
    if sample_weight is not None:
        weight = jnp.asarray(sample_weight)
        # TF's scale_losses_by_sample_weight: a (rows,) weight scales every entry of its row.
        if 0 < weight.ndim < loss.ndim:
            weight = weight.reshape(weight.shape + (1,) * (loss.ndim - weight.ndim))
        loss = loss * weight
    if global_batch_size is not None:
        check_number(
            global_batch_size,
            "global_batch_size",
            integer=True,
            low=1,
            expected="a positive int or None",
            fix="Pass None to divide by the real rows across all replicas.",
        )
    ctx = context.get_replica_context()
    if ctx is None and global_batch_size is None:
        raise RuntimeError(
            "`compute_average_loss` was called in a cross-replica context (inside "
            "strategy.scope() but outside strategy.run) without `global_batch_size`. Call it "
            "inside the function passed to strategy.run, or pass global_batch_size."
        )
    mask = None if ctx is None else ctx.row_mask
    rows = loss.shape[0]
    if mask is not None:
        if mask.shape[0] != rows:
            raise ValueError(
                f"`per_example_loss` has {rows} rows but this replica's batch has "
                f"{mask.shape[0]} (its row mask); pass one loss per row of the batch the "
                "distributed dataset gave this replica."
            )
        loss = loss * mask.reshape(mask.shape + (1,) * (loss.ndim - 1)).astype(dtype)
    total = jnp.sum(loss).astype(dtype)
    if global_batch_size is not None:
        return total / jnp.asarray(global_batch_size, dtype)
    assert ctx is not None  # a cross-replica context without global_batch_size raised above
    if mask is None:
        return total / jnp.asarray(rows * ctx.num_replicas_in_sync, dtype)
    real = ctx.all_reduce("SUM", jnp.sum(mask.astype(jnp.int32)))
    # A batch of padding only (possible on uneven per-replica pipelines) contributes zero.
    return total / jnp.maximum(real, 1).astype(dtype)


def scale_regularization_loss(regularization_loss: Any) -> jnp.ndarray:
    """Scales a regularization loss so that summing over replicas counts it once.

    As `tf.nn.scale_regularization_loss`: inside `Strategy.run` it returns
    ``regularization_loss / num_replicas_in_sync`` (every replica adds the same penalty, and
    the gradients are summed across replicas); elsewhere it returns it as it is.

    Args:
      regularization_loss: a scalar, e.g. ``1e-5 * sum(jnp.sum(w ** 2) for w in kernels)``.

    Returns:
      The scaled scalar.

    Example:

    >>> float(scale_regularization_loss(0.5))
    0.5
    """
    loss = jnp.asarray(regularization_loss)
    ctx = context.inside_run()
    if ctx is None:
        return loss
    return loss / jnp.asarray(ctx.num_replicas_in_sync, loss.dtype)
