"""Host rows onto the mesh: `put_rows`, the one route; `full_mask`, the cached all-true row
mask; and `Placer`, which pads, checks and places the batches of one dataset (or one
`distribute_batch` call) at one static shape.

Placement is one `put_rows` (`jax.make_array_from_process_local_data`, a single
`jax.device_put` in one process) per batch; a full batch is never copied on the host. When
a strategy spans several processes each process feeds only the rows its devices own
(`rows.process_row_slices`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jstrategy._src.context_parallel.axis import batch_shardings
from jstrategy._src.input.checks import BatchSpec
from jstrategy._src.input.checks import check_matches
from jstrategy._src.input.checks import flatten_batch
from jstrategy._src.input.checks import spec_of
from jstrategy._src.input.rows import process_local_batch
from jstrategy._src.input.rows import process_row_slices
from jstrategy._src.numerics import round_up
from jstrategy._src.validation import is_int
from jstrategy._src.values import PerReplica
from jstrategy._src.values import replica_devices
from jstrategy._src.values import row_blocks

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = ["Placer", "distribute_batch", "full_mask", "is_full_mask", "put_rows"]

# The one route from host rows to the mesh: distributed datasets, `distribute_batch`,
# `experimental_distribute_values_from_function`, and `Model`'s array batches and masks
# all go through `put_rows`, and every all-true row mask comes from `full_mask`.
_FULL_MASKS: dict[Any, jax.Array] = {}


def put_rows(
    sharding: jax.sharding.Sharding | list[jax.sharding.Sharding],
    local: list[Any],
    global_shapes: list[tuple],
) -> list[jax.Array]:
    """Lays host rows over the mesh: one batched transfer, no per-device Python copies.

    Args:
      sharding: where the rows go (e.g. `Strategy.batch_sharding()`), or one sharding per
        array (`context_parallel.axis.batch_shardings`: sequences split over a context
        axis too).
      local: host arrays: this process's rows (the rows its devices own, in mesh order),
        or the whole arrays when an array's shape is its global shape (every process
        holds the same data, as `Model.fit` with arrays).
      global_shapes: each array's global shape.

    Returns:
      The global `jax.Array` of each.

    Example:

    >>> import numpy as np, jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> [x] = put_rows(strategy.batch_sharding(), [np.arange(4.0)], [(4,)])
    >>> [s.data.tolist() for s in x.addressable_shards]
    [[0.0, 1.0], [2.0, 3.0]]
    """
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local, global_shapes)


def full_mask(
    sharding: jax.sharding.Sharding, global_shape: tuple, local_shape: tuple | None = None
) -> jax.Array:
    """An all-true row mask of `global_shape`, placed once and reused across steps: full
    batches then put no mask at all.

    `local_shape` is this process's part (`put_rows`' process-local rows); None: the
    process holds the whole mask.
    """
    local_shape = global_shape if local_shape is None else local_shape
    key = (sharding, tuple(global_shape), tuple(local_shape))
    mask = _FULL_MASKS.get(key)
    # A step that donates its inputs deletes the cached mask; make a new one then.
    if mask is None or mask.is_deleted():
        [mask] = put_rows(sharding, [np.ones(local_shape, bool)], [tuple(global_shape)])
        _FULL_MASKS[key] = mask
    return mask


def is_full_mask(mask: Any) -> bool:
    """Whether `mask` is an all-true row mask made by `full_mask` (its batch has no padding).

    Example:

    >>> import jstrategy
    >>> sharding = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).batch_sharding()
    >>> is_full_mask(full_mask(sharding, (4,))), is_full_mask(None)
    (True, False)
    """
    return mask is not None and any(mask is m for m in _FULL_MASKS.values())


def _process_layout(strategy: StrategyLike) -> tuple[list[Any], int, int, int]:
    """(row blocks' process indices, this process's pipeline id, pipelines, local replicas).

    A row block is the rows one group of devices holds (`row_blocks` of the batch
    sharding): a replica's, or part of one where the strategy splits a replica's rows over
    its devices too. Its process index is a set when its devices span several processes
    (a replica of an N-D mesh), each of which then feeds its rows.
    """
    sharding = strategy.batch_sharding()
    owner_sets = [sorted({d.process_index for d in block}) for block in row_blocks(sharding)]
    owners = [o[0] if len(o) == 1 else frozenset(o) for o in owner_sets]
    processes = sorted({p for o in owner_sets for p in o})
    me = jax.process_index()
    if me not in processes:
        raise ValueError(
            f"This process ({me}) owns none of the strategy's devices, so it has no rows to "
            "feed. Build the strategy from devices that include this process's devices."
        )
    groups = replica_devices(sharding, strategy.num_replicas_in_sync)
    local_replicas = sum(any(d.process_index == me for d in group) for group in groups)
    return owners, processes.index(me), len(processes), local_replicas


class Placer:
    """Pads, checks and places the batches of one dataset (or one `distribute_batch` call).

    Args:
      strategy: the strategy whose mesh the batches go to.
      rows_are_global: batches are global (each process keeps its rows) or process-local.
      global_batch_size: the static global size; None: from the first batch.
      fetch_to_device: put elements on the devices or keep them on the host.
      arg: the argument named in error messages.
    """

    def __init__(
        self,
        strategy: StrategyLike,
        *,
        rows_are_global: bool,
        global_batch_size: int | None,
        fetch_to_device: bool,
        arg: str,
    ):
        n = strategy.num_replicas_in_sync
        unit = strategy.batch_multiple  # n, times a pipeline's microbatches
        owners, pipeline_id, pipelines, local_replicas = _process_layout(strategy)
        if global_batch_size is not None and (
            not is_int(global_batch_size) or global_batch_size < 1 or global_batch_size % unit
        ):
            hint = round_up(global_batch_size, unit) if isinstance(global_batch_size, int) else unit
            what = f"num_replicas_in_sync={n}" if unit == n else f"batch_multiple={unit}"
            raise ValueError(
                f"`global_batch_size` must be a positive multiple of {what}, so every "
                f"replica gets the same rows; got {global_batch_size!r}. Pass "
                f"global_batch_size={max(hint, unit)}."
            )
        if not rows_are_global and local_replicas * pipelines != n:
            raise ValueError(
                "Per-process input needs the same number of replicas on every process; "
                f"this process has {local_replicas} of {n} over {pipelines} processes. Use "
                "experimental_distribute_dataset with global batches instead."
            )
        self.strategy = strategy
        self.rows_are_global = rows_are_global
        self.fetch_to_device = fetch_to_device
        self.arg = arg
        self.num_replicas = n
        self.unit = unit
        self.owners = owners
        self.pipeline_id = pipeline_id
        self.pipelines = pipelines
        self.local_replicas = local_replicas
        self.global_batch_size = None if global_batch_size is None else int(global_batch_size)
        self.spec: BatchSpec | None = None
        self.static_global = 0  # the static global rows, once known
        self.source_of_size = "global_batch_size"
        self._slices: tuple[slice, ...] | None = None
        self._each: list[jax.sharding.Sharding] | None = None  # `leaf_shardings`, once known

    # The static size is fixed by the first batch unless given, and then never changes.
    def _set_sizes(self, first_rows: int) -> None:
        if self.global_batch_size is None:
            if self.rows_are_global:
                self.global_batch_size = round_up(first_rows, self.unit)
            else:
                local = round_up(first_rows, self.local_replicas * self.unit // self.num_replicas)
                self.global_batch_size = local * self.pipelines
            self.source_of_size = "the first batch"
        g = self.global_batch_size
        self.static_global = g
        if self.rows_are_global:
            self.static_rows = g
            slices = process_row_slices(g, self.owners, jax.process_index())
            self._slices = None if self.pipelines == 1 else slices
            self.local_rows = sum(s.stop - s.start for s in slices)
        else:
            self.static_rows = self.local_rows = g // self.pipelines
            self._slices = None

    def static_shapes(self) -> list[tuple[int, ...]]:
        assert self.spec is not None
        return [(self.static_global, *shape) for shape in self.spec.row_shapes]

    def init(self, leaves: list[Any], treedef: Any, rows: int, where: str) -> None:
        """Fixes the spec and static sizes from the first batch (`rows` of this pipeline)."""
        if rows == 0:
            raise ValueError(
                f"{where} has 0 rows; the first batch fixes the static batch size, so it "
                "must not be empty. Drop empty batches or pass global_batch_size."
            )
        self._set_sizes(rows)
        self.spec = spec_of(leaves, treedef)

    def check(self, leaves: list[Any], treedef: Any, rows: int, where: str) -> None:
        if self.spec is None:
            self.init(leaves, treedef, rows, where)
        else:
            check_matches(self.spec, leaves, treedef, where, "the first batch")

    def place(self, batch: Any, where: str) -> Any:
        leaves, treedef, rows = flatten_batch(batch, where)
        self.check(leaves, treedef, rows, where)
        if rows > self.static_rows:
            unit = self.unit if self.rows_are_global else self.local_replicas
            kind = "global" if self.rows_are_global else "per-process"
            suggested = round_up(rows, unit) * (1 if self.rows_are_global else self.pipelines)
            raise ValueError(
                f"{where} has {rows} rows, more than the static {kind} batch size "
                f"{self.static_rows} (from {self.source_of_size}, a multiple of {unit} "
                "replicas). Every element has that static shape so the compiled step is "
                "reused. Make the first batch the largest, or pass "
                f"global_batch_size={suggested}."
            )
        return self._place_leaves(leaves, treedef, rows)

    def _place_leaves(self, leaves: list[Any], treedef: Any, rows: int) -> Any:
        static = self.static_rows
        full = rows == static
        if not self.fetch_to_device:
            leaves = [np.asarray(x) for x in leaves]
        elif not full:
            # Padding happens on the host: jax.Array leaves come back once, for this batch only.
            leaves = [np.asarray(x) if isinstance(x, jax.Array) else x for x in leaves]
        local, host_mask = process_local_batch(leaves, rows, static, self._slices)
        values: list[Any]
        mask: Any
        if not self.fetch_to_device:
            mask = host_mask
            mask.flags.writeable = False
            values = local
        else:
            shapes = self.static_shapes()
            g = self.static_global
            sharding = self.strategy.batch_sharding()
            each = self.leaf_shardings()
            if full:
                values = put_rows(each, local, shapes)
                mask = full_mask(sharding, (g,), (len(host_mask),))
            else:
                *values, mask = put_rows([*each, sharding], [*local, host_mask], [*shapes, (g,)])
        return jax.tree.unflatten(
            treedef, [PerReplica(v, stacked=False, mask=mask) for v in values]
        )

    def leaf_shardings(self) -> list[jax.sharding.Sharding]:
        """Each array's sharding: by rows, and under a context axis the arrays carrying the
        sequence along it too (`context_parallel.axis.batch_shardings`)."""
        if self._each is None:
            assert self.spec is not None
            shapes = [jax.ShapeDtypeStruct(s, np.bool_) for s in self.static_shapes()]
            self._each = jax.tree.leaves(
                batch_shardings(self.strategy, jax.tree.unflatten(self.spec.treedef, shapes))
            )
        return self._each

    def element_spec(self) -> Any:
        assert self.spec is not None
        if self.fetch_to_device:
            shardings: list[Any] = self.leaf_shardings()
            dtypes = [jax.dtypes.canonicalize_dtype(d) for d in self.spec.dtypes]
        else:
            shardings, dtypes = [None] * len(self.spec.dtypes), list(self.spec.dtypes)
        return jax.tree.unflatten(
            self.spec.treedef,
            [
                jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for shape, dtype, sharding in zip(
                    self.static_shapes(), dtypes, shardings, strict=True
                )
            ],
        )


def distribute_batch(strategy: StrategyLike, batch: Any, *, global_batch_size: int | None = None):
    """Pads one global batch to a static size and lays it over the strategy's replicas.

    The low-level step of every distributed dataset, for code that holds its batches in
    memory (e.g. `Model.fit` on NumPy arrays). Replica *i* gets the *i*-th contiguous slice
    of rows; padding rows are zeros at the end and are false in the mask, which `Strategy.run`
    hands to `ReplicaContext.row_mask`. When the strategy spans several processes, `batch`
    is the whole global batch on every process and each process places only its rows.

    Args:
      strategy: the strategy whose replicas get the batch.
      batch: a pytree of NumPy (or JAX) arrays that share their leading (row) dimension.
      global_batch_size: the static number of rows to pad to, a multiple of
        `strategy.num_replicas_in_sync`; None: the batch's rows rounded up to one. Give the
        same value for every batch (the full batch size) so every batch compiles to the same
        program.

    Returns:
      The pytree of `batch` with each leaf a split `PerReplica` of global shape
      ``(global_batch_size, ...)``; all leaves share one boolean `mask`.

    Raises:
      TypeError: if a leaf is not an array.
      ValueError: if the leaves' leading dimensions differ, a leaf is a scalar, the batch has
        more rows than `global_batch_size`, or `global_batch_size` does not divide by the
        replica count.

    Example:

    >>> import numpy as np
    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> batch = {"x": np.arange(6.0).reshape(3, 2)}
    >>> dist = distribute_batch(strategy, batch)
    >>> dist["x"].value.shape, dist["x"].mask.tolist()
    ((4, 2), [True, True, True, False])
    """
    placer = Placer(
        strategy,
        rows_are_global=True,
        global_batch_size=global_batch_size,
        fetch_to_device=True,
        arg="batch",
    )
    return placer.place(batch, "`batch`")
