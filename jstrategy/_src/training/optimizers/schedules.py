"""Keras's learning-rate schedules: step -> rate, with Keras's names, arguments and formulas.

A schedule is what `jstrategy.optimizers` take as ``learning_rate`` besides a float (an
optax schedule, any ``step -> rate`` callable, works too). These objects add what Keras's
have: a `get_config` that `Model.save` writes and `deserialize` reads back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.registry import register_kind
from jstrategy._src.registry import register_saveable
from jstrategy._src.registry import saveable_classes
from jstrategy._src.registry import saveable_name
from jstrategy._src.registry import saved_class
from jstrategy._src.validation import check_number

__all__ = [
    "CosineDecay",
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "deserialize",
    "is_schedule",
    "serialize",
]


class LearningRateSchedule:
    """Base class: ``schedule(step)`` is the learning rate of optimizer step `step` (0-based).

    Subclasses implement `__call__` (traceable: `step` may be a traced int) and
    `get_config`.

    Example:

    >>> class Halving(LearningRateSchedule):
    ...     def __call__(self, step):
    ...         return 0.1 * 0.5 ** (step // 10)
    ...     def get_config(self):
    ...         return {}
    >>> float(Halving()(20))
    0.025
    """

    def __call__(self, step: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(step).")

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as in Keras."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_config().")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class _TimeDecay(LearningRateSchedule):
    """What the exponential and inverse-time decays share: a rate, a period, a staircase."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        decay_rate: float,
        staircase: bool = False,
    ):
        self.initial_learning_rate = check_number(
            initial_learning_rate, "initial_learning_rate", low=0, low_open=True, finite=True
        )
        self.decay_steps = check_number(
            decay_steps, "decay_steps", low=0, low_open=True, finite=True
        )
        self.decay_rate = check_number(decay_rate, "decay_rate", low=0, low_open=True, finite=True)
        self.staircase = bool(staircase)

    def _periods(self, step: Any) -> Any:
        p = jnp.asarray(step, jnp.float32) / self.decay_steps
        return jnp.floor(p) if self.staircase else p

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
        }


register_kind("schedule", LearningRateSchedule)


@register_saveable(kind="schedule")
class ExponentialDecay(_TimeDecay):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (Keras's formula).

    Args:
      initial_learning_rate: the rate at step 0.
      decay_steps: the steps over which the rate is multiplied by `decay_rate`.
      decay_rate: the factor per `decay_steps`.
      staircase: decay in whole periods (``step // decay_steps``).

    Example:

    >>> schedule = ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    >>> round(float(schedule(10)), 6), round(float(schedule(5)), 6)
    (0.05, 0.070711)
    """

    def __call__(self, step: Any) -> Any:
        return self.initial_learning_rate * jnp.power(self.decay_rate, self._periods(step))


@register_saveable(kind="schedule")
class InverseTimeDecay(_TimeDecay):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (Keras's formula).

    Args:
      initial_learning_rate: the rate at step 0.
      decay_steps: the step scale of the decay.
      decay_rate: how fast the rate falls.
      staircase: decay in whole periods (``step // decay_steps``).

    Example:

    >>> round(float(InverseTimeDecay(0.1, decay_steps=1, decay_rate=1.0)(4)), 6)
    0.02
    """

    def __call__(self, step: Any) -> Any:
        return self.initial_learning_rate / (1.0 + self.decay_rate * self._periods(step))


@register_saveable(kind="schedule")
class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[i]`` between ``boundaries[i - 1]`` (exclusive) and ``boundaries[i]`` (Keras).

    Args:
      boundaries: increasing steps where the rate changes.
      values: one more rate than `boundaries`: ``values[0]`` up to ``boundaries[0]``
        (inclusive), ..., ``values[-1]`` after the last boundary.

    Raises:
      ValueError: if `values` does not have one more entry than `boundaries`.

    Example:

    >>> schedule = PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1])
    >>> [round(float(schedule(s)), 6) for s in (0, 10, 11, 21)]
    [1.0, 1.0, 0.5, 0.1]
    """

    def __init__(self, boundaries: Sequence[int], values: Sequence[float]):
        boundaries, values = list(boundaries), list(values)
        if len(values) != len(boundaries) + 1:
            raise ValueError(
                f"`values` must have one more entry than `boundaries`; got {len(values)} "
                f"values for {len(boundaries)} boundaries."
            )
        if any(b >= a for a, b in zip(boundaries[1:], boundaries, strict=False)):
            raise ValueError(f"`boundaries` must increase; got {boundaries}.")
        self.boundaries = [int(b) for b in boundaries]
        self.values = [float(v) for v in values]

    def __call__(self, step: Any) -> Any:
        step = jnp.asarray(step)
        index = jnp.sum(step > jnp.asarray(self.boundaries, step.dtype))
        return jnp.asarray(self.values, jnp.float32)[index]

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries, "values": self.values}


@register_saveable(kind="schedule")
class CosineDecay(LearningRateSchedule):
    """Cosine decay from `initial_learning_rate` to ``alpha * initial_learning_rate`` over
    `decay_steps` (Keras's ``CosineDecay`` without warmup).

    Args:
      initial_learning_rate: the rate at step 0.
      decay_steps: the steps of the decay; the rate stays at its floor afterwards.
      alpha: the floor, as a fraction of `initial_learning_rate`.

    Example:

    >>> schedule = CosineDecay(1.0, decay_steps=10)
    >>> [round(float(schedule(s)), 4) for s in (0, 5, 10, 20)]
    [1.0, 0.5, 0.0, 0.0]
    """

    def __init__(self, initial_learning_rate: float, decay_steps: int, alpha: float = 0.0):
        self.initial_learning_rate = check_number(
            initial_learning_rate, "initial_learning_rate", low=0, low_open=True, finite=True
        )
        self.decay_steps = check_number(
            decay_steps, "decay_steps", low=0, low_open=True, finite=True
        )
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"`alpha` must be in [0, 1]; got {alpha!r}.")
        self.alpha = float(alpha)

    def __call__(self, step: Any) -> Any:
        done = jnp.minimum(jnp.asarray(step, jnp.float32), self.decay_steps) / self.decay_steps
        cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * done))
        return self.initial_learning_rate * ((1.0 - self.alpha) * cosine + self.alpha)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
        }


def serialize(schedule: LearningRateSchedule) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}``, Keras's form, for a schedule defined here.

    Raises:
      TypeError: for any other callable (an optax schedule is a plain function).

    Example:

    >>> serialize(CosineDecay(0.1, 100))["class_name"]
    'CosineDecay'
    """
    name = saveable_name(schedule, "schedule")
    if name is None:
        raise TypeError(
            f"Only jstrategy.optimizers.schedules objects can be saved; got {schedule!r}. "
            f"Use one of {sorted(saveable_classes('schedule'))}, or save the weights only."
        )
    return {"class_name": name, "config": schedule.get_config()}


def deserialize(config: dict[str, Any]) -> LearningRateSchedule:
    """The schedule `serialize` described.

    Raises:
      ValueError: for an unknown class name.

    Example:

    >>> deserialize(serialize(CosineDecay(0.1, 100))).decay_steps
    100.0
    """
    name = config.get("class_name")
    cls = saved_class(
        "schedule", name, lambda known: f"Unknown learning-rate schedule {name!r}; known: {known}."
    )
    return cls(**config.get("config", {}))


def is_schedule(value: Any) -> bool:
    """Whether `value` is a schedule (a callable ``step -> rate``) rather than a number."""
    return callable(value) and not isinstance(value, (jax.Array,))
