"""Keras's ``Conv2D`` as a linen module, and the argument checks convolutions and pooling share."""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jstrategy._src.layers import activations
from jstrategy._src.layers import weights
from jstrategy._src.layers.base import Layer
from jstrategy._src.registry import register_saveable
from jstrategy._src.validation import check_positive_int

__all__ = ["Conv2D", "check_data_format", "check_image_inputs", "check_padding", "pair"]


def check_data_format(data_format: Any) -> str:
    """``"channels_last"`` (Keras's default, for None) or ``"channels_first"``."""
    if data_format is None:
        return "channels_last"
    if data_format not in ("channels_last", "channels_first"):
        raise ValueError(
            f"`data_format` must be 'channels_last', 'channels_first' or None; got {data_format!r}."
        )
    return str(data_format)


def check_padding(padding: Any) -> str:
    """``"VALID"`` or ``"SAME"`` from Keras's ``"valid"`` / ``"same"``."""
    if not isinstance(padding, str) or padding.lower() not in ("valid", "same"):
        raise ValueError(f"`padding` must be 'valid' or 'same'; got {padding!r}.")
    return padding.upper()


def check_image_inputs(
    layer: Any,
    shape: tuple[int, ...],
    window: tuple[int, int] | None = None,
    strides: tuple[int, int] = (1, 1),
    dilation: tuple[int, int] = (1, 1),
) -> None:
    """Refuses inputs a 2-D layer cannot take, before any work: a rank other than 4 (e.g.
    images without a channel axis), or (``"valid"`` padding) a `window` larger than the
    image, which Keras refuses too ("Computed output size would be zero or negative")
    and which would otherwise build an empty feature map.
    """
    what = f"{type(layer).__name__} {layer.name!r}" if layer.name else type(layer).__name__
    first = check_data_format(layer.data_format) == "channels_first"
    layout = "(batch, channels, height, width)" if first else "(batch, height, width, channels)"
    if len(shape) != 4:
        fix = "Give the rows the layout above"
        if len(shape) == 3:
            row = (1, *shape[1:]) if first else (*shape[1:], 1)
            axis = "x[:, None]" if first else "x[..., None]"
            fix = (
                f"Add a channel axis: {axis} (then input_shape={row}), or start the model "
                f"with Reshape({row})"
            )
        raise ValueError(
            f"{what} takes inputs of rank 4, {layout}; got inputs of shape {tuple(shape)}. {fix}."
        )
    if window is None or check_padding(layer.padding) != "VALID":
        return
    spatial = shape[2:] if first else shape[1:3]
    span = tuple((k - 1) * d + 1 for k, d in zip(window, dilation, strict=True))
    if any(size < extent for size, extent in zip(spatial, span, strict=True)):
        out = tuple(
            (size - extent) // s + 1 for size, extent, s in zip(spatial, span, strides, strict=True)
        )
        raise ValueError(
            f"{what}: its window {span} is larger than the {tuple(spatial)} image of its "
            f"inputs (shape {tuple(shape)}). Computed output size would be zero or negative: "
            f"{out}. Use a smaller window, padding='same', or larger images."
        )


def pair(value: Any, name: str) -> tuple[int, int]:
    """An int or a pair of positive ints as a pair (Keras's ``kernel_size=3``)."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (check_positive_int(value[0], name), check_positive_int(value[1], name))
    if isinstance(value, (tuple, list)):
        raise ValueError(f"`{name}` must be an int or a pair of ints; got {value!r}.")
    size = check_positive_int(value, name, "E.g. 3 or (3, 3).")
    return (size, size)


@register_saveable(kind="layer")
class Conv2D(Layer):
    """Keras's ``Conv2D``: a 2-D convolution, kernel ``(kh, kw, in // groups, filters)``.

    Args:
      filters: the number of output channels.
      kernel_size: an int or ``(kh, kw)``.
      strides: an int or a pair (default 1).
      padding: ``"valid"`` (default) or ``"same"`` (TF's SAME).
      data_format: ``"channels_last"`` (default, for None) or ``"channels_first"``.
      dilation_rate: an int or a pair.
      groups: the number of channel groups.
      activation: a Keras activation name, a callable or None.
      use_bias: whether to add a bias.
      kernel_initializer: default ``"glorot_uniform"``.
      bias_initializer: default ``"zeros"``.
      kernel_regularizer: a regularizer for the kernel, or None.
      bias_regularizer: a regularizer for the bias, or None.
      kernel_constraint: a constraint for the kernel, or None.
      bias_constraint: a constraint for the bias, or None.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.ones((2, 28, 28, 1))
    >>> layer = Conv2D(32, 3, activation="relu")
    >>> variables = layer.init(jax.random.key(0), x)
    >>> variables["params"]["kernel"].shape, layer.apply(variables, x).shape
    ((3, 3, 1, 32), (2, 26, 26, 32))
    """

    filters: int
    kernel_size: Any
    strides: Any = (1, 1)
    padding: str = "valid"
    data_format: str | None = None
    dilation_rate: Any = (1, 1)
    groups: int = 1
    activation: Any = None
    use_bias: bool = True
    kernel_initializer: Any = "glorot_uniform"
    bias_initializer: Any = "zeros"
    kernel_regularizer: Any = None
    bias_regularizer: Any = None
    kernel_constraint: Any = None
    bias_constraint: Any = None
    input_shape: Any = None

    has_weights: ClassVar[bool] = True

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        check_positive_int(self.filters, "filters", "E.g. Conv2D(32, 3).")
        for name in ("kernel_size", "strides", "dilation_rate"):
            object.__setattr__(self, name, pair(getattr(self, name), name))
        check_padding(self.padding)
        check_data_format(self.data_format)
        check_positive_int(self.groups, "groups")
        if self.filters % self.groups:
            raise ValueError(
                f"`filters` ({self.filters}) must be a multiple of `groups` ({self.groups})."
            )
        weights.check_kernel_and_bias(self)

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        inputs = self.cast_inputs(inputs)
        check_image_inputs(
            self, jnp.shape(inputs), self.kernel_size, self.strides, self.dilation_rate
        )
        channels_first = check_data_format(self.data_format) == "channels_first"
        in_channels = jnp.shape(inputs)[1 if channels_first else -1]
        if in_channels % self.groups:
            raise ValueError(
                f"The inputs' {in_channels} channels must be a multiple of `groups` "
                f"({self.groups})."
            )
        kernel = weights.weight(
            self, "kernel", (*self.kernel_size, in_channels // self.groups, self.filters)
        )
        layout = "NCHW" if channels_first else "NHWC"
        y = jax.lax.conv_general_dilated(
            inputs,
            kernel.astype(self.compute_dtype(inputs, kernel)),
            window_strides=self.strides,
            padding=check_padding(self.padding),
            rhs_dilation=self.dilation_rate,
            dimension_numbers=(layout, "HWIO", layout),
            feature_group_count=self.groups,
        )
        if self.use_bias:
            bias = weights.weight(self, "bias", (self.filters,))
            shape = (1, self.filters, 1, 1) if channels_first else (self.filters,)
            y = y + bias.astype(y.dtype).reshape(shape)
        return activations.get(self.activation)(y)
