"""`MonitorCallback`: the base of the callbacks that watch one logged quantity.

`EarlyStopping`, `ReduceLROnPlateau` and `ModelCheckpoint` each watch `monitor` in the
direction `mode` says: ``"auto"`` infers it once, from the metric's ``direction`` when
the model lists it, else from its name (losses and errors go down, accuracies go up).
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.training.callbacks.base import host_float

__all__ = ["Mode", "MonitorCallback"]


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


class MonitorCallback(Callback):
    """A callback that watches one logged quantity, `monitor`, in the direction of `mode`.

    As Keras 3's ``MonitorCallback``: it checks `monitor` and `mode`, reads the value from
    an epoch's logs (`get_monitor_value`, warning once per read when it is missing) and
    says whether a lower value is better (`lower_is_better`, inferred at its first use
    with ``mode="auto"``: the model is known by then). What counts as an improvement (a
    `min_delta`, a baseline) is each subclass's.

    Args:
      monitor: the log key to watch, e.g. ``"val_loss"``.
      mode: ``"min"``, ``"max"`` or ``"auto"`` (a `Mode`, or its value).

    Raises:
      ValueError: for an empty or non-string `monitor`, or an unknown `mode`.

    Example:

    >>> from jstrategy.callbacks import ModelCheckpoint
    >>> issubclass(ModelCheckpoint, MonitorCallback)
    True
    """

    #: How messages name the callback, and what it does with the best value.
    _owner = "MonitorCallback"
    _verb = "track"

    def __init__(self, monitor: str, mode: Mode | str):
        super().__init__()
        _check_monitor(monitor)
        self.monitor = monitor
        self.mode = _parse_mode(mode)
        self._lower_is_better: bool | None = None

    def get_monitor_value(self, logs: dict[str, Any] | None) -> float | None:
        """The monitored value in `logs`, or None (with a warning) if it is missing."""
        return _monitored(logs, self.monitor, self._owner)

    def lower_is_better(self) -> bool:
        """Whether a lower `monitor` is better (`mode`, or inferred once from the model)."""
        if self._lower_is_better is None:
            self._lower_is_better = _infer_lower_is_better(
                self.mode, self.monitor, self.model, self._owner, self._verb
            )
        return self._lower_is_better
