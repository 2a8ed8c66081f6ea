"""Keras's initializer names, resolved to Flax initializers ``(key, shape, dtype)``.

Keras and Flax compute the fans of a kernel the same way (the receptive field times the
input and output channels), and Keras's ``*_normal`` variance-scaling initializers are
truncated normals corrected to the stated variance, as Flax's ``"truncated_normal"``
distribution is, so each name draws from Keras's distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax.linen import initializers as init

__all__ = ["get"]

Initializer = Callable[..., jax.Array]


def _random_uniform(key: jax.Array, shape: Any, dtype: Any = jax.numpy.float32) -> jax.Array:
    """Keras's ``RandomUniform()``: uniform in [-0.05, 0.05)."""
    return jax.random.uniform(key, shape, dtype, minval=-0.05, maxval=0.05)


_INITIALIZERS: dict[str, Initializer] = {
    "glorot_uniform": init.variance_scaling(1.0, "fan_avg", "uniform"),
    "glorot_normal": init.variance_scaling(1.0, "fan_avg", "truncated_normal"),
    "he_uniform": init.variance_scaling(2.0, "fan_in", "uniform"),
    "he_normal": init.variance_scaling(2.0, "fan_in", "truncated_normal"),
    "lecun_uniform": init.variance_scaling(1.0, "fan_in", "uniform"),
    "lecun_normal": init.variance_scaling(1.0, "fan_in", "truncated_normal"),
    "zeros": init.zeros,
    "ones": init.ones,
    # Keras's RandomNormal and TruncatedNormal defaults (RandomUniform: below).
    "normal": init.normal(stddev=0.05),
    "truncated_normal": init.truncated_normal(stddev=0.05),
    "uniform": _random_uniform,
    "orthogonal": init.orthogonal(),
}
_ALIASES = {
    "zero": "zeros",
    "one": "ones",
    "random_uniform": "uniform",
    "random_normal": "normal",
    "GlorotUniform": "glorot_uniform",
    "GlorotNormal": "glorot_normal",
    "HeUniform": "he_uniform",
    "HeNormal": "he_normal",
    "LecunUniform": "lecun_uniform",
    "LecunNormal": "lecun_normal",
    "Zeros": "zeros",
    "Ones": "ones",
    "RandomUniform": "uniform",
    "RandomNormal": "normal",
    "TruncatedNormal": "truncated_normal",
    "Orthogonal": "orthogonal",
}


def get(identifier: Any, argument: str) -> Initializer:
    """The Flax initializer for a Keras name or a callable ``(key, shape, dtype)``.

    Raises:
      ValueError: for an unknown name or a value that is neither, naming `argument`.

    Example:

    >>> import jax
    >>> w = get("uniform", "embeddings_initializer")(jax.random.key(0), (1000,))
    >>> bool((w >= -0.05).all() and (w < 0.05).all())
    True
    """
    if isinstance(identifier, str):
        name = _ALIASES.get(identifier, identifier)
        if name in _INITIALIZERS:
            return _INITIALIZERS[name]
        raise ValueError(
            f"`{argument}` must be a Keras initializer name or a Flax initializer "
            f"(key, shape, dtype) -> array; got {identifier!r}. Known names: "
            f"{sorted(_INITIALIZERS)}."
        )
    if callable(identifier):
        return identifier
    raise ValueError(
        f"`{argument}` must be a Keras initializer name (e.g. 'glorot_uniform') or a Flax "
        f"initializer (key, shape, dtype) -> array; got {type(identifier).__name__} "
        f"{identifier!r}."
    )
