"""Keras-compatible losses: Keras's per-element values, weighted and reduced as Keras does.

Every loss maps ``(y_true, y_pred)`` to values with the batch axis first (`Loss.values`):
as in Keras, only the last (class or feature) axis is reduced, so ``(b, k)`` outputs give
``(b,)`` and sequence outputs ``(b, t, k)`` give ``(b, t)``, one value per time step. A
sample weight multiplies them element by element (``(b,)`` and ``(b, 1)`` weigh rows,
``(b, t)`` and ``(b, t, 1)`` weigh time steps, e.g. a padding mask), and the reduction
``"sum_over_batch_size"`` divides the weighted sum by the number of elements (``b * t``),
not by the sum of the weights.

The train step (`Model.compile`, `make_train_step`) computes the same thing over the real
rows of the global batch: each replica sums its weighted values (padding rows weigh 0) and
divides by the elements per row; one all-reduce adds the replicas' sums and their counts
of real rows, and the quotient is Keras's ``"sum_over_batch_size"`` loss of the global
batch. Calling a loss object directly reduces as Keras does (`Reduction`); inside
`Strategy.run` the default ``"sum_over_batch_size"`` is an error, as in TF, because it
would average one replica's rows only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jstrategy._src import context
from jstrategy._src.registry import register_kind
from jstrategy._src.registry import register_saveable
from jstrategy._src.registry import saveable_classes
from jstrategy._src.training.per_example import PerExampleFunction
from jstrategy._src.training.per_example import align_ranks
from jstrategy._src.training.per_example import callable_name
from jstrategy._src.training.per_example import compute_dtype
from jstrategy._src.training.per_example import require_class_axis
from jstrategy._src.training.per_example import require_same_shape
from jstrategy._src.training.per_example import sparse_labels
from jstrategy._src.training.per_example import squeeze_or_expand_to_same_rank
from jstrategy._src.training.per_example import weighted_values
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import check_number
from jstrategy._src.validation import keras_object

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "get",
]

# Keras's backend.epsilon(): probabilities are clipped to [EPSILON, 1 - EPSILON] before log.
EPSILON = 1e-7


def _check_label_smoothing(value: Any) -> float:
    return check_number(
        value, "label_smoothing", low=0, high=1, fix="Pass 0.0 for no smoothing, or e.g. 0.1."
    )


class Reduction(enum.Enum):
    """How a loss object called directly reduces its weighted values (Keras's names).

    The values are the loss per element (`Loss.values`: ``(b,)``, or ``(b, t)`` for
    sequence outputs), each multiplied by its sample weight.

    * ``NONE``: the weighted values, of the values' shape (``(b, t)`` stays ``(b, t)``).
    * ``SUM``: their sum.
    * ``SUM_OVER_BATCH_SIZE`` (the default): their sum divided by the number of values
      (``b * t``), whatever the weights, as Keras.
    * ``MEAN``: Keras's other name for ``SUM_OVER_BATCH_SIZE``; ``AUTO``: TF's.
    * ``MEAN_WITH_SAMPLE_WEIGHT``: their sum divided by the sum of the sample weights (as
      given: a ``(b, 1)`` weight counts once per row), or by the number of values
      without weights.

    Inside `Strategy.run`, rows that a distributed dataset added as padding count for
    nothing (their values are 0 with ``NONE``), and the reductions that divide are errors,
    as in TF: they would average this replica's rows only, not the global batch. Use
    ``NONE`` and `jstrategy.compute_average_loss`, as TF's custom-training tutorial does.
    `compile` and the train step compute ``SUM_OVER_BATCH_SIZE`` over the real rows of the
    global batch whatever the loss's reduction (``NONE`` and ``MEAN`` alike); they refuse
    ``SUM`` and ``MEAN_WITH_SAMPLE_WEIGHT``, whose meaning depends on how the data is cut
    into batches.

    Example:

    >>> import numpy as np, jstrategy
    >>> Reduction = jstrategy.losses.Reduction
    >>> y_true, y_pred = np.array([0.0, 1.0]), np.array([1.0, 1.0])
    >>> jstrategy.losses.MeanSquaredError(reduction=Reduction.NONE)(y_true[:, None], y_pred[:, None]).tolist()
    [1.0, 0.0]
    >>> float(jstrategy.losses.MeanSquaredError(reduction="sum")(y_true[:, None], y_pred[:, None]))
    1.0
    """

    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"
    MEAN = "mean"
    MEAN_WITH_SAMPLE_WEIGHT = "mean_with_sample_weight"
    AUTO = "auto"


#: The reductions that divide by a count: an error inside `Strategy.run`.
_DIVIDING = (
    Reduction.SUM_OVER_BATCH_SIZE,
    Reduction.MEAN,
    Reduction.AUTO,
    Reduction.MEAN_WITH_SAMPLE_WEIGHT,
)


def _reduction(value: Any) -> Reduction:
    if value is None:
        return Reduction.NONE
    if isinstance(value, Reduction):
        return value
    try:
        return Reduction(value)
    except ValueError:
        raise ValueError(
            f"`reduction` must be one of {[r.value for r in Reduction]} (or a "
            f"jstrategy.losses.Reduction); got {value!r}. Use 'none' for per-example losses."
        ) from None


class Loss(PerExampleFunction):
    """Base class: a loss mapping ``(y_true, y_pred)`` to values with the batch axis first.

    Subclasses implement `call`, returning Keras's per-element values: the class or
    feature axis reduced, any other axis kept (``(b, t)`` for sequence outputs). Calling
    the loss weighs and reduces them as `reduction` says (Keras's
    ``reduce_weighted_values``); `compile` and the train step use `values` and reduce over
    the real rows of the global batch (see `Reduction`). `per_example` averages the values
    over the non-batch axes: one value per row.

    Args:
      reduction: a `Reduction` or its value: ``"sum_over_batch_size"`` (the default: the
        weighted sum over the number of values), ``"sum"``, ``"none"``, ``"mean"`` or
        ``"mean_with_sample_weight"``.
      name: the loss's name; defaults to the class name in snake case, as in Keras.

    Example:

    >>> import jax.numpy as jnp
    >>> class AbsCube(Loss):
    ...     def call(self, y_true, y_pred):
    ...         return jnp.mean(jnp.abs(y_pred - y_true) ** 3, axis=-1)
    >>> loss = AbsCube(reduction="none")
    >>> loss.name, loss(jnp.zeros((2, 3)), jnp.ones((2, 3))).tolist()
    ('abs_cube', [1.0, 1.0])
    >>> y, p = jnp.zeros((2, 2, 1)), jnp.array([[[1.0], [2.0]], [[1.0], [1.0]]])
    >>> float(AbsCube()(y, p, sample_weight=jnp.array([[1.0, 0.0], [1.0, 1.0]])))  # 3 / 4
    0.75
    """

    #: What the loss expects its predictions to be when ``from_logits`` is False:
    #: ``"binary"`` (each value a probability) or ``"categorical"`` (rows of
    #: probabilities summing to 1); None: any value (`expects_probabilities`).
    _probabilities: str | None = None

    def __init__(self, *, reduction: Any = "sum_over_batch_size", name: str | None = None):
        super().__init__(name=name)
        self.reduction = _reduction(reduction)

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> jax.Array:
        """The loss, weighted and reduced as `reduction` says (Keras's ``loss(y_true, y_pred,
        sample_weight)``).

        Args:
          y_true: labels, batch axis first.
          y_pred: predictions, batch axis first.
          sample_weight: optional weights multiplying the values (`values`) element by
            element: a scalar, one per example (``(b,)``, ``(b, 1)``), or one per element
            (``(b, t)``, ``(b, t, 1)`` for values ``(b, t)``).

        Returns:
          A scalar, or the weighted values (``(b,)``, ``(b, t)``) with ``reduction="none"``.

        Raises:
          ValueError: if the shapes do not fit, or for a reduction that divides (the
            default) inside `Strategy.run`.
        """
        what = f"{type(self).__name__} ({self.name!r})"
        values = self.values(y_true, y_pred)
        values = values.astype(compute_dtype(values))
        ctx = context.inside_run()
        if ctx is not None and self.reduction in _DIVIDING:
            raise ValueError(
                f"{type(self).__name__}(reduction='{self.reduction.value}') called inside "
                "strategy.run would average this replica's rows only, not the global batch. "
                "As in TF, create the loss with reduction='none' and pass its per-example "
                "values to jstrategy.compute_average_loss(per_example_loss), which divides "
                "by the global batch (or use reduction='sum' and divide by the global batch "
                "size yourself)."
            )
        weight = None
        if sample_weight is not None:
            weight = jnp.asarray(sample_weight, values.dtype)
            values = weighted_values(values, weight, what)
        mask = None if ctx is None else ctx.row_mask
        if mask is not None:
            if mask.shape[0] != values.shape[0]:
                raise ValueError(
                    f"{type(self).__name__} got {values.shape[0]} rows but this replica's "
                    f"batch has {mask.shape[0]} (its row mask); pass labels and predictions "
                    "for the rows the distributed dataset gave this replica."
                )
            keep = mask.reshape(mask.shape + (1,) * (values.ndim - 1))
            values = jnp.where(keep, values, jnp.zeros((), values.dtype))
        if self.reduction is Reduction.NONE:
            return values
        total = jnp.sum(values)
        if self.reduction is Reduction.SUM:
            return total
        if self.reduction is Reduction.MEAN_WITH_SAMPLE_WEIGHT and weight is not None:
            # Keras divides by the weights as aligned to the values, not broadcast to them.
            _, aligned = squeeze_or_expand_to_same_rank(values, weight)
            divisor = jnp.sum(aligned)
        else:
            divisor = jnp.asarray(values.size, values.dtype)
        return jnp.where(divisor != 0, total / jnp.where(divisor != 0, divisor, 1), 0.0)

    def get_config(self) -> dict[str, Any]:
        return {"reduction": self.reduction.value, **super().get_config()}

    @property
    def expects_probabilities(self) -> str | None:
        """``"binary"`` or ``"categorical"`` when the loss reads its predictions as
        probabilities (a cross-entropy with ``from_logits=False``), else None.

        The train step checks the first step's predictions against it and warns once when
        they are not probabilities (`jstrategy.losses.NotProbabilitiesWarning`).

        Example:

        >>> SparseCategoricalCrossentropy().expects_probabilities
        'categorical'
        >>> SparseCategoricalCrossentropy(from_logits=True).expects_probabilities is None
        True
        """
        if getattr(self, "from_logits", False):
            return None
        return self._probabilities


class _SmoothedCrossentropy(Loss):
    """What the binary and categorical cross-entropies share: logits and label smoothing."""

    def __init__(self, from_logits: bool, label_smoothing: float, *, reduction: Any, name: str):
        super().__init__(reduction=reduction, name=name)
        self.from_logits = check_bool(from_logits, "from_logits")
        self.label_smoothing = _check_label_smoothing(label_smoothing)

    def get_config(self):
        return {
            "from_logits": self.from_logits,
            "label_smoothing": self.label_smoothing,
            **super().get_config(),
        }


register_kind("loss", Loss)


@register_saveable(kind="loss")
class BinaryCrossentropy(_SmoothedCrossentropy):
    """Binary cross-entropy, for 0/1 labels and one probability (or logit) per output.

    Predictions ``(b, 1)`` with labels ``(b,)`` or ``(b, 1)`` both work. As in Keras, the
    last axis is averaged: multi-label outputs ``(b, k)`` give ``(b,)``, sequence outputs
    ``(b, t, 1)`` give one value per time step ``(b, t)``.

    Args:
      from_logits: whether `y_pred` holds logits (computed stably with
        `optax.sigmoid_binary_cross_entropy`) rather than probabilities.
      label_smoothing: in [0, 1]; labels become ``y * (1 - s) + 0.5 * s``.
      reduction: how calling the loss reduces its weighted values (`Reduction`):
        ``"sum_over_batch_size"`` (default), ``"sum"`` or ``"none"``.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> loss = BinaryCrossentropy(from_logits=True, reduction="none")
    >>> [round(float(v), 4) for v in loss(np.array([1.0, 0.0]), np.array([[0.0], [0.0]]))]
    [0.6931, 0.6931]
    """

    _probabilities = "binary"

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        *,
        reduction: Any = "sum_over_batch_size",
        name: str = "binary_crossentropy",
    ):
        super().__init__(from_logits, label_smoothing, reduction=reduction, name=name)

    def call(self, y_true, y_pred):
        y_true, y_pred = _feature_inputs(y_true, y_pred, "BinaryCrossentropy")
        if self.label_smoothing:
            y_true = y_true * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:
            return jnp.mean(optax.sigmoid_binary_cross_entropy(y_pred, y_true), axis=-1)
        p = jnp.clip(y_pred, EPSILON, 1.0 - EPSILON)
        return jnp.mean(-(y_true * jnp.log(p) + (1.0 - y_true) * jnp.log1p(-p)), axis=-1)


def _class_log_probs(y_pred: jax.Array, from_logits: bool) -> jax.Array:
    if from_logits:
        return jax.nn.log_softmax(y_pred, axis=-1)
    # Keras renormalizes probabilities; the floor keeps an all-zero row (e.g. a padded
    # row through a ReLU head) finite instead of NaN, since NaN * mask 0 is still NaN.
    total = jnp.maximum(jnp.sum(y_pred, axis=-1, keepdims=True), EPSILON)
    return jnp.log(jnp.clip(y_pred / total, EPSILON, 1.0 - EPSILON))


@register_saveable(kind="loss")
class CategoricalCrossentropy(_SmoothedCrossentropy):
    """Cross-entropy with one-hot (or soft) labels over the last (class) axis: ``(b,)``
    for ``(b, k)``, ``(b, t)`` for sequence outputs ``(b, t, k)``.

    Args:
      from_logits: whether `y_pred` holds logits (computed with
        `optax.softmax_cross_entropy`) rather than probabilities.
      label_smoothing: in [0, 1]; labels become ``y * (1 - s) + s / num_classes``.
      reduction: how calling the loss reduces its weighted values (`Reduction`):
        ``"sum_over_batch_size"`` (default), ``"sum"`` or ``"none"``.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> loss = CategoricalCrossentropy(reduction="none")
    >>> values = loss(np.array([[0, 1], [1, 0]]), np.array([[0.5, 0.5], [0.9, 0.1]]))
    >>> [round(float(v), 4) for v in values]
    [0.6931, 0.1054]
    """

    _probabilities = "categorical"

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        *,
        reduction: Any = "sum_over_batch_size",
        name: str = "categorical_crossentropy",
    ):
        super().__init__(from_logits, label_smoothing, reduction=reduction, name=name)

    def call(self, y_true, y_pred):
        require_class_axis(y_pred, "CategoricalCrossentropy")
        require_same_shape(
            y_true,
            y_pred,
            "CategoricalCrossentropy",
            " For integer class labels use SparseCategoricalCrossentropy.",
        )
        dtype = compute_dtype(y_pred)
        y_pred = y_pred.astype(dtype)
        y_true = y_true.astype(dtype)
        if self.label_smoothing:
            num_classes = y_pred.shape[-1]
            y_true = y_true * (1.0 - self.label_smoothing) + self.label_smoothing / num_classes
        if self.from_logits:
            return optax.softmax_cross_entropy(y_pred, y_true)
        return -jnp.sum(y_true * _class_log_probs(y_pred, from_logits=False), axis=-1)


@register_saveable(kind="loss")
class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy with integer class labels, ``(b,)`` or ``(b, 1)`` (``(b, t)`` for
    sequence outputs ``(b, t, k)``, giving one value per time step).

    Args:
      from_logits: whether `y_pred` holds logits (computed with
        `optax.softmax_cross_entropy_with_integer_labels`) rather than probabilities.
      reduction: how calling the loss reduces its weighted values (`Reduction`):
        ``"sum_over_batch_size"`` (default), ``"sum"`` or ``"none"``.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> loss = SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    >>> [round(float(v), 4) for v in loss(np.array([[1], [0]]), np.zeros((2, 4)))]
    [1.3863, 1.3863]
    """

    _probabilities = "categorical"

    def __init__(
        self,
        from_logits: bool = False,
        *,
        reduction: Any = "sum_over_batch_size",
        name: str = "sparse_categorical_crossentropy",
    ):
        super().__init__(reduction=reduction, name=name)
        self.from_logits = check_bool(from_logits, "from_logits")

    def call(self, y_true, y_pred):
        require_class_axis(y_pred, "SparseCategoricalCrossentropy")
        labels = sparse_labels(y_true, y_pred, "SparseCategoricalCrossentropy")
        y_pred = y_pred.astype(compute_dtype(y_pred))
        if self.from_logits:
            return optax.softmax_cross_entropy_with_integer_labels(y_pred, labels)
        log_p = _class_log_probs(y_pred, from_logits=False)
        return -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]

    def get_config(self):
        return {"from_logits": self.from_logits, **super().get_config()}


