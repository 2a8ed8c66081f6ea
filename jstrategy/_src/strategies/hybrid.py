"""`HybridStrategy`: model replicas x FSDP shards x tensor shards (HSDP x TP), a preset of
`ParallelStrategy` with no expert or context axis.

The mesh has the axes ``("replica", "fsdp", "tensor")``; see `ParallelStrategy` for where
variables live, how rows are split and how the degrees cross hosts.
"""

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

    `ParallelStrategy` with ``experts=1, context=1``: the mesh is ``(replicas, fsdp,
    tensor)`` with axes ``("replica", "fsdp", "tensor")``. Replicas hold whole copies (the
    data axis, gradients all-reduced over it); within a replica variables are split over
    ``"fsdp"`` (ZeRO-3) on a dimension the tensor layout leaves free and over ``"tensor"``
    as a `LayoutMap` or the model's Flax annotations say; each replica's rows are split
    over its ``"fsdp"`` devices too, so a global batch divides by ``replicas x fsdp``.

    By default the replicas alone cross hosts (``dcn_replicas`` = the number of
    processes): FSDP's all-gathers and the tensor collectives stay within a host, the
    slow links carry one gradient all-reduce per step (torchtitan's and PyTorch's HSDP).
    Grow FSDP until the state fits, tensor when a replica's activations do not, and
    replicas for throughput across hosts.

    Args:
      replicas: the number of model replicas; -1 means the devices `fsdp` and `tensor`
        leave.
      fsdp: the FSDP degree; -1 means the rest.
      tensor: the tensor-parallel degree; -1 means the rest.
      dcn_replicas: how many hosts the replicas span; None means the number of processes
        over ``dcn_fsdp x dcn_tensor``.
      dcn_fsdp: how many hosts FSDP's split spans (1: each all-gather within a host).
      dcn_tensor: how many hosts the tensor split spans (1: within a host).
      layout_map: the tensor layouts: a `LayoutMap` whose layouts name ``"tensor"`` or
        ``"model"`` (and optionally ``"fsdp"``, ``"data"`` or ``"batch"``); its own mesh's
        shape is not used. None: the Flax annotations only.
      min_shard_size: the fewest elements a variable needs to be split over ``"fsdp"``.
      devices: the devices, in host order. None means every device of every process.
      cluster_resolver: the job to join, as for `FSDPStrategy`.
      communication_options: `jstrategy.experimental.CommunicationOptions` for the job.
      offload_optimizer: keep the optimizer state in host memory between steps.
      offload: a `jstrategy.experimental.OffloadPolicy`.
      tensor_activations: which dimension of the activations between blocks the step
        splits over ``"tensor"``: ``"features"`` (under remat) or ``"sequence"``
        (`TensorActivations`).

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
