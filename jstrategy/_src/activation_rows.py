"""Where a sharded train step keeps the activations between a model's blocks: split by rows.

In the global view (`staging.sharded_train_program`) nothing in the step says how the
activations inside a model are laid out, and XLA's partitioner is free to choose. Under
FSDP with scanned layers it chose badly: meeting each layer's weights split over the data
axis inside the loop, it gathered the *activations* of every replica instead (each device
then held the whole batch's, and moved them at every layer), where MaxText's layers pin
their inputs to the batch's split and gather the weights. So the step pins them too: while
it traces the replicas' forward pass (`placing`), the input of every block the model marks
(`jstrategy.training.remat`, and each layer of a `Repeated` block run in order) is
constrained (`place`) to its rows' split over the axes the step splits the batch's rows
over (`Strategy.activation_rows`). Only the rows: the other dimensions stay XLA's choice
(unconstrained), so a sequence split over the context axis, or a model's own constraint
on its features, is kept.

The forward pass runs inside the replicas' ``vmap``, whose ``spmd_axis_name`` (the data
axis) lays the mapped replicas out: the constraint names the other row axes only
(HybridStrategy's ``"fsdp"``, none under FSDP), and the map adds the data axis on the
replicas' dimension.

Nothing is constrained outside `placing` (evaluation, prediction, the manual-region steps
of Mirrored, OneDevice, TPU), inside a manual region (a ``shard_map``: there values are
per device), inside a pipeline's stages (`suspended`: there the rows are microbatches laid
out over the stages), or for an input whose rows do not divide among the row axes.

This module is core: the training layer's `remat` and the pipeline's `Repeated` read it,
and the step enters it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["current", "place", "placing", "suspended"]

# The rows' constraint in the replicas' map: (mesh, the row axes other than the map's).
_CURRENT: contextvars.ContextVar[tuple[Any, tuple[str, ...]] | None] = contextvars.ContextVar(
    "jstrategy_activation_rows", default=None
)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@contextlib.contextmanager
def placing(mesh: Any, rows: Any, mapped: str) -> Iterator[None]:
    """Within: `place` splits rows over `rows` (a `PartitionSpec` entry: a mesh axis, a
    tuple of them, or None for nothing placed), less `mapped`, the axis of the replicas'
    ``vmap`` (its ``spmd_axis_name``), which the map puts back on the replicas' dimension.
    """
    value = None if rows is None else (mesh, tuple(a for a in _axes(rows) if a != mapped))
    token = _CURRENT.set(value)
    try:
        yield
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Within: `place` constrains nothing (a pipeline's stages: their rows are microbatches,
    their leading dimension the stages)."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> bool:
    """Whether `place` is in effect: a sharded train step is tracing its forward pass.

    Example:

    >>> current()
    False
    """
    return _CURRENT.get() is not None


def place(x: Any) -> Any:
    """`x` with its rows (dimension 0) split over the step's row axes, its other dimensions
    left to XLA; `x` as it is where nothing is placed (see the module's docstring)."""
    value = _CURRENT.get()
    if value is None or not isinstance(x, jax.Array) or x.ndim == 0:
        return x
    if jax.sharding.get_abstract_mesh().manual_axes:
        return x  # a shard_map's body: its values are per device
    mesh, axes = value
    if x.shape[0] % math.prod(int(mesh.shape[a]) for a in axes):
        return x
    rows = None if not axes else axes[0] if len(axes) == 1 else axes
    spec = P(rows, *[P.UNCONSTRAINED] * (x.ndim - 1))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
