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
over (`Strategy.activation_rows`). Only the rows, and under a tensor layout one more dimension:
the other dimensions stay XLA's choice (unconstrained), so a sequence split over the
context axis is kept.

Under a tensor layout (a mesh axis named ``"model"``, as ModelParallelStrategy's Keras-style
meshes name it, or ``"tensor"``, HybridStrategy's, of more than one device) a sequence
model's block input (three dimensions or more) is also split over that axis, as the
strategy's ``tensor_activations`` says (`TensorActivations`):

* ``FEATURES`` (the default), in a step with ``remat`` set: its last dimension, as MaxText's
  rules split each layer's input (``activation_embed`` on ``tensor``). Left to itself, XLA
  kept every layer's input whole on each device of the tensor axis, and a scan saved all
  of them for the backward pass: llama2-7B under data 2 x tensor 8 on a v5p-32 peaked at
  24.22 GiB a chip, 1.42x MaxText's 17.07 (`benchmarks/maxtext_topology.py`); split,
  16.99 GiB (each chip keeps an eighth of the saved inputs: 1 GiB, not 8). Without remat
  the split only adds collectives (a Megatron block's all-reduce becomes an all-gather and
  a reduce-scatter around it), so the step leaves it out there.
* ``SEQUENCE``, with or without remat: its second dimension, the sequence (Megatron's
  sequence parallelism): the norms and residual adds between the tensor-split matmuls run
  on a slice of the tokens, each block's all-reduce becoming a reduce-scatter into the
  slice and an all-gather out of it.

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
import enum
import math
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import trace_context
from jstrategy._src.validation import check_mode

__all__ = [
    "Placement",
    "TensorActivations",
    "current",
    "place",
    "placement",
    "placing",
    "suspended",
]


class TensorActivations(enum.Enum):
    """Which dimension of the activations between a model's blocks a sharded train step
    splits over the tensor axis (``tensor_activations=`` of `ParallelStrategy`,
    `HybridStrategy` and `ModelParallelStrategy`).

    Attributes:
      FEATURES: the last dimension, in a step with ``remat`` set (MaxText's
        ``activation_embed`` rule): the saved block inputs take a tensor degree's share.
      SEQUENCE: the sequence (dimension 1), with or without remat (Megatron's sequence
        parallelism): the norms and residual adds between blocks also run on a share.

    Example:

    >>> import jstrategy
    >>> jstrategy.experimental.HybridStrategy(
    ...     fsdp=4, tensor=2,
    ...     tensor_activations=jstrategy.experimental.TensorActivations.SEQUENCE,
    ... ).tensor_activations
    <TensorActivations.SEQUENCE: 'sequence'>
    """

    FEATURES = "features"
    SEQUENCE = "sequence"

    @classmethod
    def of(cls, value: Any) -> TensorActivations:
        """`value` (a member or its name) as a member; a clear error for any other."""
        fix = "Pass e.g. tensor_activations='sequence'."
        return check_mode(value, cls, "tensor_activations", fix)  # type: ignore[no-any-return]


#: The constraint in the replicas' map (`trace_context.TraceContext.activation_rows`):
#: (mesh, the row axes other than the map's, the tensor axis or None, the dimension it
#: splits: -1 the features, 1 the sequence).
Placement = tuple[Any, tuple[str, ...], str | None, int]

#: The names of a tensor-parallel axis: ModelParallelStrategy's (Keras's ``"model"``) and
#: HybridStrategy's (``"tensor"``).
TENSOR_AXES = ("model", "tensor")


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def placement(
    mesh: Any,
    rows: Any,
    mapped: str,
    *,
    split: TensorActivations | None = TensorActivations.FEATURES,
) -> Placement | None:
    """What `place` reads while a step traces its replicas' forward pass: rows split over
    `rows` (a `PartitionSpec` entry: a mesh axis, a tuple of them, or None for nothing
    placed), less `mapped`, the axis of the replicas' ``vmap`` (its ``spmd_axis_name``),
    which the map puts back on the replicas' dimension; a sequence model's dimension that
    `split` names over the tensor axis too (None: no tensor split). The step passes
    ``FEATURES`` under remat only (see the module's docstring).
    """
    if rows is None:
        return None
    row_axes = tuple(a for a in _axes(rows) if a != mapped)
    tensor = [
        a
        for a in TENSOR_AXES
        if split is not None and a in mesh.shape and int(mesh.shape[a]) > 1 and a not in _axes(rows)
    ]
    dim = 1 if split is TensorActivations.SEQUENCE else -1
    return (mesh, row_axes, tensor[0] if tensor else None, dim)


def placing(
    mesh: Any,
    rows: Any,
    mapped: str,
    *,
    split: TensorActivations | None = TensorActivations.FEATURES,
) -> contextlib.AbstractContextManager[Any]:
    """Within: `place` places as `placement` says (the step sets it in its one
    `trace_context.TraceContext`; this is that field alone)."""
    return trace_context.replaced(activation_rows=placement(mesh, rows, mapped, split=split))


def suspended() -> contextlib.AbstractContextManager[Any]:
    """Within: `place` constrains nothing (a pipeline's stages: their rows are microbatches,
    their leading dimension the stages)."""
    return trace_context.replaced(activation_rows=None)


def current() -> bool:
    """Whether `place` is in effect: a sharded train step is tracing its forward pass.

    Example:

    >>> current()
    False
    """
    return trace_context.current().activation_rows is not None


def place(x: Any) -> Any:
    """`x` with its rows (dimension 0) split over the step's row axes (and, under a tensor
    layout, a sequence model's features or sequence over the tensor axis), its other
    dimensions left to XLA; `x` as it is where nothing is placed (see the module's
    docstring)."""
    value = trace_context.current().activation_rows
    if value is None or not isinstance(x, jax.Array) or x.ndim == 0:
        return x
    if jax.sharding.get_abstract_mesh().manual_axes:
        return x  # a shard_map's body: its values are per device
    mesh, axes, tensor, dim = value
    if x.shape[0] % math.prod(int(mesh.shape[a]) for a in axes):
        return x
    spec: list[Any] = [P.UNCONSTRAINED] * x.ndim
    spec[0] = None if not axes else axes[0] if len(axes) == 1 else axes
    if tensor is not None and x.ndim >= 3 and x.shape[dim] % int(mesh.shape[tensor]) == 0:
        spec[dim] = tensor
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))
