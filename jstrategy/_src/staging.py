"""How the programs of a train step are staged on a strategy's devices.

The training layer describes one step as three functions (`StepFunctions`): the gradients
of one replica, the update, and the split of the state into what the replicas read. A
strategy turns them into a program with `Strategy.stage_train_step`, whose variants live
here:

* `replicated_train_program` (the default): variables live on every replica, so the whole
  step, and a ``lax.scan`` of several, is ONE ``jax.jit(jax.shard_map(...))`` program; the
  update runs on every replica on identical, all-reduced gradients.
* `host_update_train_program` (`CentralStorageStrategy`): variables live elsewhere (one copy
  in host memory), so each step is two programs: the gradients on the replicas, then the
  update where the variables live.
* `sharded_train_program` (`FSDPStrategy`, `ModelParallelStrategy`): variables are split
  across devices, so ONE ``jax.jit`` in the global view (no manual axis) holds, per step,
  the gradients (``fns.global_gradients``: the replicas a vmapped axis laid out over the
  data axis, differentiated outside it) and ``fns.update``, with the gradients constrained
  to their parameters' layouts and ``out_shardings`` from `Strategy.variable_sharding`. XLA
  then gathers each parameter where it is read and reduces each gradient where it is
  produced, layer by layer (and scan iteration by scan iteration).

A program is ``program(state, acc, batch, mask) -> (state, acc, logs)``: `acc` holds running
loss and metric sums (with the count of real rows) that each step adds to, or None to start
from the step's own sums (one step only); `logs` are their means. `mask` is the batch's row
mask, or None for full batches (every row real), which compile to their own program
without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from jstrategy._src import dispatch
from jstrategy._src import flax_annotations
from jstrategy._src.numerics import means
from jstrategy._src.placement import in_device_memory
from jstrategy._src.placement import in_host_memory
from jstrategy._src.placement import moved_to_device
from jstrategy._src.placement import moved_to_host
from jstrategy._src.placement import variable_shardings

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = [
    "StepFunctions",
    "TrainProgram",
    "host_update_train_program",
    "replica_map",
    "replicated_train_program",
    "row_spec",
    "sharded_train_program",
]


class TrainProgram(Protocol):
    """``program(state, acc, batch, mask) -> (state, acc, logs)``; see the module docstring."""

    def __call__(self, state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any, Any]: ...

    def lower(self, state: Any, acc: Any, batch: Any, mask: Any) -> Any:
        """The lowered program with the cross-device communication, to inspect its HLO."""
        ...


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """One training step, as the training layer hands it to `Strategy.stage_train_step`.

    Attributes:
      split: ``state -> (params, rest)``: the trained parameters, and what else the
        replicas read (the state without its parameters and optimizer state).
      gradients: ``(params, rest, batch, mask) -> (grads, model_state, sums)`` for one
        replica, traced inside `replica_map`: the gradients of the mean loss over the
        global batch's real rows, the new mutable state (e.g. BatchNorm statistics) and the
        loss and metric sums with the count of real rows, all combined across replicas
        (identical on every replica).
      update: ``(state, grads, model_state) -> state``: the optimizer update; every staged
        step applies its update through it.
      gradients_like: ``(per_param, scalar) -> tree``: what `gradients` returns for its
        gradients, given what to put for each parameter and for a scalar (e.g. partition
        specs): the gradients are shaped like the parameters, except under gradient
        accumulation (``GradientSums(sums, rows)``). A staging that lays the gradients out
        leaf by leaf (`sharded_train_program`) builds its shardings with it.
      global_gradients: the same as `gradients`, traced in the global view (no manual
        axis) on the global batch: what `sharded_train_program` stages. None if the step
        has no such form.
    """

    split: Callable[[Any], tuple[Any, Any]]
    gradients: Callable[..., tuple[Any, Any, Any]]
    update: Callable[[Any, Any, Any], Any]
    gradients_like: Callable[[Any, Any], Any] = lambda per_param, scalar: per_param
    global_gradients: Callable[..., tuple[Any, Any, Any]] | None = None


def row_spec(strategy: StrategyLike, lead: int = 0) -> P:
    """The spec of a batch split by rows over the data axis, after `lead` stacked axes."""
    return P(*([None] * lead), strategy.axis_name)


def rows_beyond_data_axis(strategy: StrategyLike) -> bool:
    """Whether a batch's rows are split over more than the data axis (``"fsdp"``,
    ``"expert"``: `HybridStrategy`, `ParallelStrategy`, `FSDPStrategy(experts=k)`).

    In a program manual over the data axis (`replica_map`, `Strategy.run`), the rest of
    such a split is automatic, and XLA's partitioner aborts on a gather whose operand and
    indices are both split over one automatic axis (an embedding lookup whose table FSDP
    splits: "Check failed: partition_group_list.num_replica_groups() * ..."). Evaluation
    and prediction then run in the global view; `run` takes each replica's rows whole.

    Example:

    >>> import jstrategy
    >>> rows_beyond_data_axis(jstrategy.MirroredStrategy())
    False
    """
    rows = strategy.batch_sharding().spec[0]
    return isinstance(rows, tuple) and len(rows) > 1


def replica_map(
    strategy: StrategyLike, fn: Callable[..., Any], in_specs: Any, out_specs: Any
) -> Any:
    """`jax.shard_map` of a per-replica `fn` over the strategy's mesh.

    Manual over the data axis (`strategy.axis_name`): inside, `fn` sees one replica's rows
    and collectives over that axis combine replicas. On a mesh with other axes those stay
    automatic (XLA partitions them from the variables' shardings).
    """
    mesh = strategy.mesh
    # An empty set means every axis, as on a 1-D mesh.
    manual = frozenset({strategy.axis_name}) if len(mesh.axis_names) > 1 else frozenset()
    return jax.shard_map(
        _under_rules(fn, strategy),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=manual,
    )


def _under_rules(fn: Callable[..., Any], strategy: StrategyLike) -> Callable[..., Any]:
    """`fn` traced under the logical axis rules read on the strategy's mesh
    (`flax_annotations.step_rules`): `nn.with_logical_constraint` in a model names the
    strategy's axes, or does nothing where the strategy splits nothing."""

    def traced(*args: Any) -> Any:
        with flax_spmd.logical_axis_rules(flax_annotations.step_rules(strategy)):
            return fn(*args)

    return traced


def _accumulate(acc: Any, sums: Any) -> Any:
    return sums if acc is None else jax.tree.map(jnp.add, acc, sums)


def _step_loop(
    one: Callable[[Any, Any, Any, Any], tuple[Any, Any]], *, steps: int, stacked: bool
) -> Callable[[Any, Any, Any, Any], tuple[Any, Any, Any]]:
    """``program(state, acc, batch, mask) -> (state, acc, logs)`` running `one` step, or a
    ``lax.scan`` of `steps` steps over stacked (or a tuple of) batches."""

    def program(state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any, Any]:
        if not steps:
            state, acc = one(state, acc, batch, mask)
            return state, acc, means(acc)
        if not stacked:
            batch = jax.tree.map(lambda *xs: jnp.stack(xs), *batch)
            if mask is not None:  # None: full batches, no mask
                mask = jax.tree.map(lambda *xs: jnp.stack(xs), *mask)

        def scan_step(carry: Any, inputs: Any) -> tuple[Any, None]:
            return one(*carry, *inputs), None

        (state, acc), _ = jax.lax.scan(scan_step, (state, acc), (batch, mask))
        return state, acc, means(acc)

    return program


def replicated_train_program(
    strategy: StrategyLike, fns: StepFunctions, *, steps: int, stacked: bool
) -> TrainProgram:
    """The default staging: ONE compiled program running `steps` steps on every replica.

    Args:
      strategy: the strategy whose replicas run it.
      fns: the step.
      steps: 0 for one step on a single batch (leaves ``(B, ...)``); else the number of
        steps, over `stacked` batches (leaves ``(steps, B, ...)``, mask ``(steps, B)``) or
        a tuple of `steps` batches and masks (stacked inside the program).
      stacked: see `steps`.

    Returns:
      The jitted `TrainProgram`; it donates the state and `acc`.
    """
    lead = 1 if steps and stacked else 0

    def one(state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any]:
        params, rest = fns.split(state)
        grads, model_state, sums = fns.gradients(params, rest, batch, mask)
        return fns.update(state, grads, model_state), _accumulate(acc, sums)

    program = _step_loop(one, steps=steps, stacked=stacked)
    rows = row_spec(strategy, lead)
    return jax.jit(
        replica_map(strategy, program, in_specs=(P(), P(), rows, rows), out_specs=(P(), P(), P())),
        donate_argnums=(0, 1),
    )


# FSDP and ModelParallel: variables split across devices, the step in the global view -----
class _ShardedTrainProgram:
    """`sharded_train_program`'s program: one ``jax.jit`` per train-state structure.

    Its ``out_shardings`` are the state's `variable_shardings`, which depend on the state,
    so the jitted function is made for the first state of each structure.
    """

    def __init__(self, strategy: StrategyLike, fns: StepFunctions, *, steps: int, stacked: bool):
        if fns.global_gradients is None:
            raise ValueError(
                "The sharded strategies stage the step in the global view: "
                "`StepFunctions.global_gradients` must be given."
            )
        self._strategy = strategy
        self._fns = fns
        self._steps = steps
        self._stacked = stacked
        self._programs: dict[Any, Any] = {}

    def _build(self, state: Any) -> Any:
        strategy, fns, steps, stacked = self._strategy, self._fns, self._steps, self._stacked
        global_gradients = fns.global_gradients
        assert global_gradients is not None
        shardings = variable_shardings(state, strategy)
        replicated = strategy.replicated_sharding()
        # Variables an `OffloadPolicy` keeps in host memory: moved to device memory where
        # the step reads them, back through `out_shardings` (and, in a scan, after every
        # step: they live in host memory between steps).
        offloaded = in_host_memory(shardings)
        on_device = (
            jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)
            if offloaded
            else shardings
        )
        # Offloaded parameters (or anything else the gradients read) move in at the step's
        # start; the optimizer state alone only once the gradients are taken, so it holds
        # no device memory during the forward and backward passes.
        early = offloaded and in_host_memory(fns.split(shardings))
        param_shardings, _ = fns.split(on_device)
        grad_shardings = fns.gradients_like(param_shardings, replicated)

        def one(state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any]:
            if early:
                state = moved_to_device(state, shardings)
            params, rest = fns.split(state)
            grads, model_state, sums = global_gradients(params, rest, batch, mask)
            # Each gradient laid out like its parameter: XLA reduce-scatters it where
            # backpropagation produces it, and the update runs on each device's slices.
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            if offloaded and not early:
                state = moved_to_device(state, shardings)
            state = fns.update(state, grads, model_state)
            # Where the strategy keeps each variable, after every step of a scan too.
            state = jax.lax.with_sharding_constraint(state, on_device)
            if offloaded:
                state = moved_to_host(state, shardings)
            return state, _accumulate(acc, sums)

        return jax.jit(
            _step_loop(one, steps=steps, stacked=stacked),
            out_shardings=(shardings, replicated, replicated),
            donate_argnums=(0, 1),
        )

    def _program(self, state: Any) -> Any:
        key = jax.tree.structure(state)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._build(state)
        return program

    def __call__(self, state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any, Any]:
        return self._program(state)(state, acc, batch, mask)

    def lower(self, state: Any, acc: Any, batch: Any, mask: Any) -> Any:
        """The lowered program (gradients, their reduction and the update)."""
        return self._program(state).lower(state, acc, batch, mask)


