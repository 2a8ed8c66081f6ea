"""The core `Strategy`: one implementation that every strategy specializes by policy."""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import axes
from jstrategy._src import context
from jstrategy._src import dispatch
from jstrategy._src import staging
from jstrategy._src.activation_rows import TensorActivations
from jstrategy._src.cross_device_ops import CrossDeviceOps
from jstrategy._src.cross_device_ops import NcclAllReduce
from jstrategy._src.devices import canonical_name
from jstrategy._src.extended import StrategyExtended
from jstrategy._src.input.datasets import distribute_dataset
from jstrategy._src.input.datasets import distribute_datasets_from_function
from jstrategy._src.input.placement import put_rows
from jstrategy._src.mesh import DeviceMesh
from jstrategy._src.mesh import auto_mesh
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.run.program import RunPrograms
from jstrategy._src.validation import short_repr
from jstrategy._src.values import PerReplica
from jstrategy._src.values import is_per_replica
from jstrategy._src.values import local_replica_devices
from jstrategy._src.values import local_results
from jstrategy._src.values import on_a_mesh

__all__ = ["REPLICA_AXIS", "Strategy", "ValueContext", "get_strategy"]

#: The name of the mesh axis along which the replicas of the 1-D strategies (OneDevice,
#: Mirrored, TPU, ..., and FSDP) are laid. Use it for collectives in your own code, e.g.
#: ``nn.BatchNorm(axis_name=jstrategy.REPLICA_AXIS)``; `Strategy.axis_name` is the same
#: name for any strategy (``batch_dim_name`` for `ModelParallelStrategy`).
REPLICA_AXIS = axes.REPLICA_AXIS


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What `experimental_distribute_values_from_function` tells `value_fn` about a replica.

    Attributes:
      replica_id_in_sync_group: the replica whose value is being made.
      num_replicas_in_sync: how many replicas there are.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> values = strategy.experimental_distribute_values_from_function(
    ...     lambda ctx: ctx.replica_id_in_sync_group * 10.0)
    >>> [float(v) for v in strategy.experimental_local_results(values)]
    [0.0, 10.0]
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


