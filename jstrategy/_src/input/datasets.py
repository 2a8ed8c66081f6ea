"""Distributed input: global batches laid over the mesh, padded to one static shape, prefetched.

A distributed dataset turns an iterable of global batches (pytrees of NumPy or JAX arrays)
into elements that go straight into `Strategy.run`: every leaf becomes a split `PerReplica`
whose global array is laid out with `Strategy.batch_sharding()`, so replica *i* owns the
*i*-th contiguous slice of rows, as in tf.distribute.

Every element has the same static shape. A batch with fewer rows than the static global
batch size (the last one, or any batch whose size does not divide by the replica count) is
padded with zero rows, and every element carries a boolean row mask (all true for full
batches) so full and partial batches run the same compiled program. `Strategy.run` passes
the mask to the replica context and `jstrategy.compute_average_loss` uses it, so losses
count only real rows.

Placement is one `put_rows` (`jax.make_array_from_process_local_data`, a single
`jax.device_put` in one process) per batch, the one route from host rows to the mesh; a full
batch is never copied on the host. When a strategy spans several
processes each process feeds only the rows its devices own; `process_row_slices` is the
pure function that says which.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jstrategy._src.numerics import round_up
from jstrategy._src.validation import check_number
from jstrategy._src.validation import is_int
from jstrategy._src.values import PerReplica
from jstrategy._src.values import local_replica_devices
from jstrategy._src.values import replica_devices

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "distribute_batch",
    "distribute_dataset",
    "distribute_datasets_from_function",
    "full_mask",
    "pad_rows",
    "process_local_batch",
    "process_row_slices",
    "put_rows",
    "replica_row_slices",
]


# Options and context ------------------------------------------------------------------
class InputReplicationMode(enum.Enum):
    """How many input pipelines `distribute_datasets_from_function` builds, as in TF.

    * ``PER_WORKER``: one pipeline per process; each element is the process's share of the
      global batch (``global_batch_size // num_input_pipelines`` rows).
    * ``PER_REPLICA``: one pipeline per replica; each element is one replica's batch
      (``InputContext.get_per_replica_batch_size(global_batch_size)`` rows).

    Example:

    >>> import jstrategy
    >>> jstrategy.InputReplicationMode("PER_WORKER") is jstrategy.InputReplicationMode.PER_WORKER
    True
    >>> options = jstrategy.InputOptions(
    ...     experimental_replication_mode=jstrategy.InputReplicationMode.PER_REPLICA)
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputOptions:
    """How a distributed dataset moves batches to the devices, as `tf.distribute.InputOptions`.

    Args:
      experimental_fetch_to_device: put each batch on the replicas' devices (True, the
        default) or keep it on the host. Host elements are pytrees of split `PerReplica`
        values whose `value` and `mask` are NumPy arrays, padded like device elements;
        `Strategy.run` accepts them and transfers them when it runs the step (without
        overlap), so use this for batches that a step reads on the host, or that you
        place yourself.
      experimental_per_replica_buffer_size: how many batches are put on the devices ahead of
        the one being consumed; 0 turns prefetching off. JAX transfers asynchronously, so
        batches put ahead move while the current step runs.
      experimental_replication_mode: `InputReplicationMode.PER_WORKER` (the default) or
        `PER_REPLICA`; only `distribute_datasets_from_function` supports `PER_REPLICA`.
      experimental_place_dataset_on_device: with `PER_REPLICA` and
        ``experimental_fetch_to_device=False``, put each replica's batch on its device as
        soon as it is produced, with no prefetch buffer (JAX has no device-resident input
        pipelines, so this is the closest equivalent of TF's option).

    Raises:
      TypeError: if an option has the wrong type.
      ValueError: if an option is out of range or the combination is invalid.

    Example:

    >>> options = InputOptions(experimental_per_replica_buffer_size=2)
    >>> options.experimental_replication_mode
    <InputReplicationMode.PER_WORKER: 'PER_WORKER'>
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False

    def __post_init__(self) -> None:
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"`{name}` must be a bool; got {type(value).__name__} {value!r}.")
        size = check_number(
            self.experimental_per_replica_buffer_size,
            "experimental_per_replica_buffer_size",
            integer=True,
            low=0,
            expected="an int >= 0",
            fix="Pass 0 to turn prefetching off, or 1 or 2 to overlap transfers with steps.",
        )
        mode = self.experimental_replication_mode
        if isinstance(mode, str) and mode.upper() in InputReplicationMode.__members__:
            mode = InputReplicationMode[mode.upper()]
        if not isinstance(mode, InputReplicationMode):
            raise ValueError(
                f"`experimental_replication_mode` must be a jstrategy.InputReplicationMode; "
                f"got {mode!r}. Pass InputReplicationMode.PER_WORKER or PER_REPLICA."
            )
        object.__setattr__(self, "experimental_replication_mode", mode)
        object.__setattr__(self, "experimental_per_replica_buffer_size", int(size))
        if self.experimental_place_dataset_on_device:
            if mode is not InputReplicationMode.PER_REPLICA:
                raise ValueError(
                    "`experimental_place_dataset_on_device=True` requires "
                    "experimental_replication_mode=InputReplicationMode.PER_REPLICA; got "
                    f"{mode}. Set the replication mode to PER_REPLICA, or leave "
                    "experimental_place_dataset_on_device=False."
                )
            if self.experimental_fetch_to_device:
                raise ValueError(
                    "`experimental_place_dataset_on_device=True` and "
                    "`experimental_fetch_to_device=True` cannot both be set (as in TF); "
                    "pass experimental_fetch_to_device=False with it."
                )


class InputContext:
    """What `dataset_fn` of `distribute_datasets_from_function` learns about its pipeline.

    Args:
      num_input_pipelines: how many input pipelines there are (one per process, or one per
        replica in `InputReplicationMode.PER_REPLICA`).
      input_pipeline_id: this pipeline's index, 0 to `num_input_pipelines - 1` (the process
        index for one pipeline per process).
      num_replicas_in_sync: how many replicas take part in each step.

    Raises:
      ValueError: if a count is not a positive int or the id is out of range.

    Example:

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    >>> ctx.get_per_replica_batch_size(64)
    8
    """

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ):
        for name, value in (
            ("num_input_pipelines", num_input_pipelines),
            ("num_replicas_in_sync", num_replicas_in_sync),
        ):
            check_number(value, name, integer=True, low=1)
        check_number(
            input_pipeline_id,
            "input_pipeline_id",
            integer=True,
            low=0,
            high=num_input_pipelines,
            high_open=True,
            expected=f"an int in [0, {num_input_pipelines}) "
            f"(num_input_pipelines={num_input_pipelines})",
        )
        self._num_input_pipelines = int(num_input_pipelines)
        self._input_pipeline_id = int(input_pipeline_id)
        self._num_replicas_in_sync = int(num_replicas_in_sync)

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines there are."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index; use it to shard files or examples between pipelines."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The rows each replica gets of a global batch of `global_batch_size` rows.

        Args:
          global_batch_size: the rows of one global batch, across all replicas.

        Returns:
          ``global_batch_size // num_replicas_in_sync``.

        Raises:
          ValueError: if `global_batch_size` does not divide by `num_replicas_in_sync`.
        """
        n = self._num_replicas_in_sync
        check_number(global_batch_size, "global_batch_size", integer=True, low=1)
        if global_batch_size % n:
            raise ValueError(
                f"`global_batch_size` must be divisible by num_replicas_in_sync={n}; got "
                f"{global_batch_size}. Use {round_up(global_batch_size, n)} or "
                f"{max(n, global_batch_size // n * n)}."
            )
        return int(global_batch_size) // n

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


