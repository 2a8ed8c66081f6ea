"""Distributed datasets: global batches laid over the mesh, padded to one static shape,
prefetched; the entry points of `jstrategy/_src/input/`.

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

The package, one job a file: `options.py` (`InputOptions`, `InputReplicationMode`,
`InputContext`), `rows.py` (which rows each replica and process owns, and the one
pad-and-mask), `checks.py` (what every batch must share with the first), `placement.py`
(`put_rows`, the one route from host rows to the mesh, and the `Placer` of one dataset),
`sources.py` (what a user's dataset is read through), `per_replica.py` (elements made of
per-replica batches) and this module.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any

from jstrategy._src.input.checks import flatten_batch
from jstrategy._src.input.options import InputContext
from jstrategy._src.input.options import InputOptions
from jstrategy._src.input.options import InputReplicationMode
from jstrategy._src.input.options import resolve_options
from jstrategy._src.input.per_replica import init_per_pipeline
from jstrategy._src.input.per_replica import place_per_replica
from jstrategy._src.input.placement import Placer
from jstrategy._src.input.sources import Source
from jstrategy._src.input.sources import empty_error
from jstrategy._src.validation import short_repr
from jstrategy._src.values import local_replica_devices

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "distribute_dataset",
    "distribute_datasets_from_function",
]


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
        sources: list[Source],
        placer: Placer,
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
        flat = [flatten_batch(source.peek(), where) for source in self._sources]
        init_per_pipeline(self._placer, flat, where, per_replica=self._per_replica)

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
                    self._error = empty_error(self._dataset._sources[0].arg)
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
        if dataset._shared_pipeline:
            # TF's per-worker pipeline: its consecutive elements go to this process's replicas.
            batches = [self._next_of(0) for _ in range(placer.local_replicas)]
        else:
            batches = [self._next_of(r) for r in range(len(self._iterators))]
        if all(b is None for b in batches):
            return None
        on_host = not (
            placer.fetch_to_device or dataset.options.experimental_place_dataset_on_device
        )
        return place_per_replica(placer, batches, where, on_host=on_host)

    def _next_of(self, pipeline: int) -> Any:
        """The next batch of one pipeline, or None once it has ended."""
        if self._finished[pipeline]:
            return None
        try:
            return next(self._iterators[pipeline])
        except StopIteration:
            self._finished[pipeline] = True
            return None


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
    options = resolve_options(options)
    if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
        raise ValueError(
            "InputReplicationMode.PER_REPLICA is only supported by "
            "distribute_datasets_from_function (as in TF); use PER_WORKER with "
            "experimental_distribute_dataset."
        )
    source = Source(dataset, "dataset")
    placer = Placer(
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
            f"{type(dataset_fn).__name__} {short_repr(dataset_fn)}."
        )
    options = resolve_options(options)
    per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    n = strategy.num_replicas_in_sync
    placer = Placer(
        strategy,
        rows_are_global=False,
        global_batch_size=global_batch_size,
        fetch_to_device=options.experimental_fetch_to_device,
        arg="dataset_fn",
    )
    if per_replica:
        local = local_replica_devices(strategy.per_replica_sharding(), n)
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
        sources.append(Source(dataset, "dataset_fn"))
    return DistributedDataset(
        strategy, sources, placer, options, per_replica=per_replica, shared_pipeline=not per_replica
    )
