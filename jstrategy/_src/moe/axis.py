"""The expert axis: the mesh axis that expert parallelism splits the experts over.

`FSDPStrategy(experts=k)` lays its devices as ``("replica", "expert")``; the expert layers
annotate their stacked weights' leading axis with `EXPERT_AXIS`, so the strategy keeps
each device's experts only. While a step is traced under such a mesh (`expert_degree` > 1),
the layers dispatch tokens to the experts' devices with ``all_to_all`` over this axis
(`jstrategy._src.moe.parallel`); under any other mesh they compute every expert densely.
"""

from __future__ import annotations

import jax

from jstrategy._src import axes

__all__ = ["EXPERT_AXIS", "EXPERT_HIDDEN", "check_divides", "expert_degree", "tensor_degree"]

#: The mesh axis the experts are split over.
EXPERT_AXIS = axes.EXPERT_AXIS

#: The logical name of the experts' hidden units: a strategy with a tensor axis maps it
#: there (`ParallelStrategy`'s rule), splitting each expert Megatron-style.
EXPERT_HIDDEN = "expert_hidden"


def expert_degree() -> int:
    """The size of the expert axis of the mesh being traced under (1 without one).

    Example:

    >>> expert_degree()
    1
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[EXPERT_AXIS])


def tensor_degree() -> int:
    """The size of the tensor axis of the mesh being traced under (1 without one).

    Example:

    >>> tensor_degree()
    1
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axes.TENSOR_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[axes.TENSOR_AXIS])


def check_divides(num_experts: int, degree: int) -> None:
    """Refuses an expert degree that does not divide `num_experts`, naming the fix.

    Example:

    >>> check_divides(6, 4)
    Traceback (most recent call last):
    ...
    ValueError: The strategy's expert degree (`experts`=4) must divide the layer's `num_experts` (6): each device holds num_experts / experts experts. Pass experts=2 or 3 or 6 to the strategy (or 1), or num_experts=8.
    """
    if num_experts % degree == 0:
        return
    divisors = [d for d in range(2, num_experts + 1) if num_experts % d == 0]
    raise ValueError(
        f"The strategy's expert degree (`experts`={degree}) must divide the layer's "
        f"`num_experts` ({num_experts}): each device holds num_experts / experts experts. "
        f"Pass experts={' or '.join(map(str, divisors))} to the strategy (or 1), or "
        f"num_experts={-(-num_experts // degree) * degree}."
    )
