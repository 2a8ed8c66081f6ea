"""Pipeline schedules: microbatches through stages of layers, neighbours linked by ``ppermute``.

A pipelined model's repeated block holds its layers' variables stacked, with a leading
layers dimension that `PipelineStrategy` splits over the mesh axis `STAGE_AXIS`: stage ``s``
holds layers ``s * K`` to ``(s + 1) * K - 1`` (``K = layers / stages``). A schedule runs,
inside the one compiled train step, every microbatch through the stages in order:

* `PipelineSchedule.GPIPE` (`gpipe`): at tick ``t`` stage ``s`` applies its layers to
  microbatch ``t - s``; after each tick every stage hands its output to the next one with
  one ``jax.lax.ppermute`` (XLA's collective-permute). ``M`` microbatches take
  ``M + S - 1`` ticks, so the stages idle a fraction ``(S - 1) / (M + S - 1)`` of the time
  (the bubble). Backpropagation is JAX's: the transposed loop runs the ticks backwards, the
  transposed ``ppermute`` hands cotangents to the previous stage, and every stage keeps
  the activations of all its microbatches until then (GPipe's memory).

The schedule is chosen by the strategy; the block (`jstrategy.experimental.Repeated`)
reads it while the train step is traced (`active`), and without one runs its layers one
after the other (a ``lax.scan``), as on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

__all__ = [
    "STACKED_KEY",
    "STAGE_AXIS",
    "PipelineConfig",
    "PipelineSchedule",
    "activate",
    "active",
    "gpipe",
    "is_stacked",
]

#: The mesh axis the stages are laid along.
STAGE_AXIS = "stage"

#: The key under which a repeated block keeps its stacked variables (leading dimension:
#: the layers), the key `PipelineStrategy` finds them by.
STACKED_KEY = "stacked_layers"


class PipelineSchedule(enum.Enum):
    """The order in which the stages run the microbatches (see the module docstring)."""

    GPIPE = "gpipe"

    @classmethod
    def of(cls, value: Any) -> PipelineSchedule:
        """`value` (a member or its name) as a member; a clear error for any other."""
        if isinstance(value, cls):
            return value
        names = [m.value for m in cls]
        if isinstance(value, str) and value.lower() in names:
            return cls(value.lower())
        raise ValueError(
            f"`schedule` must be one of {names} (or a jstrategy.experimental."
            f"PipelineSchedule); got {value!r}. Pass e.g. schedule='gpipe'."
        )


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """What a repeated block reads while a pipelined step is traced.

    Attributes:
      num_stages: the stages (the size of `STAGE_AXIS`).
      num_microbatches: how many microbatches each replica's rows are cut into.
      schedule: the `PipelineSchedule`.
      mesh: the strategy's mesh, with the axis `STAGE_AXIS`.
    """

    num_stages: int
    num_microbatches: int
    schedule: PipelineSchedule
    mesh: Mesh


_ACTIVE: contextvars.ContextVar[PipelineConfig | None] = contextvars.ContextVar(
    "jstrategy_pipeline", default=None
)


def active() -> PipelineConfig | None:
    """The pipeline a repeated block traced now runs on, or None (its layers in order)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activate(config: PipelineConfig | None) -> Iterator[None]:
    """Repeated blocks traced inside run on `config`'s pipeline (None: not pipelined)."""
    token = _ACTIVE.set(config)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def is_stacked(path: tuple[str, ...]) -> bool:
    """Whether the variable at `path` (a parameter, or an optimizer moment that ends with
    a parameter's path) is a repeated block's stacked variable."""
    return STACKED_KEY in path


def _shift(mesh: Mesh, stages: int) -> Callable[[Any], Any]:
    """Every stage's value handed to the next stage (the last one's to the first, which
    overwrites it): one ``ppermute`` over `STAGE_AXIS` per leaf."""
    perm = [(i, (i + 1) % stages) for i in range(stages)]

    def shift(tree: Any) -> Any:
        return jax.tree.map(lambda v: jax.lax.ppermute(v, STAGE_AXIS, perm), tree)

    # Manual over every axis: traced inside the replicas' ``vmap`` (whose
    # ``spmd_axis_name`` adds the data axis to the specs), each device then holds its
    # stage's slice of its replica's microbatch.
    return jax.shard_map(shift, mesh=mesh, in_specs=P(STAGE_AXIS), out_specs=P(STAGE_AXIS))


def gpipe(
    stage: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    x: jax.Array,
    config: PipelineConfig,
    *,
    ticks: int | None = None,
) -> jax.Array:
    """`stage` applied by every stage in turn to `x`, microbatch by microbatch (GPipe).

    Args:
      stage: ``(one stage's params, microbatch) -> microbatch`` of the same shape.
      stage_params: the stages' params, each leaf ``(num_stages, ...)``, split over
        `STAGE_AXIS`.
      x: the rows, ``(rows, ...)``; `config.num_microbatches` must divide ``rows``.
      config: the pipeline.
      ticks: how many ticks to run; None for all ``M + S - 1``. Only
        ``benchmarks/pipeline.py`` passes fewer: ``M`` ticks are the same work per tick
        without the pipeline's fill and drain, the no-bubble limit it times the step
        against (their outputs are not the model's).

    Returns:
      What applying the stages in order to `x` gives, ``(rows, ...)``.
    """
    stages, micro = config.num_stages, config.num_microbatches
    rows = x.shape[0]
    xs = x.reshape(micro, rows // micro, *x.shape[1:])
    on_stages = jax.sharding.NamedSharding(config.mesh, P(STAGE_AXIS))
    shift = _shift(config.mesh, stages)
    run_stages = jax.vmap(stage)

    def tick(carry: Any, t: jax.Array) -> tuple[Any, None]:
        buffer, outputs = carry
        # Stage 0 takes microbatch t (past the last one, the last one again: its outputs
        # are never read); stage s > 0 what stage s - 1 gave at the previous tick.
        feed = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, micro - 1), keepdims=False)
        buffer = jax.lax.with_sharding_constraint(buffer.at[0].set(feed), on_stages)
        out = jax.lax.with_sharding_constraint(run_stages(stage_params, buffer), on_stages)
        # The last stage finishes microbatch t - (S - 1); before the first finishes, the
        # write to slot 0 is overwritten later.
        done = jnp.maximum(t - (stages - 1), 0)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, out[stages - 1], done, 0)
        return (shift(out), outputs), None

    buffer = jnp.zeros((stages, *xs.shape[1:]), x.dtype)
    outputs = jnp.zeros_like(xs)
    count = micro + stages - 1 if ticks is None else ticks
    (_, outputs), _ = jax.lax.scan(tick, (buffer, outputs), jnp.arange(count))
    return outputs.reshape(x.shape)
