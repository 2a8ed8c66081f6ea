"""The core `Strategy`: one implementation that every strategy specializes by policy."""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import threading
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

from jstrategy._src import context
from jstrategy._src import dispatch
from jstrategy._src import mirrored_check
from jstrategy._src import staging
from jstrategy._src import tracked
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
from jstrategy._src.validation import short_repr
from jstrategy._src.values import PerReplica
from jstrategy._src.values import is_per_replica
from jstrategy._src.values import local_replica_devices
from jstrategy._src.values import local_results
from jstrategy._src.values import on_a_mesh
from jstrategy._src.values import varying_axes

__all__ = ["REPLICA_AXIS", "Strategy", "ValueContext", "get_strategy"]

#: The name of the mesh axis along which the replicas of the 1-D strategies (OneDevice,
#: Mirrored, TPU, ..., and FSDP) are laid. Use it for collectives in your own code, e.g.
#: ``nn.BatchNorm(axis_name=jstrategy.REPLICA_AXIS)``; `Strategy.axis_name` is the same
#: name for any strategy (``batch_dim_name`` for `ModelParallelStrategy`).
REPLICA_AXIS = "replica"

_RUN_CACHE_SIZE = 256

# How each leaf of `run`'s arguments reaches the replicas.
_STACKED = "stacked"  # PerReplica with a replica axis: replica i gets value[i].
# A stacked PerReplica that `experimental_check_mirrored` found the same on every replica
# (an output of `run` that must be mirrored), passed back: checked again as mirrored.
_STACKED_MIRRORED = "stacked_mirrored"
_SPLIT = "split"  # PerReplica of rows: replica i gets the i-th contiguous slice.
_WHOLE = "whole"  # an array or number: every replica gets all of it.
_STATIC = "static"  # any other Python object: passed as is, part of the cache key.

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, int, float, complex, bool)


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


