"""Keras's core layers as linen modules: `Input`, `Dense`, `Embedding`, `Activation`,
`Dropout`.

Weights have Keras's names (``kernel``, ``bias``, ``embeddings``), so a variable's path
is Keras's (``dense/kernel`` in a `jstrategy.Sequential`) and `LayoutMap` keys written for
Keras match it.
"""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src import batch_region
from jstrategy._src.layers import activations
from jstrategy._src.layers import initializers
from jstrategy._src.layers import regularizers
from jstrategy._src.layers import symbolic
from jstrategy._src.layers import weights
from jstrategy._src.layers.base import Layer
from jstrategy._src.registry import register_saveable
from jstrategy._src.validation import check_number
from jstrategy._src.validation import check_positive_int
from jstrategy._src.validation import check_row_shape
from jstrategy._src.validation import is_int

__all__ = ["Activation", "Dense", "Dropout", "Embedding", "Input", "InputLayer", "Lambda"]


@register_saveable(kind="layer")
class InputLayer(Layer):
    """The input of a `jstrategy.Sequential`: the shape and dtype of one row (identity).

    Made by `Input` (Keras 3's recommended first entry of a ``Sequential``) or directly,
    with Keras 3's arguments; a `Sequential` takes it as its first element and does not
    list it in ``layers``, as Keras.

    Attributes:
      shape: the shape of one row, without the batch axis. Keras 2's ``input_shape=``
        means the same.
      batch_size: accepted as Keras does; batches come from the data.
      batch_shape: instead of `shape`, the shape with the batch axis first (which may be
        None), as Keras's ``batch_shape`` (and Keras 2's ``batch_input_shape``).
      dtype: the dtype of the rows (default float32).

    Example:

    >>> InputLayer(input_shape=(3,)).shape, InputLayer(batch_shape=(None, 4, 2)).shape
    ((3,), (4, 2))

    >>> import jstrategy
    >>> from jstrategy.layers import Dense, Input, InputLayer
    >>> model = jstrategy.Sequential([InputLayer(shape=(3,)), Dense(2)])
    >>> isinstance(Input(shape=(3,)).node.layer, InputLayer), [layer.name for layer in model.layers]
    (True, ['dense'])
    """

    shape: Any = None
    batch_size: int | None = None
    batch_shape: Any = None

    @nn.nowrap  # called before the module is bound
    def _check_dtype(self) -> None:
        # An input's dtype is the rows' dtype, not a precision policy.
        try:
            name = np.dtype(self.dtype or "float32").name
        except TypeError:
            raise ValueError(
                f"`dtype` must be the rows' dtype, e.g. 'float32' or 'int32'; got {self.dtype!r}."
            ) from None
        object.__setattr__(self, "dtype", name)

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        if self.batch_size is not None:
            check_positive_int(self.batch_size, "batch_size", "Or pass None.")
        if self.batch_shape is not None:
            if self.shape is not None:
                raise ValueError(
                    "Pass `shape` or `batch_shape` to InputLayer, not both: shape is "
                    "batch_shape without its first (batch) entry."
                )
            if not isinstance(self.batch_shape, (tuple, list)) or len(self.batch_shape) < 2:
                raise ValueError(
                    f"`batch_shape` must be (batch, *row_shape), e.g. (None, 10); got "
                    f"{self.batch_shape!r}."
                )
            object.__setattr__(self, "shape", tuple(self.batch_shape[1:]))
            object.__setattr__(self, "batch_shape", None)
        if self.shape is None:
            raise ValueError(
                "InputLayer needs `shape`, the shape of one row, e.g. InputLayer(shape=(10,))."
            )
        object.__setattr__(self, "shape", check_row_shape(self.shape, "shape"))

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return inputs


