"""`Callback`: the hooks into `Model.fit`, `evaluate` and `predict`, with `History` and
`LambdaCallback`.

The hooks, their arguments and the meaning of `logs` follow Keras: batch logs hold the
running averages since the epoch (or evaluation) began, epoch logs the epoch's results
plus ``val_``-prefixed validation results. One `logs` dict is handed to every callback in
turn, so a key added by one callback (e.g. ``learning_rate``) is seen by those after it,
`History` included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jstrategy._src.values import local_copy

__all__ = ["Callback", "History", "LambdaCallback", "host_float", "log_numbers"]

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
