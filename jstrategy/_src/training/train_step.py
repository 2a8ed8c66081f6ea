"""Compiled, strategy-aware train, eval and predict steps for Flax (linen; NNX in `nnx.py`).

A step is ONE compiled SPMD program: ``jax.jit(jax.shard_map(...))`` over the strategy's
mesh. The train state is replicated (in_specs ``P()``) and donated; each replica sees its
slice of the global batch (``P("replica")``). Inside, each replica differentiates the
mask-weighted *sum* of its per-example losses with respect to a per-replica (varying) copy
of the parameters, so JAX inserts no implicit reduction; the gradients, the loss and metric
sums, the count of real rows and any per-replica mutable state are then combined by ONE
call to ``strategy.cross_device_ops.all_reduce`` (so `HierarchicalCopyAllReduce` changes the
program's communication, not the numbers). Dividing by the global count of real rows makes
the loss the mean over real rows of the global batch: padding never skews it, and every
strategy follows the same trajectory as `OneDeviceStrategy` up to float rounding.

The model-specific parts (how to call the model, which leaves are trained, how to apply
the update) live in an adapter chosen by the train state's type: linen's `TrainState`
here, `NNXTrainState` in `nnx.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state as flax_train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import context
from jstrategy._src import dispatch
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.training import losses as losses_lib
from jstrategy._src.training import metrics as metrics_lib
from jstrategy._src.values import PerReplica
from jstrategy._src.values import device_put_global
from jstrategy._src.values import is_per_replica
from jstrategy._src.values import varying_axes

__all__ = [
    "EvalStep",
    "PredictStep",
    "TrainState",
    "TrainStep",
    "create_train_state",
    "make_eval_step",
    "make_predict_step",
    "make_train_step",
    "place_state",
]

# Keyword arguments that tell a Flax module whether it is training, and the value each
# takes in training mode (``deterministic`` is the negation).
_TRAIN_ARGS = {"train": True, "training": True, "deterministic": False}
_COUNT = "count"


# ---------------------------------------------------------------------------------------
# Train state and placement
# ---------------------------------------------------------------------------------------
class TrainState(flax_train_state.TrainState):
    """Flax's `TrainState` plus BatchNorm statistics, a dropout key and the train flag.

    An immutable pytree: steps return a new one (``state.replace(...)``).

    Attributes:
      step: the number of optimizer steps taken (an int32 array).
      params: the trained parameters (the ``"params"`` collection).
      opt_state: the optimizer's state.
      batch_stats: the ``"batch_stats"`` collection (BatchNorm running statistics), or None.
      rng: the base dropout key. Step ``s`` on replica ``r`` uses
        ``fold_in(fold_in(rng, s), r)``: different on every replica, reproducible.
      train_arg: the keyword of the module's ``__call__`` that switches training mode
        (``"train"``, ``"training"`` or ``"deterministic"``), or None if it has none.
    """

    batch_stats: Any = None
    rng: Any = None
    train_arg: str | None = struct.field(pytree_node=False, default=None)

    @property
    def variables(self) -> dict[str, Any]:
        """The Flax variables: ``{"params": ..., "batch_stats": ...}`` (the latter if any)."""
        out = {"params": self.params}
        if self.batch_stats is not None:
            out["batch_stats"] = self.batch_stats
        return out


def place_state(tree: Any, strategy: Any = None) -> Any:
    """Places a train state (or any pytree of variables) where `strategy` keeps variables.

    Each leaf goes to ``strategy.variable_sharding(leaf, path)``: one full copy per replica
    for OneDevice, Mirrored and TPU strategies, one copy in host memory for
    `CentralStorageStrategy` with several compute devices.

    Args:
      tree: a pytree of arrays (NumPy or JAX).
      strategy: the strategy; None means `jstrategy.get_strategy()`.

    Returns:
      The same pytree, its arrays placed as the strategy says.

    Example:

    >>> import jax.numpy as jnp
    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> placed = place_state({"w": jnp.ones(3)}, strategy)
    >>> len(placed["w"].sharding.device_set)
    2
    """
    strategy = strategy if strategy is not None else context.get_strategy()
    shardings = variable_shardings(tree, strategy)
    if all(s.is_fully_addressable for s in jax.tree.leaves(shardings)):
        return jax.device_put(tree, shardings)  # one batched transfer
    # Shardings spanning other processes' devices (MultiWorkerMirrored): each process
    # places the pieces its own devices hold.
    return jax.tree.map(device_put_global, tree, shardings)


def in_device_memory(tree: Any) -> Any:
    """`tree` with every array held in host memory copied to device memory, same devices.

    Eager JAX operations that create an array "like" another (``jnp.zeros_like``, hence
    optax's ``tx.init``) fail on host-memory arrays such as `CentralStorageStrategy`'s
    ("Memory kind mismatch with xla::PjRtBuffers"). Run them on this copy and put the
    results back with `place_state`. Arrays in device memory are returned as they are.

    Args:
      tree: a pytree of arrays.

    Returns:
      The same pytree, every array in device memory.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    >>> w = in_device_memory({"w": jax.device_put(jnp.ones(2), host)})["w"]
    >>> w.sharding.memory_kind
    'device'
    """

    def move(x: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding.memory_kind in _HOST_MEMORY:
            return jax.device_put(x, x.sharding.with_memory_kind("device"))
        return x

    return jax.tree.map(move, tree)


_HOST_MEMORY = ("pinned_host", "unpinned_host")


def _key_name(key: Any) -> str:
    # The names checkpoints use, so `variable_sharding` sees the same paths in both.
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    a = np.asarray(x)
    return jax.ShapeDtypeStruct(a.shape, jax.dtypes.canonicalize_dtype(a.dtype))


def variable_shardings(tree: Any, strategy: Any) -> Any:
    """``strategy.variable_sharding`` of every leaf of `tree`, as a pytree of shardings."""
    return jax.tree_util.tree_map_with_path(
        lambda keypath, x: strategy.variable_sharding(
            _abstract(x), tuple(_key_name(k) for k in keypath)
        ),
        tree,
    )


def _resolve_train_arg(module: Any, train_arg: str | None) -> str | None:
    if train_arg != "auto":
        if train_arg is not None and train_arg not in _TRAIN_ARGS:
            raise ValueError(
                f"`train_arg` must be 'auto', None or one of {sorted(_TRAIN_ARGS)}; got "
                f"{train_arg!r}."
            )
        return train_arg
    try:
        params = inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in _TRAIN_ARGS if name in params), None)


def _rng_key(rng: Any) -> jax.Array:
    if isinstance(rng, (int, np.integer)):
        return jax.random.key(int(rng))
    if isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    if isinstance(rng, (jax.Array, np.ndarray)) and rng.shape == (2,):
        return jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32))
    raise TypeError(
        f"`rng` must be an int seed or a JAX PRNG key; got {type(rng).__name__} {rng!r}."
    )


def create_train_state(
    module: Any,
    tx: optax.GradientTransformation,
    *sample_args: Any,
    rng: Any = 0,
    strategy: Any = None,
    train_arg: str | None = "auto",
    **init_kwargs: Any,
) -> TrainState:
    """Initializes a linen module and its optimizer and places them as the strategy says.

    Args:
      module: a `flax.linen.Module`.
      tx: an Optax gradient transformation.
      *sample_args: example inputs for ``module.init`` (only their shapes matter; a batch
        of one row is enough).
      rng: an int seed or a PRNG key. Split into the ``"params"`` init key and the base
        ``"dropout"`` key kept in the state.
      strategy: where to place the state; None means `jstrategy.get_strategy()` (the
        innermost ``strategy.scope()``).
      train_arg: the module's training-mode keyword (``"train"``, ``"training"`` or
        ``"deterministic"``); ``"auto"`` finds it in ``module.__call__``'s signature; None
        for modules without one.
      **init_kwargs: extra keyword arguments for ``module.init``.

    Returns:
      A `TrainState` whose arrays are placed by `place_state`.

    Raises:
      ValueError: if the module creates variable collections other than ``"params"`` and
        ``"batch_stats"``.

    Example:

    >>> import jax.numpy as jnp, optax, flax.linen as nn
    >>> import jstrategy
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     state = create_train_state(nn.Dense(3), optax.sgd(0.1), jnp.ones((1, 4)))
    >>> state.params["kernel"].shape, int(state.step)
    ((4, 3), 0)
    """
    strategy = strategy if strategy is not None else context.get_strategy()
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"`tx` must be an optax.GradientTransformation such as optax.adam(1e-3); got "
            f"{type(tx).__name__} {tx!r}."
        )
    key = _rng_key(rng)
    params_key, dropout_key = jax.random.split(key)
    resolved = _resolve_train_arg(module, train_arg)
    kwargs = dict(init_kwargs)
    if resolved is not None and resolved not in kwargs:
        kwargs[resolved] = resolved == "deterministic"

    # Eagerly, op by op: each op's kernel is cached across models, while a jitted init
    # would compile a new program for every model (seconds, for nothing reused).
    # This process's first replica device: under a multi-worker strategy the mesh's first
    # device may belong to another process.
    with jax.default_device(strategy.local_devices[0]):
        variables = dict(
            module.init({"params": params_key, "dropout": dropout_key}, *sample_args, **kwargs)
        )
        opt_state = tx.init(variables["params"])
    unknown = sorted(set(variables) - {"params", "batch_stats"})
    if unknown:
        raise ValueError(
            f"The module creates variable collections {unknown}; the train step keeps only "
            "'params' and 'batch_stats'. Make other collections non-persistent (e.g. do "
            "not `sow` during init)."
        )
    params = variables["params"]
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        apply_fn=module.apply,
        params=params,
        tx=tx,
        opt_state=opt_state,
        batch_stats=variables.get("batch_stats"),
        rng=dropout_key,
        train_arg=resolved,
    )
    return place_state(state, strategy)


# ---------------------------------------------------------------------------------------
# Adapters: the model-specific parts of a step
# ---------------------------------------------------------------------------------------
class _LinenAdapter:
    """Linen `TrainState` (Flax's, or ours with batch_stats/rng/train_arg)."""

    @staticmethod
    def params(state):
        return state.params

    @staticmethod
    def forward(state, params, x, *, train: bool, axis_name: str):
        variables = {"params": params}
        batch_stats = getattr(state, "batch_stats", None)
        if batch_stats is not None:
            variables["batch_stats"] = batch_stats
        kwargs: dict[str, Any] = {}
        train_arg = getattr(state, "train_arg", None)
        if train_arg is not None:
            kwargs[train_arg] = train if train_arg != "deterministic" else not train
        rng = getattr(state, "rng", None)
        if train and rng is not None:
            step_key = jax.random.fold_in(rng, state.step)
            kwargs["rngs"] = {
                "dropout": jax.random.fold_in(step_key, jax.lax.axis_index(axis_name))
            }
        if train and batch_stats is not None:
            y_pred, updates = state.apply_fn(variables, x, mutable=["batch_stats"], **kwargs)
            return y_pred, updates["batch_stats"]
        return state.apply_fn(variables, x, **kwargs), None

    @staticmethod
    def apply(state, grads, new_model_state):
        if new_model_state is not None:
            return state.apply_gradients(grads=grads, batch_stats=new_model_state)
        return state.apply_gradients(grads=grads)


_ADAPTERS: list[tuple[type, Any]] = [(flax_train_state.TrainState, _LinenAdapter)]


def register_adapter(state_type: type, adapter: Any) -> None:
    """Teaches the step factory a new train-state type (used by `nnx.py`)."""
    _ADAPTERS.insert(0, (state_type, adapter))


def _adapter_for(state: Any) -> Any:
    for state_type, adapter in _ADAPTERS:
        if isinstance(state, state_type):
            return adapter
    raise TypeError(
        f"`state` must be a jstrategy.training.TrainState (linen), a Flax TrainState or an "
        f"NNXTrainState; got {type(state).__name__}. Create one with create_train_state or "
        "create_nnx_train_state."
    )


# ---------------------------------------------------------------------------------------
# Losses, metrics and batches
# ---------------------------------------------------------------------------------------
def resolve_loss(loss: Any) -> losses_lib.Loss:
    """A `Loss` from a name, a Loss object or a callable (see `jstrategy.losses.get`)."""
    if loss is None:
        raise ValueError(
            "`loss` must be a loss name (e.g. 'mse'), a jstrategy.losses object or a "
            "callable (y_true, y_pred) -> per-example losses; got None."
        )
    return losses_lib.get(loss)


def resolve_metrics(metrics: Any, loss: Any = None) -> list[tuple[str, Callable]]:
    """``(name, metric)`` pairs from names, Metric objects or callables."""
    if metrics is None:
        return []
    if isinstance(metrics, str) or callable(metrics):
        metrics = [metrics]
    out: list[tuple[str, Callable]] = []
    for identifier in metrics:
        metric = metrics_lib.get(identifier, loss=loss)
        name = metric.name
        if name in (_COUNT, "loss") or any(name == n for n, _ in out):
            raise ValueError(
                f"Metric names must be unique and not 'loss' or 'count'; got {name!r} after "
                f"{[n for n, _ in out]}. Give the metric another `name`."
            )
        out.append((name, metric))
    return out


def _per_example(values: Any, rows: int, what: str) -> jax.Array:
    values = jnp.asarray(values)
    if values.ndim == 0 or values.shape[0] != rows:
        raise ValueError(
            f"The {what} must return one value per example, shape ({rows}, ...); got shape "
            f"{values.shape}. Return per-example values (jstrategy.losses objects do); do not "
            "take the mean over the batch."
        )
    if values.ndim > 1:
        values = jnp.mean(values, axis=tuple(range(1, values.ndim)))
    return values.astype(jnp.float32)


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


def split_batch(batch: Any, strategy: Any) -> tuple[Any, Any]:
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
    rows = {int(np.shape(v)[0]) for v in values if np.ndim(v) > 0}
    n = strategy.num_replicas_in_sync
    for r in rows:
        if r % n:
            raise ValueError(
                f"The global batch has {r} rows, which does not divide among {n} replicas. "
                "Distribute it with jstrategy's distribute_batch or a distributed dataset, "
                "which pad it and set the row mask."
            )
    return jax.tree.unflatten(treedef, values), mask


_ONES_MASKS: dict[Any, jax.Array] = {}


def ones_mask(rows: int, sharding: NamedSharding, lead: tuple[int, ...] = ()) -> jax.Array:
    """A cached all-true row mask (a full batch has no padding)."""
    key = (rows, lead, sharding)
    mask = _ONES_MASKS.get(key)
    if mask is None:
        mask = jax.device_put(np.ones((*lead, rows), bool), sharding)
        _ONES_MASKS[key] = mask
    return mask


def _batch_rows(x: Any) -> int:
    leaves = [leaf for leaf in jax.tree.leaves(x) if np.ndim(leaf) > 0]
    if not leaves:
        raise ValueError("The batch's inputs `x` must contain at least one array.")
    return int(np.shape(leaves[0])[0])


# ---------------------------------------------------------------------------------------
# Per-replica bodies (traced inside shard_map)
# ---------------------------------------------------------------------------------------
def _to_varying(tree: Any, axis_name: str) -> Any:
    """Marks invariant leaves as per-replica, so their gradient is not implicitly summed."""

    def cast(x):
        if axis_name in varying_axes(x):
            return x
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a step computes: the loss and metrics, on which strategy."""

    strategy: Any
    loss: Callable | None
    metrics: tuple[tuple[str, Callable], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return (("loss",) if self.loss is not None else ()) + tuple(n for n, _ in self.metrics)

    def zero_sums(self) -> dict[str, Any]:
        return {name: np.float32(0) for name in (*self.names, _COUNT)}


def _sums(spec: StepSpec, y, y_pred, weight, maskf, loss_sum=None) -> dict[str, jax.Array]:
    rows = maskf.shape[0]
    out: dict[str, jax.Array] = {}
    if spec.loss is not None:
        if loss_sum is None:
            per = _per_example(spec.loss(y, y_pred), rows, "loss")
            loss_sum = jnp.sum(per * weight)
        out["loss"] = loss_sum
    for name, fn in spec.metrics:
        out[name] = jnp.sum(_per_example(fn(y, y_pred), rows, f"metric {name!r}") * maskf)
    out[_COUNT] = jnp.sum(maskf)
    return out


def _weights(maskf, w):
    if w is None:
        return maskf
    w = jnp.asarray(w, jnp.float32)
    return maskf * w.reshape(w.shape[0], -1).mean(axis=1)


def grad_body(spec: StepSpec, state, batch, mask):
    """One replica's gradients; returns ``(grads, new mutable state, sums)``, all-reduced.

    The gradients are those of the mean loss over the global batch's real rows; the
    mutable state (e.g. BatchNorm statistics) is averaged over replicas. Everything it
    returns is identical on every replica.
    """
    strategy = spec.strategy
    axis = strategy.axis_name
    adapter = _adapter_for(state)
    x, y, w = unpack_batch(batch)
    if y is None:
        raise ValueError("A training batch must be (x, y) or (x, y, sample_weight); got no y.")
    maskf = mask.astype(jnp.float32)
    weight = _weights(maskf, w)
    rows = maskf.shape[0]

    def local_loss(params):
        y_pred, aux = adapter.forward(state, params, x, train=True, axis_name=axis)
        per = _per_example(spec.loss(y, y_pred), rows, "loss")
        return jnp.sum(per * weight), (y_pred, aux)

    params = _to_varying(adapter.params(state), axis)
    (loss_sum, (y_pred, aux)), grads = jax.value_and_grad(local_loss, has_aux=True)(params)
    sums = _sums(spec, y, y_pred, weight, maskf, loss_sum=loss_sum)
    # Per-replica mutable state (e.g. unsynchronized BatchNorm statistics) is averaged, as
    # tf.distribute aggregates such variables with MEAN.
    aux_leaves, aux_tree = jax.tree.flatten(aux)
    varying = [i for i, leaf in enumerate(aux_leaves) if axis in varying_axes(leaf)]
    grads, sums, synced = strategy.cross_device_ops.all_reduce(
        ReduceOp.SUM, (grads, sums, [aux_leaves[i] for i in varying]), mesh=strategy.mesh
    )
    n = strategy.num_replicas_in_sync
    for i, leaf in zip(varying, synced, strict=True):
        aux_leaves[i] = (leaf / n).astype(aux_leaves[i].dtype)
    aux = jax.tree.unflatten(aux_tree, aux_leaves)
    denom = jnp.maximum(sums[_COUNT], 1.0)
    grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
    return grads, aux, sums


def train_body(spec: StepSpec, state, batch, mask):
    """One training step on one replica; returns the new state and all-reduced sums."""
    grads, aux, sums = grad_body(spec, state, batch, mask)
    return _adapter_for(state).apply(state, grads, aux), sums


def eval_body(spec: StepSpec, state, batch, mask):
    """One evaluation step on one replica; returns all-reduced loss and metric sums."""
    strategy = spec.strategy
    adapter = _adapter_for(state)
    x, y, w = unpack_batch(batch)
    if y is None:
        raise ValueError("An evaluation batch must be (x, y) or (x, y, sample_weight).")
    maskf = mask.astype(jnp.float32)
    y_pred, _ = adapter.forward(state, adapter.params(state), x, train=False, axis_name="")
    sums = _sums(spec, y, y_pred, _weights(maskf, w), maskf)
    return strategy.cross_device_ops.all_reduce(ReduceOp.SUM, sums, mesh=strategy.mesh)


def predict_body(state, x):
    adapter = _adapter_for(state)
    y_pred, _ = adapter.forward(state, adapter.params(state), x, train=False, axis_name="")
    return y_pred


def means(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Each sum divided by the count of real rows (the count itself dropped)."""
    denom = jnp.maximum(sums[_COUNT], 1.0)
    return {k: v / denom for k, v in sums.items() if k != _COUNT}


# ---------------------------------------------------------------------------------------
# Programs used by the public steps and by Model (several steps per execution)
# ---------------------------------------------------------------------------------------
def _row_spec(strategy, lead: int) -> P:
    return P(*([None] * lead), strategy.axis_name)


_PROBE = jax.ShapeDtypeStruct((), jnp.float32)


def _staged(strategy) -> bool:
    """Whether `strategy` keeps variables off the replicas' device memory (CentralStorage).

    The compiled programs compute on one copy per replica (`replicated_sharding`); when
    `Strategy.variable_sharding` says variables live elsewhere, the steps are staged: see
    `_StagedTrain`.
    """
    return strategy.variable_sharding(_PROBE) != strategy.replicated_sharding()


def _compute_view(state: Any, strategy: Any) -> Any:
    """What the replicas compute with: the state minus its optimizer state, on each replica.

    The optimizer state is only needed where the update is applied, so it never leaves
    the variables' home.
    """
    if hasattr(state, "opt_state"):
        state = state.replace(opt_state=None)
    return jax.device_put(state, strategy.replicated_sharding())


def _move(x: Any, sharding: jax.sharding.Sharding) -> Any:
    """A value replicated over the replicas, on `sharding`: one of its shards when it can."""
    if isinstance(x, jax.Array) and len(sharding.device_set) == 1:
        (device,) = sharding.device_set
        for shard in x.addressable_shards:
            if shard.device == device:
                return shard.data  # no copy: the replica on that device holds it already
    return jax.device_put(x, sharding)


class _StagedTrain:
    """A training step for strategies that keep variables where the replicas do not compute.

    As TF's CentralStorageStrategy, each step is two compiled programs:

    1. On the replicas, ``jax.jit(jax.shard_map(grad_body))``: the parameters, copied from
       their home to every replica's device memory, give the all-reduced gradients (and
       the averaged mutable state) of the global batch. The copies are donated to the
       gradients, which reuse their buffers.
    2. On the variables' home, the update, applied once: the program takes the state as it
       lives (e.g. in host memory), moves it to device memory inside
       (``jax.device_put(..., memory_kind="device")``), applies the gradients and writes
       the new state back home through ``out_shardings``. The state is donated, so the
       update overwrites it in place.

    One program cannot do both: a jitted program's arguments must all live on its devices,
    and one central copy lives on one device while the batch is split over all of them.
    """

    def __init__(self, spec: StepSpec, *, lead: int):
        strategy = spec.strategy
        self._strategy = strategy
        self._home = strategy.variable_sharding(_PROBE).with_memory_kind("device")
        self._updates: dict[Any, Any] = {}
        rows = _row_spec(strategy, lead)

        def grads_program(params, rest, acc, batch, mask, index):
            if lead:
                batch, mask = jax.tree.map(lambda v: v[index], (batch, mask))
            grads, aux, sums = grad_body(spec, rest.replace(params=params), batch, mask)
            acc = sums if acc is None else jax.tree.map(jnp.add, acc, sums)
            return grads, aux, acc, means(acc)

        self._grads = jax.jit(
            jax.shard_map(
                grads_program,
                mesh=strategy.mesh,
                in_specs=(P(), P(), P(), rows, rows, P()),
                out_specs=(P(), P(), P(), P()),
            ),
            donate_argnums=(0, 2),
        )

    def _grad_args(self, state, acc, batch, mask, index):
        view = _compute_view(state, self._strategy)
        return view.params, view.replace(params=None), acc, batch, mask, index

    def _update(self, state: Any) -> Any:
        key = jax.tree.structure(state)
        program = self._updates.get(key)
        if program is None:
            shardings = variable_shardings(state, self._strategy)
            on_device = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)

            def update(state, grads, aux):
                state = jax.device_put(state, on_device)
                return _adapter_for(state).apply(state, grads, aux)

            program = jax.jit(update, out_shardings=shardings, donate_argnums=(0,))
            self._updates[key] = program
        return program

    def __call__(self, state, acc, batch, mask, index=None):
        """One step: ``(state, acc, logs)``; `acc` None starts the sums afresh."""
        grads, aux, acc, logs = self._grads(*self._grad_args(state, acc, batch, mask, index))
        grads, aux = jax.tree.map(lambda x: _move(x, self._home), (grads, aux))
        return self._update(state)(state, grads, aux), acc, logs

    def lower(self, state, batch, mask) -> Any:
        """The lowered gradient program (the one with the cross-device communication)."""
        return self._grads.lower(*self._grad_args(state, None, batch, mask, None))