# Layout: which rows belong to which replica and process (pure) --------------------------
def replica_row_slices(global_batch_size: int, num_replicas: int) -> tuple[slice, ...]:
    """The rows of a global batch that each replica owns: replica *i* gets the *i*-th slice.

    Args:
      global_batch_size: rows in the (padded) global batch.
      num_replicas: replicas in sync; must divide `global_batch_size`.

    Returns:
      One `slice` per replica, in replica order.

    Raises:
      ValueError: if `global_batch_size` does not divide by `num_replicas`.

    Example:

    >>> replica_row_slices(8, 4)
    (slice(0, 2, None), slice(2, 4, None), slice(4, 6, None), slice(6, 8, None))
    """
    if num_replicas < 1 or global_batch_size % num_replicas:
        padded = round_up(global_batch_size, max(num_replicas, 1))
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must be a multiple of the number of "
            f"replicas ({num_replicas}); pad the batch to {padded} rows."
        )
    per = global_batch_size // num_replicas
    return tuple(slice(i * per, (i + 1) * per) for i in range(num_replicas))


def process_row_slices(
    global_batch_size: int,
    device_process_indices: Sequence[int | Collection[int]],
    process_index: int,
) -> tuple[slice, ...]:
    """The rows of a global batch that one process feeds, given which process owns each replica.

    Replica *i* (the *i*-th device of the strategy's mesh) owns the *i*-th contiguous slice
    of rows; a process feeds the rows of its replicas, in mesh order. Adjacent slices are
    merged, so a process whose devices are contiguous in the mesh gets a single slice (and
    its rows are a view of the batch, not a copy). The concatenation of the returned slices
    is exactly the process-local data `jax.make_array_from_process_local_data` expects.

    Args:
      global_batch_size: rows in the (padded) global batch.
      device_process_indices: the process index of each replica's device, in replica order
        (a collection of indices for a replica whose devices span several processes).
      process_index: the process asking.

    Returns:
      The row slices of `process_index`, in order; empty if it owns no replica.

    Raises:
      ValueError: if `global_batch_size` does not divide by the number of replicas.

    Example:

    >>> process_row_slices(8, [0, 0, 1, 1], 1)
    (slice(4, 8, None),)
    >>> process_row_slices(8, [0, 1, 0, 1], 0)
    (slice(0, 2, None), slice(4, 6, None))
    """
    rows = replica_row_slices(global_batch_size, len(device_process_indices))
    merged: list[slice] = []
    for owner, sl in zip(device_process_indices, rows, strict=True):
        if process_index not in (owner if isinstance(owner, Collection) else (owner,)):
            continue
        if merged and merged[-1].stop == sl.start:
            merged[-1] = slice(merged[-1].start, sl.stop)
        else:
            merged.append(sl)
    return tuple(merged)


