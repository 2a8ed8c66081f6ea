"""The context axis: which mesh axis a train step splits the sequence over.

A sharded strategy whose mesh has an axis named `CONTEXT_AXIS` (``"context"``) of size
greater than one (``FSDPStrategy(context=k)``, or a `DeviceMesh` with that axis under
`ModelParallelStrategy`) splits every batch array of two or more dimensions along its
dimension 1, the sequence, over that axis (`split_sequence`), and traces the train step's
forward pass inside `applying`, whose `ContextAxis` `jstrategy.experimental.
dot_product_attention` reads to run ring attention over it. The step stays in the global
view: the loss is a global sum over every token, reduced over the data and context axes by
XLA, so its mean is one device's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["CONTEXT_AXIS", "ContextAxis", "applying", "check_sequence", "current", "of_mesh"]

#: The mesh axis name the sharded strategies split the sequence over.
CONTEXT_AXIS = "context"


@dataclasses.dataclass(frozen=True)
class ContextAxis:
    """Where a train step's sequence is split.

    Attributes:
      mesh: the strategy's mesh.
      name: the mesh axis the sequence is split over (`CONTEXT_AXIS`).
      size: how many shards the sequence has (the axis's size).
      data_axis: the step's data axis: the ``spmd_axis_name`` of the map over the replicas
        the forward pass runs in, which an attention region inside it makes manual too.
    """

    mesh: Mesh
    name: str
    size: int
    data_axis: str


_CURRENT: contextvars.ContextVar[ContextAxis | None] = contextvars.ContextVar(
    "jstrategy_context_axis", default=None
)


def of_mesh(mesh: Mesh, data_axis: str) -> ContextAxis | None:
    """The context axis of `mesh`: its `CONTEXT_AXIS` when larger than one, else None.

    Example:

    >>> import jax, numpy as np
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "context"))
    >>> of_mesh(mesh, "replica").size
    4
    """
    if CONTEXT_AXIS not in mesh.axis_names or data_axis == CONTEXT_AXIS:
        return None
    size = int(mesh.shape[CONTEXT_AXIS])
    return ContextAxis(mesh, CONTEXT_AXIS, size, data_axis) if size > 1 else None


@contextlib.contextmanager
def applying(axis: ContextAxis | None) -> Iterator[None]:
    """`axis` is the current context axis while the body runs (a train step's trace)."""
    token = _CURRENT.set(axis)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> ContextAxis | None:
    """The context axis of the train step being traced; None elsewhere.

    Example:

    >>> current() is None
    True
    """
    return _CURRENT.get()


def check_sequence(batch: Any, size: int) -> None:
    """Refuses a batch whose arrays' sequences do not split into `size` shards.

    Every array of two or more dimensions has its sequence as dimension 1.

    Raises:
      ValueError: naming the array, its shape, the context degree and the fix.

    Example:

    >>> import numpy as np
    >>> check_sequence({"tokens": np.zeros((2, 6)), "labels": np.zeros((2,))}, 4)
    Traceback (most recent call last):
    ...
    ValueError: Under context parallelism (context=4) ...
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = tuple(getattr(leaf, "shape", ()))
        if len(shape) >= 2 and shape[1] % size:
            raise ValueError(
                f"Under context parallelism (context={size}) every batch array of two or "
                "more dimensions has its sequence as dimension 1, split over the "
                f"{size} shards of the {CONTEXT_AXIS!r} axis; the batch's array at "
                f"{jax.tree_util.keystr(path) or 'the top'} has shape {shape}, whose "
                f"dimension 1 ({shape[1]}) does not divide by {size}. Pad the sequences to "
                f"a multiple of {size} (masking the padding), or choose a context degree "
                f"that divides {shape[1]}."
            )


def split_sequence(batch: Any, axis: ContextAxis) -> Any:
    """`batch` (one step's global batch) with each array's rows over the data axis and its
    sequence (dimension 1) over the context axis, after `check_sequence`.

    The batch arrives split by rows only (the same on every shard of the context axis), so
    this is a local slice per device, no communication.
    """
    check_sequence(batch, axis.size)

    def split(leaf: Any) -> Any:
        if getattr(leaf, "ndim", 0) < 2:
            return leaf
        return jax.lax.with_sharding_constraint(
            leaf, NamedSharding(axis.mesh, P(axis.data_axis, axis.name))
        )

    return jax.tree.map(split, batch)
