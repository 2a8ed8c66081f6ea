"""How a distributed dataset is asked for: `InputOptions`, `InputReplicationMode`, and the
`InputContext` each of `distribute_datasets_from_function`'s pipelines is built with.

They are TF's (`tf.distribute.InputOptions`, `InputReplicationMode`, `InputContext`),
checked when they are made.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from jstrategy._src.numerics import round_up
from jstrategy._src.validation import check_number
from jstrategy._src.validation import short_repr

__all__ = ["InputContext", "InputOptions", "InputReplicationMode", "resolve_options"]


class InputReplicationMode(enum.Enum):
    """How many input pipelines `distribute_datasets_from_function` builds, as in TF.

    * ``PER_WORKER``: one pipeline per process; each element is the process's share of the
      global batch (``global_batch_size // num_input_pipelines`` rows).
    * ``PER_REPLICA``: one pipeline per replica; each element is one replica's batch
      (``InputContext.get_per_replica_batch_size(global_batch_size)`` rows).

    Example:

    >>> import jstrategy
    >>> jstrategy.InputReplicationMode("PER_WORKER") is jstrategy.InputReplicationMode.PER_WORKER
    True
    >>> options = jstrategy.InputOptions(
    ...     experimental_replication_mode=jstrategy.InputReplicationMode.PER_REPLICA)
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputOptions:
    """How a distributed dataset moves batches to the devices, as `tf.distribute.InputOptions`.

    Args:
      experimental_fetch_to_device: put each batch on the replicas' devices (True, the
        default) or keep it on the host. Host elements are pytrees of split `PerReplica`
        values whose `value` and `mask` are NumPy arrays, padded like device elements;
        `Strategy.run` accepts them and transfers them when it runs the step (without
        overlap), so use this for batches that a step reads on the host, or that you
        place yourself.
      experimental_per_replica_buffer_size: how many batches are put on the devices ahead of
        the one being consumed; 0 turns prefetching off. JAX transfers asynchronously, so
        batches put ahead move while the current step runs.
      experimental_replication_mode: `InputReplicationMode.PER_WORKER` (the default) or
        `PER_REPLICA`; only `distribute_datasets_from_function` supports `PER_REPLICA`.
      experimental_place_dataset_on_device: with `PER_REPLICA` and
        ``experimental_fetch_to_device=False``, put each replica's batch on its device as
        soon as it is produced, with no prefetch buffer (JAX has no device-resident input
        pipelines, so this is the closest equivalent of TF's option).

    Raises:
      TypeError: if an option has the wrong type.
      ValueError: if an option is out of range or the combination is invalid.

    Example:

    >>> options = InputOptions(experimental_per_replica_buffer_size=2)
    >>> options.experimental_replication_mode
    <InputReplicationMode.PER_WORKER: 'PER_WORKER'>
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False

    def __post_init__(self) -> None:
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"`{name}` must be a bool; got {type(value).__name__} {value!r}.")
        size = check_number(
            self.experimental_per_replica_buffer_size,
            "experimental_per_replica_buffer_size",
            integer=True,
            low=0,
            expected="an int >= 0",
            fix="Pass 0 to turn prefetching off, or 1 or 2 to overlap transfers with steps.",
        )
        mode = self.experimental_replication_mode
        if isinstance(mode, str) and mode.upper() in InputReplicationMode.__members__:
            mode = InputReplicationMode[mode.upper()]
        if not isinstance(mode, InputReplicationMode):
            raise ValueError(
                f"`experimental_replication_mode` must be a jstrategy.InputReplicationMode; "
                f"got {mode!r}. Pass InputReplicationMode.PER_WORKER or PER_REPLICA."
            )
        object.__setattr__(self, "experimental_replication_mode", mode)
        object.__setattr__(self, "experimental_per_replica_buffer_size", int(size))
        if self.experimental_place_dataset_on_device:
            if mode is not InputReplicationMode.PER_REPLICA:
                raise ValueError(
                    "`experimental_place_dataset_on_device=True` requires "
                    "experimental_replication_mode=InputReplicationMode.PER_REPLICA; got "
                    f"{mode}. Set the replication mode to PER_REPLICA, or leave "
                    "experimental_place_dataset_on_device=False."
                )
            if self.experimental_fetch_to_device:
                raise ValueError(
                    "`experimental_place_dataset_on_device=True` and "
                    "`experimental_fetch_to_device=True` cannot both be set (as in TF); "
                    "pass experimental_fetch_to_device=False with it."
                )


class InputContext:
    """What `dataset_fn` of `distribute_datasets_from_function` learns about its pipeline.

    Args:
      num_input_pipelines: how many input pipelines there are (one per process, or one per
        replica in `InputReplicationMode.PER_REPLICA`).
      input_pipeline_id: this pipeline's index, 0 to `num_input_pipelines - 1` (the process
        index for one pipeline per process).
      num_replicas_in_sync: how many replicas take part in each step.

    Raises:
      ValueError: if a count is not a positive int or the id is out of range.

    Example:

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    >>> ctx.get_per_replica_batch_size(64)
    8
    """

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ):
        for name, value in (
            ("num_input_pipelines", num_input_pipelines),
            ("num_replicas_in_sync", num_replicas_in_sync),
        ):
            check_number(value, name, integer=True, low=1)
        check_number(
            input_pipeline_id,
            "input_pipeline_id",
            integer=True,
            low=0,
            high=num_input_pipelines,
            high_open=True,
            expected=f"an int in [0, {num_input_pipelines}) "
            f"(num_input_pipelines={num_input_pipelines})",
        )
        self._num_input_pipelines = int(num_input_pipelines)
        self._input_pipeline_id = int(input_pipeline_id)
        self._num_replicas_in_sync = int(num_replicas_in_sync)

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines there are."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index; use it to shard files or examples between pipelines."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The rows each replica gets of a global batch of `global_batch_size` rows.

        Args:
          global_batch_size: the rows of one global batch, across all replicas.

        Returns:
          ``global_batch_size // num_replicas_in_sync``.

        Raises:
          ValueError: if `global_batch_size` does not divide by `num_replicas_in_sync`.
        """
        n = self._num_replicas_in_sync
        check_number(global_batch_size, "global_batch_size", integer=True, low=1)
        if global_batch_size % n:
            raise ValueError(
                f"`global_batch_size` must be divisible by num_replicas_in_sync={n}; got "
                f"{global_batch_size}. Use {round_up(global_batch_size, n)} or "
                f"{max(n, global_batch_size // n * n)}."
            )
        return int(global_batch_size) // n

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


def resolve_options(options: InputOptions | None) -> InputOptions:
    """The options in force: `options`, or the defaults for None; anything else raises."""
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"`options` must be a jstrategy.InputOptions or None; got "
            f"{type(options).__name__} {short_repr(options)}."
        )
    return options