class Strategy:
    """Where parameters and computation live, and how replicas talk.

    A strategy owns a `jax.sharding.Mesh`. One of its axes, the data axis (`axis_name`),
    has one entry per replica: a replica is one data-parallel group, which computes on its
    own slice of every batch. The 1-D strategies (`MirroredStrategy`, `OneDeviceStrategy`,
    ...) have only that axis, `REPLICA_AXIS` (``"replica"``), one device per replica. An
    N-D mesh (`ModelParallelStrategy`) adds axes along which variables are split; its
    replicas are groups of devices, and everything here (`run`, `reduce`, `gather`, the
    replica context, distributed datasets) works over the data axis, leaving the other
    axes to XLA's SPMD partitioner. Subclasses only choose the mesh and the policies
    (`variable_sharding`); everything here is shared.

    Args:
      devices: the replicas' devices, in replica order (a 1-D mesh along `REPLICA_AXIS`),
        or a mesh (`jstrategy.experimental.DeviceMesh` or `jax.sharding.Mesh`).
      cross_device_ops: how replicas' values are combined; defaults to
        `NcclAllReduce(num_packs=0)` (see `MirroredStrategy`).
      data_axis: the mesh axis along which replicas are laid, when `devices` is a mesh.

    Raises:
      ValueError: if `data_axis` is not an axis of the mesh.

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> isinstance(strategy, jstrategy.Strategy), strategy.axis_name
    (True, 'replica')
    >>> strategy.reduce("SUM", strategy.run(lambda: jnp.float32(1.0)), axis=None).item()
    2.0
    """

    def __init__(
        self,
        devices: Sequence[jax.Device] | Mesh | DeviceMesh,
        *,
        cross_device_ops: CrossDeviceOps | None = None,
        data_axis: str = REPLICA_AXIS,
    ):
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                f"`cross_device_ops` must be a jstrategy.CrossDeviceOps such as "
                f"NcclAllReduce(); got {type(cross_device_ops).__name__} {cross_device_ops!r}."
            )
        if isinstance(devices, (Mesh, DeviceMesh)):
            self._mesh = auto_mesh(devices)
            if data_axis not in self._mesh.axis_names:
                raise ValueError(
                    f"The data axis {data_axis!r} is not an axis of the mesh, whose axes are "
                    f"{tuple(self._mesh.axis_names)}. Name one of them (the axis the batch "
                    "is split over), or add it to the mesh."
                )
        else:
            self._mesh = Mesh(
                np.array(tuple(devices), dtype=object), (data_axis,), axis_types=(AxisType.Auto,)
            )
        self._data_axis = data_axis
        self._devices = tuple(self._mesh.devices.flat)
        self._cross_device_ops = cross_device_ops or NcclAllReduce(num_packs=0)
        self._run_programs = RunPrograms(self)
        self._gather_programs: dict[Any, Callable[..., Any]] = {}

    # Properties -------------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        """The mesh: replicas along `axis_name` (the only axis of the 1-D strategies)."""
        return self._mesh

    @property
    def axis_name(self) -> str:
        """The mesh axis along which replicas are laid (the data axis): ``"replica"`` for
        the 1-D strategies, ``batch_dim_name`` for `ModelParallelStrategy`."""
        return self._data_axis

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step: the size of the data axis."""
        return int(self._mesh.shape[self._data_axis])

    @property
    def batch_multiple(self) -> int:
        """What the rows of a global batch divide by: `num_replicas_in_sync` (each replica
        gets as many rows), times the microbatches for `PipelineStrategy`.

        `Model.fit`, `evaluate` and `predict`, distributed datasets and `distribute_batch`
        pad a batch to a multiple of it (the padding rows masked out).

        Example:

        >>> import jstrategy
        >>> jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]).batch_multiple
        2
        """
        return self.num_replicas_in_sync

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The strategy's devices in mesh order: the replicas' devices, in replica order, on
        a 1-D mesh."""
        return self._devices

    @property
    def local_devices(self) -> tuple[jax.Device, ...]:
        """This process's devices, in mesh order (all of them in one process)."""
        me = jax.process_index()
        return tuple(d for d in self._devices if d.process_index == me)

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """The devices this process computes on (`extended`'s ``worker_devices``)."""
        return self.local_devices

    @property
    def parameter_devices(self) -> tuple[jax.Device, ...]:
        """The devices the variables live on, as `variable_sharding` places them, in mesh
        order (`extended`'s ``parameter_devices``)."""
        held = self.variable_sharding(jax.ShapeDtypeStruct((), np.float32)).device_set
        return tuple(d for d in self._devices if d in held) or tuple(held)

    @property
    def extended(self) -> StrategyExtended:
        """TF's ``strategy.extended``: `worker_devices`, `parameter_devices` and
        ``variable_created_in_scope(v)``."""
        return StrategyExtended(self)

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """The algorithm that combines values across replicas."""
        return self._cross_device_ops

    def replicated_sharding(self) -> NamedSharding:
        """The sharding of a value with one full copy on every replica's device."""
        return NamedSharding(self._mesh, P())

    def batch_sharding(self) -> NamedSharding:
        """The sharding of a global batch split by rows across replicas: replica *i* owns
        the *i*-th contiguous slice of rows.

        Over the data axis, each replica's devices holding its rows whole; a strategy
        whose train step splits each replica's rows over its devices too
        (`HybridStrategy`: over ``("replica", "fsdp")``) places them so, and every route
        from host rows to the mesh (distributed datasets, `Model`'s batches, the
        train-step factory) follows it.

        Example:

        >>> import jstrategy
        >>> jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]).batch_sharding().spec
        P('replica',)
        """
        return NamedSharding(self._mesh, P(self._data_axis))

    def per_replica_sharding(self) -> NamedSharding:
        """The sharding of a stacked per-replica value (what `run` returns): its leading
        axis has one entry per replica, split over the data axis.

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.HybridStrategy(fsdp=2).per_replica_sharding().spec
        P('replica',)
        """
        return NamedSharding(self._mesh, P(self._data_axis))

    def variable_sharding(
        self, leaf: jax.ShapeDtypeStruct | jax.Array, path: tuple[str, ...] = ()
    ) -> jax.sharding.Sharding:
        """Where a variable lives between steps: the one place that decides it.

        Train states are placed with it (`jstrategy.training.place_state`, hence
        `create_train_state` and `Model`), checkpoints are restored straight into it, and
        the compiled steps write updated variables back to it. The default is one full
        copy per replica, in device memory (`replicated_sharding`). A strategy that keeps
        variables elsewhere overrides this method and nothing else: `CentralStorageStrategy`
        returns one copy in host memory; a partitioned strategy could return
        ``NamedSharding(mesh, P("ps"))`` for the variables it shards.

        The compiled steps compute on `replicated_sharding`: when this method places a
        variable anywhere else, a step copies it to the replicas' device memory for the
        computation and applies the update where the variable lives.

        Args:
          leaf: the variable's shape and dtype (its own sharding, if any, is ignored).
          path: the variable's keys in the state, as strings, e.g.
            ``("params", "Dense_0", "kernel")``; empty when unknown.

        Returns:
          A `jax.sharding.Sharding` for the variable.

        Example:

        >>> import jax, jax.numpy as jnp
        >>> import jstrategy
        >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
        >>> leaf = jax.ShapeDtypeStruct((3,), jnp.float32)
        >>> strategy.variable_sharding(leaf, ("params", "bias")) == strategy.replicated_sharding()
        True
        """
        del leaf, path  # every leaf is replicated alike
        return self.replicated_sharding()

    def annotation_axis(self, name: str) -> str | None:
        """The axis of this strategy's mesh that a model's sharding annotation naming the
        mesh axis `name` means here, or None: that dimension is not split.

        A model annotated for one mesh (``nn.with_partitioning(init, ("data", "model"))``,
        ``nnx`` ``sharding=``, logical axis rules such as ``("mlp", "model")``) trains
        under every strategy: each strategy reads the annotation's axes through this
        method. The strategies that keep a copy of every variable per replica split
        nothing, so every name means None; the sharded ones override it.

        Example:

        >>> import jstrategy
        >>> print(jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]).annotation_axis("model"))
        None
        """
        del name  # nothing is split
        return None

    # Scope ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this strategy current: `jstrategy.get_strategy()` returns it inside.

        Re-entering the same strategy's scope is allowed; entering another strategy's scope
        inside it raises `ValueError`.

        NNX variables created inside carry their sharding annotations as metadata but are
        not sharded when created (``nnx.use_eager_sharding(False)``): the strategy places
        them, reading the annotations through `annotation_axis`, when a train state or a
        `Model` is made of them. So a model annotated for any mesh is created in any scope.

        With Keras 3 (JAX backend) imported, the scope also makes this strategy's
        ``keras.distribution`` current (`jstrategy.keras`), so a ``keras.Model`` created
        and compiled inside trains distributed through Keras's own ``fit``.
        """
        with (
            context.strategy_scope(self),
            nnx.use_eager_sharding(False),
            context.scope_hooks_entered(self),
        ):
            yield self

    # run --------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None):
        """Runs `fn` once per replica, as one compiled SPMD program.

        `PerReplica` arguments (from `run`, distributed datasets or
        `experimental_distribute_values_from_function`) are split across replicas; arrays
        and numbers reach every replica whole, as that replica's own copy (TF's mirrored
        variable components): the gradient with respect to such a copy is the replica's
        local gradient, which `ReplicaContext.all_reduce` combines, exactly as in TF.
        Other Python objects are passed as they are and become part of the compilation
        cache key. Inside `fn`, `jstrategy.get_replica_context()` gives the
        `ReplicaContext`.

        The program (a `jax.shard_map` over `mesh`, under `jax.jit`) is cached: calling
        `run` again with the same `fn` and argument shapes does not trace `fn` again. The
        first call traces `fn` twice, once to learn which outputs are identical on every
        replica.

        Args:
          fn: the per-replica function.
          args: positional arguments for `fn`.
          kwargs: keyword arguments for `fn`.

        Returns:
          `fn`'s outputs: a leaf computed only from collectives' results (e.g. an
          `all_reduce`) or constants is identical on every replica and comes back as a
          replicated `jax.Array` (TF's Mirrored value); any other leaf is a `PerReplica`.
          Parameters updated from all-reduced gradients are a `PerReplica` whose replicas
          hold equal values; pass it back to the next `run` as it is.

        Example:

        >>> import jax.numpy as jnp
        >>> import jstrategy
        >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
        >>> def fn():
        ...     ctx = jstrategy.get_replica_context()
        ...     return ctx.replica_id_in_sync_group * 10
        >>> out = strategy.run(fn)
        >>> [int(v) for v in strategy.experimental_local_results(out)]
        [0, 10]
        """
        if not callable(fn):
            raise TypeError(f"`fn` must be callable; got {type(fn).__name__} {fn!r}.")
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"`args` must be a tuple or list of positional arguments; got "
                f"{type(args).__name__}. Wrap a single argument: args=(x,)."
            )
        if kwargs is not None and not isinstance(kwargs, collections.abc.Mapping):
            raise TypeError(
                f"`kwargs` must be a dict of keyword arguments for `fn`; got "
                f"{type(kwargs).__name__} {short_repr(kwargs)}. Pass kwargs={{'name': value}}, "
                f"or positional arguments as args=(...)."
            )
        kwargs = {} if kwargs is None else dict(kwargs)
        # One compiled program per function and kinds of arguments: `run/program.py`.
        return self._run_programs.run(fn, args, kwargs)

    # Cross-replica reductions -----------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines per-replica values across replicas (and along `axis`), as tf.distribute.

        Args:
          reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or ``"SUM"``/``"MEAN"``).
          value: a pytree of `PerReplica` values or arrays. A plain array counts as the
            same value on every replica (TF's Mirrored value).
          axis: if given, also reduce along this axis of each replica's value. MEAN then
            divides by the total number of elements across all replicas.

        Returns:
          The reduced pytree; arrays replicated on the strategy's devices.

        Example:

        >>> import jstrategy
        >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
        >>> per_replica = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: float(ctx.replica_id_in_sync_group + 1))
        >>> float(strategy.reduce("SUM", per_replica, axis=None))
        3.0
        """
        op = ReduceOp.from_value(reduce_op)
        value = on_a_mesh(value, self.per_replica_sharding())
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        distributed = [i for i, x in enumerate(leaves) if isinstance(x, PerReplica)]
        out = list(leaves)
        if distributed:
            reduced = self._cross_device_ops.reduce(op, [leaves[i] for i in distributed], axis=axis)
            for i, r in zip(distributed, reduced, strict=True):
                out[i] = r
        n = self.num_replicas_in_sync
        for i, leaf in enumerate(leaves):
            if i in distributed:
                continue
            x = jnp.asarray(leaf)
            if axis is not None:
                x = jnp.sum(x, axis) if op is ReduceOp.SUM else jnp.mean(x, axis)
            out[i] = x * n if op is ReduceOp.SUM else x
        return jax.tree.unflatten(treedef, out)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's value along `axis`, in replica order.

        Args:
          value: a pytree of `PerReplica` values (or plain arrays, counted once per replica).
          axis: the axis to concatenate along.

        Returns:
          A pytree of arrays, replicated on the strategy's devices.
        """
        value = on_a_mesh(value, self.per_replica_sharding())
        n = self.num_replicas_in_sync

        def one(leaf):
            if isinstance(leaf, PerReplica):
                x, stacked = leaf.value, leaf.stacked
            else:
                x, stacked = jnp.broadcast_to(leaf, (n, *np.shape(leaf))), True
            key = (x.shape, x.dtype, stacked, axis)
            program = self._gather_programs.get(key)
            if program is None:
                program = jax.jit(
                    _gather_fn(n, stacked, axis), out_shardings=self.replicated_sharding()
                )
                self._gather_programs[key] = program
            out = program(x)
            dispatch.track(out)  # an all-gather: bounded like `run`'s steps
            return out

        return jax.tree.map(one, value, is_leaf=is_per_replica)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """One value per local replica, in replica order (a 1-tuple for non-distributed values).

        Args:
          value: a pytree of `PerReplica` values and arrays.

        Returns:
          A tuple with one pytree per replica of this process.
        """
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        if not leaves:
            return (value,)
        per_leaf = [local_results(x, self._data_axis) for x in leaves]
        count = max(len(r) for r in per_leaf)
        per_leaf = [r if len(r) == count else r * count for r in per_leaf]
        return tuple(jax.tree.unflatten(treedef, [r[i] for r in per_leaf]) for i in range(count))

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """Builds per-replica values by calling `value_fn` once per local replica.

        Args:
          value_fn: called with a `ValueContext`; returns a pytree of arrays or numbers, the
            same structure and shapes for every replica.

        Returns:
          A pytree of `PerReplica` values.

        Raises:
          ValueError: if replicas' values differ in structure or shape.
        """
        n = self.num_replicas_in_sync
        sharding = self.per_replica_sharding()
        local = local_replica_devices(sharding, n)
        results = [value_fn(ValueContext(i, n)) for i, _ in local]
        structures = [jax.tree.structure(r) for r in results]
        if any(s != structures[0] for s in structures):  # type: ignore[operator]
            raise ValueError(
                f"`value_fn` must return the same structure for every replica; got {structures}."
            )
        per_leaf = zip(*[jax.tree.leaves(r) for r in results], strict=True)
        out = []
        for values in per_leaf:
            arrays = [np.asarray(v) for v in values]
            shapes = {a.shape for a in arrays}
            if len(shapes) != 1 or len({a.dtype for a in arrays}) != 1:
                raise ValueError(
                    "`value_fn` must return the same shape and dtype for every replica; got "
                    f"{[(a.shape, str(a.dtype)) for a in arrays]}."
                )
            # This process's rows: its replicas' values, stacked in replica order.
            [stacked] = put_rows(sharding, [np.stack(arrays)], [(n, *arrays[0].shape)])
            out.append(PerReplica(stacked, stacked=True))
        return jax.tree.unflatten(structures[0], out)

    # Input ------------------------------------------------------------------------------
    def experimental_distribute_dataset(
        self, dataset: Any, options: Any = None, *, global_batch_size: int | None = None
    ) -> Any:
        """Distributes an iterable of global batches over the replicas.

        Each element is the next global batch laid over the replicas: replica *i* gets
        the *i*-th contiguous slice of its rows, as in tf.distribute (on a multi-axis mesh
        every device of replica *i* holds that slice). Every element has one static shape
        so the compiled step is reused: a batch with fewer rows (the last one, or one whose
        rows do not divide by the replica count) is padded with zero rows, and each element
        carries a row mask that `run` hands to the replica context, so
        `jstrategy.compute_average_loss` counts only real rows. With several processes,
        every process iterates the same global batches and places only its replicas' rows.
        The next batches are put on the devices while the current one is used.

        Args:
          dataset: the global batches, each a pytree (array, tuple, dict, ...) of NumPy or
            JAX arrays sharing their leading (row) dimension: a list or other re-iterable,
            a zero-argument callable returning an iterator (a generator function), a
            one-shot iterator (iterated once only), a grain loader, or a
            `tf.data.Dataset` (read through ``as_numpy_iterator()``).
          options: a `jstrategy.InputOptions`; None for the defaults (fetch to the
            devices, one batch ahead). ``InputReplicationMode.PER_REPLICA`` is only for
            `distribute_datasets_from_function`.
          global_batch_size: the static rows of every element, a multiple of
            `num_replicas_in_sync`; None: the first batch's rows rounded up to one.

        Returns:
          A `DistributedDataset`: iterable (once per epoch, when the source is
          re-iterable), with `element_spec` and, when the source has one, `len()`. Its
          elements are pytrees of split `PerReplica` values to pass to `run`.

        Raises:
          TypeError: if `dataset` is not iterable or `options` is not an `InputOptions`.
          ValueError: for ``PER_REPLICA`` options or a `global_batch_size` that is not a
            positive multiple of `num_replicas_in_sync`. While iterating: a ragged batch,
            a leaf that is not an array, a batch unlike the first in structure, row shape
            or dtype, or one with more rows than the static size.

        Example:

        >>> import numpy as np
        >>> import jstrategy
        >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
        >>> rows = np.arange(6, dtype=np.float32)[:, None]
        >>> dist = strategy.experimental_distribute_dataset([rows[:4], rows[4:]])
        >>> for element in dist:  # replica 0, replica 1; the last batch padded
        ...     print([v.ravel().tolist() for v in strategy.experimental_local_results(element)])
        [[0.0, 1.0], [2.0, 3.0]]
        [[4.0, 5.0], [0.0, 0.0]]
        """

        return distribute_dataset(self, dataset, options, global_batch_size=global_batch_size)

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[Any], Any],
        options: Any = None,
        *,
        global_batch_size: int | None = None,
    ) -> Any:
        """Builds the input pipelines with `dataset_fn(InputContext)` and distributes them.

        `dataset_fn` is called now, once per input pipeline, with a `jstrategy.InputContext`
        (``num_input_pipelines``, ``input_pipeline_id``, ``num_replicas_in_sync``); shard the
        data by ``input_pipeline_id`` inside it. The pipelines depend on
        ``options.experimental_replication_mode``:

        * ``InputReplicationMode.PER_WORKER`` (default): one pipeline per process. As in
          TF, each element it yields is ONE REPLICA's batch
          (``ctx.get_per_replica_batch_size(global_batch_size)`` rows), and every step
          hands the pipeline's next elements to the process's replicas, in replica order:
          a step trains on ``per-replica rows * num_replicas_in_sync`` rows.
        * ``InputReplicationMode.PER_REPLICA``: one pipeline per local replica, with
          ``input_pipeline_id`` the replica id; each element is that replica's batch
          (``ctx.get_per_replica_batch_size(global_batch_size)`` rows). A pipeline that
          ends early yields all-padding batches until every pipeline has ended.

        Batches are padded to one static shape and masked as in
        `experimental_distribute_dataset`.

        Args:
          dataset_fn: called with an `InputContext`; returns the pipeline's batches in any
            form `experimental_distribute_dataset` accepts.
          options: a `jstrategy.InputOptions`; None for the defaults.
          global_batch_size: the static global rows of every element (the per-replica
            batch times `num_replicas_in_sync`); None: from the first per-replica batch.

        Returns:
          A `DistributedDataset` whose elements are pytrees of split `PerReplica` values.

        Raises:
          TypeError: if `dataset_fn` is not callable, returns None or something not
            iterable, or `options` is not an `InputOptions`.
          ValueError: for a bad `global_batch_size`, or per-process pipelines when the
            processes hold different numbers of replicas. While iterating: batches that are
            ragged, unlike the first, or over the static size.

        Example:

        >>> import numpy as np
        >>> import jstrategy
        >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
        >>> def dataset_fn(ctx):
        ...     rows = ctx.get_per_replica_batch_size(4)  # one replica's share of 4 rows
        ...     return [np.full((rows, 1), i, np.float32) for i in range(4)]
        >>> dist = strategy.distribute_datasets_from_function(dataset_fn)
        >>> [np.asarray(element.value)[:, 0].tolist() for element in dist]
        [[0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 3.0, 3.0]]
        """

        return distribute_datasets_from_function(
            self, dataset_fn, options, global_batch_size=global_batch_size
        )

    # ------------------------------------------------------------------------------------
    # Hooks: everything a strategy specializes, each a method with a default. A strategy
    # file overrides only what differs (docs/ARCHITECTURE.md says who overrides which).
    # Where variables live is the first of them: `variable_sharding`, above.
    # ------------------------------------------------------------------------------------
    def stage_train_step(
        self, fns: staging.StepFunctions, *, steps: int = 0, stacked: bool = True
    ) -> staging.TrainProgram:
        """How an update is staged: turns one training step into the program(s) that run it.

        The training layer (`make_train_step`, `jstrategy.Model`) describes the step as
        `StepFunctions` (the replica's gradients, the update, what the replicas read);
        this method decides where each runs. The default, for variables that live on
        every replica, is ONE ``jax.jit(jax.shard_map(...))`` program in which every
        replica computes its gradients, all-reduces them and applies the same update (a
        ``lax.scan`` of `steps` steps when ``steps > 0``). `CentralStorageStrategy` stages
        two programs per step: the gradients on the replicas, then the update applied once
        where the variables live.

        Args:
          fns: the step.
          steps: 0 for one step per call on one batch; else the steps each call runs.
          stacked: with ``steps > 0``, whether the batches come stacked on a leading axis
            (else as a tuple of batches).

        Returns:
          ``program(state, acc, batch, mask) -> (state, acc, logs)``: the new state, the
          running loss and metric sums `acc` plus this call's, and their means.
        """
        return staging.replicated_train_program(self, fns, steps=steps, stacked=stacked)

    def read_on_replicas(self, tree: Any) -> Any:
        """How a program over the replicas reads variables kept by this strategy.

        `tree` holds variables as `variable_sharding` places them; the result is what a
        program over the replicas (evaluation, prediction, `run`) takes. The default
        returns `tree` as it is: the variables already live on the replicas.
        `CentralStorageStrategy` copies its central host-memory variables to every replica.

        Args:
          tree: a pytree of variables placed by this strategy.

        Returns:
          The pytree, readable by the replicas.
        """
        return tree

    @property
    def activation_rows(self) -> str | tuple[str, ...] | None:
        """The mesh axes the train step splits the rows of a model's activations over
        between its blocks (a `PartitionSpec` entry), or None (the default): the step
        places no activation.

        Where it is set, the train step constrains the input of every block the model marks
        with `jstrategy.training.remat` (scanned or unrolled, with or without the step's
        ``remat``) and of each layer of a `Repeated` block run in order: its leading
        dimension (its rows) split over these axes, its other dimensions left to XLA, as
        MaxText's rules pin each layer's input to the batch's split. The model says nothing
        about the mesh. `ShardedStrategy` sets its data axis, `HybridStrategy` its
        replicas and FSDP axes (whatever the step splits a batch's rows over); the
        strategies whose step runs in a manual region, where each replica's rows are its
        own already, keep None.

        Example:

        >>> import jstrategy
        >>> print(jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]).activation_rows)
        None
        """
        return None

    @property
    def tensor_activations(self) -> TensorActivations:
        """Which dimension of the activations between blocks the train step splits over a
        tensor axis, where `activation_rows` places them (`TensorActivations`; the
        sharded strategies with a tensor layout take it as ``tensor_activations=``).

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.FSDPStrategy().tensor_activations
        <TensorActivations.FEATURES: 'features'>
        """
        return TensorActivations.FEATURES

    @property
    def pipeline(self) -> Any:
        """The pipeline the train step runs a model's `Repeated` blocks on, or None (the
        default: their layers run one after the other).

        Read once, when a step is built, into its `StepSpec.pipeline`; the step traces the
        model inside that pipeline's context, as it does inside `remat`'s policy.
        `PipelineStrategy` returns its `PipelineConfig` (stages, microbatches, schedule).

        Example:

        >>> import jstrategy
        >>> print(jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]).pipeline)
        None
        """
        return None

    @property
    def should_use_with_coordinator(self) -> bool:
        """Whether `jstrategy.Model.fit` trains through a `ClusterCoordinator` (TF's Keras
        reads ``strategy._should_use_with_coordinator`` for the same decision).

        False by default: `fit` runs the compiled steps on the replicas. True for
        `ParameterServerStrategy`, whose `fit` schedules each step on a worker; the training
        layer then runs its epochs with a coordinated fit runner.
        """
        return False

    def restore_variables(self, read: Callable[[Strategy | None], Any]) -> Any:
        """How a checkpoint's variables are laid out when restored under this strategy.

        `CheckpointManager.restore` and `load_weights` call it with `read`: ``read(self)``
        restores every leaf straight into `variable_sharding` (each process reading only
        its shards), ``read(None)`` restores to the host as NumPy arrays. The default is
        the former. `ParameterServerStrategy` reads to the host and creates its variables
        on the parameter servers.

        Args:
          read: reads the checkpoint, laid out by the given strategy (or on the host).

        Returns:
          The restored variables, as this strategy keeps them.
        """
        return read(self)

    def __repr__(self) -> str:
        if len(self._mesh.axis_names) > 1:
            axes = ", ".join(f"{name!r}: {size}" for name, size in self._mesh.shape.items())
            return f"{type(self).__name__}(mesh={{{axes}}}, data_axis={self._data_axis!r})"

        names = [canonical_name(d) for d in self._devices]
        shown = names if len(names) <= 4 else [*names[:2], "...", names[-1]]
        return f"{type(self).__name__}(devices=[{', '.join(shown)}])"


def _gather_fn(n: int, stacked: bool, axis: int) -> Callable[[jax.Array], jax.Array]:
    def gather(x):
        if not stacked:
            x = x.reshape(n, x.shape[0] // n, *x.shape[1:])
        rank = x.ndim - 1
        if not -rank <= axis < rank:
            raise ValueError(
                f"`axis` must index each replica's value of rank {rank}; got axis={axis}."
            )
        a = axis % rank
        x = jnp.moveaxis(x, 0, a)
        return x.reshape(*x.shape[:a], x.shape[a] * x.shape[a + 1], *x.shape[a + 2 :])

    return gather


def get_strategy() -> Strategy:
    """The current strategy: the innermost `scope()`, or the default strategy outside any.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.OneDeviceStrategy("cpu:0")
    >>> with strategy.scope():
    ...     jstrategy.get_strategy() is strategy
    True
    >>> jstrategy.has_strategy()
    False
    """
    # The context's stack holds only `Strategy` objects (`scope` and `run` push them); it
    # types them by the protocol because it sits below this module.
    return cast(Strategy, context.get_strategy())
