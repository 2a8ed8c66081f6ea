"""`FSDPStrategy`: fully sharded data parallelism (ZeRO-3) over one axis of devices, a preset
of `ParallelStrategy` whose replicas are its FSDP axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jstrategy._src import devices as devices_lib
from jstrategy._src.axes import REPLICA_AXIS
from jstrategy._src.collective_util import CommunicationOptions
from jstrategy._src.offload import OffloadPolicy
from jstrategy._src.strategies.parallel import DEFAULT_MIN_SHARD_SIZE
from jstrategy._src.strategies.parallel import MeshPlan
from jstrategy._src.strategies.parallel import ParallelStrategy
from jstrategy._src.strategies.parallel import check_min_shard_size
from jstrategy._src.strategies.sharded import ShardedStrategy
from jstrategy._src.validation import check_number

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver

__all__ = ["FSDPStrategy"]

#: One axis of replicas, each holding its slices (FSDP's axis is the data axis), and
#: beside it a context or an expert axis; the rows split over the replicas alone.
_PLAN = MeshPlan(
    order=("replicas", "context", "experts"),
    kept=frozenset({"replicas"}),
    fsdp=REPLICA_AXIS,
    rows=(REPLICA_AXIS,),
)


class FSDPStrategy(ParallelStrategy):
    """Data parallelism with parameters and optimizer state sharded over the replicas.

    What differs from `MirroredStrategy` is where variables live between steps: every
    variable with at least `min_shard_size` elements is split over the replicas along its
    largest dimension that divides (`shard_dim`); the others are replicated. XLA gathers
    each parameter where it is used and reduce-scatters its gradient back to the slices.
    With ``devices=None`` it joins the job as `MultiWorkerMirroredStrategy` does.

    Args:
      devices: the devices, one replica each; None means every device of every process.
      min_shard_size: the fewest elements a variable must have to be sharded.
      cluster_resolver, communication_options: the job, as for `ParallelStrategy`.
      context: the context-parallel degree k: the mesh is ``("replica", "context")``,
        each replica k neighbouring devices; sequences split as under `ParallelStrategy`.
      offload_optimizer, offload: as `ParallelStrategy`.
      experts: the expert-parallel degree k: the mesh is ``("replica", "expert")``, the
        expert layers' experts split as under `ParallelStrategy`.

    Raises:
      ValueError: if `devices`, `min_shard_size`, `context` or `experts` is invalid (a
        degree must divide the number of devices), or the offloading is.
      TypeError: if `offload` is not an `OffloadPolicy`.
      RuntimeError: if it must start the distributed runtime after JAX's backends started.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import jstrategy
    >>> strategy = jstrategy.experimental.FSDPStrategy(min_shard_size=64)
    >>> strategy.num_replicas_in_sync
    8
    >>> kernel = jax.ShapeDtypeStruct((12, 16), jnp.float32)
    >>> strategy.variable_sharding(kernel, ("params", "Dense_0", "kernel")).spec
    P(None, 'replica')
    >>> bias = jax.ShapeDtypeStruct((16,), jnp.float32)
    >>> strategy.variable_sharding(bias, ("params", "Dense_0", "bias")).spec
    P()
    """

    def __init__(
        self,
        devices: Sequence[devices_lib.DeviceSpec] | None = None,
        *,
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        context: int = 1,
        offload_optimizer: bool = False,
        offload: OffloadPolicy | None = None,
        experts: int = 1,
    ):
        for name, k, what, fix in (
            ("experts", experts, "each expert layer's experts", "for no expert parallelism"),
            ("context", context, "each sequence", "to keep sequences whole"),
        ):
            check_number(
                k,
                name,
                integer=True,
                low=1,
                expected=f"a positive int (how many devices split {what})",
                fix=f"Pass e.g. {name}=2, or 1 (the default) {fix}.",
            )
        if experts > 1 and context > 1:
            raise ValueError(
                f"`experts`={experts} and `context`={context} cannot be combined: an "
                "FSDPStrategy has one axis besides its replicas. Pass one of them."
            )
        check_min_shard_size(min_shard_size)
        cross_device_ops, resolved = self._join_and_resolve(
            devices, cluster_resolver, communication_options
        )
        for name, k, what in (
            ("context", context, "its sequences"),
            ("experts", experts, "the experts"),
        ):
            if len(resolved) % k:
                raise ValueError(
                    f"`{name}` must divide the number of devices, {len(resolved)} (each "
                    f"replica is `{name}` devices splitting {what}); got {name}={k}. Pass a "
                    f"divisor of {len(resolved)}, e.g. {name}="
                    f"{max(d for d in range(1, k) if len(resolved) % d == 0)}."
                )
        degrees = {"replicas": len(resolved) // max(context, experts)}
        degrees |= {"context": context, "experts": experts}
        self._build(
            _PLAN,
            degrees,
            [resolved],
            cross_device_ops,
            min_shard_size=min_shard_size,
            offload=offload,
            offload_optimizer=offload_optimizer,
        )

    def __repr__(self) -> str:
        context, experts = self.context_parallelism, self.expert_parallelism
        extra = f", context={context}" if context > 1 else ""
        extra += f", experts={experts}" if experts > 1 else ""
        text = ShardedStrategy.__repr__(self)
        return f"{text[:-1]}, min_shard_size={self._min_shard_size}{extra})"