def _staged_train_program(spec: StepSpec, *, steps: int, stacked: bool):
    staged = _StagedTrain(spec, lead=1 if steps and stacked else 0)
    indices = [np.int32(i) for i in range(steps)]

    def train_program(state, acc, batch, mask):
        if not steps:
            return staged(state, acc, batch, mask)
        for i in range(steps):
            if stacked:
                state, acc, logs = staged(state, acc, batch, mask, indices[i])
            else:
                state, acc, logs = staged(state, acc, batch[i], mask[i])
            dispatch.track(logs)
        return state, acc, logs

    return train_program


def build_train_program(spec: StepSpec, *, steps: int = 0, stacked: bool = True):
    """A jitted ``(state, acc, batch, mask) -> (state, acc, logs)`` running ``steps`` steps.

    ``acc`` holds running sums (and the count of real rows) that the steps add to; ``logs``
    are their means. With ``steps=0`` the batch is a single batch (leaves ``(B, ...)``);
    otherwise ``stacked`` batches have leaves ``(steps, B, ...)`` and mask
    ``(steps, B)``, while unstacked ones are tuples of ``steps`` batches and masks.

    For a strategy that keeps variables off the replicas (`_staged`), a callable with the
    same signature that runs the steps one by one, each as `_StagedTrain`.
    """
    strategy = spec.strategy
    if _staged(strategy):
        return _staged_train_program(spec, steps=steps, stacked=stacked)
    lead = 1 if steps and stacked else 0

    def train_program(state, acc, batch, mask):
        if not steps:
            state, sums = train_body(spec, state, batch, mask)
            acc = jax.tree.map(jnp.add, acc, sums)
            return state, acc, means(acc)
        if not stacked:
            batch = jax.tree.map(lambda *xs: jnp.stack(xs), *batch)
            mask = jnp.stack(mask)

        def one(carry, inputs):
            state, acc = carry
            state, sums = train_body(spec, state, *inputs)
            return (state, jax.tree.map(jnp.add, acc, sums)), None

        (state, acc), _ = jax.lax.scan(one, (state, acc), (batch, mask))
        return state, acc, means(acc)

    rows = _row_spec(strategy, lead)
    return jax.jit(
        jax.shard_map(
            train_program,
            mesh=strategy.mesh,
            in_specs=(P(), P(), rows, rows),
            out_specs=(P(), P(), P()),
        ),
        donate_argnums=(0, 1),
    )


