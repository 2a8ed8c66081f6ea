"""`compile`'s losses and metrics for a functional model's several outputs, as Keras's.

The train step takes one loss and flat lists of metrics over the model's whole output
(`StepSpec`); a model of several outputs gets them here: `OutputsLoss`, each output's loss
(one loss for all, a list, or a dict by output name) times its ``loss_weights`` entry,
summed per row, so the step's ``"sum_over_batch_size"`` reduction gives Keras's total
``sum_i w_i * loss_i``; and `OutputMetric` objects, each a metric (or an output's loss,
logged as ``<output>_loss``) on one output, named ``<output>_<metric>`` as Keras names
them. The labels are a list (or tuple) in the outputs' order, or a dict by output name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from jstrategy._src.training import losses as losses_lib
from jstrategy._src.training import metrics as metrics_lib
from jstrategy._src.training.step.body import resolve_loss
from jstrategy._src.validation import check_number

__all__ = ["OutputMetric", "Outputs", "OutputsLoss", "PerOutput", "compile_arguments"]


@dataclasses.dataclass(frozen=True)
class Outputs:
    """A model's outputs: their names (a dict's keys, else their layers') and count."""

    names: tuple[str, ...]

    def pick(self, tree: Any, index: int, what: str) -> Any:
        """Output `index`'s array of `tree` (labels or predictions): by position in a
        list or tuple, by name in a dict."""
        name = self.names[index]
        if len(self.names) == 1 and not isinstance(tree, (Mapping, list, tuple)):
            return tree
        if isinstance(tree, Mapping):
            if name not in tree:
                raise ValueError(
                    f"{what} is a dict without the output {name!r}; the model's outputs are "
                    f"{list(self.names)}. Key the arrays by output name (or pass a list)."
                )
            return tree[name]
        if isinstance(tree, (list, tuple)) and len(tree) == len(self.names):
            return tree[index]
        given = (
            f"a {type(tree).__name__} of {len(tree)}"
            if isinstance(tree, (list, tuple))
            else "one array"
        )
        raise ValueError(
            f"The model has {len(self.names)} outputs {list(self.names)}; {what} is {given}. "
            f"Pass a list of {len(self.names)} arrays in the outputs' order, or a dict by "
            "output name."
        )


@dataclasses.dataclass(frozen=True)
class PerOutput:
    """What `compile` was given for each output, resolved: what `Model.save` writes (a
    dict by output name each) and `load_model` compiles with again.

    Attributes:
      losses: each output's loss (outputs without one are left out).
      loss_weights: each output's weight, for the outputs with a loss.
      metrics: each output's metrics (Metric objects, before they are named by output).
      weighted_metrics: likewise, the weighted metrics.
    """

    losses: dict[str, Any]
    loss_weights: dict[str, float]
    metrics: dict[str, list[Any]]
    weighted_metrics: dict[str, list[Any]]


class OutputsLoss(losses_lib.Loss):
    """A multi-output model's loss: each output's loss, weighted, summed for each row.

    Args:
      outputs: the model's `Outputs`.
      terms: ``(output index, loss, weight)`` for each output with a loss.
    """

    def __init__(self, outputs: Outputs, terms: tuple[tuple[int, Any, float], ...]):
        super().__init__(name="loss")
        self.outputs = outputs
        self.terms = terms

    def values(self, y_true: Any, y_pred: Any) -> jax.Array:
        total: Any = 0.0
        for index, loss, weight in self.terms:
            true = self.outputs.pick(y_true, index, "y")
            pred = self.outputs.pick(y_pred, index, "the model's output")
            total = total + weight * loss.per_example(true, pred)
        return total

    def call(self, y_true: Any, y_pred: Any) -> jax.Array:
        return self.values(y_true, y_pred)


class OutputMetric(metrics_lib.Metric):
    """A metric (or a loss, logged as a metric) of one output of a multi-output model.

    Args:
      outputs: the model's `Outputs`.
      index: the output.
      function: the metric, or the output's loss.
      name: its key in the logs, ``<output>_<metric>`` (``<output>_loss`` for the loss).
    """

    def __init__(self, outputs: Outputs, index: int, function: Any, name: str):
        self.outputs = outputs
        self.index = index
        self.function = function
        self.direction = getattr(function, "direction", None) or (
            "down" if isinstance(function, losses_lib.Loss) else None
        )
        super().__init__(name=name)

    def values(self, y_true: Any, y_pred: Any) -> jax.Array:
        true = self.outputs.pick(y_true, self.index, "y")
        pred = self.outputs.pick(y_pred, self.index, "the model's output")
        return self.function.values(true, pred)

    def call(self, y_true: Any, y_pred: Any) -> jax.Array:
        return self.values(y_true, y_pred)