def _feature_inputs(y_true, y_pred, what):
    """Labels and predictions of one shape, float, with a last (feature) axis to reduce.

    Keras reduces the last axis even of ``(b,)`` predictions, which averages the batch
    into one value; here ``(b,)`` counts as ``(b, 1)``: one value per example.
    """
    y_true, y_pred = align_ranks(y_true, y_pred)
    require_same_shape(y_true, y_pred, what)
    if y_pred.ndim == 1:
        y_true, y_pred = y_true[:, None], y_pred[:, None]
    dtype = compute_dtype(y_pred)
    return y_true.astype(dtype), y_pred.astype(dtype)


@register_saveable(kind="loss")
class MeanSquaredError(Loss):
    """Mean of squared errors over the last axis: ``(b,)`` for ``(b, k)``, ``(b, t)`` for
    ``(b, t, k)`` (Keras's).

    Args:
      reduction: how calling the loss reduces its weighted values (`Reduction`):
        ``"sum_over_batch_size"`` (default), ``"sum"`` or ``"none"``.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> MeanSquaredError(reduction="none")(np.zeros((2, 2)), np.array([[1.0, 1.0], [0.0, 0.0]])).tolist()
    [1.0, 0.0]
    """

    def __init__(self, *, reduction: Any = "sum_over_batch_size", name: str = "mean_squared_error"):
        super().__init__(reduction=reduction, name=name)

    def call(self, y_true, y_pred):
        y_true, y_pred = _feature_inputs(y_true, y_pred, "MeanSquaredError")
        return jnp.mean(optax.squared_error(y_pred, y_true), axis=-1)


