"""How `Strategy.run` becomes one compiled SPMD program, cached per function and arguments.

`run` sorts each leaf of its arguments into a kind (a `PerReplica` split by rows or
stacked on a replica axis, an array every replica gets whole as its own copy, a static
Python object that is part of the cache key), traces the function once for shapes (the
outputs' structure, which of them are per-replica, the holders of stateful objects it
touches: `tracked.py`), and compiles one ``jax.jit(jax.shard_map(...))`` manual over the
data axis only, so a mesh's other axes stay automatic. The holders' values are inputs at
every call, those written come back (donated) and are stored; with `mirrored_check` on, the
outputs that must be mirrored are compared across replicas. Under a strategy with a context
axis the function is traced inside `context_parallel.axis.refusing`: the sequences are not
split here, so `dot_product_attention` raises rather than compute full attention.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jstrategy._src import context
from jstrategy._src import dispatch
from jstrategy._src import staging
from jstrategy._src import tracked
from jstrategy._src.context_parallel import axis as context_axis
from jstrategy._src.run import mirrored_check
from jstrategy._src.values import PerReplica
from jstrategy._src.values import is_per_replica
from jstrategy._src.values import varying_axes

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = ["RunProgram", "RunPrograms"]

_CACHE_SIZE = 256

# How each leaf of `run`'s arguments reaches the replicas.
_STACKED = "stacked"  # PerReplica with a replica axis: replica i gets value[i].
# A stacked PerReplica that `experimental_check_mirrored` found the same on every replica
# (an output of `run` that must be mirrored), passed back: checked again as mirrored.
_STACKED_MIRRORED = "stacked_mirrored"
_SPLIT = "split"  # PerReplica of rows: replica i gets the i-th contiguous slice.
_WHOLE = "whole"  # an array or number: every replica gets all of it.
_STATIC = "static"  # any other Python object: passed as is, part of the cache key.

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, int, float, complex, bool)


@dataclasses.dataclass
class RunProgram:
    """One compiled `run` program and what its calls need besides the arguments."""

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
    # The outputs' structure with each per-replica leaf inside a `PerReplica` node: one
    # unflatten wraps them (`RunPrograms.run`'s fast path).
    wrapped_tree: Any = None


@dataclasses.dataclass(frozen=True)
class _FastEntry:
    """A call pattern seen before: its program, and which leaves of the plainly flattened
    arguments (PerReplica nodes in the treedef, masks among the leaves) are its inputs."""

    program: RunProgram
    inputs: Callable[[list[Any]], list[Any]]
    per_replica: tuple[tuple[int, bool], ...]  # (leaf index, stacked) of PerReplica values


class RunPrograms:
    """One strategy's `run` programs, the most recently built 256 kept.

    Args:
      strategy: the strategy whose mesh and data axis the programs run over.
    """

    def __init__(self, strategy: StrategyLike):
        self._strategy = strategy
        self._programs: collections.OrderedDict[Any, RunProgram] = collections.OrderedDict()
        self._fast: collections.OrderedDict[Any, _FastEntry] = collections.OrderedDict()
        self._lock = threading.Lock()

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict) -> Any:
        """`fn(*args, **kwargs)` once per replica, as `Strategy.run` documents it (its
        arguments already checked)."""
        if mirrored_check.enabled():
            return self._run(fn, args, kwargs)
        # The fast path, for a call like one seen before: a training loop's steady state.
        # One flatten in C++ (PerReplica nodes land in the treedef), a key of the treedef
        # and the leaves' types, and the inputs picked by index: `run` then costs what a
        # `jax.jit` call costs (benchmarks/overhead.py). The first call of a pattern, and
        # calls with Python objects as arguments, take the full path below.
        plain = (tuple(args), kwargs)
        leaves, treedef = jax.tree.flatten(plain)
        key = (fn, treedef, tuple(map(type, leaves)))
        try:
            entry = self._fast.get(key)
        except TypeError:  # an unhashable function or treedef: the full path explains
            return self._run(fn, args, kwargs)
        if entry is None:
            return self._run(fn, args, kwargs, fast_key=key, plain_count=len(leaves))
        try:
            outs, _ = self._call(entry.program, entry.inputs(leaves))
        except ValueError:
            # Most likely PerReplica values from another strategy: say so clearly.
            for i, stacked in entry.per_replica:
                _check_per_replica(self._strategy, PerReplica(leaves[i], stacked=stacked))
            raise
        return jax.tree.unflatten(entry.program.wrapped_tree, outs)

    def _call(self, program: RunProgram, dynamic: list[Any]) -> tuple[list[Any], Any]:
        """Runs `program` on `dynamic` and its holders' values, stores what it wrote, and
        bounds the calls in flight; returns `fn`'s flat outputs and the flags."""
        if program.written or program.read_only or program.pushes:
            if any(isinstance(x, jax.core.Tracer) for x in dynamic):
                _refuse_outer_trace(program)
            held = _held_values(self._strategy, program)
        else:
            held = ([], [])
        written, outs, pushed, flags = program.compiled(*dynamic, *held)
        if program.written or program.pushes:
            _store_written(self._strategy, program, written, pushed)
        dispatch.track(flags)
        return outs, flags

    def _run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict,
        *,
        fast_key: Any = None,
        plain_count: int = 0,
    ) -> Any:
        strategy = self._strategy
        leaves, treedef = jax.tree.flatten((tuple(args), kwargs), is_leaf=is_per_replica)
        kinds: list[str] = []
        dynamic: list[Any] = []
        statics: list[Any] = []
        mask = None
        check = mirrored_check.enabled()
        for leaf in leaves:
            if isinstance(leaf, PerReplica):
                _check_per_replica(strategy, leaf)
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
            program = self._programs.get(key)
        except TypeError:
            raise TypeError(
                "`run` passes arguments that are not arrays as Python objects and compiles "
                f"one program per value, so they must be hashable; got unhashable "
                f"{[type(s).__name__ for s in statics]}. Pass arrays instead."
            ) from None
        if program is None:
            program = _build(strategy, fn, treedef, kinds, statics, has_mask, dynamic)
            with self._lock:
                self._programs[key] = program
                if len(self._programs) > _CACHE_SIZE:
                    self._programs.popitem(last=False)
        if fast_key is not None and not statics:
            entry = _fast_entry(program, leaves, plain_count)
            if entry is not None:
                with self._lock:
                    self._fast[fast_key] = entry
                    if len(self._fast) > _CACHE_SIZE:
                        self._fast.popitem(last=False)
        outs, flags = self._call(program, dynamic)
        if program.checked:
            _raise_if_disagree(program, flags)
        wrapped = [
            PerReplica(o, stacked=True, mirrored=i in program.checked) if v else o
            for i, (o, v) in enumerate(zip(outs, program.varying, strict=True))
        ]
        return jax.tree.unflatten(program.out_tree, wrapped)


