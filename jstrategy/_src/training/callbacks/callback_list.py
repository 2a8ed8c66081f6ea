"""`CallbackList`: the hooks dispatched to every callback in turn, as `fit` calls them."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.training.callbacks.base import History
from jstrategy._src.training.callbacks.progress import ProgbarLogger

__all__ = ["CallbackList"]


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