def _reading_the_state(program: Callable[..., Any], strategy: Any) -> Callable[..., Any]:
    """`program(state, ...)` taking the state from where the strategy keeps it."""
    if not _staged(strategy):
        return program

    def staged(state, *args):
        return program(_compute_view(state, strategy), *args)

    staged.lower = lambda state, *args: program.lower(_compute_view(state, strategy), *args)  # type: ignore[attr-defined]
    return staged


def build_eval_program(spec: StepSpec):
    """A jitted ``(state, acc, batch, mask) -> (acc, logs)`` for one evaluation batch."""
    strategy = spec.strategy

    def eval_program(state, acc, batch, mask):
        acc = jax.tree.map(jnp.add, acc, eval_body(spec, state, batch, mask))
        return acc, means(acc)

    rows = _row_spec(strategy, 0)
    program = jax.jit(
        jax.shard_map(
            eval_program, mesh=strategy.mesh, in_specs=(P(), P(), rows, rows), out_specs=(P(), P())
        ),
        donate_argnums=(1,),
    )
    return _reading_the_state(program, strategy)


def build_predict_program(strategy):
    """A jitted ``(state, x) -> y_pred`` with outputs split by rows like the inputs."""
    rows = _row_spec(strategy, 0)
    program = jax.jit(
        jax.shard_map(predict_body, mesh=strategy.mesh, in_specs=(P(), rows), out_specs=rows)
    )
    return _reading_the_state(program, strategy)