@register_saveable(kind="loss")
class MeanAbsoluteError(Loss):
    """Mean of absolute errors over the last axis: ``(b,)`` for ``(b, k)``, ``(b, t)`` for
    ``(b, t, k)`` (Keras's).

    Args:
      reduction: how calling the loss reduces its weighted values (`Reduction`):
        ``"sum_over_batch_size"`` (default), ``"sum"`` or ``"none"``.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> MeanAbsoluteError(reduction="none")(np.array([0.0, 3.0]), np.array([[1.0], [1.0]])).tolist()
    [1.0, 2.0]
    """

    def __init__(
        self, *, reduction: Any = "sum_over_batch_size", name: str = "mean_absolute_error"
    ):
        super().__init__(reduction=reduction, name=name)

    def call(self, y_true, y_pred):
        y_true, y_pred = _feature_inputs(y_true, y_pred, "MeanAbsoluteError")
        return jnp.mean(jnp.abs(y_pred - y_true), axis=-1)


@register_saveable(kind="loss")
class Huber(Loss):
    """Huber loss: quadratic for errors up to `delta`, linear beyond (`optax.huber_loss`),
    averaged over the last axis as in Keras.

    Args:
      delta: the positive error size where the loss turns linear.
      reduction: how calling the loss reduces its weighted values (`Reduction`):
        ``"sum_over_batch_size"`` (default), ``"sum"`` or ``"none"``.
      name: the loss's name.

    Example:

    >>> import numpy as np
    >>> Huber(delta=1.0, reduction="none")(np.zeros(2), np.array([0.5, 3.0])).tolist()
    [0.125, 2.5]
    """

    def __init__(
        self,
        delta: float = 1.0,
        *,
        reduction: Any = "sum_over_batch_size",
        name: str = "huber_loss",
    ):
        super().__init__(reduction=reduction, name=name)
        self.delta = check_number(
            delta, "delta", low=0, low_open=True, finite=True, fix="E.g. 1.0."
        )

    def call(self, y_true, y_pred):
        y_true, y_pred = _feature_inputs(y_true, y_pred, "Huber")
        return jnp.mean(optax.huber_loss(y_pred, y_true, delta=self.delta), axis=-1)

    def get_config(self):
        return {"delta": self.delta, **super().get_config()}


