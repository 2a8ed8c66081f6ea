"""`SGD`: Keras 3's gradient descent, with optional (Nesterov) momentum."""

from __future__ import annotations

from typing import Any

from jstrategy._src.registry import register_saveable
from jstrategy._src.training.optimizers import transform as keras_transform
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.optimizers.base import cast_like
from jstrategy._src.validation import check_number

__all__ = ["SGD"]


@register_saveable(kind="optimizer")
class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum: Keras 3's ``SGD``.

    With momentum the velocity accumulates rate-scaled steps, ``v = momentum * v -
    learning_rate * g`` and ``w += v`` (Nesterov: ``w += momentum * v - learning_rate *
    g``), so a rate that changes (a schedule, `LearningRateScheduler`) scales only the
    new steps, as in Keras.

    Args:
      learning_rate: a float (default 0.01) or a schedule.
      momentum: in [0, 1]; 0 for plain gradient descent.
      nesterov: Nesterov momentum.
      **kwargs: `Optimizer`'s: `weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
        `use_ema`, `ema_momentum`, `ema_overwrite_frequency`, `loss_scale_factor`,
        `gradient_accumulation_steps`, `name`.

    Example:

    >>> import jax.numpy as jnp
    >>> opt = SGD(learning_rate=0.1, momentum=0.9)
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = opt.tx.update({"w": jnp.ones(2)}, opt.tx.init(params), params)
    >>> opt.get_config()["momentum"], opt.learning_rate, round(float(updates["w"][0]), 6)
    (0.9, 0.1, -0.1)
    """

    _hyperparameters: tuple[str, ...] = ("momentum", "nesterov")

    def __init__(
        self,
        learning_rate: Any = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.momentum = check_number(momentum, "momentum", low=0.0, high=1.0)
        self.nesterov = bool(nesterov)

    def _rule(self) -> keras_transform.UpdateRule:
        momentum, nesterov = self.momentum, self.nesterov

        def leaf(g: Any, v: Any, slots: Any, lr: Any, t: Any, extra: Any) -> Any:
            lr, g = cast_like(lr, v), g.astype(v.dtype)
            if not momentum:
                return v - g * lr, slots
            mom = cast_like(momentum, v)
            m = slots[0] * mom - g * lr
            return (v + (m * mom - g * lr) if nesterov else v + m), (m,)

        return keras_transform.UpdateRule((("momentum", 0.0),) if momentum else (), leaf)
