"""`Lion`: Keras 3's update step."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jstrategy._src.registry import register_saveable
from jstrategy._src.training.optimizers import transform as keras_transform
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.optimizers.base import cast_like
from jstrategy._src.validation import check_number

__all__ = ["Lion"]


@register_saveable(kind="optimizer")
class Lion(Optimizer):
    """Lion (sign of an interpolated momentum): Keras 3's ``Lion``.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      beta_1: the interpolation factor of the update, in (0, 1].
      beta_2: the momentum's decay.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Lion().get_config()["beta_2"]
    0.99
    """

    _hyperparameters: tuple[str, ...] = ("beta_1", "beta_2")

    def __init__(
        self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.99, **kwargs: Any
    ):
        super().__init__(learning_rate, **kwargs)
        self.beta_1 = check_number(beta_1, "beta_1", low=0.0, high=1.0)
        self.beta_2 = check_number(beta_2, "beta_2", low=0.0, high=1.0)
        if self.beta_1 <= 0:
            raise ValueError(
                "Argument `beta_1` must be in the [0, 1] range. Otherwise, the optimizer "
                f"degenerates to SignSGD. Received: beta_1={beta_1}."
            )

    def _rule(self) -> keras_transform.UpdateRule:
        b1, b2 = self.beta_1, self.beta_2

        def leaf(g: Any, v: Any, slots: Any, lr: Any, t: Any, extra: Any) -> Any:
            lr, g = cast_like(lr, v), g.astype(v.dtype)
            beta_1, beta_2 = cast_like(b1, v), cast_like(b2, v)
            m = slots[0]
            v = v - lr * jnp.sign(m * beta_1 + g * (1.0 - beta_1))
            return v, (m * beta_2 + g * (1.0 - beta_2),)

        return keras_transform.UpdateRule((("momentum", 0.0),), leaf)
