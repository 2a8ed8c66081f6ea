"""The global batch inside a per-replica step: Flax's dropout and BatchNorm as on one device.

The training forward pass runs per replica (inside ``shard_map``, manual over the data
axis): each replica sees its own rows. Two Flax layers would then depend on how many
replicas there are, where `OneDeviceStrategy` sees the whole global batch:

* Dropout draws its mask for the rows it is given. Here Flax's ``nn.Dropout`` (linen) and
  ``nnx.Dropout`` (NNX) draw it as if for the global batch instead: with the same key on
  every replica, replica ``r`` of ``n`` keeps rows ``r * B .. (r + 1) * B`` of the mask
  ``jax.random.bernoulli(key, keep, (n * B, ...))`` that one device draws for the whole
  batch. So the mask of global row ``i`` is one device's, whatever the mesh.
* BatchNorm without ``axis_name`` normalizes each replica's rows. Here ``nn.BatchNorm`` and
  ``nnx.BatchNorm`` built without ``axis_name`` take their statistics over the data axis
  (as if built with ``axis_name=strategy.axis_name``), unless the step is given
  ``sync_batch_norm="per_replica"`` (`BatchNormSync`). A BatchNorm that names an axis
  itself is left alone.

Only those layers are reached: Flax lets a linen module's methods be intercepted
(``nn.intercept_methods``), and an NNX forward pass merges a fresh module, whose layers
can be adjusted before the call. Random numbers drawn by the model's own code
(``jax.random.*`` with ``self.make_rng("dropout")`` or an ``nnx.Rngs`` stream) get the
same key on every replica, so a custom dropout draws the same mask for every replica's
rows; to follow one device, draw for the global shape as `global_rows_bernoulli` does.

With JAX's counter-based threefry keys (the default, ``jax_threefry_partitionable``) the
bits of element ``j`` of a draw depend only on ``j``, so a replica computes only its own
rows' counters: the mask costs what a per-replica mask costs. With another PRNG
implementation, the global mask is drawn on every replica and sliced (``n`` times the
random-number work).

Outside a per-replica region (``axis_name`` None: evaluation, prediction, or a step
staged in the global view) nothing is intercepted: one key over the global batch is
already one device's mask, and BatchNorm's statistics already global.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import math
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.random import threefry2x32_p

__all__ = [
    "BatchNormSync",
    "as_batch_norm_sync",
    "global_rows_bernoulli",
    "linen_global_batch",
    "nnx_global_batch",
]


class BatchNormSync(enum.Enum):
    """Which rows a BatchNorm built without ``axis_name`` takes its statistics over in a
    training step (``sync_batch_norm=`` of `Model.compile` and `make_train_step`).

    * ``GLOBAL`` (``"global"``, the default): the global batch, as on one device, under
      every strategy: Keras's ``BatchNormalization(synchronized=True)``, TF's
      ``SyncBatchNormalization``, and what Keras 3's JAX ``DataParallel`` computes.
    * ``PER_REPLICA`` (``"per_replica"``): each replica's own rows, as TF's
      ``BatchNormalization`` under a ``tf.distribute`` strategy (Keras's
      ``synchronized=False`` on the TensorFlow backend); the running statistics are then
      averaged over the replicas after each step. The trajectory depends on the number
      of replicas.

    A BatchNorm built with ``axis_name`` (e.g. ``jstrategy.REPLICA_AXIS``) does what it
    says under either.

    Example:

    >>> BatchNormSync("per_replica")
    <BatchNormSync.PER_REPLICA: 'per_replica'>
    """

    GLOBAL = "global"
    PER_REPLICA = "per_replica"


def as_batch_norm_sync(value: Any) -> BatchNormSync:
    """`value` (a `BatchNormSync` or its value) as a `BatchNormSync`.

    Raises:
      ValueError: for anything else, naming the choices (and Keras's ``synchronized``
        for a bool).
    """
    if isinstance(value, BatchNormSync):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return BatchNormSync(value)
    hint = (
        " (Keras's synchronized=True is 'global', synchronized=False 'per_replica')"
        if isinstance(value, bool)
        else ""
    )
    raise ValueError(
        f"`sync_batch_norm` must be one of {[m.value for m in BatchNormSync]} or a "
        f"jstrategy.training.BatchNormSync; got {value!r}{hint}. 'global' (the default) "
        "takes BatchNorm statistics over the global batch, 'per_replica' over each "
        "replica's rows."
    )


@dataclasses.dataclass(frozen=True)
class _Region:
    """A per-replica training forward pass: the data axis and this replica's rows."""

    axis_name: str
    rows: int
    sync_batch_norm: bool


# The region of the forward pass being traced (read by NNX's dropout, which, unlike
# linen's interceptor, cannot close over it).
_REGION: contextvars.ContextVar[_Region | None] = contextvars.ContextVar(
    "jstrategy_global_batch", default=None
)


def _leading_rows(x: Any) -> int | None:
    leaves = [leaf for leaf in jax.tree.leaves(x) if np.ndim(leaf) > 0]
    return int(np.shape(leaves[0])[0]) if leaves else None


def _region(x: Any, axis_name: str | None, sync: BatchNormSync) -> _Region | None:
    rows = _leading_rows(x)
    if axis_name is None or rows is None:
        return None
    return _Region(axis_name, rows, sync is BatchNormSync.GLOBAL)


# Masks ------------------------------------------------------------------------------------
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


