"""`RMSprop`: Keras 3's update step."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jstrategy._src.registry import register_saveable
from jstrategy._src.training.optimizers import transform as keras_transform
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.optimizers.base import cast_like
from jstrategy._src.validation import check_number

__all__ = ["RMSprop"]


@register_saveable(kind="optimizer")
class RMSprop(Optimizer):
    """RMSprop: Keras 3's ``RMSprop`` (epsilon inside the root; the momentum, if any,
    accumulates rate-scaled increments).

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      rho: the decay of the moving average of squared gradients.
      momentum: in [0, 1]; 0 for none.
      epsilon: added to the average before the root.
      centered: divide by the variance rather than the second moment.
      **kwargs: `Optimizer`'s.

    Example:

    >>> RMSprop().get_config()["rho"]
    0.9
    """

    _hyperparameters: tuple[str, ...] = ("rho", "momentum", "epsilon", "centered")

    def __init__(
        self,
        learning_rate: Any = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.rho = check_number(rho, "rho", low=0.0, high=1.0, high_open=True)
        self.momentum = check_number(momentum, "momentum", low=0.0, high=1.0)
        self.epsilon = check_number(epsilon, "epsilon", low=0, low_open=True)
        self.centered = bool(centered)

    def _rule(self) -> keras_transform.UpdateRule:
        rho, momentum, eps, centered = self.rho, self.momentum, self.epsilon, self.centered
        names: tuple[tuple[str, float], ...] = (("velocity", 0.0),)
        if momentum > 0:
            names += (("momentum", 0.0),)
        if centered:
            names += (("average_gradient", 0.0),)

        def leaf(g: Any, v: Any, slots: Any, lr: Any, t: Any, extra: Any) -> Any:
            lr, g = cast_like(lr, v), g.astype(v.dtype)
            velocity = rho * slots[0] + (1 - rho) * jnp.square(g)
            out = [velocity]
            if centered:
                average_grad = rho * slots[-1] + (1 - rho) * g
                denominator = velocity - jnp.square(average_grad) + eps
            else:
                denominator = velocity + eps
            increment = (lr * g) / jnp.sqrt(denominator)
            if momentum > 0:
                mom = momentum * slots[1] + increment
                out.append(mom)
                v = v - mom
            else:
                v = v - increment
            if centered:
                out.append(average_grad)
            return v, tuple(out)

        return keras_transform.UpdateRule(names, leaf)
