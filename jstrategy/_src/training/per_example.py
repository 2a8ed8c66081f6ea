"""What losses and metrics share: input checks, sample weights and their base class.

`jstrategy.losses` and `jstrategy.metrics` both map ``(y_true, y_pred)`` to values with the
batch axis first (Keras's: the class or feature axis reduced, so ``(b, t)`` for sequence
outputs); the checks of their inputs, how sample weights of shape ``(b,)``, ``(b, 1)``,
``(b, t)`` or ``(b, t, 1)`` meet those values (`weighted_values`, `samplewise`), and
`PerExampleFunction`, the base of both, live here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.names import snake_case
from jstrategy._src.numerics import per_example

__all__ = [
    "PerExampleFunction",
    "align_ranks",
    "callable_name",
    "check_name",
    "compute_dtype",
    "prepare",
    "require_class_axis",
    "require_same_shape",
    "samplewise",
    "sparse_labels",
    "squeeze_or_expand_to_same_rank",
    "weighted_values",
]


def compute_dtype(x: jax.Array) -> Any:
    """At least float32, so bfloat16 outputs do not lose the loss in rounding."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.promote_types(x.dtype, jnp.float32)
    return jnp.float32


def prepare(y_true: Any, y_pred: Any, what: str) -> tuple[jax.Array, jax.Array]:
    """Converts to arrays and checks that both have the same leading (batch) axis."""
    y_true = jnp.asarray(y_true)
    y_pred = jnp.asarray(y_pred)
    if y_pred.ndim == 0 or y_true.ndim == 0:
        raise ValueError(
            f"{what} expects batched inputs with a leading batch axis; got y_true of shape "
            f"{y_true.shape} and y_pred of shape {y_pred.shape}. Pass arrays of shape "
            "(batch, ...)."
        )
    if y_true.shape[0] != y_pred.shape[0]:
        raise ValueError(
            f"{what} expects y_true and y_pred with the same batch size; got shapes "
            f"{y_true.shape} and {y_pred.shape}. Pass labels and predictions for the same rows."
        )
    return y_true, y_pred


def align_ranks(y_true: jax.Array, y_pred: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keras's ``squeeze_or_expand_to_same_rank``: reconciles ``(b,)`` with ``(b, 1)``.

    A rank-1 side is expanded (so ``(b,)`` labels against ``(b, 1)`` predictions give
    ``(b, 1)``); otherwise the side with a trailing axis of size 1 is squeezed.
    """
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        if y_pred.ndim == 1:
            return y_true, y_pred[:, None]
        return jnp.squeeze(y_true, -1), y_pred
    if y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        if y_true.ndim == 1:
            return y_true[:, None], y_pred
        return y_true, jnp.squeeze(y_pred, -1)
    return y_true, y_pred


def squeeze_or_expand_to_same_rank(
    x1: jax.Array, x2: jax.Array, expand_rank_1: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Keras's function of that name: ranks that differ by one, with a trailing axis of
    size 1 on the larger, are made equal (a rank-1 side is expanded, else the other
    squeezed)."""
    if x1.ndim == x2.ndim + 1 and x1.shape[-1] == 1:
        if x2.ndim == 1 and expand_rank_1:
            x2 = x2[..., None]
        else:
            x1 = jnp.squeeze(x1, -1)
    elif x2.ndim == x1.ndim + 1 and x2.shape[-1] == 1:
        if x1.ndim == 1 and expand_rank_1:
            x1 = x1[..., None]
        else:
            x2 = jnp.squeeze(x2, -1)
    return x1, x2


def _aligned_weight(values: jax.Array, sample_weight: Any, what: str) -> tuple[Any, Any]:
    """``(values, weight)`` of the same rank (weight broadcastable), as Keras aligns them.

    A weight of lower rank than the values is one weight per row (per leading entries),
    repeated over the remaining axes. Keras multiplies without expanding, which fails for
    ``(b,)`` weights on ``(b, t)`` values (and silently pairs weights with time steps when
    ``t == b``); tf.keras 2 repeated it, as here.
    """
    weight = jnp.asarray(sample_weight)
    weight = weight.astype(jnp.promote_types(values.dtype, jnp.float32))
    if weight.ndim == 0:
        return values, weight
    values, weight = squeeze_or_expand_to_same_rank(values, weight)
    if weight.ndim < values.ndim:
        weight = weight.reshape(weight.shape + (1,) * (values.ndim - weight.ndim))
    try:
        jnp.broadcast_shapes(values.shape, weight.shape)
        if weight.ndim > values.ndim:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{what}: `sample_weight` of shape {jnp.shape(sample_weight)} does not fit values "
            f"of shape {values.shape} (the loss or metric per element, the class or feature "
            "axis reduced). Pass one weight per example (batch,), (batch, 1), or one per "
            f"element {values.shape} (optionally with a trailing axis of size 1)."
        ) from None
    return values, weight


