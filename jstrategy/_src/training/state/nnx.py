"""Flax NNX support: `NNXTrainState` and `create_nnx_train_state`.

An NNX module and its `nnx.Optimizer` are split once into static graph definitions and
pytrees of variables (the state), so the steps from `make_train_step`, `make_eval_step`
and `make_predict_step` and `jstrategy.Model` are pure functions of an immutable pytree,
exactly as for linen: `NNXTrainState` implements the same `TrainStateProtocol`. Inside a
compiled step the module is re-assembled with ``nnx.merge``, called, updated with
``optimizer.update`` and split again.

NNX keeps its random streams (``nnx.Rngs``) in the module's state. In a training step every
replica calls the module with the same keys, and its ``nnx.Dropout`` layers keep their
rows of the global batch's mask (`global_batch`), so dropout is one device's whatever the
mesh; the stored keys stay the same (only the streams' counts advance), so runs are
reproducible and the state stays identical on every replica.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen
from flax import nnx
from flax import struct

from jstrategy._src import flax_annotations
from jstrategy._src.moe import losses as moe_losses
from jstrategy._src.placement import create_placed
from jstrategy._src.placement import in_device_memory
from jstrategy._src.placement import place_state
from jstrategy._src.precision import policy as mp
from jstrategy._src.strategy import get_strategy
from jstrategy._src.training import summary as summary_lib
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.state import global_batch
from jstrategy._src.training.state import weight_order
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.training.state.train_state import loss_scale_for

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = ["NNXTrainState", "create_nnx_train_state"]


class NNXTrainState(struct.PyTreeNode):
    """An NNX module and optimizer as an immutable pytree, for the compiled steps.

    Implements `TrainStateProtocol`.

    Attributes:
      params: the trained variables (the optimizer's ``wrt``, usually ``nnx.Param``).
      model_state: the module's other variables (BatchNorm statistics, RNG streams, ...).
      opt_state: the `nnx.Optimizer`'s variables (its step count and optax state).
      graphdef: the module's structure in training mode (static).
      eval_graphdef: the module's structure in evaluation mode (static).
      opt_graphdef: the optimizer's structure (static).
      wrt: the filter selecting the trained variables (static).
      loss_scale: the `jstrategy.mixed_precision.DynamicLossScale` the train step
        applies, or None (no loss scaling; the default except for float16 compute).
      grad_accumulator: the gradient-accumulation cycle in progress (a
        `GradientAccumulator`, with ``gradient_accumulation_steps`` > 1), or None.
      weight_order: the variables' paths in Keras's order (definition order, each
        module's parameters first: `weight_order.nnx_order`), read from the module given
        (merging a graph definition sorts attributes by name), for `get_weights`.

    Example:

    >>> import optax, jstrategy
    >>> from flax import nnx
    >>> from jstrategy.training import NNXTrainState, create_nnx_train_state
    >>> with jstrategy.OneDeviceStrategy("cpu:0").scope():
    ...     state = create_nnx_train_state(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    >>> isinstance(state, NNXTrainState), state.params["kernel"].shape, int(state.step)
    (True, (3, 2), 0)
    """

    params: nnx.State
    model_state: nnx.State
    opt_state: nnx.State
    graphdef: Any = struct.field(pytree_node=False)
    eval_graphdef: Any = struct.field(pytree_node=False)
    opt_graphdef: Any = struct.field(pytree_node=False)
    wrt: Any = struct.field(pytree_node=False, default=nnx.Param)
    loss_scale: Any = None
    grad_accumulator: Any = None
    weight_order: tuple[weight_order.Path, ...] | None = struct.field(
        pytree_node=False, default=None
    )

    @property
    def step(self) -> jax.Array:
        """The number of optimizer steps taken."""
        return self.optimizer.step[...]

    @property
    def model(self) -> nnx.Module:
        """A module (training mode) holding this state's variables.

        To copy the trained values into your own module instead:
        ``nnx.update(module, state.params, state.model_state)``.
        """
        return nnx.merge(self.graphdef, self.params, self.model_state)

    @property
    def optimizer(self) -> nnx.Optimizer:
        """An `nnx.Optimizer` holding this state's optimizer variables."""
        return nnx.merge(self.opt_graphdef, self.opt_state)

    @property
    def tx(self) -> optax.GradientTransformation:
        """The optimizer's optax transformation."""
        return self.optimizer.tx

    @property
    def variables(self) -> nnx.State:
        """The module's `nnx.State`: parameters and other variables."""
        return nnx.merge_state(self.params, self.model_state)

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
        if not train:
            model = nnx.merge(self.eval_graphdef, _fresh(params), _fresh(self.model_state))
            return model(x), None
        model_state = _fresh(_fold_keys(self.model_state))
        model = nnx.merge(self.graphdef, _fresh(params), model_state)
        check_dropout_streams(model)
        with global_batch.nnx_global_batch(
            model, x, axis_name=axis_name, sync_batch_norm=sync_batch_norm, row_mask=row_mask
        ):
            y_pred = model(x)
        _, _, model_state = split_model(model, self.wrt)
        # The stored keys stay as they were; only the streams' counts advance.
        return y_pred, _restore_keys(model_state, self.model_state)

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
        # NNX layers hand their losses (the expert layers' auxiliary losses) to the
        # forward pass that collects them: sowing would change the state's structure.
        with moe_losses.collecting() as sown:
            y_pred, model_state = self.forward(
                params,
                x,
                train=train,
                axis_name=axis_name,
                sync_batch_norm=sync_batch_norm,
                row_mask=row_mask,
            )
        total = sum(jnp.sum(v.astype(jnp.float32)) for v in sown) if sown else None
        return y_pred, model_state, total

    def apply_update(self, grads: Any, model_state: Any) -> NNXTrainState:
        model = nnx.merge(self.graphdef, _fresh(self.params), _fresh(model_state))
        optimizer = nnx.merge(self.opt_graphdef, _fresh(self.opt_state))
        optimizer.update(model, grads)
        _, params, model_state = split_model(model, self.wrt)
        _, opt_state = nnx.split(optimizer)
        return self.replace(params=params, model_state=model_state, opt_state=opt_state)

    def replica_view(self, *, with_params: bool = False) -> NNXTrainState:
        return self.replace(
            params=self.params if with_params else None, opt_state=None, grad_accumulator=None
        )

    def with_variables(self, params: Any, model_state: Any) -> NNXTrainState:
        return self.replace(params=params, model_state=model_state)

    def with_step(self, step: Any) -> NNXTrainState:
        if self.opt_state is None:
            return self
        optimizer = nnx.merge(self.opt_graphdef, _fresh(self.opt_state))
        optimizer.step[...] = jnp.asarray(step, optimizer.step[...].dtype)
        _, opt_state = nnx.split(optimizer)
        return self.replace(opt_state=opt_state)

    def with_optimizer(self, tx: optax.GradientTransformation) -> NNXTrainState:
        model = in_device_memory(self).model
        state = _split_state(model, nnx.Optimizer(model, tx, wrt=self.wrt), self.wrt)
        return state.replace(loss_scale=self.loss_scale, weight_order=self.weight_order)

    def weights(self) -> dict[str, Any]:
        return {"params": self.params, "model_state": self.model_state}

    def _weight_indices(self) -> list[int]:
        # NNX random streams (keys and counts) are not weights. The rest in Keras's order:
        # definition order, each module's parameters first (`weight_order.nnx_order`).
        variables = jax.tree.leaves(self.variables, is_leaf=_is_variable)
        paths = weight_order.leaf_paths(self.variables, is_leaf=_is_variable)
        rank = {path: i for i, path in enumerate(self.weight_order or ())}
        kept = [i for i, v in enumerate(variables) if not isinstance(v, nnx.RngState)]
        return sorted(kept, key=lambda i: rank.get(paths[i], len(rank) + i))

    def weight_names(self) -> list[str]:
        paths = weight_order.leaf_paths(self.variables, is_leaf=_is_variable)
        return ["/".join(paths[i]) for i in self._weight_indices()]

    def with_weights(self, weights: dict[str, Any]) -> NNXTrainState:
        return self.replace(**weights)

    def get_weights(self) -> list[Any]:
        leaves = jax.tree.leaves(self.variables)
        return [leaves[i] for i in self._weight_indices()]

    def with_weight_list(self, weights: list[Any]) -> NNXTrainState:
        leaves, treedef = jax.tree.flatten(self.variables)
        for i, w in zip(self._weight_indices(), weights, strict=True):
            leaves[i] = w
        merged = nnx.merge(self.graphdef, jax.tree.unflatten(treedef, leaves))
        _, params, model_state = split_model(merged, self.wrt)
        return self.replace(params=params, model_state=model_state)

    def summary_table(self, module: Any, sample: Any) -> str:
        del module  # the state holds the variables the summary shows
        return summary_lib.summarize(in_device_memory(self).model, None, sample)

    def write_back(self, module: Any) -> None:
        nnx.update(module, self.params, self.model_state)


def split_model(model: nnx.Module, wrt: Any) -> tuple[Any, nnx.State, nnx.State]:
    """``(graphdef, trained variables, other variables)`` of an NNX module."""
    graphdef, params, rest = nnx.split(model, wrt, ...)  # type: ignore[misc]
    return graphdef, params, rest


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _fresh(tree: Any) -> Any:
    # NNX variables may only be mutated at the trace level where they were created;
    # rebuilding the pytree creates new variable objects at the current one.
    return jax.tree.map(lambda x: x, tree)


def _fold_keys(model_state: nnx.State) -> nnx.State:
    # The same keys on every replica: Dropout draws the global batch's mask and keeps this
    # replica's rows (`global_batch`). (Folding in 0, the first replica's index, keeps
    # one-replica trajectories as they always were.)
    def fold(v: Any) -> Any:
        if isinstance(v, nnx.RngKey):
            key = v[...]
            fold_in = lambda k: jax.random.fold_in(k, 0)  # noqa: E731
            for _ in range(jnp.ndim(key)):  # stacked layers' keys (NNXRepeated): each one
                fold_in = jax.vmap(fold_in)
            return v.replace(value=fold_in(key))
        return v

    return jax.tree.map(fold, model_state, is_leaf=_is_variable)


def _restore_keys(new: nnx.State, old: nnx.State) -> nnx.State:
    def restore(n: Any, o: Any) -> Any:
        return o if isinstance(o, nnx.RngKey) else n

    return jax.tree.map(restore, new, old, is_leaf=_is_variable)


_STREAMS_FIX = (
    "The train step calls model(x) (no `rngs`): keep the streams in the module, as "
    "nnx.Dropout(rate, rngs=rngs) built in __init__ from the nnx.Rngs it is given, and "
    "call the random layers without rngs."
)


def check_call_signature(model: nnx.Module) -> None:
    """Refuses, before any work, a module whose ``__call__`` requires more than its input
    (the Flax tutorial's call-time ``rngs``): every step calls ``model(x)``."""
    try:
        params = list(inspect.signature(type(model).__call__).parameters.values())[1:]
    except (TypeError, ValueError):
        return
    required = [
        p.name
        for p in params[1:]
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if "rngs" in required:
        raise ValueError(
            f"{type(model).__name__}.__call__ requires `rngs`, the random streams the Flax "
            f"tutorial passes at each call. {_STREAMS_FIX}"
        )
    if required:
        raise ValueError(
            f"{type(model).__name__}.__call__ requires {', '.join(map(repr, required))} "
            "besides its input, but the steps call model(x). Give them defaults, or hold "
            "them in the module."
        )


def check_dropout_streams(model: nnx.Module) -> None:
    """Refuses, at the training step's trace (before any work), an `nnx.Dropout` made
    without ``rngs``: in training it needs a stream, which the step does not pass."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Dropout) and node.rngs is None and node.rate > 0:
            where = "/".join(str(k) for k in path) or type(model).__name__
            raise ValueError(
                f"The nnx.Dropout at {where!r} was made without `rngs`, so in training it "
                f"needs them at each call (the Flax tutorial's model(x, rngs=rngs)). "
                f"{_STREAMS_FIX}"
            )


def _keras_order(model: nnx.Module) -> tuple[weight_order.Path, ...]:
    ranks = weight_order.nnx_order(model)
    return tuple(sorted(ranks, key=ranks.__getitem__))


def _split_state(model: nnx.Module, optimizer: nnx.Optimizer, wrt: Any) -> NNXTrainState:
    training = nnx.view(
        model, deterministic=False, use_running_average=False, raise_if_not_found=False
    )
    evaluating = nnx.view(
        model, deterministic=True, use_running_average=True, raise_if_not_found=False
    )
    graphdef, params, model_state = split_model(training, wrt)
    eval_graphdef, _, _ = split_model(evaluating, wrt)
    opt_graphdef, opt_state = nnx.split(optimizer)
    return NNXTrainState(
        params=params,
        model_state=model_state,
        opt_state=opt_state,
        graphdef=graphdef,
        eval_graphdef=eval_graphdef,
        opt_graphdef=opt_graphdef,
        wrt=wrt,
    )


def create_nnx_train_state(
    model: nnx.Module,
    optimizer: Any,
    *,
    wrt: Any = nnx.Param,
    strategy: Strategy | None = None,
    dtype_policy: mp.Policy | str | None = None,
) -> NNXTrainState:
    """Splits an NNX module and its optimizer into an `NNXTrainState` placed by the strategy.

    The module itself is not modified; the steps work on the returned state. Copy trained
    values back with ``nnx.update(model, state.params, state.model_state)``.

    Args:
      model: the `nnx.Module` (already initialized, e.g. with ``rngs=nnx.Rngs(0)``), or a
        function of no arguments that creates it (``lambda: MLP(rngs=nnx.Rngs(0))``).
        Given a function, a strategy that splits variables (FSDP, ModelParallel) creates
        the module where it lives: its shapes come from `jax.eval_shape`, then the
        function and the optimizer's init run as one jitted program with
        ``out_shardings`` from `variable_sharding`, so no device holds a whole split
        variable (the same values as calling it eagerly). An existing module's variables
        are placed first, and its optimizer state is then created where it lives.
      optimizer: an ``nnx.Optimizer(model, tx, wrt=...)`` for this model (not with a
        function), or an optax transformation or `jstrategy.optimizers` object to build
        one with.
      wrt: the filter of trained variables when `optimizer` is an optax transformation;
        an `nnx.Optimizer` brings its own.
      strategy: where to place the state; None means `jstrategy.get_strategy()`.
      dtype_policy: a `jstrategy.mixed_precision.Policy` or its name; None means
        `jstrategy.mixed_precision.global_policy()`. The state's variables are its
        variable dtype (a copy of the module's, cast, if they differ; the optimizer is then
        rebuilt on the copy with its transformation); a float16 compute dtype adds a
        `DynamicLossScale` (``state.loss_scale``). Give the train step the same policy.

    Returns:
      The `NNXTrainState`, placed by `place_state`.

    Example:

    >>> import optax
    >>> from flax import nnx
    >>> import jstrategy
    >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     state = create_nnx_train_state(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    >>> state.params["kernel"].shape, int(state.step)
    ((3, 2), 0)
    """
    strategy = strategy if strategy is not None else get_strategy()
    policy = mp.as_policy(dtype_policy, argument="dtype_policy")
    factory = None
    if not isinstance(model, nnx.Module):
        if isinstance(model, linen.Module) or not callable(model):
            raise TypeError(
                f"`model` must be an nnx.Module or a function of no arguments that creates "
                f"one; got {type(model).__name__}. For linen modules use create_train_state."
            )
        factory = model
    else:
        check_call_signature(model)
    if isinstance(optimizer, Optimizer):
        optimizer = optimizer.tx
    if isinstance(optimizer, nnx.Optimizer):
        if factory is not None:
            raise TypeError(
                "With a function that creates the module, `optimizer` must be an optax "
                "transformation or a jstrategy.optimizers object (an nnx.Optimizer belongs "
                "to a module that already exists); pass its transformation, e.g. "
                "optax.adam(1e-3)."
            )
        wrt = optimizer.wrt
    elif not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"`optimizer` must be an nnx.Optimizer, an optax.GradientTransformation or a "
            f"jstrategy.optimizers object; got "
            f"{type(optimizer).__name__} {optimizer!r}."
        )

    def assemble(model: nnx.Module, optimizer: Any, order: Any) -> NNXTrainState:
        graphdef, variables = nnx.split(model)
        flax_annotations.prepare_nnx(variables, strategy)  # Flax's sharding metadata
        cast = mp.cast_to_variable(variables, policy)
        leaves = zip(jax.tree.leaves(cast), jax.tree.leaves(variables), strict=True)
        if any(a is not b for a, b in leaves):
            # Variables in another dtype: a cast copy (the user's module stays as it is),
            # with the optimizer's state created anew for it.
            model = nnx.merge(graphdef, cast)
            if isinstance(optimizer, nnx.Optimizer):
                optimizer = optimizer.tx
        if isinstance(optimizer, optax.GradientTransformation):
            optimizer = nnx.Optimizer(model, optimizer, wrt=wrt)
        state = _split_state(model, optimizer, wrt)
        return state.replace(loss_scale=loss_scale_for(policy), weight_order=order)

    # Where variables are split (FSDP, ModelParallel) the state is created where it lives
    # by one jitted program; otherwise eagerly, then placed.
    if factory is not None:

        def create() -> NNXTrainState:
            made = factory()
            if not isinstance(made, nnx.Module):
                raise TypeError(
                    f"`model` must create an nnx.Module; it returned {type(made).__name__}."
                )
            check_call_signature(made)
            return assemble(made, optimizer, _keras_order(made))

        def eager() -> NNXTrainState:
            with jax.default_device(strategy.local_devices[0]):
                return create()

        return create_placed(create, strategy=strategy, eager=eager)

    # An existing module: its variables are placed first (split, if their layout says so),
    # then the optimizer state is created next to them.
    flax_annotations.prepare_nnx(nnx.split(model)[1], strategy)  # before any placement
    order = _keras_order(model)  # read here: the module rebuilt below has sorted attributes
    graphdef, params, model_state = split_model(model, wrt)
    opt_graphdef = opt_state = None
    if isinstance(optimizer, nnx.Optimizer):
        opt_graphdef, opt_state = nnx.split(optimizer)

    def build(variables: dict[str, Any]) -> NNXTrainState:
        built = nnx.merge(graphdef, variables["params"], variables["model_state"])
        opt: Any = optimizer
        if opt_graphdef is not None:
            opt = nnx.merge(opt_graphdef, variables["opt_state"])
        return assemble(built, opt, order)

    variables = {"params": params, "model_state": model_state, "opt_state": opt_state}
    return create_placed(
        build,
        variables,
        strategy=strategy,
        eager=lambda: assemble(model, optimizer, order),
        place_args=lambda args: (place_state(args[0], strategy),),
    )
