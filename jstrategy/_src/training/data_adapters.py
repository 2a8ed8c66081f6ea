"""Data adapters: what `jstrategy.Model` trains, evaluates and predicts on, cut into steps.

As Keras 3's data adapters, they separate the data from the trainer loop. An adapter turns
its input into *executions*: one or more steps' batches laid out on the strategy's devices,
padded to one static shape with a row mask (by `input/rows.py`'s `pad_rows`, the one
pad-and-mask of jstrategy's input), ahead of use.

* `ArrayAdapter`: in-memory arrays, shuffled each epoch by a seed, cut into global batches;
  ``steps_per_execution`` full batches are stacked into one execution.
* `DatasetAdapter`: an iterable of batches or a distributed dataset, one epoch per pass
  (or ``steps_per_epoch`` batches from one persistent iterator).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src.context_parallel.axis import batch_shardings
from jstrategy._src.input.datasets import DistributedDataset
from jstrategy._src.input.placement import full_mask
from jstrategy._src.input.placement import put_rows
from jstrategy._src.input.rows import pad_rows
from jstrategy._src.numerics import row_count
from jstrategy._src.numerics import static_rows
from jstrategy._src.training import input_checks
from jstrategy._src.validation import check_positive_int
from jstrategy._src.validation import is_int
from jstrategy._src.validation import is_number
from jstrategy._src.values import PerReplica
from jstrategy._src.values import is_per_replica

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "ArrayAdapter",
    "DataAdapter",
    "DatasetAdapter",
    "Execution",
    "is_array",
    "is_array_tree",
    "as_arrays",
    "make_adapter",
    "ones_mask",
    "prefetch",
    "split_batch",
    "split_validation",
    "unpack_batch",
    "validation_inputs",
]

PREFETCH = 2  # executions whose batches are on the devices before they run


@dataclasses.dataclass
class Execution:
    """One dispatch of the training program.

    Attributes:
      steps: the training steps it runs.
      key: the program that runs it: ``(steps per call, or 0 for one, stacked)``.
      batch: ``(x, y, sample_weight)`` of global arrays (stacked, or a tuple of batches).
      mask: the row mask(s).
    """

    steps: int
    key: tuple[int, bool]
    batch: Any
    mask: Any


def ones_mask(rows: int, sharding: NamedSharding, lead: tuple[int, ...] = ()) -> jax.Array:
    """A cached all-true row mask (a full batch has no padding): `input/placement.py`'s
    `full_mask`."""
    return full_mask(sharding, (*lead, rows))


def prefetch(iterator: Iterator[Any], depth: int = PREFETCH) -> Iterator[Any]:
    """Keeps `depth` items (batches already dispatched to the devices) ahead of the consumer."""
    buffer: collections.deque[Any] = collections.deque()
    for item in iterator:
        buffer.append(item)
        if len(buffer) > depth:
            yield buffer.popleft()
    while buffer:
        yield buffer.popleft()


def is_array(x: Any) -> bool:
    """Whether `x` is one array (NumPy, JAX or array-like)."""
    return isinstance(x, (np.ndarray, jax.Array)) or (
        hasattr(x, "__array__") and hasattr(x, "shape") and hasattr(x, "dtype")
    )


def is_array_tree(x: Any) -> bool:
    """Whether `x` is an array or a dict/tuple of arrays (rather than a dataset)."""
    if x is None:
        return False
    if isinstance(x, (dict, tuple)) and not hasattr(x, "_fields"):
        leaves = jax.tree.leaves(x)
        return bool(leaves) and all(is_array(leaf) for leaf in leaves)
    return is_array(x)


def _numbers_only(value: Any) -> bool:
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return bool(value) and all(_numbers_only(v) for v in value)
    return isinstance(value, (int, float, np.number, np.bool_))  # a bool is an int


def as_arrays(value: Any) -> Any:
    """A list (or tuple) of numbers, nested to any depth, as one NumPy array, as tf.keras
    converted one (``y=[0, 1, 1]``, ``x=[[0.1, 0.2], ...]``); anything else as it is.

    A list whose elements are arrays stays a list (targets of several outputs, or a list
    of batches). Keras 3 refuses lists of numbers ("Unrecognized data type").

    Example:

    >>> as_arrays([[1, 2], [3, 4]]).shape, as_arrays(np.ones(2)).shape
    ((2, 2), (2,))
    """
    if not _numbers_only(value) or not isinstance(value, (list, tuple)):
        return value
    array = np.asarray(value)
    return value if array.dtype == object else array


# Batches: what a step takes ---------------------------------------------------------
def unpack_batch(batch: Any) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` from a Keras-style batch ``(x,)``, ``(x, y)`` or ``(x, y, w)``."""
    if isinstance(batch, (tuple, list)):
        if 1 <= len(batch) <= 3:
            padded = (*batch, None, None)
            return padded[0], padded[1], padded[2]
        raise ValueError(
            f"A batch must be (x,), (x, y) or (x, y, sample_weight); got a "
            f"{type(batch).__name__} of length {len(batch)}. Group several inputs into one "
            "pytree x, e.g. a dict."
        )
    return batch, None, None


