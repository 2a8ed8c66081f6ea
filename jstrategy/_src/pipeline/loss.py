"""The 1F1B train step's loss: the model cut at its repeated block, each microbatch's loss
computed inside the pipeline (`schedules.one_f_one_b`).

The model is traced in two pieces around the block (`repeated.Split`). *Before*: the block
returns its input, the first stage's input ``h0``, pulled back with ``jax.vjp`` (the layers
before the block see the replica's whole batch). *After*, per microbatch: the block returns
the last stage's output, then that microbatch's loss sum. The schedule returns the
gradients of the stacked variables, of the layers after the block and of ``h0``; they reach
the step's autodiff as the derivative of ``sum(params * stop_gradient(grads))``. Layers
after the block must treat rows independently: those that would not (BatchNorm in
training, dropout, state or sown losses read from the activations, inputs that skip the
block) are refused; a custom layer mixing rows by its own arithmetic cannot be told apart.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from jstrategy._src.names import path_names
from jstrategy._src.pipeline import repeated
from jstrategy._src.pipeline.circular import layer_layout
from jstrategy._src.pipeline.circular import stage_layout
from jstrategy._src.pipeline.repeated import Captured
from jstrategy._src.pipeline.repeated import Split
from jstrategy._src.pipeline.schedules import STACKED_KEY
from jstrategy._src.pipeline.schedules import PipelineConfig
from jstrategy._src.pipeline.schedules import PipelineSchedule
from jstrategy._src.pipeline.schedules import is_stacked
from jstrategy._src.pipeline.schedules import one_f_one_b

__all__ = [
    "ReplicaLoss",
    "ReplicaSlices",
    "after_block_refused",
    "microbatch",
    "one_f_one_b_loss",
    "replica_loss",
    "whole_batch_loss",
]

#: One replica's differentiated loss: ``(params, x, **keywords) -> (value, (loss sum,
#: y_pred, model_state))``, the keywords as `one_f_one_b_loss`'s.
ReplicaLoss = Callable[..., tuple[jax.Array, tuple[jax.Array, Any, Any]]]


def replica_loss(config: PipelineConfig | None) -> ReplicaLoss:
    """How a train step's replica computes its loss under the pipeline `config` (or None):
    `one_f_one_b_loss` under a 1F1B schedule, else `whole_batch_loss`."""
    if config is not None and config.schedule is PipelineSchedule.ONE_F_ONE_B:
        return one_f_one_b_loss
    return whole_batch_loss


def splits_replicas(config: PipelineConfig | None) -> bool:
    """Whether a step in the global view hands each replica its `ReplicaSlices` (the
    1F1B loss reduces their gradients over the replicas layer by layer)."""
    return replica_loss(config) is one_f_one_b_loss


def whole_batch_loss(
    params: Any,
    x: Any,
    *,
    forward: Callable[[Any, Any], tuple[Any, Any, Any]],
    loss_sum: Callable[[Any, Any], jax.Array],
    penalty: Callable[[Any], jax.Array],
    scaled: Callable[[jax.Array], jax.Array],
    **_: Any,
) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
    """One replica's differentiated loss, the forward pass over its whole batch (the
    arguments as `one_f_one_b_loss`'s; `loss_sum`'s microbatch is None: every row). The
    forward pass casts, and every leaf is differentiated whole: `cast` and `slices` unused."""
    y_pred, model_state, model_loss = forward(params, x)
    total = loss_sum(y_pred, None)
    if model_loss is not None:
        total = total + penalty(model_loss)
    return scaled(total), (total, y_pred, model_state)


def microbatch(tree: Any, rows: int, m: Any, size: int) -> Any:
    """Microbatch `m` (rows ``m * size ..``) of every leaf with `rows` leading rows."""

    def take(v: Any) -> Any:
        if v is None or jnp.ndim(v) == 0 or jnp.shape(v)[0] != rows:
            return v
        return jax.lax.dynamic_slice_in_dim(v, m * size, size, axis=0)

    return jax.tree.map(take, tree)


@dataclasses.dataclass(frozen=True)
class ReplicaSlices:
    """The stacked parameters a sharded step splits over its replicas, and along which
    dimension, as a 1F1B step in the global view hands them to each replica.

    There the replicas are a ``vmap`` differentiated from outside, so a schedule summing
    each replica's weight gradients over the ticks would hold its stage's in full until the
    step's reduction. Each replica gets its slice of each split leaf instead (`of`: a
    reshape) and gathers a layer's where it reads it (`gather`), whose transpose
    reduce-scatters that layer's gradient as it is produced, as GPipe's transposed loop does.

    Attributes:
      axis: the replicas' axis name (the map's).
      replicas: how many replicas.
      dims: per parameter leaf (``jax.tree.leaves`` order), the dimension split over the
        replicas, or None (a leaf not stacked or not split: its gradient as before).
    """

    axis: str
    replicas: int
    dims: tuple[int | None, ...]

    @classmethod
    def find(
        cls, params: Any, specs: Sequence[Any], axis: str, replicas: int
    ) -> ReplicaSlices | None:
        """The stacked leaves of `params` whose `specs` (their layouts' partition specs)
        split a dimension other than the layers over `axis` alone; None when none does."""
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        dims: list[int | None] = []
        for (path, leaf), spec in zip(leaves, specs, strict=True):
            d = next((d for d, entry in enumerate(spec) if entry == axis), None)
            split = d is not None and d >= 1 and leaf.shape[d] % replicas == 0
            dims.append(d if split and is_stacked(path_names(path)) else None)
        if replicas == 1 or all(d is None for d in dims):
            return None
        return cls(axis, replicas, tuple(dims))

    def of(self, params: Any) -> list[jax.Array | None]:
        """Outside the replicas' map: each split leaf ``(..., D, ...)`` as ``(replicas,
        ..., D / replicas, ...)``, replica ``r``'s slice at ``r`` (None for the others)."""

        def sliced(v: jax.Array, d: int) -> jax.Array:
            shape = (*v.shape[:d], self.replicas, v.shape[d] // self.replicas, *v.shape[d + 1 :])
            return jnp.moveaxis(v.reshape(shape), d, 0)

        leaves = jax.tree.leaves(params)
        return [None if d is None else sliced(v, d) for v, d in zip(leaves, self.dims, strict=True)]

    def gather(self, layer: jax.Array, dim: int) -> jax.Array:
        """Inside the map: one layer of a split leaf (its dimension `dim` of the stacked
        leaf, the layers taken off) whole, from every replica's slice."""
        return jax.lax.all_gather(layer, self.axis, axis=dim - 1, tiled=True)


def _sources(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[list[frozenset[int]], Any]:
    """For each output leaf of ``fn(*args)``, which argument leaves its value is computed
    from (by their flat index), read off the traced program (conservatively: every output
    of an operation reads all of its inputs); and the outputs' shapes."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    env: dict[Any, frozenset[int]] = {v: frozenset((i,)) for i, v in enumerate(closed.jaxpr.invars)}

    def read(v: Any) -> frozenset[int]:
        return frozenset() if isinstance(v, Literal) else env.get(v, frozenset())

    for eqn in closed.jaxpr.eqns:
        reads = frozenset().union(*(read(v) for v in eqn.invars))
        for out in eqn.outvars:
            env[out] = reads
    return [read(v) for v in closed.jaxpr.outvars], shapes


def _refusing_after(record: Split) -> Any:
    """A linen interceptor refusing dropout and BatchNorm's batch statistics in the
    layers called after the block returned (their microbatches would not be the batch's)."""

    def intercept(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if record.returned and context.method_name == "__call__":
            what = None
            if isinstance(module, nn.Dropout) and module.rate > 0:
                given = kwargs.get("deterministic", args[1] if len(args) > 1 else None)
                if not nn.merge_param("deterministic", module.deterministic, given):
                    what = "dropout"
            if isinstance(module, nn.BatchNorm):
                given = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
                if not nn.merge_param("use_running_average", module.use_running_average, given):
                    what = "BatchNorm with batch statistics"
            if what is not None:
                layer = f"{type(module).__name__} ({'/'.join(module.scope.path)})"
                raise after_block_refused(layer, what)
        return next_fun(*args, **kwargs)

    return intercept


def after_block_refused(layer: str, what: str) -> ValueError:
    """The error for a `layer` applying `what` after the block (1F1B: on a microbatch)."""
    return ValueError(
        f"schedule='1f1b' computes the layers after the repeated block one microbatch at "
        f"a time, and {layer} there applies {what}, which would see a microbatch instead "
        "of the batch (the trajectory would not be OneDeviceStrategy's). Move it before "
        "the repeated block, or use schedule='gpipe'."
    )


def one_f_one_b_loss(
    params: Any,
    x: Any,
    *,
    forward: Callable[[Any, Any], tuple[Any, Any, Any]],
    cast: Callable[[Any], Any],
    loss_sum: Callable[[Any, Any], jax.Array],
    penalty: Callable[[Any], jax.Array],
    scaled: Callable[[jax.Array], jax.Array],
    slices: tuple[ReplicaSlices, list[Any]] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
    """One replica's differentiated loss under the 1F1B pipeline the step traces the model
    on (`repeated.current`; the module docstring).

    Args:
      params: the parameters (differentiated by the caller).
      x: the replica's inputs.
      forward: ``(params, inputs) -> (y_pred, model_state, model_loss)``, the training
        forward pass (under the step's precision policy).
      cast: parameters as the forward pass computes with them (the policy's dtype).
      loss_sum: ``(microbatch m's y_pred, m) -> its loss sum`` (m None: every row's).
      penalty: the model's own losses -> what they add to the loss sum.
      scaled: a loss sum -> what is differentiated (loss scaling).
      slices: in the global view, the `ReplicaSlices` and this replica's slices (their
        `of`, mapped; differentiated by the caller too): those leaves' gradients come
        back through the slices, reduced over the replicas, zero through `params`.

    Returns:
      ``(value, (loss sum, y_pred, model_state))`` as the step's ``local_loss`` returns
      them: `value`'s gradient with respect to `params` is the scaled loss sum's.
    """
    tracing = repeated.current()
    assert tracing is not None, "a 1F1B loss is traced inside its step's pipeline"
    config = tracing.config
    micro = config.num_microbatches
    frozen = jax.lax.stop_gradient(params)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(frozen)
    paths = [path_names(p) for p, _ in leaves]
    values = [v for _, v in leaves]
    found: list[Captured] = []

    def before(p: Any) -> tuple[tuple[jax.Array, jax.Array], tuple[Any, jax.Array]]:
        with tracing.splitting(Split()) as record:
            _, model_state, model_loss = forward(p, x)
        found[:] = record.captured
        if len(found) != 1:
            raise ValueError(
                f"schedule='1f1b' pipelines exactly one jstrategy.experimental.Repeated "
                f"block; this model runs {len(found)} "
                f"({[_where(c.path) for c in found]}). Pass "
                "schedule='gpipe', which pipelines each block, or merge them into one."
            )
        pen = penalty(model_loss)
        return (found[0].inputs, scaled(pen)), (model_state, pen)

    (h0, pen_scaled), pull_before, (model_state, pen) = jax.vjp(before, frozen, has_aux=True)
    block = found[0]
    rows, size = h0.shape[0], h0.shape[0] // micro
    prefix = _stacked_prefix(block, paths)
    stacked = [i for i, p in enumerate(paths) if p[: len(prefix)] == prefix]
    split, mine = (None, []) if slices is None else slices
    dims = [None if split is None else split.dims[i] for i in stacked]
    # A split leaf's slice: the schedule differentiates the stage with respect to it.
    block_values = [
        values[i] if d is None else jax.lax.stop_gradient(mine[i])
        for i, d in zip(stacked, dims, strict=True)
    ]

    def after(
        p: Any, h: jax.Array, m: Any, inputs: Any = None
    ) -> tuple[jax.Array, tuple[Any, Any, Any, Any]]:
        inputs = microbatch(x, rows, m, size) if inputs is None else inputs
        record = Split(output=h)
        with tracing.splitting(record), nn.intercept_methods(_refusing_after(record)):
            y_pred, state, model_loss = forward(p, inputs)
        total = loss_sum(y_pred, m)
        return scaled(total), (total, y_pred, state, model_loss)

    # What the layers after the block read: their parameters (the rest are dead code
    # there), and never the inputs or, for state and sown losses, the block's output.
    h_like = jnp.zeros((size, *h0.shape[1:]), h0.dtype)
    x_like = microbatch(x, rows, 0, size)

    def probe(vals: list[Any], h: jax.Array, xm: Any) -> Any:
        value, (_, *rest) = after(jax.tree.unflatten(treedef, vals), h, 0, xm)
        return value, *rest

    n_params, n_x = len(values), len(jax.tree.leaves(x_like))
    reads, out_shapes = _sources(probe, (values, h_like, x_like))
    counts = [len(jax.tree.leaves(o)) for o in out_shapes]
    value_reads, y_reads = reads[0], frozenset().union(*reads[1 : 1 + counts[1]])
    state_reads = frozenset().union(*reads[1 + counts[1] :])
    h_index, x_indices = n_params, set(range(n_params + 1, n_params + 1 + n_x))
    if (value_reads | y_reads) & x_indices:
        raise ValueError(
            "schedule='1f1b' computes the layers after the repeated block from the block's "
            "output one microbatch at a time, but this model's output also reads its "
            "inputs by another way (e.g. a skip connection around the block). Put the "
            "skip connection inside the repeated block, or use schedule='gpipe'."
        )
    if h_index in state_reads:
        raise ValueError(
            "schedule='1f1b' computes the layers after the repeated block one microbatch "
            "at a time, but there they update the model's state or add losses (sow) from "
            "their activations, which would see a microbatch instead of the batch. Keep "
            "stateful layers before the repeated block, or use schedule='gpipe'."
        )
    live = sorted(i for i in value_reads if i < n_params and i not in stacked)

    def head(head_params: list[Any], h: jax.Array, m: Any) -> tuple[jax.Array, Any]:
        vals = list(values)
        for i, v in zip(live, head_params, strict=True):
            vals[i] = v
        value, (total, y_pred, _, _) = after(jax.tree.unflatten(treedef, vals), h, m)
        return value, (total, y_pred)

    block_params = [stage_layout(v, config) for v in block_values]
    block_tree = jax.tree.structure(functools.reduce(operator.getitem, prefix, frozen))

    def stage(p: list[Any], h: jax.Array) -> jax.Array:
        if split is None:
            return block.stage(jax.tree.unflatten(block_tree, [cast(v) for v in p]), h)
        return block.stage(jax.tree.unflatten(block_tree, p), h, wrap=gathering)

    def gathering(layer: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        # Each split leaf's layer gathered from the replicas' slices where it is read, so
        # its gradient is reduce-scattered there, layer by layer. Recomputed in the
        # backward pass, not kept per layer (the layer's dots are): the stage's gathered
        # layers would outweigh its slices.
        def gathered(h: jax.Array, p: Any) -> Any:
            assert split is not None
            leaves = [
                v if d is None else split.gather(v, d)
                for v, d in zip(jax.tree.leaves(p), dims, strict=True)
            ]
            return layer(h, jax.tree.unflatten(block_tree, [cast(v) for v in leaves]))

        return jax.checkpoint(gathered, policy=jax.checkpoint_policies.dots_saveable)

    value, (totals, y_preds), d_head, d_block, d_h0 = one_f_one_b(
        stage, block_params, h0, head, [values[i] for i in live], config
    )
    (d_before,) = pull_before((d_h0, jnp.ones_like(pen_scaled)))
    grads = jax.tree.leaves(d_before)
    for i, g in zip(live, d_head, strict=True):
        grads[i] = grads[i] + g
    pairs = list(zip(jax.tree.leaves(params), grads, strict=True))
    for i, g, d in zip(stacked, d_block, dims, strict=True):
        g = layer_layout(g, config)  # the stages' layout back to layer order
        if d is None:
            pairs[i] = (pairs[i][0], grads[i] + g.reshape(values[i].shape).astype(grads[i].dtype))
        else:  # summed over the replicas already: through the slice, not the parameter
            pairs.append((mine[i], g.reshape(mine[i].shape).astype(grads[i].dtype)))
    # The derivative of sum(params * grads) is grads: the caller's autodiff reads them.
    linear = sum(
        jnp.sum(p.astype(jnp.float32) * jax.lax.stop_gradient(g).astype(jnp.float32))
        for p, g in pairs
    )
    value = jax.lax.stop_gradient(value + pen_scaled) + (linear - jax.lax.stop_gradient(linear))
    y_pred = jax.tree.map(lambda v: v.reshape(rows, *v.shape[2:]), y_preds)
    return value, (jnp.sum(totals) + pen, y_pred, model_state)


def _where(path: tuple[str, ...] | None) -> str:
    return "an NNXRepeated block" if path is None else "/".join(path) or "the model"


def _stacked_prefix(block: Captured, paths: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The path of `block`'s stacked parameters. An NNX block does not know its own
    path (`Captured.path` None): then the model's one path ending at `STACKED_KEY`."""
    if block.path is not None:
        return (*block.path, STACKED_KEY)
    prefixes = sorted({p[: p.index(STACKED_KEY) + 1] for p in paths if STACKED_KEY in p})
    if len(prefixes) != 1:
        raise ValueError(
            "schedule='1f1b' pipelines exactly one repeated block, but this model holds "
            f"{len(prefixes)} ({['/'.join(p) for p in prefixes]}) and runs one of them. "
            "Pass schedule='gpipe', which pipelines each block, or merge them into one."
        )
    return prefixes[0]