def _fast_entry(program: RunProgram, leaves: list[Any], plain_count: int) -> _FastEntry | None:
    """Where `program`'s inputs sit among the plainly flattened arguments (a PerReplica's
    value, then its mask, in place of the PerReplica); None if they do not line up."""
    order, per_replica, mask_at, at = [], [], None, 0
    for leaf in leaves:
        order.append(at)
        if isinstance(leaf, PerReplica):
            if not isinstance(leaf.value, _ARRAY_TYPES):
                return None  # a PerReplica of a pytree: flattens further
            per_replica.append((at, leaf.stacked))
            if leaf.mask is not None:
                mask_at = at + 1 if mask_at is None else mask_at
                at += 1
        at += 1
    if at != plain_count:
        return None
    if mask_at is not None:
        order.append(mask_at)
    picks = tuple(order)

    def inputs(plain: list[Any]) -> list[Any]:
        return [plain[i] for i in picks]

    return _FastEntry(program, inputs, tuple(per_replica))


def _held_values(strategy: StrategyLike, program: RunProgram) -> tuple[list[Any], list[Any]]:
    """The current values of the holders a `run` program takes, as the replicas read them."""
    written = [h.value_on(strategy) for h in program.written]
    read_only = [h.value_on(strategy) for h in program.read_only]
    return strategy.read_on_replicas(written), strategy.read_on_replicas(read_only)


def _refuse_outer_trace(program: RunProgram) -> None:
    holders = (*program.written, *program.read_only, *(h for h, _ in program.pushes))
    names = list(dict.fromkeys(h.name for h in holders))
    raise RuntimeError(
        f"strategy.run was called inside a function that JAX compiles (jax.jit, ...) "
        f"and uses {names}: their values would be frozen into that program when it is "
        "traced and their updates never applied. run compiles its function itself "
        "(TF's @tf.function is not needed): call it outside jax.jit."
    )


def _store_written(
    strategy: StrategyLike, program: RunProgram, values: list[Any], pushed: list[Any]
) -> None:
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((values, pushed))):
        _refuse_outer_trace(program)
    for holder, value in zip(program.written, values, strict=True):
        holder.store(value, strategy)
    for (sink, how), value in zip(program.pushes, pushed, strict=True):
        sink.apply(value, how)


def _raise_if_disagree(program: RunProgram, flags: Any) -> None:
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