def sharded_train_program(
    strategy: StrategyLike, fns: StepFunctions, *, steps: int, stacked: bool
) -> TrainProgram:
    """The staging of strategies whose variables are split across devices.

    ONE compiled program (a ``lax.scan`` of `steps` steps when ``steps > 0``) in the global
    view: no mesh axis is manual, so XLA's SPMD partitioner decides every collective from
    the layouts. Each step:

    1. ``fns.global_gradients``: the per-replica loss of `StepFunctions.gradients`, mapped
       over the replicas by ``jax.vmap`` with ``axis_name=strategy.axis_name`` (models that
       name the data axis, e.g. ``nn.BatchNorm(axis_name=...)``, and the per-replica
       dropout keys see the replicas as under a manual region) and ``spmd_axis_name`` the
       data axis (each replica's rows stay on its devices), then differentiated outside the
       map: the gradients are global values. A parameter split over the data axis (FSDP)
       is all-gathered where it is read, one layer (or one scan iteration) at a time, and
       its gradient reduce-scattered as soon as it is produced; split over other axes (a
       `LayoutMap`'s ``"model"``), XLA partitions the computation.
    2. The gradients constrained to their parameters' layouts, then ``fns.update`` in the
       same view: gradients, parameters and optimizer state share their layouts, so each
       device updates its own slices.

    Every variable comes out where `Strategy.variable_sharding` keeps it (the program's
    ``out_shardings``); the state and `acc` are donated. Leaves it keeps in host memory (a
    sharded strategy's `OffloadPolicy`) are moved to device memory inside the step, the
    optimizer state once the gradients are taken, and written back to host memory after
    every step. Same arguments and result as
    `replicated_train_program`.
    """
    return _ShardedTrainProgram(strategy, fns, steps=steps, stacked=stacked)


