"""The two stagings of the train step's per-replica loss: what differs between them.

`body._gradients` builds each replica's loss, differentiates the mean over the global
batch's real rows and finishes the gradients, once for both stagings; a `View` owns the
rest: how the replicas are traced (`Manual`: one replica's rows inside a region manual
over the data axis, `staging.replica_map`; `Global`: every replica's, a ``vmap`` in the
global view, `staging.sharded_train_program`), how the global count of real rows is known,
how the gradients, sums and mutable state are combined over the replicas (one all-reduce,
or the map's sum), where non-finite gradients are counted (`check_numerics`), where
the marked blocks' inputs are placed (`activation_rows`) and where the batch arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src import activation_rows
from jstrategy._src.context_parallel import axis as context_axis_lib
from jstrategy._src.numerics import COUNT
from jstrategy._src.pipeline.loss import ReplicaSlices
from jstrategy._src.pipeline.loss import splits_replicas
from jstrategy._src.placement import variable_shardings
from jstrategy._src.precision.loss_scale import all_finite
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.training.step import check_numerics
from jstrategy._src.training.step import replica_constraints
from jstrategy._src.training.step.spec import StepSpec
from jstrategy._src.values import is_key
from jstrategy._src.values import varying_axes

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = ["Global", "Manual", "View"]


def _to_varying(tree: Any, axis_name: str) -> Any:
    """Marks invariant leaves as per-replica, so their gradient is not implicitly summed."""

    def cast(x: Any) -> Any:
        if axis_name in varying_axes(x):
            return x
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)


class View:
    """What differs between the two stagings of the per-replica loss (`body._gradients`): how
    the replicas are traced, how the global count of real rows is known, how the
    gradients, sums and mutable state are combined over the replicas, and where the
    non-finite gradients are counted. Everything else is one function, `body._gradients`.

    Attributes:
      strategy: the step's strategy.
      axis: its data axis (the replicas').
      n: its number of replicas.
      context_axis: the `context_parallel.axis.ContextAxis` the forward pass is traced
        under (the attention reads it), or None.
    """

    context_axis: context_axis_lib.ContextAxis | None = None

    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        self.axis = strategy.axis_name
        self.n = strategy.num_replicas_in_sync

    def arriving(self, batch: Any, mask: Any) -> tuple[Any, Any]:
        """The batch and mask as this staging computes on them."""
        return batch, mask

    def global_rows(self, rows: int) -> int:
        """The global batch's rows, from the rows of the batch this staging is given."""
        raise NotImplementedError

    def replica_rows(self, rows: int) -> int:
        """One replica's rows, from the rows of the batch this staging is given."""
        raise NotImplementedError

    def count(self, rows: int, mask: jax.Array | None) -> Any:
        """The global batch's count of real rows (static for a full batch)."""
        raise NotImplementedError

    def placement(self, spec: StepSpec) -> activation_rows.Placement | None:
        """Where the marked blocks' inputs are placed (`activation_rows`)."""
        raise NotImplementedError

    def differentiable(
        self, one_replica: Callable[..., tuple[jax.Array, Any]], spec: StepSpec, params: Any
    ) -> tuple[Callable[[Any, Any, Any], tuple[jax.Array, Any]], Any]:
        """``(params, batch, mask) -> (the replicas' scaled loss sum, aux)`` from
        ``one_replica(params, slices, batch, mask)``, and the parameters to differentiate
        it at."""
        raise NotImplementedError

    def replica_state(self, model_state: Any) -> Any:
        """A replica's new mutable state as it leaves the replica's function."""
        return model_state

    def reduce(
        self, grads: Any, sums: dict[str, Any], model_state: Any, count: Any, checked: bool
    ) -> tuple[Any, dict[str, Any], Any]:
        """The gradients, sums and mutable state combined over the replicas (identical on
        every replica); `count` is the global count when known (not to be reduced again);
        `checked`: count non-finite gradients into ``check_numerics.GRADIENTS``."""
        raise NotImplementedError


class Manual(View):
    """Traced inside a region manual over the data axis (`staging.replica_map`): each
    replica differentiates its own loss with respect to a per-replica (varying) copy of
    the parameters, so JAX inserts no implicit reduction; ONE call to
    ``strategy.cross_device_ops.all_reduce`` then combines the gradients, the sums and the
    mutable state that differs across replicas (so `HierarchicalCopyAllReduce` changes the
    program's communication, not the numbers)."""

    def global_rows(self, rows: int) -> int:
        return rows * self.n

    def replica_rows(self, rows: int) -> int:
        return rows

    def count(self, rows: int, mask: jax.Array | None) -> Any:
        if mask is None:
            return float(rows * self.n)  # a full batch: nothing to all-reduce
        local = jnp.sum(mask.astype(jnp.float32))
        return self.strategy.cross_device_ops.all_reduce(
            ReduceOp.SUM, local, mesh=self.strategy.mesh, axis_name=self.axis
        )

    def placement(self, spec: StepSpec) -> activation_rows.Placement | None:
        return None  # values are per device here

    def differentiable(
        self, one_replica: Callable[..., tuple[jax.Array, Any]], spec: StepSpec, params: Any
    ) -> tuple[Callable[[Any, Any, Any], tuple[jax.Array, Any]], Any]:
        def replica(params: Any, batch: Any, mask: Any) -> tuple[jax.Array, Any]:
            return one_replica(params, None, batch, mask)

        return replica, _to_varying(params, self.axis)

    def reduce(
        self, grads: Any, sums: dict[str, Any], model_state: Any, count: Any, checked: bool
    ) -> tuple[Any, dict[str, Any], Any]:
        if checked:  # each replica's own gradients, summed over replicas with the sums
            sums[check_numerics.GRADIENTS] = sums[check_numerics.GRADIENTS] + _not_finite(grads)
        if count is not None:
            sums.pop(COUNT)
        leaves, tree = jax.tree.flatten(model_state)
        varying = [i for i, leaf in enumerate(leaves) if self.axis in varying_axes(leaf)]
        grads, sums, synced = self.strategy.cross_device_ops.all_reduce(
            ReduceOp.SUM,
            (grads, sums, [leaves[i] for i in varying]),
            mesh=self.strategy.mesh,
            axis_name=self.axis,
        )
        if count is not None:
            sums[COUNT] = jnp.asarray(count, jnp.float32)
        for i, leaf in zip(varying, synced, strict=True):
            leaves[i] = (leaf / self.n).astype(leaves[i].dtype)
        return grads, sums, jax.tree.unflatten(tree, leaves)


class Global(View):
    """Traced in the global view (no manual mesh axis): the same per-replica function runs
    on each replica's rows, the replicas being a vmapped axis named ``strategy.axis_name``
    (so dropout keys and synchronized BatchNorm see replicas exactly as in `Manual`) and
    laid out over the data axis (``spmd_axis_name``); the loss sums are summed over that
    axis and differentiated *outside* the map. The gradients are then global values, and
    XLA's partitioner reduces each where backpropagation produces it (a reduce-scatter to
    a variable split over the data axis), layer by layer, instead of after the whole
    backward pass; parameters are gathered where they are read. ``(B, ...)`` batch leaves
    become ``(replicas, B / replicas, ...)``: a view of the rows each device holds. The
    input of each block the model marks (`jstrategy.training.remat`, `Repeated`'s layers)
    is kept split by rows as the batch is (`Strategy.activation_rows`)."""

    def __init__(self, strategy: Strategy):
        super().__init__(strategy)
        self.context_axis = context_axis_lib.of_mesh(strategy.mesh, strategy.axis_name)

    def arriving(self, batch: Any, mask: Any) -> tuple[Any, Any]:
        # Batches arrive placed (`Strategy.batch_sharding`, `axis.batch_shardings`); the
        # constraint keeps one given on another layout (a `jax.Array` of the user's)
        # computed so too: its sequences split over the context axis (checked first), or
        # its rows where they are split within a replica (FSDP's and the experts' axes,
        # microbatches).
        if self.context_axis is not None:
            return context_axis_lib.split_sequence(batch, self.context_axis), mask
        if self.strategy.batch_multiple > self.n:
            rows = self.strategy.batch_sharding()
            return jax.lax.with_sharding_constraint((batch, mask), rows)
        return batch, mask

    def global_rows(self, rows: int) -> int:
        return rows

    def replica_rows(self, rows: int) -> int:
        return rows // self.n

    def count(self, rows: int, mask: jax.Array | None) -> Any:
        return float(rows) if mask is None else jnp.sum(mask.astype(jnp.float32))

    def placement(self, spec: StepSpec) -> activation_rows.Placement | None:
        # Left to itself, XLA gathered every replica's activations inside a scan over
        # FSDP's layers. The features over a tensor axis too, where a remat policy keeps
        # the blocks' inputs (without one their split only adds collectives); the
        # sequence wherever the strategy asks for it.
        strategy = self.strategy
        split: activation_rows.TensorActivations | None = strategy.tensor_activations
        if split is activation_rows.TensorActivations.FEATURES and spec.remat is None:
            split = None
        return activation_rows.placement(
            strategy.mesh, strategy.activation_rows, self.axis, split=split
        )

    def differentiable(
        self, one_replica: Callable[..., tuple[jax.Array, Any]], spec: StepSpec, params: Any
    ) -> tuple[Callable[[Any, Any, Any], tuple[jax.Array, Any]], Any]:
        axis, n = self.axis, self.n
        split = _replica_slices(spec, params)

        def mine(params: Any, slices: Any, batch: Any, mask: Any) -> tuple[jax.Array, Any]:
            return one_replica(params, None if split is None else (split, slices), batch, mask)

        # A model's constraints naming the data axis on its batch (``P("data", "model")``,
        # as written for a global jit) mean the replicas' axis here: taken out, the map
        # adds it back.
        flags = (False, True, True, True)  # the slices are mapped, as the batch is
        mine = replica_constraints.drop_data_axis(mine, axis, flags)
        mapped = jax.vmap(mine, in_axes=(None, 0, 0, 0), axis_name=axis, spmd_axis_name=axis)

        def per_replica(v: Any) -> Any:
            return v.reshape(n, v.shape[0] // n, *v.shape[1:])

        def replicas(params: Any, batch: Any, mask: Any) -> tuple[jax.Array, Any]:
            batch, mask = jax.tree.map(per_replica, (batch, mask))
            # A reshape of the split leaves, no data moved: their gradients come back
            # through it already reduced over the replicas, where the rest sum over the map.
            slices = None if split is None else split.of(params)
            scaled, aux = mapped(params, slices, batch, mask)
            return jnp.sum(scaled), aux

        return replicas, params

    def replica_state(self, model_state: Any) -> Any:
        return jax.tree.map(lambda x: _replica_mean(x, self.axis, self.n), model_state)

    def reduce(
        self, grads: Any, sums: dict[str, Any], model_state: Any, count: Any, checked: bool
    ) -> tuple[Any, dict[str, Any], Any]:
        sums = {k: jnp.sum(v, axis=0) for k, v in sums.items()}
        if checked:  # the gradients exist only outside the replicas' map: counted once
            sums[check_numerics.GRADIENTS] = sums[check_numerics.GRADIENTS] + _not_finite(grads)
        model_state = jax.tree.map(lambda x: x[0], model_state)  # the same on every replica
        return grads, sums, model_state


def _not_finite(grads: Any) -> jax.Array:
    return jnp.logical_not(all_finite(grads)).astype(jnp.float32)


def _replica_mean(x: Any, axis: str, n: int) -> Any:
    """A replica's mutable-state leaf averaged over the vmapped replicas, as `Manual`
    averages those that differ across replicas: a leaf the same on every replica (computed
    from synchronized statistics, or untouched) is kept exactly, and PRNG keys as they are."""
    if is_key(x):
        return x
    # Mutable state is not differentiated, but this runs inside the function that is:
    # without the stop, JAX would need pmax's derivative, which it does not define.
    x = jax.lax.stop_gradient(x)
    mean = (jax.lax.psum(x, axis) / n).astype(x.dtype)
    # pmax and pmin leave a value that does not vary over the replicas as it is, where
    # psum would multiply it by n (and the division might not give it back exactly).
    return jnp.where(jax.lax.pmax(x, axis) == jax.lax.pmin(x, axis), x, mean)


def _replica_slices(spec: StepSpec, params: Any) -> ReplicaSlices | None:
    """Where the pipeline asks for them (`pipeline.loss.splits_replicas`: 1F1B), the
    repeated block's leaves the strategy's `variable_sharding` splits over the data axis:
    each replica gets its slices of them, so that their weight gradients are reduced over
    the replicas layer by layer, as GPipe's transposed loop reduces them, not summed in
    full on each replica until the step's reduction. None without such leaves."""
    if not splits_replicas(spec.pipeline):
        return None
    strategy = spec.strategy
    specs = [s.spec for s in jax.tree.leaves(variable_shardings(params, strategy))]
    return ReplicaSlices.find(params, specs, strategy.axis_name, strategy.num_replicas_in_sync)
