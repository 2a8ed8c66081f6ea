"""The loops behind `jstrategy.Model`: epochs, progress, callbacks, resume; evaluate; predict.

The loops run on a `Trainer` (`trainer.py`), the training side of a model. `fit` runs
epochs; each epoch is handed to the strategy (`Strategy.run_fit_epoch`) as a
`FitEpoch`, whose `run` is the default: the compiled programs over the epoch's executions,
dispatched asynchronously (bounded by `dispatch.track`) with their batches on the devices
ahead of use. The running loss and metric sums stay on the devices; the host reads them
when a progress bar draws (throttled) and once at the end of the epoch.

`FitState` is where `fit` is (`Model.fit_state`): callbacks read it and save and restore
through it, so that a backup taken at any step resumes exactly.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src import dispatch
from jstrategy._src import fault_tolerance
from jstrategy._src.numerics import means
from jstrategy._src.placement import place_state
from jstrategy._src.training import callbacks as callbacks_lib
from jstrategy._src.training import check_numerics
from jstrategy._src.training import step as step_lib
from jstrategy._src.training.data_adapters import DataAdapter
from jstrategy._src.training.data_adapters import prefetch
from jstrategy._src.training.trainer import Trainer

if TYPE_CHECKING:
    pass

__all__ = [
    "FitEpoch",
    "FitEpochResult",
    "FitState",
    "Resume",
    "evaluate",
    "fit",
    "predict",
]

_FIT_KEYS = ("epoch", "step", "order_index", "position")


@dataclasses.dataclass
class Resume:
    """A restored position that the next `fit` starts from (set by `BackupAndRestore`)."""

    epoch: int
    step: int
    order_index: int
    position: int | None
    sums: Any


@dataclasses.dataclass(eq=False)
class FitState:
    """Where `Model.fit` is, and what a callback may save and restore: ``model.fit_state``.

    Enough to start a new process at the same step with the same data.

    Attributes:
      epoch: the epoch being trained (as `fit` numbers them).
      step: the steps done in it.
      order_index: the model's epoch counter that seeded this epoch's shuffling order.
      position_base: for a dataset read through one persistent iterator
        (``steps_per_epoch``), the elements drawn from it before this epoch; else None.
      sums: the epoch's running loss and metric sums (on the devices), or None.
      owner: the `jstrategy.Model` being trained (what a strategy keys its own fit state
        by, see `Strategy.fit_backup_state`).
    """

    trainer: Trainer = dataclasses.field(repr=False)
    epoch: int = 0
    step: int = 0
    order_index: int = 0
    position_base: int | None = None
    sums: Any = dataclasses.field(default=None, repr=False)
    owner: Any = dataclasses.field(default=None, repr=False)
    # Whether this fit warned of steps skipped at the loss scale's floor (once per fit).
    loss_scale_warned: bool = dataclasses.field(default=False, repr=False)

    def metadata(self, *, epoch_end: bool) -> dict[str, Any]:
        """The JSON-able position saved with a backup: at this step, or after the epoch."""
        position = None if self.position_base is None else self.position_base + self.step
        if epoch_end:
            return {
                "epoch": self.epoch + 1,
                "step": 0,
                "order_index": self.order_index + 1,
                "position": position,
            }
        return {
            "epoch": self.epoch,
            "step": self.step,
            "order_index": self.order_index,
            "position": position,
        }

    def checkpoint_tree(self, *, weights_only: bool = False, epoch_sums: bool = False) -> Any:
        """What a callback saves: ``{"weights": ...}``, or ``{"train_state": ...}`` with what
        the strategy keeps besides (``"strategy_state"``, `Strategy.fit_backup_state`) and,
        for a backup taken mid-epoch, the epoch's running sums (``"epoch_sums"``)."""
        trainer = self.trainer
        if weights_only:
            return {"weights": trainer.weights_tree()}
        tree: dict[str, Any] = {"train_state": fault_tolerance.to_savable(trainer.state)}
        if epoch_sums:
            tree["epoch_sums"] = self.sums if self.sums is not None else trainer.zero_sums()
        extra = trainer.strategy.fit_backup_state(self.owner, trainer.state)
        if extra is not None:
            tree["strategy_state"] = extra
        return tree

    def restore_backup(self, manager: checkpoint_lib.CheckpointManager) -> dict[str, Any]:
        """Restores a backup (state and epoch sums); `fit` then resumes at its step.

        Returns:
          The backup's metadata.

        Raises:
          CheckpointError: if the backup was not written by `BackupAndRestore`.
        """
        trainer = self.trainer
        target = self.checkpoint_tree(epoch_sums=True)
        # The target holds the train state as the strategy places it, and every leaf is
        # restored there (strategy=None: a ParameterServerStrategy would create variables
        # on its parameter servers, where a Model keeps none).
        restored = manager.restore(target=target)
        metadata = manager.restore_metadata()
        state = fault_tolerance.from_savable(restored["train_state"], trainer.state)
        trainer.state = place_state(state, trainer.strategy)
        if "strategy_state" in restored:
            trainer.strategy.restore_fit_backup_state(
                self.owner, trainer.state, restored["strategy_state"]
            )
        missing = [k for k in _FIT_KEYS if k not in metadata]
        if missing:
            raise checkpoint_lib.CheckpointError(
                f"The backup in {manager.directory} lacks {missing} in its metadata: it was "
                "not written by BackupAndRestore. Pass an empty or BackupAndRestore "
                "directory as backup_dir.",
                path=manager.directory,
            )
        trainer.resume = Resume(
            epoch=int(metadata["epoch"]),
            step=int(metadata["step"]),
            order_index=int(metadata["order_index"]),
            position=metadata["position"],
            sums=restored["epoch_sums"],
        )
        return metadata


