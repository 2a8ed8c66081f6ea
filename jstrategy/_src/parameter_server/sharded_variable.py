"""Variables that live on parameter servers: `Variable`, `ShardedVariable` and `VariableTree`.

`ParameterServerStrategy.create_variables(tree, optimizer=...)` turns each leaf of a pytree
(parameters, counters, ...) into a `Variable` on one parameter server, round-robin, or,
with a `variable_partitioner`, into a `ShardedVariable` whose row blocks sit on successive
parameter servers. It returns a `VariableTree`, the handle training code uses:

* ``read()`` pulls the current values onto the device of the worker running the code
  (the coordinator's device elsewhere): a pytree of arrays shaped like the original;
* ``apply_gradients(grads)`` pushes a gradient pytree; each parameter server applies the
  optimizer to its variables at once, atomically per variable, without waiting for other
  workers (asynchronous training);
* ``assign``, ``assign_add``, ``assign_sub`` and ``numpy()`` do what they say.

The optimizer runs per variable, as TF's optimizers do with slot variables: its state for
a variable (or shard) lives on that variable's parameter server. Element-wise optimizers
(SGD, momentum, Adam, RMSProp, Adagrad, ...) give exactly the updates of the same optimizer
over the whole tree; transformations that couple variables (``clip_by_global_norm``) act
per variable, so clip gradients on the worker instead.
"""

from __future__ import annotations

import itertools
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src.names import path_str
from jstrategy._src.parameter_server import backend as backend_lib
from jstrategy._src.parameter_server import run_capture
from jstrategy._src.parameter_server.partitioners import shard_offsets
from jstrategy._src.values import PerReplica
from jstrategy._src.values import is_per_replica

__all__ = ["ShardedVariable", "Variable", "VariableTree"]

_TREE_IDS = itertools.count()


def _default_device(fallback: jax.Device | None) -> jax.Device:
    worker = backend_lib.current_worker()
    if worker is not None:
        return worker.device
    return fallback if fallback is not None else jax.devices()[0]


class _Assignable:
    """`assign`, `assign_add` and `assign_sub`, through the class's `_apply(kind, value)`,
    and `numpy`, through its `read_value`.

    A `ShardedVariable` takes full-shape values (or scalars) and splits them by rows.
    """

    name: str

    def _apply(self, kind: str, value: Any) -> None:
        raise NotImplementedError

    def read_value(self, device: jax.Device | None = None) -> jax.Array:
        raise NotImplementedError

    def numpy(self) -> np.ndarray:
        """The (whole) current value as a NumPy array."""
        run_capture.refuse_inside_trace(f"{self.name}.numpy()", captured=False)
        return np.asarray(jax.device_get(self.read_value()))

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def assign(self, value: Any) -> None:
        """Sets the value (cast to the variable's dtype)."""
        self._apply(backend_lib.ASSIGN, value)

    def assign_add(self, delta: Any) -> None:
        """Adds `delta` atomically on the parameter server(s)."""
        self._apply(backend_lib.ASSIGN_ADD, delta)

    def assign_sub(self, delta: Any) -> None:
        """Subtracts `delta` atomically on the parameter server(s)."""
        self._apply(backend_lib.ASSIGN_SUB, delta)


class Variable(_Assignable):
    """One array on one parameter server (TF's variable placed on a ``ps`` task).

    Created by `ParameterServerStrategy.create_variables`; not constructed directly.

    Attributes:
      name: the variable's name: its path in the tree, e.g. ``"params/Dense_0/kernel"``
        (``".../part_1"`` for a shard).
      shape: its shape.
      dtype: its dtype.
      ps_task: the index of the parameter server that holds it.

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> from jstrategy.coordinator import local_cluster_resolver
    >>> strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1, num_ps=2))
    >>> tree = strategy.create_variables({"a": jnp.zeros(2), "b": jnp.ones(3)})
    >>> [(v.name, v.shape, v.ps_task) for v in tree.variables.values()]
    [('a', (2,), 0), ('b', (3,), 1)]
    """

    def __init__(self, store: Any, var_id: int, name: str, shape, dtype, tree: VariableTree):
        self._store = store
        self._id = var_id
        self.name = name
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._tree = tree

    @property
    def ps_task(self) -> int:
        return self._store.ps_index

    @property
    def device(self) -> str:
        """TF's name of the device holding it: ``/job:ps/replica:0/task:<i>/device:CPU:0``."""
        return f"/job:ps/replica:0/task:{self.ps_task}/device:CPU:0"

    def read_value(self, device: jax.Device | None = None) -> jax.Array:
        """The current value, on `device` (default: this worker's, or the coordinator's)."""
        target = _default_device(device or self._tree._coordinator_device)
        return self._tree._read_flat([self], target)[0]

    def _apply(self, kind: str, value: Any) -> None:
        self._tree._apply_flat([self], [value], kind)

    def __repr__(self) -> str:
        return (
            f"Variable(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"device={self.device!r})"
        )


