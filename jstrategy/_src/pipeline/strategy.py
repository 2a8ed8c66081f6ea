"""`PipelineStrategy`: a model's repeated layers split over stages, the batch over replicas;
a preset of `ParallelStrategy` with a ``("stage", "replica")`` mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jstrategy._src import devices as devices_lib
from jstrategy._src.axes import REPLICA_AXIS
from jstrategy._src.pipeline.schedules import PipelineConfig
from jstrategy._src.pipeline.schedules import PipelineSchedule
from jstrategy._src.pipeline.schedules import check_pipeline
from jstrategy._src.strategies.parallel import DEFAULT_MIN_SHARD_SIZE
from jstrategy._src.strategies.parallel import MeshPlan
from jstrategy._src.strategies.parallel import ParallelStrategy
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import check_positive_int

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver
    from jstrategy._src.collective_util import CommunicationOptions

__all__ = ["PipelineStrategy"]


class PipelineStrategy(ParallelStrategy):
    """Pipeline parallelism over a ``"stage"`` axis, data parallelism over ``"replica"``.

    The model marks its repeated block with `jstrategy.experimental.Repeated` (NNX:
    `NNXRepeated`), whose layers' variables are stacked: those (and their optimizer
    moments) are split over the stages along the layers dimension; every other variable is
    replicated, or with ``shard_over_replicas=True`` split over the replicas as by
    `FSDPStrategy`. In the train step each replica's rows are cut into microbatches, which
    go through the stages as `schedule` orders them, handed on with ``jax.lax.ppermute``.
    See docs/guides/pipeline-parallelism.md.

    Args:
      devices: the devices (TF-style strings or `jax.Device` objects); None means every
        device of JAX's default backend, of every process of the job. Their number must
        divide by `num_stages`; ``len(devices) / num_stages`` replicas.
      num_stages: the pipeline stages (the size of the ``"stage"`` axis).
      num_microbatches: how many microbatches each replica's rows are cut into; it must
        divide the per-replica batch (``2 * num_stages`` or more keeps the bubble under a
        third).
      schedule: a `PipelineSchedule` or its name: ``"gpipe"`` or ``"1f1b"``.
      num_repeats: the virtual stages each stage holds (1: none); with ``R > 1`` each
        microbatch goes round the stages `R` times (circular GPipe, interleaved 1F1B),
        `num_microbatches` a multiple of `num_stages` and the layers of ``R * num_stages``.
      shard_over_replicas: also split variables over the replicas (ZeRO-3, as FSDP).
      min_shard_size: with `shard_over_replicas`, the fewest elements a variable needs to
        be split over the replicas.
      cluster_resolver, communication_options: the job, as for `ParallelStrategy`.

    Raises:
      ValueError: if a setting is invalid (`check_pipeline`), or the devices do not
        divide by `num_stages`.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import jstrategy
    >>> strategy = jstrategy.experimental.PipelineStrategy(num_stages=4, num_microbatches=8)
    >>> strategy.num_replicas_in_sync, dict(strategy.mesh.shape)
    (2, {'stage': 4, 'replica': 2})
    >>> stacked = jax.ShapeDtypeStruct((8, 16, 16), jnp.float32)
    >>> path = ("params", "Repeated_0", "stacked_layers", "Dense_0", "kernel")
    >>> strategy.variable_sharding(stacked, path).spec
    P('stage', None, None)
    >>> PipelineStrategy = jstrategy.experimental.PipelineStrategy
    >>> circular = PipelineStrategy(num_stages=4, num_microbatches=8, num_repeats=2)
    >>> circular
    PipelineStrategy(num_stages=4, num_replicas_in_sync=2, num_microbatches=8, schedule='gpipe', num_repeats=2)
    >>> circular.variable_sharding(stacked, path).spec  # layer order, as without repeats
    P('stage', None, None)
    """

    def __init__(
        self,
        devices: Sequence[devices_lib.DeviceSpec] | None = None,
        *,
        num_stages: int,
        num_microbatches: int,
        schedule: PipelineSchedule | str = PipelineSchedule.GPIPE,
        num_repeats: int = 1,
        shard_over_replicas: bool = False,
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
    ):
        stages, micro, schedule, repeats = check_pipeline(
            num_stages, num_microbatches, schedule, num_repeats
        )
        check_bool(shard_over_replicas, "shard_over_replicas", error=TypeError)
        min_shard_size = (
            check_positive_int(min_shard_size, "min_shard_size") if min_shard_size else 0
        )
        cross_device_ops, resolved = self._join_and_resolve(
            devices, cluster_resolver, communication_options
        )
        if len(resolved) % stages:
            raise ValueError(
                f"`num_stages`={stages} must divide the number of devices, {len(resolved)}: "
                "each stage is a group of replicas. Pick num_stages among its divisors, or "
                "pass devices= with a multiple of num_stages devices."
            )
        self._build(
            MeshPlan(  # ("stage", "replica"); FSDP's split over the replicas where asked
                order=("stages", "replicas"),
                kept=frozenset({"stages", "replicas"}),
                fsdp=REPLICA_AXIS if shard_over_replicas else None,
                rows=(REPLICA_AXIS,),
            ),
            {"stages": stages, "replicas": len(resolved) // stages},
            [resolved],
            cross_device_ops,
            pipeline=(stages, micro, schedule, repeats),
            min_shard_size=min_shard_size,
        )

    @property
    def pipeline(self) -> PipelineConfig:
        """The pipeline the train step runs a `Repeated` block on."""
        assert self._pipeline is not None
        return self._pipeline

    @property
    def num_stages(self) -> int:
        """The pipeline stages."""
        return self.pipeline.num_stages

    @property
    def num_microbatches(self) -> int:
        """The microbatches each replica's rows are cut into."""
        return self.pipeline.num_microbatches

    @property
    def num_repeats(self) -> int:
        """The virtual stages each stage holds (1: none; see `num_repeats` above)."""
        return self.pipeline.num_repeats

    @property
    def schedule(self) -> PipelineSchedule:
        """The pipeline schedule."""
        return self.pipeline.schedule

    def __repr__(self) -> str:
        return (
            f"PipelineStrategy(num_stages={self.num_stages}, num_replicas_in_sync="
            f"{self.num_replicas_in_sync}, num_microbatches={self.num_microbatches}, "
            f"schedule={self.schedule.value!r}"
            + (f", num_repeats={self.num_repeats})" if self.num_repeats > 1 else ")")
        )
