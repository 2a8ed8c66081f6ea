"""The Adam family: `Adam`, `AdamW`, `Adamax` and `Nadam`, Keras 3's update steps."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jstrategy._src.registry import register_saveable
from jstrategy._src.training.optimizers import transform as keras_transform
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.optimizers.base import cast_like
from jstrategy._src.validation import check_number

__all__ = ["Adam", "AdamW", "Adamax", "Nadam"]


class _AdamFamily(Optimizer):
    """What Adam, AdamW, Adamax and Nadam share: two moments and an epsilon."""

    _hyperparameters: tuple[str, ...] = ("beta_1", "beta_2", "epsilon")

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.beta_1 = check_number(beta_1, "beta_1", low=0.0, high=1.0, high_open=True)
        self.beta_2 = check_number(beta_2, "beta_2", low=0.0, high=1.0, high_open=True)
        self.epsilon = check_number(epsilon, "epsilon", low=0, low_open=True)


@register_saveable(kind="optimizer")
class Adam(_AdamFamily):
    """Adam: Keras 3's ``Adam`` (epsilon added to the root of the uncorrected second
    moment, the step size ``lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)``).

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      beta_1: the first moment's decay.
      beta_2: the second moment's decay.
      epsilon: added to the root of the second moment.
      amsgrad: use the AMSGrad variant (the running maximum of the second moment, as
        Keras keeps it).
      **kwargs: `Optimizer`'s.

    Example:

    >>> Adam().get_config()["epsilon"]
    1e-07
    """

    _hyperparameters: tuple[str, ...] = ("beta_1", "beta_2", "epsilon", "amsgrad")

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, **kwargs)
        self.amsgrad = bool(amsgrad)

    def _rule(self) -> keras_transform.UpdateRule:
        b1, b2, eps, amsgrad = self.beta_1, self.beta_2, self.epsilon, self.amsgrad

        def leaf(g: Any, v: Any, slots: Any, lr: Any, t: Any, extra: Any) -> Any:
            lr, g = cast_like(lr, v), g.astype(v.dtype)
            step = cast_like(t + 1, v)
            b1_power, b2_power = (
                jnp.power(cast_like(b1, v), step),
                jnp.power(cast_like(b2, v), step),
            )
            m, vel = slots[0], slots[1]
            alpha = lr * jnp.sqrt(1 - b2_power) / (1 - b1_power)
            m = m + (g - m) * (1 - b1)
            vel = vel + (jnp.square(g) - vel) * (1 - b2)
            out: tuple[Any, ...] = (m, vel)
            if amsgrad:
                vel = jnp.maximum(slots[2], vel)
                out = (m, out[1], vel)
            return v - (m * alpha) / (jnp.sqrt(vel) + eps), out

        names = (("momentum", 0.0), ("velocity", 0.0))
        return keras_transform.UpdateRule(
            names + ((("velocity_hat", 0.0),) if amsgrad else ()), leaf
        )


@register_saveable(kind="optimizer")
class AdamW(Adam):
    """Adam with decoupled weight decay: Keras 3's ``AdamW`` (default decay 0.004).

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      weight_decay: each step first subtracts ``variable * weight_decay *
        learning_rate``.
      beta_1: the first moment's decay.
      beta_2: the second moment's decay.
      epsilon: added to the root of the second moment.
      amsgrad: use the AMSGrad variant.
      **kwargs: `Optimizer`'s.

    Raises:
      ValueError: for ``weight_decay=None`` (Keras's message).

    Example:

    >>> AdamW().weight_decay
    0.004
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs: Any,
    ):
        if weight_decay is None:
            raise ValueError("Argument `weight_decay` must be a float. Received: weight_decay=None")
        super().__init__(
            learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay=weight_decay, **kwargs
        )


@register_saveable(kind="optimizer")
class Adamax(_AdamFamily):
    """Adamax (Adam with the infinity norm): Keras 3's ``Adamax``.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      beta_1: the first moment's decay.
      beta_2: the decay of the infinity norm.
      epsilon: added to the norm.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Adamax(learning_rate=0.002).learning_rate
    0.002
    """

    def _rule(self) -> keras_transform.UpdateRule:
        b1, b2, eps = self.beta_1, self.beta_2, self.epsilon

        def leaf(g: Any, v: Any, slots: Any, lr: Any, t: Any, extra: Any) -> Any:
            lr, g = cast_like(lr, v), g.astype(v.dtype)
            b1_power = jnp.power(cast_like(b1, v), cast_like(t + 1, v))
            m, u = slots
            m = m + (g - m) * (1 - b1)
            u = jnp.maximum(b2 * u, jnp.abs(g))
            return v - (lr * m) / ((1 - b1_power) * (u + eps)), (m, u)

        return keras_transform.UpdateRule((("momentum", 0.0), ("norm", 0.0)), leaf)


@register_saveable(kind="optimizer")
class Nadam(_AdamFamily):
    """Adam with Nesterov momentum: Keras 3's ``Nadam`` (Dozat's momentum schedule
    ``beta_1 * (1 - 0.5 * 0.96^t)`` and its running product).

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      beta_1: the first moment's decay.
      beta_2: the second moment's decay.
      epsilon: added to the root of the corrected second moment.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Nadam().get_config()["beta_2"]
    0.999
    """

    def _rule(self) -> keras_transform.UpdateRule:
        b1, b2, eps = self.beta_1, self.beta_2, self.epsilon

        def init_extra(dtype: Any) -> Any:
            return jnp.ones((), dtype)  # Keras's _u_product

        def prepare(u_product: Any, t: Any) -> Any:
            return u_product * b1 * (1.0 - 0.5 * jnp.power(0.96, cast_like(t + 1, u_product)))

        def leaf(g: Any, v: Any, slots: Any, lr: Any, t: Any, u_product: Any) -> Any:
            lr, g = cast_like(lr, v), g.astype(v.dtype)
            local_step, next_step = cast_like(t + 1, v), cast_like(t + 2, v)
            decay, beta_1, beta_2 = cast_like(0.96, v), cast_like(b1, v), cast_like(b2, v)
            u_t = beta_1 * (1.0 - 0.5 * jnp.power(decay, local_step))
            u_t_1 = beta_1 * (1.0 - 0.5 * jnp.power(decay, next_step))
            u_product_t = u_product.astype(v.dtype)
            u_product_t_1 = u_product_t * u_t_1
            beta_2_power = jnp.power(beta_2, local_step)
            m, vel = slots
            m = m + (g - m) * (1 - beta_1)
            vel = vel + (jnp.square(g) - vel) * (1 - beta_2)
            m_hat = (u_t_1 * m) / (1 - u_product_t_1) + ((1 - u_t) * g) / (1 - u_product_t)
            v_hat = vel / (1 - beta_2_power)
            return v - (m_hat * lr) / (jnp.sqrt(v_hat) + eps), (m, vel)

        return keras_transform.UpdateRule(
            (("momentum", 0.0), ("velocity", 0.0)), leaf, init_extra=init_extra, prepare=prepare
        )
