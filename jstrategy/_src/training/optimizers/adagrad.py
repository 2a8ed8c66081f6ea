"""The Adagrad family: `Adagrad` and `Adadelta`, Keras 3's update steps."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jstrategy._src.registry import register_saveable
from jstrategy._src.training.optimizers import transform as keras_transform
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.optimizers.base import cast_like
from jstrategy._src.validation import check_number

__all__ = ["Adadelta", "Adagrad"]


@register_saveable(kind="optimizer")
class Adagrad(Optimizer):
    """Adagrad: Keras 3's ``Adagrad``.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      initial_accumulator_value: the starting sum of squared gradients.
      epsilon: added to the sum before the root.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Adagrad().get_config()["initial_accumulator_value"]
    0.1
    """

    _hyperparameters: tuple[str, ...] = ("initial_accumulator_value", "epsilon")

    def __init__(
        self,
        learning_rate: Any = 0.001,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.initial_accumulator_value = check_number(
            initial_accumulator_value, "initial_accumulator_value", low=0
        )
        self.epsilon = check_number(epsilon, "epsilon", low=0, low_open=True)

    def _rule(self) -> keras_transform.UpdateRule:
        eps = self.epsilon

        def leaf(g: Any, v: Any, slots: Any, lr: Any, t: Any, extra: Any) -> Any:
            lr, g = cast_like(lr, v), g.astype(v.dtype)
            accumulator = slots[0] + jnp.square(g)
            return v - (lr * g) / jnp.sqrt(accumulator + eps), (accumulator,)

        return keras_transform.UpdateRule((("accumulator", self.initial_accumulator_value),), leaf)


@register_saveable(kind="optimizer")
class Adadelta(Optimizer):
    """Adadelta: Keras 3's ``Adadelta``.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      rho: the decay of the moving averages.
      epsilon: added inside the roots.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Adadelta().get_config()["rho"]
    0.95
    """

    _hyperparameters: tuple[str, ...] = ("rho", "epsilon")

    def __init__(
        self, learning_rate: Any = 0.001, rho: float = 0.95, epsilon: float = 1e-7, **kwargs: Any
    ):
        super().__init__(learning_rate, **kwargs)
        self.rho = check_number(rho, "rho", low=0.0, high=1.0, high_open=True)
        self.epsilon = check_number(epsilon, "epsilon", low=0, low_open=True)

    def _rule(self) -> keras_transform.UpdateRule:
        rho, eps = self.rho, self.epsilon

        def rms(x: Any) -> Any:
            return jnp.sqrt(x + eps)

        def leaf(g: Any, v: Any, slots: Any, lr: Any, t: Any, extra: Any) -> Any:
            lr, g = cast_like(lr, v), g.astype(v.dtype)
            accumulated_grad, accumulated_delta_var = slots
            accumulated_grad = rho * accumulated_grad + (1 - rho) * jnp.square(g)
            delta_var = -((rms(accumulated_delta_var) * g) / rms(accumulated_grad))
            accumulated_delta_var = rho * accumulated_delta_var + (1 - rho) * jnp.square(delta_var)
            return v + lr * delta_var, (accumulated_grad, accumulated_delta_var)

        return keras_transform.UpdateRule(
            (("accumulated_grad", 0.0), ("accumulated_delta_var", 0.0)), leaf
        )