def pad_rows(
    leaves: Sequence[Any], num_rows: int, static_size: int, lead: tuple[int, ...] = ()
) -> tuple[list[Any], np.ndarray]:
    """Pads each leaf's row axis to `static_size` rows of zeros; returns them with a row mask.

    The one pad-and-mask of jstrategy's input: distributed datasets (`process_local_batch`)
    and `jstrategy.Model`'s data adapters use it. Leaves that already have `static_size`
    rows are returned as they are.

    Args:
      leaves: arrays whose axis ``len(lead)`` holds `num_rows` rows.
      num_rows: the real rows.
      static_size: the rows after padding.
      lead: the sizes of the axes before the rows (several batches stacked), if any.

    Returns:
      ``(leaves, mask)``: the padded leaves and a bool array of shape ``lead +
      (static_size,)``, true for real rows.

    Example:

    >>> leaves, mask = pad_rows([np.ones((2, 3))], 3, 4, lead=(2,))
    >>> leaves[0].shape, mask.tolist()
    ((2, 4), [[True, True, True, False], [True, True, True, False]])
    """
    axis = len(lead)
    if num_rows < static_size:
        padded = []
        for x in leaves:
            x = np.asarray(x)
            out = np.zeros((*x.shape[:axis], static_size, *x.shape[axis + 1 :]), x.dtype)
            out[(slice(None),) * axis + (slice(0, num_rows),)] = x
            padded.append(out)
        leaves = padded
    mask = np.arange(static_size) < num_rows
    if lead:
        mask = np.broadcast_to(mask, (*lead, static_size)).copy()
    return list(leaves), mask


