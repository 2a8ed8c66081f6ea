"""`CheckpointManager`: numbered steps of a training state in one directory."""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import numpy as np

from jstrategy._src.checkpoint.array_format import STATE_ITEM
from jstrategy._src.checkpoint.array_format import as_saveable
from jstrategy._src.checkpoint.array_format import check_metadata
from jstrategy._src.checkpoint.array_format import flatten_state
from jstrategy._src.checkpoint.array_format import is_single_checkpoint
from jstrategy._src.checkpoint.array_format import prepare
from jstrategy._src.checkpoint.array_format import read_record
from jstrategy._src.checkpoint.array_format import save_args
from jstrategy._src.checkpoint.errors import READ_ERRORS
from jstrategy._src.checkpoint.errors import wrap_read_error
from jstrategy._src.checkpoint.errors import write_error
from jstrategy._src.checkpoint.orbax_compat import Trash
from jstrategy._src.checkpoint.orbax_compat import handler_registry
from jstrategy._src.checkpoint.orbax_compat import hold_until_committed
from jstrategy._src.checkpoint.orbax_compat import manager_options
from jstrategy._src.checkpoint.orbax_compat import mark_committed
from jstrategy._src.checkpoint.restore_layout import restore_into
from jstrategy._src.checkpoint.workers import EVERY_WORKER
from jstrategy._src.checkpoint.workers import chief_directory
from jstrategy._src.cluster import coordination
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import check_number
from jstrategy._src.validation import is_int

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = ["BestMode", "CheckpointManager", "check_max_to_keep"]


def check_max_to_keep(max_to_keep: Any) -> None:
    """Refuses a `max_to_keep` that is neither None (keep all) nor a positive int."""
    if max_to_keep is not None:
        check_number(
            max_to_keep,
            "max_to_keep",
            integer=True,
            low=1,
            expected="a positive int or None (keep all)",
        )


class BestMode(enum.Enum):
    """Whether a lower (``MIN``, e.g. a loss) or higher (``MAX``) metric is better."""

    MIN = "min"
    MAX = "max"


def _metrics_dict(metrics: Any, keep_best: str | None) -> dict[str, float] | None:
    if metrics is None:
        if keep_best is not None:
            raise ValueError(
                f"`metrics` must include {keep_best!r} because the manager keeps the best "
                f"checkpoints by it (keep_best={keep_best!r}); got metrics=None. Pass "
                f"metrics={{{keep_best!r}: value}}."
            )
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"`metrics` must be a dict of numbers; got {type(metrics).__name__}.")
    out = {}
    for k, v in metrics.items():
        try:
            out[str(k)] = float(np.asarray(v))
        except (TypeError, ValueError):
            raise TypeError(
                f"`metrics[{k!r}]` must be a number or a scalar array; got {type(v).__name__}."
            ) from None
    if keep_best is not None and keep_best not in out:
        raise ValueError(
            f"`metrics` must include {keep_best!r} because the manager keeps the best "
            f"checkpoints by it (keep_best={keep_best!r}); got keys {sorted(out)}."
        )
    return out


def _rank(value: float, mode: BestMode) -> float:
    """A `keep_best` metric as orbax ranks it: NaN and +-inf rank below every finite value.

    A run whose metric became NaN (or overflowed) must keep its best finite step; sorting
    raw NaNs is undefined, and an infinite loss in "max" mode (or -inf in "min") is a
    diverged run, not a good one.
    """
    value = float(value)
    if math.isfinite(value):
        return value
    return math.inf if mode is BestMode.MIN else -math.inf