def _check_per_replica(strategy: StrategyLike, value: PerReplica) -> None:
    sharding = getattr(value.value, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and mesh.shape_tuple != strategy.mesh.shape_tuple:
        raise ValueError(
            f"A PerReplica argument has {value.num_replicas} replicas but this strategy has "
            f"{strategy.num_replicas_in_sync}. Pass values made by this strategy (its run, "
            "datasets or experimental_distribute_values_from_function)."
        )


def _build(strategy: StrategyLike, fn, treedef, kinds, statics, has_mask, example) -> RunProgram:
    data = strategy.axis_name
    per_replica_kinds = (_STACKED, _STACKED_MIRRORED, _SPLIT)
    user_specs = tuple(
        P(data) if k in per_replica_kinds else P() for k in kinds if k != _STATIC
    ) + ((P(data),) if has_mask else ())
    # Manual over the data axis only: a mesh's other axes stay automatic, so variables
    # split over them keep their layout inside `fn` and XLA partitions the math.
    shard_map = functools.partial(jax.shard_map, mesh=strategy.mesh, axis_names=frozenset({data}))
    # Where rows are split beyond the data axis, each replica takes its rows whole inside
    # (see `staging.rows_beyond_data_axis`: XLA aborts on an embedding lookup otherwise).
    whole_rows = staging.rows_beyond_data_axis(strategy)

    def call(values, frame, *, shared=False):
        row_mask = values[-1] if has_mask else None
        replica_context = context.ReplicaContext(strategy, row_mask=row_mask)
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
                if whole_rows and kind in (_STACKED, _SPLIT):
                    value = jax.lax.with_sharding_constraint(value, P())
                leaves.append(value)
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        # A context axis splits no sequence here: the attention refuses to run whole.
        with (
            context.replica_scope(strategy, replica_context),
            tracked.run_frame(frame),
            context_axis.refusing(strategy, "strategy.run"),
        ):
            return jax.tree.flatten(fn(*args, **kwargs))

    # First trace (shapes only): the outputs' structure, which of them are per-replica,
    # and the holders of stateful objects the function touches.
    info: list[Any] = []

    def probe(*values, shared=False):
        frame = tracked.RunFrame(strategy, (), None)
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
            i for i, (v, s) in enumerate(zip(varying, shared_varying, strict=True)) if v and not s
        ]
    planned = written + read_only

    def body(*inputs):
        *values, written_values, read_values = inputs
        frame = tracked.RunFrame(strategy, planned, [*written_values, *read_values])
        try:
            flat, _ = call(values, frame)
            if [(id(h), how) for h, _, how in frame.pushes] != [(id(h), how) for h, how in pushes]:
                raise tracked.Replan()
        except tracked.Replan:
            raise RuntimeError(
                "The function given to strategy.run used other metrics, optimizers, "
                "models or parameter-server variables when it was traced again (for new "
                "argument shapes) than the first time. Use the same stateful objects on "
                "every call."
            ) from None
        per_replica = [jnp.asarray(x) for x, v in zip(flat, varying, strict=True) if v]
        if per_replica:
            # Per-replica outputs leave stacked: a leading axis of 1 added here. Without
            # the barrier XLA fuses around that reshape differently from the same step
            # written with replicated outputs: it recomputes an optimizer's momentum in
            # the parameter update and keeps the all-reduced gradients alive for it, a
            # temporary the size of the largest variable (benchmarks/overhead.py's MLP:
            # 1.07 MB against 0.13 MB). Behind the barrier the two programs are the same,
            # op for op, up to free bitcasts (jaxlib 0.12; 0.10's XLA drops the barrier
            # before it fuses, and keeps the temporary).
            per_replica = jax.lax.optimization_barrier(per_replica)
        stacked = iter(per_replica)
        outs = [next(stacked)[None] if v else x for x, v in zip(flat, varying, strict=True)]
        new_values = [frame.final(h) for h in written]
        pushed = [value for _, value, _ in frame.pushes]
        # A small output of every call that is never donated: what `run` waits on to
        # bound the calls in flight, also when `fn` returns nothing and only writes
        # state (whose arrays the next call consumes).
        flags = jnp.zeros((), jnp.bool_)
        if checked:
            flags = mirrored_check.disagreement([flat[i] for i in checked], data)
        # The written holders' new values come first: JAX pairs each donated input with
        # the first unused output of its size, so in this order every holder's buffer is
        # reused for its own new value. After `fn`'s outputs, a scalar output took a
        # counter's buffer and every later holder moved up one: a copy each.
        return new_values, outs, pushed, flags

    def holder_specs(holders: Sequence[tracked.Holder]) -> list[P]:
        return [P(data) if h.per_replica else P() for h in holders]

    out_specs = (
        holder_specs(written),
        [P(data) if v else P() for v in varying],
        [P() for _ in pushes],
        P(),
    )
    in_specs = (*user_specs, holder_specs(written), holder_specs(read_only))
    compiled = jax.jit(
        shard_map(body, in_specs=in_specs, out_specs=out_specs),
        donate_argnums=(len(user_specs),) if written else (),
    )
    wrapped_tree = jax.tree.structure(
        jax.tree.unflatten(out_tree, [PerReplica(0, stacked=True) if v else 0 for v in varying])
    )
    return RunProgram(
        compiled, out_tree, varying, written, read_only, pushes, checked, wrapped_tree
    )


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