def split_batch(batch: Any, strategy: Strategy) -> tuple[Any, Any]:
    """The global arrays of a (possibly distributed) batch, and its row mask (or None)."""
    mask = None
    leaves, treedef = jax.tree.flatten(batch, is_leaf=is_per_replica)
    values = []
    for leaf in leaves:
        if isinstance(leaf, PerReplica):
            if leaf.stacked:
                raise ValueError(
                    "A step takes batches split by rows (from a distributed dataset or "
                    "distribute_batch); got a stacked PerReplica (one value per replica, as "
                    "Strategy.run returns)."
                )
            if mask is None:
                mask = leaf.mask
            values.append(leaf.value)
        else:
            values.append(leaf)
    rows = row_count(values, "batch")
    n = strategy.num_replicas_in_sync
    if rows % n:
        raise ValueError(
            f"The global batch has {rows} rows, which does not divide among {n} replicas. "
            "Distribute it with jstrategy's distribute_batch or a distributed dataset, "
            "which pad it and set the row mask."
        )
    return jax.tree.unflatten(treedef, values), mask


class ArrayAdapter:
    """In-memory arrays cut into shuffled global batches, padded to one static size."""

    def __init__(
        self,
        strategy: Strategy,
        x: Any,
        y: Any,
        w: Any,
        *,
        batch_size: int,
        shuffle: bool,
        seed: int,
        steps: int | None = None,
        bucket_batch: bool = False,
    ):
        self.strategy = strategy
        self.data = jax.tree.map(np.asarray, (x, y, w))
        rows = row_count(self.data, "x, y and sample_weight")
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        # The static global batch: batch_size rows rounded up to divide among replicas (and
        # a pipeline's microbatches: `Strategy.batch_multiple`), or
        # for data smaller than a batch a power of two, so row counts share programs; with
        # `bucket_batch` (evaluate, predict) batch sizes share them too (`numerics.bucket`).
        self.static_rows = static_rows(
            rows, batch_size, strategy.batch_multiple, bucket_batch=bucket_batch
        )
        # `steps` (evaluate/predict's, fit's steps_per_epoch) takes the first batches, as Keras.
        self.steps: int | None = min(math.ceil(rows / batch_size), steps or rows)
        self.limit: int | None = None  # `fit`'s steps_per_epoch cuts epochs short instead
        self.exhausted = False
        self.taken = 0
        self._single = strategy.batch_sharding()
        self._stacked = NamedSharding(strategy.mesh, P(None, *self._single.spec))

    def first_x(self) -> Any:
        """The inputs, to build a model from."""
        return self.data[0]

    def epoch_steps(self, steps_per_epoch: int | None) -> int | None:
        """The steps of an epoch of `fit` given its ``steps_per_epoch``."""
        assert self.steps is not None
        return self.steps if steps_per_epoch is None else min(steps_per_epoch, self.steps)

    def _place(
        self, index: np.ndarray, lead: tuple[int, ...], *, masked: bool = True, train: bool = False
    ) -> tuple[Any, Any]:
        """Rows `index` (shape lead + (k,), k <= static rows), padded, on the devices, and
        their row mask (None for a full batch when not `masked`). A `train` batch has the
        arrays carrying a sequence split along it over a context axis, if the strategy has
        one (`context_parallel.axis.batch_shardings`); evaluation reads whole sequences."""
        k = index.shape[-1]
        leaves, treedef = jax.tree.flatten(self.data)
        flat = index.reshape(-1)
        gathered = [a[flat].reshape(*lead, k, *a.shape[1:]) for a in leaves]
        sharding = self._stacked if lead else self._single
        each: list[Any] = [sharding] * len(gathered)
        if train:
            each = jax.tree.leaves(
                batch_shardings(self.strategy, jax.tree.unflatten(treedef, gathered), sharding)
            )
        # Every process holds the whole arrays, so each leaf's shape is its global shape.
        if k == self.static_rows:
            placed = put_rows(each, gathered, [a.shape for a in gathered])
            mask = ones_mask(k, sharding, lead) if masked else None
            return jax.tree.unflatten(treedef, placed), mask
        padded, host_mask = pad_rows(gathered, k, self.static_rows, lead)
        host = [*padded, host_mask]
        *placed, mask = put_rows([*each, sharding], host, [a.shape for a in host])
        return jax.tree.unflatten(treedef, placed), mask

    def seek(self, position: int) -> None:
        """Nothing to do: an epoch's batches are cut anew from its seed (`order`)."""
        del position

    def order(self, epoch_seed: Any) -> np.ndarray:
        """The epoch's row order: a function of `epoch_seed` only, so a backup can redo it."""
        if not self.shuffle:
            return np.arange(self.rows)
        return np.random.default_rng(epoch_seed).permutation(self.rows)

    def train_executions(
        self, epoch_seed: Any, steps_per_execution: int, limit: int | None, skip: int = 0
    ) -> Iterator[Execution]:
        """The epoch's executions, after its first `skip` steps (done before a resume)."""
        order = self.order(epoch_seed)
        steps = self.epoch_steps(limit)
        assert steps is not None
        bs = self.batch_size
        full = min(steps, self.rows // bs)  # batches with batch_size real rows
        # Backups are taken between executions, so `skip` is where one ended: starting
        # there, the executions are the ones the uninterrupted epoch runs.
        # An epoch of full batches only runs the programs without a row mask (cheaper: no
        # count of real rows to reduce); one with a padded batch passes every batch's mask,
        # so that all its batches share one program.
        masked = full < steps or self.static_rows != bs
        step = skip
        n = steps_per_execution
        while step + n <= full and n > 1:
            index = order[step * bs : (step + n) * bs].reshape(n, bs)
            batch, mask = self._place(index, (n,), masked=masked, train=True)
            yield Execution(n, (n, True), batch, mask)
            step += n
        while step < steps:
            index = order[step * bs : (step + 1) * bs]
            batch, mask = self._place(index, (), masked=masked, train=True)
            yield Execution(1, (0, True), batch, mask)
            step += 1

    def batches(self) -> Iterator[tuple[Any, Any, int | None]]:
        """In order, unshuffled: (batch, mask, real rows) for evaluation and prediction."""
        bs = self.batch_size
        assert self.steps is not None
        for start in range(0, min(self.rows, self.steps * bs), bs):
            index = np.arange(start, min(start + bs, self.rows))
            batch, mask = self._place(index, ())
            yield batch, mask, len(index)


class DatasetAdapter:
    """An iterable of batches (host or already distributed), one epoch per pass."""

    def __init__(self, strategy: Strategy, dataset: Any, *, steps: int | None, arg: str):
        self.strategy = strategy
        self._passes = 0
        if isinstance(dataset, DistributedDataset):
            self.dataset = dataset
        else:
            # The one rule of what a dataset may be: experimental_distribute_dataset's.
            self.dataset = strategy.experimental_distribute_dataset(dataset)
        # A one-shot iterator (e.g. a generator object) gives one pass; later epochs get
        # nothing. A generator function gives a fresh pass each epoch.
        self.one_shot = self.dataset.one_shot
        self.limit = steps
        self.arg = arg
        self._iterator: Iterator[Any] | None = None
        self.steps: int | None
        try:
            self.steps = len(self.dataset) if steps is None else steps
        except TypeError:
            self.steps = steps
        self.exhausted = False
        # Elements drawn from the persistent iterator (with `steps`), across restarts.
        self.taken = 0

    def first_x(self) -> Any:
        """Zeros shaped like one element's inputs, to build a model from."""
        spec = unpack_batch(self.dataset.element_spec)[0]
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)

    def epoch_steps(self, steps_per_epoch: int | None) -> int | None:
        """The steps of an epoch of `fit`, if known."""
        del steps_per_epoch  # the adapter already knows its limit
        return self.steps

    def seek(self, position: int) -> None:
        """Draws and drops elements until `position` were drawn: a new process resumes the
        persistent iterator where a backup says the previous one was (the source must give
        the same elements in the same order)."""
        while self.taken < position:
            if self._next() is None:
                return

    def _elements(self, skip: int = 0) -> Iterator[tuple[Any, Any]]:
        """One epoch's elements: all of them, or `limit` from a persistent iterator.

        `skip` elements of the epoch were consumed before a resume: of a full pass they are
        drawn again and dropped; a persistent iterator was moved past them by `seek`.
        """
        if self.limit is None:
            if self.one_shot and self._passes:
                return
            self._passes += 1
            for element in itertools.islice(self.dataset, skip, None):
                yield split_batch(element, self.strategy)
            return
        for _ in range(self.limit - skip):
            element = self._next()
            if element is None:
                return
            yield split_batch(element, self.strategy)

    def _next(self) -> Any:
        element = self._draw()
        if element is not None:
            self.taken += 1
        return element

    def _draw(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.dataset)
        try:
            return next(self._iterator)
        except StopIteration:
            pass
        if self.one_shot:
            self.exhausted = True
            return None
        # Like a repeated tf.data dataset: start over when the source can be iterated again.
        self._iterator = iter(self.dataset)
        try:
            return next(self._iterator)
        except StopIteration:
            self.exhausted = True
            return None

    def _with_mask(self, values: Any, mask: Any) -> tuple[Any, Any]:
        batch = unpack_batch(values)
        if mask is None:
            rows = row_count(batch[0], "x")
            mask = ones_mask(rows, self.strategy.batch_sharding())
        return batch, mask

    def train_executions(
        self, epoch_seed: Any, steps_per_execution: int, limit: int | None, skip: int = 0
    ) -> Iterator[Execution]:
        """The epoch's executions; see `ArrayAdapter.train_executions`."""
        del epoch_seed, limit  # the dataset decides its order and length
        group: list[tuple[Any, Any]] = []
        n = steps_per_execution
        for values, mask in self._elements(skip):
            batch, mask = self._with_mask(values, mask)
            if n == 1:
                yield Execution(1, (0, True), batch, mask)
                continue
            if group and _layout(group[0]) != _layout((batch, mask)):
                yield from _singles(group)
                group = []
            group.append((batch, mask))
            if len(group) == n:
                batches, masks = zip(*group, strict=True)
                yield Execution(n, (n, False), tuple(batches), tuple(masks))
                group = []
        yield from _singles(group)

    def batches(self) -> Iterator[tuple[Any, Any, int | None]]:
        """(batch, mask, None) for evaluation and prediction: the mask drops padding."""
        for values, mask in self._elements():
            batch, mask = self._with_mask(values, mask)
            yield batch, mask, None