def _placement(sharding: jax.sharding.Sharding) -> tuple[Any, ...]:
    mesh = getattr(sharding, "mesh", None)
    devices = tuple(mesh.devices.flat) if mesh is not None else tuple(sharding.device_set)
    return devices, sharding.memory_kind or "device"


def _check_state_on(state: Any, strategy: Any) -> None:
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    found = next(((k, x) for k, x in flat if isinstance(x, jax.Array)), None)
    if found is None:
        return
    keypath, leaf = found
    expected = strategy.variable_sharding(_abstract(leaf), tuple(_key_name(k) for k in keypath))
    (devices, memory), (want, want_memory) = _placement(leaf.sharding), _placement(expected)
    if set(devices) != set(want) or (len(want) > 1 and devices != want) or memory != want_memory:
        raise ValueError(
            f"The train state is not placed on the step's strategy {strategy!r} (a leaf is "
            f"in {memory} memory of {[str(d) for d in devices]}; the strategy keeps it in "
            f"{want_memory} memory of {[str(d) for d in want]}). Create the state inside the "
            "same strategy.scope(), or call place_state(state, strategy)."
        )


class _Step:
    def __init__(self, spec: StepSpec):
        self._spec = spec
        self._checked: set[Any] = set()

    @property
    def strategy(self) -> Any:
        """The strategy the step runs on."""
        return self._spec.strategy

    def _inputs(self, state, batch):
        strategy = self._spec.strategy
        key = jax.tree.structure(state)
        if key not in self._checked:
            _check_state_on(state, strategy)
            self._checked.add(key)
        values, mask = split_batch(batch, strategy)
        if mask is None:
            x = unpack_batch(values)[0]
            mask = ones_mask(_batch_rows(x), strategy.batch_sharding())
        return values, mask


