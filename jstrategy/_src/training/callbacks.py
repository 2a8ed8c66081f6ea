"""Keras-compatible callbacks: hooks into `Model.fit`, `evaluate` and `predict`.

The hooks, their arguments and the meaning of `logs` follow Keras: batch logs hold the
running averages since the epoch (or evaluation) began, epoch logs the epoch's results
plus ``val_``-prefixed validation results. One `logs` dict is handed to every callback in
turn, so a key added by one callback (e.g. ``learning_rate``) is seen by those after it,
`History` included.
"""

from __future__ import annotations

import enum
import inspect
import math
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src.cluster import coordination
from jstrategy._src.cluster import signals
from jstrategy._src.training.progress import Progbar
from jstrategy._src.training.progress import resolve_verbose
from jstrategy._src.validation import check_non_negative_int
from jstrategy._src.values import local_copy

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "Mode",
    "ModelCheckpoint",
    "ProgbarLogger",
    "ReduceLROnPlateau",
]

_HOOKS = (
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


class Callback:
    """Base class for callbacks; every hook does nothing unless overridden.

    Attributes:
      model: the model being trained, set by `set_model`.
      params: ``{"verbose", "epochs", "steps"}``, set by `set_params`.

    Example:

    >>> class CountEpochs(Callback):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.count = 0
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         self.count += 1
    >>> cb = CountEpochs()
    >>> for epoch in range(3):
    ...     cb.on_epoch_end(epoch, {"loss": 1.0})
    >>> cb.count
    3
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        """Sets the model the hooks act on."""
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        """Sets the run's parameters (``verbose``, ``epochs``, ``steps``)."""
        self.params = params

    # Keras calls on_batch_* for training batches; kept so Keras callbacks port unchanged.
    def on_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Alias of `on_train_batch_begin` (Keras's older name)."""

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Alias of `on_train_batch_end` (Keras's older name)."""

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Called when `fit` starts."""

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Called when `fit` ends; `logs` holds the last epoch's results."""

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Called at the start of epoch `epoch` (0-based)."""

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Called at the end of epoch `epoch`, with its training and validation results."""

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called before training batch `batch` (0-based within the epoch)."""
        self.on_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called after training batch `batch`, with running averages so far."""
        self.on_batch_end(batch, logs)

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Called when evaluation (including validation inside `fit`) starts."""

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        """Called when evaluation ends, with its results."""

    def on_test_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called before evaluation batch `batch`."""

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called after evaluation batch `batch`, with running averages so far."""

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Called when `predict` starts."""

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None:
        """Called when `predict` ends."""

    def on_predict_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called before prediction batch `batch`."""

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called after prediction batch `batch`."""

    def _on_train_abort(self) -> None:
        """Called when `fit` ends with an exception: release what `on_train_begin` took."""


class History(Callback):
    """Records epoch results; `Model.fit` returns it.

    Attributes:
      history: metric name to the list of its per-epoch values.
      epoch: the epochs recorded.

    Example:

    >>> h = History()
    >>> h.on_train_begin()
    >>> h.on_epoch_end(0, {"loss": 0.5})
    >>> h.on_epoch_end(1, {"loss": 0.25})
    >>> h.history, h.epoch
    ({'loss': [0.5, 0.25]}, [0, 1])
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []

    def on_train_begin(self, logs=None):
        self.epoch = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(value)
        if self.model is not None:
            # Keras exposes the latest History as `model.history`.
            self.model.history = self


class ProgbarLogger(Callback):
    """Prints Keras's ``Epoch i/N`` headers and a `Progbar` per epoch, evaluation or predict.

    Reads ``verbose``, ``epochs`` and ``steps`` from `params`. Batch logs are shown as
    given, since by Keras's convention they are already running averages; they are
    converted to numbers only when drawn. Inside `fit`, validation draws no bar: its
    results appear on the epoch's final line.

    Args:
      file: the stream to write to; None means `sys.stdout` at the time of writing.

    Example:

    >>> import io
    >>> out = io.StringIO()
    >>> logger = ProgbarLogger(file=out)
    >>> logger.set_params({"verbose": 2, "epochs": 2, "steps": 4})
    >>> logger.on_train_begin()
    >>> logger.on_epoch_begin(0)
    >>> for batch in range(4):
    ...     logger.on_train_batch_end(batch, {"loss": 0.5})
    >>> logger.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.75})
    >>> print(out.getvalue().splitlines()[0])
    Epoch 1/2
    >>> out.getvalue().splitlines()[1].endswith("loss: 0.5000 - val_loss: 0.7500")
    True
    """

    def __init__(self, *, file: Any = None) -> None:
        super().__init__()
        self.file = file
        self.verbose = 1
        self.epochs = 1
        self.target: int | None = None
        self.seen = 0
        self.progbar: Progbar | None = None
        self._called_in_fit = False

    def set_params(self, params):
        super().set_params(params)
        self.verbose = resolve_verbose(params.get("verbose", 1), self.file)
        self.epochs = params.get("epochs") or 1
        self.target = params.get("steps")

    def _print(self, text: str) -> None:
        file = sys.stdout if self.file is None else self.file
        print(text, file=file, flush=True)

    def on_train_begin(self, logs=None):
        self._called_in_fit = True

    def on_train_end(self, logs=None):
        self._called_in_fit = False

    def on_epoch_begin(self, epoch, logs=None):
        self._reset_progbar()
        if self.verbose and self.epochs > 1:
            self._print(f"Epoch {epoch + 1}/{self.epochs}")
        self._maybe_init_progbar()

    def on_train_batch_end(self, batch, logs=None):
        self._update_progbar(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._finalize_progbar(logs)

    def on_test_begin(self, logs=None):
        if not self._called_in_fit:
            self._reset_progbar()
            self._maybe_init_progbar()

    def on_test_batch_end(self, batch, logs=None):
        if not self._called_in_fit:
            self._update_progbar(batch, logs)

    def on_test_end(self, logs=None):
        if not self._called_in_fit:
            self._finalize_progbar(logs)

    def on_predict_begin(self, logs=None):
        self._reset_progbar()
        self._maybe_init_progbar()

    def on_predict_batch_end(self, batch, logs=None):
        # Prediction outputs are not metrics; only progress is shown.
        self._update_progbar(batch, None)

    def on_predict_end(self, logs=None):
        self._finalize_progbar(None)

    def _reset_progbar(self) -> None:
        self.seen = 0
        self.progbar = None

    def _maybe_init_progbar(self) -> Progbar:
        if self.progbar is None:
            self.progbar = Progbar(
                self.target, verbose=self.verbose, unit_name="step", file=self.file
            )
        return self.progbar

    def _update_progbar(self, batch: int, logs: dict[str, Any] | None) -> None:
        progbar = self._maybe_init_progbar()
        logs = logs or {}
        progbar.stateful_metrics.update(logs)
        self.seen = batch + 1
        if self.verbose == 1:
            progbar.update(self.seen, logs, finalize=False)

    def _finalize_progbar(self, logs: dict[str, Any] | None) -> None:
        progbar = self._maybe_init_progbar()
        logs = logs or {}
        progbar.stateful_metrics.update(logs)
        if progbar.target is None:
            # The step count is known only now: show it as the target on the final line.
            progbar.target = self.seen
        progbar.update(progbar.target, logs, finalize=True)


class Mode(enum.Enum):
    """Whether a monitored quantity should go down (MIN), up (MAX), or be inferred (AUTO).

    Example:

    >>> from jstrategy.callbacks import EarlyStopping, Mode
    >>> Mode("max") is Mode.MAX
    True
    >>> stopping = EarlyStopping(monitor="val_accuracy", mode=Mode.MAX)
    """

    AUTO = "auto"
    MIN = "min"
    MAX = "max"


# Names (after stripping "val_") that are known to improve upward; anything ending in one
# of the downward suffixes improves downward.
_UPWARD = ("acc", "accuracy", "auc", "precision", "recall", "f1", "iou", "r2")
_DOWNWARD = ("loss", "error", "crossentropy", "mse", "mae", "mape", "msle", "hinge", "huber")


def host_float(value: Any) -> float:
    """`value` (a number, or a replicated device array: this process's copy) as a float."""
    return float(np.asarray(local_copy(value), dtype=np.float64))


def log_numbers(logs: dict[str, Any] | None) -> dict[str, float]:
    """The entries of `logs` that are numbers, as floats (others, e.g. strings, dropped)."""
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[str(key)] = host_float(value)
        except (TypeError, ValueError):
            continue
    return out


def _check_monitor(monitor: Any) -> None:
    if not isinstance(monitor, str) or not monitor:
        raise ValueError(f"`monitor` must be a log key such as 'val_loss'; got {monitor!r}.")


def _monitored(logs: dict[str, Any] | None, monitor: str, owner: str) -> float | None:
    """The monitored value in `logs`, or None (with a warning) if it is missing."""
    logs = logs or {}
    value = logs.get(monitor)
    if value is None:
        warnings.warn(
            f"{owner} is conditioned on {monitor!r}, which is not in the logs (available: "
            f"{sorted(logs)}). Pass validation data for 'val_' keys or pick one of the "
            "available keys.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return host_float(value)


def _parse_mode(mode: Any) -> Mode:
    try:
        return Mode(mode)
    except ValueError:
        raise ValueError(
            f"`mode` must be one of {[m.value for m in Mode]}; got {mode!r}. Use 'min' "
            "for losses and errors, 'max' for accuracies, 'auto' to infer."
        ) from None


def _infer_lower_is_better(mode: Mode, monitor: str, model: Any, owner: str, verb: str) -> bool:
    """Whether a lower `monitor` is better: from `mode`, the metric's direction or its name."""
    if mode is not Mode.AUTO:
        return mode is Mode.MIN
    name = monitor.removeprefix("val_")
    for metric in getattr(model, "metrics", None) or ():
        if getattr(metric, "name", None) == name:
            direction = getattr(metric, "direction", None)
            if direction in ("up", "down"):
                return direction == "down"
    if name in _UPWARD or name.endswith(tuple(f"_{n}" for n in _UPWARD)):
        return False
    if name.endswith(_DOWNWARD):
        return True
    raise ValueError(
        f"{owner}(monitor={monitor!r}, mode='auto') cannot tell whether "
        f"{name!r} should go up or down. Pass mode='max' to {verb} the highest value "
        "or mode='min' for the lowest."
    )


class EarlyStopping(Callback):
    """Stops training when a monitored quantity has stopped improving, as in Keras.

    Sets ``model.stop_training = True``. With `restore_best_weights`, the model's weights
    from the best epoch (``model.get_weights()``) are restored at the end of training
    (``model.set_weights(w)``), whether or not training stopped early.

    Args:
      monitor: the log key to watch, e.g. ``"val_loss"`` or ``"val_accuracy"``.
      min_delta: changes smaller than this do not count as improvement.
      patience: epochs without improvement before stopping.
      verbose: 1 prints when stopping and restoring.
      mode: ``"min"``, ``"max"`` or ``"auto"`` (a `Mode`, or its value); ``"auto"``
        infers the direction from the metric's ``direction`` attribute when the model
        lists it in ``model.metrics``, else from its name (``loss``/errors go down,
        accuracies go up).
      baseline: a value to beat; until the monitored quantity beats it, patience keeps
        running even if it improves.
      restore_best_weights: whether to restore the best epoch's weights at the end.
      start_from_epoch: epochs to wait before monitoring starts (warm-up).

    Raises:
      ValueError: for an invalid argument, or with ``mode="auto"`` for a metric whose
        direction cannot be inferred.

    Example:

    >>> class FakeModel:
    ...     stop_training = False
    >>> stopper = EarlyStopping(monitor="loss", patience=1)
    >>> stopper.set_model(FakeModel())
    >>> stopper.on_train_begin()
    >>> for epoch, loss in enumerate([1.0, 0.5, 0.6, 0.7]):
    ...     stopper.on_epoch_end(epoch, {"loss": loss})
    ...     if stopper.model.stop_training:
    ...         break
    >>> epoch, stopper.best
    (2, 0.5)
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0,
        patience: int = 0,
        verbose: int = 0,
        mode: Mode | str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ):
        super().__init__()
        _check_monitor(monitor)
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)):
            raise ValueError(f"`min_delta` must be a number; got {min_delta!r}. E.g. 1e-3.")
        patience = check_non_negative_int(patience, "patience")
        start_from_epoch = check_non_negative_int(start_from_epoch, "start_from_epoch")
        self.mode = _parse_mode(mode)
        if baseline is not None and (
            isinstance(baseline, bool) or not isinstance(baseline, (int, float))
        ):
            raise ValueError(f"`baseline` must be a number or None; got {baseline!r}.")
        self.monitor = monitor
        self.min_delta = abs(float(min_delta))
        self.patience = patience
        self.verbose = verbose
        self.baseline = None if baseline is None else float(baseline)
        self.restore_best_weights = bool(restore_best_weights)
        self.start_from_epoch = start_from_epoch
        self._lower_is_better: bool | None = None
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None
        self.best_weights: Any = None
        self.best_epoch = 0

    def _infer_lower_is_better(self) -> bool:
        return _infer_lower_is_better(
            self.mode, self.monitor, self.model, "EarlyStopping", "stop on"
        )

    def on_train_begin(self, logs=None):
        self._reset()

    def _is_improvement(self, value: float, reference: float | None) -> bool:
        if reference is None:
            return True
        if self._lower_is_better:
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def get_monitor_value(self, logs: dict[str, Any] | None) -> float | None:
        """The monitored value in `logs`, or None (with a warning) if it is missing."""
        return _monitored(logs, self.monitor, "EarlyStopping")

    def on_epoch_end(self, epoch, logs=None):
        if self._lower_is_better is None:
            self._lower_is_better = self._infer_lower_is_better()
        current = self.get_monitor_value(logs)
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            # Until something improves, the first monitored epoch's weights are the best.
            self.best_weights = self.model.get_weights()
            self.best_epoch = epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best = current
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            # Patience restarts only once the baseline is beaten too.
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0 and self.verbose > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping", flush=True)
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                print(
                    "Restoring model weights from the end of the best epoch: "
                    f"{self.best_epoch + 1}.",
                    flush=True,
                )
            self.model.set_weights(self.best_weights)


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


class ReduceLROnPlateau(Callback):
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
        super().__init__()
        _check_monitor(monitor)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
            raise ValueError(
                f"`factor` must be in (0, 1) (ReduceLROnPlateau reduces the rate); got "
                f"{factor!r}. E.g. 0.1."
            )
        for name, value in (("min_delta", min_delta), ("min_lr", min_lr)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative number; got {value!r}.")
        self.monitor = monitor
        self.factor = float(factor)
        self.patience = check_non_negative_int(patience, "patience")
        self.verbose = verbose
        self.mode = _parse_mode(mode)
        self.min_delta = float(min_delta)
        self.cooldown = check_non_negative_int(cooldown, "cooldown")
        self.min_lr = float(min_lr)
        self._lower_is_better: bool | None = None
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
        if self._lower_is_better:
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, epoch, logs=None):
        rate = host_float(self.model.learning_rate)
        if logs is not None:
            logs["learning_rate"] = rate
        current = _monitored(logs, self.monitor, "ReduceLROnPlateau")
        if current is None:
            return
        if self._lower_is_better is None:
            self._lower_is_better = _infer_lower_is_better(
                self.mode, self.monitor, self.model, "ReduceLROnPlateau", "reduce on"
            )
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


class LambdaCallback(Callback):
    """A callback built from plain functions, one per hook.

    Args:
      **hooks: hook name to function, e.g.
        ``on_epoch_end=lambda epoch, logs: print(epoch)``. Valid names are the `Callback`
        hooks, including ``on_batch_begin``/``on_batch_end``.

    Raises:
      ValueError: for an unknown hook name or a non-callable value.

    Example:

    >>> seen = []
    >>> cb = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, logs["loss"])))
    >>> cb.on_epoch_end(0, {"loss": 0.5})
    >>> seen
    [(0, 0.5)]
    """

    def __init__(self, **hooks: Callable[..., Any]):
        super().__init__()
        valid = (*_HOOKS, "on_batch_begin", "on_batch_end")
        for name, fn in hooks.items():
            if name not in valid:
                raise ValueError(f"Unknown hook {name!r} for LambdaCallback. Valid: {list(valid)}.")
            if not callable(fn):
                raise ValueError(f"`{name}` must be callable; got {fn!r}.")
            # Instance attributes shadow the no-op methods of Callback.
            setattr(self, name, fn)


class CallbackList(Callback):
    """Dispatches each hook to a list of callbacks, in order.

    Args:
      callbacks: the callbacks (None for none).
      model: if given, set on every callback.
      add_history: append a `History` unless one is present.
      add_progbar: append a `ProgbarLogger` unless one is present.
      verbose: recorded in `params` (0, 1, 2 or ``"auto"``).
      epochs: recorded in `params`.
      steps: steps per epoch (or of the evaluation/prediction), recorded in `params`.

    Raises:
      ValueError: if an item is not a `Callback`.

    Example:

    >>> cbs = CallbackList([], add_history=True, epochs=2, steps=1)
    >>> cbs.on_train_begin()
    >>> for epoch in range(2):
    ...     cbs.on_epoch_end(epoch, {"loss": 1.0 / (epoch + 1)})
    >>> cbs.history.history
    {'loss': [1.0, 0.5]}
    """

    def __init__(
        self,
        callbacks: Iterable[Callback] | None = None,
        *,
        model: Any = None,
        add_history: bool = False,
        add_progbar: bool = False,
        verbose: int | str = 1,
        epochs: int | None = None,
        steps: int | None = None,
    ):
        super().__init__()
        self.callbacks: list[Callback] = list(callbacks or [])
        for cb in self.callbacks:
            _check_callback(cb)
        self._history = next((cb for cb in self.callbacks if isinstance(cb, History)), None)
        self._progbar = next((cb for cb in self.callbacks if isinstance(cb, ProgbarLogger)), None)
        # History and the progress bar go last so that keys other callbacks add to the
        # epoch logs (e.g. learning_rate) are recorded and printed.
        if add_history and self._history is None:
            self._history = History()
            self.callbacks.append(self._history)
        if add_progbar and self._progbar is None:
            self._progbar = ProgbarLogger()
            self.callbacks.append(self._progbar)
        self.set_params({"verbose": verbose, "epochs": epochs, "steps": steps})
        if model is not None:
            self.set_model(model)

    @property
    def history(self) -> History | None:
        """The `History` among the callbacks, if any."""
        return self._history

    def append(self, callback: Callback) -> None:
        """Adds a callback, giving it the list's model and params."""
        _check_callback(callback)
        callback.set_params(self.params)
        if self.model is not None:
            callback.set_model(self.model)
        self.callbacks.append(callback)
        if isinstance(callback, History) and self._history is None:
            self._history = callback

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def set_model(self, model):
        super().set_model(model)
        for cb in self.callbacks:
            cb.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        for cb in self.callbacks:
            cb.set_params(params)

    def _call(self, hook: str, *args: Any, logs: dict[str, Any] | None) -> None:
        # One dict for all, so keys added by one callback reach the later ones.
        logs = {} if logs is None else logs
        for cb in self.callbacks:
            # Positional, as Keras calls hooks, so LambdaCallback functions may name the
            # parameters freely.
            getattr(cb, hook)(*args, logs)

    def on_batch_begin(self, batch, logs=None):
        self._call("on_train_batch_begin", batch, logs=logs)

    def on_batch_end(self, batch, logs=None):
        self._call("on_train_batch_end", batch, logs=logs)

    def on_train_begin(self, logs=None):
        self._call("on_train_begin", logs=logs)

    def on_train_end(self, logs=None):
        self._call("on_train_end", logs=logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._call("on_epoch_begin", epoch, logs=logs)

    def on_epoch_end(self, epoch, logs=None):
        self._call("on_epoch_end", epoch, logs=logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._call("on_train_batch_begin", batch, logs=logs)

    def on_train_batch_end(self, batch, logs=None):
        self._call("on_train_batch_end", batch, logs=logs)

    def on_test_begin(self, logs=None):
        self._call("on_test_begin", logs=logs)

    def on_test_end(self, logs=None):
        self._call("on_test_end", logs=logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._call("on_test_batch_begin", batch, logs=logs)

    def on_test_batch_end(self, batch, logs=None):
        self._call("on_test_batch_end", batch, logs=logs)

    def on_predict_begin(self, logs=None):
        self._call("on_predict_begin", logs=logs)

    def on_predict_end(self, logs=None):
        self._call("on_predict_end", logs=logs)

    def on_predict_batch_begin(self, batch, logs=None):
        self._call("on_predict_batch_begin", batch, logs=logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._call("on_predict_batch_end", batch, logs=logs)

    def on_train_abort(self) -> None:
        """Tells every callback that `fit` ended with an exception (`on_train_end` is not
        called then, so backups stay), so those holding resources release them."""
        for cb in self.callbacks:
            cb._on_train_abort()


def _check_callback(cb: Any) -> None:
    if not isinstance(cb, Callback):
        raise ValueError(
            f"Each callback must be a jstrategy.callbacks.Callback; got {cb!r}. Subclass "
            "Callback, or wrap functions in jstrategy.callbacks.LambdaCallback."
        )


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------
def _check_model(model: Any, owner: str) -> None:
    if not hasattr(model, "fit_state"):
        raise TypeError(
            f"{owner} works with a jstrategy.Model; got {type(model).__name__}. Pass it in "
            "Model.fit(callbacks=[...])."
        )


def _fit_state(model: Any, owner: str) -> Any:
    """Where the model's `fit` is (`Model.fit_state`)."""
    fit_state = model.fit_state
    if fit_state is None:
        raise RuntimeError(f"{owner} saves and restores only while Model.fit runs.")
    return fit_state


def _resumes_exactly(model: Any) -> bool:
    """Whether the model's `fit` can stop after any step and resume it exactly (its fit
    runner's `resumes_exactly`; outside `fit`, the default runner's True)."""
    fit_state = model.fit_state
    return True if fit_state is None else fit_state.resumes_exactly


def _steps_done(model: Any) -> int:
    fit_state = model.fit_state
    return 0 if fit_state is None else fit_state.step


def _check_save_freq(save_freq: Any) -> str | int:
    if save_freq == "epoch":
        return "epoch"
    if isinstance(save_freq, bool) or not isinstance(save_freq, (int, np.integer)) or save_freq < 1:
        raise ValueError(
            f"`save_freq` must be 'epoch' or a positive int (a number of training steps); got "
            f"{save_freq!r}."
        )
    return int(save_freq)


def _is_chief() -> bool:
    return jax.process_index() == 0


class _StepCounter:
    """Counts the training steps `fit` runs, from the model's progress (executions may run
    several steps, and a resumed epoch starts part way)."""

    def __init__(self) -> None:
        self.last = 0
        self.since_save = 0

    def epoch_begin(self, model: Any) -> None:
        self.last = _steps_done(model)

    def batch_end(self, model: Any) -> None:
        now = _steps_done(model)
        self.since_save += max(0, now - self.last)
        self.last = now

    def due(self, save_freq: str | int) -> bool:
        """Whether an int `save_freq` of steps passed since the last save (then counting
        starts over); never for ``"epoch"``."""
        if isinstance(save_freq, str) or self.since_save < save_freq:
            return False
        self.since_save = 0
        return True


class ModelCheckpoint(Callback):
    """Saves the model, or its weights, during `Model.fit`, as Keras's ``ModelCheckpoint``.

    `filepath` is a checkpoint directory written by a `jstrategy.CheckpointManager`:
    asynchronously (training goes on while files are written), atomically (a job killed
    mid-save keeps the previous checkpoint) and restorable under any strategy. Its steps are
    numbered ``epoch + 1`` with ``save_freq="epoch"`` (as Keras numbers its files) or by the
    optimizer's step count with an int `save_freq`, and each records the logs as metrics
    and ``{"epoch": epoch}`` as metadata. A step holds the weights
    (``save_weights_only=True``) or the whole training state: weights, optimizer state and
    step count. `Model.load_weights(filepath)` loads the weights of the latest step of
    either; `Model.restore_checkpoint(filepath)` restores a whole training state.

    Keras formats `filepath` with the epoch and logs (``"ckpt.{epoch:02d}.weights.h5"``);
    here the step numbers play that part, so `filepath` may not contain ``{``.

    Every process of a multi-worker job saves (checkpoints are collective); only the chief
    writes what is written once and prints.

    Args:
      filepath: the checkpoint directory (created if absent).
      monitor: the log key compared with `save_best_only`, e.g. ``"val_loss"``.
      verbose: 1 prints a line per save (and per non-improvement with `save_best_only`).
      save_best_only: save only when `monitor` improves on the best so far; the directory
        then holds the best checkpoint (which is also the latest).
      save_weights_only: save the weights only, not the optimizer state and step.
      mode: ``"min"``, ``"max"`` or ``"auto"`` (a `Mode` or its value): whether a lower or
        higher `monitor` is better; ``"auto"`` infers it as `EarlyStopping` does.
      save_freq: ``"epoch"`` saves after each epoch; an int N saves after every N training
        steps (at the end of the execution that reaches them).
      initial_value_threshold: with `save_best_only`, the value to beat first.
      max_to_keep: checkpoints kept (keyword-only); 1 (the default) keeps the latest, as
        Keras overwrites one file; None keeps all.

    Raises:
      ValueError: for an invalid argument.

    Example:

    >>> import os, tempfile, numpy as np, optax, flax.linen as nn, jstrategy
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> model = jstrategy.Model(nn.Dense(1), input_shape=(2,))
    >>> model.compile(optax.sgd(0.1), loss="mse")
    >>> x, y = np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32)
    >>> cb = ModelCheckpoint(path, monitor="loss", save_best_only=True)
    >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[cb])
    >>> sorted(os.listdir(path))
    ['3']
    """

    def __init__(
        self,
        filepath: os.PathLike | str,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: Mode | str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
        *,
        max_to_keep: int | None = 1,
    ):
        super().__init__()
        if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
            raise ValueError(f"`filepath` must be a directory path; got {filepath!r}.")
        if "{" in os.fspath(filepath):
            raise ValueError(
                f"`filepath` must be a checkpoint directory without format fields; got "
                f"{os.fspath(filepath)!r}. Each save is a numbered step in that directory "
                "(epoch + 1, or the training step with an int save_freq): pass e.g. "
                "'/tmp/ckpt'."
            )
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"`monitor` must be a log key such as 'val_loss'; got {monitor!r}.")
        if initial_value_threshold is not None and (
            isinstance(initial_value_threshold, bool)
            or not isinstance(initial_value_threshold, (int, float))
        ):
            raise ValueError(
                f"`initial_value_threshold` must be a number or None; got "
                f"{initial_value_threshold!r}."
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(
                f"`max_to_keep` must be a positive int or None (keep all); got {max_to_keep!r}."
            )
        self.filepath = os.path.abspath(os.fspath(filepath))
        self.monitor = monitor
        self.verbose = verbose
        self.save_best_only = bool(save_best_only)
        self.save_weights_only = bool(save_weights_only)
        self.mode = _parse_mode(mode)
        self.save_freq = _check_save_freq(save_freq)
        self.initial_value_threshold = initial_value_threshold
        self.max_to_keep = max_to_keep
        self.best: float | None = (
            None if initial_value_threshold is None else float(initial_value_threshold)
        )
        self._lower_is_better: bool | None = None
        self._manager: Any = None
        self._counter = _StepCounter()

    def on_train_begin(self, logs=None):
        _check_model(self.model, "ModelCheckpoint")
        strategy = self.model.strategy
        exact = _resumes_exactly(self.model)
        if not exact and self.save_freq != "epoch":
            raise ValueError(
                f"ModelCheckpoint(save_freq={self.save_freq!r}) cannot save in the middle of "
                f"an epoch under {type(strategy).__name__}: its workers train asynchronously "
                "and the model's variables are on the parameter servers until the epoch "
                "ends. Pass save_freq='epoch'."
            )
        if self._manager is None:
            best_mode = "max" if self.save_best_only and not self._lower() else "min"
            self._manager = checkpoint_lib.CheckpointManager(
                self.filepath,
                max_to_keep=self.max_to_keep,
                keep_best=self.monitor if self.save_best_only else None,
                best_mode=best_mode,
            )
        self._counter = _StepCounter()

    def _lower(self) -> bool:
        if self._lower_is_better is None:
            self._lower_is_better = _infer_lower_is_better(
                self.mode, self.monitor, self.model, "ModelCheckpoint", "keep"
            )
        return self._lower_is_better

    def on_epoch_begin(self, epoch, logs=None):
        self._counter.epoch_begin(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        self._counter.batch_end(self.model)
        if self._counter.due(self.save_freq):
            epoch = _fit_state(self.model, "ModelCheckpoint").epoch
            self._save(epoch, int(np.asarray(local_copy(self.model.state.step))), logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch, epoch + 1, logs)

    def _save(self, epoch: int, step: int, logs: dict[str, Any] | None) -> None:
        metrics = log_numbers(logs)
        where = f"Epoch {epoch + 1}: "
        if self.save_best_only:
            current = metrics.get(self.monitor)
            if current is None:
                warnings.warn(
                    f"ModelCheckpoint can save the best model only when {self.monitor!r} is "
                    f"in the logs (available: {sorted(metrics)}); skipping this save. Pass "
                    "validation data for 'val_' keys, or monitor one of the available keys.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            better = self.best is None or (
                current < self.best if self._lower() else current > self.best
            )
            if not better:
                if self.verbose > 0 and _is_chief():
                    print(f"\n{where}{self.monitor} did not improve from {self.best}", flush=True)
                return
            if self.verbose > 0 and _is_chief():
                print(
                    f"\n{where}{self.monitor} improved from {self.best} to {current}, saving "
                    f"the model to {self.filepath}/{step}",
                    flush=True,
                )
            self.best = current
        elif self.verbose > 0 and _is_chief():
            print(f"\n{where}saving the model to {self.filepath}/{step}", flush=True)
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            warnings.warn(
                f"ModelCheckpoint: {self.filepath} already holds step {latest}, so step {step} "
                "is not saved (a checkpoint directory's steps only go up). Use a new "
                "directory for a new run.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        fit_state = _fit_state(self.model, "ModelCheckpoint")
        tree = fit_state.checkpoint_tree(weights_only=self.save_weights_only)
        self._manager.save(step, tree, metrics=metrics, metadata={"epoch": epoch}, force=True)

    def on_train_end(self, logs=None):
        self._close()

    def _on_train_abort(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._manager is not None:
            manager, self._manager = self._manager, None
            manager.close()


class BackupAndRestore(Callback):
    """Backs up training during `Model.fit` so that a restarted job resumes it exactly.

    As Keras's ``BackupAndRestore``, and more exact: at the start of `fit`, a backup in
    `backup_dir` (from a run that was killed, crashed or preempted) is restored (the whole
    training state with the optimizer state, the epoch, the step within it and the
    epoch's running loss and metric sums) and training continues from that step. For array
    inputs the data order resumes too: each epoch's shuffling order is a function of the
    model's seed and the epoch, and the batches the interrupted run consumed are skipped,
    so the resumed run ends with the parameters an uninterrupted run has. For a dataset,
    the consumed batches are drawn again and dropped: exact if it yields the same batches
    in the same order in the new process (a list, a seeded generator function, a
    deterministic loader); a dataset whose order changes from run to run resumes at the
    right step with other batches. At the end of training the backup is deleted (unless
    ``delete_checkpoint=False``); after an exception or a preemption it is kept.

    Under `ParameterServerStrategy`, whose workers train asynchronously, backups are
    taken between epochs only (``save_freq="epoch"``): the train state, each variable's
    optimizer state on the parameter servers, the epoch and the data order. A restarted job
    restarts the interrupted epoch, with that epoch's data order; with one worker it then
    follows the uninterrupted run exactly, with several the order of their updates differs
    from run to run (as it does between any two runs). SIGTERM is not intercepted there.

    With `save_before_preemption` (the default), SIGTERM (the usual preemption notice) no
    longer kills the process: training goes on to the next step boundary (between
    executions of ``steps_per_execution`` steps), where every worker saves a backup of that
    same step (they agree through JAX's preemption service, see
    `jstrategy.experimental.PreemptionCheckpointHandler`), and the process exits with
    status `PREEMPTION_EXIT_CODE` (0). Starting the same command again resumes.

    Backups go to one `jstrategy.CheckpointManager` (``max_to_keep=1``; written in the
    background and atomically: a job killed mid-save resumes from the previous backup).
    Every process of a multi-worker job saves and restores; only the chief deletes and
    prints.

    Args:
      backup_dir: the directory for the backup; use one per training job.
      save_freq: ``"epoch"`` backs up after every epoch; an int N after every N training
        steps (at the end of the execution that reaches them).
      delete_checkpoint: delete the backup when `fit` completes.
      save_before_preemption: on SIGTERM, back up at the next step boundary and exit.

    Raises:
      ValueError: for an invalid argument; at the start of `fit`, for an int `save_freq`
        under a strategy whose workers train asynchronously.

    Example:

    >>> import os, tempfile, numpy as np, optax, flax.linen as nn, jstrategy
    >>> backup_dir = os.path.join(tempfile.mkdtemp(), "backup")
    >>> model = jstrategy.Model(nn.Dense(1), input_shape=(2,))
    >>> model.compile(optax.sgd(0.1), loss="mse")
    >>> x, y = np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32)
    >>> cb = BackupAndRestore(backup_dir, save_freq=1)
    >>> _ = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[cb])
    >>> os.path.exists(backup_dir)  # deleted once training completed
    False
    """

    def __init__(
        self,
        backup_dir: os.PathLike | str,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool = True,
    ):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(
                f"`backup_dir` must be a directory path; got {backup_dir!r}. E.g. '/tmp/backup'."
            )
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        self.save_freq = _check_save_freq(save_freq)
        self.delete_checkpoint = bool(delete_checkpoint)
        self.save_before_preemption = bool(save_before_preemption)
        self._manager: Any = None
        self._watcher: Any = None
        self._backups = 0
        self._counter = _StepCounter()

    def on_train_begin(self, logs=None):
        _check_model(self.model, "BackupAndRestore")
        strategy = self.model.strategy
        exact = _resumes_exactly(self.model)
        if not exact and self.save_freq != "epoch":
            raise ValueError(
                f"BackupAndRestore(save_freq={self.save_freq!r}) cannot back up in the "
                f"middle of an epoch under {type(strategy).__name__}: its workers train "
                "asynchronously, so no step is a point every update has reached. Pass "
                "save_freq='epoch': a restarted job resumes from the last completed epoch."
            )
        self._manager = checkpoint_lib.CheckpointManager(self.backup_dir, max_to_keep=1)
        self._counter = _StepCounter()
        latest = self._manager.latest_step()
        self._backups = 0 if latest is None else int(latest)
        if latest is not None:
            where = _fit_state(self.model, "BackupAndRestore").restore_backup(self._manager)
            if _is_chief():
                print(
                    f"BackupAndRestore: resuming from the backup in {self.backup_dir} at "
                    f"epoch {where['epoch'] + 1}, step {where['step']}.",
                    flush=True,
                )
        # Without exact resumption there is no step to save at a preemption notice: the
        # process stops at once, and the last epoch's backup is where it resumes.
        if self.save_before_preemption and exact:
            self._watcher = signals.PreemptionWatcher(owner="BackupAndRestore")

    def on_epoch_begin(self, epoch, logs=None):
        self._counter.epoch_begin(self.model)

    def on_train_batch_end(self, batch, logs=None):
        self._counter.batch_end(self.model)
        # Every process reaches this point at every step boundary, in the same order, as
        # the preemption service requires.
        if self._watcher is not None and self._watcher.reached_sync_point():
            self._preempted()
        if self._counter.due(self.save_freq):
            self._save(epoch_end=False)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch_end=True)

    def _save(self, *, epoch_end: bool) -> dict[str, Any]:
        self._backups += 1
        fit_state = _fit_state(self.model, "BackupAndRestore")
        metadata = fit_state.metadata(epoch_end=epoch_end)
        tree = fit_state.checkpoint_tree(epoch_sums=True)
        self._manager.save(self._backups, tree, metadata=metadata, force=True)
        return metadata

    def _preempted(self) -> None:
        where = self._save(epoch_end=False)
        self._manager.wait_until_finished()
        if _is_chief():
            print(
                f"BackupAndRestore: preemption notice; backed up epoch {where['epoch'] + 1}, "
                f"step {where['step']} in {self.backup_dir}; exiting with status "
                f"{signals.PREEMPTION_EXIT_CODE}.",
                flush=True,
            )
        sys.exit(signals.PREEMPTION_EXIT_CODE)

    def on_train_end(self, logs=None):
        self._release()
        if not self.delete_checkpoint:
            return
        # Every process is done with the backup before the chief removes it, and the
        # chief is done before any process's next fit may create it again (bounded waits).
        meeting = coordination.next_id() if coordination.active() else None
        what = f"Deleting the backup {self.backup_dir} after fit"
        fix = "Every worker runs fit with the same BackupAndRestore callback."
        if meeting is not None:
            coordination.barrier(f"backup-{meeting}/delete", what=what, fix=fix)
        if _is_chief():
            shutil.rmtree(self.backup_dir, ignore_errors=True)
        if meeting is not None:
            coordination.barrier(f"backup-{meeting}/deleted", what=what, fix=fix)

    def _on_train_abort(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._watcher is not None:
            watcher, self._watcher = self._watcher, None
            watcher.close()
        if self._manager is not None:
            manager, self._manager = self._manager, None
            manager.close()
