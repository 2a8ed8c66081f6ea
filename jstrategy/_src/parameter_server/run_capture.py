"""Parameter-server reads and updates inside `ParameterServerStrategy.run`.

TF's parameter-server tutorial reads the variables and applies the optimizer inside the
per-replica function::

    def replica_fn(x, y):
        loss, grads = jax.value_and_grad(loss_fn)(variables.read(), x, y)
        variables.apply_gradients(grads)
        return loss

`run` compiles that function, like every strategy's `run`, so neither can happen while it
is traced: a read would freeze the values of that moment into the compiled program, and an
update would push traced values. `RunCapture` compiles it with its reads as the program's
inputs, pulled before each call, and its updates as the program's outputs, pushed after
it, in the order the function made them. Each call therefore reads the current values and
pushes its own update, and the program is compiled once per function (a function defined
anew inside every scheduled call, as in TF's tutorial, counts as the same function when it
closes over the same objects).

Outside `run`, reads and updates happen at once; inside a user's own `jax.jit` they are
refused (`refuse_inside_trace`), as they would happen once, at tracing.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import types
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.jax_compat import inside_staging_trace
from jstrategy._src.strategy import REPLICA_AXIS
from jstrategy._src.values import varying_axes

if TYPE_CHECKING:
    from jstrategy._src.parameter_server.sharded_variable import Variable

__all__ = ["RunCapture", "current_recorder", "refuse_inside_trace"]

_PLANS_KEPT = 256
# Distinct closures of one function compiled before `run` warns that it recompiles.
_RECOMPILES_WARNED = 8
# Traces of a function whose reads keep changing before `run` gives up.
_MAX_REPLANS = 3

_LOCAL = threading.local()


def refuse_inside_trace(what: str, *, captured: bool = True) -> None:
    """Raises if a read or update would happen once, while a user's program is traced.

    Args:
      what: the operation, e.g. ``"Reading parameter-server variables"``.
      captured: whether `RunCapture` lifts it out of a function `run` traces (reads and
        updates); host copies (``numpy()``) cannot be.

    Raises:
      RuntimeError: inside `jax.jit` (or another compiling transformation) outside
        `ParameterServerStrategy.run`, or inside `run` when not `captured`.
    """
    if current_recorder() is not None:
        if captured:
            return
        raise RuntimeError(
            f"{what} inside strategy.run: the function is traced there, so no value is on "
            "the host yet. Use variables.read() inside run (its arrays are this call's "
            "values), and numpy() outside."
        )
    if inside_staging_trace():
        raise RuntimeError(
            f"{what} was called while JAX traces a compiled function (jax.jit, eval_shape, "
            "...). It would run once, when the function is traced, and never again: a read "
            "would freeze today's values into the program and an update would be lost or "
            "push traced values. Call it outside the compiled function (pass the values in, "
            "return the gradients), or inside strategy.run, which pulls the values before "
            "every call and pushes the updates after it."
        )


class _Recorder:
    """What one trace of a captured function read and pushed."""

    def __init__(self, plan: _Plan, values: Sequence[Sequence[Any]]):
        self._plan = plan
        self._values = values
        self.reads: list[tuple[Variable, ...]] = []
        self.pushes: list[tuple[tuple[Variable, ...], str]] = []
        self.pushed_values: list[list[Any]] = []
        self._pushed_ids: set[int] = set()

    def read(self, flat: Sequence[Variable]) -> list[Any]:
        flat = tuple(flat)
        stale = [v.name for v in flat if v._id in self._pushed_ids]
        if stale:
            raise ValueError(
                f"The function given to strategy.run reads {stale} after updating them. Inside "
                "run every read gives the values from before the call and the updates are "
                "pushed after it, so this read would not see the update. Read before "
                "updating, or update in one run call and read in the next."
            )
        index = len(self.reads)
        self.reads.append(flat)
        planned = self._plan.reads
        if index < len(planned) and _ids(planned[index]) == _ids(flat):
            return list(self._values[index])
        # Not an input of this program: the trace is abandoned after the function returns
        # and `run` traces again with this read as an input.
        return [jnp.zeros(v.shape, v.dtype) for v in flat]

    def push(self, flat: Sequence[Variable], values: Sequence[Any], kind: str) -> None:
        flat = tuple(flat)
        self.pushes.append((flat, kind))
        self.pushed_values.append([_invariant(jnp.asarray(x)) for x in values])
        self._pushed_ids.update(v._id for v in flat)


def _ids(flat: Sequence[Variable]) -> tuple[int, ...]:
    return tuple(v._id for v in flat)


def _invariant(x: jax.Array) -> jax.Array:
    # The strategies that capture have one replica, so the sum over replicas is the value
    # itself; it makes an update computed from per-replica copies a single output.
    if REPLICA_AXIS in varying_axes(x):
        return jax.lax.psum(x, REPLICA_AXIS)
    return x


def current_recorder() -> _Recorder | None:
    """The recorder of the function `run` is tracing on this thread, or None."""
    return getattr(_LOCAL, "recorder", None)


@contextlib.contextmanager
def _recording(recorder: _Recorder) -> Iterator[None]:
    previous = current_recorder()
    _LOCAL.recorder = recorder
    try:
        yield
    finally:
        _LOCAL.recorder = previous


class _Replan(Exception):
    """A trace read other variables than the program was built for."""

    def __init__(self, reads: list[tuple[Variable, ...]]):
        super().__init__("replan")
        self.reads = reads


class _Plan:
    """One captured function: the reads its program takes, and the updates it returns."""

    def __init__(self, fn: Callable[..., Any], reads: Sequence[tuple[Variable, ...]]):
        self.fn = fn
        self.reads = tuple(reads)
        self.pushes: tuple[tuple[tuple[Variable, ...], str], ...] = ()

        def captured(read_values, *args, **kwargs):
            recorder = _Recorder(self, read_values)
            with _recording(recorder):
                out = self.fn(*args, **kwargs)
            if [_ids(r) for r in recorder.reads] != [_ids(r) for r in self.reads]:
                raise _Replan(recorder.reads)
            self.pushes = tuple(recorder.pushes)
            return out, recorder.pushed_values

        self.captured = captured


def _function_key(fn: Callable[..., Any]) -> Any:
    """Identifies `fn` by its code and the objects it closes over.

    A function defined inside the scheduled function is a new object at every call; when it
    closes over the same objects it computes the same thing, so its program is reused.
    """
    if not isinstance(fn, types.FunctionType):
        return fn
    cells: list[int | None] = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(id(cell.cell_contents))
        except ValueError:  # an empty cell
            cells.append(None)
    defaults = tuple(id(d) for d in fn.__defaults__ or ())
    kwdefaults = tuple((k, id(v)) for k, v in (fn.__kwdefaults__ or {}).items())
    return (fn.__code__, id(fn.__globals__), tuple(cells), defaults, kwdefaults)


class RunCapture:
    """Runs functions that read and update parameter-server variables, compiled once each.

    A `ParameterServerStrategy` has one; its `run` calls `RunCapture.run` with the one-replica
    strategy of the device it runs on.
    """

    def __init__(self) -> None:
        self._plans: collections.OrderedDict[Any, _Plan] = collections.OrderedDict()
        self._lock = threading.Lock()
        # Per code object: the last key compiled for it and how many keys it has had.
        self._by_code: dict[Any, tuple[Any, int]] = {}

    def _plan(self, fn: Callable[..., Any]) -> tuple[Any, _Plan]:
        key = _function_key(fn)
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                # The plan keeps `fn`, hence the objects its key names, alive.
                plan = self._plans[key] = _Plan(fn, ())
                while len(self._plans) > _PLANS_KEPT:
                    self._plans.popitem(last=False)
                self._note_new_key(fn, key)
            else:
                self._plans.move_to_end(key)
        return key, plan

    def _note_new_key(self, fn: Callable[..., Any], key: Any) -> None:
        if not isinstance(key, tuple):
            return
        code = fn.__code__  # type: ignore[attr-defined]
        previous, count = self._by_code.get(code, (None, 0))
        self._by_code[code] = (key, count + 1)
        if count + 1 != _RECOMPILES_WARNED or previous is None:
            return
        changed = [
            name
            for name, old, new in zip(code.co_freevars, previous[2], key[2], strict=True)
            if old != new
        ]
        warnings.warn(
            f"strategy.run compiled {fn.__qualname__} {_RECOMPILES_WARNED} times: it is "
            f"defined anew at each call and closes over {changed or 'defaults'} whose objects "
            "change each time. Pass those values as `args` so it compiles once.",
            RuntimeWarning,
            stacklevel=5,  # the caller of strategy.run
        )

    def run(
        self,
        run_fn: Callable[..., Any],
        device: jax.Device,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict | None,
    ) -> Any:
        """``run_fn(fn, args, kwargs)`` with `fn`'s variable reads and updates lifted out.

        Args:
          run_fn: a one-replica strategy's `Strategy.run`.
          device: where the reads are pulled (the device `run_fn` computes on).
          fn: the per-replica function.
          args: positional arguments.
          kwargs: keyword arguments.

        Returns:
          `fn`'s outputs, as `run_fn` returns them; the updates `fn` made are applied.
        """
        if not callable(fn) or not isinstance(args, (tuple, list)):
            return run_fn(fn, args, kwargs)  # which raises the usual error
        key, plan = self._plan(fn)
        for _ in range(_MAX_REPLANS):
            values = [r[0]._tree._read_flat(r, device) for r in plan.reads]
            try:
                out, pushed = run_fn(plan.captured, (values, *args), kwargs)
            except _Replan as replan:
                plan = _Plan(fn, replan.reads)
                with self._lock:
                    self._plans[key] = plan
                continue
            for (flat, kind), update in zip(plan.pushes, pushed, strict=True):
                flat[0]._tree._apply_flat(flat, update, kind)
            return out
        raise RuntimeError(
            "The function given to strategy.run reads different parameter-server variables "
            "each time it is traced (its Python control flow depends on something that "
            "changes). Read the same variables in the same order on every call."
        )
