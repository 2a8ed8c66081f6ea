"""Keras's convolutions as linen modules (`Conv1D`, `Conv2D`), and the argument and input
checks that convolutions and pooling share."""

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

__all__ = [
    "Conv1D",
    "Conv2D",
    "check_data_format",
    "check_image_inputs",
    "check_padding",
    "check_spatial_inputs",
    "pair",
    "spatial_ints",
]

# For inputs of 1 and 2 spatial axes: those axes as a layout names them, and what they are.
_SPATIAL = {1: ("steps", "sequence"), 2: ("height, width", "image")}


def check_data_format(data_format: Any) -> str:
    """``"channels_last"`` (Keras's default, for None) or ``"channels_first"``."""
    if data_format is None:
        return "channels_last"
    if data_format not in ("channels_last", "channels_first"):
        raise ValueError(
            f"`data_format` must be 'channels_last', 'channels_first' or None; got {data_format!r}."
        )
    return str(data_format)


def check_padding(padding: Any, causal: bool = False) -> str:
    """``"VALID"`` or ``"SAME"`` from Keras's ``"valid"`` / ``"same"``; ``"CAUSAL"`` too
    where `causal` (`Conv1D`'s ``"causal"``)."""
    allowed = ("valid", "same", "causal") if causal else ("valid", "same")
    if not isinstance(padding, str) or padding.lower() not in allowed:
        names = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
        raise ValueError(f"`padding` must be {names}; got {padding!r}.")
    return padding.upper()


def check_spatial_inputs(
    layer: Any,
    shape: tuple[int, ...],
    rank: int,
    window: tuple[int, ...] | None = None,
    strides: tuple[int, ...] | None = None,
    dilation: tuple[int, ...] | None = None,
) -> None:
    """Refuses inputs a layer of `rank` spatial axes cannot take, before any work: a rank
    other than ``rank + 2`` (e.g. rows without a channel axis), or (``"valid"`` padding) a
    `window` larger than the inputs' spatial axes, which Keras refuses too ("Computed
    output size would be zero or negative") and which would otherwise build an empty
    feature map.
    """
    what = f"{type(layer).__name__} {layer.name!r}" if layer.name else type(layer).__name__
    first = check_data_format(layer.data_format) == "channels_first"
    axes, noun = _SPATIAL[rank]
    layout = f"(batch, channels, {axes})" if first else f"(batch, {axes}, channels)"
    if len(shape) != rank + 2:
        fix = "Give the rows the layout above"
        if len(shape) == rank + 1:
            row = (1, *shape[1:]) if first else (*shape[1:], 1)
            axis = "x[:, None]" if first else "x[..., None]"
            fix = (
                f"Add a channel axis: {axis} (then input_shape={row}), or start the model "
                f"with Reshape({row})"
            )
        raise ValueError(
            f"{what} takes inputs of rank {rank + 2}, {layout}; got inputs of shape "
            f"{tuple(shape)}. {fix}."
        )
    if window is None or check_padding(layer.padding, causal=True) != "VALID":
        return
    strides = strides or (1,) * rank
    dilation = dilation or (1,) * rank
    spatial = shape[2:] if first else shape[1:-1]
    span = tuple((k - 1) * d + 1 for k, d in zip(window, dilation, strict=True))
    if any(size < extent for size, extent in zip(spatial, span, strict=True)):
        out = tuple(
            (size - extent) // s + 1 for size, extent, s in zip(spatial, span, strides, strict=True)
        )
        bigger = "larger images" if rank == 2 else "longer sequences"
        raise ValueError(
            f"{what}: its window {span} is larger than the {tuple(spatial)} {noun} of its "
            f"inputs (shape {tuple(shape)}). Computed output size would be zero or negative: "
            f"{out}. Use a smaller window, padding='same', or {bigger}."
        )


def check_image_inputs(
    layer: Any,
    shape: tuple[int, ...],
    window: tuple[int, int] | None = None,
    strides: tuple[int, int] = (1, 1),
    dilation: tuple[int, int] = (1, 1),
) -> None:
    """`check_spatial_inputs` for a 2-D layer: inputs of rank 4."""
    check_spatial_inputs(layer, shape, 2, window, strides, dilation)


def spatial_ints(value: Any, rank: int, name: str) -> tuple[int, ...]:
    """An int or `rank` positive ints as a tuple of `rank` (Keras's ``kernel_size=3``)."""
    if isinstance(value, (tuple, list)) and len(value) == rank:
        return tuple(check_positive_int(v, name) for v in value)
    what = "a pair of ints" if rank == 2 else f"a tuple of {rank} int" + "s" * (rank > 1)
    if isinstance(value, (tuple, list)):
        raise ValueError(f"`{name}` must be an int or {what}; got {value!r}.")
    example = "E.g. 3 or (3, 3)." if rank == 2 else "E.g. 3."
    size = check_positive_int(value, name, example)
    return (size,) * rank


