"""Keras's activation names, resolved to JAX functions with Keras's defaults.

Keras's defaults differ from JAX's in places (``gelu`` is exact, ``leaky_relu`` has slope
0.2), so a name means what it means in Keras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["get"]


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
