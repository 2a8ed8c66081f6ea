"""The strategy stack: scopes, the default strategy and replica contexts, as in tf.distribute.

The stack is thread-local. Its bottom is the default strategy with a default replica
context. `Strategy.scope()` pushes a cross-replica entry; `Strategy.run` pushes a replica
entry while it traces the per-replica function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src import jax_compat
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.values import varying_axes

# The result of an all-gather is the same on every replica; the invariant variant says so
# to the type system (so `run` returns it as a mirrored value) and its gradient is a slice.
_all_gather_invariant = jax_compat.all_gather_invariant

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = [
    "ReplicaContext",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class ReplicaContext:
    """What a per-replica function sees of its strategy while `Strategy.run` runs it.

    Obtain it with `jstrategy.get_replica_context()` inside the function passed to
    `Strategy.run`. Collectives here are traced into the one compiled SPMD program; gradients
    flow through them as in tf.distribute (the gradient of an all-reduce is the all-reduce of
    the incoming gradients). They run over the strategy's data axis (`Strategy.axis_name`):
    on a multi-axis mesh a replica is one data-parallel group of devices, and the other
    axes are left to XLA.

    Example:

    >>> import jax.numpy as jnp
    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> def fn():
    ...     ctx = jstrategy.get_replica_context()
    ...     x = (ctx.replica_id_in_sync_group + 1).astype(jnp.float32)
    ...     return ctx.all_reduce("SUM", x)
    >>> float(strategy.run(fn))
    3.0
    """

    def __init__(self, strategy: StrategyLike, *, in_run: bool = True, row_mask: Any = None):
        self._strategy = strategy
        self._in_run = in_run
        self._row_mask = row_mask

    @property
    def row_mask(self) -> jax.Array | None:
        """This replica's real-row mask when `run` got a padded batch, else None.

        Distributed datasets pad a partial last batch to the full static shape so the
        compiled step is reused; this boolean vector (one entry per local row) tells real
        rows from padding. `jstrategy.compute_average_loss` uses it.
        """
        return self._row_mask

    @property
    def strategy(self) -> StrategyLike:
        """The strategy running this replica."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each collective (the size of the data axis)."""
        return self._strategy.num_replicas_in_sync if self._in_run else 1

    @property
    def replica_id_in_sync_group(self) -> jax.Array | int:
        """This replica's index, 0 to `num_replicas_in_sync - 1` (a traced int inside `run`)."""
        if not self._in_run:
            return 0
        return jax.lax.axis_index(self._strategy.axis_name)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Combines `value` (any pytree of arrays) across replicas; every replica gets the result.

        Uses the strategy's cross-device ops, so `HierarchicalCopyAllReduce` changes the
        communication pattern of the program, not the numbers.

        Args:
          reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or their names).
          value: a pytree of arrays, the same structure and shapes on every replica.

        Returns:
          The reduced pytree, identical on every replica.
        """
        op = ReduceOp.from_value(reduce_op)
        if not self._in_run:
            return value
        strategy = self._strategy
        return strategy.cross_device_ops.all_reduce(
            op, value, mesh=strategy.mesh, axis_name=strategy.axis_name
        )

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenates each replica's `value` along `axis`, in replica order.

        Args:
          value: a pytree of arrays of rank at least 1.
          axis: the axis to concatenate along.

        Returns:
          The gathered pytree, identical on every replica.
        """
        if not self._in_run:
            return value
        name = self._strategy.axis_name

        def gather(x):
            x = jnp.asarray(x)
            if name not in varying_axes(x):
                x = jax.lax.pcast(x, name, to="varying")
            return _all_gather_invariant(x, name, axis=axis, tiled=True)

        return jax.tree.map(gather, value)

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r})"


@dataclasses.dataclass(frozen=True)
class _Entry:
    strategy: StrategyLike
    replica_context: ReplicaContext | None  # None means cross-replica context.
    scope_owner: bool = False


# Per thread, not a `trace_context` field: the user's code enters strategy scopes on its
# threads (``with strategy.scope():``) around traces and outside any; `run` pushes its
# replica contexts on the same stack.
class _Stack(threading.local):
    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.set_strategy: StrategyLike | None = None


_STACK = _Stack()
_DEFAULT: list[StrategyLike] = []
_DEFAULT_FACTORY: list[Callable[[], StrategyLike]] = []
_DEFAULT_LOCK = threading.Lock()


def set_default_strategy_factory(factory: Callable[[], StrategyLike]) -> None:
    """Says how to make the strategy in force outside any scope (`one_device.py` does, as
    it is imported: the strategies import this module, so it cannot import them)."""
    _DEFAULT_FACTORY[:] = [factory]


def _default_strategy() -> StrategyLike:
    # Created on first use, not at import: building it starts JAX's backends.
    with _DEFAULT_LOCK:
        if not _DEFAULT:
            _DEFAULT.append(_DEFAULT_FACTORY[0]())
    return _DEFAULT[0]