def process_local_batch(
    leaves: Sequence[np.ndarray],
    num_rows: int,
    static_size: int,
    row_slices: Sequence[slice] | None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Pads a global batch to `static_size` rows and keeps one process's rows, with a mask.

    The host-side half of placement, separate so it can be tested with any process layout.
    A full batch (``num_rows == static_size``) owned by one contiguous slice is returned
    without copying.

    Args:
      leaves: the batch's arrays, each with `num_rows` leading rows.
      num_rows: the real rows of the batch.
      static_size: the rows every element has after padding.
      row_slices: the rows this process feeds (from `process_row_slices`); None for all.

    Returns:
      ``(local_leaves, local_mask)``: the process's rows of each padded leaf, and a bool
      vector, true for real rows.

    Example:

    >>> leaves, mask = process_local_batch([np.arange(3)], 3, 4, [slice(2, 4)])
    >>> leaves[0].tolist(), mask.tolist()
    ([2, 0], [True, False])
    """
    leaves, mask = pad_rows(leaves, num_rows, static_size)
    if row_slices is None or (
        len(row_slices) == 1 and row_slices[0].start == 0 and row_slices[0].stop == static_size
    ):
        return list(leaves), mask
    if len(row_slices) == 1:
        sl = row_slices[0]
        return [x[sl] for x in leaves], mask[sl]
    return (
        [np.concatenate([np.asarray(x[sl]) for sl in row_slices]) for x in leaves],
        np.concatenate([mask[sl] for sl in row_slices]),
    )


# Batch checking -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Spec:
    """What every batch of a dataset must share with the first: structure, row shapes, dtypes."""

    treedef: Any
    row_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]


def _leaf_paths(treedef: Any) -> list[str]:
    dummy = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    return [
        jax.tree_util.keystr(path) or "<root>"
        for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]
    ]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _flatten_batch(batch: Any, where: str) -> tuple[list[Any], Any, int]:
    """Flattens one batch and checks its leaves; returns (leaves, treedef, rows)."""
    leaves, treedef = jax.tree.flatten(batch)
    if not leaves:
        raise ValueError(
            f"{where} has no arrays (got {_describe(batch)}); expected a pytree (array, "
            "tuple, dict, ...) of NumPy or JAX arrays with a leading batch dimension."
        )
    rows = None
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, (np.ndarray, jax.Array)):
            if isinstance(leaf, (str, bytes, int, float, complex, np.generic)) or not hasattr(
                leaf, "__array__"
            ):
                path = _leaf_paths(treedef)[i]
                raise TypeError(
                    f"{where}: leaf {path} is a {type(leaf).__name__} ({_describe(leaf)}); "
                    "every leaf must be a NumPy or JAX array with a leading batch "
                    "dimension. Convert it with np.asarray, or drop it from the batch."
                )
            leaf = leaves[i] = np.asarray(leaf)
        if leaf.ndim == 0:
            path = _leaf_paths(treedef)[i]
            raise ValueError(
                f"{where}: leaf {path} is a scalar (shape ()); every leaf must have a leading "
                "batch dimension. Give it one (e.g. np.full((batch_size,), value)) or drop it."
            )
        if leaf.dtype == object:
            path = _leaf_paths(treedef)[i]
            raise TypeError(
                f"{where}: leaf {path} has dtype object (a ragged or non-numeric array); "
                "every leaf must be a numeric NumPy or JAX array. Pad variable-length rows "
                "to one length in the input pipeline."
            )
        if rows is None:
            rows = leaf.shape[0]
        elif leaf.shape[0] != rows:
            paths = _leaf_paths(treedef)
            first = leaves[0].shape[0]
            raise ValueError(
                f"{where} is ragged: leaf {paths[i]} has {leaf.shape[0]} rows but leaf "
                f"{paths[0]} has {first}. Every leaf of a batch must have the same leading "
                "(batch) dimension; batch all features and labels together."
            )
    assert rows is not None
    return leaves, treedef, int(rows)


def _spec_of(leaves: Sequence[Any], treedef: Any) -> _Spec:
    return _Spec(
        treedef,
        tuple(tuple(x.shape[1:]) for x in leaves),
        tuple(np.dtype(x.dtype) for x in leaves),
    )


def _check_matches(spec: _Spec, leaves: Sequence[Any], treedef: Any, where: str, first: str):
    if treedef != spec.treedef:
        raise ValueError(
            f"{where} has structure {treedef} but {first} had {spec.treedef}. Every batch must "
            "have the same structure so the compiled step is reused."
        )
    for i, x in enumerate(leaves):
        if x.shape[1:] != spec.row_shapes[i] or x.dtype != spec.dtypes[i]:
            path = _leaf_paths(treedef)[i]
            raise ValueError(
                f"{where}: leaf {path} has rows of shape {tuple(x.shape[1:])} and dtype "
                f"{x.dtype}, but {first} had {spec.row_shapes[i]} and {spec.dtypes[i]}. "
                "Batches may differ only in their number of rows, so the compiled step is "
                "reused; reshape or cast in the input pipeline."
            )


# Placement ----------------------------------------------------------------------------
# The one route from host rows to the mesh: distributed datasets, `distribute_batch`,
# `experimental_distribute_values_from_function`, and `Model`'s array batches and masks
# all go through `put_rows`, and every all-true row mask comes from `full_mask`.
_FULL_MASKS: dict[Any, jax.Array] = {}


def put_rows(
    sharding: jax.sharding.Sharding, local: list[Any], global_shapes: list[tuple]
) -> list[jax.Array]:
    """Lays host rows over the mesh: one batched transfer, no per-device Python copies.

    Args:
      sharding: where the rows go (e.g. `Strategy.batch_sharding()`).
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


def _process_layout(strategy: StrategyLike) -> tuple[list[Any], int, int, int]:
    """(replicas' process indices, this process's pipeline id, pipelines, local replicas).

    A replica's process index is a set when its devices span several processes (a replica
    of an N-D mesh), each of which then feeds its rows.
    """
    groups = replica_devices(strategy.batch_sharding(), strategy.num_replicas_in_sync)
    owner_sets = [sorted({d.process_index for d in group}) for group in groups]
    owners = [o[0] if len(o) == 1 else frozenset(o) for o in owner_sets]
    processes = sorted({p for o in owner_sets for p in o})
    me = jax.process_index()
    if me not in processes:
        raise ValueError(
            f"This process ({me}) owns none of the strategy's devices, so it has no rows to "
            "feed. Build the strategy from devices that include this process's devices."
        )
    local_replicas = sum(me in o for o in owner_sets)
    return owners, processes.index(me), len(processes), local_replicas


class _Placer:
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
        self.spec: _Spec | None = None
        self.static_global = 0  # the static global rows, once known
        self._source_of_size = "global_batch_size"
        self._slices: tuple[slice, ...] | None = None

    # The static size is fixed by the first batch unless given, and then never changes.
    def _set_sizes(self, first_rows: int) -> None:
        if self.global_batch_size is None:
            if self.rows_are_global:
                self.global_batch_size = round_up(first_rows, self.unit)
            else:
                local = round_up(first_rows, self.local_replicas * self.unit // self.num_replicas)
                self.global_batch_size = local * self.pipelines
            self._source_of_size = "the first batch"
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
        self.spec = _spec_of(leaves, treedef)

    def check(self, leaves: list[Any], treedef: Any, rows: int, where: str) -> None:
        if self.spec is None:
            self.init(leaves, treedef, rows, where)
        else:
            _check_matches(self.spec, leaves, treedef, where, "the first batch")

    def place(self, batch: Any, where: str) -> Any:
        leaves, treedef, rows = _flatten_batch(batch, where)
        self.check(leaves, treedef, rows, where)
        if rows > self.static_rows:
            unit = self.unit if self.rows_are_global else self.local_replicas
            kind = "global" if self.rows_are_global else "per-process"
            suggested = round_up(rows, unit) * (1 if self.rows_are_global else self.pipelines)
            raise ValueError(
                f"{where} has {rows} rows, more than the static {kind} batch size "
                f"{self.static_rows} (from {self._source_of_size}, a multiple of {unit} "
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
            if full:
                values = put_rows(sharding, local, shapes)
                mask = full_mask(sharding, (g,), (len(host_mask),))
            else:
                *values, mask = put_rows(sharding, [*local, host_mask], [*shapes, (g,)])
        return jax.tree.unflatten(
            treedef, [PerReplica(v, stacked=False, mask=mask) for v in values]
        )

    def element_spec(self) -> Any:
        assert self.spec is not None
        if self.fetch_to_device:
            sharding = self.strategy.batch_sharding()
            dtypes = [jax.dtypes.canonicalize_dtype(d) for d in self.spec.dtypes]
        else:
            sharding, dtypes = None, list(self.spec.dtypes)
        return jax.tree.unflatten(
            self.spec.treedef,
            [
                jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for shape, dtype in zip(self.static_shapes(), dtypes, strict=True)
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
    placer = _Placer(
        strategy,
        rows_are_global=True,
        global_batch_size=global_batch_size,
        fetch_to_device=True,
        arg="batch",
    )
    return placer.place(batch, "`batch`")


# Sources ------------------------------------------------------------------------------
class _Source:
    """Opens fresh iterators over a user dataset: a re-iterable, a zero-arg callable, tf.data."""

    def __init__(self, dataset: Any, arg: str):
        self.arg = arg
        self.one_shot = False
        self._used = False
        self._peeked: tuple[Any, Iterator[Any]] | None = None
        if isinstance(dataset, (np.ndarray, jax.Array, dict, str, bytes)):
            raise TypeError(
                f"`{arg}` must be an iterable of global batches (a list, a generator function, "
                f"a grain loader, a tf.data.Dataset); got a {type(dataset).__name__}, which "
                "would be iterated row by row or key by key. Wrap a single batch in a list "
                "([batch]) or use distribute_batch."
            )
        as_numpy = getattr(dataset, "as_numpy_iterator", None)
        if callable(as_numpy):
            # tf.data: iterating the dataset itself yields tf.Tensors; NumPy is what we place.
            self._open = as_numpy
        elif isinstance(dataset, Iterable):
            if isinstance(dataset, Iterator):
                self.one_shot = True
            self._open = lambda: iter(dataset)
        elif callable(dataset):
            self._open = lambda: _iter_of(dataset(), arg)
        else:
            raise TypeError(
                f"`{arg}` must be an iterable of global batches or a zero-arg callable "
                f"returning an iterator; got {type(dataset).__name__} {_describe(dataset)}."
            )
        self._dataset = dataset

    @property
    def length(self) -> int | None:
        try:
            return len(self._dataset)
        except TypeError:  # no __len__, or tf.data with unknown or infinite cardinality
            return None

    def open(self) -> Iterator[Any]:
        if self._peeked is not None:
            first, rest = self._peeked
            self._peeked = None
            self._used = True
            return itertools.chain([first], rest)
        if self.one_shot and self._used:
            raise ValueError(
                f"`{self.arg}` is an iterator (e.g. a generator object), which can be iterated "
                "only once, and it has been. Pass a re-iterable (a list, a tf.data.Dataset, a "
                "grain loader) or a zero-arg callable returning a fresh iterator (a generator "
                "function) to iterate again."
            )
        self._used = True
        return iter(self._open())

    def peek(self) -> Any:
        """The first batch, kept so the next `open` still yields it."""
        if self._peeked is None:
            it = self.open()
            try:
                first = next(it)
            except StopIteration:
                raise _empty_error(self.arg) from None
            self._peeked = (first, it)
            self._used = False
        return self._peeked[0]


def _iter_of(obj: Any, arg: str) -> Iterator[Any]:
    if not isinstance(obj, Iterable):
        raise TypeError(
            f"`{arg}` was called as a zero-arg function and returned a "
            f"{type(obj).__name__}; it must return an iterator or iterable of batches (e.g. "
            "be a generator function)."
        )
    return iter(obj)


def _empty_error(arg: str) -> ValueError:
    return ValueError(
        f"`{arg}` yielded no batches; expected at least one global batch (a pytree of "
        "arrays). Check that it is not empty or already consumed; a generator object can be "
        "iterated once only, so pass the generator function instead."
    )


# Datasets -----------------------------------------------------------------------------
class DistributedDataset:
    """A dataset whose elements are global batches laid over a strategy's replicas.

    Made by `Strategy.experimental_distribute_dataset` and
    `Strategy.distribute_datasets_from_function`. Iterate it (again, when its source can be
    iterated again) to get a `DistributedIterator`. Each element is the batch's pytree with
    every leaf a split `PerReplica` of static global shape ``(global_batch_size, ...)``
    sharing one row mask; pass it to `Strategy.run` as is.

    The static global batch size is fixed by the first batch (rounded up to a multiple of
    the replica count) unless given, and kept for every later epoch, so every element of
    every epoch runs the same compiled step.
    """

    def __init__(
        self,
        strategy: StrategyLike,
        sources: list[_Source],
        placer: _Placer,
        options: InputOptions,
        *,
        per_replica: bool = False,
        shared_pipeline: bool = False,
    ):
        self._strategy = strategy
        self._sources = sources
        self._placer = placer
        self._options = options
        # Elements are made of per-replica batches (from one pipeline per replica, or from
        # one pipeline per process whose consecutive batches go to its replicas).
        self._per_replica = per_replica or shared_pipeline
        self._shared_pipeline = shared_pipeline

    @property
    def options(self) -> InputOptions:
        """The `InputOptions` in force."""
        return self._options

    @property
    def one_shot(self) -> bool:
        """Whether the source is an iterator (e.g. a generator object): one pass only."""
        return any(source.one_shot for source in self._sources)

    @property
    def global_batch_size(self) -> int | None:
        """The static rows of every element; None until the first batch has been seen."""
        return self._placer.global_batch_size

    @property
    def element_spec(self) -> Any:
        """The global shape, dtype and sharding of each leaf of every element (the mask aside).

        A pytree shaped like a batch, of `jax.ShapeDtypeStruct` with the padded static shape;
        handy to lower a step ahead of time. Reading it before iterating pulls the first
        batch (kept for the first epoch, so nothing is lost).
        """
        if self._placer.spec is None:
            self._peek_spec()
        return self._placer.element_spec()

    def _peek_spec(self) -> None:
        where = f"`{self._sources[0].arg}` batch 0"
        flat = [_flatten_batch(source.peek(), where) for source in self._sources]
        _init_per_pipeline(self._placer, flat, where, per_replica=self._per_replica)

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self, [source.open() for source in self._sources])

    def __len__(self) -> int:
        length = self._sources[0].length
        if length is None or len(self._sources) > 1:
            raise TypeError(
                "This distributed dataset's source has no len(); iterate it to count batches."
            )
        return length

    def __repr__(self) -> str:
        return (
            f"DistributedDataset(strategy={self._strategy!r}, "
            f"global_batch_size={self.global_batch_size}, options={self._options!r})"
        )


class DistributedIterator:
    """Iterates a `DistributedDataset`, keeping the next batches already on the devices.

    With ``experimental_per_replica_buffer_size=k`` (default 1), whenever it hands out
    batch *t* the transfers of batches *t+1* to *t+k* have already been dispatched: JAX's
    `device_put` is asynchronous, so they move while step *t* runs. An error in the source
    or a bad batch is raised when the iterator reaches it, after the batches before it.
    """

    def __init__(self, dataset: DistributedDataset, iterators: list[Iterator[Any]]):
        self._dataset = dataset
        self._iterators = iterators
        self._buffer: collections.deque[Any] = collections.deque()
        options = dataset.options
        self._ahead = options.experimental_per_replica_buffer_size
        if not options.experimental_fetch_to_device:
            self._ahead = 0  # Host batches gain nothing from being pulled early.
        self._exhausted = False
        self._error: BaseException | None = None
        self._count = 0
        self._finished: list[bool] = [False] * len(iterators)

    @property
    def element_spec(self) -> Any:
        """As `DistributedDataset.element_spec`."""
        return self._dataset.element_spec

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        self._fill()
        if self._buffer:
            return self._buffer.popleft()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        raise StopIteration

    def get_next(self) -> Any:
        """The next element, as TF's `DistributedIterator.get_next`.

        Raises:
          StopIteration: at the end of the dataset.
        """
        return next(self)

    def _fill(self) -> None:
        while not self._exhausted and len(self._buffer) <= self._ahead:
            try:
                element = self._produce()
            except Exception as error:
                self._exhausted = True
                self._error = error
                return
            if element is None:
                self._exhausted = True
                if self._count == 0:
                    self._error = _empty_error(self._dataset._sources[0].arg)
                return
            self._count += 1
            self._buffer.append(element)

    def _produce(self) -> Any:
        dataset = self._dataset
        placer = dataset._placer
        arg = dataset._sources[0].arg
        where = f"`{arg}` batch {self._count}"
        if not dataset._per_replica:
            try:
                batch = next(self._iterators[0])
            except StopIteration:
                return None
            return placer.place(batch, where)
        return _place_per_replica(self, placer, where)


def _init_per_pipeline(
    placer: _Placer, flat: list[tuple[list[Any], Any, int]], where: str, *, per_replica: bool
) -> None:
    """Fixes the static sizes from the first batch of each pipeline (the largest wins)."""
    leaves, treedef, rows = flat[0]
    if per_replica:
        # Every replica gets the same static rows: the largest first batch, on each replica.
        biggest = max(item[2] for item in flat)
        placer.init(leaves, treedef, biggest * placer.local_replicas, where)
    else:
        placer.init(leaves, treedef, rows, where)


def _next_or_none(iterator: DistributedIterator, pipeline: int) -> Any:
    """The next batch of one pipeline, or None once it has ended."""
    if iterator._finished[pipeline]:
        return None
    try:
        return next(iterator._iterators[pipeline])
    except StopIteration:
        iterator._finished[pipeline] = True
        return None


def _place_per_replica(iterator: DistributedIterator, placer: _Placer, where: str) -> Any:
    """One element made of one per-replica batch for each local replica.

    With one pipeline per replica (`InputReplicationMode.PER_REPLICA`) each replica takes
    the next batch of its own pipeline; with one pipeline per process (``PER_WORKER``) the
    replicas take its next consecutive batches, in replica order, as in TF. A pipeline that
    ends before the others (or mid-step) gives empty (all-padding) batches until every
    pipeline has ended, so uneven pipelines still step in lockstep.
    """
    batches: list[Any] = []
    if iterator._dataset._shared_pipeline:
        # TF's per-worker pipeline: its consecutive elements go to this process's replicas.
        for _ in range(placer.local_replicas):
            batches.append(_next_or_none(iterator, 0))
    else:
        for r in range(len(iterator._iterators)):
            batches.append(_next_or_none(iterator, r))
    if all(b is None for b in batches):
        return None
    flat: list[tuple[list[Any], Any, int] | None] = [
        None if batch is None else _flatten_batch(batch, f"{where} of pipeline {r}")
        for r, batch in enumerate(batches)
    ]
    if placer.spec is None:
        _init_per_pipeline(placer, [f for f in flat if f is not None], where, per_replica=True)
    per = placer.static_rows // placer.local_replicas
    for r, item in enumerate(flat):
        if item is None:
            continue
        leaves, treedef, rows = item
        here = f"{where} of pipeline {r}"
        placer.check(leaves, treedef, rows, here)
        if rows > per:
            raise ValueError(
                f"{here} has {rows} rows, more than the static per-replica batch size {per} "
                f"(from {placer._source_of_size}). Make the first batch the largest, or pass "
                f"global_batch_size={rows * placer.num_replicas}."
            )
    spec = placer.spec
    assert spec is not None
    per = placer.static_rows // placer.local_replicas
    pieces: list[list[np.ndarray]] = []  # one list of padded leaves per replica
    masks = []
    for item in flat:
        if item is None:
            leaves = [
                np.zeros((0, *s), d) for s, d in zip(spec.row_shapes, spec.dtypes, strict=True)
            ]
            rows = 0
        else:
            leaves, _, rows = item
            leaves = [np.asarray(x) for x in leaves]
        padded, replica_mask = process_local_batch(leaves, rows, per, None)
        pieces.append(padded)
        masks.append(replica_mask)
    shapes = placer.static_shapes()
    values: list[Any]
    mask: Any
    if (
        not placer.fetch_to_device
        and not iterator._dataset.options.experimental_place_dataset_on_device
    ):
        mask = np.concatenate(masks)
        mask.flags.writeable = False
        values = [np.concatenate(per_leaf) for per_leaf in zip(*pieces, strict=True)]
    else:
        # This process's rows are its replicas' batches, in replica order.
        columns = [*zip(*pieces, strict=True), masks]
        local = [np.concatenate(column) for column in columns]
        sharding = placer.strategy.batch_sharding()
        *values, mask = put_rows(sharding, local, [*shapes, (placer.static_global,)])
    return jax.tree.unflatten(
        spec.treedef, [PerReplica(v, stacked=False, mask=mask) for v in values]
    )


# Entry points -------------------------------------------------------------------------
def _options(options: InputOptions | None) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"`options` must be a jstrategy.InputOptions or None; got "
            f"{type(options).__name__} {_describe(options)}."
        )
    return options


def distribute_dataset(
    strategy: StrategyLike,
    dataset: Any,
    options: InputOptions | None = None,
    *,
    global_batch_size: int | None = None,
) -> DistributedDataset:
    """Distributes an iterable of global batches over `strategy`'s replicas.

    Implements `Strategy.experimental_distribute_dataset`. Replica *i* gets the *i*-th
    contiguous slice of every global batch. A batch with fewer rows than the static size
    (the first batch's rows rounded up to a multiple of the replica count, or
    `global_batch_size`) is zero-padded, and its mask marks the real rows. With several
    processes, every process iterates the same global batches and places only its rows.

    Args:
      strategy: the strategy whose replicas consume the batches.
      dataset: the global batches (pytrees of NumPy or JAX arrays): a list or other
        re-iterable, a zero-arg callable returning an iterator (a generator function), a
        one-shot iterator (iterated once only), a grain loader, or a `tf.data.Dataset`
        (read through `as_numpy_iterator()`).
      options: an `InputOptions`; None for the defaults (fetch to device, buffer of 1).
      global_batch_size: the static rows of every element, a multiple of the replica
        count; None: from the first batch.

    Returns:
      A `DistributedDataset`.

    Raises:
      TypeError: if `dataset` is not iterable or `options` is not an `InputOptions`.
      ValueError: for `InputReplicationMode.PER_REPLICA` (only
        `distribute_datasets_from_function` supports it) or a bad `global_batch_size`.
      Batches are checked as they are read: a ragged batch, a non-array leaf, a batch
      unlike the first, a batch over the static size, or an empty dataset raise then.

    Example:

    >>> import numpy as np
    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> batches = [np.ones((4, 3), np.float32), np.ones((1, 3), np.float32)]
    >>> dist = strategy.experimental_distribute_dataset(batches)
    >>> [(int(x.value.shape[0]), int(x.mask.sum())) for x in dist]
    [(4, 4), (4, 1)]
    """
    options = _options(options)
    if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
        raise ValueError(
            "InputReplicationMode.PER_REPLICA is only supported by "
            "distribute_datasets_from_function (as in TF); use PER_WORKER with "
            "experimental_distribute_dataset."
        )
    source = _Source(dataset, "dataset")
    placer = _Placer(
        strategy,
        rows_are_global=True,
        global_batch_size=global_batch_size,
        fetch_to_device=options.experimental_fetch_to_device,
        arg="dataset",
    )
    return DistributedDataset(strategy, [source], placer, options)


def distribute_datasets_from_function(
    strategy: StrategyLike,
    dataset_fn: Callable[[InputContext], Any],
    options: InputOptions | None = None,
    *,
    global_batch_size: int | None = None,
) -> DistributedDataset:
    """Builds the input pipelines with `dataset_fn(InputContext)` and distributes them.

    Implements `Strategy.distribute_datasets_from_function`. `dataset_fn` is called once per
    input pipeline, now:

    * ``PER_WORKER`` (default): once per process, with ``input_pipeline_id`` the process's
      index. As in TF, each element it yields is ONE REPLICA's batch
      (``ctx.get_per_replica_batch_size(global_batch_size)`` rows): every step takes the
      pipeline's next ``num_replicas_in_sync // num_input_pipelines`` elements, one for
      each of the process's replicas in replica order, so a step trains on
      ``per_replica_batch * num_replicas_in_sync`` rows.
    * ``PER_REPLICA``: once per local replica, with ``input_pipeline_id`` the replica id;
      each element is that replica's batch
      (``ctx.get_per_replica_batch_size(global_batch_size)`` rows).

    Shard the data by ``input_pipeline_id`` inside `dataset_fn`; batches are padded and
    masked as in `distribute_dataset`.

    Args:
      strategy: the strategy whose replicas consume the batches.
      dataset_fn: called with an `InputContext`; returns a dataset in any form
        `distribute_dataset` accepts.
      options: an `InputOptions`; None for the defaults.
      global_batch_size: the static global rows of every element (per-replica batch
        times `num_replicas_in_sync`); None: the first per-replica batch's rows times
        `num_replicas_in_sync`.

    Returns:
      A `DistributedDataset`.

    Raises:
      TypeError: if `dataset_fn` is not callable or returns something not iterable.
      ValueError: for a bad `global_batch_size`.

    Example:

    >>> import numpy as np
    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> def dataset_fn(ctx):
    ...     per_replica = ctx.get_per_replica_batch_size(4)  # 2 rows for each replica
    ...     return [np.full((per_replica, 1), i, np.float32) for i in range(4)]
    >>> dist = strategy.distribute_datasets_from_function(dataset_fn)
    >>> [np.asarray(element.value)[:, 0].tolist() for element in dist]
    [[0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 3.0, 3.0]]
    """
    if not callable(dataset_fn):
        raise TypeError(
            f"`dataset_fn` must be callable with an InputContext; got "
            f"{type(dataset_fn).__name__} {_describe(dataset_fn)}."
        )
    options = _options(options)
    per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    n = strategy.num_replicas_in_sync
    placer = _Placer(
        strategy,
        rows_are_global=False,
        global_batch_size=global_batch_size,
        fetch_to_device=options.experimental_fetch_to_device,
        arg="dataset_fn",
    )
    if per_replica:
        local = local_replica_devices(strategy.batch_sharding(), n)
        contexts = [InputContext(n, i, n) for i, _ in local]
    else:
        contexts = [InputContext(placer.pipelines, placer.pipeline_id, n)]
    sources = []
    for ctx in contexts:
        dataset = dataset_fn(ctx)
        if dataset is None:
            raise TypeError(
                f"`dataset_fn` returned None for {ctx}; it must return a dataset (an "
                "iterable of batches, a generator function, a tf.data.Dataset, ...)."
            )
        sources.append(_Source(dataset, "dataset_fn"))
    return DistributedDataset(
        strategy, sources, placer, options, per_replica=per_replica, shared_pipeline=not per_replica
    )