class TrainStep(_Step):
    """``train_step(state, batch) -> (state, metrics)``; see `make_train_step`."""

    def __init__(self, spec: StepSpec):
        super().__init__(spec)
        strategy = spec.strategy
        self._staged = _StagedTrain(spec, lead=0) if _staged(strategy) else None
        rows = _row_spec(strategy, 0)

        def train_step(state, batch, mask):
            state, sums = train_body(spec, state, batch, mask)
            return state, means(sums)

        self._program = jax.jit(
            jax.shard_map(
                train_step, mesh=strategy.mesh, in_specs=(P(), rows, rows), out_specs=(P(), P())
            ),
            donate_argnums=(0,),
        )

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        """Runs one step: returns the new state and ``{"loss": ..., metric: ...}``.

        The input state is donated: do not use it afterwards.
        """
        values, mask = self._inputs(state, batch)
        if self._staged is not None:
            state, _, logs = self._staged(state, None, values, mask)
            return state, logs
        return self._program(state, values, mask)

    def lower(self, state: Any, batch: Any) -> Any:
        """The lowered program (``jax.stages.Lowered``) for inspecting its HLO.

        For a strategy that keeps variables off the replicas, the gradient program.
        """
        values, mask = self._inputs(state, batch)
        if self._staged is not None:
            return self._staged.lower(state, values, mask)
        return self._program.lower(state, values, mask)


