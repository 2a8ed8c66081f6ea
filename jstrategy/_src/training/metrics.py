"""Keras-compatible metrics: per-example values for the train step, state for custom loops.

A metric maps ``(y_true, y_pred)`` to a ``(batch,)`` array (`Metric.per_example`) whose
mean over the real rows of every replica is the metric. That form makes aggregation exact
across replicas and across padded partial batches: the train step (`Model.compile`,
`make_train_step`) sums ``value * mask`` and ``mask`` with one all-reduce and divides at the
end of the epoch.

The same objects are Keras's stateful metrics in a custom loop: `Metric.update_state`
adds a batch to a running total and count, `result` divides them, `reset_state` zeroes
them. Inside `Strategy.run` an update counts only the replica's real rows (the row mask of
a padded batch). As TF's metric variables (synchronized on read, by a sum), each replica
adds to its own part of the total and count, threaded through `run`'s compiled program
(`tracked.SummedOnRead`) with no collective per update, and `result` sums the parts: the
value over every replica and worker, the global batch's. Under `ParameterServerStrategy`
they are parameter-server variables that every worker adds to.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src import context
from jstrategy._src import devices as devices_lib
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.registry import register_kind
from jstrategy._src.registry import register_saveable
from jstrategy._src.registry import saveable_classes
from jstrategy._src.strategy import get_strategy
from jstrategy._src.tracked import SummedOnRead
from jstrategy._src.training import losses as losses_lib
from jstrategy._src.training.per_example import PerExampleFunction
from jstrategy._src.training.per_example import align_ranks
from jstrategy._src.training.per_example import callable_name
from jstrategy._src.training.per_example import compute_dtype
from jstrategy._src.training.per_example import require_class_axis
from jstrategy._src.training.per_example import require_same_shape
from jstrategy._src.training.per_example import samplewise
from jstrategy._src.training.per_example import sparse_labels
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import check_number
from jstrategy._src.validation import keras_object
from jstrategy._src.values import local_copy

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "get",
]


class Metric(PerExampleFunction):
    """Base class: per-example metric values whose masked mean is the metric, and Keras's
    stateful API over them.

    Subclasses implement `call`, which may return any shape with the batch axis first;
    `per_example` checks the inputs and averages the non-batch axes. `compile(metrics=...)`
    and the train step use `per_example`; custom loops use `update_state`, `result` and
    `reset_state`, inside `Strategy.run` or outside, as in TF.

    Attributes:
      name: the key under which the metric appears in logs and History.
      direction: ``"up"`` if larger is better, ``"down"`` if smaller is, ``None`` if
        unknown; `EarlyStopping(mode="auto")` reads it.

    Args:
      name: the metric's name; defaults to the class name in snake case, as in Keras.

    Example:

    >>> import jax.numpy as jnp
    >>> class WithinOne(Metric):
    ...     direction = "up"
    ...     def call(self, y_true, y_pred):
    ...         return (jnp.abs(y_pred - y_true) <= 1).astype(jnp.float32)
    >>> m = WithinOne()
    >>> m.name, m.per_example(jnp.zeros(3), jnp.array([0.5, 2.0, -1.0])).tolist()
    ('within_one', [1.0, 0.0, 1.0])
    >>> m.update_state(jnp.zeros(3), jnp.array([0.5, 2.0, -1.0]))
    >>> round(float(m.result()), 4)
    0.6667
    """

    direction: str | None = None

    def __init__(self, *, name: str | None = None):
        super().__init__(name=name)
        self._totals: _Totals | None = None
        if context.has_strategy() and context.inside_run() is None:
            # Created in a scope: its variables live where that strategy keeps metrics'
            # (TF: SUM-synchronized parts on the replicas, or variables on the ps), also
            # when it is updated outside the scope.
            self._totals = _Totals.create(self.name, get_strategy())

    def _as_values(self, values: Any) -> Any:
        values = jnp.asarray(values)
        if not jnp.issubdtype(values.dtype, jnp.floating):
            values = values.astype(jnp.float32)
        return values

    # Keras's stateful API -----------------------------------------------------------------
    def _state(self) -> _Totals:
        if self._totals is None:
            self._totals = _Totals.create(self.name)
        return self._totals

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds a batch to the running total and count.

        Inside `Strategy.run`: this replica's real rows only (padding rows of a
        distributed dataset's batch count for nothing), added to the replica's own part;
        `result` sums the parts, so the metric is the global batch's, as TF's.

        Args:
          y_true: labels, batch axis first.
          y_pred: predictions, batch axis first.
          sample_weight: optional weights: a scalar, or one per example.

        Raises:
          ValueError: if the shapes do not fit.
        """
        values = self.values(y_true, y_pred)
        self._state().add(values, sample_weight, rows=True)

    def result(self) -> jax.Array:
        """The metric so far: the weighted mean of what was added (0 before any update)."""
        return self._state().mean()

    def reset_state(self) -> None:
        """Zeroes the running total and count (Keras's ``reset_state``; TF's older
        ``reset_states`` works too)."""
        self._state().reset()

    def reset_states(self) -> None:
        """Alias of `reset_state` (TF 2's older name)."""
        self.reset_state()

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> jax.Array:
        """Keras's ``metric(y_true, y_pred)``: `update_state`, then `result`.

        For the per-example values without changing the state, use `per_example`.
        """
        self.update_state(y_true, y_pred, sample_weight)
        return self.result()

    @property
    def variables(self) -> list[jax.Array]:
        """The running total and count, as arrays (this process's copy)."""
        return list(self._state().values())


