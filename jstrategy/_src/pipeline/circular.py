"""Circular (interleaved) pipeline schedules: each device holds several virtual stages.

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

* `circular_gpipe`: ``R * M + S - 1`` ticks, then JAX's backward pass.
* `interleaved_one_f_one_b`: backward items ``j = g * R * S + r' * S + k`` with the
  repeats reversed (``r = R - 1 - r'``); stage ``s`` runs the backward pass of item ``j``
  at tick ``R * S - 1 + j + (S - 1 - s)``, the backward ring shift wrapping from stage 0
  to stage ``S - 1`` exactly when the previous repeat's last virtual stage needs it; the
  loss (the head) runs on the last stage in the same tick as its forward pass of the last
  repeat. Between a virtual stage's forward and backward slots of one microbatch pass at
  most ``2 (R * S - 1)`` ticks, so a stage keeps ``2 * R * S - 1`` microbatch inputs.

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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jstrategy._src.pipeline.schedules import STAGE_AXIS
from jstrategy._src.pipeline.schedules import PipelineConfig
from jstrategy._src.pipeline.schedules import _at
from jstrategy._src.pipeline.schedules import _initial_carry
from jstrategy._src.pipeline.schedules import _layer_reselected
from jstrategy._src.pipeline.schedules import _on_stage_axis
from jstrategy._src.pipeline.schedules import _put
from jstrategy._src.pipeline.schedules import _shift
from jstrategy._src.pipeline.schedules import selection_primitive

__all__ = [
    "circular_gpipe",
    "interleaved_one_f_one_b",
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


def _items(config: PipelineConfig) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``(microbatch of item i (clipped into range), repeat of item i)``."""
    stages, repeats, micro = config.num_stages, config.num_repeats, config.num_microbatches

    def microbatch(i: Any) -> Any:
        return jnp.clip((i // (repeats * stages)) * stages + i % stages, 0, micro - 1)

    def repeat(i: Any) -> Any:
        return (i // stages) % repeats

    return microbatch, repeat


def _pick(v: jax.Array, r: jax.Array) -> jax.Array:
    """Each stage's repeat ``r[s]`` of one leaf, ``(S, R, K, ...)`` -> ``(S, K, ...)``.

    One select per repeat, on each stage's slice of the repeats rather than a gather: it
    stays on each stage's device and so does its transpose (a batched gather's is a
    scatter-add that the SPMD partitioner can only do by replicating the whole stacked
    variable); and, elementwise on slices of the result's shape, it fuses into one pass
    that writes the result only (a masked sum over the repeats wrote all of them first)."""
    r = r.reshape(r.shape + (1,) * (v.ndim - 2))
    out = v[:, 0]
    for j in range(1, v.shape[1]):
        out = jnp.where(r == j, v[:, j], out)
    return out


def _select(stage_params: Any, r: jax.Array) -> Any:
    """Each stage's repeat ``r[s]`` of `stage_params` (``(S, R, K, ...)`` -> ``(S, K, ...)``,
    `_pick`)."""
    return jax.tree.map(lambda v: _pick(v, r), stage_params)


def _layer_picked(v: jax.Array, r: jax.Array, k: jax.Array) -> jax.Array:
    """Layer `k` of each stage's repeat ``r[s]``: ``(S, R, K, ...)`` -> ``(S, ...)``."""
    return _pick(jax.lax.dynamic_index_in_dim(v, k, axis=2, keepdims=False), r)


def _layer_in_place(ct: jax.Array, shape: tuple[int, ...], r: jax.Array, k: jax.Array) -> jax.Array:
    """The transpose of `_layer_picked`: `ct` into layer `k` of repeat ``r[s]``."""
    pick = jnp.arange(shape[1])[None, :] == r[:, None]
    pick = pick.reshape(pick.shape + (1,) * (ct.ndim - 1))
    layer = jnp.where(pick, ct[:, None], jnp.zeros((), ct.dtype))  # (S, R, ...)
    # Added by the loop to its one accumulator: XLA writes layer k's slices in place.
    zeros = jnp.zeros(shape, ct.dtype)
    return jax.lax.dynamic_update_index_in_dim(zeros, layer, k, axis=2)


_relayer = selection_primitive(
    "jstrategy_circular_layer", _layer_picked, lambda s: (s[0], *s[3:]), _layer_in_place
)


def circular_gpipe(
    layer: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    x: jax.Array,
    config: PipelineConfig,
    *,
    ticks: int | None = None,
    remat: Any = None,
) -> jax.Array:
    """`schedules.gpipe` with ``config.num_repeats`` virtual stages per stage (the module
    docstring): ``R * M + S - 1`` ticks, one loop over ``(tick, layer)`` as GPipe's.

    Args:
      layer: ``(one layer's params, microbatch) -> microbatch`` of the same shape.
      stage_params: each leaf ``(S, R, K, ...)`` (`stage_layout`), split over `STAGE_AXIS`.
      x: the rows, ``(rows, ...)``; `config.num_microbatches` must divide ``rows``.
      config: the pipeline.
      ticks: None for all ticks; ``benchmarks/pipeline.py`` passes ``R * M``, the same
        work per tick without the fill and drain (its outputs are not the model's).
      remat: the step's checkpoint policy (`repeated.Tracing.remat`), or None.

    Returns:
      What applying the virtual stages in order to `x` gives, ``(rows, ...)``.
    """
    stages, micro, repeats = config.num_stages, config.num_microbatches, config.num_repeats
    depth = jax.tree.leaves(stage_params)[0].shape[2]
    rows = x.shape[0]
    xs = x.reshape(micro, rows // micro, *x.shape[1:])
    on_stages = jax.sharding.NamedSharding(config.mesh, P(STAGE_AXIS))
    shift = _shift(config.mesh, stages)
    run_layer = _layer_reselected(layer, remat, select=_relayer)
    microbatch, repeat = _items(config)
    stage_ids = jnp.arange(stages)
    items = repeats * micro

    def step(carry: Any, j: jax.Array) -> tuple[Any, None]:
        buffer, outputs = carry
        t, k = j // depth, j % depth
        r = repeat(t - stage_ids)  # each stage's repeat
        feed = jax.lax.dynamic_index_in_dim(xs, microbatch(t), keepdims=False)
        buffer = buffer.at[0].set(jnp.where((r[0] == 0) & (k == 0), feed, buffer[0]))
        buffer = jax.lax.with_sharding_constraint(buffer, on_stages)
        out = run_layer(stage_params, r, k, buffer)
        out = jax.lax.with_sharding_constraint(out, on_stages)
        last_layer = k == depth - 1
        last = t - (stages - 1)  # the item the last stage finished at this tick
        m = microbatch(last)
        done = last_layer & (last >= 0) & (last < items) & (r[stages - 1] == repeats - 1)
        kept = jax.lax.dynamic_index_in_dim(outputs, m, keepdims=False)
        outputs = jax.lax.dynamic_update_index_in_dim(
            outputs, jnp.where(done, out[stages - 1], kept), m, 0
        )
        return (jax.lax.cond(last_layer, shift, lambda v: v, out), outputs), None

    buffer = jnp.zeros((stages, *xs.shape[1:]), x.dtype)
    outputs = jnp.zeros_like(xs)
    count = (items + stages - 1 if ticks is None else ticks) * depth
    (_, outputs), _ = jax.lax.scan(step, (buffer, outputs), jnp.arange(count))
    return outputs.reshape(x.shape)


def interleaved_one_f_one_b(
    stage: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    x: jax.Array,
    head: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]],
    head_params: Any,
    config: PipelineConfig,
    *,
    fill_and_drain: bool = True,
) -> tuple[jax.Array, Any, Any, Any, jax.Array]:
    """`schedules.one_f_one_b` with ``config.num_repeats`` virtual stages per stage (the
    module docstring): interleaved 1F1B.

    Takes and returns what `schedules.one_f_one_b` does, with `stage_params` (and their
    gradients) laid out ``(S, R, K, ...)`` (`stage_layout`). ``R * S - 1`` ticks run
    forward slots only, ``R * (M - S) + S`` both, ``R * S - 1`` backward slots only:
    ``(R * M + S - 1)`` ticks' work of ``1 / R`` of a stage each, the bubble
    ``(S - 1) / (R * M + S - 1)``. `fill_and_drain` False runs ``R * M`` ticks with both
    slots, the no-bubble limit ``benchmarks/pipeline.py`` times it against.
    """
    stages, micro, repeats = config.num_stages, config.num_microbatches, config.num_repeats
    rows = x.shape[0]
    xs = x.reshape(micro, rows // micro, *x.shape[1:])
    items = repeats * micro
    first_backward = repeats * stages - 1  # the tick the last stage starts backward slots
    slots = 2 * repeats * stages - 1  # the microbatch inputs a stage keeps
    on_stages = jax.sharding.NamedSharding(config.mesh, P(STAGE_AXIS))

    forward_shift = _shift(config.mesh, stages)
    backward_shift = _shift(config.mesh, stages, step=-1)
    run_stages = jax.vmap(stage)
    microbatch, repeat = _items(config)

    def backward(params: Any, h: jax.Array, grad: jax.Array) -> Any:
        return jax.vjp(stage, params, h)[1](grad)

    backward_stages = jax.vmap(backward)
    stage_ids = jnp.arange(stages)

    def forward_slot(carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        r = repeat(t - stage_ids)
        feed = jax.lax.dynamic_index_in_dim(xs, microbatch(t), keepdims=False)
        inputs = carry["inputs"]
        inputs = inputs.at[0].set(jnp.where(r[0] == 0, feed, inputs[0]))
        inputs = jax.lax.with_sharding_constraint(inputs, on_stages)
        kept = carry["kept"].at[:, t % slots].set(inputs)
        out = run_stages(_select(stage_params, r), inputs)
        out = jax.lax.with_sharding_constraint(out, on_stages)
        return {**carry, "inputs": forward_shift(out), "kept": kept}, out

    def head_slot(carry: dict[str, Any], t: jax.Array, out: jax.Array) -> dict[str, Any]:
        i = t - (stages - 1)  # the item the last stage finished this tick
        m = microbatch(i)

        def run(carry: dict[str, Any]) -> dict[str, Any]:
            value, pullback, aux = jax.vjp(
                lambda p, h: head(p, h, m), head_params, out[stages - 1], has_aux=True
            )
            d_head, d_out = pullback(jnp.ones_like(value))
            return {
                **carry,
                "grads": carry["grads"].at[stages - 1].set(d_out),
                "value": carry["value"] + value,
                "aux": _put(carry["aux"], aux, m),
                "d_head": jax.tree.map(jnp.add, carry["d_head"], d_head),
            }

        # Only a microbatch's last repeat leaves the block; the others go round the ring.
        finished = (i >= 0) & (i < items) & (repeat(i) == repeats - 1)
        return jax.lax.cond(finished, run, lambda carry: carry, carry)

    def backward_slot(carry: dict[str, Any], t: jax.Array) -> dict[str, Any]:
        j = t - first_backward - (stages - 1 - stage_ids)  # each stage's backward item
        valid = (j >= 0) & (j < items)
        r = repeats - 1 - repeat(j)
        # The forward item of the same microbatch and repeat, and its tick on stage s.
        i = (j // (repeats * stages)) * (repeats * stages) + r * stages + j % stages
        inputs = jax.vmap(_at)(carry["kept"], (i + stage_ids) % slots)
        d_params, d_inputs = backward_stages(_select(stage_params, r), inputs, carry["grads"])
        # Each stage's gradient goes to its repeat's layers, [S, R, ...].
        to = valid[:, None] & (jnp.arange(repeats)[None, :] == r[:, None])

        def masked_add(acc: jax.Array, g: jax.Array) -> jax.Array:
            keep = to.reshape(to.shape + (1,) * (g.ndim - 1))
            return acc + jnp.where(keep, g[:, None], jnp.zeros((), g.dtype))

        d_stages = _on_stage_axis(
            config.mesh, jax.tree.map(masked_add, carry["d_stages"], d_params)
        )
        # Stage 0's input gradient is the block's at repeat 0; else it goes round the ring.
        first = microbatch(j[0])  # written once more, correctly, when valid
        d_x = jnp.where(
            valid[0] & (r[0] == 0),
            d_inputs[0],
            jax.lax.dynamic_index_in_dim(carry["d_x"], first, keepdims=False),
        )
        return {
            **carry,
            "grads": jax.lax.with_sharding_constraint(backward_shift(d_inputs), on_stages),
            "d_stages": d_stages,
            "d_x": jax.lax.dynamic_update_index_in_dim(carry["d_x"], d_x, first, 0),
        }

    def warmup(carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], None]:
        return forward_slot(carry, t)[0], None

    def steady(carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], None]:
        carry, out = forward_slot(carry, t)
        return backward_slot(head_slot(carry, t, out), t), None

    def cooldown(carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], None]:
        return backward_slot(carry, t), None

    carry = _initial_carry(xs, slots, head, head_params, stage_params, config)
    last_forward = items + stages - 1  # one past the last stage's last forward tick
    if fill_and_drain:
        carry, _ = jax.lax.scan(warmup, carry, jnp.arange(first_backward))
        carry, _ = jax.lax.scan(steady, carry, jnp.arange(first_backward, last_forward))
        drain = jnp.arange(last_forward, first_backward + items + stages - 1)
        carry, _ = jax.lax.scan(cooldown, carry, drain)
    else:
        carry, _ = jax.lax.scan(steady, carry, jnp.arange(first_backward, first_backward + items))
    d_x = carry["d_x"].reshape(x.shape)
    return carry["value"], carry["aux"], carry["d_head"], carry["d_stages"], d_x