class ShardedVariable(_Assignable):
    """A variable split along its first axis into `Variable` shards on several servers.

    Shard ``i`` holds rows ``offsets[i]:offsets[i+1]`` (TF's layout: the first
    ``rows % num_shards`` shards get one extra row). The full value is assembled on demand.

    Attributes:
      name: the variable's name; shard ``i`` is named ``"<name>/part_<i>"``.
      shards: the `Variable` shards, in row order (also ``variables``, as in TF).
      shape: the full shape.
      dtype: the dtype.
      offsets: the row offsets of the shards (``len(shards) + 1`` of them).

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> from jstrategy.coordinator import local_cluster_resolver
    >>> from jstrategy.experimental.partitioners import FixedShardsPartitioner
    >>> strategy = jstrategy.ParameterServerStrategy(
    ...     local_cluster_resolver(num_workers=1, num_ps=2),
    ...     variable_partitioner=FixedShardsPartitioner(2))
    >>> w = strategy.create_variables({"w": jnp.arange(5.0)}).variables["w"]
    >>> w.name, w.offsets, [s.name for s in w.shards]
    ('w', [0, 3, 5], ['w/part_0', 'w/part_1'])
    >>> w.numpy().tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0]
    """

    def __init__(self, shards: Sequence[Variable], name: str):
        shards = list(shards)
        if not shards or any(not isinstance(s, Variable) for s in shards):
            raise TypeError(f"`shards` must be a non-empty list of Variables; got {shards!r}.")
        if len({s.dtype for s in shards}) > 1 or len({s.shape[1:] for s in shards}) > 1:
            raise ValueError(
                "All shards must share a dtype and all axes but the first; got "
                f"{[(s.shape, str(s.dtype)) for s in shards]}."
            )
        self.name = name
        self._shards = shards
        self.offsets = [0, *itertools.accumulate(s.shape[0] for s in shards)]
        self.shape = (self.offsets[-1], *shards[0].shape[1:])
        self.dtype = shards[0].dtype

    @property
    def shards(self) -> list[Variable]:
        return list(self._shards)

    @property
    def variables(self) -> list[Variable]:
        """The shards (TF's name)."""
        return list(self._shards)

    def __iter__(self):
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def read_value(self, device: jax.Device | None = None) -> jax.Array:
        """The full value: the shards concatenated, on `device` (default as `Variable`)."""
        tree = self._shards[0]._tree
        target = _default_device(device or tree._coordinator_device)
        parts = tree._read_flat(self._shards, target)
        return jnp.concatenate(parts, axis=0)

    def _apply(self, kind: str, value: Any) -> None:
        value = _as_array(value, self)
        _check_shape(self, np.shape(value))
        if value.ndim == 0:
            parts = [value] * len(self._shards)
        else:
            parts = [value[a:b] for a, b in itertools.pairwise(self.offsets)]
        self._shards[0]._tree._apply_flat(self._shards, parts, kind)

    def __repr__(self) -> str:
        return (
            f"ShardedVariable(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"shards={[s.shape[0] for s in self._shards]})"
        )


_UPDATING = "Updating parameter-server variables"