@dataclasses.dataclass
class FitEpochResult:
    """What an epoch of `fit` ends with: the train state and the epoch's logs."""

    state: Any
    logs: dict[str, float]


@dataclasses.dataclass
class FitEpoch:
    """One epoch of `Model.fit`, as `Strategy.run_fit_epoch` receives it.

    Attributes:
      trainer: the model's training side; `state`, `spec` and `next_order_seed` are what
        a runner needs of it.
      owner: the `jstrategy.Model` being trained (a key for state a runner keeps across
        epochs; not to be modified).
      data: the epoch's data adapter (`train_executions` cuts it into executions).
      callbacks: the callbacks; a runner calls the train-batch hooks.
      steps_per_epoch: `fit`'s ``steps_per_epoch``.
      skip: steps of this epoch done before a resume.
      sums: the running sums a resumed epoch starts from, or None.
    """

    trainer: Trainer
    owner: Any
    data: DataAdapter
    callbacks: callbacks_lib.CallbackList
    steps_per_epoch: int | None
    skip: int = 0
    sums: Any = None

    @property
    def state(self) -> Any:
        """The train state at the start of the epoch."""
        return self.trainer.state

    @property
    def spec(self) -> step_lib.StepSpec:
        """The compiled step."""
        return self.trainer.compiled_spec

    @property
    def stop_requested(self) -> bool:
        """Whether a callback asked training to stop (``model.stop_training``)."""
        return self.trainer.stop_training

    def begin(self, sums: Any = None) -> FitState:
        """Records where the epoch starts in `FitState` (before `next_order_seed`), so a
        backup taken during or after it resumes with the same data; every runner calls it."""
        trainer = self.trainer
        progress = trainer.fit_state or FitState(trainer, owner=self.owner)
        progress.order_index = trainer.epochs_run
        progress.step = self.skip
        data = self.data
        progress.position_base = None if data.limit is None else data.taken - self.skip
        progress.sums = sums
        return progress

    def run(self) -> FitEpochResult | None:
        """The default epoch: the compiled programs on the replicas, asynchronously.

        A resumed epoch starts after its first `skip` steps, with the running `sums` the
        interrupted run had there, so it ends with the same state and logs. Returns None
        (and warns) when the data gave no batch.
        """
        trainer, cbs, data, skip = self.trainer, self.callbacks, self.data, self.skip
        acc = trainer.zero_sums() if self.sums is None else self.sums
        logs: dict[str, Any] = {}
        progress = self.begin(acc)
        epoch_seed = trainer.next_order_seed()
        step = skip
        executions = data.train_executions(
            epoch_seed, trainer.steps_per_execution, self.steps_per_epoch, skip=skip
        )
        # As Keras, skip the per-batch hooks when no callback implements them.
        batch_hooks = implements(cbs, "train_batch")
        watch = check_numerics.Watch(
            self.spec, "training step", f" of epoch {progress.epoch}", trainer.probed
        )
        for execution in prefetch(executions):
            if batch_hooks:
                cbs.on_train_batch_begin(step)
            program = trainer.program(("train", *execution.key))
            trainer.state, acc, logs = program(trainer.state, acc, execution.batch, execution.mask)
            progress.sums = acc
            dispatch.track(logs)
            watch.add(logs, step, step + execution.steps - 1)
            step += execution.steps
            progress.step = step
            if batch_hooks:
                cbs.on_train_batch_end(step - 1, trainer.ordered(logs))
            if trainer.stop_training:
                break
        if not step:
            warnings.warn(
                "The training data ran out: this epoch got no batches, so training stops. "
                "Pass a dataset that can be iterated again (e.g. a list or a "
                "DistributedDataset over one), or fewer epochs * steps_per_epoch batches.",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        if not logs:  # resumed after the epoch's last step: its sums are all there is
            logs = means(acc)
        watch.finish()
        # The one host synchronization of the epoch.
        host, skipped = jax.device_get((logs, acc.get(check_numerics.FLOOR)))
        if not progress.loss_scale_warned:
            progress.loss_scale_warned = check_numerics.warn_loss_scale_floor(
                skipped, step, progress.epoch, trainer.state.loss_scale
            )
        host = trainer.ordered(host)
        return FitEpochResult(trainer.state, {k: float(v) for k, v in host.items()})


def implements(callbacks: callbacks_lib.CallbackList, kind: str) -> bool:
    """Whether any callback overrides the ``on_{kind}_begin/end`` hooks (or their aliases)."""
    names = {f"on_{kind}_begin", f"on_{kind}_end"}
    if kind == "train_batch":
        names |= {"on_batch_begin", "on_batch_end"}
    base = callbacks_lib.Callback
    for cb in callbacks:
        for name in names:
            if name in vars(cb) or getattr(type(cb), name, None) is not getattr(base, name):
                return True
    return False


def fit(
    trainer: Trainer,
    owner: Any,
    data: DataAdapter,
    val_data: DataAdapter | None,
    cbs: callbacks_lib.CallbackList,
    *,
    epochs: int,
    initial_epoch: int,
    steps_per_epoch: int | None,
    validate: Callable[[int], bool] = lambda epoch: True,
) -> callbacks_lib.History:
    """`Model.fit`'s loop over epochs, after its arguments were checked and adapted.

    `validate(epoch)` says whether `val_data` is evaluated after that epoch (Keras's
    ``validation_freq``).

    Each epoch runs through `Strategy.run_fit_epoch`; validation follows it. A backup
    restored by `BackupAndRestore.on_train_begin` makes it start at the backup's step, with
    the shuffling order and dataset position the interrupted run had there.
    """
    trainer.stop_training = False
    trainer.fit_state = fit_state = FitState(trainer, owner=owner)
    logs: dict[str, Any] = {}
    try:
        cbs.on_train_begin()
        resume, trainer.resume = trainer.resume, None
        start, skip, sums = initial_epoch, 0, None
        if resume is not None:
            start, skip, sums = resume.epoch, resume.step, resume.sums
            trainer.epochs_run = resume.order_index
            if data.limit is not None:
                data.seek(int(resume.position or 0))
        for epoch in range(start, epochs):
            fit_state.epoch = epoch
            fit_state.step = skip
            cbs.on_epoch_begin(epoch)
            run = FitEpoch(trainer, owner, data, cbs, steps_per_epoch, skip=skip, sums=sums)
            result = trainer.strategy.run_fit_epoch(run)
            skip, sums = 0, None
            if result is None:  # the data ran out
                trainer.stop_training = True
                break
            trainer.state = result.state
            logs = result.logs
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


def evaluate(
    trainer: Trainer, data: DataAdapter, cbs: callbacks_lib.CallbackList
) -> dict[str, float]:
    """The loss and metrics over `data` (every real row once), with the test hooks."""
    program = trainer.program(("eval",))
    acc = trainer.zero_sums()
    logs: dict[str, Any] = {}
    cbs.on_test_begin()
    batch_hooks = implements(cbs, "test_batch")
    watch = check_numerics.Watch(trainer.compiled_spec, "evaluation batch", probed=trainer.probed)
    for i, (batch, mask, _) in enumerate(prefetch(data.batches())):
        if batch_hooks:
            cbs.on_test_batch_begin(i)
        acc, logs = program(trainer.state, acc, batch, mask)
        dispatch.track(logs)
        watch.add(logs, i)
        if batch_hooks:
            cbs.on_test_batch_end(i, trainer.ordered(logs))
    if not logs:
        raise ValueError(
            f"`{getattr(data, 'arg', 'x')}` gave no batches to evaluate (an empty dataset, "
            "or a one-shot iterator already used up). Pass a dataset that can be iterated "
            "again, e.g. a list of batches."
        )
    watch.finish()
    result = {k: float(v) for k, v in trainer.ordered(jax.device_get(logs)).items()}
    cbs.on_test_end(dict(result))
    return result


def predict(trainer: Trainer, data: DataAdapter, cbs: callbacks_lib.CallbackList) -> Any:
    """The model's outputs for every real row of `data`, as NumPy arrays, in order."""
    program = trainer.program(("predict",))
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