class DataAdapter(Protocol):
    """What the fit loop, `evaluate` and `predict` use of an adapter.

    Attributes:
      steps: the batches of one pass, if known.
      limit: for `fit` on a dataset with ``steps_per_epoch``, the batches drawn per epoch
        from one persistent iterator; else None.
      taken: the elements drawn from that iterator so far.
      exhausted: whether the data ran out for good (a one-shot iterator).
    """

    steps: int | None
    limit: int | None
    taken: int
    exhausted: bool

    def first_x(self) -> Any: ...

    def epoch_steps(self, steps_per_epoch: int | None) -> int | None: ...

    def seek(self, position: int) -> None: ...

    def train_executions(
        self, epoch_seed: Any, steps_per_execution: int, limit: int | None, skip: int = 0
    ) -> Iterator[Execution]: ...

    def batches(self) -> Iterator[tuple[Any, Any, int | None]]: ...


def _singles(group: list[tuple[Any, Any]]) -> Iterator[Execution]:
    for batch, mask in group:
        yield Execution(1, (0, True), batch, mask)


def _layout(tree: Any) -> tuple[str, list[Any]]:
    """What must match for batches to be stacked into one execution."""
    leaves, treedef = jax.tree.flatten(tree)
    return str(treedef), [(np.shape(x), getattr(x, "dtype", type(x))) for x in leaves]