def _per_output(value: Any, names: tuple[str, ...], argument: str, *, single: bool) -> list[Any]:
    """`value` as one entry per output: a dict by output name (missing outputs: None), a
    list of one entry per output, or (`single`) one entry for every output."""
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ValueError(
                f"`{argument}` names outputs {unknown} the model does not have; its outputs "
                f"are {list(names)}."
            )
        return [value.get(name) for name in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ValueError(
                f"For a model of {len(names)} outputs {list(names)}, `{argument}` as a list "
                f"must have one entry per output (as Keras's); got {len(value)} entries. Or "
                f"pass a dict by output name, e.g. {{{names[0]!r}: ...}}."
            )
        return list(value)
    if single:
        return [value] * len(names)
    raise ValueError(
        f"For a model of {len(names)} outputs {list(names)}, `{argument}` must be a list of "
        f"one entry per output or a dict by output name (as Keras's); got {value!r}."
    )


def _metrics(
    value: Any, outputs: Outputs, losses: list[Any], argument: str
) -> tuple[list[Any], dict[str, list[Any]]]:
    """`compile`'s metrics (or weighted metrics) for each output, as `OutputMetric`s, and
    the metrics by output name."""
    found: list[Any] = []
    by_name: dict[str, list[Any]] = {}
    if value is None:
        return found, by_name
    for index, entry in enumerate(_per_output(value, outputs.names, argument, single=False)):
        entries = [] if entry is None else entry if isinstance(entry, (list, tuple)) else [entry]
        for identifier in entries:
            metric = metrics_lib.get(identifier, loss=losses[index])
            name = f"{outputs.names[index]}_{metric.name}"
            found.append(OutputMetric(outputs, index, metric, name))
            by_name.setdefault(outputs.names[index], []).append(metric)
    return found, by_name


def compile_arguments(
    names: list[str], loss: Any, loss_weights: Any, metrics: Any, weighted_metrics: Any
) -> tuple[Any, Any, Any, PerOutput]:
    """``(loss, metrics, weighted_metrics)`` for the step, from a multi-output model's
    `compile` arguments given as Keras takes them, and the `PerOutput` record of them.

    Raises:
      ValueError: for entries that do not match the outputs, a weight that is not a
        number, or no loss at all; each message shows the form expected.
    """
    outputs = Outputs(tuple(names))
    if loss is None:
        raise ValueError(
            f"`loss` is required: one loss for every output, a list (one per output) or a "
            f"dict by output name {list(names)}; got None."
        )
    per_loss = [
        None if entry is None else resolve_loss(entry)
        for entry in _per_output(loss, outputs.names, "loss", single=True)
    ]
    if all(entry is None for entry in per_loss):
        raise ValueError(f"`loss` gives no output a loss; give at least one of {list(names)} one.")
    weights = (
        [1.0] * len(names)
        if loss_weights is None
        else _per_output(loss_weights, outputs.names, "loss_weights", single=False)
    )
    terms = []
    logged = []
    for index, (entry, weight) in enumerate(zip(per_loss, weights, strict=True)):
        if entry is None:
            continue
        weight = 1.0 if weight is None else check_number(weight, f"loss_weights[{index}]")
        terms.append((index, entry, float(weight)))
        logged.append(OutputMetric(outputs, index, entry, f"{names[index]}_loss"))
    plain, plain_by_name = _metrics(metrics, outputs, per_loss, "metrics")
    weighted, weighted_by_name = _metrics(weighted_metrics, outputs, per_loss, "weighted_metrics")
    record = PerOutput(
        {names[i]: loss for i, loss, _ in terms},
        {names[i]: weight for i, _, weight in terms},
        plain_by_name,
        weighted_by_name,
    )
    return OutputsLoss(outputs, tuple(terms)), logged + plain, weighted, record
