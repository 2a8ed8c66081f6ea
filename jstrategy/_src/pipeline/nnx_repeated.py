"""`NNXRepeated`: `Repeated` for Flax NNX, its layers made stacked (Flax's "scan over
layers" recipe), read by the train step through the same `Tracing`, `Captured` and `Split`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jstrategy._src.pipeline.repeated import check_output
from jstrategy._src.pipeline.repeated import current
from jstrategy._src.pipeline.repeated import dropout_refused
from jstrategy._src.pipeline.repeated import pipelined
from jstrategy._src.validation import check_positive_int

__all__ = ["NNXRepeated"]

_OWNER = "NNXRepeated"


class NNXRepeated(nnx.Module):
    """An NNX block applied `num_layers` times, each time with its own variables.

    ``block(rngs)`` creates one layer; `NNXRepeated` creates `num_layers` of them at once
    (``nnx.split_rngs`` and ``nnx.vmap``), every variable with a leading dimension of
    `num_layers`, under the attribute ``stacked_layers``: a checkpoint of a model holding
    one restores under any strategy. A call applies the layers in order with ``nnx.scan``
    (the block maps its input to an output of the same shape and dtype; the call's other
    arguments go to every layer); under `jstrategy.experimental.PipelineStrategy` the train
    step runs them as the linen `Repeated`'s. A block holding anything but parameters
    (random streams, BatchNorm's statistics) is refused by a pipelined step, as is, under
    ``schedule="1f1b"``, a train state's ``wrt`` that trains part of the block.

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

        # `schedules.STACKED_KEY`: the path PipelineStrategy splits over its stages.
        self.stacked_layers = create(rngs)
        self.num_layers = layers

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        tracing, name = current(), type(self.stacked_layers).__name__
        if tracing is None:  # in order (``nnx.scan``: streams and state per layer)

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def layer(h: jax.Array, block: nnx.Module) -> jax.Array:
                out = block(h, *args, **kwargs)
                check_output(name, h, out, _OWNER)
                return out

            out: jax.Array = layer(x, self.stacked_layers)
            return out

        def build() -> tuple[nnx.State, Callable[..., jax.Array]]:  # `pipelined`'s
            for _, node in nnx.iter_graph(self.stacked_layers):
                if isinstance(node, nnx.Dropout) and node.rate > 0 and not node.deterministic:
                    raise dropout_refused(_OWNER, name)
            graphdef, params, rest = nnx.split(self.stacked_layers, nnx.Param, ...)  # type: ignore[misc]
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

            def one(p: Any, h: jax.Array) -> jax.Array:
                if jax.tree.structure(p) != structure:
                    raise ValueError(
                        f"schedule='1f1b' differentiates every parameter of the block repeated "
                        f"by {_OWNER} ({name}), but the train state trains only some of them "
                        "(its `wrt` filter). Train the whole block, or use schedule='gpipe'."
                    )
                out = nnx.merge(graphdef, p)(h, *args, **kwargs)
                check_output(name, h, out, _OWNER)
                return out

            return params, one

        # An NNX module does not know its path: a 1F1B step finds it from the one stacked
        # block's parameters (path None).
        return pipelined(_OWNER, name, tracing, x, args, kwargs, self.num_layers, None, build)