def Input(
    shape: Any = None,
    batch_size: int | None = None,
    dtype: Any = None,
    batch_shape: Any = None,
    name: str | None = None,
) -> symbolic.KerasTensor:
    """Keras's ``Input``: a symbolic tensor, the start of a functional model or of a
    `jstrategy.Sequential`.

    Also ``jstrategy.Input``, as ``keras.Input``. Call `jstrategy.layers` on it to write a
    model in Keras's functional API, then ``jstrategy.Model(inputs, outputs)``; or put it
    first in a `jstrategy.Sequential` to give the shape of one row.

    Args:
      shape: the shape of one row, without the batch axis, e.g. ``(28, 28, 1)``.
      batch_size: accepted as Keras does; batches come from the data.
      dtype: the rows' dtype (default float32).
      batch_shape: instead of `shape`, the shape with the batch axis first (which may be
        None).
      name: the input's name: the key of its array when the data is a dict.

    Returns:
      A `KerasTensor` of shape ``(None, *shape)``, made by an `InputLayer`.

    Raises:
      ValueError: for a missing or non-concrete shape.

    Example:

    >>> import jstrategy
    >>> x = jstrategy.Input((3,))
    >>> x.shape, jstrategy.layers.Dense(2)(x).shape
    ((None, 3), (None, 2))
    >>> model = jstrategy.Sequential([jstrategy.Input((3,)), jstrategy.layers.Dense(2)])
    >>> model.count_params()
    8
    """
    layer = InputLayer(
        shape=shape, batch_size=batch_size, batch_shape=batch_shape, dtype=dtype, name=name
    )
    return symbolic.input_tensor(layer)


@register_saveable(kind="layer")
class Lambda(Layer):
    """Keras's ``Lambda``: a function of the inputs as a layer (no weights).

    What lets a functional model apply a JAX function (``jnp.tanh``, a slice, a sum of
    two tensors) to symbolic tensors, which hold no values themselves.

    Args:
      function: a function of the inputs (an array, or the list/dict the layer is
        called on) returning the outputs, e.g. ``lambda x: x[:, 0]``.

    A model holding a Lambda saves its variables, but not the function (code): pass the
    layers to `jstrategy.models.load_model`, or build the model and ``load_weights``.

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> x = jstrategy.Input((4,))
    >>> jstrategy.layers.Lambda(lambda t: jnp.sum(t, axis=-1, keepdims=True))(x).shape
    (None, 1)
    """

    function: Any
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        if not callable(self.function):
            raise ValueError(
                f"`function` must be a function of the inputs, e.g. lambda x: x * 2; got "
                f"{self.function!r}."
            )

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return self.function(jax.tree.map(self.cast_inputs, inputs))


@register_saveable(kind="layer")
class Dense(Layer):
    """Keras's ``Dense``: ``activation(inputs @ kernel + bias)`` on the last axis.

    Args:
      units: the output size.
      activation: a Keras activation name, a callable or None (linear).
      use_bias: whether to add a bias.
      kernel_initializer: Keras's name (default ``"glorot_uniform"``) or a Flax
        initializer.
      bias_initializer: likewise (default ``"zeros"``).
      kernel_regularizer: a `jstrategy.regularizers` object, a name (``"l2"``) or None;
        its penalty is added to the loss, as in Keras.
      bias_regularizer: likewise, for the bias.
      kernel_constraint: a `jstrategy.constraints` object, a name (``"max_norm"``) or
        None: the kernel is projected by it after each update, as Keras's optimizer does.
      bias_constraint: likewise, for the bias.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.
        Keras's ``input_dim=n`` means ``input_shape=(n,)``.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> layer = Dense(4, activation="relu")
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> jax.tree.map(jnp.shape, variables["params"])
    {'bias': (4,), 'kernel': (3, 4)}
    """

    units: int
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
        check_positive_int(self.units, "units", "E.g. Dense(16).")
        weights.check_kernel_and_bias(self)

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        inputs = self.cast_inputs(inputs)
        kernel = weights.weight(self, "kernel", (jnp.shape(inputs)[-1], self.units))
        y = jnp.matmul(inputs, kernel.astype(self.compute_dtype(inputs, kernel)))
        if self.use_bias:
            bias = weights.weight(self, "bias", (self.units,))
            y = y + bias.astype(y.dtype)
        return activations.get(self.activation)(y)


