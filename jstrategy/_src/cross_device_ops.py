"""Cross-device reduction algorithms: `NcclAllReduce`, `HierarchicalCopyAllReduce`, `ReductionToOneDevice`.

Each is a different communication pattern in the compiled SPMD program, selected by the
strategy and used for `ReplicaContext.all_reduce`, `Strategy.reduce` and gradient
aggregation. All three compute the same sums (up to float rounding order).

* `NcclAllReduce`: the tensors are concatenated into `num_packs` buffers and each buffer is
  one all-reduce (NCCL on GPU); ``num_packs=0`` all-reduces each tensor on its own.
* `HierarchicalCopyAllReduce`: TF's DGX-1 design. The devices are split into two halves;
  each half reduces to its first device with a tree of point-to-point copies
  (collective-permutes), the two half-leaders combine, and the result is broadcast back.
* `ReductionToOneDevice`: every replica copies its value to one device, which accumulates
  them with `accumulation_fn`, and the result is broadcast back to all replicas.

The broadcasts back are written as an all-reduce in which only the source contributes
(JAX's own `broadcast_one_to_all` idiom, and the documented meaning of
`jax.lax.pbroadcast`, which has no CPU lowering); that keeps the result typed as identical
on every replica.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import devices as devices_lib
from jstrategy._src import dispatch
from jstrategy._src.collective_util import CommunicationImplementation
from jstrategy._src.context import _all_gather_invariant
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.validation import check_number
from jstrategy._src.values import PerReplica
from jstrategy._src.values import is_per_replica
from jstrategy._src.values import on_a_mesh
from jstrategy._src.values import replica_axis_of
from jstrategy._src.values import varying_axes

__all__ = [
    "CollectiveAllReduce",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
]


class CrossDeviceOps:
    """Base class of the cross-device reduction algorithms.

    Subclasses implement `_sum_leaves`, the sum across replicas of a list of arrays inside
    the SPMD program. Everything else (MEAN, pytrees, cross-replica `reduce`) is shared.

    Example:

    >>> import jstrategy
    >>> ops = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).cross_device_ops
    >>> isinstance(ops, jstrategy.CrossDeviceOps), type(ops).__name__
    (True, 'NcclAllReduce')
    """

    def __init__(self) -> None:
        self._programs: dict[Any, Callable[..., Any]] = {}

    # Inside the SPMD program ------------------------------------------------------------
    def all_reduce(
        self,
        reduce_op: ReduceOp | str,
        value: Any,
        *,
        mesh: jax.sharding.Mesh,
        axis_name: str | None = None,
    ) -> Any:
        """Reduces a pytree across replicas from inside `Strategy.run` (or a train step).

        Args:
          reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN`.
          value: a pytree of arrays, the same structure and shapes on every replica.
          mesh: the strategy's mesh.
          axis_name: the mesh axis along which replicas are laid (`Strategy.axis_name`);
            None for a 1-D mesh's only axis.

        Returns:
          The reduced pytree, identical on every replica.

        Raises:
          ValueError: if `axis_name` is None and the mesh has several axes.
        """
        op = ReduceOp.from_value(reduce_op)
        axis_name = _data_axis(mesh, axis_name)
        leaves, treedef = jax.tree.flatten(value)
        leaves = [jnp.asarray(x) for x in leaves]
        summed = self._sum_leaves(leaves, mesh, axis_name) if leaves else []
        if op is ReduceOp.MEAN:
            summed = [s / mesh.shape[axis_name] for s in summed]
        return jax.tree.unflatten(treedef, summed)

    def _sum_leaves(
        self, leaves: list[jax.Array], mesh: jax.sharding.Mesh, axis_name: str
    ) -> list[jax.Array]:
        """The sums across replicas of `leaves`, traced inside a shard_map manual over
        `axis_name`, the mesh axis along which replicas are laid."""
        raise NotImplementedError

    # In the cross-replica context ------------------------------------------------------
    def reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_value: Any,
        destinations: Any = None,
        *,
        axis: int | None = None,
    ) -> Any:
        """Reduces per-replica values across replicas, from outside `run`.

        Args:
          reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN`.
          per_replica_value: a pytree whose leaves are `PerReplica` values.
          destinations: where to put the result: None for replicated over the replicas'
            devices, or a device (string or `jax.Device`).
          axis: if given, also reduce along this axis of each replica's value; MEAN then
            divides by the total number of elements reduced, as in tf.distribute.

        Returns:
          A pytree of arrays, the reduced values.
        """
        op = ReduceOp.from_value(reduce_op)
        per_replica_value = on_a_mesh(per_replica_value)
        leaves, treedef = jax.tree.flatten(per_replica_value, is_leaf=is_per_replica)
        for leaf in leaves:
            if not isinstance(leaf, PerReplica):
                raise TypeError(
                    f"`per_replica_value` leaves must be PerReplica values (from "
                    f"Strategy.run or a distributed dataset); got {type(leaf).__name__}."
                )
        if not leaves:
            return per_replica_value
        sharding = leaves[0].value.sharding
        mesh = sharding.mesh
        axis_name = replica_axis_of(sharding) or _data_axis(mesh, None)
        key = (mesh, axis_name, op, axis, tuple(leaf.stacked for leaf in leaves), len(leaves))
        program = self._programs.get(key)
        if program is None:
            program = self._build_reduce(
                mesh, axis_name, op, axis, [leaf.stacked for leaf in leaves]
            )
            self._programs[key] = program
        out = program(*[leaf.value for leaf in leaves])
        dispatch.track(out)  # a collective: bounded like `Strategy.run`'s steps
        if destinations is not None:
            out = jax.device_put(out, devices_lib.resolve_device(destinations))
        return jax.tree.unflatten(treedef, out)

    def batch_reduce(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Any]:
        """Reduces several per-replica values in one program (so packing applies).

        Args:
          reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN`.
          value_destination_pairs: ``(per_replica_value, destinations)`` pairs.

        Returns:
          The reduced values, in order.
        """
        values = [v for v, _ in value_destination_pairs]
        reduced = self.reduce(reduce_op, values)
        return [
            r if d is None else jax.device_put(r, devices_lib.resolve_device(d))
            for r, (_, d) in zip(reduced, value_destination_pairs, strict=True)
        ]

    def _build_reduce(
        self, mesh, axis_name: str, op: ReduceOp, axis: int | None, stacked: list[bool]
    ):
        n = mesh.shape[axis_name]

        def body(*values: jax.Array) -> list[jax.Array]:
            xs = [x[0] if s else x for x, s in zip(values, stacked, strict=True)]
            counts = [1] * len(xs)
            if axis is not None:
                counts = [x.shape[axis] for x in xs]
                xs = [jnp.sum(x, axis=axis) for x in xs]
            summed = self._sum_leaves(xs, mesh, axis_name)
            if op is ReduceOp.MEAN:
                summed = [s / (n * c) for s, c in zip(summed, counts, strict=True)]
            return summed

        in_specs = tuple(P(axis_name) for _ in stacked)
        out_specs = [P() for _ in stacked]
        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=in_specs,
                out_specs=out_specs,
                axis_names=frozenset({axis_name}),
            ),
            out_shardings=[NamedSharding(mesh, P()) for _ in stacked],
        )

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        return f"{type(self).__name__}({settings})"

    def _settings(self) -> dict[str, Any]:
        return {}


def _data_axis(mesh: jax.sharding.Mesh, axis_name: str | None) -> str:
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"`axis_name` must name the mesh axis along which replicas are laid when the "
                f"mesh has several axes {tuple(mesh.axis_names)}; got None. Pass "
                "axis_name=strategy.axis_name."
            )
        return mesh.axis_names[0]
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"`axis_name` must be one of the mesh's axes {tuple(mesh.axis_names)}; got "
            f"{axis_name!r}. Pass axis_name=strategy.axis_name."
        )
    return axis_name


def _check_num_packs(num_packs: int) -> int:
    return check_number(
        num_packs,
        "num_packs",
        integer=True,
        low=0,
        fix="Use 1 to pack all tensors into one buffer, or 0 to reduce each tensor on its own.",
    )


def _packed(
    leaves: list[jax.Array], num_packs: int, reduce_buffer: Callable[[jax.Array], jax.Array]
) -> list[jax.Array]:
    """Applies `reduce_buffer` to `num_packs` concatenated buffers (per dtype) and unpacks."""
    if num_packs == 0:
        return [reduce_buffer(x) for x in leaves]
    out: list[jax.Array | None] = [None] * len(leaves)
    by_dtype: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        by_dtype.setdefault(x.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in indices])
        total = flat.shape[0]
        packs = max(1, min(num_packs, total))
        bounds = np.linspace(0, total, packs + 1).round().astype(int)
        reduced = jnp.concatenate(
            [reduce_buffer(flat[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        )
        offset = 0
        for i in indices:
            size = leaves[i].size
            out[i] = reduced[offset : offset + size].reshape(leaves[i].shape)
            offset += size
    return out  # type: ignore[return-value]


def _broadcast_from(x: jax.Array, axis_name: str, sources: Sequence[int]) -> jax.Array:
    """Sum of `x` over the `sources` replicas, delivered to every replica."""
    index = jax.lax.axis_index(axis_name)
    is_source = functools.reduce(jnp.logical_or, [index == s for s in sources])
    return jax.lax.psum(jnp.where(is_source, x, jnp.zeros_like(x)), axis_name)


class NcclAllReduce(CrossDeviceOps):
    """All-reduce of packed buffers: one all-reduce per pack (NCCL on GPU).

    Args:
      num_packs: how many buffers to concatenate the tensors into (per dtype); each is one
        all-reduce. 0 all-reduces each tensor separately.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(
    ...     devices=["cpu:0", "cpu:1"], cross_device_ops=NcclAllReduce(num_packs=2))
    >>> strategy.cross_device_ops
    NcclAllReduce(num_packs=2)
    """

    def __init__(self, num_packs: int = 1):
        super().__init__()
        self.num_packs = _check_num_packs(num_packs)

    def _settings(self) -> dict[str, Any]:
        return {"num_packs": self.num_packs}

    def _sum_leaves(self, leaves, mesh, axis_name):
        return _packed(leaves, self.num_packs, lambda x: jax.lax.psum(x, axis_name))


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Two-level reduction: within each half of the devices, across the halves, then back.

    Within each half, partial sums travel up a binary tree of point-to-point copies
    (collective-permutes) to the half's first device; the two half-leaders are combined and
    the total is broadcast back to every device. This is TF's hierarchical copy for DGX-1
    style machines, where each half is a fast island.

    Args:
      num_packs: how many buffers to concatenate the tensors into (per dtype). 0 reduces
        each tensor separately.

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> strategy = jstrategy.MirroredStrategy(
    ...     devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"],
    ...     cross_device_ops=jstrategy.HierarchicalCopyAllReduce(num_packs=1))
    >>> ones = strategy.run(lambda: jnp.ones(2))
    >>> strategy.reduce("SUM", ones, axis=None).tolist()
    [4.0, 4.0]
    """

    def __init__(self, num_packs: int = 1):
        super().__init__()
        self.num_packs = _check_num_packs(num_packs)

    def _settings(self) -> dict[str, Any]:
        return {"num_packs": self.num_packs}

    @staticmethod
    def groups(n: int) -> list[list[int]]:
        """The replica groups: the first and second half of `n` replicas."""
        half = (n + 1) // 2
        return [g for g in (list(range(half)), list(range(half, n))) if g]

    def _sum_leaves(self, leaves, mesh, axis_name):
        groups = self.groups(mesh.shape[axis_name])

        def reduce_buffer(x):
            step = 1
            while step < max(len(g) for g in groups):
                perm = [(g[i], g[i - step]) for g in groups for i in range(step, len(g), 2 * step)]
                # Replicas that receive nothing get zeros, so adding is safe everywhere.
                x = x + jax.lax.ppermute(x, axis_name, perm)
                step *= 2
            return _broadcast_from(x, axis_name, [g[0] for g in groups])

        return _packed(leaves, self.num_packs, reduce_buffer)


def _add_n(values: list[jax.Array]) -> jax.Array:
    return functools.reduce(jnp.add, values)


class ReductionToOneDevice(CrossDeviceOps):
    """Copies every replica's value to one device, accumulates there, broadcasts back.

    Args:
      reduce_to_device: the device to reduce on (string or `jax.Device`); it must be one of
        the strategy's devices. None means the first replica's device.
      accumulation_fn: a function from a list of arrays (one per replica, in replica order)
        to their sum; defaults to adding them.

    Raises:
      ValueError: at first use, if `reduce_to_device` is not one of the strategy's devices.

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> strategy = jstrategy.MirroredStrategy(
    ...     devices=["cpu:0", "cpu:1"],
    ...     cross_device_ops=jstrategy.ReductionToOneDevice(reduce_to_device="cpu:0"))
    >>> strategy.reduce("MEAN", strategy.run(lambda: jnp.ones(3)), axis=None).tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(
        self,
        reduce_to_device: Any = None,
        accumulation_fn: Callable[[list[jax.Array]], jax.Array] | None = None,
    ):
        super().__init__()
        self.reduce_to_device = (
            None if reduce_to_device is None else devices_lib.resolve_device(reduce_to_device)
        )
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(
                f"`accumulation_fn` must be callable (list of arrays -> array); got "
                f"{accumulation_fn!r}."
            )
        self.accumulation_fn = accumulation_fn or _add_n

    def _settings(self) -> dict[str, Any]:
        return {"reduce_to_device": self.reduce_to_device}

    def _destination_index(self, mesh: jax.sharding.Mesh, axis_name: str) -> int:
        """The replica (position along `axis_name`) whose devices include the destination."""
        if self.reduce_to_device is None:
            return 0
        devices = list(mesh.devices.flat)
        if self.reduce_to_device not in devices:
            raise ValueError(
                f"`reduce_to_device` must be one of the strategy's devices "
                f"{[devices_lib.canonical_name(d) for d in devices]}; got "
                f"{devices_lib.canonical_name(self.reduce_to_device)}. Pass one of them, or "
                "None for the first replica's device."
            )
        position = np.argwhere(mesh.devices == self.reduce_to_device)[0]
        return int(position[mesh.axis_names.index(axis_name)])

    def _sum_leaves(self, leaves, mesh, axis_name):
        n = mesh.shape[axis_name]
        dest = self._destination_index(mesh, axis_name)
        out = []
        for x in leaves:
            received = {dest: x}
            for k in range(1, n):
                src = (dest + k) % n
                received[src] = jax.lax.ppermute(x, axis_name, [(src, dest)])
            total = self.accumulation_fn([received[i] for i in range(n)])
            out.append(_broadcast_from(total, axis_name, [dest]))
        return out


def _packed_by_bytes(
    leaves: list[jax.Array], bytes_per_pack: int, reduce_buffer: Callable[[jax.Array], jax.Array]
) -> list[jax.Array]:
    """Groups consecutive same-dtype tensors into buffers of at most `bytes_per_pack` bytes.

    Each buffer is reduced by one `reduce_buffer` call; a tensor larger than the limit is a
    buffer of its own. ``bytes_per_pack=0`` reduces each tensor on its own.
    """
    if bytes_per_pack == 0:
        return [reduce_buffer(x) for x in leaves]
    packs: list[list[int]] = []
    size = 0
    for i, x in enumerate(leaves):
        nbytes = x.size * x.dtype.itemsize
        same_dtype = bool(packs) and leaves[packs[-1][0]].dtype == x.dtype
        if packs and same_dtype and size + nbytes <= bytes_per_pack:
            packs[-1].append(i)
            size += nbytes
        else:
            packs.append([i])
            size = nbytes
    out: list[jax.Array | None] = [None] * len(leaves)
    for pack in packs:
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in pack])
        reduced = reduce_buffer(flat)
        offset = 0
        for i in pack:
            out[i] = reduced[offset : offset + leaves[i].size].reshape(leaves[i].shape)
            offset += leaves[i].size
    return out  # type: ignore[return-value]


def _ring_sum(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    """Sum across replicas as a reduce-scatter followed by an all-gather (a ring's two phases)."""
    shape, size = x.shape, x.size
    flat = x.reshape(-1)
    padded = -(-size // n) * n
    if padded != size:
        flat = jnp.pad(flat, (0, padded - size))
    if axis_name not in varying_axes(flat):
        flat = jax.lax.pcast(flat, axis_name, to="varying")
    shard = jax.lax.psum_scatter(flat, axis_name, scatter_dimension=0, tiled=True)
    full = _all_gather_invariant(shard, axis_name, axis=0, tiled=True)
    return full[:size].reshape(shape)


class CollectiveAllReduce(CrossDeviceOps):
    """MultiWorkerMirroredStrategy's collectives: RING, NCCL or AUTO, with byte-sized packs.

    Args:
      implementation: a `CommunicationImplementation` (or its name). ``RING`` is a
        reduce-scatter followed by an all-gather in the compiled program (the two phases of
        a ring all-reduce); ``NCCL`` is the platform all-reduce (NCCL on GPUs, gloo on CPUs);
        ``AUTO`` leaves the choice to XLA (an all-reduce that XLA may combine or split).
      bytes_per_pack: if positive, gradients are concatenated into buffers of at most this
        many bytes, one collective per buffer; 0 leaves packing to XLA.

    Example:

    >>> op = CollectiveAllReduce(implementation="RING", bytes_per_pack=1 << 20)
    >>> op
    CollectiveAllReduce(implementation=<CommunicationImplementation.RING: 'RING'>, bytes_per_pack=1048576)
    """

    def __init__(self, implementation: Any = "AUTO", bytes_per_pack: int = 0):
        super().__init__()
        self.implementation = CommunicationImplementation.from_value(implementation)
        self.bytes_per_pack = check_number(
            bytes_per_pack,
            "bytes_per_pack",
            integer=True,
            low=0,
            fix="Use 0 to let XLA pack, or e.g. 32 << 20 for 32 MiB buffers.",
        )

    def _settings(self) -> dict[str, Any]:
        return {"implementation": self.implementation, "bytes_per_pack": self.bytes_per_pack}

    def _sum_leaves(self, leaves, mesh, axis_name):
        n = mesh.shape[axis_name]
        if self.implementation is CommunicationImplementation.RING:
            return _packed_by_bytes(
                leaves, self.bytes_per_pack, lambda x: _ring_sum(x, axis_name, n)
            )
        return _packed_by_bytes(leaves, self.bytes_per_pack, lambda x: jax.lax.psum(x, axis_name))
