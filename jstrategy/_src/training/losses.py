"""Keras-compatible losses that return one value per example.

Every loss maps ``(y_true, y_pred)`` to a ``(batch,)`` array and does no reduction over
the batch: the train step owns that, because only it knows which rows are padding and how
many real rows all replicas hold together. Non-batch axes are averaged, as Keras averages
them before its batch reduction, so ``mean(loss(y_true, y_pred))`` over real rows equals
Keras's ``sum_over_batch_size`` value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "SparseCategoricalCrossentropy",
    "get",
]

# Keras's backend.epsilon(): probabilities are clipped to [EPSILON, 1 - EPSILON] before log.
EPSILON = 1e-7


def _compute_dtype(x: jax.Array) -> Any:
    """At least float32, so bfloat16 outputs do not lose the loss in rounding."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.promote_types(x.dtype, jnp.float32)
    return jnp.float32


def _prepare(y_true: Any, y_pred: Any, what: str) -> tuple[jax.Array, jax.Array]:
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


def _align_ranks(y_true: jax.Array, y_pred: jax.Array) -> tuple[jax.Array, jax.Array]:
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


def _require_same_shape(y_true: jax.Array, y_pred: jax.Array, what: str, hint: str = "") -> None:
    # Silent broadcasting of (b, k) against (b, j) is the classic source of wrong losses,
    # so mismatches are errors rather than broadcasts.
    if y_true.shape != y_pred.shape:
        raise ValueError(
            f"{what} expects y_true and y_pred of the same shape (after reconciling a "
            f"trailing axis of size 1); got {y_true.shape} and {y_pred.shape}.{hint}"
        )


def _per_example(values: Any, batch: int, what: str) -> jax.Array:
    """Averages every non-batch axis, giving shape ``(batch,)``."""
    values = jnp.asarray(values)
    if values.ndim == 0 or values.shape[0] != batch:
        raise ValueError(
            f"{what} must return one value per example (an array with leading axis {batch}); "
            f"got shape {values.shape}. Return per-example values and leave the batch "
            "reduction to the train step."
        )
    if values.ndim == 1:
        return values
    return jnp.mean(values, axis=tuple(range(1, values.ndim)))