# CentralStorage: the gradients on the replicas, the update where the variables live --------
_PROBE = jax.ShapeDtypeStruct((), jnp.float32)


def _move(x: Any, sharding: jax.sharding.Sharding) -> Any:
    """A value replicated over the replicas, on `sharding`: one of its shards when it can."""
    if isinstance(x, jax.Array) and len(sharding.device_set) == 1:
        (device,) = sharding.device_set
        for shard in x.addressable_shards:
            if shard.device == device:
                return shard.data  # no copy: the replica on that device holds it already
    return jax.device_put(x, sharding)


class _HostUpdateStep:
    """One step as two compiled programs, as TF's CentralStorageStrategy runs it:

    1. On the replicas, ``jax.jit(replica_map(gradients))``: the parameters, copied from
       their home to every replica's device memory, give the all-reduced gradients (and
       the averaged mutable state) of the global batch. The copies are donated to the
       gradients, which reuse their buffers.
    2. On the variables' home, the update, applied once: the program takes the state as it
       lives (e.g. in host memory), moves it to device memory inside
       (``jax.device_put(..., memory_kind="device")``), applies the gradients and writes
       the new state back home through ``out_shardings``. The state is donated, so the
       update overwrites it in place.

    One program cannot do both: a jitted program's arguments must all live on its devices,
    and one central copy lives on one device while the batch is split over all of them.
    """

    def __init__(self, strategy: StrategyLike, fns: StepFunctions, *, lead: int):
        self._strategy = strategy
        self._fns = fns
        self._home = strategy.variable_sharding(_PROBE).with_memory_kind("device")
        self._updates: dict[Any, Any] = {}
        rows = row_spec(strategy, lead)

        def gradients(params: Any, rest: Any, acc: Any, batch: Any, mask: Any, index: Any):
            if lead:
                batch, mask = jax.tree.map(lambda v: v[index], (batch, mask))
            grads, model_state, sums = fns.gradients(params, rest, batch, mask)
            acc = _accumulate(acc, sums)
            return grads, model_state, acc, means(acc)

        self._gradients = jax.jit(
            replica_map(
                strategy,
                gradients,
                in_specs=(P(), P(), P(), rows, rows, P()),
                out_specs=(P(), P(), P(), P()),
            ),
            donate_argnums=(0, 2),
        )

    def _args(self, state: Any, acc: Any, batch: Any, mask: Any, index: Any) -> tuple:
        replicated = self._strategy.replicated_sharding()
        split = self._fns.split(state)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(split)):
            # Lowered from shapes alone (`plan`): the same arguments, abstract.
            params, rest = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), split
            )
        else:
            params, rest = jax.device_put(in_device_memory(split), replicated)
        return params, rest, acc, batch, mask, index

    def _update(self, state: Any) -> Any:
        key = jax.tree.structure(state)
        program = self._updates.get(key)
        if program is None:
            shardings = variable_shardings(state, self._strategy)
            update = self._fns.update

            def update_home(state: Any, grads: Any, model_state: Any) -> Any:
                return update(moved_to_device(state, shardings), grads, model_state)

            program = jax.jit(update_home, out_shardings=shardings, donate_argnums=(0,))
            self._updates[key] = program
        return program

    def __call__(self, state: Any, acc: Any, batch: Any, mask: Any, index: Any = None) -> Any:
        grads, model_state, acc, logs = self._gradients(*self._args(state, acc, batch, mask, index))
        grads, model_state = jax.tree.map(lambda x: _move(x, self._home), (grads, model_state))
        return self._update(state)(state, grads, model_state), acc, logs

    def lower(self, state: Any, acc: Any, batch: Any, mask: Any) -> Any:
        """The lowered gradient program (the one with the cross-device communication)."""
        return self._gradients.lower(*self._args(state, acc, batch, mask, None))


