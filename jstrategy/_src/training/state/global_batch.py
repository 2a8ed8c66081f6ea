"""The global batch inside a per-replica step: Flax's dropout and BatchNorm as on one device.

The training forward pass runs per replica (inside ``shard_map``, manual over the data
axis, or a ``vmap`` over the replicas in the sharded strategies' global view): each replica
sees its own rows. The step enters a `batch_region.Region` there, which
`jstrategy.layers`' BatchNormalization and Dropout read themselves; Flax's own layers cannot
read it, and would depend on how many replicas there are, where `OneDeviceStrategy` sees
the whole global batch:

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

Outside a per-replica region (``axis_name`` None: evaluation, prediction) nothing is
intercepted: one key over the global batch is already one device's mask, and BatchNorm's
statistics already global.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jstrategy._src import batch_region
from jstrategy._src.batch_region import Region
from jstrategy._src.batch_region import global_rows_bernoulli
from jstrategy._src.numerics import row_count
from jstrategy._src.pipeline import repeated
from jstrategy._src.pipeline.loss import after_block_refused

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


def _region(
    x: Any, axis_name: str | None, sync: BatchNormSync, row_mask: Any = None
) -> Region | None:
    rows = row_count(x)
    if axis_name is None or rows is None:
        return None
    return Region(axis_name, rows, sync is BatchNormSync.GLOBAL, row_mask)


def _dropout(inputs: Any, key: jax.Array, rate: float, broadcast_dims: Sequence[int]) -> Any:
    """Flax's dropout of `inputs` (both APIs compute it so) with a global-rows mask."""
    shape = list(np.shape(inputs))
    for dim in broadcast_dims:
        shape[dim] = 1
    return batch_region.dropout(inputs, key, rate, shape)


# linen --------------------------------------------------------------------------------------
def _linen_dropout_args(
    inputs: Any, deterministic: bool | None = None, rng: Any = None
) -> tuple[Any, Any, Any]:
    return inputs, deterministic, rng


def _linen_interceptor(region: Region) -> Any:
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
            return _dropout(inputs, rng, module.rate, module.broadcast_dims)
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
    x: Any,
    *,
    axis_name: str | None,
    sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL,
    row_mask: Any = None,
) -> Iterator[None]:
    """Within: linen's Dropout and BatchNorm see the global batch (module docstring).

    `x` is the forward pass's input (its rows are this replica's, `row_mask` which of them
    are real); with `axis_name` None nothing changes.
    """
    region = _region(x, axis_name, sync_batch_norm, row_mask)
    if region is None:
        yield
        return
    with batch_region.entered(region), nn.intercept_methods(_linen_interceptor(region)):
        yield


# NNX ----------------------------------------------------------------------------------------
class _GlobalRowsDropout(nnx.Dropout):
    """``nnx.Dropout`` drawing the global rows' mask (the class of a forward pass's own
    Dropout layers while `nnx_global_batch` holds)."""

    def __call__(
        self, inputs: Any, *, deterministic: bool | None = None, rngs: Any = None
    ) -> jax.Array:
        region = batch_region.current()
        deterministic = deterministic if deterministic is not None else self.deterministic
        if not deterministic and self.rate > 0 and repeated.after_block():
            raise after_block_refused("an nnx.Dropout", "dropout")
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
        return _dropout(inputs, key, self.rate, self.broadcast_dims)


@contextlib.contextmanager
def nnx_global_batch(
    model: nnx.Module,
    x: Any,
    *,
    axis_name: str | None,
    sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL,
    row_mask: Any = None,
) -> Iterator[None]:
    """Within: `model`'s ``nnx.Dropout`` and ``nnx.BatchNorm`` layers see the global batch.

    `model` is a forward pass's own module (from ``nnx.merge``); its layers are changed
    while the context holds and restored after, so its state splits as before. `x`,
    `axis_name` and `row_mask` as in `linen_global_batch`.
    """
    region = _region(x, axis_name, sync_batch_norm, row_mask)
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
    try:
        for module in dropouts:
            module.__class__ = _GlobalRowsDropout
        for module in norms:
            module.axis_name = region.axis_name
        with batch_region.entered(region):
            yield
    finally:
        for module in dropouts:
            module.__class__ = nnx.Dropout
        for module in norms:
            module.axis_name = None
