"""`NNXRepeated`: `Repeated` for Flax NNX, a block's layers created stacked and applied in
order, or as the train step's pipeline.

Flax's own recipe for NNX "scan over layers": the layers are created at once by
``nnx.split_rngs`` and ``nnx.vmap`` (each variable with a leading layers dimension, each
layer its own random streams) and applied with ``nnx.scan``. `NNXRepeated` keeps them
under the attribute ``stacked_layers`` (`schedules.STACKED_KEY`), the path
`PipelineStrategy` finds stacked variables by, and reads the same context object as
linen's `Repeated` (`repeated.current`): inside a pipelined train step it runs its layers
as the schedule, everywhere else with ``nnx.scan``. What the step does with it (GPipe's
differentiated schedule, 1F1B's cut at the block in `pipeline/loss.py`) is the linen
block's, through the same `Captured` and `Split`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jstrategy._src.pipeline.circular import stage_layout
from jstrategy._src.pipeline.repeated import Captured
from jstrategy._src.pipeline.repeated import check_output
from jstrategy._src.pipeline.repeated import check_pipelined
from jstrategy._src.pipeline.repeated import current
from jstrategy._src.pipeline.repeated import dropout_refused
from jstrategy._src.pipeline.schedules import STACKED_KEY
from jstrategy._src.pipeline.schedules import gpipe
from jstrategy._src.validation import check_positive_int

__all__ = ["NNXRepeated"]

_OWNER = "NNXRepeated"


class NNXRepeated(nnx.Module):
    """An NNX block applied `num_layers` times, each time with its own variables.

    ``block(rngs)`` creates one layer; `NNXRepeated` creates `num_layers` of them at once
    (``nnx.split_rngs`` and ``nnx.vmap``, as Flax's "scan over layers" does), so every
    variable of the block has a leading dimension of `num_layers`, and keeps them under the
    attribute ``stacked_layers``: a checkpoint of a model holding one restores under any
    strategy. A call applies the layers in order with ``nnx.scan``; the block maps its
    input to an output of the same shape and dtype, and the call's other arguments are
    passed to every layer.

    Under `jstrategy.experimental.PipelineStrategy` the train step runs the layers as a
    pipeline, on either schedule, exactly as for the linen `Repeated`: stage ``s`` of
    ``S`` holds layers ``s * L / S`` to ``(s + 1) * L / S - 1``. A block holding anything
    but parameters (dropout's random streams, BatchNorm's statistics) trains without a
    pipeline (``nnx.scan`` carries its streams and statistics layer by layer) and is
    refused by a pipelined step, whose microbatches would see other masks and batch
    statistics than the whole batch. Under ``schedule="1f1b"`` the block's parameters
    train as a whole: a train state's ``wrt`` that trains part of them is refused there
    (GPipe takes it).

    Args:
      block: a function of an ``nnx.Rngs`` that creates one layer, an ``nnx.Module``
        (e.g. the block's class, or ``lambda rngs: Block(64, rngs=rngs)``).
      num_layers: how many layers.
      rngs: the random streams the layers are created from (split per layer).

    Raises:
      ValueError: if `num_layers` is not a positive int.
      TypeError: if `block` is not a function or does not create an ``nnx.Module``, or
        `rngs` is not an ``nnx.Rngs``.

    Example:

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jstrategy
    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.dense = nnx.Linear(8, 8, rngs=rngs)
    ...     def __call__(self, x):
    ...         return x + jnp.tanh(self.dense(x))
    >>> layers = jstrategy.experimental.NNXRepeated(Block, num_layers=4, rngs=nnx.Rngs(0))
    >>> layers.stacked_layers.dense.kernel.shape
    (4, 8, 8)
    >>> layers(jnp.ones((2, 8))).shape
    (2, 8)
    """

    def __init__(self, block: Callable[[nnx.Rngs], nnx.Module], *, num_layers: int, rngs: nnx.Rngs):
        layers = check_positive_int(num_layers, "num_layers", "E.g. num_layers=4.")
        if isinstance(block, nnx.Module) or not callable(block):
            raise TypeError(
                f"`block` must be a function of an nnx.Rngs that creates one layer (e.g. "
                f"the block's class, or lambda rngs: Block(..., rngs=rngs)); got "
                f"{type(block).__name__}. NNXRepeated creates the {layers} layers itself, "
                "each with its own variables."
            )
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"`rngs` must be an nnx.Rngs (e.g. nnx.Rngs(0)); got {type(rngs).__name__}."
            )

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> nnx.Module:
            made = block(rngs)
            if not isinstance(made, nnx.Module):
                raise TypeError(
                    f"`block` must create an nnx.Module; it returned {type(made).__name__}."
                )
            return made

        # Under STACKED_KEY: the path PipelineStrategy splits over its stages.
        setattr(self, STACKED_KEY, create(rngs))
        self.num_layers = layers

    @property
    def _layers(self) -> nnx.Module:
        layers: nnx.Module = getattr(self, STACKED_KEY)
        return layers

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        tracing = current()
        if tracing is None:
            return self._in_order(x, args, kwargs)
        name = type(self._layers).__name__
        record, config = tracing.split, tracing.config
        if record is not None and record.output is not None:
            # The layers after the block, on one microbatch: the last stage's output.
            check_output(name, x, record.output, _OWNER)
            record.returned = True
            return record.output
        check_pipelined(_OWNER, x, args, kwargs, self.num_layers, config)
        params, stage, one = self._stage(args, kwargs)
        if record is not None:  # the layers before the block: record it, return its input
            # An NNX module does not know its path: the 1F1B step finds it from the one
            # stacked block's parameters (path None).
            record.captured.append(Captured(None, stage, x))
            return x
        stage_params = jax.tree.map(lambda v: stage_layout(v, config), params)
        return gpipe(one, stage_params, x, config, remat=tracing.remat)

    def _in_order(self, x: jax.Array, args: Any, kwargs: Any) -> jax.Array:
        """The layers one after the other (``nnx.scan``: streams and state per layer)."""
        name = type(self._layers).__name__

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def layer(h: jax.Array, block: nnx.Module) -> jax.Array:
            out = block(h, *args, **kwargs)
            check_output(name, h, out, _OWNER)
            return out

        out: jax.Array = layer(x, self._layers)
        return out

    def _stage(
        self, args: Any, kwargs: Any
    ) -> tuple[nnx.State, Callable[..., jax.Array], Callable[[Any, jax.Array], jax.Array]]:
        """The stacked parameters; ``(one stage's stacked parameters, microbatch) ->
        microbatch``: its layers in order, a pure function of its arguments (a 1F1B step
        traces it outside the model's call); and ``(one layer's parameters, microbatch)
        -> microbatch`` (`schedules.gpipe`'s `layer`). Refuses a block holding other
        variables."""
        name = type(self._layers).__name__
        for _, node in nnx.iter_graph(self._layers):
            if isinstance(node, nnx.Dropout) and node.rate > 0 and not node.deterministic:
                raise dropout_refused(_OWNER, name)
        graphdef, params, rest = nnx.split(self._layers, nnx.Param, ...)  # type: ignore[misc]
        others = [
            f"{'/'.join(map(str, path))} ({type(v).__name__})"
            for path, v in nnx.to_flat_state(rest)
        ]
        if others:
            raise ValueError(
                f"The block repeated by {_OWNER} ({name}) holds variables other than "
                f"parameters, {others} (e.g. BatchNorm's statistics, random streams), "
                "which PipelineStrategy refuses: its microbatches would update them from "
                "other rows than the whole batch. Use a normalization without state "
                "(nnx.LayerNorm, nnx.RMSNorm) in the block, or keep the stateful layer "
                "outside it."
            )
        structure: Any = jax.tree.structure(params)

        def stage(stage_params: Any, h: jax.Array) -> jax.Array:
            if jax.tree.structure(stage_params) != structure:
                raise ValueError(
                    f"schedule='1f1b' differentiates every parameter of the block repeated "
                    f"by {_OWNER} ({name}), but the train state trains only some of them "
                    "(its `wrt` filter). Train the whole block, or use schedule='gpipe'."
                )

            return jax.lax.scan(lambda h, p: (one(p, h), None), h, stage_params)[0]

        def one(p: Any, h: jax.Array) -> jax.Array:
            out = nnx.merge(graphdef, p)(h, *args, **kwargs)
            check_output(name, h, out, _OWNER)
            return out

        return params, stage, one
