"""Train states: the typed protocol every step, `Model` and strategy relies on, and linen's.

A train state is an immutable pytree (a `flax.struct.PyTreeNode`) that knows how to run
its model and apply an update. `TrainStateProtocol` is the whole interface: the compiled
steps call `forward` and `apply_update`, `jstrategy.Model` saves, loads and summarizes
through it, and strategies (`ParameterServerStrategy`'s `fit`) swap its variables. Linen's
`TrainState` (here) and `NNXTrainState` (`nnx.py`) implement it; nothing else asks which
one it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state as flax_train_state

from jstrategy._src import flax_annotations
from jstrategy._src.layers.base import TRAIN_KEYWORDS
from jstrategy._src.layers.base import train_keyword
from jstrategy._src.layers.base import train_kwargs
from jstrategy._src.layers.regularizers import LOSSES
from jstrategy._src.placement import create_placed
from jstrategy._src.placement import in_device_memory
from jstrategy._src.placement import lower_creation
from jstrategy._src.precision import policy as mp
from jstrategy._src.precision.loss_scale import DynamicLossScale
from jstrategy._src.strategy import get_strategy
from jstrategy._src.training import summary as summary_lib
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.state import global_batch
from jstrategy._src.training.state import trainable
from jstrategy._src.training.state import weight_order as weight_order_lib
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.values import is_key

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "TrainState",
    "TrainStateProtocol",
    "as_train_state",
    "compile_train_state_creation",
    "create_train_state",
    "loss_scale_for",
    "train_state_shapes",
]

_S = TypeVar("_S", bound="TrainStateProtocol")

# Keyword arguments that tell a Flax module whether it is training, and the value each
# takes in training mode (``deterministic`` is the negation).


class TrainStateProtocol(Protocol):
    """What a train state offers the steps, `jstrategy.Model` and the strategies.

    Implementations are immutable pytrees: every ``with_*`` and `apply_update` returns a
    new state. `params` are the trained variables; `model_state` the variables the forward
    pass updates without gradients (BatchNorm statistics, NNX random-stream counts), or
    None.

    Example:

    >>> import jax.numpy as jnp, optax, flax.linen as nn, jstrategy
    >>> from flax import nnx
    >>> from jstrategy.training import TrainStateProtocol
    >>> from jstrategy.training import create_nnx_train_state, create_train_state
    >>> with jstrategy.OneDeviceStrategy("cpu:0").scope():
    ...     linen = create_train_state(nn.Dense(2), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     nnx_state = create_nnx_train_state(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    >>> def describe(state: TrainStateProtocol) -> str:   # any train state the steps take
    ...     return f"{type(state).__name__}: step {int(state.step)}"
    >>> describe(linen), describe(nnx_state)
    ('TrainState: step 0', 'NNXTrainState: step 0')
    """

    @property
    def step(self) -> Any:
        """The number of optimizer steps taken."""
        ...

    @property
    def params(self) -> Any:
        """The trained variables."""
        ...

    @property
    def opt_state(self) -> Any:
        """The optimizer state."""
        ...

    @property
    def tx(self) -> optax.GradientTransformation:
        """The optimizer."""
        ...

    @property
    def model_state(self) -> Any:
        """The variables the forward pass updates without gradients, or None."""
        ...

    @property
    def variables(self) -> Any:
        """The model's variables as Flax shows them (for users and `Model.variables`)."""
        ...

    @property
    def loss_scale(self) -> DynamicLossScale | None:
        """The dynamic loss scale the train step applies (float16 compute), or None."""
        ...

    @property
    def grad_accumulator(self) -> Any:
        """A gradient-accumulation cycle in progress (`GradientAccumulator`), or None."""
        ...

    def replace(self: _S, **updates: Any) -> _S:
        """The state with fields replaced (a `flax.struct.PyTreeNode`'s ``replace``)."""
        ...

    def forward(
        self,
        params: Any,
        x: Any,
        *,
        train: bool,
        axis_name: str | None,
        sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL,
        row_mask: Any = None,
    ) -> tuple[Any, Any]:
        """Runs the model on `x` with `params`: ``(y_pred, new model_state or None)``.

        In training mode the new `model_state` is returned. Inside a per-replica step over
        the data axis `axis_name` (`x` this replica's rows, `row_mask` which of them are
        real), Dropout layers draw the mask of their global rows and BatchNorm layers
        without ``axis_name`` take statistics over the global batch (per replica with
        `sync_batch_norm` ``PER_REPLICA``), so the step follows one device's
        (`global_batch`); `jstrategy.layers.BatchNormalization` leaves padding rows out of
        them. With `axis_name` None the rows given are the batch.
        """
        ...

    def forward_with_losses(
        self,
        params: Any,
        x: Any,
        *,
        train: bool,
        axis_name: str | None,
        sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL,
        row_mask: Any = None,
    ) -> tuple[Any, Any, Any]:
        """`forward`, plus the sum of the losses the model adds (regularization penalties,
        Keras's ``model.losses``) or None when it adds none; the train and evaluation
        steps add it to the loss."""
        ...

    def apply_update(self: _S, grads: Any, model_state: Any) -> _S:
        """The state after one optimizer step on `grads`, with the new `model_state`."""
        ...

    def replica_view(self: _S, *, with_params: bool = False) -> _S:
        """The state without `opt_state` (and `params`, unless `with_params`): what the
        replicas read besides the parameters they are given."""
        ...

    def with_variables(self: _S, params: Any, model_state: Any) -> _S:
        """The state with other `params` and `model_state`."""
        ...

    def with_step(self: _S, step: Any) -> _S:
        """The state with another step count."""
        ...

    def with_optimizer(self: _S, tx: optax.GradientTransformation) -> _S:
        """The state with optimizer `tx`, a fresh optimizer state and step 0 (unplaced)."""
        ...

    def weights(self) -> dict[str, Any]:
        """The variables saved as weights, by the state's field names."""
        ...

    def with_weights(self: _S, weights: dict[str, Any]) -> _S:
        """The state with the weights `weights()` returns replaced (by field name)."""
        ...

    def get_weights(self) -> list[Any]:
        """The weights as a list of arrays, in Keras's order (`weight_order`: Keras's
        ``get_weights``)."""
        ...

    def weight_names(self) -> list[str]:
        """The names of `get_weights`'s arrays, in its order (``"dense/kernel"``)."""
        ...

    def with_weight_list(self: _S, weights: list[Any]) -> _S:
        """The state with weights from a list like `get_weights` returns (unplaced)."""
        ...

    def summary_table(self, module: Any, sample: Any) -> str:
        """A Keras-like summary table of `module` with this state's variables."""
        ...

    def write_back(self, module: Any) -> None:
        """Copies the variables into `module` where the module holds its own (NNX)."""
        ...


class TrainState(flax_train_state.TrainState):
    """Flax's `TrainState` plus BatchNorm statistics, a dropout key and the train flag.

    An immutable pytree: steps return a new one (``state.replace(...)``). Implements
    `TrainStateProtocol` for linen modules.

    Attributes:
      step: the number of optimizer steps taken (an int32 array).
      params: the trained parameters (the ``"params"`` collection).
      opt_state: the optimizer's state.
      batch_stats: the ``"batch_stats"`` collection (BatchNorm running statistics), or None.
      rng: the base dropout key. Step ``s`` uses ``fold_in(fold_in(rng, s), 0)`` on
        every replica; Dropout layers keep their rows of the global batch's mask.
      train_arg: the keyword of the module's ``__call__`` that switches training mode
        (``"train"``, ``"training"`` or ``"deterministic"``), or None if it has none.
      loss_scale: the `jstrategy.mixed_precision.DynamicLossScale` the train step
        applies, or None (no loss scaling; the default except for float16 compute).
      grad_accumulator: the gradient-accumulation cycle in progress (a
        `GradientAccumulator`, with ``gradient_accumulation_steps`` > 1), or None.
      weight_order: the variables' paths in Keras's order (`weight_order.linen_order`,
        recorded when the module is initialized), for `get_weights`; None: sorted.
      layer_plan: the frozen layers and weight constraints the optimizer honours
        (`trainable.LayerPlan`), read from the module's `jstrategy.layers`.

    Example:

    >>> import jax.numpy as jnp, optax, flax.linen as nn, jstrategy
    >>> from jstrategy.training import TrainState, create_train_state
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     state = create_train_state(nn.Dense(2), optax.adam(1e-3), jnp.ones((1, 3)))
    >>> isinstance(state, TrainState), state.params["kernel"].shape, int(state.step)
    (True, (3, 2), 0)
    """

    batch_stats: Any = None
    rng: Any = None
    train_arg: str | None = struct.field(pytree_node=False, default=None)
    weight_order: tuple[weight_order_lib.Path, ...] | None = struct.field(
        pytree_node=False, default=None
    )
    layer_plan: trainable.LayerPlan = struct.field(pytree_node=False, default=trainable.LayerPlan())
    loss_scale: DynamicLossScale | None = None
    grad_accumulator: Any = None

    @property
    def variables(self) -> dict[str, Any]:
        """The Flax variables: ``{"params": ..., "batch_stats": ...}`` (the latter if any)."""
        out = {"params": self.params}
        if self.batch_stats is not None:
            out["batch_stats"] = self.batch_stats
        return out

    @property
    def model_state(self) -> Any:
        """The BatchNorm statistics, or None."""
        return self.batch_stats

    def _mode_kwargs(self, train: bool) -> dict[str, Any]:
        return train_kwargs(self.train_arg, train)

    def forward(
        self,
        params: Any,
        x: Any,
        *,
        train: bool,
        axis_name: str | None,
        sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL,
        row_mask: Any = None,
    ) -> tuple[Any, Any]:
        return self._apply(params, x, train, axis_name, sync_batch_norm, row_mask, losses=False)[:2]

    def forward_with_losses(
        self,
        params: Any,
        x: Any,
        *,
        train: bool,
        axis_name: str | None,
        sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL,
        row_mask: Any = None,
    ) -> tuple[Any, Any, Any]:
        # Layers sow their penalties into the "losses" collection when it is mutable
        # (`jstrategy.layers`' regularizers); nothing is added when none does.
        return self._apply(params, x, train, axis_name, sync_batch_norm, row_mask, losses=True)

    def _apply(
        self,
        params: Any,
        x: Any,
        train: bool,
        axis_name: str | None,
        sync_batch_norm: BatchNormSync,
        row_mask: Any,
        *,
        losses: bool,
    ) -> tuple[Any, Any, Any]:
        variables = {"params": params}
        if self.batch_stats is not None:
            variables["batch_stats"] = self.batch_stats
        kwargs = self._mode_kwargs(train)
        if train and self.rng is not None:
            # The same key on every replica: Dropout draws the global batch's mask and
            # keeps this replica's rows (`global_batch`). (Folding in 0, the first
            # replica's index, keeps one-replica trajectories as they always were.)
            step_key = jax.random.fold_in(self.rng, self.step)
            kwargs["rngs"] = {"dropout": jax.random.fold_in(step_key, 0)}
        mutable = ["batch_stats"] if train and self.batch_stats is not None else []
        if losses:
            mutable.append(LOSSES)
        with global_batch.linen_global_batch(
            x,
            axis_name=axis_name if train else None,
            sync_batch_norm=sync_batch_norm,
            row_mask=row_mask,
        ):
            if not mutable:
                return self.apply_fn(variables, x, **kwargs), None, None
            y_pred, updates = self.apply_fn(variables, x, mutable=mutable, **kwargs)
        sown = jax.tree.leaves(updates.get(LOSSES, {}))
        total = sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in sown) if sown else None
        return y_pred, updates.get("batch_stats") if "batch_stats" in mutable else None, total

    def apply_update(self, grads: Any, model_state: Any) -> TrainState:
        if model_state is not None:
            return self.apply_gradients(grads=grads, batch_stats=model_state)
        return self.apply_gradients(grads=grads)

    def replica_view(self, *, with_params: bool = False) -> TrainState:
        return self.replace(
            params=self.params if with_params else None, opt_state=None, grad_accumulator=None
        )

    def with_variables(self, params: Any, model_state: Any) -> TrainState:
        return self.replace(params=params, batch_stats=model_state)

    def with_step(self, step: Any) -> TrainState:
        return self.replace(step=step)

    def with_optimizer(self, tx: optax.GradientTransformation) -> TrainState:
        state = in_device_memory(self)
        tx = trainable.honour(tx, self.layer_plan)  # frozen layers, constraints
        return state.replace(
            tx=tx,
            opt_state=tx.init(state.params),
            step=jnp.zeros((), jnp.int32),
            grad_accumulator=None,
        )

    def weights(self) -> dict[str, Any]:
        return self.variables

    def with_weights(self, weights: dict[str, Any]) -> TrainState:
        return self.replace(**weights)

    def _ordered(self) -> tuple[weight_order_lib.Path, ...] | None:
        order = self.weight_order
        if order is None or weight_order_lib.get_leaves(self.variables, order) is None:
            return None
        return order

    def get_weights(self) -> list[Any]:
        order = self._ordered()
        if order is None:
            return jax.tree.leaves(self.variables)
        return weight_order_lib.get_leaves(self.variables, order) or []

    def weight_names(self) -> list[str]:
        order = self._ordered()
        paths = order or weight_order_lib.leaf_paths(self.variables)
        return ["/".join(path[1:]) for path in paths]

    def with_weight_list(self, weights: list[Any]) -> TrainState:
        order = self._ordered()
        if order is None:
            new = jax.tree.unflatten(jax.tree.structure(self.variables), weights)
        else:
            new = weight_order_lib.set_leaves(self.variables, order, weights)
        return self.replace(params=new["params"], batch_stats=new.get("batch_stats"))

    def summary_table(self, module: Any, sample: Any) -> str:
        # Summaries trace the module in inference mode.
        variables = in_device_memory(self.variables)
        return summary_lib.summarize(
            module, variables, sample, frozen=self.layer_plan.frozen, **self._mode_kwargs(False)
        )

    def write_back(self, module: Any) -> None:
        del module  # a linen module holds no variables


def as_train_state(state: Any) -> TrainStateProtocol:
    """`state` as a `TrainStateProtocol`: Flax's own linen `TrainState` is converted.

    Raises:
      TypeError: for anything else, naming the supported types and how to make one.
    """
    # Checked on the class: an instance check against the protocol would evaluate its
    # properties (an NNX state's `step` merges its optimizer) on every step.
    kind = type(state)
    if all(callable(getattr(kind, name, None)) for name in ("forward", "apply_update")):
        return state
    if isinstance(state, flax_train_state.TrainState):
        return TrainState(
            step=state.step,
            apply_fn=state.apply_fn,
            params=state.params,
            tx=state.tx,
            opt_state=state.opt_state,
        )
    raise TypeError(
        f"`state` must be a jstrategy.training.TrainState (linen), a Flax TrainState or an "
        f"NNXTrainState; got {type(state).__name__}. Create one with create_train_state or "
        "create_nnx_train_state."
    )


def _resolve_train_arg(module: Any, train_arg: str | None) -> str | None:
    if train_arg != "auto":
        if train_arg is not None and train_arg not in TRAIN_KEYWORDS:
            raise ValueError(
                f"`train_arg` must be 'auto', None or one of {sorted(TRAIN_KEYWORDS)}; got "
                f"{train_arg!r}."
            )
        return train_arg
    return train_keyword(module)


def _rng_key(rng: Any) -> jax.Array:
    if isinstance(rng, (int, np.integer)):
        return jax.random.key(int(rng))
    if is_key(rng):
        return rng
    if isinstance(rng, (jax.Array, np.ndarray)) and rng.shape == (2,):
        return jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32))
    raise TypeError(
        f"`rng` must be an int seed or a JAX PRNG key; got {type(rng).__name__} {rng!r}."
    )