def weighted_values(values: jax.Array, sample_weight: Any, what: str) -> jax.Array:
    """`values` times `sample_weight`, aligned as Keras's ``reduce_weighted_values`` does.

    Args:
      values: a loss's values, batch axis first (e.g. ``(b, t)`` for sequence outputs).
      sample_weight: None, a scalar, or weights ``(b,)``, ``(b, 1)``, ``(b, t)``,
        ``(b, t, 1)``: one per example or one per element.
      what: the function's description for errors.

    Returns:
      The weighted values, of the values' shape (or the broadcast of both, as Keras).

    Raises:
      ValueError: if the weight's shape does not fit the values.

    Example:

    >>> import jax.numpy as jnp
    >>> weighted_values(jnp.ones((2, 3)), jnp.array([[1.0], [0.0]]), "The loss").tolist()
    [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """
    if sample_weight is None:
        return values
    values, weight = _aligned_weight(values, sample_weight, what)
    return values * weight.astype(values.dtype)


def samplewise(
    values: jax.Array, sample_weight: Any, what: str
) -> tuple[jax.Array, jax.Array | None]:
    """Keras's ``reduce_to_samplewise_values``: one value and one weight per row.

    A metric's values and weights are averaged over the non-batch axes after the weight is
    aligned and broadcast to the values, so the metric (``sum(values) / sum(weights)`` over
    the rows) is ``sum(v * w) / sum(w)`` over the elements for per-element weights, and the
    weighted mean of the rows' means for per-row weights.

    Returns:
      ``(values (b,), weights (b,) or None)``; a scalar `values` stays a scalar.

    Example:

    >>> import jax.numpy as jnp
    >>> v, w = samplewise(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([[1.0], [0], [0], [1]]), "Mean")
    >>> float(v.sum() / w.sum())
    2.5
    """
    weight = None
    if sample_weight is not None:
        values, weight = _aligned_weight(values, sample_weight, what)
        shape = jnp.broadcast_shapes(values.shape, weight.shape)
        weight = jnp.broadcast_to(weight, shape)
        values = jnp.broadcast_to(values, shape) * weight.astype(values.dtype)
        if weight.ndim > 1:
            weight = jnp.mean(weight, axis=tuple(range(1, weight.ndim)))
    if values.ndim > 1:
        values = jnp.mean(values, axis=tuple(range(1, values.ndim)))
    return values, weight


def require_same_shape(y_true: jax.Array, y_pred: jax.Array, what: str, hint: str = "") -> None:
    # Silent broadcasting of (b, k) against (b, j) is the classic source of wrong losses,
    # so mismatches are errors rather than broadcasts.
    if y_true.shape != y_pred.shape:
        raise ValueError(
            f"{what} expects y_true and y_pred of the same shape (after reconciling a "
            f"trailing axis of size 1); got {y_true.shape} and {y_pred.shape}.{hint}"
        )


