"""Keras's ``TensorBoard`` callback: scalars, histograms and profiles for TensorBoard.

Events are written with tensorboardX (``pip install 'jstrategy[tensorboard]'``), a writer
of TensorBoard's event files that needs no TensorFlow; profiles are `jax.profiler` traces,
which TensorBoard's profile plugin reads.
"""

from __future__ import annotations

import io
import itertools
import os
import socket
import tempfile
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src.cluster.join import is_chief
from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.training.callbacks.base import host_float
from jstrategy._src.training.callbacks.base import log_numbers
from jstrategy._src.validation import is_int
from jstrategy._src.values import to_host

__all__ = ["TensorBoard"]


def _summary_writer_class() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ImportError(
            "jstrategy.callbacks.TensorBoard writes TensorBoard event files with "
            "tensorboardX; install it with pip install 'jstrategy[tensorboard]' (or pip "
            "install tensorboardX)."
        ) from None
    return SummaryWriter


# Writers opened by this process: the counter in each event file's name, as TensorBoard's
# own writers number theirs, so two writers opened within one second (a `fit` per epoch, a
# sweep's short runs) never share a file name.
_WRITERS_OPENED = itertools.count()


def _unique_suffix(directory: str) -> str:
    """The end of a new event file's name: ``.<pid>.<counter>``, zero-padded so that the
    files of one second sort in the order they were opened (TensorBoard reads them so).

    A suffix that a file in `directory` already ends with (another process with the same
    id, e.g. in another container) is skipped: an event file is never replaced.
    """
    host = socket.gethostname()
    existing = os.listdir(directory) if os.path.isdir(directory) else []
    while True:
        suffix = f".{os.getpid()}.{next(_WRITERS_OPENED):06d}"
        if not any(name.endswith(f".{host}{suffix}") for name in existing):
            return suffix


def _profile_range(profile_batch: Any) -> tuple[int, int]:
    message = (
        "`profile_batch` must be a non-negative int, or a pair (start, stop) of positive "
        "ints with start <= stop (the range of batches to profile), or 0 to disable "
        f"profiling; got {profile_batch!r}."
    )
    value = profile_batch
    if isinstance(value, str):  # Keras's legacy "start,stop" form
        try:
            value = [int(part) for part in value.split(",")]
        except ValueError:
            raise ValueError(message) from None
        if len(value) == 1:
            value = value[0]
    if is_int(value):
        start = stop = int(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) for v in value):
        start, stop = (int(v) for v in value)
        if start < 1:
            raise ValueError(message)
    else:
        raise ValueError(message)
    if start < 0 or stop < start:
        raise ValueError(message)
    return start, stop