def only_replica(leaf: Any) -> Any:
    """The value of a one-replica `PerReplica` (what `run` returns under this strategy).

    Raises:
      ValueError: for a `PerReplica` of several replicas (from another strategy).
    """
    if not isinstance(leaf, PerReplica):
        return leaf
    if leaf.num_replicas != 1:
        raise ValueError(
            f"Got a PerReplica value of {leaf.num_replicas} replicas; ParameterServerStrategy "
            "has one replica per worker. Combine the replicas first, e.g. "
            "strategy.reduce('SUM', value, axis=None) with the strategy that made it."
        )
    return _first_row(leaf.value) if leaf.stacked else leaf.value


# Compiled once: indexing outside `jit` costs several times its dispatch.
_first_row = jax.jit(lambda x: x[0])


def _as_array(value: Any, var: Variable | ShardedVariable) -> Any:
    """`value` as an array (NumPy for host values, so they travel once), or a clear error."""
    if isinstance(value, (jax.Array, jax.core.Tracer, np.ndarray)):
        array = value
    else:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"An update of variable {var.name!r} must be a numeric array; got "
                f"{type(value).__name__} ({e})."
            ) from None
    if not backend_lib.fits_dtype(array.dtype, var.dtype):
        raise TypeError(
            f"An update of variable {var.name!r} ({var.dtype}) must be a real numeric array; "
            f"got dtype {array.dtype}."
        )
    return array


def _checked_update(var: Variable, value: Any, traced_ok: bool) -> Any:
    """`value` checked to fit `var`: numeric, its shape (scalars broadcast), not traced."""
    if isinstance(value, jax.core.Tracer) and not traced_ok:
        raise TypeError(
            f"An update of variable {var.name!r} got a traced value ({value.aval}): it was "
            "computed inside jax.jit, grad or another transformation, and only the concrete "
            "result can be pushed to a parameter server. Return the value from the "
            "transformed function and push it outside, or update inside strategy.run, which "
            "pushes each call's result."
        )
    array = _as_array(value, var)
    _check_shape(var, np.shape(array))
    if np.shape(array) == var.shape:
        return array
    if isinstance(array, np.ndarray):
        return np.broadcast_to(array, var.shape)
    return jnp.broadcast_to(array, var.shape)


def _check_shape(var: Variable | ShardedVariable, shape: tuple[int, ...]) -> None:
    if tuple(shape) not in (var.shape, ()):
        raise ValueError(
            f"An update of variable {var.name!r} must have its shape {var.shape} (or be a "
            f"scalar); got shape {tuple(shape)}."
        )