class EvalStep(_Step):
    """``eval_step(state, batch) -> metrics``; see `make_eval_step`."""

    def __init__(self, spec: StepSpec):
        super().__init__(spec)
        strategy = spec.strategy
        rows = _row_spec(strategy, 0)

        def eval_step(state, batch, mask):
            return means(eval_body(spec, state, batch, mask))

        self._program = _reading_the_state(
            jax.jit(
                jax.shard_map(
                    eval_step, mesh=strategy.mesh, in_specs=(P(), rows, rows), out_specs=P()
                )
            ),
            strategy,
        )

    def __call__(self, state: Any, batch: Any) -> dict[str, jax.Array]:
        """Evaluates one batch: ``{"loss": ..., metric: ...}``, means over its real rows."""
        values, mask = self._inputs(state, batch)
        return self._program(state, values, mask)


class PredictStep(_Step):
    """``predict_step(state, x) -> PerReplica``; see `make_predict_step`."""

    def __init__(self, spec: StepSpec):
        super().__init__(spec)
        self._program = build_predict_program(spec.strategy)

    def __call__(self, state: Any, x: Any) -> Any:
        """The model's outputs for the inputs `x` (a distributed or global batch of inputs).

        Returns:
          A pytree of split `PerReplica` values (global arrays, row i for input row i),
          carrying the input's row mask so padding rows can be dropped.
        """
        values, mask = self._inputs(state, (x,))
        y_pred = self._program(state, values[0])
        return jax.tree.map(lambda v: PerReplica(v, stacked=False, mask=mask), y_pred)


