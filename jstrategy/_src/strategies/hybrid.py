"""`HybridStrategy`: model replicas x FSDP shards x tensor shards (HSDP x TP), a preset of
`ParallelStrategy` with no expert or context axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jstrategy._src import devices as devices_lib
from jstrategy._src.activation_rows import TensorActivations
from jstrategy._src.collective_util import CommunicationOptions
from jstrategy._src.layout_map import LayoutMap
from jstrategy._src.offload import OffloadPolicy
from jstrategy._src.strategies.parallel import DEFAULT_MIN_SHARD_SIZE
from jstrategy._src.strategies.parallel import ParallelStrategy

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver

__all__ = ["HybridStrategy"]


class HybridStrategy(ParallelStrategy):
    """Replicas x FSDP x tensor parallelism on one mesh, each degree split across hosts.

    `ParallelStrategy` with ``experts=1, context=1``: the mesh's axes are ``("replica",
    "fsdp", "tensor")``, a global batch divides by ``replicas x fsdp``. By default the
    replicas alone cross hosts, so the slow links carry one gradient all-reduce per step
    (torchtitan's and PyTorch's HSDP).

    Args:
      replicas, fsdp, tensor: the degrees, as `ParallelStrategy`'s.
      dcn_replicas, dcn_fsdp, dcn_tensor: their across-host parts, as `ParallelStrategy`'s.
      layout_map, min_shard_size, devices: as `ParallelStrategy`.
      cluster_resolver, communication_options: as `ParallelStrategy`.
      offload_optimizer, offload, tensor_activations: as `ParallelStrategy`.

    Raises:
      ValueError, TypeError: as `ParallelStrategy`.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import jstrategy
    >>> mesh = jstrategy.experimental.DeviceMesh((2, 2, 2), ("replica", "fsdp", "tensor"))
    >>> layout_map = jstrategy.experimental.LayoutMap(mesh)
    >>> layout_map["Dense_0/kernel"] = (None, "tensor")
    >>> strategy = jstrategy.experimental.HybridStrategy(
    ...     replicas=2, fsdp=2, tensor=2, dcn_replicas=2, layout_map=layout_map,
    ...     min_shard_size=0)
    >>> dict(strategy.mesh.shape), strategy.num_replicas_in_sync, strategy.batch_multiple
    ({'replica': 2, 'fsdp': 2, 'tensor': 2}, 2, 4)
    >>> kernel = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    >>> strategy.variable_sharding(kernel, ("params", "Dense_0", "kernel")).spec
    P('fsdp', 'tensor')
    >>> strategy.hosts  # two groups of four devices, each one replica
    ((0, 1, 2, 3), (4, 5, 6, 7))
    """

    def __init__(
        self,
        *,
        replicas: int = -1,
        fsdp: int = 1,
        tensor: int = 1,
        dcn_replicas: int | None = None,
        dcn_fsdp: int = 1,
        dcn_tensor: int = 1,
        layout_map: LayoutMap | None = None,
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        devices: Sequence[devices_lib.DeviceSpec] | None = None,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        offload_optimizer: bool = False,
        offload: OffloadPolicy | None = None,
        tensor_activations: TensorActivations | str = TensorActivations.FEATURES,
    ):
        super().__init__(
            replicas=replicas,
            fsdp=fsdp,
            tensor=tensor,
            dcn_replicas=dcn_replicas,
            dcn_fsdp=dcn_fsdp,
            dcn_tensor=dcn_tensor,
            layout_map=layout_map,
            min_shard_size=min_shard_size,
            devices=devices,
            cluster_resolver=cluster_resolver,
            communication_options=communication_options,
            offload_optimizer=offload_optimizer,
            offload=offload,
            tensor_activations=tensor_activations,
        )
