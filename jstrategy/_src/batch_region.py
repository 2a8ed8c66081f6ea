"""The rows a training forward pass sees, so that batch-dependent layers compute as one device.

A train step runs each replica's forward pass on its own rows: inside ``shard_map`` (manual
over the data axis) or, under the sharded strategies, inside a ``vmap`` whose mapped axis is
the replicas. Two kinds of layer would then depend on the mesh, where `OneDeviceStrategy`
sees the whole global batch: batch statistics (BatchNorm) and random masks (dropout). The
step says where it is with a `Region` (`entered`); such layers read it (`current`):

* statistics: `moments` takes the mean and variance over the global batch (a mean over the
  region's data axis of each replica's), or over this replica's rows when asked;
* masks: `global_rows_bernoulli` draws this replica's rows of the mask one device draws for
  the global batch, from the same key on every replica, so the mask of global row ``i`` does
  not depend on the mesh.

Outside a region (evaluation, prediction, one device, a user's own ``shard_map``) there is
nothing to reconcile: the rows a layer sees are the batch it is given.

This module is core: the layers (`jstrategy.layers`) read it, and the training layer's
`global_batch` enters it and extends it to Flax's own layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from jstrategy._src import trace_context

__all__ = [
    "Region",
    "axis_bound",
    "current",
    "dropout",
    "entered",
    "global_rows_bernoulli",
    "moments",
]


@dataclasses.dataclass(frozen=True)
class Region:
    """A per-replica training forward pass.

    Attributes:
      axis_name: the data axis: collectives over it combine the replicas.
      rows: this replica's rows (the leading dimension of its inputs).
      sync_batch_norm: whether batch statistics are the global batch's (the default) or,
        when False, each replica's (``compile(sync_batch_norm="per_replica")``).
      row_mask: which of this replica's rows are real (not padding), ``(rows,)``, or None
        for all of them: batch statistics leave padding rows out, as Keras's smaller last
        batch has none.
    """

    axis_name: str
    rows: int
    sync_batch_norm: bool = True
    row_mask: Any = None


def current() -> Region | None:
    """The region of the forward pass being traced, or None outside one (the field of the
    step's `trace_context.TraceContext`)."""
    return trace_context.current().region  # type: ignore[no-any-return]


def entered(region: Region | None) -> contextlib.AbstractContextManager[Any]:
    """Within: `current` is `region` (None: no region, e.g. an evaluation step)."""
    return trace_context.replaced(region=region)


def axis_bound(axis_name: str) -> bool:
    """Whether `axis_name` names an axis of the map being traced (``shard_map``, ``vmap``).

    Example:

    >>> axis_bound("replica")
    False
    """
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


# Statistics -----------------------------------------------------------------------------
def moments(
    x: jax.Array, axes: Sequence[int], axis_name: str | None, row_mask: Any = None
) -> tuple[Any, Any]:
    """``(mean, variance)`` of `x` over `axes`, and over the replicas of `axis_name`.

    Two passes over the global batch (or this replica's rows, with `axis_name` None): the
    mean, then the mean squared deviation from it, which is ``jnp.var`` of the whole batch
    (up to rounding) without the cancellation of ``E[x²] - E[x]²``. With `row_mask`
    (``(rows,)``, the leading axis of `x` its rows, among `axes`) only the real rows
    count, so padding a batch changes nothing.
    """
    axes = tuple(axes)
    kept = tuple(1 if a in axes else d for a, d in enumerate(x.shape))
    masked = row_mask is not None and 0 in axes and np.shape(row_mask) == x.shape[:1]
    if not masked and axis_name is None:
        return jnp.mean(x, axis=axes), jnp.var(x, axis=axes)
    if masked:
        weight = jnp.asarray(row_mask, x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
        count = jnp.sum(jnp.broadcast_to(weight, x.shape), axis=axes)
    else:
        weight, count = None, jnp.asarray(math.prod(x.shape[a] for a in axes), x.dtype)

    def mean_over_rows(values: Any) -> Any:
        total = jnp.sum(values if weight is None else values * weight, axis=axes)
        totals = (total, count) if axis_name is None else jax.lax.psum((total, count), axis_name)
        return totals[0] / jnp.maximum(totals[1], 1)  # no real rows: zeros, never NaN

    mean = mean_over_rows(x)
    var = mean_over_rows(jnp.square(x - mean.reshape(kept)))
    return mean, var


# Masks ----------------------------------------------------------------------------------
def _as_typed_key(key: jax.Array) -> jax.Array:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)  # a raw key: the default implementation, as jax


def _counter_rows_fit(key: jax.Array, p: jax.Array, size: int) -> bool:
    """Whether `_threefry_rows` reproduces ``jax.random.bernoulli`` for this draw."""
    return (
        bool(jax.config.jax_threefry_partitionable)
        and str(jax.random.key_impl(key)) == "threefry2x32"
        and p.dtype == jnp.float32
        and size < 2**32
    )


def _threefry_rows(key: jax.Array, p: jax.Array, shape: tuple[int, ...], first_row: Any) -> Any:
    """Rows ``first_row ..`` of ``jax.random.bernoulli(key, p, (G, *shape[1:]))``.

    JAX's partitionable threefry gives element ``j`` (row-major) of a ``bits`` draw the
    bits ``threefry2x32(key, (j >> 32, j & 0xffffffff))``, halves xor-ed; ``uniform`` keeps
    23 mantissa bits, ``bernoulli`` compares with `p`. Only this replica's counters are
    computed. Checked bit for bit against JAX by the tests.
    """
    inner = math.prod(shape[1:])
    offset = jnp.asarray(first_row, jnp.uint32) * jnp.uint32(inner)
    lo = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape) + offset
    k1, k2 = jax.random.key_data(key)
    # threefry's loop needs its operands typed alike: `lo` differs per replica (varying in
    # a manual region, batched under the global view's vmap), so the others are made from
    # it (``lo ^ lo`` is zero) to vary or batch as it does.
    zero = lo ^ lo
    bits1, bits2 = threefry2x32_p.bind(zero + k1, zero + k2, zero, lo)
    bits = bits1 ^ bits2
    mantissa = jax.lax.shift_right_logical(bits, jnp.uint32(32 - 23))
    one = jnp.uint32(np.array(1.0, np.float32).view(np.uint32))
    uniform = jax.lax.bitcast_convert_type(mantissa | one, jnp.float32) - jnp.float32(1.0)
    return jnp.maximum(jnp.float32(0.0), uniform) < p


