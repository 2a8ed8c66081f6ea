"""Keras's pooling layers as linen modules: `MaxPooling1D`, `AveragePooling1D`,
`MaxPooling2D`, `AveragePooling2D`, `GlobalAveragePooling1D`, `GlobalMaxPooling1D`,
`GlobalAveragePooling2D`, `GlobalMaxPooling2D`."""

from __future__ import annotations

import math
from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jstrategy._src.layers.base import Layer
from jstrategy._src.layers.conv import check_data_format
from jstrategy._src.layers.conv import check_padding
from jstrategy._src.layers.conv import check_spatial_inputs
from jstrategy._src.layers.conv import spatial_ints
from jstrategy._src.registry import register_saveable
from jstrategy._src.validation import check_bool

__all__ = [
    "AveragePooling1D",
    "AveragePooling2D",
    "GlobalAveragePooling1D",
    "GlobalAveragePooling2D",
    "GlobalMaxPooling1D",
    "GlobalMaxPooling2D",
    "MaxPooling1D",
    "MaxPooling2D",
]


def _window(size: tuple[int, ...], channels_first: bool) -> tuple[int, ...]:
    return (1, 1, *size) if channels_first else (1, *size, 1)


class _Pooling(Layer):
    """Shared checks and window reduction: ``strides`` default to ``pool_size``, as in
    Keras. Subclasses declare Keras's arguments as fields and `rank`, their spatial axes."""

    rank: ClassVar[int]

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        pool = spatial_ints(self.pool_size, self.rank, "pool_size")
        object.__setattr__(self, "pool_size", pool)
        strides = self.strides
        strides = pool if strides is None else spatial_ints(strides, self.rank, "strides")
        object.__setattr__(self, "strides", strides)
        check_padding(self.padding)
        check_data_format(self.data_format)

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def _pool(self, x: Any, init: Any, op: Any) -> Any:
        check_spatial_inputs(self, jnp.shape(x), self.rank, self.pool_size, self.strides)
        first = check_data_format(self.data_format) == "channels_first"
        return jax.lax.reduce_window(
            x,
            init,
            op,
            _window(self.pool_size, first),
            _window(self.strides, first),
            check_padding(self.padding),
        )

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def _max(self, inputs: Any) -> Any:
        return self._pool(self.cast_inputs(inputs), -jnp.inf, jax.lax.max)

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def _average(self, inputs: Any) -> Any:
        # With padding="same", a window's mean is over its positions inside the inputs, as
        # Keras's (which counts them with a second reduction, as here).
        inputs = self.cast_inputs(inputs)
        sums = self._pool(inputs, 0.0, jax.lax.add)
        if check_padding(self.padding) == "VALID":
            return sums / math.prod(self.pool_size)
        counts = self._pool(jnp.ones_like(inputs), 0.0, jax.lax.add)
        return sums / counts


@register_saveable(kind="layer")
class MaxPooling1D(_Pooling):
    """Keras's ``MaxPooling1D``: the maximum over windows of `pool_size` steps.

    Args:
      pool_size: an int or ``(k,)`` (default 2).
      strides: an int or ``(s,)``; None (default) is `pool_size`.
      padding: ``"valid"`` (default) or ``"same"``.
      data_format: ``"channels_last"`` (default, for None): inputs ``(batch, steps,
        channels)``; or ``"channels_first"``: ``(batch, channels, steps)``.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Example:

    >>> import jax.numpy as jnp
    >>> MaxPooling1D().apply({}, jnp.ones((1, 9, 4))).shape
    (1, 4, 4)
    >>> MaxPooling1D(3, strides=2, padding="same").apply({}, jnp.ones((1, 9, 4))).shape
    (1, 5, 4)
    """

    pool_size: Any = 2
    strides: Any = None
    padding: str = "valid"
    data_format: str | None = None
    input_shape: Any = None

    rank: ClassVar[int] = 1

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._max(inputs)


@register_saveable(kind="layer")
class AveragePooling1D(_Pooling):
    """Keras's ``AveragePooling1D``: the mean over windows of `pool_size` steps.

    With ``padding="same"`` a window's mean is over its steps inside the input, as Keras's.

    Args:
      pool_size: an int or ``(k,)``.
      strides: an int or ``(s,)``; None (default) is `pool_size`.
      padding: ``"valid"`` (default) or ``"same"``.
      data_format: ``"channels_last"`` (default, for None): inputs ``(batch, steps,
        channels)``; or ``"channels_first"``: ``(batch, channels, steps)``.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Example:

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(5.0).reshape(1, 5, 1)
    >>> AveragePooling1D(2, padding="same").apply({}, x)[0, :, 0].tolist()
    [0.5, 2.5, 4.0]
    """

    pool_size: Any
    strides: Any = None
    padding: str = "valid"
    data_format: str | None = None
    input_shape: Any = None

    rank: ClassVar[int] = 1

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._average(inputs)


