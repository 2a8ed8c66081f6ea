"""The callbacks that write checkpoints during `fit`: `ModelCheckpoint`, `BackupAndRestore`.

`BackupAndRestore`, and `ModelCheckpoint` given a directory, save through a
`jstrategy.CheckpointManager` (asynchronous, atomic, restorable under any strategy) what
the model's `fit_state` gives; `ModelCheckpoint` given a ``.keras`` or ``.weights.h5``
path saves through `Model.save` or `Model.save_weights`, as Keras's. Both count training
steps the same way for an int ``save_freq``.
"""

from __future__ import annotations

import enum
import os
import shutil
import string
import sys
import warnings
from typing import Any

import numpy as np

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src.checkpoint.manager import check_max_to_keep
from jstrategy._src.checkpoint.paths import latest_step_dir
from jstrategy._src.cluster import coordination
from jstrategy._src.cluster import signals
from jstrategy._src.cluster.join import is_chief
from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.training.callbacks.base import log_numbers
from jstrategy._src.training.callbacks.monitor import Mode
from jstrategy._src.training.callbacks.monitor import MonitorCallback
from jstrategy._src.training.saving import config as saved_config
from jstrategy._src.validation import check_number
from jstrategy._src.values import local_copy

__all__ = ["BackupAndRestore", "ModelCheckpoint"]


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
    return check_number(
        save_freq,
        "save_freq",
        integer=True,
        low=1,
        expected="'epoch' or a positive int (a number of training steps)",
    )


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


class Destination(enum.Enum):
    """What a `ModelCheckpoint` path names, by its ending (Keras's rule, and a directory)."""

    #: ``.keras``: the whole model, as `Model.save` writes it (what `load_model` reads).
    MODEL = "model"
    #: ``.weights.h5``: the weights, as `Model.save_weights` writes them (`load_weights`).
    WEIGHTS = "weights"
    #: Any other path: a `jstrategy.CheckpointManager` directory of numbered steps.
    STEPS = "steps"


def _destination(path: str, save_weights_only: bool) -> Destination:
    """Keras's rule for a checkpoint path's ending, checked before training starts."""
    if path.endswith(".weights.h5"):
        if not save_weights_only:
            raise ValueError(
                f"`filepath` ending in '.weights.h5' holds weights only (what "
                f"model.load_weights reads), so it needs save_weights_only=True; got "
                f"filepath={path!r} with save_weights_only=False. Pass save_weights_only=True, "
                "or a path ending in '.keras' for the whole model."
            )
        return Destination.WEIGHTS
    if path.endswith(".keras"):
        if save_weights_only:
            raise ValueError(
                f"`filepath` ending in '.keras' holds the whole model (what "
                f"jstrategy.models.load_model reads), so it needs save_weights_only=False; got "
                f"filepath={path!r} with save_weights_only=True. Pass a path ending in "
                "'.weights.h5' for the weights only."
            )
        return Destination.MODEL
    if path.endswith(".h5"):
        raise ValueError(
            f"`filepath` must end in '.keras' (the whole model), '.weights.h5' (the "
            f"weights) or name a checkpoint directory; got {path!r}: a Keras 2 HDF5 model "
            "file, which jstrategy does not write. Pass e.g. 'best.keras'."
        )
    if "{" in path:
        raise ValueError(
            f"`filepath` may hold format fields only when it ends in '.keras' or "
            f"'.weights.h5'; got {path!r}, a checkpoint directory, where each save is a "
            "numbered step (epoch + 1, or the training step with an int save_freq). Pass "
            "e.g. 'ckpt.{epoch:02d}.keras', or a directory such as '/tmp/ckpt'."
        )
    return Destination.STEPS


def _check_format(path: str) -> None:
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(path) if name is not None]
    except ValueError as e:
        raise ValueError(
            f"`filepath` {path!r} is not a valid format string ({e}). Write fields as "
            "'{epoch:02d}' or '{val_loss:.2f}', and a literal brace as '{{' or '}}'."
        ) from None
    if "" in fields:
        raise ValueError(
            f"`filepath` {path!r} has an unnamed field '{{}}'. Name it, e.g. '{{epoch:02d}}'."
        )


