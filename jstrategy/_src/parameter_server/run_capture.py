"""Parameter-server reads and updates inside `ParameterServerStrategy.run`.

TF's parameter-server tutorial reads the variables and applies the optimizer inside the
per-replica function::

    def replica_fn(x, y):
        loss, grads = jax.value_and_grad(loss_fn)(variables.read(), x, y)
        variables.apply_gradients(grads)
        return loss

`run` compiles that function, like every strategy's `run`, so neither can happen while it
is traced: a read would freeze the values of that moment into the compiled program, and an
update would push traced values. The variables are therefore a holder kind of `run`'s one
capture mechanism (`tracked.py`), `ParameterServerHolder`: a read is an input of the
program, pulled from the parameter servers before each call; an update is a push
(`RunFrame.push`), an output of the program applied on the parameter servers after it, in
the order the function made them. Each call therefore reads the current values and pushes
its own update. `RunCapture` compiles the program once per function (a function defined
anew inside every scheduled call, as in TF's tutorial, counts as the same function when it
closes over the same objects).

Outside `run`, reads and updates happen at once; inside a user's own `jax.jit` they are
refused (`refuse_inside_trace`), as they would happen once, at tracing.
"""

from __future__ import annotations

import collections
import threading
import types
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src import tracked
from jstrategy._src.jax_compat import inside_staging_trace
from jstrategy._src.values import varying_axes

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = ["ParameterServerHolder", "RunCapture", "capturing", "refuse_inside_trace"]

_PLANS_KEPT = 256
# Distinct closures of one function compiled before `run` warns that it recompiles.
_RECOMPILES_WARNED = 8


def capturing() -> tracked.RunFrame | None:
    """The frame of the `run` function traced on this thread, when it can capture
    parameter-server reads and updates (its strategy has one replica), or None."""
    frame = tracked.current_frame()
    if frame is None or frame.strategy.num_replicas_in_sync != 1:
        return None
    return frame


def refuse_inside_trace(what: str, *, captured: bool = True) -> None:
    """Raises if a read or update would happen once, while a user's program is traced.

    Args:
      what: the operation, e.g. ``"Reading parameter-server variables"``.
      captured: whether `run` lifts it out of a function it traces (reads and updates);
        host copies (``numpy()``) cannot be.

    Raises:
      RuntimeError: inside `jax.jit` (or another compiling transformation) outside
        `ParameterServerStrategy.run`, or inside `run` when not `captured`.
    """
    if capturing() is not None:
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


class ParameterServerHolder(tracked.Holder):
    """Some variables of a `VariableTree`, as `run` threads them (a `tracked.Holder` kind).

    Its value is the variables' arrays, pulled from the parameter servers at each call (on
    the device the one replica computes on); an update is pushed (`RunFrame.push`) with its
    kind (gradients, assign, ...) and applied on the parameter servers after the call.
    `VariableTree` keeps one holder per list of variables it reads or updates.

    Args:
      tree: the `VariableTree` of the variables.
      flat: the variables (`Variable`s, shards unrolled), in order.
    """

    def __init__(self, tree: Any, flat: Sequence[Any]):
        self._tree = tree
        self._flat = tuple(flat)
        self.ids = frozenset(v._id for v in self._flat)
        names = [v.name for v in self._flat]
        self.name = f"parameter-server variables {names}"
        self._spec = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in self._flat]

    @property
    def spec(self) -> Any:
        return self._spec

    def value_on(self, strategy: StrategyLike) -> Any:
        return self._tree._pull_flat(self._flat, strategy.devices[0])

    def traced(self, value: Any, axis: str) -> Any:
        # The replica's own copy, as `run`'s array arguments: the gradient with respect to
        # it is this replica's.
        return [
            x if axis in varying_axes(x) else jax.lax.pcast(x, axis, to="varying") for x in value
        ]

    def read(self, frame: tracked.RunFrame) -> list[Any]:
        """The values inside the trace of `frame`: this call's, pulled before it.

        Raises:
          ValueError: if the function updated some of them before (in this call).
        """
        pushed = set().union(
            *(h.ids for h, _, _ in frame.pushes if isinstance(h, ParameterServerHolder))
        )
        stale = [v.name for v in self._flat if v._id in pushed]
        if stale:
            raise ValueError(
                f"The function given to strategy.run reads {stale} after updating them. Inside "
                "run every read gives the values from before the call and the updates are "
                "pushed after it, so this read would not see the update. Read before "
                "updating, or update in one run call and read in the next."
            )
        return list(frame.read(self))

    def push(self, frame: tracked.RunFrame, values: Sequence[Any], kind: str) -> None:
        """Records an update of `kind`, pushed after the call."""
        axis = frame.strategy.axis_name
        frame.push(self, [_invariant(jnp.asarray(x), axis) for x in values], kind)

    def apply(self, value: Any, how: Any) -> None:
        self._tree._apply_flat(self._flat, value, how)


def _invariant(x: jax.Array, axis: str) -> jax.Array:
    # The strategies that capture have one replica, so the sum over replicas is the value
    # itself; it makes an update computed from per-replica copies a single output.
    if axis in varying_axes(x):
        return jax.lax.psum(x, axis)
    return x


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
    """Runs the functions given to `ParameterServerStrategy.run`, compiled once each.

    A `ParameterServerStrategy` has one; its `run` calls `RunCapture.run` with the one-replica
    strategy of the device it runs on. Functions that compute the same thing (the same code
    closing over the same objects) are given to that strategy's `run` as one function, so
    its compiled program, which captures their parameter-server reads and updates, is reused.
    """

    def __init__(self) -> None:
        self._functions: collections.OrderedDict[Any, Callable[..., Any]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        # Per code object: the last key compiled for it and how many keys it has had.
        self._by_code: dict[Any, tuple[Any, int]] = {}

    def _function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        key = _function_key(fn)
        with self._lock:
            first = self._functions.get(key)
            if first is None:
                # Kept: it keeps the objects its key names alive.
                first = self._functions[key] = fn
                while len(self._functions) > _PLANS_KEPT:
                    self._functions.popitem(last=False)
                self._note_new_key(fn, key)
            else:
                self._functions.move_to_end(key)
        return first

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
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict | None,
    ) -> Any:
        """``run_fn(fn, args, kwargs)``, with `fn` the first function that computes as it.

        Args:
          run_fn: a one-replica strategy's `Strategy.run`, which pulls `fn`'s
            parameter-server reads before each call and applies its updates after.
          fn: the per-replica function.
          args: positional arguments.
          kwargs: keyword arguments.

        Returns:
          `fn`'s outputs, as `run_fn` returns them; the updates `fn` made are applied.
        """
        if not callable(fn) or not isinstance(args, (tuple, list)):
            return run_fn(fn, args, kwargs)  # which raises the usual error
        return run_fn(self._function(fn), args, kwargs)
