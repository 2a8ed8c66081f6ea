"""`MirroredStrategy`: replicas on local devices, `ParallelStrategy`'s per-replica preset."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jstrategy._src import devices as devices_lib
from jstrategy._src.axes import REPLICA_AXIS
from jstrategy._src.cross_device_ops import CrossDeviceOps
from jstrategy._src.strategies.parallel import MeshPlan
from jstrategy._src.strategies.parallel import ParallelStrategy
from jstrategy._src.strategy import Strategy

__all__ = ["MirroredStrategy"]


#: Replicas alone, no FSDP axis: the fold places every variable whole.
_PLAN = MeshPlan(order=("replicas",), kept=frozenset({"replicas"}), fsdp=None, rows=(REPLICA_AXIS,))


class MirroredStrategy(ParallelStrategy):
    """One replica per device; parameters replicated; gradients all-reduced each step.

    Args:
      devices: the devices to replicate over (TF-style strings or `jax.Device` objects). None
        means every local device of JAX's default backend.
      cross_device_ops: how values are combined across replicas: `NcclAllReduce`,
        `HierarchicalCopyAllReduce()` or `ReductionToOneDevice()`. None means
        `NcclAllReduce(num_packs=0)`: one all-reduce per tensor, which XLA's combiner packs
        itself without the concatenation copies of explicit packing (which doubled an
        MLP's gradient all-reduce time on 8 CPU devices); `num_packs=k` packs, as TF.

    Raises:
      ValueError: if `devices` is empty, names a device twice, mixes platforms, or names a
        device that does not exist.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(
    ...     devices=["/cpu:0", "/cpu:1"],
    ...     cross_device_ops=jstrategy.HierarchicalCopyAllReduce())
    >>> strategy.num_replicas_in_sync
    2
    """

    def __init__(
        self,
        devices: Sequence[devices_lib.DeviceSpec] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
    ):
        resolved = jax.local_devices() if devices is None else devices_lib.resolve_devices(devices)
        self._build(_PLAN, {"replicas": len(resolved)}, [list(resolved)], cross_device_ops)

    # The manual view (shard_map): `cross_device_ops` combines gradients; no mesh, no rows.
    stage_train_step = Strategy.stage_train_step
    activation_rows = Strategy.activation_rows
    annotation_axis = Strategy.annotation_axis  # whole copies: no name splits anything
    mesh_context = None  # type: ignore[assignment]
    __repr__ = Strategy.__repr__