def split_validation(
    x: Any, y: Any, w: Any, validation_split: Any, validation_data: Any
) -> tuple[Any, Any, Any, Any]:
    """`fit`'s ``validation_split``: the last fraction of the array rows, before shuffling.

    Cut where Keras 3 cuts (``train_validation_split``): training keeps the first
    ``floor(rows * (1 - validation_split))`` rows, validation the rest (10 rows at 0.25:
    7 and 3).

    Returns:
      ``(x, y, sample_weight, validation_data)``: the training part and the held-out one
      (the arguments as they are without a split, or with `validation_data` given).

    Raises:
      ValueError: for a fraction outside [0, 1), a dataset, or an empty part.
    """
    if not 0.0 <= float(validation_split) < 1.0:
        raise ValueError(
            f"`validation_split` must be in [0, 1); got {validation_split!r}. E.g. 0.2 "
            "holds out the last 20% of the rows."
        )
    if validation_split and not is_array_tree(x):
        raise ValueError(
            f"`validation_split` needs array inputs; got validation_split={validation_split} "
            f"with x of type {type(x).__name__}. For a dataset pass validation_data instead."
        )
    if not validation_split or validation_data is not None:
        return x, y, w, validation_data
    rows = row_count((x, y), "x and y")
    split = math.floor(rows * (1.0 - float(validation_split)))
    if split in (0, rows):
        raise ValueError(
            f"validation_split={validation_split} leaves an empty part of {rows} rows."
        )

    def cut(tree: Any, part: slice) -> Any:
        return None if tree is None else jax.tree.map(lambda a: a[part], tree)

    train, held_out = slice(0, split), slice(split, None)
    validation: tuple[Any, ...] = (cut(x, held_out), cut(y, held_out))
    if w is not None:
        validation += (cut(w, held_out),)
    return cut(x, train), cut(y, train), cut(w, train), validation