@dataclasses.dataclass
class _RunProgram:
    compiled: Callable[..., Any]
    out_tree: Any
    varying: list[bool]
    # Stateful objects' holders the function touched (`tracked.py`): those it wrote are
    # donated inputs and outputs of the program, the others inputs only.
    written: list[tracked.TrackedState] = dataclasses.field(default_factory=list)
    read_only: list[tracked.Holder] = dataclasses.field(default_factory=list)
    # The updates it pushed (holder, how), in order: outputs applied after each call.
    pushes: list[tuple[tracked.Holder, Any]] = dataclasses.field(default_factory=list)
    # With `experimental_check_mirrored`: the output leaves that must be mirrored.
    checked: list[int] = dataclasses.field(default_factory=list)


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
        self._run_cache: collections.OrderedDict[Any, _RunProgram] = collections.OrderedDict()
        self._lock = threading.Lock()
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
        """The sharding of a global batch split by rows across replicas (over the data
        axis; each replica's devices hold its rows whole)."""
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
        """
        with context.strategy_scope(self), nnx.use_eager_sharding(False):
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
        leaves, treedef = jax.tree.flatten((tuple(args), kwargs), is_leaf=is_per_replica)
        kinds: list[str] = []
        dynamic: list[Any] = []
        statics: list[Any] = []
        mask = None
        check = mirrored_check.enabled()
        for leaf in leaves:
            if isinstance(leaf, PerReplica):
                self._check_per_replica(leaf)
                if not leaf.stacked:
                    kinds.append(_SPLIT)
                else:
                    kinds.append(_STACKED_MIRRORED if check and leaf.mirrored else _STACKED)
                dynamic.append(leaf.value)
                if mask is None:
                    mask = leaf.mask
            elif isinstance(leaf, _ARRAY_TYPES):
                kinds.append(_WHOLE)
                dynamic.append(leaf)
            else:
                kinds.append(_STATIC)
                statics.append(leaf)
        has_mask = mask is not None
        if has_mask:
            dynamic.append(mask)
        key = (fn, treedef, tuple(kinds), tuple(statics), has_mask, check)
        try:
            program = self._run_cache.get(key)
        except TypeError:
            raise TypeError(
                "`run` passes arguments that are not arrays as Python objects and compiles "
                f"one program per value, so they must be hashable; got unhashable "
                f"{[type(s).__name__ for s in statics]}. Pass arrays instead."
            ) from None
        if program is None:
            program = self._build_run(fn, treedef, kinds, statics, has_mask, dynamic)
            with self._lock:
                self._run_cache[key] = program
                if len(self._run_cache) > _RUN_CACHE_SIZE:
                    self._run_cache.popitem(last=False)
        if (program.written or program.read_only or program.pushes) and any(
            isinstance(x, jax.core.Tracer) for x in dynamic
        ):
            self._refuse_outer_trace(program)
        outs, written, pushed, flags = program.compiled(*dynamic, *self._held_values(program))
        if program.written or program.pushes:
            self._store_written(program, written, pushed)
        dispatch.track(flags)
        if program.checked:
            self._raise_if_disagree(program, flags)
        wrapped = [
            PerReplica(o, stacked=True, mirrored=i in program.checked) if v else o
            for i, (o, v) in enumerate(zip(outs, program.varying, strict=True))
        ]
        return jax.tree.unflatten(program.out_tree, wrapped)

    def _held_values(self, program: _RunProgram) -> tuple[list[Any], list[Any]]:
        """The current values of the holders a `run` program takes, as the replicas read them."""
        written = [h.value_on(self) for h in program.written]
        read_only = [h.value_on(self) for h in program.read_only]
        return self.read_on_replicas(written), self.read_on_replicas(read_only)

    def _refuse_outer_trace(self, program: _RunProgram) -> None:
        holders = (*program.written, *program.read_only, *(h for h, _ in program.pushes))
        names = list(dict.fromkeys(h.name for h in holders))
        raise RuntimeError(
            f"strategy.run was called inside a function that JAX compiles (jax.jit, ...) "
            f"and uses {names}: their values would be frozen into that program when it is "
            "traced and their updates never applied. run compiles its function itself "
            "(TF's @tf.function is not needed): call it outside jax.jit."
        )

    def _store_written(self, program: _RunProgram, values: list[Any], pushed: list[Any]) -> None:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((values, pushed))):
            self._refuse_outer_trace(program)
        for holder, value in zip(program.written, values, strict=True):
            holder.store(value, self)
        for (sink, how), value in zip(program.pushes, pushed, strict=True):
            sink.apply(value, how)

    def _raise_if_disagree(self, program: _RunProgram, flags: Any) -> None:
        disagree = np.asarray(jax.device_get(flags))
        if disagree.any():
            paths = jax.tree_util.tree_unflatten(
                program.out_tree, [f"leaf {i}" for i in range(len(program.varying))]
            )
            flat = jax.tree_util.tree_flatten_with_path(paths)[0]
            names = [
                jax.tree_util.keystr(flat[i][0]) or "the output"
                for i, bad in zip(program.checked, disagree, strict=True)
                if bad
            ]
            raise ValueError(
                f"The replicas disagree on {names}, outputs of the function given to "
                "strategy.run that are computed only from replicated arguments, constants "
                "and collectives, and so must be the same on every replica (e.g. parameters "
                "updated from gradients). Were the gradients combined across replicas? Use "
                "get_replica_context().all_reduce('SUM', grads), or a "
                "jstrategy.optimizers optimizer's apply_gradients, which does it. "
                "(jstrategy.config.experimental_check_mirrored is on.)"
            )

    def _check_per_replica(self, value: PerReplica) -> None:
        sharding = getattr(value.value, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and mesh.shape_tuple != self._mesh.shape_tuple:
            raise ValueError(
                f"A PerReplica argument has {value.num_replicas} replicas but this strategy has "
                f"{self.num_replicas_in_sync}. Pass values made by this strategy (its run, "
                "datasets or experimental_distribute_values_from_function)."
            )

    def _build_run(self, fn, treedef, kinds, statics, has_mask, example) -> _RunProgram:
        data = self._data_axis
        per_replica_kinds = (_STACKED, _STACKED_MIRRORED, _SPLIT)
        user_specs = tuple(
            P(data) if k in per_replica_kinds else P() for k in kinds if k != _STATIC
        ) + ((P(data),) if has_mask else ())
        # Manual over the data axis only: a mesh's other axes stay automatic, so variables
        # split over them keep their layout inside `fn` and XLA partitions the math.
        shard_map = functools.partial(jax.shard_map, mesh=self._mesh, axis_names=frozenset({data}))

        def call(values, frame, *, shared=False):
            row_mask = values[-1] if has_mask else None
            replica_context = context.ReplicaContext(self, row_mask=row_mask)
            value_iter, static_iter = iter(values), iter(statics)
            leaves = []
            for kind in kinds:
                if kind == _STATIC:
                    leaves.append(next(static_iter))
                else:
                    value = next(value_iter)
                    if kind == _STACKED or (kind == _STACKED_MIRRORED and not shared):
                        value = value[0]
                    elif kind == _WHOLE and not shared:
                        value = _per_replica_copy(value, data)
                    leaves.append(value)
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            with context.replica_scope(self, replica_context), tracked.run_frame(frame):
                return jax.tree.flatten(fn(*args, **kwargs))

        # First trace (shapes only): the outputs' structure, which of them are per-replica,
        # and the holders of stateful objects the function touches.
        info: list[Any] = []

        def probe(*values, shared=False):
            frame = tracked.RunFrame(self, (), None)
            flat, out_tree = call(values, frame, shared=shared)
            flat = [jnp.asarray(x) for x in flat]
            info.append((out_tree, [data in varying_axes(x) for x in flat], frame))
            return [x[None] for x in flat]

        jax.eval_shape(shard_map(probe, in_specs=user_specs, out_specs=P(data)), *example)
        out_tree, varying, frame = info[0]
        written = list(frame.written.values())
        read_only = [h for h in frame.touched if id(h) not in frame.written]
        pushes = [(h, how) for h, _, how in frame.pushes]
        checked: list[int] = []
        if mirrored_check.enabled():
            # With replicated (and checked-mirrored) arguments typed as one shared value,
            # which outputs come out the same on every replica?
            shared_specs, shared_example = [], []
            dynamic_kinds = [k for k in kinds if k != _STATIC] + ([_SPLIT] if has_mask else [])
            for kind, spec, value in zip(dynamic_kinds, user_specs, example, strict=True):
                if kind == _STACKED_MIRRORED:
                    spec, value = P(), jax.ShapeDtypeStruct(value.shape[1:], value.dtype)
                shared_specs.append(spec)
                shared_example.append(value)
            jax.eval_shape(
                shard_map(
                    functools.partial(probe, shared=True),
                    in_specs=tuple(shared_specs),
                    out_specs=P(data),
                ),
                *shared_example,
            )
            shared_varying = info[1][1]
            checked = [
                i
                for i, (v, s) in enumerate(zip(varying, shared_varying, strict=True))
                if v and not s
            ]
        planned = written + read_only

        def body(*inputs):
            *values, written_values, read_values = inputs
            frame = tracked.RunFrame(self, planned, [*written_values, *read_values])
            try:
                flat, _ = call(values, frame)
                if [(id(h), how) for h, _, how in frame.pushes] != [
                    (id(h), how) for h, how in pushes
                ]:
                    raise tracked.Replan()
            except tracked.Replan:
                raise RuntimeError(
                    "The function given to strategy.run used other metrics, optimizers, "
                    "models or parameter-server variables when it was traced again (for new "
                    "argument shapes) than the first time. Use the same stateful objects on "
                    "every call."
                ) from None
            outs = [jnp.asarray(x)[None] if v else x for x, v in zip(flat, varying, strict=True)]
            new_values = [frame.final(h) for h in written]
            pushed = [value for _, value, _ in frame.pushes]
            # A small output of every call that is never donated: what `run` waits on to
            # bound the calls in flight, also when `fn` returns nothing and only writes
            # state (whose arrays the next call consumes).
            flags = jnp.zeros((), jnp.bool_)
            if checked:
                flags = mirrored_check.disagreement([flat[i] for i in checked], data)
            return outs, new_values, pushed, flags

        def holder_specs(holders: Sequence[tracked.Holder]) -> list[P]:
            return [P(data) if h.per_replica else P() for h in holders]

        out_specs = (
            [P(data) if v else P() for v in varying],
            holder_specs(written),
            [P() for _ in pushes],
            P(),
        )
        in_specs = (*user_specs, holder_specs(written), holder_specs(read_only))
        compiled = jax.jit(
            shard_map(body, in_specs=in_specs, out_specs=out_specs),
            donate_argnums=(len(user_specs),) if written else (),
        )
        return _RunProgram(compiled, out_tree, varying, written, read_only, pushes, checked)

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
        value = on_a_mesh(value, self.batch_sharding())
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
        value = on_a_mesh(value, self.batch_sharding())
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
        sharding = self.batch_sharding()
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


def _per_replica_copy(value: Any, axis_name: str) -> jax.Array:
    """Types a replicated argument as this replica's own copy, as TF's mirrored components.

    JAX would otherwise treat it as one value shared by all replicas, and the gradient with
    respect to it would already be summed over the replicas; as a per-replica copy its
    gradient is this replica's, and `ReplicaContext.all_reduce` combines them, as in TF.
    The cast is free: it changes the type, not the data.
    """
    value = jnp.asarray(value)
    if axis_name in varying_axes(value):
        return value
    return jax.lax.pcast(value, axis_name, to="varying")


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
