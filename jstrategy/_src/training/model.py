"""`jstrategy.Model`: Keras's compile/fit/evaluate/predict for a Flax module, on a strategy.

A `Model` captures the strategy current when it is created (``with strategy.scope():``),
as Keras models do, and trains with the compiled steps of `train_step.py`: every call of
the training program runs ``steps_per_execution`` steps (a ``lax.scan`` over batches
stacked on a leading axis), dispatched asynchronously with the batches laid out on the
devices ahead of use. The epoch's running loss and metric sums stay on the devices; the
host reads them when a progress bar draws (throttled) and once at the end of each epoch.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import os
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src import context
from jstrategy._src import dispatch
from jstrategy._src import fault_tolerance
from jstrategy._src.training import callbacks as callbacks_lib
from jstrategy._src.training import nnx as nnx_lib
from jstrategy._src.training import summary as summary_lib
from jstrategy._src.training import train_step as steps_lib

__all__ = ["Model"]

# Keras's default learning rates for optimizers given by name.
_OPTIMIZERS: dict[str, tuple[Callable[..., optax.GradientTransformation], float]] = {
    "sgd": (optax.sgd, 0.01),
    "adam": (optax.adam, 1e-3),
    "adamw": (optax.adamw, 1e-3),
    "rmsprop": (optax.rmsprop, 1e-3),
    "adagrad": (optax.adagrad, 1e-3),
}
_PREFETCH = 2  # executions whose batches are on the devices before they run


# ---------------------------------------------------------------------------------------
# Learning rate kept in the optimizer state (changing it does not recompile)
# ---------------------------------------------------------------------------------------
class LearningRateScaleState(NamedTuple):
    """The factor `Model.learning_rate` multiplies an opaque optimizer's updates by."""

    learning_rate_scale: jax.Array


def scale_by_learning_rate_scale() -> optax.GradientTransformation:
    """Multiplies updates by a factor kept in the optimizer state (initially 1)."""

    def init(params):
        del params
        return LearningRateScaleState(jnp.ones((), jnp.float32))

    def update(updates, state, params=None):
        del params
        factor = state.learning_rate_scale
        return jax.tree.map(lambda u: u * factor.astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)


def _path_names(path: Sequence[Any]) -> list[Any]:
    names = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            names.append(entry.key)
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            names.append(entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            names.append(entry.idx)
    if names and names[-1] == "value":  # an NNX variable's array
        names.pop()
    return names


def _learning_rate_leaf(state: Any) -> tuple[int, str] | None:
    """Where the learning rate lives in a train state: (leaf index, kind), if unique."""
    found = []
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        names = _path_names(path)
        if not names or "opt_state" not in names:
            continue
        if names[-1] == "learning_rate" and "hyperparams" in names:
            found.append((i, "absolute"))
        elif names[-1] == "learning_rate_scale":
            found.append((i, "scale"))
    return found[0] if len(found) == 1 else None


def _resolve_optimizer(optimizer: Any) -> optax.GradientTransformation:
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in _OPTIMIZERS:
            raise ValueError(
                f"Unknown optimizer {optimizer!r}. Valid names: {sorted(_OPTIMIZERS)}; or pass "
                "an optax.GradientTransformation such as optax.adam(1e-3)."
            )
        factory, rate = _OPTIMIZERS[key]
        return optax.inject_hyperparams(factory)(learning_rate=rate)
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    raise TypeError(
        f"`optimizer` must be an optax.GradientTransformation or one of "
        f"{sorted(_OPTIMIZERS)}; got {type(optimizer).__name__} {optimizer!r}."
    )


def _has_absolute_rate(tx: optax.GradientTransformation, params: Any) -> bool:
    opt_state = jax.eval_shape(tx.init, params)
    holder = _learning_rate_leaf({"opt_state": opt_state})
    return holder is not None and holder[1] == "absolute"


# ---------------------------------------------------------------------------------------
# Data: executions of one or more steps, laid out on the devices ahead of use
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Execution:
    steps: int  # training steps this call runs
    key: tuple[int, bool]  # the program: (steps per call or 0 for one, stacked)
    batch: Any  # (x, y, sample_weight) of global arrays
    mask: Any


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) or (
        hasattr(x, "__array__") and hasattr(x, "shape") and hasattr(x, "dtype")
    )


def _is_array_tree(x: Any) -> bool:
    if x is None:
        return False
    if isinstance(x, (dict, tuple)) and not hasattr(x, "_fields"):
        leaves = jax.tree.leaves(x)
        return bool(leaves) and all(_is_array(leaf) for leaf in leaves)
    return _is_array(x)


def _rows(tree: Any, arg: str) -> int:
    counts = {int(np.shape(leaf)[0]) for leaf in jax.tree.leaves(tree) if np.ndim(leaf) > 0}
    if len(counts) != 1:
        raise ValueError(
            f"`{arg}` must be arrays with one shared number of rows; got row counts "
            f"{sorted(counts) or 'none'}."
        )
    return counts.pop()


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _check_batch_size(batch_size: Any) -> int:
    if batch_size is None:
        return 32
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise ValueError(f"`batch_size` must be a positive int; got {batch_size!r}. E.g. 32.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int; got {batch_size!r}. E.g. 32.")
    return int(batch_size)


