"""Keras 3's losses and optimizers for jstrategy's ``compile`` and train-step factory.

`loss` makes a ``keras.losses.Loss`` a `jstrategy.losses.Loss`: the step takes Keras's
per-example values (its ``call``) and reduces them over the global batch's real rows, as
Keras reduces over its batch. `optimizer` makes a ``keras.optimizers.Optimizer`` an optax
transformation through ``stateless_apply``, so its state is the train state's and every
strategy updates as Keras does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jstrategy._src.keras3.backend import require_keras
from jstrategy._src.training.losses import Loss

keras = require_keras("jstrategy.keras.loss and optimizer")

__all__ = ["KerasLoss", "loss", "optimizer"]


class KerasLoss(Loss):
    """A ``keras.losses.Loss`` as a `jstrategy.losses.Loss` (made by `loss`).

    Args:
      keras_loss: the Keras loss; its ``reduction`` is kept.

    Example:

    >>> import keras, numpy as np
    >>> from jstrategy.keras import KerasLoss
    >>> mse = KerasLoss(keras.losses.MeanSquaredError())
    >>> mse.name, mse.values(np.zeros((2, 1)), np.ones((2, 1))).tolist()
    ('mean_squared_error', [1.0, 1.0])
    """

    def __init__(self, keras_loss: Any):
        if not isinstance(keras_loss, keras.losses.Loss):
            raise TypeError(
                f"jstrategy.keras.loss takes a keras.losses.Loss; got "
                f"{type(keras_loss).__name__}. For a function fn(y_true, y_pred), pass it "
                "to compile as it is."
            )
        super().__init__(reduction=keras_loss.reduction or "none", name=keras_loss.name)
        self.keras_loss = keras_loss

    def call(self, y_true: Any, y_pred: Any) -> Any:
        # As Keras's Loss.__call__: both in the loss's dtype, then its per-example values.
        dtype = self.keras_loss.dtype
        y_true = jax.tree.map(lambda v: jnp.asarray(v, dtype), y_true)
        y_pred = jax.tree.map(lambda v: jnp.asarray(v, dtype), y_pred)
        return self.keras_loss.call(y_true, y_pred)

    def get_config(self) -> dict[str, Any]:
        return {"keras_loss": keras.losses.serialize(self.keras_loss)}


def loss(keras_loss: Any) -> KerasLoss:
    """A ``keras.losses.Loss`` for jstrategy's ``compile`` or ``make_train_step``.

    Example:

    >>> import keras, numpy as np
    >>> from jstrategy.keras import loss
    >>> ce = loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> float(ce(np.array([0]), np.array([[0.0, 0.0]])))  # log 2
    0.6931471824645996
    """
    return KerasLoss(keras_loss)


def optimizer(keras_optimizer: Any) -> optax.GradientTransformation:
    """A ``keras.optimizers.Optimizer`` as an optax transformation, for jstrategy's
    ``compile`` or ``create_train_state``.

    The Keras optimizer is built for the parameters on the first ``init`` (one model per
    optimizer, as in Keras); its variables (iteration count, moments) are the optax state,
    and each update is Keras's ``stateless_apply``: learning-rate schedules, clipping,
    weight decay and EMA as Keras computes them. jstrategy's learning-rate callbacks
    (``ReduceLROnPlateau``, ``LearningRateScheduler``) set an optax rate and do not reach
    it: give the Keras optimizer a schedule instead.

    Example:

    >>> import keras, jax.numpy as jnp
    >>> from jstrategy.keras import optimizer
    >>> tx = optimizer(keras.optimizers.SGD(0.5))
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"].tolist()
    [-0.5, -0.5]
    """
    if not isinstance(keras_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"jstrategy.keras.optimizer takes a keras.optimizers.Optimizer; got "
            f"{type(keras_optimizer).__name__}."
        )

    def init(params: Any) -> Any:
        leaves = jax.tree.leaves(params)
        if not keras_optimizer.built:
            # Built from shapes alone, and eagerly even when `init` is traced: Keras's
            # variables hold concrete values, never a trace's.
            with jax.ensure_compile_time_eval():
                keras_optimizer.build(
                    [
                        keras.Variable(np.zeros(leaf.shape, leaf.dtype), name=f"param_{i}")
                        for i, leaf in enumerate(leaves)
                    ]
                )
        elif len(keras_optimizer._trainable_variables) != len(leaves):
            raise ValueError(
                f"This Keras optimizer was built for "
                f"{len(keras_optimizer._trainable_variables)} variables; these parameters "
                f"have {len(leaves)}. Give each model its own keras.optimizers object."
            )
        return [jnp.asarray(v.value) for v in keras_optimizer.variables]

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        if params is None:
            raise ValueError("jstrategy.keras.optimizer's update needs the parameters.")
        leaves, treedef = jax.tree.flatten(params)
        new, state = keras_optimizer.stateless_apply(state, jax.tree.leaves(updates), leaves)
        steps = [jnp.asarray(n) - p for n, p in zip(new, leaves, strict=True)]
        return jax.tree.unflatten(treedef, steps), list(state)

    return optax.GradientTransformation(init, update)
