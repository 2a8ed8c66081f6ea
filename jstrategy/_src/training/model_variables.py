"""A `jstrategy.Model` in a custom loop, as TF's tutorials use a Keras model.

TF's custom loops call the model (``model(images, training=True)``), differentiate with
respect to ``model.trainable_variables`` and hand both lists to
``optimizer.apply_gradients(zip(gradients, model.trainable_variables))``. A JAX
function is differentiated with respect to its arguments, so here the variables are an
argument of the function differentiated, and the model takes them:
``model(images, training=True, trainable_variables=variables)``.

`ModelVariables` holds the model's variables for `Strategy.run` (`tracked.TrainableHolder`):
inside `run` they are the compiled program's inputs, read before each call, and an
optimizer's update is its output, written back into the model's train state after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax

from jstrategy._src import context
from jstrategy._src.layers import symbolic
from jstrategy._src.tracked import TrainableHolder
from jstrategy._src.training.state.train_state import TrainState

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy
    from jstrategy._src.strategy_like import StrategyLike
    from jstrategy._src.training.trainer import Trainer

__all__ = ["CustomLoopMixin", "ModelVariables", "call_model"]


class ModelVariables(TrainableHolder):
    """A model's parameters, other variables and step, held in its train state.

    Args:
      trainer: the model's training side, whose ``state`` holds the variables.
    """

    def __init__(self, trainer: Trainer):
        self._trainer = trainer
        super().__init__(self._get(), name="the model's variables")

    def _get(self) -> Any:
        state = self._trainer.state
        # A linen state's step seeds dropout (its key is folded with the step); NNX keeps
        # its step with its optimizer.
        step = state.step if isinstance(state, TrainState) else None
        return {"params": state.params, "model_state": state.model_state, "step": step}

    def _set(self, value: Any) -> None:
        state = self._trainer.state.with_variables(value["params"], value["model_state"])
        if value["step"] is not None:
            state = state.with_step(value["step"])
        self._trainer.state = state

    def _placed_for(self) -> Strategy | None:
        return self._trainer.strategy

    def _place(self, strategy: StrategyLike) -> None:
        raise ValueError(
            f"The model was created under {self._trainer.strategy!r} but is used in "
            f"{strategy!r}'s run. Create the model inside the scope of the strategy whose "
            "run uses it."
        )

    def trainable(self, value: Any) -> Any:
        return value["params"]

    def with_trainable(self, value: Any, new: Any) -> Any:
        step = value["step"]
        return {**value, "params": new, "step": None if step is None else step + 1}


def call_model(
    holder: ModelVariables, x: Any, *, training: bool, trainable_variables: Any = None
) -> Any:
    """The model's outputs for `x`: `Model.__call__` (see there).

    Raises:
      ValueError: for `trainable_variables` that do not fit, or training outside `run`.
      NotImplementedError: in training mode for a model whose forward pass updates
        variables (BatchNorm statistics, NNX random streams).
    """
    value = holder.read()
    params = value["params"]
    if trainable_variables is not None:
        leaves = list(trainable_variables)
        own, treedef = jax.tree.flatten(params)
        if len(leaves) != len(own):
            raise ValueError(
                f"`trainable_variables` must hold the model's {len(own)} trainable "
                f"variables, as model.trainable_variables lists them; got {len(leaves)}."
            )
        params = jax.tree.unflatten(treedef, leaves)
    ctx = context.inside_run()
    if training and ctx is None:
        raise ValueError(
            "model(x, training=True) runs inside strategy.run, where each replica draws its "
            "own dropout key; outside run, call the model with training=False."
        )
    if training and value["model_state"] is not None:
        raise NotImplementedError(
            "model(x, training=True) in a custom loop cannot update the variables the "
            "forward pass changes (BatchNorm statistics, NNX random streams): JAX cannot "
            "write them from inside the differentiated function. Train such a model with "
            "Model.fit or jstrategy.training.make_train_step."
        )
    state = holder._trainer.state.with_variables(None, value["model_state"])
    if value["step"] is not None:
        state = state.with_step(value["step"])
    axis = ctx.strategy.axis_name if ctx is not None else None
    y_pred, _ = state.forward(params, x, train=training, axis_name=axis)
    return y_pred


class CustomLoopMixin:
    """`Model`'s surface for TF-style custom loops: variables, losses, calling it."""

    _trainer: Trainer
    _holder: ModelVariables | None = None  # made on first use

    @property
    def trainable_variables(self) -> list[Any]:
        """The trainable variables, as a list (TF's ``model.trainable_variables``).

        Differentiate with respect to it and give both lists to an optimizer:
        ``optimizer.apply_gradients(zip(gradients, model.trainable_variables))``. Inside
        `Strategy.run` it is this replica's own copy, read at every call, so the gradients
        are the replica's (the optimizer sums them over the replicas).
        """
        return self._model_variables().trainable_variables()

    @property
    def losses(self) -> list[Any]:
        """Keras's layer regularization losses: Flax layers add none, so always ``[]``.

        Add a penalty on the variables to the loss yourself (scaled by
        `jstrategy.scale_regularization_loss` inside `Strategy.run`).
        """
        return []

    def __call__(
        self, x: Any, training: bool = False, *, trainable_variables: Sequence[Any] | None = None
    ) -> Any:
        """The model's outputs for `x`, as calling a Keras model.

        Inside `Strategy.run` the variables are the program's (read at every call);
        outside, the model's current ones.

        Args:
          x: inputs, batch axis first.
          training: training mode (dropout on; inside `run` only).
          trainable_variables: the list to compute with instead of the model's own, e.g.
            the argument of the function differentiated (JAX's form of TF's
            ``GradientTape``): ``jax.grad(loss_fn)(model.trainable_variables)`` with
            ``loss_fn(v)`` calling ``model(x, training=True, trainable_variables=v)``.

        Returns:
          The module's outputs.

        Raises:
          ValueError: if the model has no variables, `trainable_variables` does not fit,
            or `training` outside `run`.
          NotImplementedError: in training mode for a model whose forward pass updates
            variables (BatchNorm, NNX random streams): use `fit` or `make_train_step`.

        Example:

        >>> import numpy as np, flax.linen as nn, jstrategy
        >>> model = jstrategy.Model(nn.Dense(2), input_shape=(3,))
        >>> model(np.ones((4, 3), np.float32)).shape
        (4, 2)
        """
        if symbolic.contains_symbolic(x):
            raise TypeError(
                "A jstrategy model is not called as a layer of a functional model (Keras's "
                "nested models): call its layers on the symbolic tensors instead, e.g. "
                "for layer in model.layers: h = layer(h), or write the whole model as one "
                "Flax module."
            )
        return call_model(
            self._model_variables(),
            x,
            training=training,
            trainable_variables=trainable_variables,
        )

    def _model_variables(self) -> ModelVariables:
        self._trainer.require_state("trainable_variables")
        holder = self._holder
        if holder is None:
            holder = self._holder = ModelVariables(self._trainer)
        return holder