def create_train_state(
    module: Any,
    tx: Any,
    *sample_args: Any,
    rng: Any = 0,
    strategy: Strategy | None = None,
    train_arg: str | None = "auto",
    dtype_policy: mp.Policy | str | None = None,
    **init_kwargs: Any,
) -> TrainState:
    """Initializes a linen module and its optimizer and places them as the strategy says.

    Args:
      module: a `flax.linen.Module`.
      tx: an optax gradient transformation, or a `jstrategy.optimizers` object (its
        ``tx``).
      *sample_args: example inputs for ``module.init`` (only their shapes matter; a batch
        of one row is enough).
      rng: an int seed or a PRNG key. Split into the ``"params"`` init key and the base
        ``"dropout"`` key kept in the state.
      strategy: where to place the state; None means `jstrategy.get_strategy()` (the
        innermost ``strategy.scope()``).
      train_arg: the module's training-mode keyword (``"train"``, ``"training"`` or
        ``"deterministic"``); ``"auto"`` finds it in ``module.__call__``'s signature; None
        for modules without one.
      dtype_policy: a `jstrategy.mixed_precision.Policy` or its name; None means
        `jstrategy.mixed_precision.global_policy()`. The variables (and so the optimizer
        state) are created in its variable dtype; a float16 compute dtype adds a
        `DynamicLossScale` (``state.loss_scale``), as Keras wraps the optimizer in a
        `LossScaleOptimizer`. Give the train step the same policy.
      **init_kwargs: extra keyword arguments for ``module.init``.

    Returns:
      A `TrainState` whose arrays are placed by `variable_sharding`. Where it splits
      variables across devices (FSDP, ModelParallel) the state is created there: its
      shapes come from `jax.eval_shape`, then ``module.init`` and ``tx.init`` run as one
      jitted program with ``out_shardings`` (`compile_train_state_creation`), each device
      computing only its slices; otherwise they run eagerly on this process's first
      device and the result is placed. The same `rng` gives the same values either way.

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
    strategy = strategy if strategy is not None else get_strategy()
    init, args = _creation(
        module, tx, sample_args, rng, train_arg, dtype_policy, init_kwargs, strategy
    )

    def eager() -> TrainState:
        # Eagerly, op by op: each op's kernel is cached across models, while a jitted init
        # would compile a new program for every model (seconds, for nothing reused).
        # This process's first replica device: under a multi-worker strategy the mesh's
        # first device may belong to another process.
        with jax.default_device(strategy.local_devices[0]):
            return init(*args)

    # Where variables are split (FSDP, ModelParallel) the state is created where it lives,
    # each device computing its slices: no device ever holds the whole model.
    return create_placed(init, *args, strategy=strategy, eager=eager)


def compile_train_state_creation(
    module: Any,
    tx: Any,
    *sample_args: Any,
    rng: Any = 0,
    strategy: Strategy | None = None,
    train_arg: str | None = "auto",
    dtype_policy: mp.Policy | str | None = None,
    **init_kwargs: Any,
) -> jax.stages.Compiled:
    """The compiled program that creates `create_train_state`'s state where it lives.

    Takes `create_train_state`'s arguments and returns the program it runs when the
    strategy's `variable_sharding` splits variables (FSDP, ModelParallel): ``module.init``
    and ``tx.init`` under ``jax.jit`` with ``out_shardings`` from `variable_sharding`. For
    any strategy the program is built the same way, so its ``memory_analysis()`` gives the
    creation's peak memory per device (the arguments, outputs and temporaries of one
    device's program), e.g. for a benchmark to compare with one whole copy of the state.

    Returns:
      A `jax.stages.Compiled`; nothing has run.

    Example:

    >>> import jax.numpy as jnp, optax, flax.linen as nn
    >>> import jstrategy
    >>> strategy = jstrategy.experimental.FSDPStrategy(min_shard_size=0)
    >>> program = compile_train_state_creation(
    ...     nn.Dense(64), optax.adam(1e-3), jnp.ones((1, 64)), strategy=strategy
    ... )
    >>> stats = program.memory_analysis()
    >>> whole = 3 * (64 * 64 + 64) * 4  # params and Adam's two moments, float32
    >>> stats.output_size_in_bytes < whole / 4
    True
    """
    strategy = strategy if strategy is not None else get_strategy()
    init, args = _creation(
        module, tx, sample_args, rng, train_arg, dtype_policy, init_kwargs, strategy
    )
    return lower_creation(init, *args, strategy=strategy).compile()


def train_state_shapes(
    module: Any,
    tx: Any,
    *sample_args: Any,
    rng: Any = 0,
    strategy: Strategy | None = None,
    train_arg: str | None = "auto",
    dtype_policy: mp.Policy | str | None = None,
    **init_kwargs: Any,
) -> TrainState:
    """`create_train_state`'s state as `jax.ShapeDtypeStruct` leaves, nothing computed.

    ``module.init`` and ``tx.init`` traced by `jax.eval_shape` (the sample arguments may
    be `jax.ShapeDtypeStruct` values); what `jstrategy.experimental.plan` compiles from.
    """
    strategy = strategy if strategy is not None else get_strategy()
    init, args = _creation(
        module, tx, sample_args, rng, train_arg, dtype_policy, init_kwargs, strategy
    )
    return jax.eval_shape(init, *args)


def _creation(
    module: Any,
    tx: Any,
    sample_args: tuple[Any, ...],
    rng: Any,
    train_arg: str | None,
    dtype_policy: mp.Policy | str | None,
    init_kwargs: dict[str, Any],
    strategy: Strategy,
) -> tuple[Any, tuple[Any, ...]]:
    """``(init, args)``: ``init(*args)`` is the new `TrainState`, a pure function."""
    policy = mp.as_policy(dtype_policy, argument="dtype_policy")
    if isinstance(tx, Optimizer):
        tx = tx.tx
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"`tx` must be an optax.GradientTransformation such as optax.adam(1e-3) or a "
            f"jstrategy.optimizers object; got {type(tx).__name__} {tx!r}."
        )
    key = _rng_key(rng)
    resolved = _resolve_train_arg(module, train_arg)
    kwargs = dict(init_kwargs)
    if resolved is not None and resolved not in kwargs:
        kwargs.update(train_kwargs(resolved, False))

    def init(key: jax.Array, *sample_args: Any) -> TrainState:
        params_key, dropout_key = jax.random.split(key)
        with weight_order_lib.recording_calls() as calls:
            variables = dict(
                module.init({"params": params_key, "dropout": dropout_key}, *sample_args, **kwargs)
            )
        # Keras's weight order, read before any tree operation sorts the dicts' keys, and
        # what the layers say about training (frozen ones, constraints).
        order = weight_order_lib.linen_order(variables, calls)
        plan = trainable.plan_of(calls)
        honoured = trainable.honour(tx, plan)
        # Flax's sharding annotations (nn.with_partitioning, ...) go to the strategy; the
        # state holds plain arrays.
        variables = flax_annotations.prepare(variables, strategy)
        variables = mp.cast_to_variable(variables, policy)
        unknown = sorted(set(variables) - {"params", "batch_stats"})
        if unknown:
            raise ValueError(
                f"The module creates variable collections {unknown}; the train step keeps "
                "only 'params' and 'batch_stats'. Make other collections non-persistent "
                "(e.g. do not `sow` during init)."
            )
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            apply_fn=module.apply,
            # A model of layers without weights (pooling, reshaping) has no "params".
            params=variables.get("params", {}),
            tx=honoured,
            opt_state=honoured.init(variables.get("params", {})),
            batch_stats=variables.get("batch_stats"),
            rng=dropout_key,
            train_arg=resolved,
            loss_scale=loss_scale_for(policy),
            weight_order=order,
            layer_plan=plan,
        )

    return init, (key, *sample_args)


def uses_loss_scale(policy: mp.Policy) -> bool:
    """Whether a step under `policy` scales its loss: float16 compute, as in Keras."""
    return policy.compute_dtype == "float16"


def loss_scale_for(policy: mp.Policy) -> DynamicLossScale | None:
    """A new state's loss scale: Keras's dynamic one for float16 compute, else None."""
    return DynamicLossScale.create() if uses_loss_scale(policy) else None
