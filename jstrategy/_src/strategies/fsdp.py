"""`FSDPStrategy`: fully sharded data parallelism (ZeRO-3) over one axis of devices.

What differs from `MirroredStrategy` is only where variables live between steps: instead of
a full copy per replica, every large enough variable (parameter or optimizer-state leaf) is
split into one slice per replica along one of its dimensions, so each device holds about
``1 / num_replicas_in_sync`` of the parameters and optimizer state. Replicas, `run`, the
replica context and distributed datasets are Mirrored's: each replica computes on its slice
of the batch, over the data axis `REPLICA_AXIS`.

A compiled step that receives such variables lets XLA's SPMD partitioner gather each
parameter where it is used and reduce-scatter its gradient back to the slices, and applies
the optimizer update to the slices only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import devices as devices_lib
from jstrategy._src import flax_annotations
from jstrategy._src.axes import DATA_AXES
from jstrategy._src.collective_util import CommunicationOptions
from jstrategy._src.context_parallel.axis import CONTEXT_AXIS
from jstrategy._src.moe.axis import EXPERT_AXIS
from jstrategy._src.offload import OffloadPolicy
from jstrategy._src.strategies.sharded import ShardedStrategy
from jstrategy._src.strategy import REPLICA_AXIS
from jstrategy._src.validation import check_number

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver

__all__ = ["DEFAULT_MIN_SHARD_SIZE", "FSDPStrategy", "check_min_shard_size", "shard_dim"]

#: Variables with fewer elements stay replicated: gathering a bias or a norm's scale costs
#: a collective per use and saves next to nothing.
DEFAULT_MIN_SHARD_SIZE = 1024


class FSDPStrategy(ShardedStrategy):
    """Data parallelism with parameters and optimizer state sharded over the replicas.

    Every variable with at least `min_shard_size` elements is split over the replicas
    along its largest dimension that divides by `num_replicas_in_sync` (the first such
    dimension when several are equally large); smaller variables, and those without such a
    dimension, are replicated. The decision depends on the shape only, so an optimizer's
    moments are laid out like their parameters.

    Several processes (workers) train together as under `MultiWorkerMirroredStrategy`:
    with ``devices=None`` the strategy joins the job that `cluster_resolver` (by default
    ``TF_CONFIG``) describes through `jstrategy.cluster_resolver.join`, as
    `MultiWorkerMirroredStrategy` does (so create it before any other JAX computation),
    and lays one replica on every device of every worker; each process then holds only its
    devices' slices of every variable. Without ``TF_CONFIG`` it is one process over the
    local devices. `jstrategy.launch` runs such a job on one machine.

    Args:
      devices: the devices (TF-style strings or `jax.Device` objects), one replica each. None
        means every device of JAX's default backend, of every process of the job.
      min_shard_size: the fewest elements a variable must have to be sharded.
      cluster_resolver: the job to join, as for `MultiWorkerMirroredStrategy`; defaults to
        `TFConfigClusterResolver()` when `devices` is None.
      communication_options: `jstrategy.experimental.CommunicationOptions` for the
        collectives across workers (implementation, packing, ``timeout_seconds``), as for
        `MultiWorkerMirroredStrategy`.
      context: the context-parallel degree: how many devices split each sequence. The
        mesh is then ``(replicas, context)`` with axes ``("replica", "context")`` (each
        replica ``context`` neighbouring devices), `num_replicas_in_sync` is the devices
        over ``context``, variables are split over all the devices, and a train step
        (``make_train_step``, ``Model.fit``) splits the batch arrays that carry the
        sequence (dimension 1 equal to the inputs' sequence length, the longest dimension
        1 of ``x``'s arrays; a ``(B, 3)`` label stays whole) along it over the
        ``"context"`` axis, each device receiving only its part, with
        `jstrategy.experimental.dot_product_attention` running ring attention over it.
        `run` does not split sequences: that attention refuses to run there.
      offload_optimizer: keep the optimizer state in host memory between steps (its
        slices, split as above), moved to device memory for the update inside the
        compiled step: ``offload=OffloadPolicy()``.
      offload: a `jstrategy.experimental.OffloadPolicy`: which variables (optimizer
        state, parameters, chosen by path) live in host memory between steps.
      experts: the expert-parallel degree k. The mesh is then ``(replicas, experts)``
        with axes ``("replica", "expert")`` (each replica k neighbouring devices),
        `num_replicas_in_sync` is the devices over k, and the stacked weights of
        `jstrategy.experimental.MoE` / `NNXMoE` (annotated ``"expert"`` on their experts'
        axis) are split over the ``"expert"`` axis, each device holding ``1/k`` of the
        experts (and FSDP's split of those over the replicas); other variables are split
        over all the devices. In a train step each expert layer sends its tokens to their
        experts' devices and back with ``all_to_all`` over the ``"expert"`` axis. k must
        divide every expert layer's ``num_experts`` (checked when the step is traced).

    Raises:
      ValueError: if `devices` is invalid, `min_shard_size` is not a non-negative int,
        `context` is not a positive int dividing the number of devices, or offloading is
        asked twice or on devices without host memory.
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
        check_number(
            experts,
            "experts",
            integer=True,
            low=1,
            expected="a positive int (how many devices split each expert layer's experts)",
            fix="Pass e.g. experts=2, or 1 (the default) for no expert parallelism.",
        )
        if experts > 1 and context > 1:
            raise ValueError(
                f"`experts`={experts} and `context`={context} cannot be combined: an "
                "FSDPStrategy has one axis besides its replicas. Pass one of them."
            )
        check_number(
            context,
            "context",
            integer=True,
            low=1,
            expected="a positive int (how many devices split each sequence)",
            fix="Pass e.g. context=2, or 1 (the default) to keep sequences whole.",
        )
        check_min_shard_size(min_shard_size)
        cross_device_ops, resolved = self._join_and_resolve(
            devices, cluster_resolver, communication_options
        )
        if len(resolved) % context:
            raise ValueError(
                f"`context` must divide the number of devices, {len(resolved)} (each replica "
                f"is `context` devices splitting its sequences); got context={context}. Pass "
                f"a divisor of {len(resolved)}, e.g. context="
                f"{max(d for d in range(1, context) if len(resolved) % d == 0)}."
            )
        if len(resolved) % experts:
            raise ValueError(
                f"`experts` must divide the number of devices, {len(resolved)} (each replica "
                f"is `experts` devices splitting the experts); got experts={experts}. Pass "
                f"a divisor of {len(resolved)}, e.g. experts="
                f"{max(d for d in range(1, experts) if len(resolved) % d == 0)}."
            )
        mesh: Sequence[jax.Device] | Mesh = resolved
        second = CONTEXT_AXIS if context > 1 else EXPERT_AXIS if experts > 1 else None
        if second is not None:
            mesh = Mesh(
                np.array(tuple(resolved), dtype=object).reshape(-1, max(context, experts)),
                (REPLICA_AXIS, second),
                axis_types=(AxisType.Auto, AxisType.Auto),
            )
        super().__init__(mesh, cross_device_ops=cross_device_ops)
        self._set_offload(offload, offload_optimizer)
        self._min_shard_size = min_shard_size
        self._experts = experts
        # Variables split over every device: over the context (or expert) axis too, as
        # MaxText's FSDP.
        self._split_axes = (REPLICA_AXIS, second) if second is not None else REPLICA_AXIS

    @property
    def min_shard_size(self) -> int:
        """The fewest elements a variable must have to be sharded."""
        return self._min_shard_size

    def variable_sharding(
        self, leaf: jax.ShapeDtypeStruct | jax.Array, path: tuple[str, ...] = ()
    ) -> jax.sharding.Sharding:
        """One slice per replica along the largest dimension that divides, else replicated.

        A variable whose Flax annotation (`nn.with_partitioning`, `nnx.with_partitioning`,
        ...) splits a dimension over a data axis (named ``"data"``, ``"fsdp"``, ``"batch"``
        or `axis_name`) is split along that dimension when it divides, whatever its size;
        the annotation's other axes do not exist on this 1-D mesh and are ignored.

        Args:
          leaf: the variable's shape and dtype.
          path: the variable's keys in the state: they find its annotation, if any (a
            parameter's optimizer moments follow it).

        Returns:
          ``NamedSharding(mesh, P(..., "replica", ...))`` with the data axis at the
          chosen dimension, or `replicated_sharding`.
        """
        n = self.mesh.size
        shape = tuple(leaf.shape)
        expert_dim = self._expert_dim(path, shape)
        if expert_dim is not None:
            # Each device holds its experts; FSDP splits those over the replicas.
            spec: list[str | tuple[str, ...] | None] = [None] * len(shape)
            spec[expert_dim] = EXPERT_AXIS
            replicas = self.num_replicas_in_sync
            best = shard_dim(shape, replicas, self._min_shard_size, exclude=(expert_dim,))
            if best is not None:
                spec[best] = REPLICA_AXIS
            return NamedSharding(self.mesh, P(*spec))
        annotated = flax_annotations.data_dim(self, path, shape, (*DATA_AXES, self.axis_name))
        if annotated is not None and self.num_replicas_in_sync > 1:
            axes = self._split_axes if shape[annotated] % n == 0 else self.axis_name
            return NamedSharding(self.mesh, P(*([None] * annotated), axes))
        best = shard_dim(shape, n, self._min_shard_size)
        if best is None:
            return self.replicated_sharding()
        spec = [None] * len(shape)
        spec[best] = self._split_axes
        return NamedSharding(self.mesh, P(*spec))

    @property
    def logical_axis_rules(self) -> tuple[tuple[str, Any], ...]:
        """With an expert axis, the logical name ``"expert"`` (the expert layers' experts)
        maps to it; otherwise no rule.

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.FSDPStrategy(experts=2).logical_axis_rules
        (('expert', 'expert'),)
        """
        return ((EXPERT_AXIS, EXPERT_AXIS),) if self._experts > 1 else ()

    @property
    def expert_parallelism(self) -> int:
        """The expert-parallel degree: the size of the ``"expert"`` axis (1 without one).

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.FSDPStrategy(experts=4).expert_parallelism
        4
        """
        return self._experts

    def _expert_dim(self, path: tuple[str, ...], shape: tuple[int, ...]) -> int | None:
        """The dimension an expert layer annotated ``"expert"`` (its experts), when this
        strategy has an expert axis that divides it; else None."""
        if self._experts == 1:
            return None
        found = flax_annotations.annotation(self, path)
        if found is None:
            return None
        for dim, entry in enumerate(found[1]):
            named = (entry,) if isinstance(entry, str) else tuple(entry or ())
            if EXPERT_AXIS in named and dim < len(shape) and shape[dim] % self._experts == 0:
                return dim
        return None

    def __repr__(self) -> str:
        context = self.context_parallelism
        extra = f", context={context}" if context > 1 else ""
        extra += f", experts={self._experts}" if self._experts > 1 else ""
        return f"{super().__repr__()[:-1]}, min_shard_size={self._min_shard_size}{extra})"


def check_min_shard_size(min_shard_size: int) -> int:
    """`min_shard_size` if it is a non-negative int, else the `ValueError` with the fix."""
    return check_number(
        min_shard_size,
        "min_shard_size",
        integer=True,
        low=0,
        expected="a non-negative int (the fewest elements a variable needs to be sharded)",
        fix=f"Pass e.g. min_shard_size={DEFAULT_MIN_SHARD_SIZE}, or 0 to shard every "
        "variable that divides.",
    )


def shard_dim(
    shape: tuple[int, ...], n: int, min_shard_size: int, *, exclude: tuple[int, ...] = ()
) -> int | None:
    """The dimension FSDP splits a variable of `shape` along over `n` replicas, or None.

    The largest dimension (the first of equally large ones) that divides by `n`, not in
    `exclude`, when the variable has at least `min_shard_size` elements.

    Example:

    >>> shard_dim((12, 16), 8, 64), shard_dim((16,), 8, 64), shard_dim((4, 8, 8), 8, 0, exclude=(1,))
    (1, None, 2)
    """
    if n == 1 or math.prod(shape) < max(min_shard_size, 1):
        return None
    dims = [i for i, d in enumerate(shape) if d >= n and d % n == 0 and i not in exclude]
    if not dims:
        return None
    return max(dims, key=lambda i: (shape[i], -i))
