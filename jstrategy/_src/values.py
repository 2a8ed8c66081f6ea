"""Per-replica values: one array holding every replica's value, laid over the mesh."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["PerReplica", "is_per_replica", "local_devices_of", "varying_axes"]


@jax.tree_util.register_pytree_node_class
class PerReplica:
    """One value per replica, stored as a single global `jax.Array` sharded over the mesh.

    Two layouts exist, both with the replica axis first and split across the strategy's
    devices:

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
    """

    __slots__ = ("mask", "stacked", "value")

    def __init__(self, value: Any, *, stacked: bool = True, mask: Any = None):
        if stacked and mask is not None:
            raise ValueError("`mask` is only meaningful for split (stacked=False) values.")
        self.value = value
        self.stacked = stacked
        self.mask = mask

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
        sharding = getattr(self.value, "sharding", None)
        if sharding is None:
            return int(self.value.shape[0]) if self.stacked else 1
        return int(np.prod(sharding.mesh.devices.shape)) if hasattr(sharding, "mesh") else 1

    @property
    def values(self) -> tuple[Any, ...]:
        """This process's replicas' values, in replica order (as TF's ``.values``)."""
        return local_results(self)

    def __repr__(self) -> str:
        return f"PerReplica(shape={self.shape}, dtype={self.dtype}, replicas={self.num_replicas})"


def is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def local_devices_of(array: jax.Array) -> list[jax.Device]:
    """The devices of `array`'s mesh that belong to this process, in mesh order."""
    sharding = array.sharding
    if hasattr(sharding, "mesh"):
        devices = list(sharding.mesh.devices.flat)
    else:
        devices = sorted(sharding.device_set, key=lambda d: d.id)
    me = jax.process_index()
    return [d for d in devices if d.process_index == me]


def local_results(leaf: Any) -> tuple[Any, ...]:
    """One value per local replica for a single leaf, in replica order."""
    if isinstance(leaf, PerReplica):
        by_device = {s.device: s.data for s in leaf.value.addressable_shards}
        out = [by_device[d] for d in local_devices_of(leaf.value)]
        return tuple(x[0] for x in out) if leaf.stacked else tuple(out)
    if (
        isinstance(leaf, jax.Array)
        and len(leaf.sharding.device_set) > 1
        and leaf.sharding.is_fully_replicated
    ):
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
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = put(jax.random.key_data(leaf))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)