class ModelCheckpoint(MonitorCallback):
    """Saves the model, or its weights, during `Model.fit`, as Keras's ``ModelCheckpoint``.

    What is saved depends on how `filepath` ends, as in Keras:

    * ``.keras``: the whole model, as `Model.save` writes it (a directory here), read by
      `jstrategy.models.load_model`; needs ``save_weights_only=False``.
    * ``.weights.h5``: the weights, as `Model.save_weights` writes them (a directory here,
      not HDF5), read by `Model.load_weights`; needs ``save_weights_only=True``.
    * any other path: a checkpoint directory of numbered steps, written by a
      `jstrategy.CheckpointManager` (below).

    A ``.keras`` or ``.weights.h5`` path is formatted as Keras does, with ``epoch`` (from
    1), ``batch`` (with an int `save_freq`) and the logs: ``"ckpt.{epoch:02d}.keras"``.
    Each save replaces what is at its path, as Keras overwrites the file, whichever run
    wrote it; the new model is written beside it and moved into place, so an interrupted
    save leaves the previous one whole.

    A checkpoint directory is written asynchronously (training goes on while files are
    written), atomically (a job killed mid-save keeps the previous checkpoint) and is
    restorable under any strategy. Its steps are numbered ``epoch + 1`` with
    ``save_freq="epoch"`` or by the optimizer's step count with an int `save_freq`; each
    records the logs as metrics and ``{"epoch": epoch}`` as metadata and holds the weights
    (``save_weights_only=True``) or the whole training state (weights, optimizer state,
    step). `Model.load_weights(filepath)` loads the weights of the latest step of either;
    `Model.restore_checkpoint(filepath)` restores a whole training state. A `fit` that
    starts at its first epoch is a new run: its first save replaces every step an earlier
    run left there (as Keras overwrites its file). A `fit` that resumes (restored by
    `BackupAndRestore`, or given ``initial_epoch``) keeps them, and a save replaces only
    the steps from its own onwards.

    Every process of a multi-worker job saves (checkpoints are collective); only the chief
    writes what is written once and prints.

    Args:
      filepath: a ``.keras`` or ``.weights.h5`` path, or the checkpoint directory (created
        if absent).
      monitor: the log key compared with `save_best_only`, e.g. ``"val_loss"``.
      verbose: 1 prints a line per save (and per non-improvement with `save_best_only`).
      save_best_only: save only when `monitor` improves on the best so far; without
        format fields, `filepath` then holds the best model of the run.
      save_weights_only: save the weights only, not the optimizer state and step.
      mode: ``"min"``, ``"max"`` or ``"auto"`` (a `Mode` or its value): whether a lower or
        higher `monitor` is better; ``"auto"`` infers it as `EarlyStopping` does.
      save_freq: ``"epoch"`` saves after each epoch; an int N saves after every N training
        steps (at the end of the execution that reaches them).
      initial_value_threshold: with `save_best_only`, the value to beat first.
      max_to_keep: a checkpoint directory's steps kept (keyword-only); 1 (the default)
        keeps the latest, as Keras overwrites one file; None keeps all. A ``.keras`` or
        ``.weights.h5`` path keeps one save per formatted path.

    Raises:
      ValueError: for an invalid argument, or a `filepath` whose ending does not match
        `save_weights_only`; at the start of `fit`, for a ``.keras`` path that holds
        something other than a saved model.

    Example:

    >>> import os, tempfile, numpy as np, optax, flax.linen as nn, jstrategy
    >>> path = os.path.join(tempfile.mkdtemp(), "best.keras")
    >>> model = jstrategy.Model(nn.Dense(1), input_shape=(2,))
    >>> model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
    >>> x, y = np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32)
    >>> cb = ModelCheckpoint(path, monitor="loss", save_best_only=True)
    >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[cb])
    >>> best = jstrategy.models.load_model(path, nn.Dense(1))
    >>> np.allclose(best.get_weights()[0], model.get_weights()[0])
    True
    """

    _owner = "ModelCheckpoint"
    _verb = "keep"

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
        if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
            raise ValueError(
                "`filepath` must be a path ending in '.keras' or '.weights.h5', or a "
                f"checkpoint directory; got {filepath!r}."
            )
        path = os.fspath(filepath)
        self._destination = _destination(path, bool(save_weights_only))
        if self._destination is not Destination.STEPS:
            _check_format(path)
            if max_to_keep != 1:
                raise ValueError(
                    f"`max_to_keep` counts the steps of a checkpoint directory; got "
                    f"max_to_keep={max_to_keep!r} with filepath={path!r}, which each save "
                    "replaces (as Keras overwrites it). Put '{epoch:02d}' in the path to "
                    "keep every epoch's, or leave max_to_keep out."
                )
        super().__init__(monitor, mode)
        if initial_value_threshold is not None:
            check_number(
                initial_value_threshold, "initial_value_threshold", expected="a number or None"
            )
        check_max_to_keep(max_to_keep)
        self.filepath = os.path.abspath(path)
        self.verbose = verbose
        self.save_best_only = bool(save_best_only)
        self.save_weights_only = bool(save_weights_only)
        self.save_freq = _check_save_freq(save_freq)
        self.initial_value_threshold = initial_value_threshold
        self.max_to_keep = max_to_keep
        self.best: float | None = (
            None if initial_value_threshold is None else float(initial_value_threshold)
        )
        self._manager: Any = None
        self._counter = _StepCounter()
        # Whether this fit started at its first epoch (a new run), and whether it saved.
        self._new_run: bool | None = None
        self._saved = False

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
        if self._destination is Destination.MODEL:
            self._check_model_path()
        if self._destination is Destination.STEPS and self._manager is None:
            best_mode = "max" if self.save_best_only and not self.lower_is_better() else "min"
            self._manager = checkpoint_lib.CheckpointManager(
                self.filepath,
                max_to_keep=self.max_to_keep,
                keep_best=self.monitor if self.save_best_only else None,
                best_mode=best_mode,
            )
        self._counter = _StepCounter()
        self._new_run, self._saved = None, False

    def _check_model_path(self) -> None:
        """Refuses, before training, a ``.keras`` path that `Model.save` would not replace."""
        if "{" in self.filepath or not os.path.exists(self.filepath):
            return
        if os.path.isdir(self.filepath) and (
            not os.listdir(self.filepath) or saved_config.is_saved_model(self.filepath)
        ):
            return
        what = "a file"
        if os.path.isdir(self.filepath):
            steps = latest_step_dir(self.filepath) is not None
            what = "numbered checkpoint steps (an older ModelCheckpoint)" if steps else "files"
        raise ValueError(
            f"ModelCheckpoint cannot save the model to {self.filepath}: it holds {what}, not "
            "a model written by model.save, and is not replaced. Remove it (its weights "
            "load with model.load_weights) or pass another path."
        )

    def on_epoch_begin(self, epoch, logs=None):
        if self._new_run is None:  # after every callback's on_train_begin: a resume is known
            fit_state = _fit_state(self.model, "ModelCheckpoint")
            self._new_run = fit_state.epoch == 0 and fit_state.step == 0
        self._counter.epoch_begin(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        self._counter.batch_end(self.model)
        if self._counter.due(self.save_freq):
            epoch = _fit_state(self.model, "ModelCheckpoint").epoch
            self._save(epoch, int(np.asarray(local_copy(self.model.state.step))), logs, batch)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch, epoch + 1, logs, None)

    def _path(self, epoch: int, batch: int | None, logs: dict[str, Any] | None) -> str:
        """Where a ``.keras`` or ``.weights.h5`` save goes: `filepath` formatted as Keras
        does, with ``epoch`` and ``batch`` counted from 1 and the logs."""
        fields = dict(logs or {})
        fields["epoch"] = epoch + 1
        if batch is not None and "batch" not in fields:
            fields["batch"] = batch + 1
        try:
            return self.filepath.format(**fields)
        except (KeyError, IndexError) as e:
            raise KeyError(
                f"ModelCheckpoint cannot format filepath {self.filepath!r}: no {e} in epoch, "
                f"batch or the logs (available: {sorted(fields)}). Use one of those fields."
            ) from None

    def _save(self, epoch: int, step: int, logs: dict[str, Any] | None, batch: int | None) -> None:
        metrics = log_numbers(logs)
        where = f"Epoch {epoch + 1}: "
        if self._destination is Destination.STEPS:
            target = f"{self.filepath}/{step}"
        else:
            target = self._path(epoch, batch, logs)
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
                current < self.best if self.lower_is_better() else current > self.best
            )
            if not better:
                if self.verbose > 0 and is_chief():
                    print(f"\n{where}{self.monitor} did not improve from {self.best}", flush=True)
                return
            if self.verbose > 0 and is_chief():
                print(
                    f"\n{where}{self.monitor} improved from {self.best} to {current}, saving "
                    f"the model to {target}",
                    flush=True,
                )
            self.best = current
        elif self.verbose > 0 and is_chief():
            print(f"\n{where}saving the model to {target}", flush=True)
        if self._destination is Destination.MODEL:
            self.model.save(target, overwrite=True)
        elif self._destination is Destination.WEIGHTS:
            self.model.save_weights(target, overwrite=True)
        else:
            self._save_step(epoch, step, metrics)
        self._saved = True

    def _save_step(self, epoch: int, step: int, metrics: dict[str, float]) -> None:
        """Saves a step of the checkpoint directory, replacing what it replaces: every
        step an earlier run left, at a new run's first save; else the steps from `step`
        on (a resumed run's, or a run that went further, as Keras overwrites a file)."""
        steps = self._manager.all_steps()
        new_run_starts = bool(self._new_run) and not self._saved
        stale = steps if new_run_starts else [s for s in steps if s >= step]
        if stale and self.verbose > 0 and is_chief():
            print(
                f"ModelCheckpoint: replacing the steps {stale} an earlier run left in "
                f"{self.filepath}.",
                flush=True,
            )
        for old in stale:
            self._manager.delete(old)
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
            if is_chief():
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
        if is_chief():
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
        if is_chief():
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
