"""Keras-like progress bars, and `ProgbarLogger`, the callback that draws them in `fit`.

The bars behave in terminals and in captured output alike. In a terminal the bar is redrawn in place with a carriage return, at most once per
`interval`. Anywhere else (CI logs, files, notebooks capturing stdout) a carriage return
does not overwrite anything, so each redraw would become a new line; there the bar prints
one finished line per run (and, for runs longer than `Progbar.non_tty_interval` seconds,
one progress line per that many seconds).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import TextIO

import numpy as np

from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.validation import check_number

__all__ = ["Progbar", "ProgbarLogger", "resolve_verbose"]


def _isatty(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):
        # A closed or exotic stream is not a terminal.
        return False


def resolve_verbose(verbose: int | str, file: TextIO | None = None) -> int:
    """Resolves Keras's `verbose` argument, including ``"auto"``.

    Args:
      verbose: 0 (silent), 1 (progress bar), 2 (one line per epoch) or ``"auto"``: 1 when
        `file` is a terminal, else 2, so logs and notebooks get no carriage returns.
      file: the stream progress goes to; None means `sys.stdout`.

    Returns:
      0, 1 or 2.

    Raises:
      ValueError: for any other value.

    Example:

    >>> import io
    >>> resolve_verbose("auto", io.StringIO())
    2
    >>> resolve_verbose(1)
    1
    """
    if isinstance(verbose, str) and verbose == "auto":
        return 1 if _isatty(sys.stdout if file is None else file) else 2
    if isinstance(verbose, (int, np.integer)) and int(verbose) in (0, 1, 2):
        return int(verbose)
    raise ValueError(
        f'`verbose` must be 0, 1, 2 or "auto"; got {verbose!r}. Use 0 for silence, 1 for a '
        'progress bar, 2 for one line per epoch, "auto" for 1 in a terminal and 2 elsewhere.'
    )


def _as_float(value: Any) -> float:
    # np.asarray waits for a device value, so this runs only when a number is needed.
    return float(np.mean(np.asarray(value, dtype=np.float64)))


def _is_number(value: Any) -> bool:
    return not isinstance(value, (str, bytes))


def _format_value(value: float) -> str:
    return f"{value:.4f}" if abs(value) > 1e-3 else f"{value:.4e}"


def _format_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    if seconds >= 60:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds}s"


def _format_per_unit(seconds: float, unit: str) -> str:
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.0f}s/{unit}"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/{unit}"
    return f"{seconds * 1e6:.0f}us/{unit}"


class Progbar:
    """A Keras-like progress bar with ETA and running metric averages.

    Args:
      target: the total number of steps, or None if unknown.
      width: the bar's width in characters.
      verbose: 0 (silent), 1 (bar), 2 (one line when finished) or ``"auto"`` (see
        `resolve_verbose`).
      interval: minimum seconds between redraws in a terminal.
      stateful_metrics: names whose values are shown as given instead of averaged over
        steps (e.g. metrics that are already running averages). Their values are
        converted to numbers only when drawn, so passing device arrays does not wait for
        the device at every step.
      unit_name: what a step is called in the speed display (``"5ms/step"``).
      file: the stream to write to; None means `sys.stdout` at the time of writing.

    Raises:
      ValueError: for a negative `target`, a non-positive `width`, a negative `interval`
        or an invalid `verbose`.

    Example:

    >>> import io
    >>> out = io.StringIO()
    >>> bar = Progbar(3, file=out)
    >>> for step in range(1, 4):
    ...     bar.update(step, [("loss", 1.0 / step)])
    >>> print(out.getvalue().split(" - ")[0])
    3/3 [==============================]
    >>> "\\r" in out.getvalue(), out.getvalue().count("\\n")
    (False, 1)
    """

    #: Outside a terminal, seconds between progress lines before the run finishes.
    non_tty_interval: float = 60.0

    def __init__(
        self,
        target: int | None,
        *,
        width: int = 30,
        verbose: int | str = 1,
        interval: float = 0.05,
        stateful_metrics: Iterable[str] | None = None,
        unit_name: str = "step",
        file: TextIO | None = None,
    ):
        if target is not None:
            check_number(
                target,
                "target",
                integer=True,
                low=0,
                expected="a non-negative int or None",
                fix="Pass the number of steps, or None when it is unknown.",
            )
        check_number(width, "width", integer=True, low=1, fix="E.g. 30.")
        check_number(interval, "interval", low=0)
        self.target = None if target is None else int(target)
        self.width = width
        self.verbose = resolve_verbose(verbose, file)
        self.interval = float(interval)
        self.stateful_metrics = set(stateful_metrics or ())
        self.unit_name = unit_name
        self._file = file
        self._dynamic_display = _isatty(sys.stdout if file is None else file)
        self._values: dict[str, list[Any]] = {}
        self._values_order: list[str] = []
        self._seen_so_far = 0
        self._start = time.monotonic()
        self._last_draw: float | None = None
        self._last_line = self._start
        self._drawn_width = 0

    @property
    def seen(self) -> int:
        """The last `current` passed to `update`."""
        return self._seen_so_far

    def _write(self, text: str) -> None:
        file = sys.stdout if self._file is None else self._file
        file.write(text)
        file.flush()

    def update(
        self,
        current: int,
        values: Iterable[tuple[str, Any]] | Mapping[str, Any] | None = None,
        finalize: bool | None = None,
    ) -> None:
        """Moves the bar to `current` and records metric values.

        Args:
          current: the index of the current step (1 after the first step).
          values: ``(name, value)`` pairs or a mapping. Values of names not in
            `stateful_metrics` are averaged over steps, weighted by the steps they cover.
          finalize: whether this is the last update; None means ``current >= target``.
        """
        if finalize is None:
            finalize = self.target is not None and current >= self.target
        if isinstance(values, Mapping):
            values = values.items()
        for name, value in values or ():
            if name not in self._values_order:
                self._values_order.append(name)
            if name in self.stateful_metrics or not _is_number(value):
                self._values[name] = [value, None]
            else:
                steps = max(current - self._seen_so_far, 1)
                total, count = self._values.get(name, [0.0, 0])
                if count is None:
                    total, count = 0.0, 0
                self._values[name] = [total + _as_float(value) * steps, count + steps]
        self._seen_so_far = current

        if self.verbose == 0:
            return
        now = time.monotonic()
        if self.verbose == 1 and self._dynamic_display:
            if (
                not finalize
                and self._last_draw is not None
                and now - self._last_draw < self.interval
            ):
                return
            line = self._bar_line(current, now, finalize)
            padding = " " * max(self._drawn_width - len(line), 0)
            self._drawn_width = len(line)
            self._write("\r" + line + padding + ("\n" if finalize else ""))
        elif self.verbose == 1:
            if finalize or now - self._last_line >= self.non_tty_interval:
                self._write(self._bar_line(current, now, finalize) + "\n")
                self._last_line = now
        elif finalize:
            self._write(self._epoch_line(current, now) + "\n")
        self._last_draw = now

    def add(
        self, n: int, values: Iterable[tuple[str, Any]] | Mapping[str, Any] | None = None
    ) -> None:
        """Advances the bar by `n` steps (see `update`).

        Args:
          n: how many steps were done since the last update.
          values: as in `update`.
        """
        self.update(self._seen_so_far + n, values)

    def _counter(self, current: int) -> str:
        if self.target is None:
            return f"{current:7d}/Unknown"
        digits = len(str(self.target))
        return f"{current:{digits}d}/{self.target}"

    def _bar(self, current: int) -> str:
        if self.target is None:
            return ""
        progress = 1.0 if self.target == 0 else min(current / self.target, 1.0)
        filled = int(self.width * progress)
        bar = ""
        if filled > 0:
            bar = "=" * (filled - 1) + (">" if current < self.target else "=")
        return " [" + bar + "." * (self.width - filled) + "]"

    def _metrics(self) -> str:
        parts = []
        for name in self._values_order:
            total, count = self._values[name]
            if count is None and not _is_number(total):
                parts.append(f" - {name}: {total}")
            else:
                value = _as_float(total) if count is None else total / max(count, 1)
                parts.append(f" - {name}: {_format_value(value)}")
        return "".join(parts)

    def _per_unit(self, current: int, now: float) -> float:
        return (now - self._start) / current if current else 0.0

    def _bar_line(self, current: int, now: float, finalize: bool) -> str:
        line = self._counter(current) + self._bar(current)
        per_unit = self._per_unit(current, now)
        if not finalize and self.target is not None and current < self.target:
            line += f" - ETA: {_format_duration(per_unit * (self.target - current))}"
        else:
            elapsed = _format_duration(now - self._start)
            line += f" - {elapsed} {_format_per_unit(per_unit, self.unit_name)}"
        return line + self._metrics()

    def _epoch_line(self, current: int, now: float) -> str:
        return (
            f"{self._counter(current).strip()} - {_format_duration(now - self._start)} - "
            f"{_format_per_unit(self._per_unit(current, now), self.unit_name)}" + self._metrics()
        )


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