def check_name(name: Any, owner: Any = None) -> str:
    if name is None and owner is not None:
        return snake_case(type(owner).__name__)
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty str; got {name!r}.")
    return name


def require_class_axis(y_pred: jax.Array, what: str) -> None:
    if y_pred.ndim < 2:
        raise ValueError(
            f"{what} expects y_pred with a class axis, shape (batch, ..., num_classes); got "
            f"{y_pred.shape}. For one output per example use BinaryCrossentropy."
        )


def sparse_labels(y_true: jax.Array, y_pred: jax.Array, what: str) -> jax.Array:
    """Integer labels shaped like ``y_pred`` without its class axis."""
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = jnp.squeeze(y_true, -1)
    if y_true.shape != y_pred.shape[:-1]:
        raise ValueError(
            f"{what} expects integer labels of shape {y_pred.shape[:-1]} (or with a trailing "
            f"axis of size 1) for y_pred of shape {y_pred.shape}; got {y_true.shape}. For "
            "one-hot labels use the categorical variant."
        )
    return y_true.astype(jnp.int32)


def callable_name(fn: Callable[..., Any]) -> str:
    for attr in ("name", "__name__"):
        name = getattr(fn, attr, None)
        if isinstance(name, str) and name:
            return "lambda" if name == "<lambda>" else name
    return type(fn).__name__


class PerExampleFunction:
    """What losses and metrics share: ``(y_true, y_pred)`` to values with the batch axis first.

    Subclasses implement `call`, which returns values with the batch axis first: Keras's
    per-element values, the class or feature axis reduced (``(b,)`` for ``(b, k)``
    outputs, ``(b, t)`` for sequence outputs ``(b, t, k)``). `values` checks the inputs and
    returns them; `per_example` averages them over the non-batch axes, one value per row.

    Args:
      name: the function's name; defaults to the class name in snake case, as in Keras.
    """

    _kind = "function"

    def __init__(self, *, name: str | None = None):
        self.name = check_name(name, self)

    def __call__(self, y_true: Any, y_pred: Any) -> Any:
        """The per-example values (`per_example`); losses and metrics give it Keras's
        meaning: a reduced loss, a metric's running result."""
        return self.per_example(y_true, y_pred)

    def values(self, y_true: Any, y_pred: Any) -> jax.Array:
        """The unreduced values `call` returns, checked: batch axis first.

        Args:
          y_true: labels, batch axis first.
          y_pred: predictions, batch axis first.

        Returns:
          An array ``(batch, ...)``: for the built-in losses and metrics, one value per
          element of the outputs without their last (class or feature) axis, as Keras's.

        Raises:
          ValueError: if the shapes do not fit.
        """
        what = f"{type(self).__name__} ({self.name!r})"
        y_true, y_pred = prepare(y_true, y_pred, what)
        values = jnp.asarray(self._as_values(self.call(y_true, y_pred)))
        if values.ndim == 0 or values.shape[0] != y_pred.shape[0]:
            per_example(values, y_pred.shape[0], what)  # raises, naming the shapes
        return values

    def per_example(self, y_true: Any, y_pred: Any) -> jax.Array:
        """Returns one value per example, shape ``(batch,)``: `values` averaged over the
        non-batch axes (each row's mean over its time steps, say).

        Args:
          y_true: labels, batch axis first.
          y_pred: predictions, batch axis first.

        Returns:
          A ``(batch,)`` array.

        Raises:
          ValueError: if the shapes do not fit.
        """
        values = self.values(y_true, y_pred)
        return per_example(values, values.shape[0], "")

    def _as_values(self, values: Any) -> Any:
        return values

    def call(self, y_true: jax.Array, y_pred: jax.Array) -> jax.Array:
        """Computes the unreduced values; the batch axis must stay first.

        Args:
          y_true: labels, an array with a batch axis first.
          y_pred: predictions, an array with the same batch size.

        Returns:
          Values with the batch axis first.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `call(y_true, y_pred)`.")

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as in Keras."""
        return {"name": self.name}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"
