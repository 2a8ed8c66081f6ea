"""State that `Strategy.run` threads through its compiled program, as TF threads variables.

TF's custom loops close over stateful objects: a metric's ``update_state`` and an
optimizer's ``apply_gradients`` inside ``strategy.run`` change variables. JAX programs are
functions, so the state of jstrategy's stateful objects (metrics' totals, optimizers'
slots, a `jstrategy.Model`'s variables) lives in `TrackedState` holders, and `run` makes
the holders a function touches part of its program: their values are the program's inputs
(pulled before each call), what the function writes to them its outputs (pushed after
the call, the inputs donated). The holders a function touches are found when `run` traces
it the first time, as TF finds the variables a ``tf.function`` captures; the program is
compiled once, and every call reads the current values.

Inside the program a holder's value is the same on every replica (mirrored, TF's
``MirroredVariable``): writing a per-replica (varying) value to it is an error at trace
time, which costs nothing at run time. The objects that write (metrics, optimizers)
combine per-replica contributions with one all-reduce first, as TF's variables aggregate.

Outside `run`, reading and writing act at once, on placed arrays. Inside a user's own
`jax.jit` they are refused: a read would freeze today's value into the program and a
write would leak a traced value.

This is `run`'s one capture mechanism; `Holder` is what it threads, and its kinds say where
the value lives: `TrackedState` (placed arrays, mirrored), `SummedOnRead` (one part per
replica), `TrainableHolder` (a model's variables), and the parameter-server variables'
holder (`parameter_server/run_capture.py`), whose input is pulled from the parameter
servers and whose updates are pushes (`RunFrame.push`), applied after the call in the
order the function made them.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src import context
from jstrategy._src import dispatch
from jstrategy._src import trace_context
from jstrategy._src.jax_compat import inside_staging_trace
from jstrategy._src.placement import place_state
from jstrategy._src.placement import variable_shardings
from jstrategy._src.values import device_put_global
from jstrategy._src.values import varying_axes

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = [
    "Holder",
    "Replan",
    "RunFrame",
    "SummedOnRead",
    "TrackedState",
    "TrainableHolder",
    "current_frame",
    "owner_of_trainable",
    "run_frame",
]


class Holder:
    """What `run` threads through its program: a value it reads as an input, and updates.

    The kinds say where the value lives and what an update is: a `TrackedState`'s writes
    replace its value (the program's output, stored after the call); a kind that pushes
    (the parameter-server variables') records updates with `RunFrame.push`, applied after
    the call in order by `apply`.
    """

    name: str
    #: Whether each replica keeps its own part (`SummedOnRead`), or one mirrored value.
    per_replica = False

    @property
    def spec(self) -> Any:
        """The value's structure, shapes and dtypes (`jax.ShapeDtypeStruct` leaves)."""
        raise NotImplementedError

    def value_on(self, strategy: StrategyLike) -> Any:
        """The current value, as `strategy`'s `run` program takes it (pulled at each call)."""
        raise NotImplementedError

    def traced(self, value: Any, axis: str) -> Any:
        """The value a trace reads: from the program's input (or zeros while discovering)."""
        del axis
        return value

    def apply(self, value: Any, how: Any) -> None:
        """Applies an update pushed inside `run` (`RunFrame.push`), after the call."""
        raise NotImplementedError(f"{self.name} takes no pushed updates")


class TrackedState(Holder):
    """A pytree of arrays kept where the strategy keeps variables, threaded through `run`.

    Created with a value (arrays or NumPy); placed for the strategy in force when it is
    first used (`jstrategy.get_strategy()`, or the strategy whose `run` uses it). A holder
    keeps the structure, shapes and dtypes of its first value, as a TF variable keeps its
    shape.

    Args:
      value: the initial pytree of arrays.
      name: names the holder in errors, e.g. ``"train_accuracy"``.
    """

    def __init__(self, value: Any, *, name: str):
        self.name = name
        self._value = jax.tree.map(np.asarray, value) if _all_host(value) else value
        self._strategy: StrategyLike | None = None
        self._spec = jax.tree.map(_spec_of, value)
        self._outputs_placed: tuple[StrategyLike, bool] | None = None

    # What subclasses (a model's variables) may keep elsewhere -------------------------------
    def _get(self) -> Any:
        return self._value

    def _set(self, value: Any) -> None:
        self._value = value

    def _placed_for(self) -> StrategyLike | None:
        return self._strategy

    def _place(self, strategy: StrategyLike) -> None:
        self._set(place_state(self._get(), strategy))
        self._strategy = strategy

    # Reading and writing --------------------------------------------------------------------
    @property
    def spec(self) -> Any:
        """The value's structure, shapes and dtypes (`jax.ShapeDtypeStruct` leaves)."""
        return self._spec

    def value_on(self, strategy: StrategyLike) -> Any:
        """The value placed for `strategy` (moved there on first use under it)."""
        if self._placed_for() is not strategy:
            self._place(strategy)
        return self._get()

    def current_value(self) -> Any:
        """The placed arrays outside any program (even while `run` traces)."""
        return self.value_on(self._placed_for() or context.get_strategy())

    def read(self) -> Any:
        """The current value: inside `run`, this replica's view of it in the program.

        Raises:
          RuntimeError: inside a user's `jax.jit` outside `run`.
        """
        frame = current_frame()
        if frame is not None:
            return frame.read(self)
        self._refuse_inside_trace("Reading")
        return self._read_outside(self.value_on(self._placed_for() or context.get_strategy()))

    def write(self, value: Any) -> None:
        """Sets the value: inside `run`, the program's output for this holder.

        Raises:
          ValueError: if `value` differs from the holder's structure, shapes or dtypes, or
            is per-replica inside `run`.
          RuntimeError: inside a user's `jax.jit` outside `run`.
        """
        self.check_like(value)
        frame = current_frame()
        if frame is not None:
            frame.write(self, value)
            return
        self._refuse_inside_trace("Updating")
        strategy = self._placed_for() or context.get_strategy()
        self._set(self._placed_value(value, strategy))
        self._strategy = strategy

    def _read_outside(self, placed: Any) -> Any:
        """The value read outside `run`, from the placed arrays."""
        return placed

    def _placed_value(self, value: Any, strategy: StrategyLike) -> Any:
        """The arrays kept for `value` written outside `run`."""
        return place_state(value, strategy)

    def store(self, value: Any, strategy: StrategyLike) -> None:
        """Keeps `value`, a `run` program's output for this holder, where `strategy` keeps
        variables (copied there when the program's outputs live elsewhere, e.g. from the
        replicas to `CentralStorageStrategy`'s host memory)."""
        cached = self._outputs_placed
        if cached is None or cached[0] is not strategy:
            shardings = jax.tree.leaves(variable_shardings(value, strategy))
            placed = all(
                x.sharding == target
                for x, target in zip(jax.tree.leaves(value), shardings, strict=True)
            )
            self._outputs_placed = cached = (strategy, placed)
        if not cached[1]:
            # The replicas' copies agree; one of them moves (JAX moves arrays between
            # memory kinds on one device, not from several devices to one).
            value = place_state(jax.tree.map(_one_copy, value), strategy)
        self._set(value)
        self._strategy = strategy

    def check_like(self, value: Any) -> None:
        """Raises a `ValueError` if `value` is not shaped like the holder's value."""
        spec = jax.tree.map(_spec_of, value)
        if jax.tree.structure(spec) != jax.tree.structure(self._spec) or any(  # type: ignore[operator]
            (a.shape, a.dtype) != (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(spec), jax.tree.leaves(self._spec), strict=True)
        ):
            raise ValueError(
                f"{self.name}: the new value must keep the structure, shapes and dtypes of "
                f"the old one ({_describe(self._spec)}); got {_describe(spec)}."
            )

    def _refuse_inside_trace(self, what: str) -> None:
        if inside_staging_trace():
            raise RuntimeError(
                f"{what} {self.name} inside a function that JAX compiles (jax.jit, ...), "
                "outside strategy.run: it would happen once, when the function is traced. "
                "strategy.run compiles its function itself (TF's @tf.function is not "
                "needed): call it outside jax.jit, and use the object inside the function "
                "given to run."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, value={_describe(self._spec)})"


class SummedOnRead(TrackedState):
    """A holder whose replicas each keep their own part; its value is the sum of the parts.

    TF's ``SyncOnRead`` variables with SUM aggregation, as its metrics use: inside `run`
    each replica reads and writes its own part with no collective (so a metric's update
    costs no all-reduce per step), and reading it elsewhere sums the parts. Between calls
    the parts are one array stacked over the replicas, split over the strategy's data axis.
    Outside `run`, a write sets the sum (the first replica's part; the others are zero).

    Args:
      value: the initial value (the sum).
      name: names the holder in errors.
    """

    per_replica = True

    def _place(self, strategy: StrategyLike) -> None:
        current = self._get()
        if self._strategy is not None:  # parts for another strategy's replicas: their sum
            current = jax.tree.map(lambda x: np.asarray(x).sum(axis=0), jax.device_get(current))
        self._set(_stacked(current, strategy))
        self._strategy = strategy

    def _read_outside(self, placed: Any) -> Any:
        # Outside run, the value is the sum of the parts (inside, a replica reads its own).
        return jax.tree.map(lambda x: jnp.sum(x, axis=0), placed)

    def _placed_value(self, value: Any, strategy: StrategyLike) -> Any:
        # Written outside run, `value` is the sum (inside, a replica writes its own part).
        return _stacked(value, strategy)

    def store(self, value: Any, strategy: StrategyLike) -> None:
        """Keeps the parts a `run` program returned (already split over the replicas)."""
        self._set(value)
        self._strategy = strategy


def _stacked(total: Any, strategy: StrategyLike) -> Any:
    """Parts over `strategy`'s replicas whose sum is `total`: it, then zeros."""
    n = strategy.num_replicas_in_sync
    sharding = strategy.per_replica_sharding()
    if sharding.is_fully_addressable:
        # Built on the devices: a metric updated after every step outside `run` (Keras's
        # habit) costs no host round trip.
        program = _parts_program(n, sharding)
        replicated = strategy.replicated_sharding()
        out = jax.tree.map(lambda x: program(jax.device_put(x, replicated)), total)
        dispatch.track(out)
        return out

    def parts(x: Any) -> Any:
        x = np.asarray(x)
        out = np.zeros((n, *x.shape), x.dtype)
        out[0] = x
        return out

    # Other processes' devices too: each process places its pieces from the host.
    return jax.tree.map(lambda x: device_put_global(parts(x), sharding), jax.device_get(total))


@functools.lru_cache(maxsize=32)
def _parts_program(n: int, sharding: jax.sharding.Sharding) -> Any:
    def parts(x: jax.Array) -> jax.Array:
        return jnp.zeros((n, *x.shape), x.dtype).at[0].set(x)

    return jax.jit(parts, out_shardings=sharding)


class TrainableHolder(TrackedState):
    """A holder of variables that an optimizer trains (a `jstrategy.Model`'s).

    Its value holds the trainable variables (`trainable`) and what goes with them;
    `trainable_variables` hands them out as a list, as TF's ``model.trainable_variables``,
    and `owner_of_trainable` finds the holder again from that list, so
    ``optimizer.apply_gradients(zip(grads, model.trainable_variables))`` knows what to
    update. Inside `run` the list holds this replica's own copies (typed per-replica), so
    gradients with respect to them are the replica's, as with `run`'s replicated arguments.
    """

    def __init__(self, value: Any, *, name: str):
        super().__init__(value, name=name)
        self._listed: tuple[Any, list[Any]] | None = None
        _TRAINABLE.add(self)

    def trainable(self, value: Any) -> Any:
        """The trainable variables in the holder's `value`."""
        raise NotImplementedError

    def with_trainable(self, value: Any, new: Any) -> Any:
        """The holder's value after an optimizer step that gave `new` trainable variables."""
        raise NotImplementedError

    def trainable_variables(self) -> list[Any]:
        """The trainable variables as a list (the same list while they are unchanged)."""
        trainable = self.trainable(self.read())
        frame = current_frame()
        cached = frame.listed.get(id(self)) if frame is not None else self._listed
        if cached is not None and cached[0] is trainable:
            return cached[1]
        leaves = jax.tree.leaves(trainable)
        if frame is not None:
            leaves = [_per_replica(x, frame.strategy.axis_name) for x in leaves]
            frame.listed[id(self)] = (trainable, leaves)
        else:
            self._listed = (trainable, leaves)
        return leaves


_TRAINABLE: weakref.WeakSet[TrainableHolder] = weakref.WeakSet()


def _per_replica(x: Any, axis: str) -> Any:
    if axis in varying_axes(x):
        return x
    return jax.lax.pcast(x, axis, to="varying")


def owner_of_trainable(variables: Sequence[Any]) -> TrainableHolder:
    """The holder whose `trainable_variables` list is `variables` (element by element).

    Raises:
      ValueError: if no holder handed out this list.
    """
    frame = current_frame()
    if frame is not None:
        holders = [h for h in _TRAINABLE if id(h) in frame.listed]
        listed = {id(h): frame.listed[id(h)][1] for h in holders}
    else:
        holders = [h for h in _TRAINABLE if h._listed is not None]
        listed = {id(h): h._listed[1] for h in holders}  # type: ignore[index]
    for holder in holders:
        leaves = listed[id(holder)]
        if len(leaves) == len(variables) and all(
            a is b for a, b in zip(leaves, variables, strict=True)
        ):
            return holder
    raise ValueError(
        "apply_gradients' variables must be a model's trainable_variables, all of them in "
        "their order, as the model gave them (inside strategy.run, read inside the function "
        "given to run): zip(gradients, model.trainable_variables)."
    )


def _one_copy(x: Any) -> Any:
    if isinstance(x, jax.Array) and x.sharding.is_fully_replicated:
        return x.addressable_data(0)
    return x


def _all_host(value: Any) -> bool:
    return all(not isinstance(x, jax.Array) for x in jax.tree.leaves(value))


def _spec_of(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or hasattr(x, "aval"):
        return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)
    a = np.asarray(x)
    return jax.ShapeDtypeStruct(a.shape, jax.dtypes.canonicalize_dtype(a.dtype))


def _describe(spec: Any) -> str:
    leaves = jax.tree.leaves(spec)
    shown = ", ".join(f"{s.dtype}{list(s.shape)}" for s in leaves[:4])
    more = f", ... ({len(leaves)} arrays)" if len(leaves) > 4 else ""
    return f"[{shown}{more}]"


class Replan(Exception):
    """A trace touched a holder the program was not built with: `run` traces again."""


class RunFrame:
    """What one trace of a `run` function does with holders: its reads, writes and pushes.

    A read is an input of the program (a holder not planned raises `Replan`), a write the
    holder's new value (an output), a push an update in order (an output, applied after
    the call by the holder's `apply`).

    Args:
      strategy: the strategy whose `run` traces the function.
      planned: the holders the program takes, in order.
      values: their values inside the program (None while discovering: zeros stand in).
    """

    def __init__(
        self, strategy: StrategyLike, planned: Sequence[Holder], values: Sequence[Any] | None
    ):
        self.strategy = strategy
        self._planned = {id(s): i for i, s in enumerate(planned)}
        self._values = values
        self.touched: list[Holder] = []
        self._current: dict[int, Any] = {}
        self.written: dict[int, TrackedState] = {}
        # TrainableHolder id -> (its trainable tree, the list handed out in this trace).
        self.listed: dict[int, tuple[Any, list[Any]]] = {}
        # (holder, value, how) per push, in the order made.
        self.pushes: list[tuple[Holder, Any, Any]] = []

    def _enter(self, state: Holder) -> None:
        key = id(state)
        if key in self._current:
            return
        self.touched.append(state)
        index = self._planned.get(key)
        axis = self.strategy.axis_name
        if self._values is not None and index is not None:
            value = self._values[index]
            if state.per_replica:  # this replica's block of the parts: (1, ...)
                value = jax.tree.map(lambda x: x[0], value)
        elif self._values is not None:
            raise Replan()
        else:
            value = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state.spec)
            if state.per_replica:
                value = jax.tree.map(lambda x: _per_replica(x, axis), value)
        self._current[key] = state.traced(value, axis)

    def read(self, state: Holder) -> Any:
        """The holder's value in this trace: the program's input, or the latest write."""
        self._enter(state)
        return self._current[id(state)]

    def write(self, state: TrackedState, value: Any) -> None:
        """Records `value` as the holder's new value in this trace.

        Raises:
          ValueError: if `value` differs across replicas by its type (varying).
        """
        self._enter(state)
        axis = self.strategy.axis_name
        leaves = jax.tree.leaves(value)
        if not state.per_replica and any(axis in varying_axes(x) for x in leaves):
            raise ValueError(
                f"{state.name} is mirrored (one value on every replica), but the value "
                "written to it inside strategy.run differs across replicas (it depends on "
                "this replica's data). Combine the replicas first, e.g. "
                "get_replica_context().all_reduce('SUM', value)."
            )
        value = jax.tree.map(lambda x, s: jnp.asarray(x).astype(s.dtype), value, state.spec)
        self._current[id(state)] = value
        self.written[id(state)] = state

    def push(self, holder: Holder, value: Any, how: Any) -> None:
        """Records an update of `holder`, an output applied after the call (`Holder.apply`)."""
        self.pushes.append((holder, value, how))

    def final(self, state: TrackedState) -> Any:
        """The holder's value at the end of the trace (a per-replica holder's: this
        replica's block of the parts)."""
        value = self._current[id(state)]
        if state.per_replica:
            axis = self.strategy.axis_name
            value = jax.tree.map(lambda x: _per_replica(x, axis)[None], value)
        return value


def current_frame() -> RunFrame | None:
    """The frame of the `run` function being traced, or None (`TraceContext.run_frame`)."""
    return trace_context.current().run_frame


def run_frame(frame: RunFrame | None) -> contextlib.AbstractContextManager[Any]:
    """Makes `frame` current while `run` traces its function (None: no holder may be used):
    the run frame field of the `trace_context.TraceContext` alone."""
    return trace_context.replaced(run_frame=frame)