def _spec(loss, metrics, strategy) -> StepSpec:
    strategy = strategy if strategy is not None else context.get_strategy()
    loss_fn = resolve_loss(loss) if loss is not None else None
    return StepSpec(strategy, loss_fn, tuple(resolve_metrics(metrics, loss=loss_fn)))


def make_train_step(
    loss: Any, *, metrics: Sequence[Any] | None = None, strategy: Any = None
) -> TrainStep:
    """Builds ``train_step(state, batch) -> (state, metrics)``, one compiled SPMD program.

    Works for linen (`TrainState` from `create_train_state`) and NNX (`NNXTrainState` from
    `create_nnx_train_state`). The state is donated; there is no host synchronization
    inside, so calls dispatch asynchronously (bound the steps in flight with
    ``jstrategy._src.dispatch.track`` in long loops on CPU).

    Each replica runs the model (training mode, its own dropout key) on its rows, and the
    gradients of the mask-weighted loss sums are all-reduced with the strategy's
    `cross_device_ops`; the loss is the mean over the real rows of the global batch. A
    module built with ``nn.BatchNorm(axis_name=jstrategy.REPLICA_AXIS)`` synchronizes its
    statistics across replicas; unsynchronized statistics are averaged after the step.

    Args:
      loss: a per-example loss: a name (``"mse"``, ...), a `jstrategy.losses` object, or
        a callable ``(y_true, y_pred) -> (batch,)`` values.
      metrics: names, `jstrategy.metrics` objects or callables returning per-example values;
        each is reported as its mean over real rows.
      strategy: the strategy; None means `jstrategy.get_strategy()`.

    Returns:
      A `TrainStep`. Call it with the state and a batch ``(x, y)`` or ``(x, y,
      sample_weight)`` whose leaves are split `PerReplica` values (from a distributed
      dataset) or global arrays whose rows divide among the replicas. It returns the new
      state and ``{"loss": ..., name: ...}``, replicated scalars.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     state = create_train_state(nn.Dense(1), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     step = make_train_step(lambda y, p: (y - p[:, 0]) ** 2)
    >>> x, y = np.ones((4, 3), np.float32), np.zeros(4, np.float32)
    >>> state, metrics = step(state, (x, y))
    >>> int(state.step), sorted(metrics)
    (1, ['loss'])
    """
    return TrainStep(_spec(loss, metrics, strategy))