def _ps_strategy(strategy: Any) -> Any:
    """`strategy` if it is a `ParameterServerStrategy` (whose variables live on the ps)."""
    return strategy if hasattr(strategy, "create_variables") else None


def _totals_of(values: Any, sample_weight: Any, *, rows: bool) -> tuple[jax.Array, jax.Array]:
    """The weighted sum of `values` and the sum of weights, as Keras's ``Mean`` adds them
    (`samplewise`: a ``(b, 1)`` weight weighs rows, a ``(b, t)`` one time steps), counting
    only real rows inside `Strategy.run` (when `rows`, or when `values` has one entry per
    row of the batch)."""
    values = jnp.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        values = values.astype(jnp.float32)
    values = values.astype(jnp.promote_types(values.dtype, jnp.float32))
    values, weight = samplewise(values, sample_weight, "The metric")
    weight = jnp.ones(values.shape, values.dtype) if weight is None else weight
    ctx = context.inside_run()
    mask = None if ctx is None else ctx.row_mask
    if mask is not None and values.ndim and (rows or values.shape[0] == mask.shape[0]):
        if values.shape[0] != mask.shape[0]:
            raise ValueError(
                f"The metric got {values.shape[0]} rows but this replica's batch has "
                f"{mask.shape[0]} (its row mask); pass labels and predictions for the rows "
                "the distributed dataset gave this replica."
            )
        keep = mask.astype(values.dtype)
        weight = weight * keep
        values = jnp.where(keep > 0, values, jnp.zeros((), values.dtype))
    return jnp.sum(values), jnp.sum(weight)


class _Totals:
    """A metric's running total and count, where the strategy keeps metric variables."""

    def __init__(self, name: str):
        self.name = name
        self._holder: SummedOnRead | None = None
        self._ps_variables: Any = None

    @classmethod
    def create(cls, name: str, strategy: Strategy | None = None) -> _Totals:
        """Totals for `strategy`'s replicas; None: placed where first used."""
        totals = cls(name)
        zeros = {"total": np.float32(0), "count": np.float32(0)}
        ps = _ps_strategy(strategy or get_strategy())
        if ps is not None:
            totals._ps_variables = ps.create_variables(zeros)
        else:
            totals._holder = SummedOnRead(zeros, name=f"the metric {name!r}")
            # A TPU topology's compile-only devices hold nothing: a model planned there
            # (`jstrategy.experimental.plan`) places its metrics where first used.
            if strategy is not None and not devices_lib.compile_only(strategy.mesh.devices.flat[0]):
                totals._holder.value_on(strategy)
        return totals

    def add(self, values: Any, sample_weight: Any, *, rows: bool) -> None:
        total, count = _totals_of(values, sample_weight, rows=rows)
        delta = {"total": total.astype(jnp.float32), "count": count.astype(jnp.float32)}
        if self._ps_variables is not None:
            self._ps_variables.assign_add(delta)
            return
        # Inside run each replica adds to its own part, with no collective (TF's metric
        # variables are SUM-synchronized on read, too).
        assert self._holder is not None
        old = self._holder.read()
        self._holder.write(jax.tree.map(jnp.add, old, delta))

    def _current(self) -> dict[str, Any]:
        ctx = context.inside_run()
        if self._ps_variables is not None:
            return self._ps_variables.read() if ctx is not None else self._ps_variables.numpy()
        assert self._holder is not None
        value = self._holder.read()
        if ctx is not None:  # this replica's part: the sum over the replicas
            return ctx.all_reduce(ReduceOp.SUM, value)
        return jax.tree.map(local_copy, value)  # this process's copy: readable on the host

    def values(self) -> tuple[Any, Any]:
        current = self._current()
        return current["total"], current["count"]

    def mean(self) -> jax.Array:
        total, count = self.values()
        total, count = jnp.asarray(total), jnp.asarray(count)
        return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)

    def reset(self) -> None:
        zeros = {"total": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.float32)}
        if self._ps_variables is not None:
            self._ps_variables.assign(zeros)
            return
        assert self._holder is not None
        self._holder.write(zeros if context.inside_run() else jax.device_get(zeros))