def _top() -> _Entry:
    if _STACK.entries:
        return _STACK.entries[-1]
    default = _default_strategy()
    return _Entry(default, ReplicaContext(default, in_run=False))


def get_strategy() -> StrategyLike:
    """The current strategy: the innermost `scope()`, or the default strategy outside any
    (typed for the core; `jstrategy.get_strategy` gives it as a `Strategy`)."""
    return _top().strategy


def has_strategy() -> bool:
    """Whether a non-default strategy is current (inside a `scope()` or `run`).

    Example:

    >>> import jstrategy
    >>> jstrategy.has_strategy()
    False
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     jstrategy.has_strategy()
    True
    """
    return bool(_STACK.entries)


def in_cross_replica_context() -> bool:
    """True inside a `scope()` but outside `run`; False in `run` and outside any scope.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     jstrategy.in_cross_replica_context()
    True
    >>> jstrategy.in_cross_replica_context()
    False
    """
    return _top().replica_context is None


def inside_run() -> ReplicaContext | None:
    """The replica context of the function `Strategy.run` is tracing, or None outside one."""
    ctx = _top().replica_context
    return ctx if ctx is not None and ctx._in_run else None


def get_replica_context() -> ReplicaContext | None:
    """The current `ReplicaContext`; None in a cross-replica context (a `scope()` outside `run`).

    Outside any scope it is the default strategy's replica context, as in tf.distribute.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     print(jstrategy.get_replica_context())   # cross-replica: inside a scope, outside run
    None
    >>> ids = strategy.run(lambda: jstrategy.get_replica_context().replica_id_in_sync_group)
    >>> [int(i) for i in strategy.experimental_local_results(ids)]
    [0, 1]
    """
    return _top().replica_context


@contextlib.contextmanager
def strategy_scope(strategy: StrategyLike) -> Iterator[StrategyLike]:
    """Pushes `strategy` as the current, cross-replica strategy."""
    for entry in _STACK.entries:
        if entry.strategy is not strategy:
            raise ValueError(
                f"Mixing different strategies is not allowed: entering the scope of "
                f"{strategy!r} inside the scope of {entry.strategy!r}. Exit the outer scope "
                "first, or use one strategy for both."
            )
    _STACK.entries.append(_Entry(strategy, None, scope_owner=True))
    try:
        yield strategy
    finally:
        _STACK.entries.pop()


#: What else a strategy's scope enters, each given the strategy (`add_scope_hook`).
_SCOPE_HOOKS: list[Callable[[StrategyLike], contextlib.AbstractContextManager[Any]]] = []


def add_scope_hook(
    hook: Callable[[StrategyLike], contextlib.AbstractContextManager[Any]],
) -> None:
    """Makes every `Strategy.scope` enter ``hook(strategy)`` too (once per hook).

    How a layer above the core joins the scope without the core importing it: the Keras 3
    route (`jstrategy.keras`) installs its ``keras.distribution`` this way.
    """
    if hook not in _SCOPE_HOOKS:
        _SCOPE_HOOKS.append(hook)


@contextlib.contextmanager
def scope_hooks_entered(strategy: StrategyLike) -> Iterator[None]:
    """Within: every hook of `add_scope_hook` entered for `strategy`."""
    with contextlib.ExitStack() as stack:
        for hook in tuple(_SCOPE_HOOKS):
            stack.enter_context(hook(strategy))
        yield


@contextlib.contextmanager
def replica_scope(strategy: StrategyLike, replica_context: ReplicaContext) -> Iterator[None]:
    """Pushes a replica context while `run` traces a per-replica function."""
    _STACK.entries.append(_Entry(strategy, replica_context))
    try:
        yield
    finally:
        _STACK.entries.pop()


def experimental_set_strategy(strategy: StrategyLike | None) -> None:
    """Makes `strategy` current without a `with` block; `None` clears it.

    Equivalent to entering `strategy.scope()` and never leaving, as
    `tf.distribute.experimental_set_strategy`.

    Args:
      strategy: the strategy to make current, or None.

    Raises:
      RuntimeError: if called inside some `scope()`.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> jstrategy.experimental_set_strategy(strategy)
    >>> jstrategy.get_strategy() is strategy
    True
    >>> jstrategy.experimental_set_strategy(None)
    >>> jstrategy.has_strategy()
    False
    """
    entries = _STACK.entries
    own = _STACK.set_strategy
    if entries and not (len(entries) == 1 and own is not None and entries[0].strategy is own):
        raise RuntimeError(
            "experimental_set_strategy must not be called inside a strategy scope; exit "
            "the `with strategy.scope():` block first."
        )
    entries.clear()
    _STACK.set_strategy = strategy
    if strategy is not None:
        entries.append(_Entry(strategy, None, scope_owner=True))