# CheckpointManager -------------------------------------------------------------------------------
class CheckpointManager:
    """Numbered checkpoints of a training state in one directory, on orbax's CheckpointManager.

    Saves are asynchronous by default: `save` returns once the state is copied off the
    devices, and the files are written while training goes on (`wait_until_finished` waits
    for them). Each step is written to a temporary directory and renamed when complete, so
    the latest step is always a whole checkpoint, even if the process is killed mid-write.

    A checkpoint saved under any strategy restores under any other: `restore(strategy=...)`
    reads every leaf straight into that strategy's layout (see `_target_sharding`). Each
    restore checks every leaf against a fingerprint saved with it, and a damaged or partial
    checkpoint raises `CheckpointError` naming the directory.

    Args:
      directory: where the step directories (``<directory>/<step>``) go; created if absent.
      max_to_keep: keep at most this many checkpoints (the most recent, or the best with
        `keep_best`); None keeps all.
      keep_best: a metric name; `max_to_keep` then keeps the best checkpoints by it (every
        `save` must pass it in `metrics`), and the latest one as well, so training can
        always resume.
      best_mode: ``"min"`` if a lower `keep_best` metric is better (a loss), ``"max"`` if
        higher is (an accuracy); or a `BestMode`.
      save_interval_steps: `save` writes only steps that are multiples of this (unless
        ``force=True``).
      async_save: write in the background. False makes `save` return after the commit.

    Raises:
      ValueError: for an invalid setting, or if `directory` is a file.
      TypeError: if `directory` is not a path.
      CheckpointError: if orbax cannot list the existing steps.

    Example:

    >>> import tempfile, jax.numpy as jnp, jstrategy
    >>> state = {"w": jnp.ones((2, 3)), "step": 0}
    >>> with jstrategy.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as manager:
    ...     for step in range(1, 4):
    ...         _ = manager.save(step, state, metadata={"epoch": step})
    ...     restored = manager.restore(target=state, strategy=jstrategy.MirroredStrategy())
    ...     print(manager.all_steps(), manager.restore_metadata())
    [2, 3] {'epoch': 3}
    >>> restored["w"].sharding.num_devices, int(restored["step"])
    (8, 0)
    """

    def __init__(
        self,
        directory: os.PathLike | str,
        *,
        max_to_keep: int | None = None,
        keep_best: str | None = None,
        best_mode: BestMode | str = BestMode.MIN,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(
                f"`directory` must be a non-empty path (str or os.PathLike); got {directory!r}."
            )
        directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(
                f"`directory` must be a directory; {directory} is a file. Pass another path."
            )
        check_max_to_keep(max_to_keep)
        if keep_best is not None and (not isinstance(keep_best, str) or not keep_best):
            raise ValueError(f"`keep_best` must be a metric name (str) or None; got {keep_best!r}.")
        try:
            mode = BestMode(best_mode.value if isinstance(best_mode, BestMode) else best_mode)
        except ValueError:
            raise ValueError(
                f"`best_mode` must be 'min' or 'max' (or jstrategy BestMode); got {best_mode!r}."
            ) from None
        check_number(save_interval_steps, "save_interval_steps", integer=True, low=1)
        check_bool(async_save, "async_save", error=TypeError)
        self._meeting: int | None = None
        self._restores = 0
        if coordination.active():
            self._meeting = coordination.next_id()
            directory = chief_directory(
                f"checkpoint-{self._meeting}", directory, f"CheckpointManager({directory!r})"
            )
        self._directory = directory
        self._keep_best = keep_best
        self._best_mode = mode
        self._max_to_keep = max_to_keep
        self._closed = False
        self._trash = Trash(directory)
        try:
            os.makedirs(directory, exist_ok=True)
            self._trash.repair()
        except OSError as e:
            raise write_error(e, directory) from e
        if self._meeting is not None:  # the others list the steps once the chief repaired
            coordination.barrier(
                f"checkpoint-{self._meeting}/repaired",
                what=f"Opening {directory}",
                fix=EVERY_WORKER,
            )
        self._manager = self._open(
            directory, max_to_keep, keep_best, mode, save_interval_steps, async_save
        )

    @staticmethod
    def _open(directory, max_to_keep, keep_best, mode, save_interval_steps, async_save):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as cm

        def metric(metrics):
            return _rank(metrics[keep_best], mode)

        if keep_best is None:
            preservation = cm.LatestN(n=max_to_keep)
        else:
            preservation = cm.AnyPreservationPolicy(
                [
                    cm.BestN(get_metric_fn=metric, reverse=mode is BestMode.MIN, n=max_to_keep),
                    # The latest is kept too: resuming after a crash must not go back.
                    cm.LatestN(n=1),
                ]
            )
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=cm.AnySavePolicy(
                [cm.FixedIntervalPolicy(save_interval_steps), cm.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=preservation,
            best_fn=metric if keep_best is not None else None,
            best_mode=mode.value,
            enable_async_checkpointing=async_save,
            create=True,
            **manager_options(ocp),
        )
        registry = handler_registry(ocp)
        try:
            return ocp.CheckpointManager(directory, options=options, handler_registry=registry)
        except READ_ERRORS as e:
            raise wrap_read_error(e, directory, "the step list") from e

    # Properties --------------------------------------------------------------------------
    @property
    def directory(self) -> str:
        """The absolute path of the checkpoint directory."""
        return self._directory

    def _step_dir(self, step: int) -> str:
        return os.path.join(self._directory, str(step))

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(
                f"This CheckpointManager for {self._directory} is closed. Create a new one."
            )

    # Saving ------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves `state` as checkpoint `step`, in the background unless `async_save=False`.

        Returns once the state's arrays are copied to host memory, so the caller may then
        update or donate them. A previous save still being written is waited for first.

        Args:
          step: the step number (a non-negative int, larger than any saved before).
          state: a pytree of jax.Arrays (any sharding, typed PRNG keys included), NumPy
            arrays and Python numbers: e.g. `jstrategy.training.create_train_state`'s
            state, `Model.state` or a Flax `TrainState` with its optax state. A `PerReplica`
            value from `Strategy.run` whose replicas agree (parameters updated from
            all-reduced gradients: TF's Mirrored) is saved as one copy; one whose replicas
            differ is refused: save ``strategy.reduce("MEAN", state, axis=None)`` instead.
          metrics: numbers saved with the step; required to hold `keep_best` if set.
          metadata: JSON-able values saved with the step (e.g. the epoch and the data
            iterator's position), read back with `restore_metadata`.
          force: save even if `step` is not a multiple of `save_interval_steps`.

        Returns:
          True if a checkpoint was written; False if `step` was skipped by the interval or
          is not after the latest step.

        Raises:
          ValueError: if the step is invalid or already saved, `metrics` lacks `keep_best`,
            or a `PerReplica` leaf's replicas differ.
          TypeError: if `state` holds something that is not an array or number, or
            `metadata` is not JSON-able.
          OSError: if the directory cannot be written (the message names it).
        """
        self._check_open()
        step = check_number(step, "step", integer=True, low=0)
        metrics_ = _metrics_dict(metrics, self._keep_best)
        check_metadata(metadata)
        if not force and not self._manager.should_save(step):
            flatten_state(as_saveable(state), "state")  # the same errors on every step
            return False
        if step in self._manager.all_steps():
            raise ValueError(
                f"Step {step} is already saved in {self._directory}. Save a later step, or "
                "delete that step's directory first."
            )
        if self._meeting is not None:
            # A checkpoint is written by every worker; orbax alone waits 10 min for one.
            coordination.barrier(
                f"checkpoint-{self._meeting}/save-{step}",
                what=f"Saving step {step} in {self._directory}",
                fix=EVERY_WORKER,
            )
        state, flat, key_impls = prepare(state, "state")
        args = save_args(flat, state, metadata, metrics_, key_impls)
        self._trash.empty(background=True)  # the steps deleted by earlier saves
        hold_until_committed(self._manager)
        try:
            return bool(self._manager.save(step, args=args, metrics=metrics_, force=True))
        except OSError as e:
            mark_committed(self._manager)
            raise write_error(e, self._step_dir(step)) from e

    def wait_until_finished(self) -> None:
        """Blocks until every save started so far is written and committed.

        Raises:
          Exception: the error of a background write that failed.
        """
        try:
            self._manager.wait_until_finished()
        except OSError as e:
            raise write_error(e, self._directory) from e
        finally:
            mark_committed(self._manager)

    def delete(self, step: int) -> None:
        """Deletes checkpoint `step` (e.g. one an earlier run left, before saving it again).

        The step is renamed away first (atomic), then its files are removed in the
        background: a process killed meanwhile never leaves a half-deleted step listed.
        Every process of a multi-worker job calls it.

        Raises:
          FileNotFoundError: if there is no such step.

        Example:

        >>> import tempfile, jax.numpy as jnp, jstrategy
        >>> with jstrategy.CheckpointManager(tempfile.mkdtemp()) as manager:
        ...     for step in (1, 2):
        ...         _ = manager.save(step, {"w": jnp.ones(2)})
        ...     manager.delete(2)
        ...     _ = manager.save(2, {"w": jnp.zeros(2)})  # saved again
        ...     print(manager.all_steps())
        [1, 2]
        """
        step = self._resolve_step(step)  # waits for a save of it still being written
        if self._meeting is not None:
            coordination.barrier(
                f"checkpoint-{self._meeting}/delete-{step}",
                what=f"Deleting step {step} in {self._directory}",
                fix=EVERY_WORKER,
            )
        self._manager.delete(step)

    # Steps -------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """The saved steps, ascending (including one whose background write is in flight)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest saved step, or None if there is none."""
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The step with the best `keep_best` metric, or None if there is none.

        Raises:
          ValueError: if the manager was created without `keep_best`.
        """
        if self._keep_best is None:
            raise ValueError(
                "`best_step` needs a metric to compare; create the CheckpointManager with "
                "keep_best='<metric name>' and pass metrics to save()."
            )
        return self._manager.best_step()

    def _resolve_step(self, step: int | None) -> int:
        self._check_open()
        # A step still being written is listed; wait for it rather than read half of it.
        self.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            if not steps:
                if is_single_checkpoint(self._directory):
                    raise FileNotFoundError(
                        f"No numbered steps in {self._directory}: it is one checkpoint itself "
                        "(written by save_weights, or one step of a CheckpointManager). Read "
                        f"it with jstrategy.load_weights({self._directory!r})."
                    )
                raise FileNotFoundError(
                    f"No checkpoint in {self._directory}. Save one first, or check the path."
                )
            return steps[-1]
        if not is_int(step):
            raise TypeError(f"`step` must be an int or None; got {step!r}.")
        if int(step) not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self._directory}; saved steps: {steps}."
            )
        return int(step)

    def _reader(self, step: int):
        import orbax.checkpoint as ocp

        def read(args, *, item=STATE_ITEM, metadata=False):
            if metadata:
                return self._manager.item_metadata(step)[STATE_ITEM]
            return self._manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]

        return read

    # Restoring ---------------------------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        strategy: Strategy | None = None,
    ) -> Any:
        """Restores checkpoint `step` (default: the latest) into a strategy's layout.

        Where each leaf goes:

        * ``strategy`` given: every leaf becomes a jax.Array in that strategy's layout
          (replicated over its mesh for OneDevice/Mirrored).
        * else a `target` leaf with a sharding (a jax.Array, or a `jax.ShapeDtypeStruct`
          with ``sharding=``) keeps it; a NumPy array or Python number stays one; a
          `jax.ShapeDtypeStruct` without sharding goes to the current strategy
          (`jstrategy.get_strategy()`).
        * without `target`, every leaf goes to `strategy` (or the current strategy), in the
          saved structure as nested dicts and lists.

        Args:
          step: the step to restore; None means the latest.
          target: a pytree like the saved state (concrete, or abstract such as
            `jax.eval_shape` output); the result has its structure and dtypes. None
            restores the saved structure.
          strategy: the strategy to place the state in.

        Returns:
          The restored state.

        Raises:
          FileNotFoundError: if there is no such step.
          CheckpointError: if the checkpoint is damaged or incomplete.
          ValueError: if `target` does not match the checkpoint's leaves or shapes.
        """
        step = self._resolve_step(step)
        if self._meeting is not None:
            self._restores += 1
            coordination.barrier(
                f"checkpoint-{self._meeting}/restore-{self._restores}",
                what=f"Restoring step {step} from {self._directory}",
                fix=EVERY_WORKER,
            )
        return restore_into(self._reader(step), self._step_dir(step), target, strategy)

    def restore_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The `metadata` saved with `step` (default: the latest); {} if none was.

        Raises:
          FileNotFoundError: if there is no such step.
          CheckpointError: if the checkpoint is damaged or incomplete.
        """
        step = self._resolve_step(step)
        record = read_record(self._reader(step), self._step_dir(step))
        return dict(record.get("metadata") or {})

    def metrics(self, step: int | None = None) -> dict[str, float] | None:
        """The `metrics` saved with `step` (default: the latest), or None if none were.

        Raises:
          FileNotFoundError: if there is no such step.
          CheckpointError: if the checkpoint is damaged or incomplete.
        """
        step = self._resolve_step(step)
        record = read_record(self._reader(step), self._step_dir(step))
        return record.get("metrics")

    # Lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Waits for pending saves and releases the manager. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.wait_until_finished()
        finally:
            mark_committed(self._manager)
            self._manager.close()
            self._trash.empty(background=False)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self._directory!r}, max_to_keep={self._max_to_keep}, "
            f"keep_best={self._keep_best!r})"
        )
