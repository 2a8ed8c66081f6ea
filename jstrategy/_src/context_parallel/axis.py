"""The context axis a train step splits the sequence over, and which batch arrays carry it
(how the step, the input and `strategy.run` use it: docs/ARCHITECTURE.md)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import axes
from jstrategy._src import trace_context

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = [
    "CONTEXT_AXIS",
    "ContextAxis",
    "applying",
    "batch_shardings",
    "carries_sequence",
    "check_sequence",
    "current",
    "of_mesh",
    "refused",
    "refusing",
    "split_sequence",
]

#: The mesh axis name the sharded strategies split the sequence over.
CONTEXT_AXIS = axes.CONTEXT_AXIS


@dataclasses.dataclass(frozen=True)
class ContextAxis:
    """Where a train step's sequence is split.

    Attributes:
      mesh: the strategy's mesh.
      name: the mesh axis the sequence is split over (`CONTEXT_AXIS`).
      size: how many shards the sequence has (the axis's size).
      data_axis: the ``spmd_axis_name`` of the step's map over the replicas.
      rows: the mesh's other axes a batch's rows are split over after the data axis
        (`axes.ROW_AXES`).
    """

    mesh: Mesh
    name: str
    size: int
    data_axis: str
    rows: tuple[str, ...] = ()

    @property
    def row_spec(self) -> str | tuple[str, ...]:
        """The `PartitionSpec` entry of a batch's rows: the data axis, then `rows`."""
        return (self.data_axis, *self.rows) if self.rows else self.data_axis


def of_mesh(mesh: Mesh, data_axis: str) -> ContextAxis | None:
    """The context axis of `mesh`: its `CONTEXT_AXIS` when larger than one, else None.

    Example:

    >>> import jax, numpy as np
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "context"))
    >>> of_mesh(mesh, "replica").size
    4
    """
    size = int(mesh.shape.get(CONTEXT_AXIS, 1))
    if size == 1 or data_axis == CONTEXT_AXIS:
        return None
    rows = tuple(a for a in axes.ROW_AXES if a in mesh.axis_names and a != data_axis)
    return ContextAxis(mesh, CONTEXT_AXIS, size, data_axis, rows)


def applying(axis: ContextAxis | None) -> contextlib.AbstractContextManager[Any]:
    """`axis` is the current context axis while the body (a train step's trace) runs."""
    return trace_context.replaced(context_axis=axis)


def current() -> ContextAxis | None:
    """The context axis of the train step being traced; None elsewhere.

    Example:

    >>> current() is None
    True
    """
    return trace_context.current().context_axis  # type: ignore[no-any-return]


def refusing(strategy: StrategyLike, where: str) -> contextlib.AbstractContextManager[Any]:
    """While the body runs (`where`'s trace: a program of `strategy` that splits no
    sequence, `strategy.run`), the attention refuses `strategy`'s context axis (`refused`)."""
    axis = of_mesh(strategy.mesh, strategy.axis_name)
    if axis is None:
        return contextlib.nullcontext()
    size = axis.size
    # What `refused` says after the call's name.
    return trace_context.replaced(
        context_refusal=f"was called inside {where} of a {type(strategy).__name__} with "
        f"context={size}: context parallelism (ring attention over the "
        f"{CONTEXT_AXIS!r} axis, each sequence split {size} ways) engages only in "
        "the train steps of jstrategy.training.make_train_step and Model.fit, and here it "
        f"would silently compute full attention on each of the {size} devices of "
        "a replica. Train with make_train_step or Model.fit (evaluate with make_eval_step "
        "or Model.evaluate), or build the strategy with context=1 for a custom loop over "
        f"{where}."
    )


def refused(what: str) -> None:
    """Raises if `what` (an attention call) is traced inside `refusing` and outside a
    train step's `applying`.

    Raises:
      ValueError: naming context parallelism, where the call is and the fix.

    Example:

    >>> refused("dot_product_attention")  # outside any program: nothing to refuse
    """
    refusal = trace_context.current().context_refusal
    if refusal is not None and current() is None:
        raise ValueError(f"{what} {refusal}")


def _sequence(batch: Any, lead: int) -> tuple[int, str, tuple[int, ...]] | None:
    """(length, path, shape) of the features' array (two or more dimensions after `lead`)
    with the longest dimension 1, the first of equals, which sets the sequence; or None."""
    # ``x`` of ``(x,)``, ``(x, y)`` or ``(x, y, w)``, as `unpack_batch` reads it.
    features = batch[0] if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 3 else batch
    found = None
    for path, leaf in jax.tree_util.tree_leaves_with_path(features):
        shape = tuple(getattr(leaf, "shape", ()))
        if len(shape) >= lead + 2 and (found is None or shape[lead + 1] > found[0]):
            where = jax.tree_util.keystr(path)
            found = (shape[lead + 1], f"x{where}" if features is not batch else where, shape)
    return found


def carries_sequence(batch: Any, lead: int = 0) -> Any:
    """For each array of `batch`, whether it carries the sequence: two or more dimensions
    (after `lead` stacked axes) and its dimension 1 the sequence length, the longest
    dimension 1 of the features' arrays (``x`` of ``(x, y[, w])``, else the whole batch).

    Example:

    >>> import numpy as np
    >>> tokens, one_hot = np.zeros((8, 64), np.int32), np.zeros((8, 3))
    >>> carries_sequence((tokens, one_hot)), carries_sequence({"x": tokens, "y": tokens})
    ((True, False), {'x': True, 'y': True})
    """
    found = _sequence(batch, lead)

    def carries(leaf: Any) -> bool:
        shape = tuple(getattr(leaf, "shape", ()))
        return found is not None and len(shape) >= lead + 2 and shape[lead + 1] == found[0]

    return jax.tree.map(carries, batch)


def check_sequence(batch: Any, size: int) -> None:
    """Refuses a batch whose sequence length (`carries_sequence`) does not split in `size`.

    Raises:
      ValueError: naming the array, its shape, the context degree and the fix.

    Example:

    >>> import numpy as np
    >>> check_sequence((np.zeros((2, 6)), np.zeros((2, 3))), 4)
    Traceback (most recent call last):
    ...
    ValueError: Under context parallelism (context=4) ...
    """
    found = _sequence(batch, 0)
    if found is not None and found[0] % size:
        length, where, shape = found
        raise ValueError(
            f"Under context parallelism (context={size}) the sequence is the longest "
            "dimension 1 of the inputs' arrays of two or more dimensions, split over the "
            f"{size} shards of the {CONTEXT_AXIS!r} axis; the batch's array at "
            f"{where or 'the top'} has shape {shape}, whose dimension 1 ({length}) does not "
            f"divide by {size}. Pad the sequences to a multiple of {size} (masking the "
            f"padding), or choose a context degree that divides {length}."
        )


def batch_shardings(strategy: StrategyLike, batch: Any, base: NamedSharding | None = None) -> Any:
    """Where each array of a global training batch goes: `base`, and, under a context axis
    whose degree divides the sequence, for the arrays that carry it (`carries_sequence`)
    also split along their sequence dimension over the context axis.

    Args:
      strategy: the strategy the batch is for.
      batch: the batch's arrays, or their shapes (anything with ``.shape``).
      base: where the rows go (by default `Strategy.batch_sharding`); its spec's last entry
        is the rows' dimension (after any stacked steps' axis), the sequence the next.

    Returns:
      A `NamedSharding` for each array of `batch`, in its structure.

    Example:

    >>> import numpy as np, jstrategy
    >>> strategy = jstrategy.experimental.FSDPStrategy(context=4)
    >>> tokens, one_hot = np.zeros((8, 64), np.int32), np.zeros((8, 3))
    >>> [s.spec for s in batch_shardings(strategy, (tokens, one_hot))]
    [P('replica', 'context'), P('replica',)]
    """
    base = strategy.batch_sharding() if base is None else base
    axis = of_mesh(strategy.mesh, strategy.axis_name)
    lead = len(base.spec) - 1
    found = _sequence(batch, lead) if axis is not None else None
    if axis is None or found is None or found[0] % axis.size:
        return jax.tree.map(lambda _: base, batch)
    along = NamedSharding(base.mesh, P(*base.spec, axis.name), memory_kind=base.memory_kind)
    return jax.tree.map(lambda s: along if s else base, carries_sequence(batch, lead))


def split_sequence(batch: Any, axis: ContextAxis) -> Any:
    """One step's global `batch`, checked, its arrays carrying the sequence split by rows
    over the data axis and along dimension 1 over the context axis (already so when placed
    by `batch_shardings`, else by a local slice per device)."""
    check_sequence(batch, axis.size)
    sharding = NamedSharding(axis.mesh, P(axis.row_spec, axis.name))

    def split(leaf: Any, carries: bool) -> Any:
        return jax.lax.with_sharding_constraint(leaf, sharding) if carries else leaf

    return jax.tree.map(split, batch, carries_sequence(batch))