@register_saveable(kind="layer")
class MaxPooling2D(_Pooling):
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

    rank: ClassVar[int] = 2

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._max(inputs)


@register_saveable(kind="layer")
class AveragePooling2D(_Pooling):
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

    rank: ClassVar[int] = 2

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._average(inputs)


class _GlobalPooling(Layer):
    """Shared checks and reduction of Keras's global pooling: over every spatial axis,
    which `keepdims` keeps with size 1. Subclasses declare `rank`, their spatial axes."""

    # Keras's arguments, in its order, shared by every global pooling layer.
    data_format: str | None = None
    keepdims: bool = False
    input_shape: Any = None

    rank: ClassVar[int]

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        check_data_format(self.data_format)
        check_bool(self.keepdims, "keepdims")

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def _reduce(self, inputs: Any, reduce: Any) -> Any:
        check_spatial_inputs(self, jnp.shape(inputs), self.rank)
        first = check_data_format(self.data_format) == "channels_first"
        axes = tuple(range(2, 2 + self.rank)) if first else tuple(range(1, 1 + self.rank))
        return reduce(self.cast_inputs(inputs), axis=axes, keepdims=self.keepdims)


@register_saveable(kind="layer")
class GlobalAveragePooling1D(_GlobalPooling):
    """Keras's ``GlobalAveragePooling1D``: the mean over the steps.

    Args:
      data_format: ``"channels_last"`` (default, for None): inputs ``(batch, steps,
        channels)``; or ``"channels_first"``: ``(batch, channels, steps)``.
      keepdims: whether to keep the steps axis, with size 1.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Keras's ``mask`` (of padded steps, from ``Embedding(mask_zero=True)``) is not taken:
    jstrategy's layers do not propagate masks.

    Example:

    >>> import jax.numpy as jnp
    >>> GlobalAveragePooling1D().apply({}, jnp.ones((2, 7, 8))).shape
    (2, 8)
    >>> GlobalAveragePooling1D(keepdims=True).apply({}, jnp.ones((2, 7, 8))).shape
    (2, 1, 8)
    """

    rank: ClassVar[int] = 1

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._reduce(inputs, jnp.mean)


@register_saveable(kind="layer")
class GlobalMaxPooling1D(_GlobalPooling):
    """Keras's ``GlobalMaxPooling1D``: the maximum over the steps.

    Args:
      data_format: ``"channels_last"`` (default, for None): inputs ``(batch, steps,
        channels)``; or ``"channels_first"``: ``(batch, channels, steps)``.
      keepdims: whether to keep the steps axis, with size 1.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Example:

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(6.0).reshape(1, 3, 2)
    >>> GlobalMaxPooling1D().apply({}, x).tolist()
    [[4.0, 5.0]]
    """

    rank: ClassVar[int] = 1

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._reduce(inputs, jnp.max)


@register_saveable(kind="layer")
class GlobalAveragePooling2D(_GlobalPooling):
    """Keras's ``GlobalAveragePooling2D``: the mean over the spatial axes.

    Example:

    >>> import jax.numpy as jnp
    >>> GlobalAveragePooling2D().apply({}, jnp.ones((2, 5, 5, 8))).shape
    (2, 8)
    """

    rank: ClassVar[int] = 2

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._reduce(inputs, jnp.mean)


@register_saveable(kind="layer")
class GlobalMaxPooling2D(_GlobalPooling):
    """Keras's ``GlobalMaxPooling2D``: the maximum over the spatial axes.

    Args:
      data_format: ``"channels_last"`` (default, for None): inputs ``(batch, height,
        width, channels)``; or ``"channels_first"``: ``(batch, channels, height, width)``.
      keepdims: whether to keep the spatial axes, with size 1.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Example:

    >>> import jax.numpy as jnp
    >>> GlobalMaxPooling2D().apply({}, jnp.ones((2, 5, 5, 8))).shape
    (2, 8)
    >>> GlobalMaxPooling2D(data_format="channels_first", keepdims=True).apply(
    ...     {}, jnp.ones((2, 8, 5, 5))
    ... ).shape
    (2, 8, 1, 1)
    """

    rank: ClassVar[int] = 2

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._reduce(inputs, jnp.max)
