"""The loops behind `jstrategy.Model`: epochs, progress, callbacks, resume; evaluate; predict.

The loops run on a `Trainer` (`trainer.py`), the training side of a model, and read their
compiled programs from its `Programs`. `fit` runs epochs; each epoch is a value handed to
the trainer's fit runner (`FitRunner.run_epoch`, `fit_runner.py`): a `FitEpoch` with the
train state and running sums it starts from, answered by a `FitEpochResult` with the new
ones. The running loss and metric sums stay on the devices; the host reads them when a
progress bar draws (throttled) and once at the end of the epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jstrategy._src import dispatch
from jstrategy._src.training.callbacks.base import History
from jstrategy._src.training.callbacks.callback_list import CallbackList
from jstrategy._src.training.data_adapters import DataAdapter
from jstrategy._src.training.data_adapters import prefetch
from jstrategy._src.training.fit_runner import FitEpoch
from jstrategy._src.training.fit_runner import FitState
from jstrategy._src.training.fit_runner import implements
from jstrategy._src.training.step import check_numerics
from jstrategy._src.training.trainer import Trainer

__all__ = [
    "evaluate",
    "fit",
    "predict",
]


def fit(
    trainer: Trainer,
    data: DataAdapter,
    val_data: DataAdapter | None,
    cbs: CallbackList,
    *,
    epochs: int,
    initial_epoch: int,
    steps_per_epoch: int | None,
    validate: Callable[[int], bool] = lambda epoch: True,
) -> History:
    """`Model.fit`'s loop over epochs, after its arguments were checked and adapted.

    `validate(epoch)` says whether `val_data` is evaluated after that epoch (Keras's
    ``validation_freq``).

    Each epoch runs through the trainer's `FitRunner.run_epoch`; validation follows it. A backup
    restored by `BackupAndRestore.on_train_begin` makes it start at the backup's step, with
    the shuffling order and dataset position the interrupted run had there.
    """
    trainer.stop_training = False
    trainer.fit_state = progress = FitState(trainer)
    logs: dict[str, Any] = {}
    try:
        cbs.on_train_begin()
        resume = progress.resume
        start, skip, sums = initial_epoch, 0, None
        if resume is not None:
            start, skip, sums = resume.epoch, resume.step, resume.sums
            trainer.epochs_run = resume.order_index
            if data.limit is not None:
                data.seek(int(resume.position or 0))
        for epoch in range(start, epochs):
            progress.epoch = epoch
            progress.step = skip
            cbs.on_epoch_begin(epoch)
            # The model's state as the epoch begins (a callback may have set it).
            run = FitEpoch(
                trainer,
                data,
                cbs,
                steps_per_epoch,
                state=trainer.state,
                progress=progress,
                skip=skip,
                sums=sums,
            )
            result = trainer.fit_runner.run_epoch(run)
            skip, sums = 0, None
            if result is None:  # the data ran out
                trainer.stop_training = True
                break
            trainer.state = result.state
            logs = dict(result.logs)
            if data.exhausted:
                trainer.stop_training = True
            if val_data is not None and validate(epoch):
                val_logs = evaluate(trainer, val_data, cbs)
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
            cbs.on_epoch_end(epoch, logs)
            if trainer.stop_training:
                break
    except BaseException:
        # on_train_end is not called (so backups stay), but callbacks holding resources
        # (BackupAndRestore's SIGTERM handler) release them.
        cbs.on_train_abort()
        trainer.fit_state = None
        raise
    if epochs > 0:  # Keras's condition for finalize_variable_values
        trainer.finalize_variables()
    cbs.on_train_end(logs)
    trainer.fit_state = None
    assert cbs.history is not None
    return cbs.history


def evaluate(trainer: Trainer, data: DataAdapter, cbs: CallbackList) -> dict[str, float]:
    """The loss and metrics over `data` (every real row once), with the test hooks."""
    programs = trainer.programs
    program = programs.eval
    acc = programs.zero_sums()
    logs: dict[str, Any] = {}
    cbs.on_test_begin()
    batch_hooks = implements(cbs, "test_batch")
    watch = check_numerics.Watch(programs.spec, "evaluation batch", probed=trainer.probed)
    for i, (batch, mask, _) in enumerate(prefetch(data.batches())):
        if batch_hooks:
            cbs.on_test_batch_begin(i)
        acc, logs = program(trainer.state, acc, batch, mask)
        dispatch.track(logs)
        watch.add(logs, i)
        if batch_hooks:
            cbs.on_test_batch_end(i, programs.ordered(logs))
    if not logs:
        raise ValueError(
            f"`{getattr(data, 'arg', 'x')}` gave no batches to evaluate (an empty dataset, "
            "or a one-shot iterator already used up). Pass a dataset that can be iterated "
            "again, e.g. a list of batches."
        )
    watch.finish()
    result = {k: float(v) for k, v in programs.ordered(jax.device_get(logs)).items()}
    cbs.on_test_end(dict(result))
    return result


def predict(trainer: Trainer, data: DataAdapter, cbs: CallbackList) -> Any:
    """The model's outputs for every real row of `data`, as NumPy arrays, in order."""
    program = trainer.programs.predict
    cbs.on_predict_begin()
    outputs: list[tuple[Any, Any, int | None]] = []
    for i, (batch, mask, rows) in enumerate(prefetch(data.batches())):
        cbs.on_predict_batch_begin(i)
        y_pred = program(trainer.state, batch[0])
        dispatch.track(y_pred)
        for leaf in jax.tree.leaves(y_pred):
            leaf.copy_to_host_async()
        if rows is None:
            mask.copy_to_host_async()
        outputs.append((y_pred, mask, rows))
        cbs.on_predict_batch_end(i, {"outputs": y_pred})
    cbs.on_predict_end()
    if not outputs:
        raise ValueError("`x` gave no batches to predict.")
    pieces = []
    for y_pred, mask, rows in outputs:
        keep = slice(0, rows) if rows is not None else np.asarray(mask)
        pieces.append(jax.tree.map(lambda a, keep=keep: np.asarray(a)[keep], y_pred))
    return jax.tree.map(lambda *parts: np.concatenate(parts), *pieces)
