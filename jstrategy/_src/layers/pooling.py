"""Keras's 2-D pooling layers as linen modules: `MaxPooling2D`, `AveragePooling2D`,
`GlobalAveragePooling2D`."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jstrategy._src.layers.base import Layer
from jstrategy._src.layers.conv import check_data_format
from jstrategy._src.layers.conv import check_image_inputs
from jstrategy._src.layers.conv import check_padding
from jstrategy._src.layers.conv import pair
from jstrategy._src.registry import register_saveable

__all__ = ["AveragePooling2D", "GlobalAveragePooling2D", "MaxPooling2D"]


def _window(size: tuple[int, int], channels_first: bool) -> tuple[int, ...]:
    return (1, 1, *size) if channels_first else (1, *size, 1)


class _Pooling2D(Layer):
    """Shared checks: ``strides`` default to ``pool_size``, as in Keras."""

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        pool = pair(self.pool_size, "pool_size")  # type: ignore[attr-defined]
        object.__setattr__(self, "pool_size", pool)
        strides = self.strides  # type: ignore[attr-defined]
        object.__setattr__(self, "strides", pool if strides is None else pair(strides, "strides"))
        check_padding(self.padding)  # type: ignore[attr-defined]
        check_data_format(self.data_format)  # type: ignore[attr-defined]

    def _pool(self, x: Any, init: Any, op: Any) -> Any:
        check_image_inputs(self, jnp.shape(x), self.pool_size, self.strides)  # type: ignore[attr-defined]
        first = check_data_format(self.data_format) == "channels_first"  # type: ignore[attr-defined]
        return jax.lax.reduce_window(
            x,
            init,
            op,
            _window(self.pool_size, first),  # type: ignore[attr-defined]
            _window(self.strides, first),  # type: ignore[attr-defined]
            check_padding(self.padding),  # type: ignore[attr-defined]
        )


@register_saveable(kind="layer")
class MaxPooling2D(_Pooling2D):
    """Keras's ``MaxPooling2D`` (``pool_size=(2, 2)``, ``strides`` = ``pool_size``).

    Example:

    >>> import jax.numpy as jnp
    >>> MaxPooling2D().apply({}, jnp.ones((1, 26, 26, 32))).shape
    (1, 13, 13, 32)
    """

    pool_size: Any = (2, 2)
    strides: Any = None
    padding: str = "valid"
    data_format: str | None = None
    input_shape: Any = None

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._pool(self.cast_inputs(inputs), -jnp.inf, jax.lax.max)


@register_saveable(kind="layer")
class AveragePooling2D(_Pooling2D):
    """Keras's ``AveragePooling2D``; with ``padding="same"`` a window's mean is over its
    positions inside the input, as Keras's.

    Example:

    >>> import jax.numpy as jnp
    >>> AveragePooling2D(2).apply({}, jnp.ones((1, 4, 4, 3))).shape
    (1, 2, 2, 3)
    """

    pool_size: Any
    strides: Any = None
    padding: str = "valid"
    data_format: str | None = None
    input_shape: Any = None

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        inputs = self.cast_inputs(inputs)
        sums = self._pool(inputs, 0.0, jax.lax.add)
        if check_padding(self.padding) == "VALID":
            return sums / (self.pool_size[0] * self.pool_size[1])
        counts = self._pool(jnp.ones_like(inputs), 0.0, jax.lax.add)
        return sums / counts


@register_saveable(kind="layer")
class GlobalAveragePooling2D(Layer):
    """Keras's ``GlobalAveragePooling2D``: the mean over the spatial axes.

    Example:

    >>> import jax.numpy as jnp
    >>> GlobalAveragePooling2D().apply({}, jnp.ones((2, 5, 5, 8))).shape
    (2, 8)
    """

    data_format: str | None = None
    keepdims: bool = False
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        check_data_format(self.data_format)

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        check_image_inputs(self, jnp.shape(inputs))
        axes = (2, 3) if check_data_format(self.data_format) == "channels_first" else (1, 2)
        return jnp.mean(self.cast_inputs(inputs), axis=axes, keepdims=self.keepdims)