def class_weight_to_sample_weight(x: Any, y: Any, w: Any, class_weight: Any) -> np.ndarray:
    """`fit`'s ``class_weight`` as per-row weights: Keras's rule, on the host.

    Each row weighs ``class_weight.get(label, 1.0)``, its label being `y` itself for
    ``(n,)`` or ``(n, 1)`` labels and the argmax of one-hot ``(n, classes)`` labels,
    rounded to an int (Keras's ``class_weight_to_sample_weights``).

    Raises:
      ValueError: for a `class_weight` that is not ``{int: number}``, with `sample_weight`
        also given, a dataset, or labels that are not one array.

    Example:

    >>> y = np.array([0, 1, 1, 2])
    >>> class_weight_to_sample_weight(np.ones((4, 1)), y, None, {1: 3.0}).tolist()
    [1.0, 3.0, 3.0, 1.0]
    """
    ok = isinstance(class_weight, dict) and all(is_int(k) for k in class_weight)
    if ok:
        ok = all(is_number(v) for v in class_weight.values())
    if not ok:
        raise ValueError(
            f"`class_weight` must be a dict from class index (int) to weight (number); got "
            f"{class_weight!r}. E.g. class_weight={{0: 1.0, 1: 5.0}}."
        )
    if not is_array_tree(x):
        raise ValueError(
            f"`class_weight` needs array inputs (x and y); got x of type {type(x).__name__}. "
            "For a dataset, yield (x, y, sample_weight) batches with the weights you want."
        )
    if w is not None:
        raise ValueError(
            "`class_weight` and `sample_weight` cannot both be given (Keras refuses them "
            "together too). Multiply the class weights into sample_weight yourself, or pass "
            "one of them."
        )
    if not is_array(y):
        raise ValueError(
            f"`class_weight` needs `y` to be one array of labels; got {type(y).__name__}. "
            "It is supported for models with a single output."
        )
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = labels.argmax(axis=-1) if labels.shape[-1] != 1 else labels.squeeze(-1)
    labels = np.round(labels).astype(np.int32).reshape(labels.shape[0], -1)[:, 0]
    table = {int(k): float(v) for k, v in class_weight.items()}
    return np.array([table.get(int(c), 1.0) for c in labels], np.float32)


