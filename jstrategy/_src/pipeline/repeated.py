"""`Repeated`: a Flax block applied several times, its layers' variables stacked; and
`Tracing`, the pipeline it reads while a train step is traced (docs/ARCHITECTURE.md,
"Pipelines"): in a pipelined step its layers run as the schedule (`schedules`), split over
the stages; everywhere else one after the other in a ``lax.scan``, as ``nn.scan`` would.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp

from jstrategy._src import activation_rows
from jstrategy._src import trace_context
from jstrategy._src.pipeline.circular import stage_layout
from jstrategy._src.pipeline.schedules import STACKED_KEY
from jstrategy._src.pipeline.schedules import PipelineConfig
from jstrategy._src.pipeline.schedules import gpipe
from jstrategy._src.pipeline.schedules import layers_error
from jstrategy._src.validation import check_positive_int

__all__ = [
    "Captured",
    "Repeated",
    "Split",
    "Tracing",
    "after_block",
    "check_output",
    "current",
    "dropout_refused",
    "pipelined",
    "tracing_for",
]


@dataclasses.dataclass(frozen=True)
class Captured:
    """A repeated block met while a 1F1B step traces the model's layers before it.

    Attributes:
      path: the block's module path; its stacked variables are the parameters at
        ``path + (STACKED_KEY,)``. None for an `NNXRepeated` block, which does not know
        its path: the step finds it from the model's one stacked block.
      stage: ``(one stage's stacked variables, microbatch) -> microbatch``, a pure
        function (traced outside the model's call); its keyword `wrap` maps the loop's
        body ``(h, one layer's params) -> (h, None)``, to gather split layers there.
      inputs: what the block was given (the first stage's input rows).
    """

    path: tuple[str, ...] | None
    stage: Callable[..., jax.Array]
    inputs: jax.Array


@dataclasses.dataclass
class Split:
    """How repeated blocks behave while a 1F1B step traces the model in two pieces.

    With `output` None (the layers before the block), a block records itself in
    `captured` and returns its input. With `output` (the last stage's output for one
    microbatch: the layers after the block), a block returns it and sets `returned`.
    """

    output: jax.Array | None = None
    captured: list[Captured] = dataclasses.field(default_factory=list)
    returned: bool = False


@dataclasses.dataclass
class Tracing:
    """The one context object the model side reads: the pipeline a train step traces the
    model on, and, while a 1F1B step traces it in pieces, the `Split` it follows.

    Attributes:
      config: the pipeline.
      split: the `Split` repeated blocks follow now, or None (they run the pipeline).
      remat: the step's checkpoint policy (``jax.checkpoint``'s ``policy``), or None:
        the GPipe loop's own checkpoint saves only what it saves too.
    """

    config: PipelineConfig
    split: Split | None = None
    remat: Any = None

    @contextlib.contextmanager
    def splitting(self, record: Split) -> Iterator[Split]:
        """Repeated blocks traced inside follow `record` (see `Split`)."""
        previous, self.split = self.split, record
        try:
            yield record
        finally:
            self.split = previous


def tracing_for(
    config: PipelineConfig | None, params: Any, rows: int, *, remat: Any = None
) -> Tracing | None:
    """The `Tracing` a train step traces its model with under `config`'s pipeline (None
    without one), after `PipelineConfig.check_step` of its `params` and one replica's
    `rows`; `remat` is the step's checkpoint policy (`Tracing.remat`)."""
    if config is None:
        return None
    config.check_step(params, rows)
    return Tracing(config, remat=remat)


def current() -> Tracing | None:
    """The `Tracing` in effect, or None outside a pipelined train step."""
    return trace_context.current().pipeline  # type: ignore[no-any-return]


def after_block() -> bool:
    """Whether a 1F1B step is now tracing the layers after a repeated block (the block
    has returned a microbatch's output): layers there see one microbatch."""
    tracing = current()
    return tracing is not None and tracing.split is not None and tracing.split.returned


def pipelined(
    owner: str,
    name: str,
    tracing: Tracing,
    x: jax.Array,
    args: Any,
    kwargs: Any,
    layers: int,
    path: tuple[str, ...] | None,
    build: Callable[[], tuple[Any, Callable[[Any, jax.Array], jax.Array]]],
) -> jax.Array:
    """A repeated block's call in a pipelined step (`owner`: the repeating module, `name`:
    its block's class, `path`: `Captured.path`): under a 1F1B `Split` the last stage's
    output after the block, its input (recorded) before it; else the GPipe loop. ``build()``
    gives the stacked parameters and ``(one layer's params, microbatch) -> microbatch``."""
    record, config = tracing.split, tracing.config
    if record is not None and record.output is not None:
        check_output(name, x, record.output, owner)
        record.returned = True
        return record.output
    stages, micro = config.num_stages, config.num_microbatches
    if layers % (stages * config.num_repeats):
        raise ValueError(layers_error(f"{owner}(num_layers={layers})", layers, config))
    if x.shape[0] % micro:
        raise ValueError(
            f"num_microbatches={micro} must divide the rows each replica's pipeline "
            f"receives, but it receives {x.shape[0]} (the global batch divided by the "
            "replicas). Pick a batch size that is a multiple of num_microbatches x "
            "num_replicas_in_sync, or another num_microbatches."
        )
    arrays = [a for a in jax.tree.leaves((args, kwargs)) if isinstance(a, jax.Array)]
    if arrays:
        raise ValueError(
            f"Under PipelineStrategy, {owner} passes its block only its input "
            "microbatch: the other arguments must not be arrays (got arrays of shapes "
            f"{[a.shape for a in arrays]}). Fold them into the input, or pass static "
            "values (flags such as deterministic=)."
        )
    params, layer = build()
    if record is not None:  # the layers before the block: record it, return its input

        def stage(params: Any, h: jax.Array, *, wrap: Callable[[Any], Any] | None = None) -> Any:
            def body(h: jax.Array, p: Any) -> tuple[jax.Array, None]:
                return layer(p, h), None

            return jax.lax.scan(body if wrap is None else wrap(body), h, params)[0]

        record.captured.append(Captured(path, stage, x))
        return x
    stage_params = jax.tree.map(lambda v: stage_layout(v, config), params)
    return gpipe(layer, stage_params, x, config, remat=tracing.remat)


def dropout_refused(owner: str, name: str) -> ValueError:
    """The error for a pipelined block (class `name`, repeated by `owner`) that draws
    random numbers in training."""
    return ValueError(
        f"The block repeated by {owner} ({name}) draws random numbers "
        "(dropout) in training, which PipelineStrategy refuses: each "
        "microbatch would get other masks than the whole batch gets, so the "
        "trajectory would not be OneDeviceStrategy's. Keep dropout outside "
        "the repeated block, or make it deterministic there."
    )


class Repeated(nn.Module):
    """`block` applied `num_layers` times, each time with its own variables.

    The layers' parameters are stacked under the key ``"stacked_layers"`` (each leaf with
    a leading dimension of `num_layers`), as ``nn.scan`` stacks them: a checkpoint of a
    model holding a `Repeated` restores under any strategy. `block` maps its input to an
    output of the same shape and dtype; the call's other arguments (e.g.
    ``deterministic=``) are passed to every layer.

    Under `jstrategy.experimental.PipelineStrategy` the train step runs the layers as a
    pipeline (stage ``s`` of ``S`` holds layers ``s * L / S`` to ``(s + 1) * L / S - 1``),
    refusing a block with dropout or state: its microbatches would see other masks and
    batch statistics than the whole batch. Without a pipeline, dropout keys are drawn per
    layer.

    Attributes:
      block: the repeated Flax module (an unbound instance: its fields configure every
        layer).
      num_layers: how many times it is applied.

    Example:

    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import jstrategy
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + jnp.tanh(nn.Dense(x.shape[-1])(x))
    >>> model = jstrategy.experimental.Repeated(Block(), num_layers=4)
    >>> variables = model.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> variables["params"]["stacked_layers"]["Dense_0"]["kernel"].shape
    (4, 8, 8)
    >>> model.apply(variables, jnp.ones((2, 8))).shape
    (2, 8)
    """

    block: nn.Module
    num_layers: int

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        layers = check_positive_int(self.num_layers, "num_layers")
        name = type(self.block).__name__
        # An unbound copy: applied functionally, once per layer's variables.
        template: Any = self.block.clone(parent=None)

        def init(rng: jax.Array) -> Any:
            def one(key: jax.Array) -> Any:
                return template.init({"params": key, "dropout": key}, x, *args, **kwargs)

            variables = jax.vmap(one)(jax.random.split(rng, layers))
            others = sorted(set(variables) - {"params"})
            if others:
                raise ValueError(
                    f"The block repeated by Repeated ({name}) holds "
                    f"variables other than parameters, in the collections {others} (e.g. "
                    "BatchNorm's statistics); Repeated stacks parameters only. Use a "
                    "normalization without state (nn.LayerNorm, nn.RMSNorm) in the block, "
                    "or keep the stateful layer outside it."
                )
            return nn.meta.unbox(variables["params"])

        stacked = self.param(STACKED_KEY, init)
        tracing = current()
        if self.is_initializing() or tracing is None:  # in order, a dropout key per layer
            key = self.make_rng("dropout") if self.has_rng("dropout") else None

            def in_order(h: jax.Array, inputs: Any) -> tuple[jax.Array, None]:
                params, i = inputs
                rngs = None if key is None else {"dropout": jax.random.fold_in(key, i)}
                # In a sharded train step, each layer's input split by rows as the batch is
                # (`activation_rows`), whether or not the block is marked with remat.
                h = activation_rows.place(h)
                out = template.apply({"params": params}, h, *args, rngs=rngs, **kwargs)
                check_output(name, h, out)
                return out, None

            return jax.lax.scan(in_order, x, (stacked, jnp.arange(layers)))[0]

        def layer(p: Any, h: jax.Array) -> jax.Array:
            # A stage's rows are a microbatch and its layout the schedule's (mapped over
            # the stages): the step's placement of a marked block's input stays out.
            with activation_rows.suspended():
                try:
                    out = template.apply({"params": p}, h, *args, **kwargs)
                except flax.errors.InvalidRngError as e:
                    raise dropout_refused("Repeated", name) from e
            check_output(name, h, out)
            return out

        assert self.scope is not None  # bound: it is being applied
        path = tuple(self.scope.path)
        build = lambda: (stacked, layer)  # noqa: E731
        return pipelined("Repeated", name, tracing, x, args, kwargs, layers, path, build)


def check_output(name: str, h: jax.Array, out: Any, owner: str = "Repeated") -> None:
    """Refuses a repeated block's output `out` unless shaped and typed as its input `h`
    (`name`: the block's class, `owner`: the repeating module)."""
    if not isinstance(out, jax.Array) or out.shape != h.shape or out.dtype != h.dtype:
        got = f"{out.shape} {out.dtype}" if isinstance(out, jax.Array) else type(out).__name__
        raise ValueError(
            f"The block repeated by {owner} ({name}) must return an array of its input's "
            f"shape and dtype, {h.shape} {h.dtype}; it returned {got}. Repeat only the part "
            "of the model whose output feeds the next layer."
        )