def pair(value: Any, name: str) -> tuple[int, int]:
    """An int or a pair of positive ints as a pair (Keras's ``kernel_size=3``)."""
    return spatial_ints(value, 2, name)  # type: ignore[return-value]


class _Conv(Layer):
    """What Keras's convolutions share: the checks of their arguments and the convolution.

    Subclasses declare Keras's arguments as fields and `rank`, their spatial axes.
    """

    rank: ClassVar[int]
    has_weights: ClassVar[bool] = True

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        name = type(self).__name__
        check_positive_int(self.filters, "filters", f"E.g. {name}(32, 3).")
        for argument in ("kernel_size", "strides", "dilation_rate"):
            value = spatial_ints(getattr(self, argument), self.rank, argument)
            object.__setattr__(self, argument, value)
        check_padding(self.padding, causal=self.rank == 1)
        check_data_format(self.data_format)
        check_positive_int(self.groups, "groups")
        if self.filters % self.groups:
            raise ValueError(
                f"`filters` ({self.filters}) must be a multiple of `groups` ({self.groups})."
            )
        weights.check_kernel_and_bias(self)

    @nn.nowrap  # runs in the caller's compact scope (it makes the weights)
    def _convolve(self, inputs: Any) -> Any:
        inputs = self.cast_inputs(inputs)
        shape = jnp.shape(inputs)
        check_spatial_inputs(
            self, shape, self.rank, self.kernel_size, self.strides, self.dilation_rate
        )
        channels_first = check_data_format(self.data_format) == "channels_first"
        in_channels = shape[1 if channels_first else -1]
        if in_channels % self.groups:
            raise ValueError(
                f"The inputs' {in_channels} channels must be a multiple of `groups` "
                f"({self.groups})."
            )
        kernel = weights.weight(
            self, "kernel", (*self.kernel_size, in_channels // self.groups, self.filters)
        )
        padding: Any = check_padding(self.padding, causal=True)
        if padding == "CAUSAL":  # Keras pads the start of the sequence, then "valid"
            padding = [((self.kernel_size[0] - 1) * self.dilation_rate[0], 0)]
        spatial = "WH"[: self.rank][::-1]  # "W" for 1-D, "HW" for 2-D
        layout = f"NC{spatial}" if channels_first else f"N{spatial}C"
        y = jax.lax.conv_general_dilated(
            inputs,
            kernel.astype(self.compute_dtype(inputs, kernel)),
            window_strides=self.strides,
            padding=padding,
            rhs_dilation=self.dilation_rate,
            dimension_numbers=(layout, f"{spatial}IO", layout),
            feature_group_count=self.groups,
        )
        if self.use_bias:
            bias = weights.weight(self, "bias", (self.filters,))
            shape = (1, self.filters, *(1,) * self.rank) if channels_first else (self.filters,)
            y = y + bias.astype(y.dtype).reshape(shape)
        return activations.get(self.activation)(y)


@register_saveable(kind="layer")
class Conv1D(_Conv):
    """Keras's ``Conv1D``: a 1-D convolution, kernel ``(k, in // groups, filters)``.

    Args:
      filters: the number of output channels.
      kernel_size: an int or ``(k,)``.
      strides: an int or ``(s,)`` (default 1).
      padding: ``"valid"`` (default), ``"same"`` (TF's SAME) or ``"causal"``: the start of
        the sequence padded with ``dilation_rate * (kernel_size - 1)`` zeros, so that the
        output at a step sees no later step (WaveNet's).
      data_format: ``"channels_last"`` (default, for None): inputs ``(batch, steps,
        channels)``; or ``"channels_first"``: ``(batch, channels, steps)``.
      dilation_rate: an int or ``(d,)``; more than 1 only with ``strides=1``, as Keras.
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
    >>> x = jnp.ones((2, 100, 8))
    >>> layer = Conv1D(16, 3, padding="causal", dilation_rate=2, activation="relu")
    >>> variables = layer.init(jax.random.key(0), x)
    >>> variables["params"]["kernel"].shape, layer.apply(variables, x).shape
    ((3, 8, 16), (2, 100, 16))
    """

    filters: int
    kernel_size: Any
    strides: Any = 1
    padding: str = "valid"
    data_format: str | None = None
    dilation_rate: Any = 1
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

    rank: ClassVar[int] = 1

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        _Conv.validate(self)
        if self.strides[0] > 1 and self.dilation_rate[0] > 1:
            raise ValueError(
                f"`strides` > 1 and `dilation_rate` > 1 cannot be combined (Keras refuses "
                f"it too); got strides={self.strides[0]}, "
                f"dilation_rate={self.dilation_rate[0]}. Pass one of them as 1."
            )

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._convolve(inputs)


@register_saveable(kind="layer")
class Conv2D(_Conv):
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

    rank: ClassVar[int] = 2

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self._convolve(inputs)