class TensorBoard(Callback):
    """Writes the logs of `Model.fit` for TensorBoard, as Keras's ``TensorBoard``.

    The layout and tags are Keras's, so dashboards and scripts written for Keras's logs read
    these: under ``log_dir/train``, ``epoch_<name>`` scalars (``epoch_loss``,
    ``epoch_accuracy``, ``epoch_learning_rate``, ...) at step ``epoch``; under
    ``log_dir/validation``, the ``val_`` logs with the prefix removed (``epoch_loss``, ...)
    and, at the end of each evaluation, ``evaluation_<name>_vs_iterations`` at the
    training step. With `update_freq` ``"batch"`` or N, ``batch_<name>`` scalars (the
    epoch's running means, as the batch logs hold) at the training step, every N steps.

    `profile_batch` profiles a range of training batches (counted from 1 in each `fit`)
    with `jax.profiler`: the trace lands in ``log_dir/plugins/profile/<run>/``, where
    TensorBoard's profile plugin (``pip install tensorboard-plugin-profile``) and Perfetto
    read it.

    Where it differs from Keras: a JAX program has no TensorFlow graph, so `write_graph`
    writes the model's `summary()` table as text (tag ``keras``); `write_images` and
    embeddings are not supported (a clear error). Histograms (`histogram_freq`) are of
    every variable in ``model.variables``, tagged by its path (``params/Dense_0/kernel``).

    In a multi-worker job only the chief (process 0) writes, as Keras; the other workers
    write nothing (Keras has them write to a temporary directory and delete it).

    Each writer opens a new event file, never replacing one: its name ends with the process
    id and a counter (``events.out.tfevents.<seconds>.<host>.<pid>.<counter>``), as
    TensorBoard's own writers name theirs, so a `fit` per epoch with one callback, or the
    short runs of a sweep sharing a `log_dir`, keep every epoch; TensorBoard reads a
    directory's files together.

    Args:
      log_dir: the directory of the logs (created as needed, when training or an
        evaluation begins: one that cannot be created or written to raises then, before
        any step). Do not share it with other callbacks.
      histogram_freq: every how many epochs to write histograms of the variables; 0: never.
      write_graph: whether to write the model's summary table (see above).
      write_images: must be False (not supported).
      write_steps_per_second: whether to log the training steps per second, per epoch
        (``epoch_steps_per_second``) and, with batch logging, per logged batch
        (``batch_steps_per_second``).
      update_freq: ``"epoch"`` writes the scalars at the end of each epoch; ``"batch"``
        (or 1), or an int N, also writes the batch logs every N training steps. Writing
        batch logs reads them on the host, a synchronization per write.
      profile_batch: 0 (no profiling), a batch number N, or a pair ``(start, stop)`` (or
        the string ``"start,stop"``) of batch numbers to profile.
      embeddings_freq: must be 0 (not supported).
      embeddings_metadata: must be None (not supported).

    Raises:
      ValueError: for an invalid or unsupported argument, and, when `fit` or `evaluate`
        begins, for a `log_dir` that cannot be created or written to.
      ImportError: if tensorboardX is not installed.

    Example:

    >>> import os, tempfile, numpy as np, optax, flax.linen as nn, jstrategy
    >>> log_dir = tempfile.mkdtemp()
    >>> model = jstrategy.Model(nn.Dense(1), input_shape=(2,))
    >>> model.compile(optax.sgd(0.1), loss="mse")
    >>> x, y = np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32)
    >>> _ = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
    ...               callbacks=[TensorBoard(log_dir)])
    >>> sorted(os.listdir(log_dir))
    ['train']
    """

    def __init__(
        self,
        log_dir: os.PathLike | str = "logs",
        histogram_freq: int = 0,
        write_graph: bool = True,
        write_images: bool = False,
        write_steps_per_second: bool = False,
        update_freq: str | int = "epoch",
        profile_batch: int | str | tuple[int, int] = 0,
        embeddings_freq: int = 0,
        embeddings_metadata: Any = None,
    ):
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise ValueError(f"`log_dir` must be a directory path; got {log_dir!r}.")
        if not is_int(histogram_freq) or histogram_freq < 0:
            raise ValueError(
                f"`histogram_freq` must be a non-negative int (epochs; 0 disables); got "
                f"{histogram_freq!r}."
            )
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (not is_int(update_freq) or int(update_freq) < 1):
            raise ValueError(
                f"`update_freq` must be 'epoch', 'batch' or a positive int (training steps); "
                f"got {update_freq!r}."
            )
        unsupported = {
            "write_images": write_images,
            "embeddings_freq": embeddings_freq,
            "embeddings_metadata": embeddings_metadata,
        }
        for name, value in unsupported.items():
            if value:
                raise ValueError(
                    f"`{name}` is not supported by jstrategy.callbacks.TensorBoard; got "
                    f"{value!r}. Leave it at its default (scalars, histograms, the model "
                    "summary and profiles are written)."
                )
        self._writer_class = _summary_writer_class()
        self.log_dir = os.path.abspath(os.fspath(log_dir))
        self.histogram_freq = int(histogram_freq)
        self.write_graph = bool(write_graph)
        self.write_steps_per_second = bool(write_steps_per_second)
        self.update_freq: str | int = update_freq if update_freq == "epoch" else int(update_freq)
        self._start_batch, self._stop_batch = _profile_range(profile_batch)
        self._should_trace = self._stop_batch > 0
        self._writers: dict[str, Any] = {}
        self._is_tracing = False
        self._graph_written = False
        self._in_fit = False
        self._fit_batches = 0
        self._epoch_base: int | None = None
        self._last_logged_step = 0
        self._last_logged_time = 0.0
        self._epoch_start: tuple[float, int | None] = (0.0, None)

    # Writers ----------------------------------------------------------------------------
    def _writer(self, name: str) -> Any:
        writer = self._writers.get(name)
        if writer is None:
            # Created when first written to, so a run without validation has no
            # validation directory (as Keras). tensorboardX names a file by the second
            # and the host only, and opens it for writing from scratch: the suffix makes
            # the name one that no earlier writer used.
            directory = os.path.join(self.log_dir, name)
            writer = self._writers[name] = self._writer_class(
                directory, filename_suffix=_unique_suffix(directory)
            )
        return writer

    def _check_log_dir(self) -> None:
        """Creates `log_dir` and checks that it takes files, before any step runs."""
        given = self.log_dir
        fix = "Pass a directory that this process can create and write to."
        for name in ("", "train", "validation"):
            path = os.path.join(given, name) if name else given
            if os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(
                    f"TensorBoard's `log_dir` {given!r} cannot be used: {path!r} is a file, "
                    f"where the event files' directory goes. {fix}"
                )
        try:
            os.makedirs(given, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"TensorBoard's `log_dir` {given!r} cannot be created: {e.strerror or e}. {fix}"
            ) from e
        try:  # a read-only directory or file system: found now, not after an epoch
            descriptor, probe = tempfile.mkstemp(dir=given, prefix=".jstrategy_probe_")
        except OSError as e:
            raise ValueError(
                f"TensorBoard's `log_dir` {given!r} cannot be written to: {e.strerror or e}. {fix}"
            ) from e
        os.close(descriptor)
        os.remove(probe)

    def _write_scalars(self, name: str, values: dict[str, float], step: int) -> None:
        if not values:
            return
        writer = self._writer(name)
        for tag, value in values.items():
            writer.add_scalar(tag, value, global_step=step)

    def _flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def _close(self) -> None:
        writers, self._writers = self._writers, {}
        for writer in writers.values():
            writer.close()

    # The model's training step ----------------------------------------------------------
    def _model_step(self) -> int | None:
        """The optimizer's step count (Keras's ``optimizer.iterations``), or None."""
        try:
            state = self.model.state
        except (AttributeError, RuntimeError):
            return None
        step = getattr(state, "step", None)
        return None if step is None else int(host_float(step))

    # Hooks ------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        if is_chief():
            self._check_log_dir()
        self._in_fit = True
        self._fit_batches = 0
        self._should_trace = self._stop_batch > 0  # each fit profiles its batches, as Keras

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_base = None
        if self.write_steps_per_second and is_chief():
            self._epoch_start = (time.perf_counter(), self._model_step())

    def on_train_batch_begin(self, batch, logs=None):
        self._fit_batches += 1
        if self._epoch_base is None and self.update_freq != "epoch":
            # The steps before this epoch's first batch (a resumed epoch starts part way).
            self._epoch_base = (self._model_step() or 0) - batch
            self._last_logged_step = self._epoch_base + batch
            self._last_logged_time = time.perf_counter()
        if (
            self._should_trace
            and not self._is_tracing
            and self._start_batch <= self._fit_batches <= self._stop_batch
            and is_chief()
        ):
            self._start_trace()

    def on_train_batch_end(self, batch, logs=None):
        if self._is_tracing and self._fit_batches >= self._stop_batch:
            # The profiled batches' device work is done before the trace is stopped.
            jax.block_until_ready(list((logs or {}).values()))
            self._stop_trace()
        if self.update_freq == "epoch" or not is_chief():
            return
        assert self._epoch_base is not None and isinstance(self.update_freq, int)
        step = self._epoch_base + batch + 1
        if step // self.update_freq <= self._last_logged_step // self.update_freq:
            return
        values = {f"batch_{k}": v for k, v in log_numbers(logs).items()}
        if self.write_steps_per_second:
            now = time.perf_counter()
            seconds = now - self._last_logged_time
            if seconds > 0:
                values["batch_steps_per_second"] = (step - self._last_logged_step) / seconds
            self._last_logged_time = now
        self._last_logged_step = step
        self._write_scalars("train", values, step)

    def on_epoch_end(self, epoch, logs=None):
        histograms = None
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            # Read on every process: variables split across processes (FSDP) are gathered
            # collectively; only the chief writes them.
            histograms = self._histogram_values()
        if not is_chief():
            return
        numbers = log_numbers(logs)
        train = {k: v for k, v in numbers.items() if not k.startswith("val_")}
        validation = {k[len("val_") :]: v for k, v in numbers.items() if k.startswith("val_")}
        if "learning_rate" not in train:
            rate = self._learning_rate()
            if rate is not None:
                train["learning_rate"] = rate
        if self.write_steps_per_second:
            started, first_step = self._epoch_start
            last_step = self._model_step()
            seconds = time.perf_counter() - started
            if first_step is not None and last_step is not None and seconds > 0:
                train["steps_per_second"] = (last_step - first_step) / seconds
        self._write_scalars("train", {f"epoch_{k}": v for k, v in train.items()}, epoch)
        self._write_scalars("validation", {f"epoch_{k}": v for k, v in validation.items()}, epoch)
        if histograms is not None:
            writer = self._writer("train")
            for name, values in histograms.items():
                writer.add_histogram(f"{name}/histogram", values, global_step=epoch)
        if self.write_graph and not self._graph_written:
            self._write_model_summary()
        self._flush()

    def on_test_begin(self, logs=None):
        if not self._in_fit and is_chief():  # Model.evaluate(callbacks=[...])
            self._check_log_dir()

    def on_test_end(self, logs=None):
        if not is_chief():
            return
        step = self._model_step()
        if step is not None:
            values = {f"evaluation_{k}_vs_iterations": v for k, v in log_numbers(logs).items()}
            self._write_scalars("validation", values, step)
        if self._in_fit:
            self._flush()
        else:  # Model.evaluate(callbacks=[...]) on its own: nothing else comes
            self._close()

    def on_train_end(self, logs=None):
        self._in_fit = False
        if self._is_tracing:
            self._stop_trace()
        self._close()

    def _on_train_abort(self) -> None:
        # `fit` raised: release the profiler (one trace at a time per process) and files.
        self.on_train_end()

    # Contents -----------------------------------------------------------------------------
    def _learning_rate(self) -> float | None:
        try:
            return float(self.model.learning_rate)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            return None  # no single, readable rate (e.g. a plain optax transformation)

    def _histogram_values(self) -> dict[str, np.ndarray]:
        leaves = jax.tree_util.tree_flatten_with_path(self.model.variables)[0]
        numeric = [
            (jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
            for path, leaf in leaves
            if jnp.issubdtype(getattr(leaf, "dtype", np.object_), jnp.number)  # not PRNG keys
        ]
        values = to_host([leaf for _, leaf in numeric])
        return {
            name: np.asarray(v, np.float32) for (name, _), v in zip(numeric, values, strict=True)
        }

    def _write_model_summary(self) -> None:
        buffer = io.StringIO()
        self.model.summary(print_fn=lambda text: buffer.write(str(text) + "\n"))
        # Markdown: indented lines render as a fixed-width block in TensorBoard's text tab.
        text = "".join(f"    {line}\n" for line in buffer.getvalue().splitlines())
        self._writer("train").add_text("keras", text, global_step=0)
        self._graph_written = True

    # Profiling ----------------------------------------------------------------------------
    def _start_trace(self) -> None:
        try:
            jax.profiler.start_trace(self.log_dir)
        except RuntimeError as e:  # another trace is running in this process
            warnings.warn(
                f"TensorBoard could not start profiling batches {self._start_batch}-"
                f"{self._stop_batch}: {e} Stop the other trace, or pass profile_batch=0.",
                RuntimeWarning,
                stacklevel=3,
            )
            self._should_trace = False
            return
        self._is_tracing = True

    def _stop_trace(self) -> None:
        self._is_tracing = False
        self._should_trace = False  # once per fit
        jax.profiler.stop_trace()