class VariableTree:
    """A pytree of parameter-server variables: pull values, push gradients and updates.

    Created by `ParameterServerStrategy.create_variables`. It can be used on the coordinator
    and inside functions scheduled with `ClusterCoordinator.schedule` (with the Ray backend
    it travels to the worker processes and talks to the parameter servers directly).

    Attributes:
      variables: the pytree, with a `Variable` or `ShardedVariable` per original leaf.
      optimizer: the optax transformation `apply_gradients` runs, or None.

    Example:

    >>> import jax.numpy as jnp, optax, jstrategy
    >>> from jstrategy.coordinator import local_cluster_resolver
    >>> strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1))
    >>> tree = strategy.create_variables({"w": jnp.ones(2)}, optimizer=optax.sgd(0.5))
    >>> tree.apply_gradients({"w": jnp.ones(2)})    # w - 0.5 * gradient, on the ps
    >>> tree.numpy()["w"].tolist()
    [0.5, 0.5]
    """

    def __init__(self, treedef: Any, leaves: list[Variable | ShardedVariable], optimizer: Any):
        self._treedef = treedef
        self._leaves = leaves
        self.optimizer = optimizer
        self._coordinator_device: jax.Device | None = None
        # The flat list of parameter-server variables (shards unrolled), in leaf order.
        flat: list[Variable] = []
        for leaf in leaves:
            flat.extend(leaf.shards if isinstance(leaf, ShardedVariable) else [leaf])
        self._flat = flat
        self._assemble: Any = None
        self._split: Any = None
        self._lock = threading.Lock()
        # What `run` threads for each list of variables read or updated inside it.
        self._holders: dict[tuple[int, ...], run_capture.ParameterServerHolder] = {}
        self._token = uuid.uuid4().hex
        _TREES[self._token] = self

    def __reduce__(self):
        # A tree sent to a worker process again (with every scheduled function) becomes the
        # copy that process already has, whose compiled programs are reused.
        state = dict(self.__dict__)
        # Devices and compiled programs belong to this process.
        state.update(_coordinator_device=None, _assemble=None, _split=None, _lock=None, _holders={})
        return (_restore_tree, (self._token,), state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_token" in self.__dict__:
            return  # an existing copy, returned by _restore_tree
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _TREES[self._token] = self

    @property
    def variables(self) -> Any:
        return jax.tree.unflatten(self._treedef, self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    # Internals --------------------------------------------------------------------------
    def _groups(self, flat: Sequence[Variable]) -> dict[Any, list[int]]:
        groups: dict[Any, list[int]] = {}
        for var in flat:
            groups.setdefault(var._store, []).append(var._id)
        return groups

    def _holder(self, flat: Sequence[Variable]) -> run_capture.ParameterServerHolder:
        """The holder `run` threads for these variables (one per list of variables)."""
        key = tuple(v._id for v in flat)
        holder = self._holders.get(key)
        if holder is None:
            holder = self._holders.setdefault(key, run_capture.ParameterServerHolder(self, flat))
        return holder

    def _read_flat(self, flat: Sequence[Variable], device: jax.Device) -> list[jax.Array]:
        frame = run_capture.capturing()
        if frame is not None:
            return self._holder(flat).read(frame)
        return self._pull_flat(flat, device)

    def _pull_flat(self, flat: Sequence[Variable], device: jax.Device) -> list[jax.Array]:
        run_capture.refuse_inside_trace("Reading parameter-server variables")
        groups = self._groups(flat)
        client_type = type(next(iter(groups)))
        values = client_type.read_groups(groups, device)
        cursors = {store: iter(vals) for store, vals in values.items()}
        return [next(cursors[var._store]) for var in flat]

    def _apply_flat(self, flat: Sequence[Variable], args: Sequence[Any], kind: str) -> None:
        frame = run_capture.capturing()
        if frame is None:
            run_capture.refuse_inside_trace(_UPDATING)
        # Every value is checked before any is pushed: an update either reaches every
        # variable or none, and never leaves a store holding a wrong value.
        traced_ok = frame is not None
        args = [_checked_update(v, a, traced_ok) for v, a in zip(flat, args, strict=True)]
        if frame is not None:
            self._holder(flat).push(frame, args, kind)
            return
        worker = backend_lib.current_worker()
        if worker is not None:
            # A worker that dies before its push leaves the variables untouched.
            worker.check_alive()
        groups: dict[Any, tuple[list[int], list[Any]]] = {}
        for var, arg in zip(flat, args, strict=True):
            ids, values = groups.setdefault(var._store, ([], []))
            ids.append(var._id)
            values.append(arg)
        client_type = type(next(iter(groups)))
        client_type.apply_groups(groups, kind)

    def _programs(self) -> tuple[Any, Any]:
        with self._lock:
            if self._assemble is None:
                sharded = [
                    (leaf.offsets if isinstance(leaf, ShardedVariable) else None)
                    for leaf in self._leaves
                ]

                def assemble(flat):
                    it = iter(flat)
                    out = []
                    for offsets in sharded:
                        if offsets is None:
                            out.append(next(it))
                        else:
                            parts = [next(it) for _ in range(len(offsets) - 1)]
                            out.append(jnp.concatenate(parts, axis=0))
                    return out

                def split(leaves):
                    out = []
                    for offsets, leaf in zip(sharded, leaves, strict=True):
                        if offsets is None:
                            out.append(leaf)
                        else:
                            out.extend(leaf[a:b] for a, b in itertools.pairwise(offsets))
                    return out

                has_shards = any(s is not None for s in sharded)
                self._assemble = jax.jit(assemble) if has_shards else list
                self._split = jax.jit(split) if has_shards else list
            return self._assemble, self._split

    def _flatten_like(self, tree: Any, what: str) -> list[Any]:
        # What `strategy.run` returned (e.g. gradients) can be pushed as it is.
        tree = jax.tree.map(only_replica, tree, is_leaf=is_per_replica)
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self._treedef:
            raise ValueError(
                f"`{what}` must have the structure of the variables, {self._treedef}; got "
                f"{treedef}. Pass a pytree shaped like the tree given to create_variables."
            )
        for leaf, var in zip(leaves, self._leaves, strict=True):
            if np.shape(leaf) not in (var.shape, ()):
                raise ValueError(
                    f"`{what}` for variable {var.name!r} must have shape {var.shape}; got "
                    f"{np.shape(leaf)}."
                )
        return leaves

    def _push(self, tree: Any, kind: str, what: str) -> None:
        run_capture.refuse_inside_trace(_UPDATING)
        leaves = self._flatten_like(tree, what)
        _, split = self._programs()
        full = []
        for x, var in zip(leaves, self._leaves, strict=True):
            x = _as_array(x, var)
            full.append(jnp.broadcast_to(x, var.shape) if np.shape(x) != var.shape else x)
        self._apply_flat(self._flat, split(full), kind)

    # Public -----------------------------------------------------------------------------
    def read(self, device: jax.Device | None = None) -> Any:
        """Pulls the current values: a pytree of arrays shaped like the original tree.

        Args:
          device: where to put them; default: the device of the worker running the
            current scheduled function, or the coordinator's device outside one.

        Returns:
          The values, sharded variables assembled to their full shape.

        Raises:
          ParameterServerFailureError: if a parameter server is unavailable.
        """
        target = _default_device(device or self._coordinator_device)
        assemble, _ = self._programs()
        flat = self._read_flat(self._flat, target)
        return jax.tree.unflatten(self._treedef, assemble(flat))

    def numpy(self) -> Any:
        """The current values as NumPy arrays (a pytree shaped like the original)."""
        run_capture.refuse_inside_trace("VariableTree.numpy()", captured=False)
        return backend_lib.to_numpy(self.read())

    def checkpoint_value(self) -> Any:
        """What `CheckpointManager.save` and `save_weights` write for these variables."""
        # What `CheckpointManager.save` and `save_weights` write: the variables' values,
        # whole (shards assembled), so any strategy can restore them. The per-variable
        # optimizer state stays on the parameter servers.
        return self.numpy()

    def apply_gradients(self, grads: Any) -> None:
        """Pushes gradients: each parameter server applies the optimizer to its variables.

        Updates are applied as they arrive, atomically per variable, with no barrier
        between workers: a worker's gradient may have been computed from values that
        other workers have updated since (asynchronous training, as in TF).

        Args:
          grads: a pytree shaped like the variables (e.g. from ``jax.grad`` of a function
            of `read()`'s values).

        Raises:
          ValueError: if the tree has no optimizer, or `grads` does not match.
          ParameterServerFailureError: if a parameter server is unavailable.
        """
        if self.optimizer is None:
            raise ValueError(
                "apply_gradients needs an optimizer; these variables were created without "
                "one. Pass optimizer=optax.sgd(...) to strategy.create_variables."
            )
        self._push(grads, backend_lib.GRADIENTS, "grads")

    def assign(self, tree: Any) -> None:
        """Sets every variable from a pytree of values (scalars broadcast)."""
        self._push(tree, backend_lib.ASSIGN, "tree")

    def assign_add(self, tree: Any) -> None:
        """Adds a pytree of deltas, atomically per variable."""
        self._push(tree, backend_lib.ASSIGN_ADD, "tree")

    def assign_sub(self, tree: Any) -> None:
        """Subtracts a pytree of deltas, atomically per variable."""
        self._push(tree, backend_lib.ASSIGN_SUB, "tree")

    def opt_state(self) -> Any:
        """The optimizer state of each variable (a list per shard for sharded ones), on host."""
        run_capture.refuse_inside_trace("VariableTree.opt_state()", captured=False)
        out = []
        for leaf in self._leaves:
            shards = leaf.shards if isinstance(leaf, ShardedVariable) else [leaf]
            states = [s._store.read_opt_states([s._id])[0] for s in shards]
            states = backend_lib.to_numpy(states)
            out.append(states if isinstance(leaf, ShardedVariable) else states[0])
        return jax.tree.unflatten(self._treedef, out)

    def assign_opt_state(self, tree: Any) -> None:
        """Sets each variable's optimizer state from a tree shaped like `opt_state`'s (a
        backup's, or one with a new learning rate).

        Raises:
          ValueError: if `tree` does not match the variables' optimizer states.
        """
        run_capture.refuse_inside_trace("VariableTree.assign_opt_state()", captured=False)
        per_leaf = jax.tree.structure(self.variables).flatten_up_to(tree)  # type: ignore[attr-defined]
        groups: dict[Any, tuple[list[int], list[Any]]] = {}
        for leaf, state in zip(self._leaves, per_leaf, strict=True):
            shards = leaf.shards if isinstance(leaf, ShardedVariable) else [leaf]
            shard_states = state if isinstance(leaf, ShardedVariable) else [state]
            if len(shard_states) != len(shards):
                raise ValueError(
                    f"The optimizer state of {leaf.name!r} has {len(shard_states)} shards; "
                    f"the variable has {len(shards)}."
                )
            for shard, shard_state in zip(shards, shard_states, strict=True):
                ids, values = groups.setdefault(shard._store, ([], []))
                ids.append(shard._id)
                values.append(shard_state)
        for store, (ids, values) in groups.items():
            store.assign_opt_states(ids, values)

    def __repr__(self) -> str:
        shards = sum(isinstance(v, ShardedVariable) for v in self._leaves)
        return (
            f"VariableTree({len(self._leaves)} variables, {shards} sharded, "
            f"{len(self._flat)} on parameter servers)"
        )


def build_variable_tree(
    tree: Any,
    *,
    stores: Sequence[Any],
    next_ps: Any,
    partitioner: Any,
    optimizer: Any,
    coordinator_device: jax.Device | None,
) -> VariableTree:
    """Places each leaf of `tree` on the parameter servers; see `create_variables`."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not path_leaves:
        raise ValueError("`tree` must have at least one array leaf; got an empty pytree.")
    var_tree = VariableTree.__new__(VariableTree)
    leaves: list[Variable | ShardedVariable] = []
    tx_key = ("tree", next(_TREE_IDS))
    pending: dict[Any, tuple[list[int], list[Any]]] = {}

    def new_var(value: np.ndarray, name: str) -> Variable:
        store = stores[next_ps()]
        var_id = next(_VAR_IDS)
        group = pending.setdefault(store, ([], []))
        group[0].append(var_id)
        group[1].append(value)
        return Variable(store, var_id, name, value.shape, value.dtype, var_tree)

    for path, leaf in path_leaves:
        name = path_str(path, default="variable")
        if isinstance(leaf, jax.Array):
            value = np.asarray(jax.device_get(leaf))
        else:
            value = np.asarray(leaf)
        if value.dtype == object or value.dtype.kind in ("U", "S"):
            raise TypeError(f"Variable {name!r} must be a numeric array; got dtype {value.dtype}.")
        num = 1
        if partitioner is not None and value.ndim > 0:
            partitions = list(partitioner(shape=value.shape, dtype=value.dtype))
            if not partitions or partitions[0] == 0 or any(p != 1 for p in partitions[1:]):
                raise ValueError(
                    "variable_partitioner must return a list whose elements are 1 besides "
                    f"the first (non-zero), as only the first axis is split; got {partitions} "
                    f"for variable {name!r} of shape {value.shape}."
                )
            num = min(int(partitions[0]), value.shape[0])
        if num <= 1:
            leaves.append(new_var(value, name))
        else:
            offsets = shard_offsets(value.shape[0], num)
            shards = [
                new_var(value[a:b], f"{name}/part_{i}")
                for i, (a, b) in enumerate(itertools.pairwise(offsets))
            ]
            leaves.append(ShardedVariable(shards, name))
    VariableTree.__init__(var_tree, treedef, leaves, optimizer)
    var_tree._coordinator_device = coordinator_device
    for store, (var_ids, values) in pending.items():
        store.create(var_ids, values, tx_key, optimizer)
    return var_tree


_VAR_IDS = itertools.count()
_TREES: weakref.WeakValueDictionary[str, VariableTree] = weakref.WeakValueDictionary()


def _restore_tree(token: str) -> VariableTree:
    existing = _TREES.get(token)
    if existing is not None:
        return existing
    return VariableTree.__new__(VariableTree)
