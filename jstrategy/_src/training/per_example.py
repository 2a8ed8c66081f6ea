"""What losses and metrics share: input checks and the per-example function base class.

`jstrategy.losses` and `jstrategy.metrics` both map ``(y_true, y_pred)`` to one value per
example; the checks of their inputs and `PerExampleFunction`, the base of both, live here.
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
    "sparse_labels",
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
    """What losses and metrics share: ``(y_true, y_pred)`` to per-example values ``(batch,)``.

    Subclasses implement `call`, which may return any shape with the batch axis first;
    `__call__` checks the inputs and averages the non-batch axes. The train step then takes
    the mask-weighted mean over real rows across replicas.

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

    def per_example(self, y_true: Any, y_pred: Any) -> jax.Array:
        """Returns the per-example values, shape ``(batch,)``: what the train step uses.

        Args:
          y_true: labels, batch axis first.
          y_pred: predictions, batch axis first.

        Returns:
          A ``(batch,)`` array; non-batch axes are averaged.

        Raises:
          ValueError: if the shapes do not fit.
        """
        what = f"{type(self).__name__} ({self.name!r})"
        y_true, y_pred = prepare(y_true, y_pred, what)
        values = self._as_values(self.call(y_true, y_pred))
        return per_example(values, y_pred.shape[0], what)

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
