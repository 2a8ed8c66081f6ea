"""Keras's merge layers as linen modules: `Add`, `Concatenate`.

They take a list of inputs, as Keras's do, so they combine the branches of a model whose
``__call__`` you write (a Flax module, trained with ``jstrategy.Model(module,
input_shape=...)``): a `jstrategy.Sequential` is one chain of one-input layers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jstrategy._src.layers.base import Layer
from jstrategy._src.registry import register_saveable
from jstrategy._src.validation import is_int

__all__ = ["Add", "Concatenate"]


class _Merge(Layer):
    """What Keras's merge layers share: the check that they were given a list of arrays."""

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def _inputs(self, inputs: Any) -> list[Any]:
        """`inputs` as a list of arrays in the layer's compute dtype, or an error that
        names the fix."""
        name = type(self).__name__
        if not isinstance(inputs, (list, tuple)):
            raise ValueError(
                f"{name} takes a list of inputs, as Keras's merge layers do: "
                f"{name}{'(axis=...)' if name == 'Concatenate' else '()'}([a, b]); got "
                f"{type(inputs).__name__} of shape {jnp.shape(inputs)}. A jstrategy.Sequential "
                "is one chain of one-input layers: write the model as a Flax module whose "
                f"__call__ merges its branches with {name} and train it with "
                "jstrategy.Model(module, input_shape=...)."
            )
        if not inputs:
            raise ValueError(f"{name} takes a list of at least one input; got an empty list.")
        return [jnp.asarray(self.cast_inputs(x)) for x in inputs]


@register_saveable(kind="layer")
class Add(_Merge):
    """Keras's ``Add``: the sum of a list of inputs of one shape.

    As Keras's, the shapes after the batch axis broadcast (sizes of 1 stretch), and an
    input of lower rank gets axes of size 1 after its batch axis: ``(batch, 8)`` adds to
    ``(batch, 5, 8)``.

    It takes a list, so it is used inside your own Flax module (a `jstrategy.Sequential`
    is one chain of one-input layers); train that with ``jstrategy.Model(module,
    input_shape=...)``.

    Example:

    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> from jstrategy.layers import Add, Conv1D
    >>> class Residual(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, training=False):
    ...         return Add()([x, Conv1D(x.shape[-1], 3, padding="same")(x)])
    >>> x = jnp.ones((2, 10, 4))
    >>> Residual().apply(Residual().init(jax.random.key(0), x), x).shape
    (2, 10, 4)
    >>> Add().apply({}, [jnp.ones((2, 3)), jnp.ones((2, 3))]).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        arrays = self._inputs(inputs)
        if len({x.shape[:1] for x in arrays}) > 1:
            raise ValueError(
                f"Add cannot merge inputs of different batch sizes; got shapes "
                f"{[x.shape for x in arrays]}."
            )
        rank = max(x.ndim for x in arrays)
        # Keras's rule: a lower-rank input gets axes of size 1 after its batch axis.
        arrays = [x.reshape(x.shape[:1] + (1,) * (rank - x.ndim) + x.shape[1:]) for x in arrays]
        try:
            jnp.broadcast_shapes(*(x.shape for x in arrays))
        except ValueError:
            raise ValueError(
                f"Add's inputs must have one shape (or shapes that broadcast: sizes of 1); "
                f"got shapes {[tuple(jnp.shape(x)) for x in inputs]}."
            ) from None
        out = arrays[0]
        for x in arrays[1:]:
            out = out + x
        return out


@register_saveable(kind="layer")
class Concatenate(_Merge):
    """Keras's ``Concatenate``: a list of inputs joined along `axis`.

    Args:
      axis: the axis to join along (default -1, the channels); the inputs' other axes
        must match.

    It takes a list, so it is used inside your own Flax module (a `jstrategy.Sequential`
    is one chain of one-input layers); train that with ``jstrategy.Model(module,
    input_shape=...)``.

    Example:

    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> from jstrategy.layers import Concatenate, Conv1D
    >>> class TwoWidths(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, training=False):
    ...         narrow = Conv1D(8, 3, padding="same")(x)
    ...         wide = Conv1D(8, 7, padding="same")(x)
    ...         return Concatenate()([narrow, wide])
    >>> x = jnp.ones((2, 10, 4))
    >>> TwoWidths().apply(TwoWidths().init(jax.random.key(0), x), x).shape
    (2, 10, 16)
    >>> Concatenate(axis=1).apply({}, [jnp.ones((2, 3, 4)), jnp.ones((2, 5, 4))]).shape
    (2, 8, 4)
    """

    axis: int = -1

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        if not is_int(self.axis):
            raise ValueError(f"`axis` must be an int, e.g. -1 or 1; got {self.axis!r}.")

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        arrays = self._inputs(inputs)
        shapes = [tuple(x.shape) for x in arrays]
        rank = len(shapes[0])
        if not -rank <= self.axis < rank:
            raise ValueError(
                f"Concatenate's `axis` ({self.axis}) is outside its inputs' {rank} axes "
                f"(shapes {shapes})."
            )
        axis = self.axis % rank
        others = {s[:axis] + s[axis + 1 :] for s in shapes}
        if any(len(s) != rank for s in shapes) or len(others) > 1:
            raise ValueError(
                f"Concatenate's inputs must have the same shape except along `axis` "
                f"({self.axis}); got shapes {shapes}."
            )
        return jnp.concatenate(arrays, axis=axis)
