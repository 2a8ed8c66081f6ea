"""What a step computes (`StepSpec`) and the keys its running sums hold.

The one record the step body (`step.py`), the numerics checks (`check_numerics.py`,
`probability_check.py`) and the input checks read; it depends on none of them, so each
of them can depend on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import numpy as np

from jstrategy._src.numerics import COUNT
from jstrategy._src.numerics import weight_key
from jstrategy._src.pipeline.schedules import PipelineConfig
from jstrategy._src.precision import policy as mp
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.training.state.train_state import uses_loss_scale

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "CHECKED_KEYS",
    "FLOOR_KEY",
    "NOT_PROBABILITIES_KEY",
    "Metric",
    "StepSpec",
]

#: The keys `jstrategy.config.enable_check_numerics` adds to a step's sums (and logs):
#: labels out of range, non-finite losses, non-finite gradients. `Model`'s logs leave
#: them out.
CHECKED_KEYS = (
    "check_numerics/labels_out_of_range",
    "check_numerics/non_finite_loss",
    "check_numerics/non_finite_gradients",
)
#: Steps skipped with the loss scale at its floor: in every loss-scaled step's sums.
FLOOR_KEY = "loss_scale/skipped_at_floor"
#: Real rows whose predictions are not probabilities, for a loss that expects them.
NOT_PROBABILITIES_KEY = "loss/predictions_not_probabilities"

Metric = Callable[[Any, Any], Any]


# ---------------------------------------------------------------------------------------
# What a step computes
# ---------------------------------------------------------------------------------------
_FLOAT32 = mp.Policy("float32")


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a step computes: the loss and metrics, on which strategy, with which options.

    The step's options live here, read by the step body below: a new option is a field
    with a default that keeps today's step, and the body's one update path
    (`apply_update`) and one loss path (`replica_gradients`) are where it acts.

    Attributes:
      strategy: the strategy whose replicas run the step.
      loss: the per-example loss, or None (evaluation of metrics only).
      metrics: ``(name, metric)`` pairs of per-example metrics.
      check_numerics: whether the step also counts labels out of range and non-finite
        losses and gradients (`jstrategy.config.enable_check_numerics`).
      policy: the precision policy (`jstrategy.mixed_precision.Policy`). Under
        ``"float32"`` (the default) the step casts nothing.
      accumulation_steps: micro-batches per optimizer update (1: update every step).
      weighted_metrics: ``(name, metric)`` pairs of metrics weighted by the batches'
        sample weights (Keras's ``weighted_metrics``); `metrics` ignore the weights.
      loss_scale_factor: a Keras optimizer's ``loss_scale_factor``: the loss is multiplied
        by it before differentiating (Keras's ``optimizer.scale_loss``); the optimizer
        divides the gradients by it.
      sync_batch_norm: the rows a BatchNorm without ``axis_name`` normalizes over in
        training (`BatchNormSync`: the global batch by default).
      remat: the checkpoint policy the model's `jstrategy.training.remat` blocks are
        rematerialized with in the differentiated forward pass, or None (no remat).
      pipeline: the pipeline the model's `jstrategy.experimental.Repeated` blocks run on
        in the differentiated forward pass (`Strategy.pipeline`, a `PipelineConfig`), or
        None (their layers in order).
    """

    strategy: Strategy
    loss: Metric | None
    metrics: tuple[tuple[str, Metric], ...]
    check_numerics: bool = False
    policy: mp.Policy = _FLOAT32
    accumulation_steps: int = 1
    weighted_metrics: tuple[tuple[str, Metric], ...] = ()
    loss_scale_factor: float | None = None
    sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL
    remat: Callable[..., bool] | None = None
    pipeline: PipelineConfig | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The logs' keys: ``"loss"`` (if any), each metric's name, each weighted metric's."""
        loss = ("loss",) if self.loss is not None else ()
        return loss + tuple(n for n, _ in (*self.metrics, *self.weighted_metrics))

    @property
    def functions(self) -> tuple[Any, ...]:
        """The loss (if any), then every metric, plain and weighted: what the label checks
        read (`input_checks.class_label_functions`)."""
        loss = () if self.loss is None else (self.loss,)
        return loss + tuple(m for _, m in (*self.metrics, *self.weighted_metrics))

    def zero_sums(self) -> dict[str, Any]:
        """Running sums before the first step: zeros for each name and the counts."""
        extra = self.extra_sum_keys()
        weights = tuple(weight_key(n) for n, _ in self.weighted_metrics)
        return {name: np.float32(0) for name in (*self.names, COUNT, *weights, *extra)}

    @property
    def expects_probabilities(self) -> str | None:
        """What the loss expects its predictions to be (a kind of probabilities, e.g.
        ``"categorical"``), or None: what `probability_check` checks."""
        loss = self.loss
        return None if loss is None else getattr(loss, "expects_probabilities", None)

    def extra_sum_keys(self) -> tuple[str, ...]:
        """The keys a step of this spec adds to its sums besides the loss, metrics and
        count: the numerics check's, the loss scale's floor, the probability check's."""
        checked = CHECKED_KEYS if self.check_numerics else ()
        floor = (FLOOR_KEY,) if uses_loss_scale(self.policy) else ()
        probabilities = (NOT_PROBABILITIES_KEY,) if self.expects_probabilities else ()
        return checked + floor + probabilities
