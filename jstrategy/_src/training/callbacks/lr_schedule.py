"""The callbacks that set the learning rate: `LearningRateScheduler`, `ReduceLROnPlateau`.

Both read and write ``model.learning_rate`` (the optimizer state's one slot,
`optimizers/learning_rate.py`) and record the rate in each epoch's logs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.training.callbacks.base import host_float
from jstrategy._src.training.callbacks.monitor import Mode
from jstrategy._src.training.callbacks.monitor import MonitorCallback
from jstrategy._src.validation import check_non_negative_int
from jstrategy._src.validation import check_number

__all__ = ["LearningRateScheduler", "ReduceLROnPlateau"]


def _takes_two_positional(fn: Callable[..., Any]) -> bool:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    positional = 0
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            return True
        if param.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            positional += 1
    return positional >= 2


class LearningRateScheduler(Callback):
    """Sets the learning rate at the start of each epoch from ``schedule``.

    The rate is read and written through ``model.learning_rate`` (a float property) and
    recorded as ``logs["learning_rate"]`` at the end of each epoch.

    Args:
      schedule: ``schedule(epoch)`` or ``schedule(epoch, lr)`` (epoch 0-based, `lr` the
        current rate) returning the new rate as a float.
      verbose: 1 prints each update.

    Raises:
      ValueError: if `schedule` is not callable.

    Example:

    >>> class FakeModel:
    ...     learning_rate = 0.1
    >>> sched = LearningRateScheduler(lambda epoch, lr: lr * 0.5 if epoch > 0 else lr)
    >>> sched.set_model(FakeModel())
    >>> logs = {}
    >>> for epoch in range(3):
    ...     sched.on_epoch_begin(epoch)
    ...     sched.on_epoch_end(epoch, logs)
    >>> logs["learning_rate"]
    0.025
    """

    def __init__(self, schedule: Callable[..., Any], verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise ValueError(
                f"`schedule` must be callable as schedule(epoch) or schedule(epoch, lr); got "
                f"{schedule!r}."
            )
        self.schedule = schedule
        self.verbose = verbose
        self._pass_lr = _takes_two_positional(schedule)

    def _current_rate(self) -> float:
        if not hasattr(self.model, "learning_rate"):
            raise ValueError(
                "LearningRateScheduler needs `model.learning_rate` (a float property the "
                f"model reads and sets); {type(self.model).__name__} has none. Compile the "
                "model with an optimizer whose learning rate can be changed."
            )
        return host_float(self.model.learning_rate)

    def on_train_begin(self, logs=None):
        _check_settable_rate(self.model, "LearningRateScheduler")

    def on_epoch_begin(self, epoch, logs=None):
        if self._pass_lr:
            rate = self.schedule(epoch, self._current_rate())
        else:
            self._current_rate()
            rate = self.schedule(epoch)
        try:
            value = host_float(rate)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"The `schedule` must return a non-negative finite float; at epoch {epoch} it "
                f"returned {rate!r}."
            )
        rate = value
        self.model.learning_rate = rate
        if self.verbose > 0:
            print(
                f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {rate}.",
                flush=True,
            )

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = self._current_rate()


def _check_settable_rate(model: Any, owner: str) -> None:
    """Raises before training when `model`'s learning rate cannot be read and set back.

    Raises:
      ValueError: if the model has no `learning_rate`.
      TypeError: if it cannot be read (a plain optax transformation) or set (a schedule);
        the model's message shows the fix.
    """
    if not hasattr(type(model), "learning_rate") and not hasattr(model, "learning_rate"):
        raise ValueError(
            f"{owner} needs `model.learning_rate` (a float property the model reads and "
            f"sets); {type(model).__name__} has none."
        )
    model.learning_rate = model.learning_rate


class ReduceLROnPlateau(MonitorCallback):
    """Reduces the learning rate when a monitored quantity stops improving, as Keras's.

    After `patience` epochs without an improvement larger than `min_delta`, the rate
    (``model.learning_rate``) is multiplied by `factor`, not below `min_lr`; then `cooldown`
    epochs pass before counting again. Each epoch's logs get the rate the epoch used
    (``logs["learning_rate"]``).

    Args:
      monitor: the log key to watch.
      factor: the multiplier of the rate, in (0, 1).
      patience: epochs without improvement before reducing.
      verbose: 1 prints each reduction.
      mode: ``"min"``, ``"max"`` or ``"auto"`` (see `EarlyStopping`).
      min_delta: the smallest change that counts as an improvement.
      cooldown: epochs to wait after a reduction before counting again.
      min_lr: the lowest rate.

    Raises:
      ValueError: for a bad argument, e.g. ``factor >= 1``.
      TypeError: at the start of `fit`, if the model's rate cannot be read or set (a plain
        optax transformation, or a schedule); the message shows the fix.

    Example:

    >>> class FakeModel:
    ...     learning_rate = 0.1
    >>> reduce = ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1)
    >>> reduce.set_model(FakeModel())
    >>> reduce.on_train_begin()
    >>> for epoch, loss in enumerate([1.0, 1.0, 1.0]):
    ...     reduce.on_epoch_end(epoch, {"loss": loss})
    >>> reduce.model.learning_rate
    0.025
    """

    _owner = "ReduceLROnPlateau"
    _verb = "reduce on"

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: Mode | str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
    ):
        super().__init__(monitor, mode)
        check_number(
            factor,
            "factor",
            low=0,
            high=1,
            low_open=True,
            high_open=True,
            expected="in (0, 1) (ReduceLROnPlateau reduces the rate)",
            fix="E.g. 0.1.",
        )
        for name, value in (("min_delta", min_delta), ("min_lr", min_lr)):
            check_number(value, name, low=0, expected="a non-negative number")
        self.factor = float(factor)
        self.patience = check_non_negative_int(patience, "patience")
        self.verbose = verbose
        self.min_delta = float(min_delta)
        self.cooldown = check_non_negative_int(cooldown, "cooldown")
        self.min_lr = float(min_lr)
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.cooldown_counter = 0
        self.best: float | None = None

    def on_train_begin(self, logs=None):
        self._reset()
        _check_settable_rate(self.model, "ReduceLROnPlateau")

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.lower_is_better():
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, epoch, logs=None):
        rate = host_float(self.model.learning_rate)
        if logs is not None:
            logs["learning_rate"] = rate
        current = self.get_monitor_value(logs)
        if current is None:
            return
        self.lower_is_better()  # inferred at the first value read: a wrong mode fails at once
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._improved(current):
            self.best = current
            self.wait = 0
            return
        if self.cooldown_counter > 0:
            return
        self.wait += 1
        if self.wait >= self.patience and rate > self.min_lr:
            new = max(rate * self.factor, self.min_lr)
            self.model.learning_rate = new
            if self.verbose > 0:
                print(
                    f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new}.",
                    flush=True,
                )
            self.cooldown_counter = self.cooldown
            self.wait = 0
