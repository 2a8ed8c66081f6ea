"""Flax NNX support for the step factory: `NNXTrainState` and `create_nnx_train_state`.

An NNX module and its `nnx.Optimizer` are split once into static graph definitions and
pytrees of variables (the state), so the steps from `make_train_step`, `make_eval_step`
and `make_predict_step` are pure functions of an immutable pytree, exactly as for linen:
inside the compiled step the module is re-assembled with ``nnx.merge``, called, updated
with ``optimizer.update`` and split again.

NNX keeps its random streams (``nnx.Rngs``) in the module's state. In a training step each
replica folds its replica index into every stream's key before calling the module, so
dropout differs across replicas; the stored keys stay the same (only the streams' counts
advance), so runs are reproducible and the state stays identical on every replica.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx
from flax import struct

from jstrategy._src import context
from jstrategy._src.training import train_step as train_step_lib

__all__ = ["NNXTrainState", "create_nnx_train_state"]


class NNXTrainState(struct.PyTreeNode):
    """An NNX module and optimizer as an immutable pytree, for the compiled steps.

    Attributes:
      params: the trained variables (the optimizer's ``wrt``, usually ``nnx.Param``).
      model_state: the module's other variables (BatchNorm statistics, RNG streams, ...).
      opt_state: the `nnx.Optimizer`'s variables (its step count and optax state).
      graphdef: the module's structure in training mode (static).
      eval_graphdef: the module's structure in evaluation mode (static).
      opt_graphdef: the optimizer's structure (static).
      wrt: the filter selecting the trained variables (static).
    """

    params: nnx.State
    model_state: nnx.State
    opt_state: nnx.State
    graphdef: Any = struct.field(pytree_node=False)
    eval_graphdef: Any = struct.field(pytree_node=False)
    opt_graphdef: Any = struct.field(pytree_node=False)
    wrt: Any = struct.field(pytree_node=False, default=nnx.Param)

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


def _fold_keys(model_state: nnx.State, axis_name: str) -> nnx.State:
    index = jax.lax.axis_index(axis_name)

    def fold(v):
        if isinstance(v, nnx.RngKey):
            return v.replace(value=jax.random.fold_in(v[...], index))
        return v

    return jax.tree.map(fold, model_state, is_leaf=_is_variable)


def _restore_keys(new: nnx.State, old: nnx.State) -> nnx.State:
    def restore(n, o):
        return o if isinstance(o, nnx.RngKey) else n

    return jax.tree.map(restore, new, old, is_leaf=_is_variable)


class _NNXAdapter:
    @staticmethod
    def params(state: NNXTrainState):
        return state.params

    @staticmethod
    def forward(state: NNXTrainState, params, x, *, train: bool, axis_name: str):
        if not train:
            model = nnx.merge(state.eval_graphdef, _fresh(params), _fresh(state.model_state))
            return model(x), None
        model_state = _fresh(_fold_keys(state.model_state, axis_name))
        model = nnx.merge(state.graphdef, _fresh(params), model_state)
        y_pred = model(x)
        _, _, model_state = split_model(model, state.wrt)
        # The folded keys were this replica's; the stored keys stay shared.
        return y_pred, _restore_keys(model_state, state.model_state)

    @staticmethod
    def apply(state: NNXTrainState, grads, model_state):
        model = nnx.merge(state.graphdef, _fresh(state.params), _fresh(model_state))
        optimizer = nnx.merge(state.opt_graphdef, _fresh(state.opt_state))
        optimizer.update(model, grads)
        _, params, model_state = split_model(model, state.wrt)
        _, opt_state = nnx.split(optimizer)
        return state.replace(params=params, model_state=model_state, opt_state=opt_state)


train_step_lib.register_adapter(NNXTrainState, _NNXAdapter)


def create_nnx_train_state(
    model: nnx.Module,
    optimizer: nnx.Optimizer | optax.GradientTransformation,
    *,
    wrt: Any = nnx.Param,
    strategy: Any = None,
) -> NNXTrainState:
    """Splits an NNX module and its optimizer into an `NNXTrainState` placed by the strategy.

    The module itself is not modified; the steps work on the returned state. Copy trained
    values back with ``nnx.update(model, state.params, state.model_state)``.

    Args:
      model: the `nnx.Module` (already initialized, e.g. with ``rngs=nnx.Rngs(0)``).
      optimizer: an ``nnx.Optimizer(model, tx, wrt=...)`` for this model, or an optax
        transformation to build one with.
      wrt: the filter of trained variables when `optimizer` is an optax transformation;
        an `nnx.Optimizer` brings its own.
      strategy: where to place the state; None means `jstrategy.get_strategy()`.

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
    strategy = strategy if strategy is not None else context.get_strategy()
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"`model` must be an nnx.Module; got {type(model).__name__}. For linen modules "
            "use create_train_state."
        )
    if isinstance(optimizer, optax.GradientTransformation):
        optimizer = nnx.Optimizer(model, optimizer, wrt=wrt)
    elif isinstance(optimizer, nnx.Optimizer):
        wrt = optimizer.wrt
    else:
        raise TypeError(
            f"`optimizer` must be an nnx.Optimizer or an optax.GradientTransformation; got "
            f"{type(optimizer).__name__} {optimizer!r}."
        )
    training = nnx.view(
        model, deterministic=False, use_running_average=False, raise_if_not_found=False
    )
    evaluating = nnx.view(
        model, deterministic=True, use_running_average=True, raise_if_not_found=False
    )
    graphdef, params, model_state = split_model(training, wrt)
    eval_graphdef, _, _ = split_model(evaluating, wrt)
    opt_graphdef, opt_state = nnx.split(optimizer)
    state = NNXTrainState(
        params=params,
        model_state=model_state,
        opt_state=opt_state,
        graphdef=graphdef,
        eval_graphdef=eval_graphdef,
        opt_graphdef=opt_graphdef,
        wrt=wrt,
    )
    return train_step_lib.place_state(state, strategy)
