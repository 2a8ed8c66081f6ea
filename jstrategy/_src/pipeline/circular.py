"""Circular (interleaved) pipelines: each device holds several virtual stages.

With ``num_repeats=R`` the repeated block's ``L`` layers are cut into ``R * S`` virtual
stages of ``K = L / (R * S)`` layers; virtual stage ``v = r * S + s`` (layers
``v * K .. (v + 1) * K - 1``) lives on device (stage) ``s``, so a microbatch goes round the
ring of stages `R` times, once per repeat ``r``. Each device's share of a tick is ``1 / R``
of a non-circular stage's, and the pipeline fills and drains in ``S - 1`` such short
ticks: the bubble falls from ``(S - 1) / (M + S - 1)`` to ``(S - 1) / (R * M + S - 1)``.

The forward *items* are ordered in groups of ``S`` microbatches: item
``i = g * R * S + r * S + k`` is microbatch ``m = g * S + k`` at repeat ``r``. Stage ``s``
runs the forward pass of item ``i`` at tick ``i + s``. The last stage's output of item
``i`` reaches stage 0 through the ring ``ppermute`` (it wraps around) at tick ``i + S``,
exactly when stage 0 runs item ``i + S``: the same microbatch, the next repeat. So no
buffer is needed: stage 0 takes a fresh microbatch at repeat 0 and the ring's value
otherwise, and the last stage's output is the block's at repeat ``R - 1``. Each stage
picks its repeat's layers, ``r = ((t - s) // S) % R``, from its ``(R, K, ...)`` slice.

`schedules.gpipe` and `schedules.one_f_one_b` run this order when ``R > 1`` (with
``R = 1`` it is theirs):

* GPipe: ``R * M + S - 1`` ticks, then JAX's backward pass.
* Interleaved 1F1B: backward items ``j = g * R * S + r' * S + k`` with the
  repeats reversed (``r = R - 1 - r'``); stage ``s`` runs the backward pass of item ``j``
  at tick ``R * S - 1 + j + (S - 1 - s)``, the backward ring shift wrapping from stage 0
  to stage ``S - 1`` exactly when the previous repeat's last virtual stage needs it; the
  loss (the head) runs on the last stage in the same tick as its forward pass of the last
  repeat. Between a virtual stage's forward and backward slots of one microbatch pass at
  most ``2 (R * S - 1)`` ticks, so a stage keeps ``2 * R * S - 1`` microbatch inputs.
  ``R * S - 1`` ticks run forward slots only, ``R * (M - S) + S`` both, ``R * S - 1``
  backward slots only.

`stage_layout` arranges a stacked variable ``(L, ...)`` in layer order as the schedules
take it, ``(S, R, K, ...)`` (split over the stages), and `layer_layout` back; with
``R = 1`` they are the non-circular schedules' ``(S, L / S, ...)`` reshape. The variables
are held in layer order, split over the stages contiguously (a `NamedSharding` cannot give
a device non-contiguous layers), so that a checkpoint is the same under every strategy;
inside the step ``R`` rounds of ``ppermute`` (one chunk per stage each) hand every stage
its virtual stages, and the gradients go back the same way.
"""

from __future__ import annotations

import functools
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
    """The moves from the contiguous layout to the circular one, as `repeats` rounds.

    Stage ``s`` holds virtual stages ``s * R + c`` (``c < R``) contiguously; virtual stage
    ``v`` belongs on stage ``v % S`` as its repeat ``v // S``. Every stage sends `R`
    chunks and receives `R`: a regular bipartite multigraph, which splits into `R` perfect
    matchings (Konig), each one ``ppermute`` of one chunk per stage. Each move is
    ``(source stage, its chunk, target stage, its repeat)``.
    """
    moves = [
        (s, c, (s * repeats + c) % stages, (s * repeats + c) // stages)
        for s in range(stages)
        for c in range(repeats)
    ]
    rounds = []
    for _ in range(repeats):
        matched = _matching(moves, stages)
        rounds.append(sorted(matched))
        for move in matched:
            moves.remove(move)
    return rounds


def _matching(
    moves: list[tuple[int, int, int, int]], stages: int
) -> list[tuple[int, int, int, int]]:
    """One move from every source stage, one into every target stage (augmenting paths)."""
    matched: dict[int, tuple[int, int, int, int]] = {}  # target -> move

    def assign(source: int, seen: set[int]) -> bool:
        for move in moves:
            if move[0] != source or move[2] in seen:
                continue
            seen.add(move[2])
            other = matched.get(move[2])
            if other is None or assign(other[0], seen):
                matched[move[2]] = move
                return True
        return False

    for source in range(stages):
        assign(source, set())
    return list(matched.values())


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
    """`_move_chunks`, whose gradient is the inverse move (a permutation's transpose).

    JAX's own transpose of the moves would clear each chunk's slot of a zero buffer with
    a dynamic update: a buffer that depends on nothing, which XLA shares with the
    gradient sums' zeros and allocates at the start of the step."""
    return _move_chunks(x, config, inverse=inverse)


def _moved_forward(x: Any, config: PipelineConfig, inverse: bool) -> tuple[Any, None]:
    return _move_chunks(x, config, inverse=inverse), None


def _moved_backward(config: PipelineConfig, inverse: bool, _: None, ct: Any) -> tuple[Any]:
    return (_move_chunks(ct, config, inverse=not inverse),)


_moved.defvjp(_moved_forward, _moved_backward)


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
    # Held split over the stages in layer order, contiguously: each stage's chunks are
    # moved to the stages whose virtual stages they are, one chunk per stage per round.
    per = v.shape[0] // (stages * repeats)
    return _moved(v.reshape(stages, repeats, per, *v.shape[1:]), config, False)


def layer_layout(v: jax.Array, config: PipelineConfig) -> jax.Array:
    """`stage_layout`'s inverse: ``(S, ...)`` per stage back to ``(L, ...)`` in layer order."""
    if config.num_repeats == 1:
        return v.reshape(-1, *v.shape[2:])
    return _moved(v, config, True).reshape(-1, *v.shape[3:])
