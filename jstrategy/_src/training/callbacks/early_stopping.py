"""`EarlyStopping`: stops `fit` when a monitored quantity stops improving."""

from __future__ import annotations

from typing import Any

from jstrategy._src.training.callbacks.monitor import Mode
from jstrategy._src.training.callbacks.monitor import MonitorCallback
from jstrategy._src.validation import check_non_negative_int
from jstrategy._src.validation import check_number

__all__ = ["EarlyStopping"]


class EarlyStopping(MonitorCallback):
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

    _owner = "EarlyStopping"
    _verb = "stop on"

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
        super().__init__(monitor, mode)
        check_number(min_delta, "min_delta", fix="E.g. 1e-3.")
        patience = check_non_negative_int(patience, "patience")
        start_from_epoch = check_non_negative_int(start_from_epoch, "start_from_epoch")
        if baseline is not None:
            check_number(baseline, "baseline", expected="a number or None")
        self.min_delta = abs(float(min_delta))
        self.patience = patience
        self.verbose = verbose
        self.baseline = None if baseline is None else float(baseline)
        self.restore_best_weights = bool(restore_best_weights)
        self.start_from_epoch = start_from_epoch
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None
        self.best_weights: Any = None
        self.best_epoch = 0

    def on_train_begin(self, logs=None):
        self._reset()

    def _is_improvement(self, value: float, reference: float | None) -> bool:
        if reference is None:
            return True
        if self.lower_is_better():
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def on_epoch_end(self, epoch, logs=None):
        self.lower_is_better()  # inferred before the first value is read, as Keras
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