class Mean(Metric):
    """The running (weighted) mean of the values given to `update_state` (Keras's ``Mean``).

    Inside `Strategy.run`, values with one entry per row of the replica's batch count only
    the real rows; a scalar counts once per replica.

    Args:
      name: the metric's name.

    Example:

    >>> m = Mean()
    >>> m.update_state([1.0, 3.0])
    >>> m.update_state(5.0, sample_weight=2.0)
    >>> float(m.result())
    3.5
    """

    def __init__(self, *, name: str = "mean"):
        super().__init__(name=name)

    def update_state(self, values: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Adds `values` (any shape; each element counts, weighted by `sample_weight`)."""
        self._state().add(values, sample_weight, rows=False)

    def __call__(self, values: Any, sample_weight: Any = None) -> jax.Array:  # type: ignore[override]
        """`update_state`, then `result`."""
        self.update_state(values, sample_weight)
        return self.result()

    def call(self, y_true, y_pred):
        raise TypeError(
            "Mean averages the values given to update_state(values); it has no per-example "
            "form of (y_true, y_pred). For compile(metrics=...), wrap a function in "
            "MeanMetricWrapper."
        )


register_kind("metric", Metric)


@register_saveable(kind="metric")
class Accuracy(Metric):
    """How often predictions equal labels exactly (Keras's `Accuracy`).

    Args:
      name: the metric's name.

    Example:

    >>> import numpy as np
    >>> Accuracy().per_example(np.array([1, 2, 3]), np.array([1, 0, 3])).tolist()
    [1.0, 0.0, 1.0]
    """

    direction = "up"

    def __init__(self, *, name: str = "accuracy"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        y_true, y_pred = align_ranks(y_true, y_pred)
        require_same_shape(y_true, y_pred, "Accuracy")
        return (y_true.astype(y_pred.dtype) == y_pred).astype(jnp.float32)


def _logit(p: float) -> float:
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return math.inf
    return math.log(p / (1.0 - p))


@register_saveable(kind="metric")
class BinaryAccuracy(Metric):
    """How often thresholded predictions match 0/1 labels.

    Args:
      threshold: a prediction counts as 1 when it is above this probability.
      from_logits: whether `y_pred` holds logits; the threshold then applies to
        ``sigmoid(y_pred)``, i.e. ``y_pred > log(t / (1 - t))`` (``> 0`` for 0.5), which
        stays exact where the sigmoid saturates.
      name: the metric's name.

    Example:

    >>> import numpy as np
    >>> BinaryAccuracy().per_example(np.array([1, 0, 1]), np.array([[0.7], [0.6], [0.2]])).tolist()
    [1.0, 0.0, 0.0]
    >>> BinaryAccuracy(from_logits=True).per_example(np.array([1, 0]), np.array([[2.0], [-3.0]])).tolist()
    [1.0, 1.0]
    """

    direction = "up"

    def __init__(
        self, threshold: float = 0.5, *, from_logits: bool = False, name: str = "binary_accuracy"
    ):
        super().__init__(name=name)
        check_number(threshold, "threshold", finite=True, fix="E.g. 0.5.")
        self.from_logits = check_bool(from_logits, "from_logits")
        if self.from_logits and not 0.0 < threshold < 1.0:
            raise ValueError(
                f"`threshold` must be a probability in (0, 1) with from_logits=True; got "
                f"{threshold!r}. It applies to sigmoid(logits); pass e.g. 0.5."
            )
        self.threshold = float(threshold)

    def call(self, y_true, y_pred):
        y_true, y_pred = align_ranks(y_true, y_pred)
        require_same_shape(y_true, y_pred, "BinaryAccuracy")
        cut = _logit(self.threshold) if self.from_logits else self.threshold
        predicted = (y_pred.astype(compute_dtype(y_pred)) > cut).astype(y_true.dtype)
        return (y_true == predicted).astype(jnp.float32)

    def get_config(self):
        return {
            "threshold": self.threshold,
            "from_logits": self.from_logits,
            **super().get_config(),
        }


@register_saveable(kind="metric")
class CategoricalAccuracy(Metric):
    """How often the arg-max of the predictions matches the arg-max of one-hot labels.

    Args:
      name: the metric's name.

    Example:

    >>> import numpy as np
    >>> CategoricalAccuracy().per_example(np.eye(2), np.array([[0.9, 0.1], [0.8, 0.2]])).tolist()
    [1.0, 0.0]
    """

    direction = "up"

    def __init__(self, *, name: str = "categorical_accuracy"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        require_class_axis(y_pred, "CategoricalAccuracy")
        require_same_shape(
            y_true,
            y_pred,
            "CategoricalAccuracy",
            " For integer class labels use SparseCategoricalAccuracy.",
        )
        return (jnp.argmax(y_true, axis=-1) == jnp.argmax(y_pred, axis=-1)).astype(jnp.float32)


@register_saveable(kind="metric")
class SparseCategoricalAccuracy(Metric):
    """How often the arg-max of the predictions equals integer labels ``(b,)`` or ``(b, 1)``.

    Args:
      name: the metric's name.

    Example:

    >>> import numpy as np
    >>> m = SparseCategoricalAccuracy()
    >>> m.per_example(np.array([[0], [1]]), np.array([[0.9, 0.1], [0.8, 0.2]])).tolist()
    [1.0, 0.0]
    """

    direction = "up"

    def __init__(self, *, name: str = "sparse_categorical_accuracy"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        require_class_axis(y_pred, "SparseCategoricalAccuracy")
        labels = sparse_labels(y_true, y_pred, "SparseCategoricalAccuracy")
        return (jnp.argmax(y_pred, axis=-1) == labels).astype(jnp.float32)


@register_saveable(kind="metric")
class MeanSquaredError(Metric):
    """Mean squared error per example.

    Args:
      name: the metric's name.

    Example:

    >>> import numpy as np
    >>> MeanSquaredError().per_example(np.array([0.0, 1.0]), np.array([[2.0], [1.0]])).tolist()
    [4.0, 0.0]
    """

    direction = "down"

    def __init__(self, *, name: str = "mean_squared_error"):
        super().__init__(name=name)
        self._loss = losses_lib.MeanSquaredError()

    def call(self, y_true, y_pred):
        return self._loss.call(y_true, y_pred)


@register_saveable(kind="metric")
class MeanAbsoluteError(Metric):
    """Mean absolute error per example.

    Args:
      name: the metric's name.

    Example:

    >>> import numpy as np
    >>> MeanAbsoluteError().per_example(np.array([0.0, 1.0]), np.array([[2.0], [1.5]])).tolist()
    [2.0, 0.5]
    """

    direction = "down"

    def __init__(self, *, name: str = "mean_absolute_error"):
        super().__init__(name=name)
        self._loss = losses_lib.MeanAbsoluteError()

    def call(self, y_true, y_pred):
        return self._loss.call(y_true, y_pred)


class MeanMetricWrapper(Metric):
    """Wraps a function ``fn(y_true, y_pred) -> per-example values`` as a `Metric`.

    A `jstrategy.losses.Loss` works too, which is how a loss is tracked as a metric.

    Args:
      fn: returns values with the batch axis first; other axes are averaged.
      name: defaults to ``fn.name`` or ``fn.__name__``.
      direction: ``"up"``, ``"down"`` or ``None`` (see `Metric`).

    Example:

    >>> import jax.numpy as jnp
    >>> def max_error(y_true, y_pred):
    ...     return jnp.max(jnp.abs(y_pred - y_true), axis=-1)
    >>> m = MeanMetricWrapper(max_error)
    >>> m.name, m.per_example(jnp.zeros((2, 3)), jnp.array([[1.0, 2, 3], [0, 0, 1]])).tolist()
    ('max_error', [3.0, 1.0])
    """

    def __init__(
        self,
        fn: Callable[[Any, Any], Any],
        *,
        name: str | None = None,
        direction: str | None = None,
    ):
        if not callable(fn):
            raise ValueError(
                f"`fn` must be callable as fn(y_true, y_pred); got {fn!r}. Pass a function."
            )
        if direction not in ("up", "down", None):
            raise ValueError(f"`direction` must be 'up', 'down' or None; got {direction!r}.")
        super().__init__(name=callable_name(fn) if name is None else name)
        self.fn = fn
        # A wrapped loss is something to minimize.
        if direction is None and isinstance(fn, losses_lib.Loss):
            direction = "down"
        self.direction = direction

    def call(self, y_true, y_pred):
        if isinstance(self.fn, PerExampleFunction):  # a loss: its unreduced values
            return self.fn.per_example(y_true, y_pred)
        return self.fn(y_true, y_pred)

    def get_config(self):
        return {"fn": self.fn, "direction": self.direction, **super().get_config()}


class _ShapeResolvedAccuracy(Metric):
    """``"accuracy"`` when the loss does not say which: decided from static shapes.

    As Keras 3 does: one output per example means binary, labels without a class axis
    (or with a trailing axis of size 1) mean sparse, otherwise categorical.
    """

    direction = "up"

    def __init__(self, *, name: str = "accuracy"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        if y_pred.ndim == 1 or y_pred.shape[-1] == 1:
            return BinaryAccuracy().call(y_true, y_pred)
        if y_true.ndim == y_pred.ndim - 1 or (y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1):
            return SparseCategoricalAccuracy().call(y_true, y_pred)
        return CategoricalAccuracy().call(y_true, y_pred)


def _accuracy_for(loss: Any, name: str) -> Metric:
    """The accuracy Keras picks for `loss`."""
    if isinstance(loss, str):
        loss = losses_lib.get(loss)
    if isinstance(loss, losses_lib.BinaryCrossentropy):
        return BinaryAccuracy(from_logits=loss.from_logits, name=name)
    if isinstance(loss, losses_lib.SparseCategoricalCrossentropy):
        return SparseCategoricalAccuracy(name=name)
    if isinstance(loss, losses_lib.CategoricalCrossentropy):
        return CategoricalAccuracy(name=name)
    return _ShapeResolvedAccuracy(name=name)


# Keras's string names, which name the metric; a registered class name is taken too.
_ALIASES: dict[str, type[Metric]] = {
    "binary_accuracy": BinaryAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
}


def get(identifier: Metric | str | Callable[[Any, Any], Any], *, loss: Any = None) -> Metric:
    """Resolves a metric given as an instance, a Keras name, a `Metric` class or a function.

    Named metrics keep the name they were given, as in Keras, so ``"acc"`` is logged as
    ``acc`` and ``"mae"`` as ``mae``.

    Args:
      identifier: a `Metric` (returned as is); ``"accuracy"``/``"acc"`` (resolved from
        `loss`: binary cross-entropy gives `BinaryAccuracy`, thresholding logits at 0 when
        the loss is ``from_logits``; sparse categorical cross-entropy gives
        `SparseCategoricalAccuracy`; categorical cross-entropy gives `CategoricalAccuracy`;
        any other loss decides from the shapes at trace time); ``"binary_accuracy"``,
        ``"categorical_accuracy"``, ``"sparse_categorical_accuracy"``,
        ``"mae"``/``"mean_absolute_error"``, ``"mse"``/``"mean_squared_error"``; a class
        name such as ``"BinaryAccuracy"`` or a `Metric` subclass (instantiated with
        defaults); or a function ``fn(y_true, y_pred)`` returning per-example values
        (wrapped in `MeanMetricWrapper`).
      loss: the compiled loss (a `jstrategy.losses.Loss`, a loss name, or None), used only
        to resolve ``"accuracy"``.

    Returns:
      A `Metric`.

    Raises:
      ValueError: for an unknown name or an identifier of another type.

    Example:

    >>> m = get("accuracy", loss="binary_crossentropy")
    >>> type(m).__name__, m.name
    ('BinaryAccuracy', 'accuracy')
    >>> get("mae").name
    'mae'
    """
    if isinstance(identifier, Mean) or identifier is Mean:
        raise ValueError(
            "Mean averages the values given to update_state(values) in a custom loop; a "
            "compiled metric is a function of (y_true, y_pred). Wrap one in "
            "MeanMetricWrapper, e.g. MeanMetricWrapper(fn, name='...')."
        )
    if isinstance(identifier, str) and identifier in ("accuracy", "acc"):
        return _accuracy_for(loss, identifier)  # resolved here; listed below as valid names
    named = {key: functools.partial(cls, name=key) for key, cls in _ALIASES.items()}
    return keras_object(
        identifier,
        {"accuracy": Accuracy, "acc": Accuracy, **saveable_classes("metric"), **named},
        Metric,
        MeanMetricWrapper,
        unknown=lambda known: (
            f"Unknown metric {identifier!r}. Valid names: {known}; or pass "
            "a jstrategy.metrics.Metric, or a function fn(y_true, y_pred) -> per-example "
            "values."
        ),
        bad=f"A metric must be a jstrategy.metrics.Metric, a metric name or a function "
        f"fn(y_true, y_pred); got {identifier!r}. E.g. metrics=['accuracy'].",
    )
