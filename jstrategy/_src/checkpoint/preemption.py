"""`PreemptionCheckpointHandler`: a custom loop saved on a preemption notice, and resumed.

On SIGTERM every worker saves at the same step boundary, then exits; how the workers agree
on the boundary is `cluster/signals.py`'s (`PreemptionWatcher`). `jstrategy.callbacks.
BackupAndRestore` applies the same watcher to `Model.fit`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src import context
from jstrategy._src.cluster.join import is_chief
from jstrategy._src.cluster.resolver import ClusterResolver
from jstrategy._src.cluster.signals import PREEMPTION_EXIT_CODE
from jstrategy._src.cluster.signals import PreemptionWatcher
from jstrategy._src.strategy import Strategy
from jstrategy._src.values import keys_as_data
from jstrategy._src.values import keys_like

__all__ = ["PreemptionCheckpointHandler"]


def _say(message: str) -> None:
    if is_chief():
        print(message, flush=True)


def _default_exit() -> None:
    sys.exit(PREEMPTION_EXIT_CODE)


# The handler -------------------------------------------------------------------------------
class PreemptionCheckpointHandler:
    """Saves a custom training loop's state when the job is preempted, and resumes it.

    The JAX counterpart of ``tf.distribute.experimental.PreemptionCheckpointHandler``. From
    its creation it watches for SIGTERM (on any worker). Call `run` (or `watch`) once per
    training step, on every worker: at the first step boundary after a notice that all
    workers agree on (see the module docstring for how they agree), every worker saves the
    state as checkpoint number `total_run_calls` and the process exits through `exit_fn`,
    by default ``sys.exit(PREEMPTION_EXIT_CODE)``, i.e. status 0. Started again with the same
    command, `restore` returns the saved state and `total_run_calls` says how many steps are
    done, so the loop (and its data) can continue where it stopped.

    Every worker takes part in the save and the restore (checkpoints are collective); only
    the chief writes what is written once and prints.

    Args:
      cluster_resolver_or_strategy: the `jstrategy.Strategy` the state lives in (restored
        states are placed as it places variables), or a cluster resolver (as TF's first
        argument; restored leaves then keep the shardings of the `restore` target). None
        means the current strategy (`jstrategy.get_strategy()`).
      checkpoint_manager_or_dir: a `jstrategy.CheckpointManager`, or a directory for one
        (created with `max_to_keep`; the handler closes it in `close`).
      exit_fn: called after the preemption checkpoint is written; None exits with status
        `PREEMPTION_EXIT_CODE` (0). If it returns, training goes on.
      max_to_keep: checkpoints kept when `checkpoint_manager_or_dir` is a directory.

    Raises:
      TypeError: for an argument of the wrong type.
      RuntimeError: with one process, if not created in the main thread (only it can handle
        signals); with several, if JAX's preemption service is off.

    Example:

    >>> import os, tempfile, jax.numpy as jnp, jstrategy
    >>> directory = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> strategy = jstrategy.OneDeviceStrategy("cpu:0")
    >>> def train_step(state):
    ...     return {"w": state["w"] + 1.0}, state["w"].sum()
    >>> with jstrategy.experimental.PreemptionCheckpointHandler(strategy, directory) as handler:
    ...     state = handler.restore({"w": jnp.zeros(2)})
    ...     for _ in range(handler.total_run_calls, 3):
    ...         state, loss = handler.run(train_step, state)
    >>> handler.total_run_calls, state["w"].tolist()
    (3, [3.0, 3.0])
    """

    def __init__(
        self,
        cluster_resolver_or_strategy: Any,
        checkpoint_manager_or_dir: checkpoint_lib.CheckpointManager | os.PathLike | str,
        *,
        exit_fn: Callable[[], Any] | None = None,
        max_to_keep: int | None = 1,
    ):

        first = cluster_resolver_or_strategy
        if first is None:
            first = context.get_strategy()
        if isinstance(first, Strategy):
            self._strategy: Strategy | None = first
        elif isinstance(first, ClusterResolver):
            self._strategy = None
        else:
            raise TypeError(
                "`cluster_resolver_or_strategy` must be a jstrategy.Strategy, a cluster "
                f"resolver or None (the current strategy); got {type(first).__name__}."
            )
        if exit_fn is not None and not callable(exit_fn):
            raise TypeError(f"`exit_fn` must be callable or None; got {exit_fn!r}.")
        manager = checkpoint_manager_or_dir
        if not isinstance(manager, checkpoint_lib.CheckpointManager) and not (
            isinstance(manager, (str, os.PathLike)) and os.fspath(manager)
        ):
            raise TypeError(
                "`checkpoint_manager_or_dir` must be a jstrategy.CheckpointManager or a "
                f"directory path; got {manager!r}. E.g. '/tmp/ckpt'."
            )
        self._exit_fn = exit_fn if exit_fn is not None else _default_exit
        self._total_run_calls = 0
        self._closed = False
        self._watcher = PreemptionWatcher(owner="PreemptionCheckpointHandler")
        self._owns_manager = not isinstance(manager, checkpoint_lib.CheckpointManager)
        if isinstance(manager, checkpoint_lib.CheckpointManager):
            self._manager: checkpoint_lib.CheckpointManager = manager
        else:
            try:
                self._manager = checkpoint_lib.CheckpointManager(manager, max_to_keep=max_to_keep)
            except BaseException:
                self._watcher.close()
                raise

    # Properties ----------------------------------------------------------------------
    @property
    def total_run_calls(self) -> int:
        """Steps done: `run`/`watch` calls made, plus those before the restored checkpoint."""
        return self._total_run_calls

    @property
    def checkpoint_manager(self) -> checkpoint_lib.CheckpointManager:
        """The manager the preemption checkpoints go to."""
        return self._manager

    # Restoring -------------------------------------------------------------------------
    def restore(self, target: Any) -> Any:
        """The latest checkpoint's state, or `target` itself if there is none.

        Also sets `total_run_calls` to the number of steps the checkpoint was saved after.

        Args:
          target: the initial state: the structure, dtypes and (without a strategy) the
            shardings the restored state takes; typed PRNG keys in it are restored as such.

        Returns:
          The restored state, or `target`.

        Raises:
          CheckpointError: if the latest checkpoint is damaged.
          ValueError: if `target` does not match the checkpoint.
        """
        self._check_open()
        step = self._manager.latest_step()
        if step is None:
            self._total_run_calls = 0
            return target
        saved = self._manager.restore(step, target=keys_as_data(target), strategy=self._strategy)
        self._total_run_calls = int(step)
        return keys_like(saved, target)

    def restore_metadata(self) -> dict[str, Any]:
        """The `metadata` saved with the latest checkpoint ({} if there is none)."""
        self._check_open()
        if self._manager.latest_step() is None:
            return {}
        return self._manager.restore_metadata()

    # Training ------------------------------------------------------------------------
    def run(self, step_fn: Callable[..., Any], state: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs one training step, then saves and exits if the job is being preempted.

        Args:
          step_fn: ``step_fn(state, *args, **kwargs)`` returning the new state, or a tuple
            whose first item is the new state (e.g. a jstrategy train step's
            ``(state, logs)``). A state that is itself a plain tuple needs `watch`.
          state: the state before the step.
          *args: more arguments for `step_fn` (e.g. the batch).
          **kwargs: keyword arguments for `step_fn`.

        Returns:
          What `step_fn` returned.
        """
        result = step_fn(state, *args, **kwargs)
        self.watch(result[0] if type(result) is tuple else result)
        return result

    def watch(self, state: Any, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Marks a step boundary (call once per step, on every worker) after `state`'s step.

        Counts the step in `total_run_calls`; if all workers agreed to stop here, saves
        `state` and calls `exit_fn`.

        Args:
          state: the state after the step just run.
          metadata: JSON-able values saved with a preemption checkpoint (e.g. the epoch).
        """
        self._check_open()
        self._total_run_calls += 1
        if not self._watcher.reached_sync_point():
            return
        self.save(state, metadata=metadata)
        self._manager.wait_until_finished()
        _say(
            f"PreemptionCheckpointHandler: preemption notice; saved step "
            f"{self._total_run_calls} in {self._manager.directory}; exiting."
        )
        self._watcher.clear()
        self._exit_fn()

    def save(self, state: Any, *, metadata: Mapping[str, Any] | None = None) -> bool:
        """Saves `state` now as checkpoint `total_run_calls` (every worker must call it).

        Returns:
          False if that step is saved already, else True.
        """
        self._check_open()
        step = self._total_run_calls
        if step in self._manager.all_steps():
            return False
        return self._manager.save(step, keys_as_data(state), metadata=metadata, force=True)

    # Lifetime ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("This PreemptionCheckpointHandler is closed. Create a new one.")

    def close(self) -> None:
        """Stops watching (SIGTERM gets its previous handler) and waits for pending saves."""
        if self._closed:
            return
        self._closed = True
        self._watcher.close()
        if self._owns_manager:
            self._manager.close()
        else:
            self._manager.wait_until_finished()

    def __enter__(self) -> PreemptionCheckpointHandler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PreemptionCheckpointHandler({self._manager.directory!r}, "
            f"total_run_calls={self._total_run_calls})"
        )