def host_update_train_program(
    strategy: StrategyLike, fns: StepFunctions, *, steps: int, stacked: bool
) -> TrainProgram:
    """`CentralStorageStrategy`'s staging: each step as two programs (`_HostUpdateStep`).

    Same arguments and result as `replicated_train_program`; several steps run one by one,
    each dispatch bounded by `dispatch.track`. Its ``lower`` lowers the gradient program.
    """
    return _HostUpdateProgram(
        _HostUpdateStep(strategy, fns, lead=1 if steps and stacked else 0), steps, stacked
    )


class _HostUpdateProgram:
    """`steps` host-update steps per call (one when 0), as a `TrainProgram`."""

    def __init__(self, step: _HostUpdateStep, steps: int, stacked: bool):
        self._step = step
        self._steps = steps
        self._stacked = stacked
        self._indices = [np.int32(i) for i in range(steps)]
        self.lower = step.lower

    def __call__(self, state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any, Any]:
        step = self._step
        if not self._steps:
            return step(state, acc, batch, mask)
        logs = None
        for i in range(self._steps):
            if self._stacked:
                state, acc, logs = step(state, acc, batch, mask, self._indices[i])
            else:
                state, acc, logs = step(state, acc, batch[i], None if mask is None else mask[i])
            dispatch.track(logs)
        return state, acc, logs