@register_saveable(kind="layer")
class Embedding(Layer):
    """Keras's ``Embedding``: integer indices to rows of ``embeddings``.

    Args:
      input_dim: the vocabulary size (indices in ``[0, input_dim)``).
      output_dim: the size of each row.
      embeddings_initializer: default ``"uniform"``: Keras's ``RandomUniform(-0.05, 0.05)``.
      embeddings_regularizer: a regularizer for the table, or None.
      embeddings_constraint: a constraint for the table, or None.
      mask_zero: Keras's masking of index 0; not supported (masks are not propagated).
      input_shape: the shape of one input row, for the first layer of a `Sequential`.
        Keras 2's ``input_length=n`` means ``input_shape=(n,)`` (Keras 3 ignores it, with
        a warning).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> layer = Embedding(10, 3)
    >>> variables = layer.init(jax.random.key(0), jnp.zeros((2, 5), jnp.int32))
    >>> layer.apply(variables, jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 3)
    """

    input_dim: int
    output_dim: int
    embeddings_initializer: Any = "uniform"
    embeddings_regularizer: Any = None
    embeddings_constraint: Any = None
    mask_zero: bool = False
    input_shape: Any = None

    sample_dtype: ClassVar[str] = "int32"
    has_weights: ClassVar[bool] = True
    reads_input_length: ClassVar[bool] = True

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        check_positive_int(self.input_dim, "input_dim", "The vocabulary size, e.g. 1000.")
        check_positive_int(self.output_dim, "output_dim", "E.g. 64.")
        initializers.get(self.embeddings_initializer, "embeddings_initializer")
        object.__setattr__(
            self,
            "embeddings_regularizer",
            regularizers.get(self.embeddings_regularizer, "embeddings_regularizer"),
        )
        weights.resolve_constraints(self, "embeddings")
        if self.mask_zero:
            raise ValueError(
                "`mask_zero=True` is not supported: jstrategy's layers do not propagate "
                "Keras masks. Pass mask_zero=False and weight padded positions with "
                "sample_weight (or mask them in your loss)."
            )

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        table = weights.weight(self, "embeddings", (self.input_dim, self.output_dim))
        table = table.astype(self.compute_dtype(table))
        return jnp.take(table, jnp.asarray(inputs).astype(jnp.int32), axis=0)


@register_saveable(kind="layer")
class Activation(Layer):
    """Keras's ``Activation``: applies `activation` (a Keras name or a callable).

    Example:

    >>> import jax.numpy as jnp
    >>> Activation("relu").apply({}, jnp.array([-1.0, 1.0])).tolist()
    [0.0, 1.0]
    """

    activation: Any
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        activations.get(self.activation)

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        return activations.get(self.activation)(self.cast_inputs(inputs))


@register_saveable(kind="layer")
class Dropout(Layer):
    """Keras's ``Dropout``: in training, zeroes a `rate` fraction and scales the rest by
    ``1 / (1 - rate)``; the identity otherwise.

    The mask is drawn from the ``"dropout"`` stream the train step gives (a different key
    per step, from the model's seed), by global row: in a train step the mask of a row is
    the one a single device draws for the whole batch, whatever the strategy's mesh
    (`batch_region.global_rows_bernoulli`).

    Args:
      rate: the fraction to drop, in ``[0, 1)``.
      noise_shape: the shape of the mask, broadcast over the inputs (None entries take
        the inputs' size), or None for the inputs' shape.
      seed: folded into the step's dropout key, so two Dropout layers with different
        seeds draw different masks; None uses the key as it is.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.ones((4, 8))
    >>> bool((Dropout(0.5).apply({}, x, training=False) == x).all())
    True
    >>> y = Dropout(0.5).apply({}, x, training=True, rngs={"dropout": jax.random.key(0)})
    >>> sorted({float(v) for v in y.ravel()})
    [0.0, 2.0]
    """

    rate: float
    noise_shape: Any = None
    seed: int | None = None
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        check_number(
            self.rate, "rate", low=0, high=1, high_open=True, expected="in [0, 1)", fix="E.g. 0.5."
        )
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"`seed` must be an int or None; got {self.seed!r}.")

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        inputs = self.cast_inputs(inputs)
        if not training or self.rate == 0:
            return inputs
        key = self.make_rng("dropout")
        if self.seed is not None:
            key = jax.random.fold_in(key, self.seed)
        shape = jnp.shape(inputs)
        if self.noise_shape is not None:
            shape = tuple(
                s if n is None else n for n, s in zip(self.noise_shape, shape, strict=True)
            )
        return batch_region.dropout(inputs, key, self.rate, shape)
