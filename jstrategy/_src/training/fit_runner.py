"""How an epoch of `jstrategy.Model.fit` runs: the fit runners, and where `fit` is.

A `Trainer` owns one `FitRunner`, chosen from its strategy: the default runs each epoch's
compiled programs on the replicas (`FitEpoch.run`: one dispatch per
``steps_per_execution`` steps, asynchronously, bounded by `dispatch.track`, with the
batches on the devices ahead of use); a strategy that trains through a
`ClusterCoordinator` (``Strategy.should_use_with_coordinator``: `ParameterServerStrategy`)
gets `coordinated_fit.CoordinatedFitRunner`, which schedules the steps on its workers. A
runner also says whether `fit` resumes exactly from any step, and what a backup holds
besides the train state.

An epoch passes the train state and its running sums by value: `FitEpoch` holds the state
and sums it starts from, and its run returns the new ones in a `FitEpochResult`; the
trainer holds only what is set once (its programs, its runner). The model's variables
follow each step (`FitTrainer.state`), as Keras's callbacks see them.

`FitState` is where `fit` is (`Model.fit_state`): callbacks read it and save and restore
through it, so that a backup taken at any step resumes exactly.

Nothing here imports the `Trainer`: runners and `FitState` read it through `FitTrainer`,
the part of it they use, so the trainer can own its runner without an import cycle.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any
from typing import Protocol

import jax

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src import dispatch
from jstrategy._src.numerics import means
from jstrategy._src.placement import place_state
from jstrategy._src.strategy import Strategy
from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.training.callbacks.callback_list import CallbackList
from jstrategy._src.training.data_adapters import DataAdapter
from jstrategy._src.training.data_adapters import prefetch
from jstrategy._src.training.programs import Programs
from jstrategy._src.training.step import check_numerics
from jstrategy._src.values import keys_as_data
from jstrategy._src.values import keys_like

__all__ = [
    "FitEpoch",
    "FitEpochResult",
    "FitRunner",
    "FitState",
    "FitTrainer",
    "Resume",
    "implements",
]


class FitTrainer(Protocol):
    """What the fit runners and `FitState` use of a `Trainer` (the model's training side)."""

    strategy: Strategy
    #: The model's train state: what its variables, `get_weights` and callbacks read.
    state: Any
    fit_state: FitState | None
    stop_training: bool
    epochs_run: int
    steps_per_execution: int
    probed: set[str]
    programs: Programs

    @property
    def fit_runner(self) -> FitRunner: ...

    def next_order_seed(self) -> tuple[int, int]: ...

    def weights_tree(self) -> dict[str, Any]: ...


class FitRunner:
    """How the epochs of a model's `fit` run, and what its backups hold besides the state.

    The default: each epoch is `FitEpoch.run`, the compiled steps on the replicas;
    `fit` resumes exactly from any step; a backup is the train state alone. A `Trainer`
    owns one runner for its model's whole life, so a runner may keep state across epochs
    and `fit` calls (`CoordinatedFitRunner` keeps the variables on the parameter servers).
    """

    #: Whether `Model.fit` can stop after any step and resume it exactly
    #: (`jstrategy.callbacks.BackupAndRestore` backs up at any step).
    resumes_exactly: bool = True

    def run_epoch(self, epoch: FitEpoch) -> FitEpochResult | None:
        """Runs one epoch of `fit`.

        Args:
          epoch: what the epoch needs: ``state`` (the train state it starts from),
            ``programs`` (the compiled step's), ``data`` (``train_executions`` cuts it into
            executions), ``callbacks``, ``steps_per_epoch``, and ``run()``, the default
            epoch.

        Returns:
          The new train state, the epoch's sums and logs, or None when the data gave no
          batch.
        """
        return epoch.run()

    def backup_state(self, state: Any) -> Any:
        """What a backup (`BackupAndRestore`, `Model.save`, a checkpoint) of the model holds
        besides its train state `state`: None (the train state is all there is)."""
        del state
        return None

    def restore_backup_state(self, state: Any, saved: Any) -> None:
        """Puts back what `backup_state` saved, after the train state `state` was restored
        (nothing to do by default)."""
        del state, saved


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
      resume: a restored backup's position (`restore_backup`) that this `fit` starts
        from, or None.

    Example:

    >>> import numpy as np, jstrategy
    >>> model = jstrategy.Sequential([jstrategy.layers.Dense(1, input_shape=(3,))])
    >>> model.compile("sgd", loss="mse")
    >>> seen = []
    >>> where = jstrategy.callbacks.LambdaCallback(
    ...     on_train_batch_end=lambda batch, logs: seen.append(
    ...         (model.fit_state.epoch, model.fit_state.step)))
    >>> _ = model.fit(np.ones((8, 3)), np.zeros((8, 1)), batch_size=4, epochs=2, verbose=0,
    ...               callbacks=[where])
    >>> seen
    [(0, 1), (0, 2), (1, 1), (1, 2)]
    """

    trainer: FitTrainer = dataclasses.field(repr=False)
    epoch: int = 0
    step: int = 0
    order_index: int = 0
    position_base: int | None = None
    sums: Any = dataclasses.field(default=None, repr=False)
    resume: Resume | None = dataclasses.field(default=None, repr=False)
    # Whether this fit warned of steps skipped at the loss scale's floor (once per fit).
    loss_scale_warned: bool = dataclasses.field(default=False, repr=False)

    @property
    def resumes_exactly(self) -> bool:
        """Whether this `fit` can stop after any step and resume it exactly
        (`FitRunner.resumes_exactly`)."""
        return self.trainer.fit_runner.resumes_exactly

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
        the fit runner keeps besides (``"strategy_state"``, `FitRunner.backup_state`) and,
        for a backup taken mid-epoch, the epoch's running sums (``"epoch_sums"``)."""
        trainer = self.trainer
        if weights_only:
            return {"weights": trainer.weights_tree()}
        tree: dict[str, Any] = {"train_state": keys_as_data(trainer.state)}
        if epoch_sums:
            tree["epoch_sums"] = (
                self.sums if self.sums is not None else trainer.programs.zero_sums()
            )
        extra = trainer.fit_runner.backup_state(trainer.state)
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
        state = keys_like(restored["train_state"], trainer.state)
        trainer.state = place_state(state, trainer.strategy)
        if "strategy_state" in restored:
            trainer.fit_runner.restore_backup_state(trainer.state, restored["strategy_state"])
        missing = [k for k in _FIT_KEYS if k not in metadata]
        if missing:
            raise checkpoint_lib.CheckpointError(
                f"The backup in {manager.directory} lacks {missing} in its metadata: it was "
                "not written by BackupAndRestore. Pass an empty or BackupAndRestore "
                "directory as backup_dir.",
                path=manager.directory,
            )
        self.resume = Resume(
            epoch=int(metadata["epoch"]),
            step=int(metadata["step"]),
            order_index=int(metadata["order_index"]),
            position=metadata["position"],
            sums=restored["epoch_sums"],
        )
        return metadata


@dataclasses.dataclass(frozen=True)
class FitEpochResult:
    """What an epoch of `fit` ends with: the train state, the epoch's sums and its logs."""

    state: Any
    sums: Any
    logs: dict[str, float]


@dataclasses.dataclass(frozen=True)
class FitEpoch:
    """One epoch of `Model.fit`, as `FitRunner.run_epoch` receives it.

    Attributes:
      trainer: the model's training side, for what is set once: its ``programs``,
        ``steps_per_execution``, ``next_order_seed``; and the model's ``state`` that the
        epoch's steps are published to.
      data: the epoch's data adapter (`train_executions` cuts it into executions).
      callbacks: the callbacks; a runner calls the train-batch hooks.
      steps_per_epoch: `fit`'s ``steps_per_epoch``.
      state: the train state the epoch starts from.
      progress: where `fit` is (`FitState`), which the epoch keeps up to date.
      skip: steps of this epoch done before a resume.
      sums: the running sums a resumed epoch starts from, or None.
    """

    trainer: FitTrainer
    data: DataAdapter
    callbacks: CallbackList
    steps_per_epoch: int | None
    state: Any
    progress: FitState
    skip: int = 0
    sums: Any = None

    @property
    def programs(self) -> Programs:
        """The compiled programs."""
        return self.trainer.programs

    @property
    def stop_requested(self) -> bool:
        """Whether a callback asked training to stop (``model.stop_training``)."""
        return self.trainer.stop_training

    def begin(self, sums: Any = None) -> FitState:
        """Records where the epoch starts in `FitState` (before `next_order_seed`), so a
        backup taken during or after it resumes with the same data; every runner calls it."""
        progress = self.progress
        progress.order_index = self.trainer.epochs_run
        progress.step = self.skip
        data = self.data
        progress.position_base = None if data.limit is None else data.taken - self.skip
        progress.sums = sums
        return progress

    def run(self) -> FitEpochResult | None:
        """The default epoch: the compiled programs on the replicas, asynchronously.

        The state passes from step to step; after each, the model's variables are that
        step's (callbacks see them, as Keras's), and a callback's change to them before a
        step (a learning rate it sets) is what the step trains from. A resumed epoch starts
        after its first `skip` steps, with the running `sums` the interrupted run had
        there, so it ends with the same state and logs. Returns None (and warns) when the
        data gave no batch.
        """
        trainer, cbs, data, skip = self.trainer, self.callbacks, self.data, self.skip
        programs = self.programs
        state = self.state
        acc = programs.zero_sums() if self.sums is None else self.sums
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
            programs.spec, "training step", f" of epoch {progress.epoch}", trainer.probed
        )
        for execution in prefetch(executions):
            if batch_hooks:
                cbs.on_train_batch_begin(step)
                state = trainer.state
            program = programs.train(*execution.key)
            state, acc, logs = program(state, acc, execution.batch, execution.mask)
            # The step donated the state it took: the model's variables are the new ones.
            trainer.state = state
            progress.sums = acc
            dispatch.track(logs)
            watch.add(logs, step, step + execution.steps - 1)
            step += execution.steps
            progress.step = step
            if batch_hooks:
                cbs.on_train_batch_end(step - 1, programs.ordered(logs))
            if self.stop_requested:
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
                skipped, step, progress.epoch, state.loss_scale
            )
        host = programs.ordered(host)
        return FitEpochResult(state, acc, {k: float(v) for k, v in host.items()})


def implements(callbacks: CallbackList, kind: str) -> bool:
    """Whether any callback overrides the ``on_{kind}_begin/end`` hooks (or their aliases)."""
    names = {f"on_{kind}_begin", f"on_{kind}_end"}
    if kind == "train_batch":
        names |= {"on_batch_begin", "on_batch_end"}
    base = Callback
    for cb in callbacks:
        for name in names:
            if name in vars(cb) or getattr(type(cb), name, None) is not getattr(base, name):
                return True
    return False
