"""Keras's activation names, resolved to JAX functions with Keras's defaults, and Keras's
activation layer with arguments, `ReLU`.

Keras's defaults differ from JAX's in places (``gelu`` is exact, ``leaky_relu`` has slope
0.2), so a name means what it means in Keras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jstrategy._src.layers.base import Layer
from jstrategy._src.registry import register_saveable
from jstrategy._src.validation import check_number

__all__ = ["ReLU", "get"]


def _linear(x: Any) -> Any:
    return x


def _hard_sigmoid(x: Any) -> Any:
    return jax.nn.relu6(x + 3.0) / 6.0


_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "linear": _linear,
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "sigmoid": jax.nn.sigmoid,
    "softmax": lambda x: jax.nn.softmax(x, axis=-1),
    "log_softmax": lambda x: jax.nn.log_softmax(x, axis=-1),
    "tanh": jnp.tanh,
    "elu": jax.nn.elu,
    "selu": jax.nn.selu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "leaky_relu": lambda x: jax.nn.leaky_relu(x, negative_slope=0.2),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "softplus": jax.nn.softplus,
    "softsign": jax.nn.soft_sign,
    "exponential": jnp.exp,
    "hard_sigmoid": _hard_sigmoid,
    "mish": jax.nn.mish,
}


def get(identifier: Any, argument: str = "activation") -> Callable[[Any], Any]:
    """The activation function for a Keras name, a callable, or None (linear).

    Raises:
      ValueError: for an unknown name or a value that is neither, naming `argument`.

    Example:

    >>> import jax.numpy as jnp
    >>> get("relu")(jnp.array([-1.0, 2.0])).tolist()
    [0.0, 2.0]
    >>> get(None)(3.0)
    3.0
    """
    if identifier is None:
        return _linear
    if isinstance(identifier, str):
        if identifier in _ACTIVATIONS:
            return _ACTIVATIONS[identifier]
        raise ValueError(
            f"`{argument}` must be a Keras activation name, a callable or None; got "
            f"{identifier!r}. Known names: {sorted(_ACTIVATIONS)}."
        )
    if callable(identifier):
        return identifier
    raise ValueError(
        f"`{argument}` must be a Keras activation name (e.g. 'relu'), a callable or None; "
        f"got {type(identifier).__name__} {identifier!r}."
    )


@register_saveable(kind="layer")
class ReLU(Layer):
    """Keras's ``ReLU`` layer: ``max(x, 0)``, with Keras's bound, slope and threshold.

    ``f(x) = max_value`` for ``x >= max_value``, ``x`` for ``threshold <= x < max_value``,
    ``negative_slope * (x - threshold)`` otherwise, computed as Keras 3 computes it (so
    its gradients are Keras's too).

    Args:
      max_value: a float >= 0, the largest output; None (default): unbounded.
      negative_slope: a float >= 0, the slope below `threshold` (default 0).
      threshold: a float >= 0, below which the output is ``negative_slope * (x -
        threshold)`` (default 0).
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Example:

    >>> import jax.numpy as jnp
    >>> x = jnp.array([-10.0, -5.0, 0.0, 5.0, 10.0])
    >>> ReLU(max_value=10, negative_slope=0.5).apply({}, x).tolist()
    [-5.0, -2.5, 0.0, 5.0, 10.0]
    >>> ReLU(max_value=6).apply({}, x).tolist()
    [0.0, 0.0, 0.0, 5.0, 6.0]
    """

    max_value: float | None = None
    negative_slope: float = 0.0
    threshold: float = 0.0
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        if self.max_value is not None:
            check_number(self.max_value, "max_value", low=0, fix="Or None: unbounded.")
        check_number(self.negative_slope, "negative_slope", low=0, fix="E.g. 0.1.")
        check_number(self.threshold, "threshold", low=0, fix="E.g. 0.5.")

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        x = jnp.asarray(self.cast_inputs(inputs))
        slope, top, threshold = self.negative_slope, self.max_value, self.threshold
        # Keras 3's `activations.relu`, op for op (its JAX backend's ops are these).
        if slope != 0 and top is None and threshold == 0:
            return jax.nn.leaky_relu(x, negative_slope=slope)
        negative_part: Any = 1
        if slope != 0:
            negative_part = jax.nn.relu(-x + threshold) if threshold != 0 else jax.nn.relu(-x)
        clip = top is not None
        if threshold != 0:
            x = jnp.where(x > jnp.asarray(threshold, x.dtype), x, 0)
        elif top == 6:
            x = jax.nn.relu6(x)
            clip = False
        else:
            x = jax.nn.relu(x)
        if clip:
            x = jnp.clip(x, jnp.asarray(0.0, x.dtype), jnp.asarray(top, x.dtype))
        if slope != 0:
            x = x - slope * negative_part
        return x
