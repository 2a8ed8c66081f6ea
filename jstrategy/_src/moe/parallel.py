"""Expert parallelism: each device computes its own experts on the tokens sent to it.

Inside a step traced under a mesh with an expert axis of size k (`axis.expert_degree`),
`expert_parallel` runs the layer in ``jax.shard_map`` over the mesh (the step's ``vmap``
over the replicas keeps each replica's rows on its devices; XLA gathers FSDP's slices of
the weights at the boundary, as it does for any layer). The rows a replica is given are
split over its row axes (``"fsdp"`` where the mesh has one, and ``"expert"``; padded to a
multiple of their size: a row is routed on its own, so padding rows change nothing), and
each device:

1. routes its rows (`routing.route`) and fills each expert's slots, ``[E, rows, C, D]``;
2. sends expert group g's slots to device g: ``all_to_all`` over the expert axis;
3. runs its ``E / k`` experts (the weights' slice it holds) on every device's slots: with
   a tensor axis of size t that divides the hidden units, its ``1/t`` of each expert's
   hidden units, the partial outputs summed over the tensor axis (Megatron's MLP);
4. sends the results back (``all_to_all``) and combines them with its routing weights.

The routing of a row is the dense path's, so the trajectory is one device's whatever k.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jstrategy._src import axes
from jstrategy._src.moe.axis import EXPERT_AXIS
from jstrategy._src.moe.axis import check_divides
from jstrategy._src.moe.axis import tensor_degree
from jstrategy._src.moe.routing import Routing
from jstrategy._src.moe.routing import route_tokens

__all__ = ["expert_parallel"]


def _swiglu(slots: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array) -> jax.Array:
    """Experts ``e`` of `wi_0`... on their slots ``[..., e, rows, C, D]``."""
    gate = jnp.einsum("...ebcd,edf->...ebcf", slots, wi_0)
    up = jnp.einsum("...ebcd,edf->...ebcf", slots, wi_1)
    return jnp.einsum("...ebcf,efd->...ebcd", jax.nn.silu(gate) * up, wo)


def dense_experts(
    tokens: jax.Array, routing: Routing, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array
) -> jax.Array:
    """Every expert on this device: dispatch, SwiGLU, combine (``[rows, tokens, D]``)."""
    slots = jnp.einsum("btd,btec->ebcd", tokens, routing.dispatch.astype(tokens.dtype))
    out = _swiglu(slots, wi_0, wi_1, wo)
    return jnp.einsum("ebcd,btec->btd", out, routing.combine.astype(tokens.dtype))


def _bound(name: str) -> bool:
    """Whether `name` is a mapped axis here (the step's ``vmap`` over the replicas)."""
    try:
        jax.lax.axis_size(name)
    except NameError:
        return False
    return True


def expert_parallel(
    tokens: jax.Array,
    router: jax.Array,
    weights: tuple[jax.Array, jax.Array, jax.Array],
    settings: dict[str, Any],
    degree: int,
) -> tuple[jax.Array, Routing]:
    """The layer on `tokens` (``[rows, tokens, D]``) with its experts split `degree` ways
    over the expert axis: ``(output, routing)``, the routing without dispatch masks."""
    num_experts = settings["num_experts"]
    check_divides(num_experts, degree)
    mesh = jax.sharding.get_abstract_mesh()
    # The rows' axes: inside the step's map over the replicas (its axis bound) the map
    # adds the replicas' axis itself; elsewhere (prediction, evaluation) the rows stay
    # split over it as they arrive.
    # (Axes of size one are left out: XLA's partitioner aborts on some of these maps
    # whose specs name one in a tuple of axes.)
    row_axes = tuple(
        a
        for a in axes.ROW_AXES
        if int(dict(mesh.shape).get(a, 1)) > 1 and not (a == axes.REPLICA_AXIS and _bound(a))
    )
    split = math.prod(int(mesh.shape[a]) for a in row_axes)
    rows = tokens.shape[0]
    padded = -(-rows // split) * split
    if padded != rows:
        tokens = jnp.pad(tokens, ((0, padded - rows), (0, 0), (0, 0)))
    if mesh.manual_axes:
        # Inside `strategy.run`'s map (manual over the replicas), the tokens enter whole:
        # left to propagation, a split the map asks of an embedding lookup's output made
        # XLA's partitioner abort (the lookup's table split by FSDP, see
        # `staging.rows_beyond_data_axis`).
        tokens = jax.lax.with_sharding_constraint(tokens, P())
    tensor = tensor_degree()
    tensor = tensor if tensor > 1 and weights[0].shape[-1] % tensor == 0 else 1

    def local(x: jax.Array, router: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array):
        routing = route_tokens(x, router, settings)
        slots = jnp.einsum("btd,btec->ebcd", x, routing.dispatch.astype(x.dtype))
        groups = slots.reshape(degree, num_experts // degree, *slots.shape[1:])
        # Group g of every device's slots to device g; it returns them computed.
        received = jax.lax.all_to_all(groups, EXPERT_AXIS, 0, 0, tiled=True)
        computed = _swiglu(received, wi_0, wi_1, wo)
        if tensor > 1:  # each tensor device held 1/t of the hidden units: partial sums
            computed = jax.lax.psum(computed, axes.TENSOR_AXIS)
        returned = jax.lax.all_to_all(computed, EXPERT_AXIS, 0, 0, tiled=True)
        out = returned.reshape(slots.shape)
        y = jnp.einsum("ebcd,btec->btd", out, routing.combine.astype(x.dtype))
        return y, routing.dropped, routing.load_balance, routing.z_loss

    by_rows = P(row_axes)
    hidden = axes.TENSOR_AXIS if tensor > 1 else None
    w_in, w_out = P(EXPERT_AXIS, None, hidden), P(EXPERT_AXIS, hidden, None)
    y, dropped, balance, z = jax.shard_map(
        local,
        in_specs=(by_rows, P(), w_in, w_in, w_out),
        out_specs=(by_rows, by_rows, by_rows, by_rows),
        check_vma=False,
    )(tokens, router, *weights)
    if mesh.manual_axes:
        y, dropped, balance, z = jax.lax.with_sharding_constraint((y, dropped, balance, z), P())
    empty = jnp.zeros((rows, tokens.shape[1], 0, 0), jnp.float32)  # masks stay on devices
    return y[:rows], Routing(empty, empty, dropped[:rows], balance[:rows], z[:rows])