def validation_inputs(validation_data: Any, batch_size: Any) -> tuple[Any, Any, Any, Any]:
    """``(x, y, sample_weight, batch_size)`` of `fit`'s ``validation_data``: arrays
    ``(x, y[, w])`` batched like the training data, or a dataset as it is.

    Raises:
      ValueError: for a tuple of arrays that is not ``(x, y)`` or ``(x, y, w)``.
    """
    if isinstance(validation_data, tuple):
        validation_data = tuple(as_arrays(part) for part in validation_data)
    if isinstance(validation_data, tuple) and validation_data and is_array_tree(validation_data[0]):
        if not 2 <= len(validation_data) <= 3:
            raise ValueError(
                "`validation_data` must be (x_val, y_val) or (x_val, y_val, "
                "sample_weight_val) arrays, or a dataset; got a tuple of "
                f"{len(validation_data)} arrays."
            )
        vx, vy, *vw = validation_data
        return vx, vy, vw[0] if vw else None, batch_size
    return validation_data, None, None, None


def _check_batch_size(batch_size: Any) -> int:
    if batch_size is None:
        return 32
    return check_positive_int(batch_size, "batch_size", "E.g. 32.")


def make_adapter(
    strategy: Strategy,
    x: Any,
    y: Any,
    w: Any,
    *,
    batch_size: Any,
    shuffle: bool,
    steps: Any,
    arg: str,
    seed: int,
    bucket_batch: bool = False,
) -> DataAdapter:
    """The adapter for `fit`/`evaluate`/`predict`'s inputs (`arg` names `x` in errors).

    `bucket_batch` (evaluation and prediction) pads array batches to a bucket of sizes
    (`numerics.static_rows`), so that many batch sizes share a few compiled programs.

    Raises:
      ValueError: for a bad `batch_size` or `steps`, empty or inconsistent arrays, or `y`,
        `sample_weight` or `batch_size` given with a dataset.
      TypeError: for inputs that are neither arrays nor an iterable of batches.
    """
    x, y, w = as_arrays(x), as_arrays(y), as_arrays(w)
    if steps is not None:
        steps = check_positive_int(steps, "steps", "Pass None for all the batches.")
    if is_array_tree(x):
        input_checks.array_rows(x, y, w, arg=arg)
        return ArrayAdapter(
            strategy,
            x,
            y,
            w,
            batch_size=_check_batch_size(batch_size),
            shuffle=shuffle,
            seed=seed,
            steps=steps,
            bucket_batch=bucket_batch,
        )
    if x is None or not (hasattr(x, "__iter__") or callable(x)):
        raise TypeError(
            f"`{arg}` must be arrays (NumPy or JAX, or a dict/tuple of them), an iterable "
            f"of (x, y) batches, a generator function or a distributed dataset; got "
            f"{type(x).__name__}."
        )
    # A dataset's batches hold everything; arguments meant for arrays would be ignored.
    hint = " (its batches hold (x, y) or (x, y, sample_weight))"
    if isinstance(x, list):
        hint = (
            ", since it is a list, read as a list of batches. For array data pass NumPy "
            "arrays, e.g. np.asarray(x)"
        )
    for name, value in (("y", y), ("sample_weight", w), ("batch_size", batch_size)):
        if value is not None:
            raise ValueError(
                f"`{name}` must be None when `{arg}` is a dataset{hint}; got {name} of type "
                f"{type(value).__name__}."
            )
    return DatasetAdapter(strategy, x, steps=steps, arg=arg)