def _threefry_rows(
    key: jax.Array, p: jax.Array, shape: tuple[int, ...], first_row: Any, axis_name: str
) -> jax.Array:
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

    Args:
      key: a PRNG key, the same on every replica.
      p: the probability of True (a float).
      shape: this replica's shape.
      axis_name: the data axis of the region.
      rows: this replica's rows; None means ``shape[0]``.

    Returns:
      A bool array of `shape`.

    Example:

    >>> import jax, jstrategy
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
        return _threefry_rows(key, p, shape, first_row, axis_name)
    mask = jax.random.bernoulli(key, p, whole)
    return jax.lax.dynamic_slice_in_dim(mask, first_row, rows, axis=0)


def _dropout(
    region: _Region, inputs: Any, key: jax.Array, rate: float, broadcast_dims: Sequence[int]
) -> jax.Array:
    """Flax's dropout of `inputs` (both APIs compute it so) with a global-rows mask."""
    keep_prob = 1.0 - rate
    shape = list(np.shape(inputs))
    for dim in broadcast_dims:
        shape[dim] = 1
    mask = global_rows_bernoulli(
        key, keep_prob, shape, axis_name=region.axis_name, rows=region.rows
    )
    mask = jnp.broadcast_to(mask, np.shape(inputs))
    return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))


# linen --------------------------------------------------------------------------------------
def _linen_dropout_args(
    inputs: Any, deterministic: bool | None = None, rng: Any = None
) -> tuple[Any, Any, Any]:
    return inputs, deterministic, rng


def _linen_interceptor(region: _Region) -> Any:
    def intercept(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if (
            isinstance(module, nn.Dropout)
            and type(module).__call__ is nn.Dropout.__call__
            and module.rng_collection == "dropout"
        ):
            inputs, deterministic, rng = _linen_dropout_args(*args, **kwargs)
            # nn.Dropout.__call__ from here on, with the mask of the global rows.
            deterministic = nn.merge_param("deterministic", module.deterministic, deterministic)
            if module.rate == 0.0 or deterministic:
                return inputs
            if module.rate == 1.0:
                return jnp.zeros_like(inputs)
            if rng is None:
                rng = module.make_rng(module.rng_collection)
            return _dropout(region, inputs, rng, module.rate, module.broadcast_dims)
        if region.sync_batch_norm and isinstance(module, nn.BatchNorm) and module.axis_name is None:
            # A bound module is this forward pass's own copy; its statistics are taken
            # over the data axis for this call only.
            object.__setattr__(module, "axis_name", region.axis_name)
            try:
                return next_fun(*args, **kwargs)
            finally:
                object.__setattr__(module, "axis_name", None)
        return next_fun(*args, **kwargs)

    return intercept


@contextlib.contextmanager
def linen_global_batch(
    x: Any, *, axis_name: str | None, sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL
) -> Iterator[None]:
    """Within: linen's Dropout and BatchNorm see the global batch (module docstring).

    `x` is the forward pass's input (its rows are this replica's); with `axis_name` None
    nothing changes.
    """
    region = _region(x, axis_name, sync_batch_norm)
    if region is None:
        yield
        return
    with nn.intercept_methods(_linen_interceptor(region)):
        yield


# NNX ----------------------------------------------------------------------------------------
class _GlobalRowsDropout(nnx.Dropout):
    """``nnx.Dropout`` drawing the global rows' mask (the class of a forward pass's own
    Dropout layers while `nnx_global_batch` holds)."""

    def __call__(
        self, inputs: Any, *, deterministic: bool | None = None, rngs: Any = None
    ) -> jax.Array:
        region = _REGION.get()
        deterministic = deterministic if deterministic is not None else self.deterministic
        if region is None or deterministic is None or self.rate in (0.0, 1.0) or deterministic:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        # nnx.Dropout.__call__'s choice of key, then the mask of the global rows.
        rngs = rngs if rngs is not None else self.rngs
        if isinstance(rngs, nnx.Rngs):
            key = rngs[self.rng_collection]()
        elif isinstance(rngs, nnx.RngStream):
            key = rngs()
        elif isinstance(rngs, jax.Array):
            key = rngs
        else:  # None or something else: Flax's own error
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        return _dropout(region, inputs, key, self.rate, self.broadcast_dims)


@contextlib.contextmanager
def nnx_global_batch(
    model: nnx.Module,
    x: Any,
    *,
    axis_name: str | None,
    sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL,
) -> Iterator[None]:
    """Within: `model`'s ``nnx.Dropout`` and ``nnx.BatchNorm`` layers see the global batch.

    `model` is a forward pass's own module (from ``nnx.merge``); its layers are changed
    while the context holds and restored after, so its state splits as before. `x` and
    `axis_name` as in `linen_global_batch`.
    """
    region = _region(x, axis_name, sync_batch_norm)
    if region is None:
        yield
        return
    dropouts, norms = [], []
    for _, module in nnx.iter_modules(model):
        if type(module) is nnx.Dropout:
            dropouts.append(module)
        elif (
            region.sync_batch_norm
            and isinstance(module, nnx.BatchNorm)
            and module.axis_name is None
        ):
            norms.append(module)
    token = _REGION.set(region)
    try:
        for module in dropouts:
            module.__class__ = _GlobalRowsDropout
        for module in norms:
            module.axis_name = region.axis_name
        yield
    finally:
        for module in dropouts:
            module.__class__ = nnx.Dropout
        for module in norms:
            module.axis_name = None
        _REGION.reset(token)
