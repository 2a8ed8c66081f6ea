"""Keras's reshaping layers as linen modules: `Flatten`, `Reshape`."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jstrategy._src.layers.base import Layer
from jstrategy._src.layers.conv import check_data_format
from jstrategy._src.registry import register_saveable

__all__ = ["Flatten", "Reshape"]


@register_saveable(kind="layer")
class Flatten(Layer):
    """Keras's ``Flatten``: each row to one axis (channels moved last first, for
    ``data_format="channels_first"``, as Keras does).

    Example:

    >>> import jax.numpy as jnp
    >>> Flatten().apply({}, jnp.ones((2, 3, 4))).shape
    (2, 12)
    """

    data_format: str | None = None
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        check_data_format(self.data_format)

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        inputs = self.cast_inputs(inputs)
        if check_data_format(self.data_format) == "channels_first" and inputs.ndim > 2:
            inputs = jnp.moveaxis(inputs, 1, -1)
        return jnp.reshape(inputs, (inputs.shape[0], -1))


@register_saveable(kind="layer")
class Reshape(Layer):
    """Keras's ``Reshape``: each row to `target_shape` (one entry may be -1).

    Example:

    >>> import jax.numpy as jnp
    >>> Reshape((3, -1)).apply({}, jnp.ones((2, 12))).shape
    (2, 3, 4)
    """

    target_shape: tuple[int, ...]
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        shape = self.target_shape
        if isinstance(shape, int):
            shape = (shape,)
        ok = isinstance(shape, (tuple, list)) and all(
            isinstance(d, int) and (d > 0 or d == -1) for d in shape
        )
        if not ok or sum(d == -1 for d in shape) > 1:
            raise ValueError(
                f"`target_shape` must be the shape of one output row (positive ints, at "
                f"most one -1), without the batch axis; got {self.target_shape!r}. E.g. "
                "Reshape((28, 28, 1))."
            )
        object.__setattr__(self, "target_shape", tuple(shape))

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        inputs = self.cast_inputs(inputs)
        return jnp.reshape(inputs, (inputs.shape[0], *self.target_shape))