def make_eval_step(
    loss: Any = None, *, metrics: Sequence[Any] | None = None, strategy: Any = None
) -> EvalStep:
    """Builds ``eval_step(state, batch) -> metrics`` (inference mode, one compiled program).

    Args:
      loss: as in `make_train_step`, or None to report metrics only.
      metrics: as in `make_train_step`.
      strategy: the strategy; None means `jstrategy.get_strategy()`.

    Returns:
      An `EvalStep` returning ``{"loss": ..., name: ...}``: means over the batch's real rows.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> with jstrategy.OneDeviceStrategy("cpu:0").scope():
    ...     state = create_train_state(nn.Dense(1), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     evaluate = make_eval_step(lambda y, p: jnp.abs(y - p[:, 0]))
    >>> sorted(evaluate(state, (np.ones((2, 3), np.float32), np.zeros(2, np.float32))))
    ['loss']
    """
    return EvalStep(_spec(loss, metrics, strategy))


def make_predict_step(*, strategy: Any = None) -> PredictStep:
    """Builds ``predict_step(state, x) -> outputs`` (inference mode, one compiled program).

    Args:
      strategy: the strategy; None means `jstrategy.get_strategy()`.

    Returns:
      A `PredictStep`; its outputs are split `PerReplica` values with the input's row mask.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     state = create_train_state(nn.Dense(2), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     predict = make_predict_step()
    >>> predict(state, np.ones((4, 3), np.float32)).value.shape
    (4, 2)
    """
    return PredictStep(_spec(None, None, strategy))