def global_rows_bernoulli(
    key: jax.Array, p: Any, shape: Sequence[int], *, axis_name: str, rows: int | None = None
) -> jax.Array:
    """This replica's rows of the Bernoulli mask one device draws for the global batch.

    Inside a per-replica region over the data axis `axis_name` (``n`` replicas, this one
    ``r``), with `shape` this replica's shape whose first axis holds its `rows` rows: rows
    ``r * rows .. (r + 1) * rows`` of ``jax.random.bernoulli(key, p, (n * rows,
    *shape[1:]))``, bit for bit, for the same `key` on every replica. A shape whose first
    axis is not `rows` (not split by rows, e.g. a mask broadcast over the batch) gets
    ``jax.random.bernoulli(key, p, shape)``, as on one device.

    With JAX's counter-based threefry keys (the default, ``jax_threefry_partitionable``)
    only this replica's counters are computed: the mask costs what a per-replica mask
    costs. With another PRNG implementation, the global mask is drawn on every replica and
    sliced (``n`` times the random-number work).

    Args:
      key: a PRNG key, the same on every replica.
      p: the probability of True (a float).
      shape: this replica's shape.
      axis_name: the data axis of the region.
      rows: this replica's rows; None means ``shape[0]``.

    Returns:
      A bool array of `shape`.

    Example:

    >>> import jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4,), ("replica",))
    >>> key = jax.random.key(0)
    >>> masks = jax.jit(jax.shard_map(
    ...     lambda k: global_rows_bernoulli(k, 0.5, (2, 3), axis_name="replica"),
    ...     mesh=mesh, in_specs=P(), out_specs=P("replica")))(key)
    >>> bool((masks == jax.random.bernoulli(key, 0.5, (8, 3))).all())
    True
    """
    shape = tuple(int(d) for d in shape)
    rows = shape[0] if rows is None and shape else rows
    n = jax.lax.axis_size(axis_name)
    if n == 1 or not shape or shape[0] != rows:
        return jax.random.bernoulli(key, p, shape)
    key = _as_typed_key(key)
    p = jnp.asarray(p)
    first_row = jax.lax.axis_index(axis_name) * rows
    whole = (n * rows, *shape[1:])
    if _counter_rows_fit(key, p, math.prod(whole)):
        return _threefry_rows(key, p, shape, first_row)
    mask = jax.random.bernoulli(key, p, whole)
    return jax.lax.dynamic_slice_in_dim(mask, first_row, rows, axis=0)


def dropout(inputs: Any, key: jax.Array, rate: float, mask_shape: Sequence[int]) -> jax.Array:
    """Inverted dropout of `inputs` at `rate` with a mask of `mask_shape` (broadcast to the
    inputs), drawn by global row inside a region and as ``jax.random.bernoulli`` outside.

    Flax's ``nn.Dropout``, ``nnx.Dropout`` and `jstrategy.layers.Dropout` all compute this:
    ``select(mask, inputs / keep, 0)``.
    """
    keep_prob = 1.0 - rate
    region = current()
    if region is None:
        mask = jax.random.bernoulli(key, keep_prob, tuple(mask_shape))
    else:
        mask = global_rows_bernoulli(
            key, keep_prob, mask_shape, axis_name=region.axis_name, rows=region.rows
        )
    mask = jnp.broadcast_to(mask, np.shape(inputs))
    return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))