class _ArrayData:
    """In-memory arrays cut into shuffled global batches, padded to one static size."""

    def __init__(self, strategy, x, y, w, *, batch_size: int, shuffle: bool, seed: int):
        self.strategy = strategy
        self.data = jax.tree.map(np.asarray, (x, y, w))
        rows = _rows(self.data, "x, y and sample_weight")
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        # The static global batch: batch_size rows rounded up to divide among replicas.
        self.static_rows = _round_up(min(batch_size, rows), strategy.num_replicas_in_sync)
        self.steps = math.ceil(rows / batch_size)
        mesh = strategy.mesh
        self._single = strategy.batch_sharding()
        self._stacked = NamedSharding(mesh, P(None, strategy.axis_name))

    def _take(self, index: np.ndarray, lead: tuple[int, ...]) -> tuple[Any, np.ndarray | None]:
        """Rows `index` (shape lead + (k,), k <= static rows) as padded host arrays."""
        k = index.shape[-1]
        pad = self.static_rows - k

        def gather(a):
            out = a[index.reshape(-1)].reshape(*lead, k, *a.shape[1:])
            if pad:
                widths = [(0, 0)] * len(lead) + [(0, pad)] + [(0, 0)] * (a.ndim - 1)
                out = np.pad(out, widths)
            return out

        mask = None
        if pad:
            mask = np.zeros((*lead, self.static_rows), bool)
            mask[..., :k] = True
        return jax.tree.map(gather, self.data), mask

    def _place(self, index: np.ndarray, lead: tuple[int, ...]) -> tuple[Any, Any]:
        host, host_mask = self._take(index, lead)
        sharding = self._stacked if lead else self._single
        if host_mask is None:
            return jax.device_put(host, sharding), steps_lib.ones_mask(
                self.static_rows, sharding, lead
            )
        return jax.device_put((host, host_mask), sharding)

    def order(self, epoch_seed: Any) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.rows)
        return np.random.default_rng(epoch_seed).permutation(self.rows)

    def train_executions(
        self, epoch_seed: Any, steps_per_execution: int, limit: int | None, skip: int = 0
    ):
        """The epoch's executions, after its first `skip` steps (done before a resume)."""
        order = self.order(epoch_seed)
        steps = self.steps if limit is None else min(limit, self.steps)
        bs = self.batch_size
        full = min(steps, self.rows // bs)  # batches with batch_size real rows
        # Backups are taken between executions, so `skip` is where one ended: starting
        # there, the executions are the ones the uninterrupted epoch runs.
        step = skip
        n = steps_per_execution
        while step + n <= full and n > 1:
            index = order[step * bs : (step + n) * bs].reshape(n, bs)
            batch, mask = self._place(index, (n,))
            yield _Execution(n, (n, True), batch, mask)
            step += n
        while step < steps:
            batch, mask = self._place(order[step * bs : (step + 1) * bs], ())
            yield _Execution(1, (0, True), batch, mask)
            step += 1

    def batches(self) -> Iterator[tuple[Any, Any, int]]:
        """In order, unshuffled: (batch, mask, real rows) for evaluation and prediction."""
        bs = self.batch_size
        for start in range(0, self.rows, bs):
            index = np.arange(start, min(start + bs, self.rows))
            batch, mask = self._place(index, ())
            yield batch, mask, len(index)


class _DatasetData:
    """An iterable of batches (host or already distributed), one epoch per pass."""

    def __init__(self, strategy, dataset, *, steps: int | None, arg: str):
        from jstrategy._src.input import DistributedDataset

        self.strategy = strategy
        # A one-shot iterator (e.g. a generator) gives one pass; later epochs get nothing.
        self.one_shot = not isinstance(dataset, DistributedDataset) and iter(dataset) is dataset
        self._passes = 0
        if isinstance(dataset, DistributedDataset):
            self.dataset = dataset
        else:
            self.dataset = strategy.experimental_distribute_dataset(dataset)
        self.limit = steps
        self.arg = arg
        self._iterator: Iterator[Any] | None = None
        try:
            self.steps: int | None = len(self.dataset) if steps is None else steps
        except TypeError:
            self.steps = steps
        self.exhausted = False
        # Elements drawn from the persistent iterator (with `steps`), across restarts.
        self.taken = 0

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
                yield steps_lib.split_batch(element, self.strategy)
            return
        for _ in range(self.limit - skip):
            element = self._next()
            if element is None:
                return
            yield steps_lib.split_batch(element, self.strategy)

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
        batch = steps_lib.unpack_batch(values)
        if mask is None:
            rows = steps_lib._batch_rows(batch[0])
            mask = steps_lib.ones_mask(rows, self.strategy.batch_sharding())
        return batch, mask

    def train_executions(
        self, epoch_seed: Any, steps_per_execution: int, limit: int | None, skip: int = 0
    ):
        del epoch_seed, limit  # the dataset decides its order and length
        group: list[tuple[Any, Any]] = []
        n = steps_per_execution
        for values, mask in self._elements(skip):
            batch, mask = self._with_mask(values, mask)
            if n == 1:
                yield _Execution(1, (0, True), batch, mask)
                continue
            if group and _layout(group[0]) != _layout((batch, mask)):
                yield from self._singles(group)
                group = []
            group.append((batch, mask))
            if len(group) == n:
                batches, masks = zip(*group, strict=True)
                yield _Execution(n, (n, False), tuple(batches), tuple(masks))
                group = []
        yield from self._singles(group)

    @staticmethod
    def _singles(group):
        for batch, mask in group:
            yield _Execution(1, (0, True), batch, mask)

    def batches(self) -> Iterator[tuple[Any, Any, int | None]]:
        for values, mask in self._elements():
            batch, mask = self._with_mask(values, mask)
            yield batch, mask, None


def _layout(tree: Any) -> tuple[str, list[Any]]:
    """What must match for batches to be stacked into one execution."""
    leaves, treedef = jax.tree.flatten(tree)
    return str(treedef), [(np.shape(x), getattr(x, "dtype", type(x))) for x in leaves]


def _implements(callbacks: callbacks_lib.CallbackList, kind: str) -> bool:
    """Whether any callback overrides the ``on_{kind}_begin/end`` hooks (or their aliases)."""
    names = {f"on_{kind}_begin", f"on_{kind}_end"}
    if kind == "train_batch":
        names |= {"on_batch_begin", "on_batch_end"}
    base = callbacks_lib.Callback
    for cb in callbacks:
        for name in names:
            if name in vars(cb) or getattr(type(cb), name, None) is not getattr(base, name):
                return True
    return False


def _prefetch(iterator: Iterator[Any], depth: int = _PREFETCH) -> Iterator[Any]:
    """Keeps `depth` items (batches already dispatched to the devices) ahead of the consumer."""
    buffer: collections.deque[Any] = collections.deque()
    for item in iterator:
        buffer.append(item)
        if len(buffer) > depth:
            yield buffer.popleft()
    while buffer:
        yield buffer.popleft()


# ---------------------------------------------------------------------------------------
# Where fit is, for backups
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _FitProgress:
    """Where `fit` is: enough to start a new process at the same step with the same data.

    Attributes:
      epoch: the epoch being trained (as `fit` numbers them).
      step: the steps done in it.
      order_index: the model's epoch counter that seeded this epoch's shuffling order.
      position_base: for a dataset read through one persistent iterator
        (``steps_per_epoch``), the elements drawn from it before this epoch; else None.
    """

    epoch: int = 0
    step: int = 0
    order_index: int = 0
    position_base: int | None = None

    def metadata(self, *, epoch_end: bool) -> dict[str, Any]:
        """The JSON-able position saved with a backup: at this step, or after the epoch."""
        position = None if self.position_base is None else self.position_base + self.step
        if epoch_end:
            return {
                "epoch": self.epoch + 1,
                "step": 0,
                "order_index": self.order_index + 1,
                "position": position,
            }
        return {
            "epoch": self.epoch,
            "step": self.step,
            "order_index": self.order_index,
            "position": position,
        }


@dataclasses.dataclass
class _Resume:
    """A restored position that the next `fit` starts from (set by `BackupAndRestore`)."""

    epoch: int
    step: int
    order_index: int
    position: int | None
    sums: Any


_FIT_KEYS = ("epoch", "step", "order_index", "position")


def _lookup(tree: Any, path: tuple[str, ...], location: str) -> Any:
    node = tree
    for name in path:
        try:
            node = node[int(name)] if isinstance(node, (list, tuple)) else node[name]
        except (KeyError, IndexError, ValueError, TypeError):
            raise ValueError(
                f"The checkpoint in {location} has no variable {'/'.join(path)}: it was "
                "saved from a different model. Load it into a model built like the one "
                "that saved it."
            ) from None
    return node


def _pick(saved: Any, like: Any, location: str) -> Any:
    """The leaves of `like`'s structure, found by path in a target-less restore `saved`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for keypath, leaf in flat:
        value = _lookup(saved, checkpoint_lib._path_of(keypath), location)
        if np.shape(value) != np.shape(leaf):
            raise ValueError(
                f"Variable {'/'.join(checkpoint_lib._path_of(keypath))} in {location} has "
                f"shape {np.shape(value)}; the model's has {np.shape(leaf)}. Load it into a "
                "model built like the one that saved it."
            )
        if value.dtype != leaf.dtype:
            value = value.astype(leaf.dtype)
        leaves.append(value)
    return jax.tree.unflatten(treedef, leaves)


def _latest_step_dir(path: str) -> str | None:
    """The newest committed step of a `CheckpointManager` directory, or None if it is none.

    Read from the directory listing rather than by opening a manager, which would remove
    the temporary directory of a save that another process is writing there now.
    """
    if not os.path.isdir(path) or os.path.isdir(os.path.join(path, "state")):
        return None
    steps = [int(name) for name in os.listdir(path) if name.isdigit()]
    return os.path.join(path, str(max(steps))) if steps else None


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------
class Model:
    """A Keras-like model around a Flax module (linen or NNX), trained by a strategy.

    Create it inside ``strategy.scope()``: it captures `jstrategy.get_strategy()` and
    keeps its variables as that strategy places them (one copy per replica for
    `MirroredStrategy`). Then `compile`, `fit`, `evaluate` and `predict` as in Keras.

    Args:
      module: a `flax.linen.Module` (initialized here, from `input_shape` or the first
        data) or an initialized `flax.nnx.Module`.
      input_shape: the shape of one input row, without the batch axis, e.g. ``(10,)``;
        None to build from the first data the model sees.
      input_dtype: the dtype of the sample input used to initialize the module.
      seed: seeds shuffling and, for linen modules, parameter initialization and dropout
        (an NNX module brings its own ``nnx.Rngs``); the same seed gives the same run.
      name: the name shown by `summary`; defaults to the module's class name.
      train_arg: the linen module's training-mode keyword (``"train"``, ``"training"``,
        ``"deterministic"``), found in ``__call__``'s signature by default (``"auto"``).

    Attributes:
      stop_training: set to True (e.g. by `EarlyStopping`) to end `fit` after the current
        step.
      history: the `History` of the latest `fit`.

    Example:

    >>> import numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     model = jstrategy.Model(nn.Dense(1), input_shape=(3,))
    ...     model.compile(optax.sgd(0.1), loss="mse")
    >>> x, y = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
    >>> history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    >>> len(history.history["loss"]), model.predict(x, verbose=0).shape
    (2, (8, 1))
    """

    def __init__(
        self,
        module: Any,
        input_shape: Sequence[int] | None = None,
        *,
        input_dtype: Any = jnp.float32,
        seed: int = 0,
        name: str | None = None,
        train_arg: str | None = "auto",
    ):
        self._is_nnx = isinstance(module, nnx.Module)
        if not self._is_nnx and not hasattr(module, "init"):
            raise TypeError(
                f"`module` must be a flax.linen.Module or a flax.nnx.Module; got "
                f"{type(module).__name__} {module!r}."
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"`seed` must be an int; got {seed!r}.")
        if input_shape is not None:
            if isinstance(input_shape, (int, np.integer)):
                input_shape = (int(input_shape),)
            input_shape = tuple(int(d) for d in input_shape)
        self.module = module
        self.name = name or type(module).__name__.lower()
        self._strategy = context.get_strategy()
        self._input_shape = input_shape
        self._input_dtype = input_dtype
        self._seed = int(seed)
        self._train_arg = train_arg
        self._state: Any = None
        self._tx: optax.GradientTransformation | None = None
        self._optimizer: Any = None
        self._spec: steps_lib.StepSpec | None = None
        self._steps_per_execution = 1
        self._programs: dict[Any, Any] = {}
        self._rate_leaf: tuple[int, str] | None = None
        self._raw_tx: optax.GradientTransformation | None = None
        self._epochs_run = 0
        # Set by BackupAndRestore before fit's first epoch; where fit is during it.
        self._resume: _Resume | None = None
        self._fit_progress: _FitProgress | None = None
        self._epoch_sums: Any = None
        self.stop_training = False
        self.history: callbacks_lib.History | None = None
        if self._is_nnx:
            self._state = nnx_lib.create_nnx_train_state(
                module, optax.identity(), strategy=self._strategy
            )
        elif input_shape is not None:
            self._build(jnp.zeros((1, *input_shape), input_dtype))

    # Properties ---------------------------------------------------------------------------
    @property
    def strategy(self) -> Any:
        """The strategy captured when the model was created."""
        return self._strategy

    @property
    def built(self) -> bool:
        """Whether the variables exist (after `input_shape` or the first data)."""
        return self._state is not None

    @property
    def compiled(self) -> bool:
        """Whether `compile` has been called."""
        return self._spec is not None

    @property
    def state(self) -> Any:
        """The train state (`TrainState` or `NNXTrainState`), placed by the strategy."""
        self._require_built("state")
        return self._state

    @property
    def variables(self) -> Any:
        """The Flax variables as placed by the strategy.

        For linen, ``{"params": ..., "batch_stats": ...}`` (the latter if any); for NNX,
        the module's `nnx.State` (parameters and other variables).
        """
        self._require_built("variables")
        if self._is_nnx:
            return nnx.merge_state(self._state.params, self._state.model_state)
        return self._state.variables

    @property
    def optimizer(self) -> Any:
        """The optimizer given to `compile` (an optax transformation or its name)."""
        return self._optimizer

    @property
    def loss(self) -> Any:
        """The compiled `jstrategy.losses.Loss`."""
        return None if self._spec is None else self._spec.loss

    @property
    def metrics(self) -> list[Any]:
        """The compiled metrics (`jstrategy.metrics.Metric` objects)."""
        return [] if self._spec is None else [m for _, m in self._spec.metrics]

    @property
    def metrics_names(self) -> list[str]:
        """The keys of the logs: ``"loss"`` then each metric's name."""
        return [] if self._spec is None else list(self._spec.names)

    @property
    def steps_per_execution(self) -> int:
        """How many training steps each dispatched program runs."""
        return self._steps_per_execution

    @property
    def learning_rate(self) -> float:
        """The learning rate, read from and written to the optimizer state.

        Optimizers given by name, or built with ``optax.inject_hyperparams`` (e.g.
        ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``), expose their
        absolute learning rate. Any other optax transformation is followed by a scale
        kept in the state: then `learning_rate` is a multiplier of the transformation's
        own rate, starting at 1.0. Setting it changes a value in the state, so nothing
        is recompiled.

        Raises:
          RuntimeError: before `compile`, or when the optimizer has several learning rates.
        """
        index = self._require_rate()
        return float(jax.tree.leaves(self._state)[index])

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        index = self._require_rate()
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"`learning_rate` must be a non-negative finite float; got {value}.")
        leaves, treedef = jax.tree.flatten(self._state)
        old = leaves[index]
        leaves[index] = jax.device_put(np.asarray(value, old.dtype), old.sharding)
        self._state = jax.tree.unflatten(treedef, leaves)

    def _require_rate(self) -> int:
        if self._spec is None or not self.built:
            raise RuntimeError(
                "`learning_rate` is kept in the optimizer state, which exists after "
                "`compile` and once the model is built. Call model.compile(...) first."
            )
        if self._rate_leaf is None:
            raise RuntimeError(
                "The optimizer has no single learning rate to read or set (several were "
                "found). Build it with optax.inject_hyperparams for one learning_rate."
            )
        return self._rate_leaf[0]

    def _require_built(self, what: str) -> None:
        if self._state is None:
            raise ValueError(
                f"The model has no variables yet, so `{what}` is not available. Pass "
                "input_shape=(...) to Model, or call fit/evaluate/predict first."
            )

    # Building and compiling -----------------------------------------------------------
    def _build(self, sample_x: Any) -> None:
        if self._is_nnx or self._state is not None:
            return
        tx = self._tx if self._tx is not None else optax.identity()
        self._state = steps_lib.create_train_state(
            self.module,
            tx,
            sample_x,
            rng=self._seed,
            strategy=self._strategy,
            train_arg=self._train_arg,
        )
        self._after_new_state()

    def _build_from(self, x: Any) -> None:
        if self._state is None:
            sample = jax.tree.map(lambda a: np.asarray(a[:1]), x)
            self._build(sample)

    def _sample_input(self, symbolic: bool) -> Any:
        if self._input_shape is None:
            raise ValueError(
                "The sample input shape is unknown. Pass input_shape=(...) to Model (the "
                "shape of one row, without the batch axis)."
            )
        if symbolic:
            # A symbolic batch axis, so the table shows "(batch, 16)" as Keras shows None.
            (batch,) = jax.export.symbolic_shape("batch")
            return jax.ShapeDtypeStruct((batch, *self._input_shape), self._input_dtype)
        return jax.ShapeDtypeStruct((1, *self._input_shape), self._input_dtype)

    def _after_new_state(self) -> None:
        self._rate_leaf = _learning_rate_leaf(self._state) if self._tx is not None else None
        self._programs = {}

    def compile(
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Sequence[Any] | None = None,
        steps_per_execution: int = 1,
    ) -> None:
        """Configures training, as Keras's ``compile``.

        Compiling again keeps the variables and starts a fresh optimizer state.

        Args:
          optimizer: an optax transformation, or a name (``"sgd"``, ``"adam"``,
            ``"adamw"``, ``"rmsprop"``, ``"adagrad"``) with Keras's default learning rate.
          loss: a loss name, a `jstrategy.losses` object or a callable ``(y_true, y_pred)
            -> per-example losses``.
          metrics: metric names (``"accuracy"``, ``"mae"``, ...), `jstrategy.metrics`
            objects or callables returning per-example values.
          steps_per_execution: training steps fused into one dispatched program; larger
            values cut host overhead without changing the result.

        Raises:
          ValueError: for a missing loss, unknown names or a bad `steps_per_execution`.

        Example:

        >>> import flax.linen as nn
        >>> import jstrategy
        >>> model = jstrategy.Model(nn.Dense(3), input_shape=(4,))
        >>> model.compile("adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        >>> model.metrics_names, round(model.learning_rate, 6)
        (['loss', 'accuracy'], 0.001)
        """
        if (
            isinstance(steps_per_execution, bool)
            or not isinstance(steps_per_execution, (int, np.integer))
            or steps_per_execution < 1
        ):
            raise ValueError(
                f"`steps_per_execution` must be a positive int; got {steps_per_execution!r}. "
                "1 dispatches every step; e.g. 8 fuses 8 steps into one program."
            )
        loss_fn = steps_lib.resolve_loss(loss)
        spec = steps_lib.StepSpec(
            self._strategy, loss_fn, tuple(steps_lib.resolve_metrics(metrics, loss=loss_fn))
        )
        tx = _resolve_optimizer(optimizer)
        self._optimizer = optimizer
        self._spec = spec
        self._steps_per_execution = int(steps_per_execution)
        self._raw_tx = tx
        self._tx = None
        if self._state is not None:
            self._set_optimizer(tx)

    def _set_optimizer(self, tx: optax.GradientTransformation) -> None:
        # Optimizer state is created in device memory (JAX cannot build arrays "like" a
        # host-memory array outside a program); place_state then puts it where it lives.
        state = steps_lib.in_device_memory(self._state)
        params = state.params
        if not _has_absolute_rate(tx, params):
            tx = optax.chain(tx, scale_by_learning_rate_scale())
        self._tx = tx
        if self._is_nnx:
            module = state.model
            self._state = nnx_lib.create_nnx_train_state(
                module, tx, wrt=self._state.wrt, strategy=self._strategy
            )
        else:
            opt_state = tx.init(params)
            self._state = steps_lib.place_state(
                self._state.replace(tx=tx, opt_state=opt_state, step=jnp.zeros((), jnp.int32)),
                self._strategy,
            )
        self._after_new_state()

    def _ensure_ready(self, x_sample: Any = None, *, training: bool) -> None:
        if x_sample is not None:
            self._build_from(x_sample)
        if self._state is None:
            raise ValueError(
                "The model has no variables: pass input_shape=(...) to Model or give fit "
                "arrays so it can build from them."
            )
        if training and self._spec is None:
            raise RuntimeError(
                "The model must be compiled before training or evaluation; call "
                "model.compile(optimizer, loss, metrics) first."
            )
        if self._spec is not None and self._tx is None:
            self._set_optimizer(self._raw_tx)

    def summary(self, print_fn: Callable[[str], Any] | None = None) -> None:
        """Prints a Keras-like table of the module's layers, output shapes and parameters.

        Args:
          print_fn: called with the table; defaults to `print`.

        Example:

        >>> import flax.linen as nn
        >>> import jstrategy
        >>> model = jstrategy.Model(nn.Sequential([nn.Dense(4), nn.Dense(1)]), input_shape=(3,))
        >>> model.summary()  # doctest: +ELLIPSIS
        Model: "sequential"
        ...
        Total params: 21 (84.00 B)
        ...
        """
        self._require_built("summary")
        try:
            table = self._summary_table(self._sample_input(symbolic=True))
        except Exception:  # some modules need concrete shapes (e.g. reshapes)
            table = self._summary_table(self._sample_input(symbolic=False))
        if self.name and table.startswith("Model: "):
            table = f'Model: "{self.name}"' + table[table.index("\n") :]
        (print_fn or print)(table)

    def _summary_table(self, sample: Any) -> str:
        state = steps_lib.in_device_memory(self._state)
        if self._is_nnx:
            return summary_lib.summarize(state.model, None, sample)
        kwargs = {}
        train_arg = self._state.train_arg
        if train_arg is not None:
            kwargs[train_arg] = train_arg == "deterministic"
        return summary_lib.summarize(self.module, state.variables, sample, **kwargs)

    # Weights ----------------------------------------------------------------------------
    def _weight_paths(self) -> tuple[Any, list[int]]:
        tree = self.variables
        if not self._is_nnx:
            return tree, list(range(len(jax.tree.leaves(tree))))
        # NNX random streams (keys and counts) are not weights.
        variables = jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))
        return tree, [i for i, v in enumerate(variables) if not isinstance(v, nnx.RngState)]

    def get_weights(self) -> list[np.ndarray]:
        """The variables' values as NumPy arrays (parameters and statistics), in a fixed order."""
        tree, keep = self._weight_paths()
        leaves = jax.device_get(jax.tree.leaves(tree))
        return [np.asarray(leaves[i]) for i in keep]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Sets the variables from a list like `get_weights` returns.

        Raises:
          ValueError: if the number of arrays or a shape does not match.
        """
        tree, keep = self._weight_paths()
        leaves, treedef = jax.tree.flatten(tree)
        weights = list(weights)
        if len(weights) != len(keep):
            raise ValueError(
                f"`weights` must hold {len(keep)} arrays, as get_weights() returns; got "
                f"{len(weights)}."
            )
        for i, w in zip(keep, weights, strict=True):
            w = np.asarray(w)
            if w.shape != leaves[i].shape:
                raise ValueError(
                    f"Weight {keep.index(i)} must have shape {leaves[i].shape}; got {w.shape}."
                )
            leaves[i] = w.astype(leaves[i].dtype)
        new = steps_lib.place_state(jax.tree.unflatten(treedef, leaves), self._strategy)
        if self._is_nnx:
            _, params, model_state = nnx_lib.split_model(
                nnx.merge(self._state.graphdef, new), self._state.wrt
            )
            self._state = self._state.replace(params=params, model_state=model_state)
        else:
            self._state = self._state.replace(
                params=new["params"], batch_stats=new.get("batch_stats")
            )

    # Weights and training state on disk ------------------------------------------------
    def _weights_tree(self) -> dict[str, Any]:
        """The variables as saved: fields of the train state, so a full state holds them."""
        if self._is_nnx:
            return {"params": self._state.params, "model_state": self._state.model_state}
        tree = {"params": self._state.params}
        if self._state.batch_stats is not None:
            tree["batch_stats"] = self._state.batch_stats
        return tree

    def save_weights(self, filepath: os.PathLike | str, overwrite: bool = True) -> None:
        """Writes the model's variables to the directory `filepath` (`jstrategy.save_weights`).

        Parameters and other variables (BatchNorm statistics, NNX random streams) are saved
        from wherever the strategy keeps them; the write is atomic. Every process of a
        multi-worker job must call it.

        Args:
          filepath: the directory to write.
          overwrite: replace existing weights at `filepath`; if False, they raise.

        Raises:
          ValueError: if the model has no variables yet.
          FileExistsError: if `filepath` exists and `overwrite` is False.

        Example:

        >>> import os, tempfile, flax.linen as nn, jstrategy
        >>> path = os.path.join(tempfile.mkdtemp(), "weights")
        >>> model = jstrategy.Model(nn.Dense(2), input_shape=(3,), seed=1)
        >>> model.save_weights(path)
        >>> other = jstrategy.Model(nn.Dense(2), input_shape=(3,), seed=2)
        >>> other.load_weights(path)
        >>> bool((other.get_weights()[1] == model.get_weights()[1]).all())
        True
        """
        self._require_built("save_weights")
        tree = fault_tolerance.to_savable(self._weights_tree())
        checkpoint_lib.save_weights(filepath, tree, overwrite=overwrite)

    def load_weights(self, filepath: os.PathLike | str) -> None:
        """Loads variables saved by `save_weights`, `ModelCheckpoint` or `BackupAndRestore`.

        `filepath` is a `save_weights` directory, or a checkpoint directory of
        `jstrategy.callbacks.ModelCheckpoint` (weights only or the full training state) or
        `BackupAndRestore`, whose latest step is read. The variables are placed as this
        model's strategy keeps them, whatever strategy saved them; the optimizer state is
        left as it is. Every process of a multi-worker job must call it.

        Args:
          filepath: the weights or checkpoint directory.

        Raises:
          ValueError: if the model has no variables yet, or the saved variables are not
            this model's.
          FileNotFoundError: if there is nothing at `filepath`.
          CheckpointError: if the checkpoint is damaged.
        """
        self._require_built("load_weights")
        like = self._weights_tree()
        path = os.path.abspath(os.fspath(filepath))
        step_dir = _latest_step_dir(path)
        if step_dir is None:
            target = fault_tolerance.to_savable(like)
            saved = checkpoint_lib.load_weights(path, target=target, strategy=self._strategy)
        else:
            saved = self._read_checkpoint(step_dir, like, ("weights", "train_state"))
        saved = fault_tolerance.from_savable(saved, like)
        self._state = self._state.replace(**steps_lib.place_state(saved, self._strategy))

    def restore_checkpoint(self, directory: os.PathLike | str) -> None:
        """Restores the training state (variables, optimizer state, step) of a checkpoint.

        Reads the latest step of a `ModelCheckpoint(save_weights_only=False)` or
        `BackupAndRestore` directory into this model, compiled with the same optimizer.
        Every process of a multi-worker job must call it.

        Args:
          directory: the checkpoint directory.

        Raises:
          FileNotFoundError: if `directory` holds no checkpoint.
          ValueError: if the model is not compiled, or the checkpoint holds weights only
            or another model's state.
          CheckpointError: if the checkpoint is damaged.
        """
        self._ensure_ready(training=True)
        path = os.path.abspath(os.fspath(directory))
        step_dir = _latest_step_dir(path)
        if step_dir is None:
            raise FileNotFoundError(
                f"No checkpoint in {path}. Pass a directory written by ModelCheckpoint or "
                "BackupAndRestore (for save_weights directories use load_weights)."
            )
        saved = self._read_checkpoint(step_dir, self._state)
        saved = fault_tolerance.from_savable(saved, self._state)
        self._state = steps_lib.place_state(saved, self._strategy)

    def _read_checkpoint(
        self, step_dir: str, like: Any, roots: Sequence[str] = ("train_state",)
    ) -> Any:
        """``to_savable(like)``'s leaves, read by path from the first of `roots` found in a
        checkpoint step (a full state holds the weights as fields of its train state)."""
        saved = checkpoint_lib.load_weights(step_dir, strategy=self._strategy)
        root = next((r for r in roots if isinstance(saved, dict) and r in saved), None)
        if root is None:
            raise ValueError(
                f"The checkpoint in {step_dir} holds none of {list(roots)}; it was not "
                "written by a jstrategy Model callback, or holds weights only (use "
                "load_weights)."
            )
        return _pick(saved[root], fault_tolerance.to_savable(like), step_dir)

    def _checkpoint_tree(self, *, weights_only: bool = False, epoch_sums: bool = False) -> Any:
        """What the callbacks save: ``{"weights": ...}`` or ``{"train_state": ...}``, and
        the epoch's running loss and metric sums for a backup taken mid-epoch."""
        self._require_built("checkpoints")
        if weights_only:
            return {"weights": fault_tolerance.to_savable(self._weights_tree())}
        tree: dict[str, Any] = {"train_state": fault_tolerance.to_savable(self._state)}
        if epoch_sums:
            sums = self._epoch_sums
            tree["epoch_sums"] = sums if sums is not None else self._zero_sums()
        return tree

    def _fit_metadata(self, *, epoch_end: bool) -> dict[str, Any]:
        """Where `fit` is now, as JSON-able values for a backup."""
        if self._fit_progress is None:
            raise RuntimeError("BackupAndRestore saves only while Model.fit runs.")
        return self._fit_progress.metadata(epoch_end=epoch_end)

    def _restore_for_fit(self, manager: checkpoint_lib.CheckpointManager) -> dict[str, Any]:
        """Restores a backup (state and epoch sums); the next epochs of `fit` resume it.

        Returns:
          The backup's metadata.
        """
        self._ensure_ready(training=True)
        target = self._checkpoint_tree(epoch_sums=True)
        restored = manager.restore(target=target, strategy=self._strategy)
        metadata = manager.restore_metadata()
        state = fault_tolerance.from_savable(restored["train_state"], self._state)
        self._state = steps_lib.place_state(state, self._strategy)
        missing = [k for k in _FIT_KEYS if k not in metadata]
        if missing:
            raise checkpoint_lib.CheckpointError(
                f"The backup in {manager.directory} lacks {missing} in its metadata: it was "
                "not written by BackupAndRestore. Pass an empty or BackupAndRestore "
                "directory as backup_dir.",
                path=manager.directory,
            )
        self._resume = _Resume(
            epoch=int(metadata["epoch"]),
            step=int(metadata["step"]),
            order_index=int(metadata["order_index"]),
            position=metadata["position"],
            sums=restored["epoch_sums"],
        )
        return metadata

    # Programs -----------------------------------------------------------------------------
    @property
    def _compiled_spec(self) -> steps_lib.StepSpec:
        if self._spec is None:
            raise RuntimeError("The model is not compiled; call model.compile(...) first.")
        return self._spec

    def _program(self, key: Any) -> Any:
        program = self._programs.get(key)
        if program is None:
            kind = key[0]
            spec = self._compiled_spec
            if kind == "train":
                _, steps, stacked = key
                program = steps_lib.build_train_program(spec, steps=steps, stacked=stacked)
            elif kind == "eval":
                program = steps_lib.build_eval_program(spec)
            else:
                program = steps_lib.build_predict_program(self._strategy)
            self._programs[key] = program
        return program

    def _zero_sums(self) -> dict[str, jax.Array]:
        return jax.device_put(self._compiled_spec.zero_sums(), self._strategy.replicated_sharding())

    # Data ---------------------------------------------------------------------------------
    def _data(self, x, y, w, *, batch_size, shuffle, steps, arg) -> Any:
        if _is_array_tree(x):
            if steps is not None and not isinstance(steps, (int, np.integer)):
                raise ValueError(f"`steps` must be an int or None; got {steps!r}.")
            return _ArrayData(
                self._strategy,
                x,
                y,
                w,
                batch_size=_check_batch_size(batch_size),
                shuffle=shuffle,
                seed=self._seed,
            )
        if y is not None:
            raise ValueError(
                f"`y` must be None when `{arg}` is a dataset (its batches hold (x, y)); got "
                f"y of type {type(y).__name__}."
            )
        if x is None or not hasattr(x, "__iter__"):
            raise TypeError(
                f"`{arg}` must be arrays (NumPy or JAX, or a dict/tuple of them), an iterable "
                f"of (x, y) batches or a distributed dataset; got {type(x).__name__}."
            )
        return _DatasetData(self._strategy, x, steps=steps, arg=arg)

    def _first_x(self, data: Any) -> Any:
        """A one-row sample of the inputs, to build the module from (None once built)."""
        if self._state is not None:
            return None
        if isinstance(data, _ArrayData):
            x = data.data[0]
        else:
            spec = steps_lib.unpack_batch(data.dataset.element_spec)[0]
            x = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)
        if self._input_shape is None and _is_array(x):
            self._input_shape, self._input_dtype = tuple(x.shape[1:]), x.dtype
        return x

    # fit --------------------------------------------------------------------------------
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: int | str = "auto",
        callbacks: Sequence[callbacks_lib.Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        sample_weight: Any = None,
    ) -> callbacks_lib.History:
        """Trains the model, as Keras's ``fit``.

        Args:
          x: inputs: arrays (or a dict/tuple of arrays), or a dataset: an iterable of
            ``(x, y)`` / ``(x, y, sample_weight)`` batches, or a distributed dataset.
          y: targets, for array inputs.
          batch_size: the global batch size for array inputs (default 32); the last batch
            may be partial (it is padded and masked, never dropped).
          epochs: the index of the last epoch to train.
          verbose: 0 silent, 1 progress bar, 2 one line per epoch, ``"auto"`` 1 in a
            terminal and 2 elsewhere.
          callbacks: `jstrategy.callbacks.Callback` objects, called in order.
          validation_split: the fraction of array data, taken from the end before
            shuffling, held out for validation.
          validation_data: ``(x_val, y_val)`` arrays or a dataset, evaluated after each
            epoch (``val_``-prefixed logs).
          shuffle: whether to shuffle array data each epoch (seeded by the model's seed).
          initial_epoch: the epoch to start at (to resume training). A
            `jstrategy.callbacks.BackupAndRestore` backup overrides it: training resumes
            at the backup's epoch and step, with the same data order.
          steps_per_epoch: steps per epoch; for datasets, batches are drawn from one
            iterator that continues across epochs (restarted when exhausted).
          sample_weight: per-example weights for array inputs.

        Returns:
          The `History` of the run.

        Raises:
          RuntimeError: if the model is not compiled.
          ValueError: for inconsistent arguments or data.
        """
        if not isinstance(epochs, (int, np.integer)) or isinstance(epochs, bool) or epochs < 0:
            raise ValueError(f"`epochs` must be a non-negative int; got {epochs!r}.")
        if not 0.0 <= float(validation_split) < 1.0:
            raise ValueError(
                f"`validation_split` must be in [0, 1); got {validation_split!r}. E.g. 0.2 "
                "holds out the last 20% of the rows."
            )
        if validation_split and not _is_array_tree(x):
            raise ValueError(
                "`validation_split` needs array inputs; for datasets pass validation_data."
            )
        if validation_split and validation_data is None:
            rows = _rows((x, y), "x and y")
            split = rows - int(rows * float(validation_split))
            if split in (0, rows):
                raise ValueError(
                    f"validation_split={validation_split} leaves an empty part of {rows} rows."
                )

            def cut(tree, part):
                return None if tree is None else jax.tree.map(lambda a: a[part], tree)

            validation_data = (cut(x, slice(split, None)), cut(y, slice(split, None)))
            if sample_weight is not None:
                validation_data += (cut(sample_weight, slice(split, None)),)
            x, y = cut(x, slice(0, split)), cut(y, slice(0, split))
            sample_weight = cut(sample_weight, slice(0, split))
        if _is_array_tree(x) and y is None:
            raise ValueError("`y` is required when `x` holds arrays; pass fit(x, y, ...).")
        data = self._data(
            x,
            y,
            sample_weight,
            batch_size=batch_size,
            shuffle=shuffle,
            steps=steps_per_epoch,
            arg="x",
        )
        self._ensure_ready(self._first_x(data), training=True)
        val_data = None
        if validation_data is not None:
            val_data = self._validation(validation_data, batch_size)
        steps = data.steps
        if isinstance(data, _ArrayData) and steps_per_epoch is not None:
            steps = min(steps_per_epoch, data.steps)
        cbs = callbacks_lib.CallbackList(
            callbacks,
            model=self,
            add_history=True,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=epochs,
            steps=steps,
        )
        self.stop_training = False
        self._fit_progress = _FitProgress()
        self._epoch_sums = None
        logs: dict[str, Any] = {}
        try:
            cbs.on_train_begin()
            # A backup restored by BackupAndRestore.on_train_begin: start at its step, with
            # the shuffling order and dataset position the interrupted run had there.
            resume, self._resume = self._resume, None
            start, skip, sums = initial_epoch, 0, None
            if resume is not None:
                start, skip, sums = resume.epoch, resume.step, resume.sums
                self._epochs_run = resume.order_index
                if isinstance(data, _DatasetData) and data.limit is not None:
                    data.seek(int(resume.position or 0))
            for epoch in range(start, epochs):
                self._fit_progress.epoch = epoch
                self._fit_progress.step = skip
                cbs.on_epoch_begin(epoch)
                epoch_logs = self._train_epoch(data, cbs, steps_per_epoch, skip=skip, sums=sums)
                skip, sums = 0, None
                if epoch_logs is None:
                    break
                logs = epoch_logs
                if isinstance(data, _DatasetData) and data.exhausted:
                    self.stop_training = True
                if val_data is not None:
                    val_logs = self._evaluate_data(val_data, cbs)
                    logs.update({f"val_{k}": v for k, v in val_logs.items()})
                cbs.on_epoch_end(epoch, logs)
                if self.stop_training:
                    break
        except BaseException:
            # on_train_end is not called (so backups stay), but callbacks holding
            # resources (BackupAndRestore's SIGTERM handler) release them.
            for cb in cbs:
                abort = getattr(cb, "_on_train_abort", None)
                if abort is not None:
                    abort()
            self._fit_progress = None
            raise
        cbs.on_train_end(logs)
        self._fit_progress = None
        if self._is_nnx:
            nnx.update(self.module, self._state.params, self._state.model_state)
        assert cbs.history is not None
        self.history = cbs.history
        return cbs.history

    def _validation(self, validation_data: Any, batch_size: Any) -> Any:
        if (
            isinstance(validation_data, tuple)
            and 2 <= len(validation_data) <= 3
            and _is_array_tree(validation_data[0])
        ):
            vx, vy, *vw = validation_data
            return self._data(
                vx,
                vy,
                vw[0] if vw else None,
                batch_size=batch_size,
                shuffle=False,
                steps=None,
                arg="validation_data",
            )
        return self._data(
            validation_data,
            None,
            None,
            batch_size=None,
            shuffle=False,
            steps=None,
            arg="validation_data",
        )

    def _train_epoch(
        self,
        data: Any,
        cbs: Any,
        steps_per_epoch: int | None,
        *,
        skip: int = 0,
        sums: Any = None,
    ) -> dict[str, Any] | None:
        """Runs one epoch; returns its logs, or None if the data gave no batches.

        A resumed epoch starts after its first `skip` steps, with the running `sums` the
        interrupted run had there, so it ends with the same state and logs.
        """
        # ParameterServerStrategy runs the epoch asynchronously on its workers
        # (jstrategy/_src/parameter_server/model_fit.py).
        train_model_epoch = getattr(self._strategy, "_train_model_epoch", None)
        if train_model_epoch is not None:
            return train_model_epoch(self, data, cbs, steps_per_epoch)
        acc = self._zero_sums() if sums is None else sums
        logs: dict[str, Any] = {}
        # The epoch's shuffling order is a function of (seed, this counter) only, so a new
        # process given the counter by a backup redoes it.
        epoch_seed = (self._seed, self._epochs_run)
        progress = self._fit_progress if self._fit_progress is not None else _FitProgress()
        progress.order_index = self._epochs_run
        progress.step = skip
        progress.position_base = None
        if isinstance(data, _DatasetData) and data.limit is not None:
            progress.position_base = data.taken - skip
        self._epochs_run += 1
        self._epoch_sums = acc
        step = skip
        executions = data.train_executions(
            epoch_seed, self._steps_per_execution, steps_per_epoch, skip=skip
        )
        # As Keras, skip the per-batch hooks when no callback implements them.
        batch_hooks = _implements(cbs, "train_batch")
        for execution in _prefetch(executions):
            if batch_hooks:
                cbs.on_train_batch_begin(step)
            program = self._program(("train", *execution.key))
            self._state, acc, logs = program(self._state, acc, execution.batch, execution.mask)
            self._epoch_sums = acc
            dispatch.track(logs)
            step += execution.steps
            progress.step = step
            if batch_hooks:
                cbs.on_train_batch_end(step - 1, self._ordered(logs))
            if self.stop_training:
                break
        if not step:
            warnings.warn(
                "The training data ran out: this epoch got no batches, so training stops. "
                "Pass a dataset that can be iterated again (e.g. a list or a "
                "DistributedDataset over one), or fewer epochs * steps_per_epoch batches.",
                RuntimeWarning,
                stacklevel=3,
            )
            self.stop_training = True
            return None
        if not logs:  # resumed after the epoch's last step: its sums are all there is
            logs = steps_lib.means(acc)
        # The one host synchronization of the epoch.
        return {k: float(v) for k, v in self._ordered(jax.device_get(logs)).items()}

    def _ordered(self, logs: dict[str, Any]) -> dict[str, Any]:
        # Programs return dicts with sorted keys; Keras shows the loss, then the metrics.
        return {k: logs[k] for k in self._compiled_spec.names if k in logs}

    # evaluate -----------------------------------------------------------------------------
    def _evaluate_data(self, data: Any, cbs: Any) -> dict[str, float]:
        program = self._program(("eval",))
        acc = self._zero_sums()
        logs: dict[str, Any] = {}
        cbs.on_test_begin()
        batch_hooks = _implements(cbs, "test_batch")
        for i, (batch, mask, _) in enumerate(_prefetch(data.batches())):
            if batch_hooks:
                cbs.on_test_batch_begin(i)
            acc, logs = program(self._state, acc, batch, mask)
            dispatch.track(logs)
            if batch_hooks:
                cbs.on_test_batch_end(i, self._ordered(logs))
        result = {k: float(v) for k, v in self._ordered(jax.device_get(logs)).items()}
        cbs.on_test_end(dict(result))
        return result

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[callbacks_lib.Callback] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """Computes the loss and metrics over data, as Keras's ``evaluate``.

        Every real row counts once: the partial last batch is padded and masked.

        Args:
          x: inputs (arrays) or a dataset of ``(x, y)`` batches.
          y: targets, for array inputs.
          batch_size: the global batch size for arrays (default 32).
          verbose: 0, 1, 2 or ``"auto"``, as in `fit`.
          sample_weight: per-example weights for array inputs.
          steps: for datasets, how many batches to evaluate (default: all).
          callbacks: callbacks whose ``on_test_*`` hooks are called.
          return_dict: return ``{name: value}`` instead of a list.

        Returns:
          The loss (a float) when there are no metrics, else ``[loss, *metrics]``; or the
          dict with `return_dict`.
        """
        if _is_array_tree(x) and y is None:
            raise ValueError("`y` is required when `x` holds arrays; pass evaluate(x, y).")
        data = self._data(
            x, y, sample_weight, batch_size=batch_size, shuffle=False, steps=steps, arg="x"
        )
        self._ensure_ready(self._first_x(data), training=True)
        cbs = callbacks_lib.CallbackList(
            callbacks,
            model=self,
            add_progbar=verbose != 0,
            verbose=verbose,
            steps=data.steps,
        )
        result = self._evaluate_data(data, cbs)
        if return_dict:
            return result
        values = [result[name] for name in self.metrics_names]
        return values[0] if len(values) == 1 else values

    # predict ----------------------------------------------------------------------------
    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        steps: int | None = None,
        callbacks: Sequence[callbacks_lib.Callback] | None = None,
    ) -> Any:
        """The model's outputs (inference mode), one row for each input row.

        Args:
          x: inputs (arrays) or a dataset of batches (``x`` or ``(x, ...)``).
          batch_size: the global batch size for arrays (default 32).
          verbose: 0, 1, 2 or ``"auto"``, as in `fit`.
          steps: for datasets, how many batches to predict (default: all).
          callbacks: callbacks whose ``on_predict_*`` hooks are called.

        Returns:
          NumPy arrays (a pytree, as the module returns) with one row per input row.
        """
        data = self._data(x, None, None, batch_size=batch_size, shuffle=False, steps=steps, arg="x")
        self._ensure_ready(self._first_x(data), training=False)
        program = self._program(("predict",))
        cbs = callbacks_lib.CallbackList(
            callbacks,
            model=self,
            add_progbar=verbose != 0,
            verbose=verbose,
            steps=data.steps,
        )
        cbs.on_predict_begin()
        outputs: list[tuple[Any, Any, int | None]] = []
        for i, (batch, mask, rows) in enumerate(_prefetch(data.batches())):
            cbs.on_predict_batch_begin(i)
            y_pred = program(self._state, batch[0])
            dispatch.track(y_pred)
            for leaf in jax.tree.leaves(y_pred):
                leaf.copy_to_host_async()
            if rows is None:
                mask.copy_to_host_async()
            outputs.append((y_pred, mask, rows))
            cbs.on_predict_batch_end(i, {"outputs": y_pred})
        cbs.on_predict_end()
        if not outputs:
            raise ValueError("`x` gave no batches to predict.")
        pieces = []
        for y_pred, mask, rows in outputs:
            keep = slice(0, rows) if rows is not None else np.asarray(mask)
            pieces.append(jax.tree.map(lambda a, keep=keep: np.asarray(a)[keep], y_pred))
        return jax.tree.map(lambda *parts: np.concatenate(parts), *pieces)

    def __repr__(self) -> str:
        return f"Model(name={self.name!r}, strategy={self._strategy!r}, built={self.built})"
