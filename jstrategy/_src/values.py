"""Per-replica values: one array holding every replica's value, laid over the mesh; and the
one codec of typed PRNG keys as their raw data.

Checkpoints hold plain arrays, transfers between processes and fingerprints read bits: a
typed key array (``jax.random.key``) goes through them as its raw data and comes back
with its implementation (`is_key`, `key_data`, `keys_from_data`; a tree at a time:
`keys_as_data`, `keys_like`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

__all__ = [
    "PerReplica",
    "is_key",
    "is_per_replica",
    "key_data",
    "keys_as_data",
    "keys_from_data",
    "keys_like",
    "local_copy",
    "local_devices_of",
    "local_replica_devices",
    "on_a_mesh",
    "replica_axis_of",
    "replica_devices",
    "row_blocks",
    "to_host",
    "varying_axes",
]


@jax.tree_util.register_pytree_node_class
class PerReplica:
    """One value per replica, stored as a single global `jax.Array` sharded over the mesh.

    Two layouts exist, both with the replica axis first and split over the strategy's data
    axis (on a multi-axis mesh, every device of replica *i* holds replica *i*'s part):

    * ``stacked`` (what `Strategy.run` returns): global shape ``(num_replicas, *shape)``;
      replica *i* owns ``value[i]``.
    * split (what distributed datasets yield): global shape ``(global_batch, ...)``;
      replica *i* owns the *i*-th contiguous slice of rows, as in tf.distribute.

    `PerReplica` is a pytree node, so it can be passed to `jax.jit`, `Strategy.run`,
    `Strategy.reduce` and `Strategy.gather`.

    A split value may carry a `mask`: a boolean global array of shape ``(global_batch,)``,
    split the same way, true for real rows and false for padding. Distributed datasets pad
    partial batches to a static shape and set it; `Strategy.run` hands it to the replica
    context (`ReplicaContext.row_mask`) so losses and metrics count only real rows.

    Attributes:
      value: the global array.
      stacked: whether the leading axis indexes replicas (True) or splits rows (False).
      mask: for split values, which rows are real (None: all of them).

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> def replica_id():
    ...     return jnp.float32(jstrategy.get_replica_context().replica_id_in_sync_group)
    >>> ids = strategy.run(replica_id)
    >>> isinstance(ids, jstrategy.PerReplica), [float(v) for v in strategy.experimental_local_results(ids)]
    (True, [0.0, 1.0])
    """

    __slots__ = ("mask", "mirrored", "stacked", "value")

    def __init__(
        self, value: Any, *, stacked: bool = True, mask: Any = None, mirrored: bool = False
    ):
        if stacked and mask is not None:
            raise ValueError("`mask` is only meaningful for split (stacked=False) values.")
        self.value = value
        self.stacked = stacked
        self.mask = mask
        # Set by `Strategy.run` under `jstrategy.config.experimental_check_mirrored` for an
        # output found the same on every replica; passed back to `run`, it is checked again.
        self.mirrored = mirrored

    def tree_flatten(self):
        if self.mask is None:
            return (self.value,), (self.stacked, False)
        return (self.value, self.mask), (self.stacked, True)

    @classmethod
    def tree_unflatten(cls, aux, children):
        stacked, has_mask = aux
        return cls(children[0], stacked=stacked, mask=children[1] if has_mask else None)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape each replica sees."""
        shape = tuple(self.value.shape)
        if self.stacked:
            return shape[1:]
        n = self.num_replicas
        return (shape[0] // n, *shape[1:])

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def num_replicas(self) -> int:
        """How many replicas hold a part: the size of the mesh axis splitting the leading axis."""
        sharding = getattr(self.value, "sharding", None)
        if sharding is None:
            return int(self.value.shape[0]) if self.stacked else 1
        if not hasattr(sharding, "mesh"):
            return 1
        axis = replica_axis_of(sharding)
        return 1 if axis is None else int(sharding.mesh.shape[axis])

    @property
    def values(self) -> tuple[Any, ...]:
        """This process's replicas' values, in replica order (as TF's ``.values``)."""
        return local_results(self)

    def __repr__(self) -> str:
        return f"PerReplica(shape={self.shape}, dtype={self.dtype}, replicas={self.num_replicas})"


def is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def local_copy(x: Any) -> Any:
    """This process's copy of a replicated (mirrored) array, readable on the host even when
    the array spans other processes' devices; anything else as it is.

    Example:

    >>> import jax.numpy as jnp
    >>> float(local_copy(jnp.float32(2.0)))
    2.0

    Raises:
      ValueError: for an array split across processes (read it with `to_host`).
    """
    if not isinstance(x, jax.Array) or x.sharding.is_fully_replicated:
        return x.addressable_data(0) if isinstance(x, jax.Array) else x
    if x.is_fully_addressable:
        return x  # split over this process's devices: whole when read
    raise ValueError(
        f"local_copy reads a replicated array; got one split across processes "
        f"({x.sharding}). Read it with jstrategy's to_host on every process."
    )


def local_devices_of(array: jax.Array) -> list[jax.Device]:
    """The devices of `array`'s mesh that belong to this process, in mesh order."""
    sharding = array.sharding
    if hasattr(sharding, "mesh"):
        devices = list(sharding.mesh.devices.flat)
    else:
        devices = sorted(sharding.device_set, key=lambda d: d.id)
    me = jax.process_index()
    return [d for d in devices if d.process_index == me]


def on_a_mesh(tree: Any, sharding: jax.sharding.NamedSharding | None = None) -> Any:
    """`tree` with each `PerReplica` whose array has no mesh laid out over one.

    jit gives a one-device program's outputs a `SingleDeviceSharding`, which names no mesh
    and so no replica axis to reduce or gather over. Such a value (and its mask) is put on
    `sharding`, a strategy's per-replica layout, or when None on a one-axis mesh over the
    devices holding it, in the order they hold its leading axis. Values already on a mesh
    are returned as they are, and on the same devices nothing is copied.
    """

    def lay(leaf: Any) -> Any:
        if not isinstance(leaf, PerReplica) or hasattr(
            getattr(leaf.value, "sharding", None), "mesh"
        ):
            return leaf
        target = sharding or _devices_mesh_sharding(jnp.asarray(leaf.value))
        mask = None if leaf.mask is None else jax.device_put(leaf.mask, target)
        return PerReplica(jax.device_put(leaf.value, target), stacked=leaf.stacked, mask=mask)

    return jax.tree.map(lay, tree, is_leaf=is_per_replica)


def _devices_mesh_sharding(array: jax.Array) -> jax.sharding.NamedSharding:
    """Rows split over a one-axis mesh of `array`'s devices, in the order they hold them."""
    index = array.sharding.devices_indices_map(array.shape)

    def position(device: Any) -> tuple[int, int]:
        rows = index[device]
        return ((rows[0].start or 0) if rows else 0, device.id)

    mesh = jax.sharding.Mesh(np.array(sorted(index, key=position)), ("replica",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))


def replica_axis_of(sharding: Any) -> str | None:
    """The mesh axis that splits the leading axis of a value laid out by `sharding` into
    replicas, if any: the first (major) one where several split it, each of its entries
    then holding a contiguous part that the others split further (`HybridStrategy`'s rows
    over ``("replica", "fsdp")``).

    Example:

    >>> from jax.sharding import PartitionSpec as P
    >>> class Laid:  # anything with a `spec`, as a NamedSharding
    ...     def __init__(self, spec): self.spec = spec
    >>> [replica_axis_of(Laid(s)) for s in (P("replica"), P(("replica", "fsdp")), P(None), P())]
    ['replica', 'replica', None, None]
    """
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None:
        return None
    first = spec[0]
    return first if isinstance(first, str) else (first[0] if first else None)


def row_blocks(sharding: Any) -> list[list[jax.Device]]:
    """The devices holding each block of rows `sharding` cuts a global batch into, in row
    order: one block per replica, or several where each replica's rows are split further
    over its devices (`HybridStrategy`'s ``("replica", "fsdp")``).

    Example:

    >>> import jax, numpy as np
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("r", "f"))
    >>> rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("r", "f")))
    >>> [[d.id for d in block] for block in row_blocks(rows)]
    [[0], [1], [2], [3]]
    """
    # As many rows as devices: every split of the rows divides it.
    size = len(sharding.device_set)
    blocks: dict[int, list[jax.Device]] = {}
    for device, index in sharding.devices_indices_map((size,)).items():
        blocks.setdefault((index[0].start or 0) if index else 0, []).append(device)
    return [blocks[start] for start in sorted(blocks)]


def replica_devices(sharding: Any, num_replicas: int) -> list[list[jax.Device]]:
    """The devices of each replica, in replica order, for `sharding` splitting rows by replica.

    A replica is one entry of the strategy's data axis: one device on a 1-D mesh, the
    devices of one data-parallel group (e.g. the whole ``"model"`` axis) on an N-D mesh.
    `sharding` is a strategy's batch sharding (or its per-replica sharding); only it is
    needed to know the layout. Replica *i* holds the *i*-th contiguous part of the rows,
    however finely its devices split it (`row_blocks`).
    """
    blocks = row_blocks(sharding)
    per = max(len(blocks) // num_replicas, 1)
    groups: list[list[jax.Device]] = [[] for _ in range(num_replicas)]
    for i, block in enumerate(blocks):
        groups[min(i // per, num_replicas - 1)].extend(block)
    return groups


def local_replica_devices(sharding: Any, num_replicas: int) -> list[tuple[int, list[jax.Device]]]:
    """``(replica id, this process's devices of it)`` for each replica this process holds."""
    me = jax.process_index()
    groups = [
        (i, [d for d in group if d.process_index == me])
        for i, group in enumerate(replica_devices(sharding, num_replicas))
    ]
    return [(i, group) for i, group in groups if group]


def _spec_axes(spec: Any) -> set[str]:
    axes: set[str] = set()
    for entry in spec:
        if isinstance(entry, str):
            axes.add(entry)
        elif entry is not None:
            axes.update(entry)
    return axes


def _replicas_whole(value: jax.Array) -> jax.Array:
    """`value` with every device holding whole replicas' values (no split besides replicas).

    `Strategy.run` leaves the layout over a mesh's other axes to XLA, so a per-replica
    output can come back also split over e.g. ``"model"``; reading it needs it whole.
    """
    sharding = value.sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or len(mesh.axis_names) == 1:
        return value
    target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(replica_axis_of(sharding)))
    if sharding.is_equivalent_to(target, value.ndim):
        return value
    return jax.device_put(value, target)


def local_results(leaf: Any, axis_name: str | None = None) -> tuple[Any, ...]:
    """One value per local replica for a single leaf, in replica order.

    Args:
      leaf: a `PerReplica`, or an array (a mirrored value when replicated over the
        replicas), or anything else (a 1-tuple then).
      axis_name: the strategy's data axis, which tells replicas of a mirrored array apart
        on an N-D mesh; None: every device is a replica.
    """
    if isinstance(leaf, PerReplica):
        value = _replicas_whole(leaf.value)
        n = max(leaf.num_replicas, 1)
        rows = max(value.shape[0] // n, 1)
        by_replica: dict[int, Any] = {}
        for shard in value.addressable_shards:
            start = (shard.index[0].start or 0) if shard.index else 0
            by_replica.setdefault(start // rows, shard.data)
        out = [by_replica[r] for r in sorted(by_replica)]
        return tuple(x[0] for x in out) if leaf.stacked else tuple(out)
    if not isinstance(leaf, jax.Array) or len(leaf.sharding.device_set) < 2:
        return (leaf,)
    mesh = getattr(leaf.sharding, "mesh", None)
    if axis_name is not None and mesh is not None and len(mesh.axis_names) > 1:
        spec = getattr(leaf.sharding, "spec", ())
        if axis_name not in mesh.axis_names or axis_name in _spec_axes(spec):
            return (leaf,)
        whole = leaf
        if not leaf.sharding.is_fully_replicated:
            whole = jax.device_put(
                leaf, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            )
        by_device = {s.device: s.data for s in whole.addressable_shards}
        by_position = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))
        groups = replica_devices(by_position, int(mesh.shape[axis_name]))
        return tuple(
            by_device[local[0]]
            for local in ([d for d in g if d in by_device] for g in groups)
            if local
        )
    if leaf.sharding.is_fully_replicated:
        by_device = {s.device: s.data for s in leaf.addressable_shards}
        return tuple(by_device[d] for d in local_devices_of(leaf))
    return (leaf,)


def varying_axes(x: Any) -> frozenset:
    """The mesh axes along which traced `x` may differ (its "varying manual axes")."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def device_put_global(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """`jax.device_put` that also works when `sharding` spans other processes' devices.

    Every process passes the same (global) values; each places the pieces its own devices
    hold. In one process this is exactly `jax.device_put`.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def put(leaf: Any) -> jax.Array:
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        if is_key(leaf):
            return keys_from_data(put(key_data(leaf)), jax.random.key_impl(leaf))
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def to_host(tree: Any) -> Any:
    """NumPy copies of a pytree's arrays, wherever their pieces live.

    An array split across the devices of several processes (an FSDP variable) is gathered
    from the other processes first, a collective: every process must call this together.
    In one process, or for arrays each process holds whole, it is `jax.device_get`.

    Example:

    >>> import jax.numpy as jnp
    >>> to_host({"w": jnp.ones(2)})["w"]
    array([1., 1.], dtype=float32)
    """

    def gather(leaf: Any) -> Any:
        if (
            isinstance(leaf, jax.Array)
            and not leaf.is_fully_addressable
            and not leaf.sharding.is_fully_replicated
        ):
            return multihost_utils.process_allgather(leaf, tiled=True)
        return leaf

    return jax.device_get(jax.tree.map(gather, tree))


# Typed PRNG keys as their raw data --------------------------------------------------------
def is_key(x: Any) -> bool:
    """Whether `x` is an array of typed PRNG keys (``jax.random.key``, not raw ``uint32``).

    Example:

    >>> is_key(jax.random.key(0)), is_key(jax.random.PRNGKey(0))
    (True, False)
    """
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data(x: Any) -> Any:
    """`x`'s raw key data if it is typed keys (`is_key`), else `x` itself."""
    return jax.random.key_data(x) if is_key(x) else x


def keys_from_data(data: Any, impl: Any) -> jax.Array:
    """Typed keys of implementation `impl` (as ``jax.random.key_impl`` names it) back from
    their raw `data`: the inverse of `key_data`."""
    return jax.random.wrap_key_data(data, impl=impl)


def keys_as_data(tree: Any) -> Any:
    """`tree` with each typed PRNG key array replaced by its raw key data (checkpoints hold
    plain arrays only); `keys_like` undoes it.

    Example:

    >>> saved = keys_as_data({"rng": jax.random.key(0)})
    >>> saved["rng"].dtype, saved["rng"].shape
    (dtype('uint32'), (2,))
    """
    return jax.tree.map(key_data, tree)


def keys_like(saved: Any, like: Any) -> Any:
    """`saved` (restored from ``keys_as_data(like)``) with typed keys where `like` has them.

    Args:
      saved: a pytree with the structure of ``keys_as_data(like)``.
      like: the pytree whose typed PRNG keys (and their implementation) are restored.

    Returns:
      `saved`, with raw key data wrapped back into typed keys.
    """

    def back(s: Any, original: Any) -> Any:
        if not is_key(original):
            return s
        if isinstance(s, jax.Array):
            # Laid out as the keys are: a key's data must be whole on each device, and a
            # strategy that splits small arrays (FSDP) may have read it split.
            s = jax.device_put(s, original.sharding)
        return keys_from_data(s, jax.random.key_impl(original))

    return jax.tree.map(back, saved, like)
