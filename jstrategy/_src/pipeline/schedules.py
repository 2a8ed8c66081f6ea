"""Pipeline schedules: microbatches through stages of layers, neighbours linked by ``ppermute``.

`PipelineConfig` is a strategy's pipeline as its train step reads it; `gpipe` and
`one_f_one_b` are the two loops (with ``num_repeats`` virtual stages per stage, in
``circular.py``'s order) that a repeated block (`repeated.py`) runs while the step is traced.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jstrategy._src import axes
from jstrategy._src.names import path_names
from jstrategy._src.validation import check_mode
from jstrategy._src.validation import check_positive_int

__all__ = [
    "STACKED_KEY",
    "check_pipeline",
    "STAGE_AXIS",
    "PipelineConfig",
    "PipelineSchedule",
    "gpipe",
    "is_stacked",
    "layers_error",
    "one_f_one_b",
]

#: The mesh axis the stages are laid along.
STAGE_AXIS = axes.STAGE_AXIS

#: The key under which a repeated block keeps its stacked variables (leading dimension:
#: the layers), the key `PipelineStrategy` finds them by.
STACKED_KEY = "stacked_layers"


class PipelineSchedule(enum.Enum):
    """The order in which the stages run the microbatches: GPipe's (`gpipe`: JAX's backward
    pass after every forward pass) or 1F1B's (`one_f_one_b`: each microbatch's backward
    pass as soon as its forward pass leaves the last stage).

    Example:

    >>> from jstrategy.experimental import PipelineSchedule, PipelineStrategy
    >>> PipelineSchedule("1f1b") is PipelineSchedule.ONE_F_ONE_B, [s.value for s in PipelineSchedule]
    (True, ['gpipe', '1f1b'])
    >>> strategy = PipelineStrategy(num_stages=2, num_microbatches=4, schedule=PipelineSchedule.GPIPE)
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"

    @classmethod
    def of(cls, value: Any) -> PipelineSchedule:
        """`value` (a member or its name) as a member; a clear error for any other."""
        fix = "Pass e.g. schedule='gpipe'."
        if isinstance(value, str) and value.lower() in ("interleaved", "circular"):
            # Megatron's and MaxText's names: a number of virtual stages, not a schedule.
            fix = (
                "A circular (interleaved) schedule is one of these with several virtual "
                "stages per stage: pass e.g. schedule='1f1b', num_repeats=2."
            )
        return check_mode(value, cls, "schedule", fix)  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A strategy's pipeline, as its train step reads it (`Strategy.pipeline`).

    Attributes:
      num_stages: the stages (the size of `STAGE_AXIS`).
      num_microbatches: how many microbatches each replica's rows are cut into.
      schedule: the `PipelineSchedule`.
      mesh: the strategy's mesh, with the axis `STAGE_AXIS`.
      num_repeats: the virtual stages each stage holds (``circular.py``); 1 for none.
    """

    num_stages: int
    num_microbatches: int
    schedule: PipelineSchedule
    mesh: Mesh
    num_repeats: int = 1

    @property
    def num_replicas(self) -> int:
        """The replicas, each of which runs the stages on its own rows."""
        return int(self.mesh.shape[axes.REPLICA_AXIS])

    def check_step(self, params: Any, rows: int) -> None:
        """The pre-flight checks of a pipelined train step, before the model is traced:
        `params` hold a repeated block's stacked layers, and one replica's `rows` divide
        into the microbatches (else a ValueError)."""
        paths = [path_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        if not any(is_stacked(p) for p in paths):
            raise ValueError(
                "PipelineStrategy splits a model's repeated block over its stages, but "
                "this model has none: no variable is stacked by "
                "jstrategy.experimental.Repeated (NNX: NNXRepeated). Write the repeated "
                "layers as Repeated(block, num_layers=...) (NNX: NNXRepeated(block, "
                "num_layers=..., rngs=...)), or train this model with FSDPStrategy or "
                "MirroredStrategy."
            )
        if rows % self.num_microbatches:
            replicas = self.num_replicas
            raise ValueError(
                f"num_microbatches={self.num_microbatches} must divide the rows of "
                f"each replica, {rows} (a global batch of {rows * replicas} over "
                f"{replicas} replicas). Pass batches of a multiple of "
                f"{replicas * self.num_microbatches} rows, or let distribute_batch, a "
                "distributed dataset or Model.fit pad them (they pad to that multiple "
                "and mask the padding), or pick another num_microbatches."
            )


def check_pipeline(
    stages: Any, microbatches: Any, schedule: Any, repeats: Any
) -> tuple[int, int, PipelineSchedule, int]:
    """A pipeline's settings checked (ValueError, TypeError naming the argument):
    ``(num_stages, num_microbatches, schedule, num_repeats)``.

    Example:

    >>> check_pipeline(2, 4, "1f1b", 1)
    (2, 4, <PipelineSchedule.ONE_F_ONE_B: '1f1b'>, 1)
    """
    stages = check_positive_int(stages, "num_stages", "E.g. num_stages=2.")
    micro = check_positive_int(
        microbatches, "num_microbatches", f"E.g. num_microbatches={2 * stages}."
    )
    schedule = PipelineSchedule.of(schedule)
    repeats = check_positive_int(
        repeats, "num_repeats", "E.g. num_repeats=2 (1: no virtual stages)."
    )
    if repeats > 1 and micro % stages:
        raise ValueError(
            f"With num_repeats={repeats}, `num_microbatches` must be a multiple of "
            f"num_stages={stages} (the circular schedule sends the microbatches round "
            f"the stages in groups of num_stages); got num_microbatches={micro}. Pass "
            f"e.g. num_microbatches={stages * max(1, -(-micro // stages))}."
        )
    return stages, micro, schedule, repeats


def layers_error(what: str, layers: int, config: PipelineConfig) -> str:
    """The refusal of `what`, a repeated block's `layers` that `config`'s (virtual)
    stages do not divide."""
    stages, repeats = config.num_stages, config.num_repeats
    parts = stages * repeats
    over = f"num_stages={stages} pipeline stages"
    if repeats > 1:
        over += f" x num_repeats={repeats} virtual stages each"
    return (
        f"{what} cannot be split over {over}: {layers} does not divide by {parts}. Make "
        f"Repeated's num_layers a multiple of {parts}, or pick num_stages"
        f"{' and num_repeats' if repeats > 1 else ''} among its divisors."
    )


def is_stacked(path: tuple[str, ...]) -> bool:
    """Whether the variable at `path` (a parameter or its optimizer moment) is stacked."""
    return STACKED_KEY in path


def _shift(mesh: Mesh, stages: int, *, step: int = 1) -> Callable[[Any], Any]:
    """Every stage's value handed to stage ``s + step`` (around the ring: the value that
    wraps is overwritten by its receiver): one ``ppermute`` over `STAGE_AXIS`."""
    perm = [(i, (i + step) % stages) for i in range(stages)]
    shift = lambda v: jax.lax.ppermute(v, STAGE_AXIS, perm)  # noqa: E731

    # Manual over the stages and the replicas: traced inside the replicas' ``vmap``
    # (whose ``spmd_axis_name`` adds the data axis to the specs), each device then holds
    # its stage's slice of its replica's microbatch; the mesh's other axes (a tensor or
    # FSDP split of the microbatch) stay as they are.
    manual = frozenset({STAGE_AXIS, axes.REPLICA_AXIS} & set(mesh.axis_names))
    return jax.shard_map(
        shift, mesh=mesh, in_specs=P(STAGE_AXIS), out_specs=P(STAGE_AXIS), axis_names=manual
    )


def _start(config: PipelineConfig, stage_params: Any, x: jax.Array) -> tuple[Any, ...]:
    """What both loops start from: `stage_params` as ``(S, R, K, ...)``, `x` as ``(M, rows
    / M, ...)``, the stages' sharding, ``(item i -> its microbatch (clipped into range))``
    and ``(item i -> its repeat)``."""
    stages, repeats, micro = config.num_stages, config.num_repeats, config.num_microbatches
    if repeats == 1:  # the stages' layers as their one repeat's
        stage_params = jax.tree.map(lambda v: v[:, None], stage_params)
    on_stages = jax.sharding.NamedSharding(config.mesh, P(STAGE_AXIS))

    def microbatch(i: Any) -> Any:
        return jnp.clip((i // (repeats * stages)) * stages + i % stages, 0, micro - 1)

    def repeat(i: Any) -> Any:  # without repeats a constant: its tests fold away
        return (i // stages) % repeats if repeats > 1 else jnp.zeros_like(i)

    return stage_params, x.reshape(micro, -1, *x.shape[1:]), on_stages, microbatch, repeat


def gpipe(
    layer: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    x: jax.Array,
    config: PipelineConfig,
    *,
    ticks: int | None = None,
    remat: Any = None,
) -> jax.Array:
    """The stages' layers applied by every stage in turn to `x`, microbatch by microbatch
    (GPipe; with ``config.num_repeats``, circular GPipe: ``circular.py``), as one loop
    over ``(tick, layer)``: step ``j`` is layer ``j % K`` of tick ``j // K``.

    At tick ``t`` stage ``s`` applies its layers to microbatch ``t - s``, then hands its
    output on (one ``ppermute``): ``M + S - 1`` ticks, ``(S - 1) / (M + S - 1)`` of them
    idle (the bubble). JAX's backward pass runs the ticks backwards, every stage keeping
    its microbatches' activations until then. Why one loop: docs/ARCHITECTURE.md.

    Args:
      layer: ``(one layer's params, microbatch) -> microbatch`` of the same shape.
      stage_params: the stages' stacked layers, each leaf ``(S, K, ...)``, with repeats
        ``(S, R, K, ...)`` (`circular.stage_layout`), split over `STAGE_AXIS`.
      x: the rows, ``(rows, ...)``; `config.num_microbatches` must divide ``rows``.
      config: the pipeline.
      ticks: how many ticks to run; None for all ``R * M + S - 1``. ``benchmarks/pipeline.py``
        times ``R * M``, the no-bubble limit (their outputs are not the model's).
      remat: the step's checkpoint policy (`repeated.Tracing.remat`), or None.

    Returns:
      What applying the (virtual) stages in order to `x` gives, ``(rows, ...)``.
    """
    stages, micro, repeats = config.num_stages, config.num_microbatches, config.num_repeats
    stage_params, xs, on_stages, microbatch, repeat = _start(config, stage_params, x)
    depth = jax.tree.leaves(stage_params)[0].shape[2]
    shift = _shift(config.mesh, stages)
    run_layer = _layer_reselected(layer, remat)
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
        # Elsewhere than where the last stage finishes a microbatch, the slot is written
        # with what it holds (in place: no copy of the outputs).
        done = last_layer & (last >= 0) & (last < items) & (r[stages - 1] == repeats - 1)
        kept = jax.lax.dynamic_index_in_dim(outputs, m, keepdims=False)
        outputs = jax.lax.dynamic_update_index_in_dim(
            outputs, jnp.where(done, out[stages - 1], kept), m, 0
        )
        return (jax.lax.cond(last_layer, shift, lambda v: v, out), outputs), None

    init = (jnp.zeros((stages, *xs.shape[1:]), x.dtype), jnp.zeros_like(xs))
    count = (items + stages - 1 if ticks is None else ticks) * depth
    (_, outputs), _ = jax.lax.scan(step, init, jnp.arange(count))
    return outputs.reshape(x.shape)


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
    return jax.tree.map(lambda v: _pick(v, r), stage_params)


def _layer_picked(v: jax.Array, r: jax.Array, k: jax.Array) -> jax.Array:
    """Layer `k` of each stage's repeat ``r[s]``: ``(S, R, K, ...)`` -> ``(S, ...)``."""
    return _pick(jax.lax.dynamic_index_in_dim(v, k, axis=2, keepdims=False), r)


# `_layer_picked` as one primitive, linear in the weights, so that a checkpoint policy can
# tell it from the layers' own operations (a policy sees one operation at a time; jnp's
# selection is several, and a recomputed value's inputs are saved unless recomputed too).
# Batched, it is `_layer_picked`'s plain operations.
_relayer = Primitive("jstrategy_circular_layer")
_relayer.def_impl(_layer_picked)
_relayer.def_abstract_eval(
    lambda v, *_: v.update(shape=(v.shape[0], *v.shape[3:]), weak_type=False)
)
mlir.register_lowering(_relayer, mlir.lower_fun(_layer_picked, multiple_results=False))
batching.primitive_batchers[_relayer] = lambda args, dims: (
    jax.vmap(_layer_picked, in_axes=dims)(*args),
    0,
)


def _relayer_transposed(ct: Any, v: Any, r: jax.Array, k: jax.Array) -> list[Any]:
    """`ct` put back into layer `k` of repeat ``r[s]``."""
    assert ad.is_undefined_primal(v)
    if type(ct) is ad.Zero:
        return [ad.Zero(v.aval), None, None]
    pick = jnp.arange(v.aval.shape[1])[None, :] == r[:, None]
    pick = pick.reshape(pick.shape + (1,) * (ct.ndim - 1))
    layer = jnp.where(pick, ct[:, None], jnp.zeros((), ct.dtype))  # (S, R, ...)
    # Added by the loop to its one accumulator: XLA writes layer k's slices in place.
    zeros = jnp.zeros(v.aval.shape, ct.dtype)
    return [jax.lax.dynamic_update_index_in_dim(zeros, layer, k, axis=2), None, None]


ad.defjvp(_relayer, lambda dv, v, r, k: _relayer.bind(dv, r, k), None, None)
ad.primitive_transposes[_relayer] = _relayer_transposed


def _layer_reselected(
    layer: Callable[[Any, jax.Array], jax.Array], remat: Any
) -> Callable[..., jax.Array]:
    """``(stage params, r, k, microbatches (S, ...)) -> (S, ...)``: layer `k` of every
    stage's repeat ``r[s]``, whose backward pass selects the layer's weights again.

    A step's selection depends on the step, so ``scan`` would keep a copy of it per step
    for the backward pass (a matmul's input gradient reads its weights): every layer's
    weights once per tick. Checkpointed with everything saved but the selection, the
    backward pass selects it again from the loop's constant."""
    run = jax.vmap(layer)

    def one(stage_params: Any, r: jax.Array, k: jax.Array, h: jax.Array) -> jax.Array:
        return run(jax.tree.map(lambda v: _relayer.bind(v, r, k), stage_params), h)

    # Saving every other value would also save what the layers' own remat recomputes (at
    # llama2-7B a layer's attention scores per microbatch and repeat: the step's remat had
    # no effect, 127 GiB a v5p chip against MaxText's 35): under the step's remat policy a
    # value is saved only where both policies save it.
    def policy(prim: Any, *args: Any, **params: Any) -> bool:
        if prim is _relayer:
            return False
        return remat is None or bool(remat(prim, *args, **params))

    # Inside a scan nothing can merge the recomputation into the forward pass: no barrier.
    return jax.checkpoint(one, policy=policy, prevent_cse=False)


def one_f_one_b(
    stage: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    x: jax.Array,
    head: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]],
    head_params: Any,
    config: PipelineConfig,
    *,
    fill_and_drain: bool = True,
) -> tuple[jax.Array, Any, Any, Any, jax.Array]:
    """The forward and backward passes of `stage` over the stages and of `head` after them,
    microbatch by microbatch, in the 1F1B order.

    Tick ``t`` is a forward and a backward slot on every stage: stage ``s`` runs microbatch
    ``t - s`` forward and ``t - (2S - 2 - s)`` backward; on the last stage both are one
    microbatch, whose output goes through `head` (the layers after the block and the
    loss), whose gradient starts its backward pass at once. Outputs go one stage on and
    input gradients one back, each by one ``ppermute``. A stage keeps the inputs of the
    microbatches in flight only (at most ``2S - 1``, whatever ``M``) and recomputes its
    forward pass in its backward slot (``jax.vjp``). ``S - 1`` ticks run forward slots
    only and ``S - 1`` backward slots only: the bubble is GPipe's. With
    ``config.num_repeats``, interleaved 1F1B (``circular.py``).

    Args:
      stage: ``(one stage's params, microbatch) -> microbatch`` of the same shape.
      stage_params: the stages' params, each leaf ``(S, K, ...)``, with repeats
        ``(S, R, K, ...)`` (`circular.stage_layout`); their gradients are laid out so.
      x: the first stage's input rows, ``(rows, ...)``.
      head: ``(head_params, the last stage's output for microbatch m, m) -> (value,
        aux)``: a scalar to differentiate (microbatch ``m``'s loss) and what else to keep.
      head_params: what `head` is differentiated with respect to.
      config: the pipeline.
      fill_and_drain: False runs only the ``R * M`` ticks with both slots, the no-bubble
        limit ``benchmarks/pipeline.py`` times (its results are not the model's).

    Returns:
      ``(sum of the values, the auxes stacked (M, ...), d head_params, d stage_params,
      d x)``: the gradients of the summed values.
    """
    stages, micro, repeats = config.num_stages, config.num_microbatches, config.num_repeats
    stage_params, xs, on_stages, microbatch, repeat = _start(config, stage_params, x)
    items = repeats * micro
    first_backward = repeats * stages - 1  # the tick the last stage starts backward slots
    slots = 2 * repeats * stages - 1  # the microbatch inputs a stage keeps
    forward_shift = _shift(config.mesh, stages)
    backward_shift = _shift(config.mesh, stages, step=-1)
    run_stages = jax.vmap(stage)
    backward_stages = jax.vmap(lambda params, h, grad: jax.vjp(stage, params, h)[1](grad))
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
                "aux": jax.tree.map(
                    lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, m, 0), carry["aux"], aux
                ),
                "d_head": jax.tree.map(jnp.add, carry["d_head"], d_head),
            }

        if repeats == 1:  # every steady tick finishes a microbatch
            return run(carry)
        # Only a microbatch's last repeat leaves the block; the others go round the ring.
        finished = (i >= 0) & (i < items) & (repeat(i) == repeats - 1)
        return jax.lax.cond(finished, run, lambda carry: carry, carry)

    def backward_slot(carry: dict[str, Any], t: jax.Array) -> dict[str, Any]:
        j = t - first_backward - (stages - 1 - stage_ids)  # each stage's backward item
        valid = (j >= 0) & (j < items)
        r = repeats - 1 - repeat(j)
        # The forward item of the same microbatch and repeat, and its tick on stage s.
        i = (j // (repeats * stages)) * (repeats * stages) + r * stages + j % stages
        slot = lambda v, at: jax.lax.dynamic_index_in_dim(v, at, keepdims=False)  # noqa: E731
        inputs = jax.vmap(slot)(carry["kept"], (i + stage_ids) % slots)
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

    zeros = jnp.zeros((stages, *xs.shape[1:]), xs.dtype)
    value_shape, aux_shape = jax.eval_shape(
        lambda p, h: head(p, h, jnp.zeros((), jnp.int32)), head_params, xs[0]
    )
    carry = {
        "inputs": zeros,
        "kept": jnp.zeros((stages, slots, *xs.shape[1:]), xs.dtype),
        "grads": zeros,
        "value": jnp.zeros(value_shape.shape, value_shape.dtype),
        "aux": jax.tree.map(lambda a: jnp.zeros((micro, *a.shape), a.dtype), aux_shape),
        "d_head": jax.tree.map(jnp.zeros_like, head_params),
        "d_stages": _on_stage_axis(config.mesh, jax.tree.map(jnp.zeros_like, stage_params)),
        "d_x": jnp.zeros_like(xs),
    }
    last_forward = items + stages - 1  # one past the last stage's last forward tick
    if fill_and_drain:
        carry, _ = jax.lax.scan(warmup, carry, jnp.arange(first_backward))
        carry, _ = jax.lax.scan(steady, carry, jnp.arange(first_backward, last_forward))
        drain = jnp.arange(last_forward, first_backward + items + stages - 1)
        carry, _ = jax.lax.scan(cooldown, carry, drain)
    else:
        carry, _ = jax.lax.scan(steady, carry, jnp.arange(first_backward, first_backward + items))
    d_stages = jax.tree.map(lambda v: v[:, 0] if repeats == 1 else v, carry["d_stages"])
    return carry["value"], carry["aux"], carry["d_head"], d_stages, carry["d_x"].reshape(x.shape)


def _on_stage_axis(mesh: Mesh, tree: Any) -> Any:
    """Every leaf's leading dimension constrained to `STAGE_AXIS`, the rest left to XLA."""

    def constrain(v: jax.Array) -> jax.Array:
        spec = P(STAGE_AXIS, *([P.UNCONSTRAINED] * (v.ndim - 1)))
        return jax.lax.with_sharding_constraint(v, jax.sharding.NamedSharding(mesh, spec))

    return jax.tree.map(constrain, tree)