class LossFunctionWrapper(Loss):
    """Wraps a function ``fn(y_true, y_pred) -> values`` as a `Loss`.

    Args:
      fn: returns values with the batch axis first, as Keras's loss functions do (e.g.
        ``(b,)``, or ``(b, t)`` per time step); they are weighted and reduced as the
        built-in losses' are (the default divides their weighted sum by their number).
      reduction: how calling the loss reduces its weighted values (`Reduction`).
      name: defaults to ``fn.__name__``.

    Example:

    >>> import jax.numpy as jnp
    >>> def cubic(y_true, y_pred):
    ...     return jnp.abs(y_pred - y_true) ** 3
    >>> loss = LossFunctionWrapper(cubic)
    >>> loss.name, loss.per_example(jnp.zeros(2), jnp.full((2,), 2.0)).tolist()
    ('cubic', [8.0, 8.0])
    >>> float(loss(jnp.zeros(2), jnp.array([1.0, 2.0])))  # reduced: the mean
    4.5
    """

    def __init__(
        self,
        fn: Callable[[Any, Any], Any],
        *,
        reduction: Any = "sum_over_batch_size",
        name: str | None = None,
    ):
        if not callable(fn):
            raise ValueError(
                f"`fn` must be callable as fn(y_true, y_pred); got {fn!r}. Pass a function."
            )
        super().__init__(reduction=reduction, name=callable_name(fn) if name is None else name)
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)

    def get_config(self):
        return {"fn": self.fn, **super().get_config()}


# Keras's string names; a registered class name (``"BinaryCrossentropy"``) is taken too.
_ALIASES: dict[str, Callable[[], Loss]] = {
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
    return keras_object(
        identifier,
        {**saveable_classes("loss"), **_ALIASES},
        Loss,
        LossFunctionWrapper,
        unknown=lambda known: (
            f"Unknown loss {identifier!r}. Valid names: {known}; or pass "
            "a jstrategy.losses.Loss, or a function fn(y_true, y_pred) -> per-example loss."
        ),
        bad=f"`loss` must be a jstrategy.losses.Loss, a loss name or a function "
        f"fn(y_true, y_pred); got {identifier!r}. E.g. loss='sparse_categorical_crossentropy'.",
    )