def _check_bool(value: Any, arg: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{arg}` must be a bool; got {value!r}. Pass True or False.")
    return value


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _check_name(name: Any, owner: Any = None) -> str:
    if name is None and owner is not None:
        return _snake_case(type(owner).__name__)
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty str; got {name!r}.")
    return name


def _check_label_smoothing(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0.0 <= float(value) <= 1.0
    ):
        raise ValueError(
            f"`label_smoothing` must be a float in [0, 1]; got {value!r}. "
            "Pass 0.0 for no smoothing, or e.g. 0.1."
        )
    return float(value)


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
        self.name = _check_name(name, self)

    def __call__(self, y_true: Any, y_pred: Any) -> jax.Array:
        """Returns the per-example values, shape ``(batch,)``.

        Args:
          y_true: labels, batch axis first.
          y_pred: predictions, batch axis first.

        Returns:
          A ``(batch,)`` array; non-batch axes are averaged.

        Raises:
          ValueError: if the shapes do not fit.
        """
        what = f"{type(self).__name__} ({self.name!r})"
        y_true, y_pred = _prepare(y_true, y_pred, what)
        values = self._as_values(self.call(y_true, y_pred))
        return _per_example(values, y_pred.shape[0], what)

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


class Loss(PerExampleFunction):
    """Base class: a loss mapping ``(y_true, y_pred)`` to per-example values ``(batch,)``.

    Subclasses implement `call`, which may return any shape with the batch axis first;
    `__call__` checks the inputs and averages the non-batch axes.

    Args:
      name: the loss's name; defaults to the class name in snake case, as in Keras.

    Example:

    >>> import jax.numpy as jnp
    >>> class AbsCube(Loss):
    ...     def call(self, y_true, y_pred):
    ...         return jnp.abs(y_pred - y_true) ** 3
    >>> loss = AbsCube()
    >>> loss.name, loss(jnp.zeros((2, 3)), jnp.ones((2, 3))).tolist()
    ('abs_cube', [1.0, 1.0])
    """


class BinaryCrossentropy(Loss):
    """Binary cross-entropy, for 0/1 labels and one probability (or logit) per output.

    Predictions ``(b, 1)`` with labels ``(b,)`` or ``(b, 1)`` both work. Multi-label
    outputs ``(b, k)`` are averaged over ``k``.

    Args:
      from_logits: whether `y_pred` holds logits (computed stably with
        `optax.sigmoid_binary_cross_entropy`) rather than probabilities.
      label_smoothing: in [0, 1]; labels become ``y * (1 - s) + 0.5 * s``.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> loss = BinaryCrossentropy(from_logits=True)
    >>> [round(float(v), 4) for v in loss(np.array([1.0, 0.0]), np.array([[0.0], [0.0]]))]
    [0.6931, 0.6931]
    """

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        *,
        name: str = "binary_crossentropy",
    ):
        super().__init__(name=name)
        self.from_logits = _check_bool(from_logits, "from_logits")
        self.label_smoothing = _check_label_smoothing(label_smoothing)

    def call(self, y_true, y_pred):
        y_true, y_pred = _align_ranks(y_true, y_pred)
        _require_same_shape(y_true, y_pred, "BinaryCrossentropy")
        dtype = _compute_dtype(y_pred)
        y_pred = y_pred.astype(dtype)
        y_true = y_true.astype(dtype)
        if self.label_smoothing:
            y_true = y_true * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:
            return optax.sigmoid_binary_cross_entropy(y_pred, y_true)
        p = jnp.clip(y_pred, EPSILON, 1.0 - EPSILON)
        return -(y_true * jnp.log(p) + (1.0 - y_true) * jnp.log1p(-p))

    def get_config(self):
        return {
            "from_logits": self.from_logits,
            "label_smoothing": self.label_smoothing,
            **super().get_config(),
        }


def _class_log_probs(y_pred: jax.Array, from_logits: bool) -> jax.Array:
    if from_logits:
        return jax.nn.log_softmax(y_pred, axis=-1)
    # Keras renormalizes probabilities; the floor keeps an all-zero row (e.g. a padded
    # row through a ReLU head) finite instead of NaN, since NaN * mask 0 is still NaN.
    total = jnp.maximum(jnp.sum(y_pred, axis=-1, keepdims=True), EPSILON)
    return jnp.log(jnp.clip(y_pred / total, EPSILON, 1.0 - EPSILON))


def _require_class_axis(y_pred: jax.Array, what: str) -> None:
    if y_pred.ndim < 2:
        raise ValueError(
            f"{what} expects y_pred with a class axis, shape (batch, ..., num_classes); got "
            f"{y_pred.shape}. For one output per example use BinaryCrossentropy."
        )


class CategoricalCrossentropy(Loss):
    """Cross-entropy with one-hot (or soft) labels over the last axis.

    Args:
      from_logits: whether `y_pred` holds logits (computed with
        `optax.softmax_cross_entropy`) rather than probabilities.
      label_smoothing: in [0, 1]; labels become ``y * (1 - s) + s / num_classes``.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> loss = CategoricalCrossentropy()
    >>> values = loss(np.array([[0, 1], [1, 0]]), np.array([[0.5, 0.5], [0.9, 0.1]]))
    >>> [round(float(v), 4) for v in values]
    [0.6931, 0.1054]
    """

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        *,
        name: str = "categorical_crossentropy",
    ):
        super().__init__(name=name)
        self.from_logits = _check_bool(from_logits, "from_logits")
        self.label_smoothing = _check_label_smoothing(label_smoothing)

    def call(self, y_true, y_pred):
        _require_class_axis(y_pred, "CategoricalCrossentropy")
        _require_same_shape(
            y_true,
            y_pred,
            "CategoricalCrossentropy",
            " For integer class labels use SparseCategoricalCrossentropy.",
        )
        dtype = _compute_dtype(y_pred)
        y_pred = y_pred.astype(dtype)
        y_true = y_true.astype(dtype)
        if self.label_smoothing:
            num_classes = y_pred.shape[-1]
            y_true = y_true * (1.0 - self.label_smoothing) + self.label_smoothing / num_classes
        if self.from_logits:
            return optax.softmax_cross_entropy(y_pred, y_true)
        return -jnp.sum(y_true * _class_log_probs(y_pred, from_logits=False), axis=-1)

    def get_config(self):
        return {
            "from_logits": self.from_logits,
            "label_smoothing": self.label_smoothing,
            **super().get_config(),
        }


def _sparse_labels(y_true: jax.Array, y_pred: jax.Array, what: str) -> jax.Array:
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


class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy with integer class labels, ``(b,)`` or ``(b, 1)``.

    Args:
      from_logits: whether `y_pred` holds logits (computed with
        `optax.softmax_cross_entropy_with_integer_labels`) rather than probabilities.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> loss = SparseCategoricalCrossentropy(from_logits=True)
    >>> [round(float(v), 4) for v in loss(np.array([[1], [0]]), np.zeros((2, 4)))]
    [1.3863, 1.3863]
    """

    def __init__(self, from_logits: bool = False, *, name: str = "sparse_categorical_crossentropy"):
        super().__init__(name=name)
        self.from_logits = _check_bool(from_logits, "from_logits")

    def call(self, y_true, y_pred):
        _require_class_axis(y_pred, "SparseCategoricalCrossentropy")
        labels = _sparse_labels(y_true, y_pred, "SparseCategoricalCrossentropy")
        y_pred = y_pred.astype(_compute_dtype(y_pred))
        if self.from_logits:
            return optax.softmax_cross_entropy_with_integer_labels(y_pred, labels)
        log_p = _class_log_probs(y_pred, from_logits=False)
        return -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]

    def get_config(self):
        return {"from_logits": self.from_logits, **super().get_config()}


def _regression_inputs(y_true, y_pred, what):
    y_true, y_pred = _align_ranks(y_true, y_pred)
    _require_same_shape(y_true, y_pred, what)
    dtype = _compute_dtype(y_pred)
    return y_true.astype(dtype), y_pred.astype(dtype)


class MeanSquaredError(Loss):
    """Mean of squared errors over the non-batch axes.

    Args:
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> MeanSquaredError()(np.array([[0.0, 0.0], [1.0, 1.0]]), np.ones((2, 2))).tolist()
    [1.0, 0.0]
    """

    def __init__(self, *, name: str = "mean_squared_error"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        y_true, y_pred = _regression_inputs(y_true, y_pred, "MeanSquaredError")
        return optax.squared_error(y_pred, y_true)


class MeanAbsoluteError(Loss):
    """Mean of absolute errors over the non-batch axes.

    Args:
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> MeanAbsoluteError()(np.array([0.0, 3.0]), np.array([[1.0], [1.0]])).tolist()
    [1.0, 2.0]
    """

    def __init__(self, *, name: str = "mean_absolute_error"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        y_true, y_pred = _regression_inputs(y_true, y_pred, "MeanAbsoluteError")
        return jnp.abs(y_pred - y_true)


class Huber(Loss):
    """Huber loss: quadratic for errors up to `delta`, linear beyond (`optax.huber_loss`).

    Args:
      delta: the positive error size where the loss turns linear.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> Huber(delta=1.0)(np.zeros(2), np.array([0.5, 3.0])).tolist()
    [0.125, 2.5]
    """

    def __init__(self, delta: float = 1.0, *, name: str = "huber_loss"):
        super().__init__(name=name)
        if (
            isinstance(delta, bool)
            or not isinstance(delta, (int, float))
            or not (delta > 0 and math.isfinite(delta))
        ):
            raise ValueError(f"`delta` must be a positive finite float; got {delta!r}. E.g. 1.0.")
        self.delta = float(delta)

    def call(self, y_true, y_pred):
        y_true, y_pred = _regression_inputs(y_true, y_pred, "Huber")
        return optax.huber_loss(y_pred, y_true, delta=self.delta)

    def get_config(self):
        return {"delta": self.delta, **super().get_config()}


def _callable_name(fn: Callable[..., Any]) -> str:
    for attr in ("name", "__name__"):
        name = getattr(fn, attr, None)
        if isinstance(name, str) and name:
            return "lambda" if name == "<lambda>" else name
    return type(fn).__name__


class LossFunctionWrapper(Loss):
    """Wraps a function ``fn(y_true, y_pred) -> per-example loss`` as a `Loss`.

    Args:
      fn: returns values with the batch axis first; other axes are averaged.
      name: defaults to ``fn.__name__``.

    Example:

    >>> import jax.numpy as jnp
    >>> def cubic(y_true, y_pred):
    ...     return jnp.abs(y_pred - y_true) ** 3
    >>> loss = LossFunctionWrapper(cubic)
    >>> loss.name, loss(jnp.zeros(2), jnp.full((2,), 2.0)).tolist()
    ('cubic', [8.0, 8.0])
    """

    def __init__(self, fn: Callable[[Any, Any], Any], *, name: str | None = None):
        if not callable(fn):
            raise ValueError(
                f"`fn` must be callable as fn(y_true, y_pred); got {fn!r}. Pass a function."
            )
        super().__init__(name=_callable_name(fn) if name is None else name)
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)

    def get_config(self):
        return {"fn": self.fn, **super().get_config()}


_REGISTRY: dict[str, Callable[[], Loss]] = {
    "binary_crossentropy": BinaryCrossentropy,
    "bce": BinaryCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "huber": Huber,
    "huber_loss": Huber,
}
_CLASSES = (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    SparseCategoricalCrossentropy,
    MeanSquaredError,
    MeanAbsoluteError,
    Huber,
)
_REGISTRY.update({cls.__name__: cls for cls in _CLASSES})


def get(identifier: Loss | str | Callable[[Any, Any], Any]) -> Loss:
    """Resolves a loss given as an instance, a Keras name, a `Loss` class, or a function.

    Args:
      identifier: a `Loss` (returned as is); a name such as ``"binary_crossentropy"``,
        ``"categorical_crossentropy"``, ``"sparse_categorical_crossentropy"``,
        ``"mse"``/``"mean_squared_error"``, ``"mae"``/``"mean_absolute_error"``,
        ``"huber"`` or a class name like ``"BinaryCrossentropy"``; a `Loss` subclass
        (instantiated with defaults); or a function ``fn(y_true, y_pred)`` returning
        per-example values (wrapped, named after ``fn.__name__``).

    Returns:
      A `Loss`.

    Raises:
      ValueError: for an unknown name or an identifier of another type.

    Example:

    >>> get("mse").name
    'mean_squared_error'
    >>> get(BinaryCrossentropy(from_logits=True)).from_logits
    True
    """
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, str):
        if identifier in _REGISTRY:
            return _REGISTRY[identifier]()
        raise ValueError(
            f"Unknown loss {identifier!r}. Valid names: {sorted(_REGISTRY)}; or pass a "
            "jstrategy.losses.Loss, or a function fn(y_true, y_pred) -> per-example loss."
        )
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()
    if callable(identifier):
        return LossFunctionWrapper(identifier)
    raise ValueError(
        f"`loss` must be a jstrategy.losses.Loss, a loss name or a function "
        f"fn(y_true, y_pred); got {identifier!r}. E.g. loss='sparse_categorical_crossentropy'."
    )
