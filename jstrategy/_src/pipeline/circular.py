"""Circular (interleaved) pipelines: each device holds several virtual stages.

With ``num_repeats=R`` the block's ``L`` layers are cut into ``R * S`` virtual stages of
``K = L / (R * S)`` layers; virtual stage ``v = r * S + s`` lives on stage ``s``, so a
microbatch goes round the ring of stages `R` times, once per repeat ``r``. A tick is
``1 / R`` of a non-circular one, and the bubble falls from ``(S - 1) / (M + S - 1)`` to
``(S - 1) / (R * M + S - 1)``.

The forward *items* are ordered in groups of ``S`` microbatches: item
``i = g * R * S + r * S + k`` is microbatch ``g * S + k`` at repeat ``r``, run by stage
``s`` at tick ``i + s``. The last stage's output of item ``i`` wraps round the ring to
stage 0 at tick ``i + S``, exactly when stage 0 runs item ``i + S``: the same microbatch,
the next repeat. So no buffer is needed: stage 0 takes a fresh microbatch at repeat 0 and
the ring's value otherwise, and the last stage's output is the block's at repeat ``R - 1``.
Each stage picks its repeat's layers, ``r = ((t - s) // S) % R``, from its ``(R, K, ...)``.

`schedules.gpipe` runs ``R * M + S - 1`` ticks. `schedules.one_f_one_b` runs backward
items ``j = g * R * S + r' * S + k`` (repeats reversed, ``r = R - 1 - r'``), item ``j`` on
stage ``s`` at tick ``R * S - 1 + j + (S - 1 - s)``: the backward shift wraps from stage 0
to ``S - 1`` exactly when the previous repeat needs it, and the head runs in the tick of
the last repeat's forward pass. A stage keeps ``2 * R * S - 1`` inputs (at most
``2 (R * S - 1)`` ticks from a virtual stage's forward slot to its backward slot).

`stage_layout` cuts a stacked variable, held in layer order, into each stage's virtual
stages inside the step, and `layer_layout` back (why: docs/ARCHITECTURE.md, "Pipelines").
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jstrategy._src.pipeline.schedules import STAGE_AXIS
from jstrategy._src.pipeline.schedules import PipelineConfig

__all__ = [
    "layer_layout",
    "stage_layout",
]


def _rounds(stages: int, repeats: int) -> list[list[tuple[int, int, int, int]]]:
    """The moves from the contiguous layout to the circular one, as `repeats` rounds, each
    one ``ppermute`` of one chunk per stage. Each move is ``(source stage, its chunk,
    target stage, its repeat)``, sorted by source.

    Stage ``s`` holds virtual stages ``v = s * R + c`` (``c < R``) contiguously; ``v``
    belongs on stage ``v % S`` as its repeat ``v // S``. Round ``(v + v // lcm(R, S)) % R``
    takes one chunk from every stage (``v % R`` differs within a stage's chunks) and one
    into every stage (a target's ``v = t + q * S`` take each multiple of ``gcd(R, S)``
    modulo ``R`` once per ``lcm``, which ``v // lcm`` shifts by one)."""
    period = math.lcm(stages, repeats)
    rounds: list[list[tuple[int, int, int, int]]] = [[] for _ in range(repeats)]
    for v in range(stages * repeats):
        move = (v // repeats, v % repeats, v % stages, v // stages)
        rounds[(v + v // period) % repeats].append(move)
    return rounds


def _move_chunks(x: Any, config: PipelineConfig, *, inverse: bool) -> Any:
    """``(S, R, K, ...)`` from the contiguous layout (stage ``s``'s ``c``-th chunk:
    virtual stage ``s * R + c``) to the circular one (stage ``s``'s repeat ``r``: virtual
    stage ``r * S + s``), or back: `R` ``ppermute`` rounds of one chunk per stage, so
    each stage sends and receives its own share only (no stage gathers the variable)."""
    stages, repeats = config.num_stages, config.num_repeats
    rounds = _rounds(stages, repeats)
    if inverse:  # the same moves, backwards
        rounds = [sorted((d, r, s, c) for s, c, d, r in moves) for moves in rounds]

    def move(v: jax.Array) -> jax.Array:
        me = jax.lax.axis_index(STAGE_AXIS)
        out = None
        for moves in rounds:
            send = jnp.asarray([c for _, c, _, _ in moves])[me]  # sorted by source
            into = jnp.asarray([r for _, _, _, r in sorted(moves, key=lambda m: m[2])])[me]
            chunk = jax.lax.dynamic_index_in_dim(v, send, axis=1)
            chunk = jax.lax.ppermute(chunk, STAGE_AXIS, [(s, d) for s, _, d, _ in moves])
            # The first chunk fills the buffer the others are written into: a buffer of
            # zeros would depend on nothing, and XLA allocates such buffers early (for
            # the gradients' move back: all through the step's forward pass).
            out = jnp.broadcast_to(chunk, v.shape) if out is None else out
            out = jax.lax.dynamic_update_index_in_dim(out, chunk, into, axis=1)
        assert out is not None  # R >= 2 rounds
        return out

    # Manual over every axis, as `schedules._shift`.
    spec = P(STAGE_AXIS)
    relayout = jax.shard_map(move, mesh=config.mesh, in_specs=spec, out_specs=spec)
    return jax.tree.map(relayout, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _moved(x: Any, config: PipelineConfig, inverse: bool) -> Any:
    """`_move_chunks`, whose gradient is the inverse move. JAX's own transpose would clear
    each chunk's slot of a zero buffer with a dynamic update: a buffer that depends on
    nothing, which XLA shares with the gradient sums' zeros and allocates at the start."""
    return _move_chunks(x, config, inverse=inverse)


_moved.defvjp(
    lambda x, config, inverse: (_move_chunks(x, config, inverse=inverse), None),
    lambda config, inverse, _, ct: (_move_chunks(ct, config, inverse=not inverse),),
)


def stage_layout(v: jax.Array, config: PipelineConfig) -> jax.Array:
    """A stacked variable ``(L, ...)`` in layer order as the schedules take it: stage
    ``s``'s layers first, ``(S, L / S, ...)``; with ``R > 1`` ``(S, R, K, ...)``, stage
    ``s``'s repeat ``r`` being layers ``(r * S + s) * K ..``.

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> s = jstrategy.experimental.PipelineStrategy(num_stages=2, num_microbatches=2, num_repeats=2)
    >>> stage_layout(jnp.arange(8), s.pipeline).tolist()
    [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    """
    stages, repeats = config.num_stages, config.num_repeats
    if repeats == 1:
        return v.reshape(stages, v.shape[0] // stages, *v.shape[1:])
    per = v.shape[0] // (stages * repeats)
    return _moved(v.reshape(stages, repeats, per, *v.shape[1:]), config, False)


def layer_layout(v: jax.Array, config: PipelineConfig) -> jax.Array:
    """`stage_layout`'s inverse: ``(S, ...)`` per stage back to ``(L, ...)`` in layer order."""
    if config.num_repeats == 1:
        return v.reshape(-1, *v.shape[2:])
    return _moved(v, config, True).reshape(-1, *v.shape[3:])
