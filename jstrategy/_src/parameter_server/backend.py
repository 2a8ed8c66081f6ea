"""The small interface between `ParameterServerStrategy` and where its tasks run.

Two backends implement it: `LocalBackend` (here), where parameter servers and workers are
devices and threads of this process, and `RayBackend` (`ray_backend.py`), where they are
Ray actors. The rest of the package sees only:

* a *store client* per parameter-server task (`create`, `read`, `apply`): the variables'
  storage, with per-variable atomic updates;
* a *worker handle* per worker task (`execute`, `restart`, `shutdown`), driven by one
  coordinator thread per worker;
* the *worker context* (`current_worker`), which tells code running a scheduled function
  which worker and device it is on.

`ArrayStore` holds one task's variables and applies updates with one jitted program per
update kind and variable group; both backends use it (the Ray parameter-server actor wraps
one).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jstrategy._src import context
from jstrategy._src import dispatch
from jstrategy._src.input.options import InputContext

__all__ = [
    "ArrayStore",
    "Backend",
    "LocalBackend",
    "ParameterServerFailureError",
    "ResourceTable",
    "WorkerContext",
    "WorkerFailureError",
    "current_worker",
]


class WorkerFailureError(RuntimeError):
    """A worker died (or was preempted) while running a scheduled function.

    The coordinator catches it: the function runs again on another worker and the failed
    worker is restarted with its per-worker datasets rebuilt. Raise it from a scheduled
    function to simulate a preemption.

    Example:

    >>> import jstrategy
    >>> from jstrategy.coordinator import ClusterCoordinator, WorkerFailureError
    >>> from jstrategy.coordinator import local_cluster_resolver
    >>> coordinator = ClusterCoordinator(
    ...     jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=2)))
    >>> attempts = []
    >>> def preempted_once():
    ...     attempts.append(1)
    ...     if len(attempts) == 1:
    ...         raise WorkerFailureError("simulated preemption")
    ...     return len(attempts)
    >>> coordinator.schedule(preempted_once).fetch()    # run again on a worker
    2
    >>> coordinator.shutdown()
    """


class ParameterServerFailureError(RuntimeError):
    """A parameter server is unavailable; training cannot go on without it.

    As in TF, a parameter-server failure is fatal to the cluster: `ClusterCoordinator.join`,
    `done` and later `schedule` calls raise it. Restart training (from a checkpoint).

    Example:

    >>> from jstrategy.coordinator import ParameterServerFailureError
    >>> try:
    ...     raise ParameterServerFailureError("ps 0 is unavailable")
    ... except RuntimeError as error:
    ...     print(type(error).__name__, error)
    ParameterServerFailureError ps 0 is unavailable
    """


# ---------------------------------------------------------------------------------------
# Worker context
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class WorkerContext:
    """Which worker is running the current scheduled function, and on which device."""

    worker_index: int
    num_workers: int
    device: jax.Device
    # Test hook of the local backend: the worker "dies" at its next push, or at the end of
    # the next function that starts after the failure was simulated.
    fail_next: bool = False

    def check_alive(self) -> None:
        if self.fail_next:
            self.fail_next = False
            raise WorkerFailureError(
                f"Worker {self.worker_index} failed while running a scheduled function (simulated)."
            )


# Per thread, not a `trace_context` field: which worker runs is a fact of the running
# thread (a worker's thread, while a scheduled function executes), not of a trace.
_CONTEXT = threading.local()


def current_worker() -> WorkerContext | None:
    """The worker context of this thread: set while a scheduled function runs, else None."""
    return getattr(_CONTEXT, "worker", None)


@contextlib.contextmanager
def worker_scope(worker: WorkerContext) -> Iterator[WorkerContext]:
    previous = current_worker()
    _CONTEXT.worker = worker
    try:
        yield worker
    finally:
        _CONTEXT.worker = previous


# ---------------------------------------------------------------------------------------
# Parameter-server storage
# ---------------------------------------------------------------------------------------
_RESTART_SECONDS = 0.05

GRADIENTS = "gradients"
ASSIGN = "assign"
ASSIGN_ADD = "assign_add"
ASSIGN_SUB = "assign_sub"
UPDATE_KINDS = (GRADIENTS, ASSIGN, ASSIGN_ADD, ASSIGN_SUB)


def _update_program(kind: str, tx: optax.GradientTransformation | None) -> Callable[..., Any]:
    """``(values, opt_states, args) -> (values, opt_states)`` for one group of variables.

    The optimizer runs once per variable (per shard), as TF's optimizers keep one set of
    slots per variable on that variable's parameter server.
    """

    def program(values, opt_states, args):
        if kind == GRADIENTS:
            assert tx is not None  # `ArrayStore.apply` refuses gradients without one
            new_values, new_states = [], []
            for value, state, grad in zip(values, opt_states, args, strict=True):
                updates, state = tx.update(grad.astype(value.dtype), state, value)
                new_values.append(optax.apply_updates(value, updates))
                new_states.append(state)
            return new_values, new_states
        if kind == ASSIGN:
            new_values = [a.astype(v.dtype) for v, a in zip(values, args, strict=True)]
        elif kind == ASSIGN_ADD:
            new_values = [(v + a).astype(v.dtype) for v, a in zip(values, args, strict=True)]
        else:
            new_values = [(v - a).astype(v.dtype) for v, a in zip(values, args, strict=True)]
        return new_values, opt_states

    return jax.jit(program)


def fits_dtype(dtype: Any, var_dtype: Any) -> bool:
    """Whether values of `dtype` may update a variable of `var_dtype` (cast on the way).

    Booleans, integers and floats fit any real variable; complex values only a complex one.
    """
    try:
        kind = np.dtype(dtype).kind
    except TypeError:  # extended dtypes, e.g. PRNG keys
        return False
    return kind in ("biufc" if np.dtype(var_dtype).kind == "c" else "biuf")


def _check_concrete(var_id: int, value: Any) -> None:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"Parameter-server variable {var_id} got a traced value ({value.aval}); a store "
            "holds concrete arrays only. Push the result of the computation, not a value "
            "inside jax.jit or grad."
        )


def _check_update(var_id: int, arg: Any, value: jax.Array) -> None:
    """Raises unless `arg` is a concrete numeric array of `value`'s shape."""
    _check_concrete(var_id, arg)
    if not hasattr(arg, "dtype"):
        arg = np.asarray(arg)
    if not fits_dtype(arg.dtype, value.dtype) or tuple(np.shape(arg)) != value.shape:
        raise ValueError(
            f"An update of parameter-server variable {var_id} ({value.dtype}{list(value.shape)})"
            f" must be a numeric array of that shape; got {arg.dtype}"
            f"{list(np.shape(arg))}. The variable is unchanged."
        )


class ArrayStore:
    """The variables of one parameter-server task, as arrays on one device.

    Values are immutable arrays, so a read takes references without a lock; an update
    holds the locks of its variables (taken in id order, so concurrent updates of
    overlapping groups cannot deadlock) while it dispatches one jitted program on the
    store's device. Updates are therefore atomic per variable and never lost, and are
    applied in the order they arrive, with no barrier between workers.

    Args:
      device: where the variables live.
    """

    def __init__(self, device: jax.Device):
        self.device = device
        self._values: dict[int, jax.Array] = {}
        self._opt_states: dict[int, Any] = {}
        self._tx_keys: dict[int, Any] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._txs: dict[Any, optax.GradientTransformation | None] = {}
        self._programs: dict[Any, Callable[..., Any]] = {}
        self._registry_lock = threading.Lock()
        # Updates are dispatched asynchronously; bound how many are queued on the device.
        self._limiter = dispatch.InFlightLimiter()

    def create(
        self,
        ids: Sequence[int],
        values: Sequence[Any],
        tx_key: Any,
        tx: optax.GradientTransformation | None,
    ) -> None:
        for i, value in zip(ids, values, strict=True):
            _check_concrete(i, value)
        placed = jax.device_put([jnp.asarray(v) for v in values], self.device)
        with self._registry_lock:
            self._txs.setdefault(tx_key, tx)
            for i, value in zip(ids, placed, strict=True):
                state = ()
                if tx is not None:
                    state = jax.device_put(tx.init(value), self.device)
                self._values[i] = value
                self._opt_states[i] = state
                self._tx_keys[i] = tx_key
                self._locks[i] = threading.Lock()

    def read(self, ids: Sequence[int]) -> list[jax.Array]:
        return [self._values[i] for i in ids]

    def read_opt_states(self, ids: Sequence[int]) -> list[Any]:
        return [self._opt_states[i] for i in ids]

    def assign_opt_states(self, ids: Sequence[int], states: Sequence[Any]) -> None:
        """Replaces variables' optimizer states (a restored backup, a new learning rate).

        Raises:
          ValueError: if a state is not shaped like the one it replaces.
        """
        for i, state in zip(ids, states, strict=True):
            old = self._opt_states[i]
            same = jax.tree.structure(old) == jax.tree.structure(state) and all(  # type: ignore[operator]
                np.shape(a) == np.shape(b)
                for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(state), strict=True)
            )
            if not same:
                raise ValueError(
                    f"The optimizer state for variable {i} does not match the optimizer's "
                    "(another optimizer, or another variable layout)."
                )
        placed = jax.device_put(
            [
                jax.tree.map(lambda a, b: np.asarray(b, a.dtype), self._opt_states[i], s)
                for i, s in zip(ids, states, strict=True)
            ],
            self.device,
        )
        for i, state in zip(ids, placed, strict=True):
            with self._locks[i]:
                self._opt_states[i] = state

    def apply(self, ids: Sequence[int], kind: str, args: Sequence[Any]) -> None:
        if not ids:
            return
        tx_key = self._tx_keys[ids[0]]
        tx = self._txs[tx_key]
        if kind == GRADIENTS and tx is None:
            raise ValueError(
                "apply_gradients needs an optimizer; these variables were created without "
                "one. Pass optimizer=optax.sgd(...) (or another optax transformation) to "
                "strategy.create_variables."
            )
        if kind not in UPDATE_KINDS:
            raise ValueError(f"`kind` must be one of {UPDATE_KINDS}; got {kind!r}.")
        # Checked before anything changes, so a bad update leaves every variable as it was.
        for i, arg in zip(ids, args, strict=True):
            _check_update(i, arg, self._values[i])
        key = (kind, tx_key)
        program = self._programs.get(key)
        if program is None:
            program = self._programs.setdefault(key, _update_program(kind, tx))
        args = jax.device_put(list(args), self.device)
        locks = [self._locks[i] for i in sorted(set(ids))]
        for lock in locks:
            lock.acquire()
        try:
            values = [self._values[i] for i in ids]
            states = [self._opt_states[i] for i in ids]
            new_values, new_states = program(values, states, args)
            for i, value, state in zip(ids, new_values, new_states, strict=True):
                self._values[i] = value
                self._opt_states[i] = state
        finally:
            for lock in reversed(locks):
                lock.release()
        self._limiter.track(new_values)


class StoreClient(abc.ABC):
    """How variables reach one parameter-server task's `ArrayStore`."""

    ps_index: int

    @abc.abstractmethod
    def create(self, ids, values, tx_key, tx) -> None: ...

    @classmethod
    @abc.abstractmethod
    def read_groups(cls, groups: dict[Any, list[int]], device: jax.Device) -> dict[Any, list]:
        """Reads several stores' variables (in parallel where possible), onto `device`."""

    @classmethod
    @abc.abstractmethod
    def apply_groups(cls, groups: dict[Any, tuple[list[int], list[Any]]], kind: str) -> None:
        """Applies one update to several stores' variables (in parallel where possible)."""

    @abc.abstractmethod
    def read_opt_states(self, ids: Sequence[int]) -> list[Any]: ...

    @abc.abstractmethod
    def assign_opt_states(self, ids: Sequence[int], states: Sequence[Any]) -> None: ...


def _unavailable(ps_index: int) -> ParameterServerFailureError:
    return ParameterServerFailureError(
        f"Parameter server ps:{ps_index} is unavailable, so its variables cannot be read or "
        "updated. A parameter-server failure ends training, as in TF: restart the job (from "
        "the last checkpoint)."
    )


class LocalStoreClient(StoreClient):
    """A parameter-server task that is a device of this process."""

    def __init__(self, ps_index: int, device: jax.Device):
        self.ps_index = ps_index
        self.store = ArrayStore(device)
        self.alive = True

    def _check(self) -> None:
        if not self.alive:
            raise _unavailable(self.ps_index)

    def create(self, ids, values, tx_key, tx) -> None:
        self._check()
        self.store.create(ids, values, tx_key, tx)

    @classmethod
    def read_groups(cls, groups, device):
        out = {}
        for client, ids in groups.items():
            client._check()
            out[client] = client.store.read(ids)
        # One transfer call for every store's arrays.
        clients = list(out)
        moved = jax.device_put([out[c] for c in clients], device)
        return dict(zip(clients, moved, strict=True))

    @classmethod
    def apply_groups(cls, groups, kind):
        for client, (ids, args) in groups.items():
            client._check()
            client.store.apply(ids, kind, args)

    def read_opt_states(self, ids):
        self._check()
        return self.store.read_opt_states(ids)

    def assign_opt_states(self, ids, states):
        self._check()
        self.store.assign_opt_states(ids, states)

    def __repr__(self) -> str:
        return f"LocalStoreClient(ps:{self.ps_index}, {self.store.device})"


# ---------------------------------------------------------------------------------------
# Per-worker resources (datasets, iterators), rebuilt when a worker restarts
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResourceSpec:
    """How to build one per-worker resource on a worker; replayed in order on restarts.

    ``kind`` is ``"dataset"`` (``payload`` is the dataset function), ``"iterator"``
    (``payload`` is the dataset resource's id) or ``"value"`` (``payload`` is a function
    of no arguments).
    """

    resource_id: int
    kind: str
    payload: Any


@dataclasses.dataclass(frozen=True)
class ResourceRef:
    """Stands for a per-worker resource in a scheduled function's arguments."""

    resource_id: int


def _takes_input_context(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return bool(positional)


class WorkerDataset:
    """A worker's dataset: iterating it yields batches placed on the worker's device."""

    def __init__(self, source: Any, device: jax.Device):
        self._source = source
        self._device = device

    def _iter_source(self) -> Iterator[Any]:
        source = self._source
        if hasattr(source, "as_numpy_iterator"):  # tf.data
            return iter(source.as_numpy_iterator())
        return iter(source)

    def __iter__(self) -> Iterator[Any]:
        device = self._device

        def generate():
            for batch in self._iter_source():
                yield jax.device_put(batch, device)

        return generate()


class ResourceTable:
    """The per-worker resources one worker has built, by id."""

    def __init__(self, worker_index: int, num_workers: int, device: jax.Device):
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.device = device
        self._built: dict[int, Any] = {}
        self._count = 0

    @property
    def count(self) -> int:
        """How many specs of the coordinator's registry this table has built."""
        return self._count

    def clear(self) -> None:
        self._built.clear()
        self._count = 0

    def sync(self, specs: Sequence[ResourceSpec]) -> None:
        """Builds `specs` (the registry's entries after the ones already built), in order."""

        for spec in specs:
            if spec.resource_id in self._built:
                continue
            if spec.kind == "dataset":
                fn = spec.payload
                if _takes_input_context(fn):
                    ctx = InputContext(
                        num_input_pipelines=self.num_workers,
                        input_pipeline_id=self.worker_index,
                        num_replicas_in_sync=1,
                    )
                    source = fn(ctx)
                else:
                    source = fn()
                value: Any = WorkerDataset(source, self.device)
            elif spec.kind == "iterator":
                value = iter(self._built[spec.payload])
            else:
                value = spec.payload()
            self._built[spec.resource_id] = value
            self._count += 1

    def resolve(self, tree: Any) -> Any:
        """`tree` with every `ResourceRef` replaced by this worker's resource."""
        return jax.tree.map(
            lambda x: self._built[x.resource_id] if isinstance(x, ResourceRef) else x,
            tree,
            is_leaf=lambda x: isinstance(x, ResourceRef),
        )


# ---------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------
class WorkerHandle(abc.ABC):
    """One worker task, as the coordinator's thread for that worker drives it."""

    index: int

    @abc.abstractmethod
    def execute(
        self, fn: Callable[..., Any], args: Any, kwargs: Any, specs: Sequence[ResourceSpec]
    ) -> Any:
        """Builds missing resources (`specs` is the whole registry), then runs `fn`.

        Returns:
          `fn`'s result, computed (not a pending computation).

        Raises:
          WorkerFailureError: if the worker died; the function's effects may be partial.
          ParameterServerFailureError: if a parameter server it used is unavailable.
          Exception: whatever `fn` raised.
        """

    @abc.abstractmethod
    def restart(self) -> bool:
        """Brings a failed worker back with no resources; False if it cannot come back."""

    def simulate_failure(self, *, restart: bool = True) -> None:
        """Test hook: make this worker die during its next (or current) function."""
        raise NotImplementedError

    def shutdown(self) -> None:  # noqa: B027 (optional: most workers hold nothing)
        """Releases the worker."""


class Backend(abc.ABC):
    """Where the parameter servers and workers of a `ParameterServerStrategy` run."""

    num_workers: int
    num_ps: int

    @abc.abstractmethod
    def store(self, ps_index: int) -> StoreClient: ...

    @abc.abstractmethod
    def worker(self, worker_index: int) -> WorkerHandle: ...

    @abc.abstractmethod
    def simulate_parameter_server_failure(self, ps_index: int) -> None: ...

    def shutdown(self) -> None:  # noqa: B027 (optional: local tasks hold nothing)
        """Releases every task."""


class LocalWorker(WorkerHandle):
    """A worker that is a device of this process; its functions run on the calling thread."""

    def __init__(self, index: int, num_workers: int, device: jax.Device, strategy: Any):
        self.index = index
        self.device = device
        self._strategy = strategy
        self._table = ResourceTable(index, num_workers, device)
        self._context = WorkerContext(index, num_workers, device)
        self._can_restart = True
        self._lock = threading.Lock()

    def execute(self, fn, args, kwargs, specs):

        table = self._table
        with worker_scope(self._context), context.strategy_scope(self._strategy):
            if table.count < len(specs):
                table.sync(specs[table.count :])
            args, kwargs = table.resolve((args, kwargs))
            armed = self._context.fail_next
            result = fn(*args, **kwargs)
            # The function's device work is done before its result is ready, which bounds
            # the work each worker has in flight.
            result = jax.block_until_ready(result)
            if armed:
                # A failure simulated before the function started and not yet hit at a push.
                self._context.check_alive()
        return result

    def simulate_failure(self, *, restart: bool = True) -> None:
        with self._lock:
            self._context.fail_next = True
            self._can_restart = restart

    def restart(self) -> bool:
        # A restarted worker has lost its state: its datasets are rebuilt on next use. The
        # pause stands for the time a real worker takes to come back.
        self._table.clear()
        if self._can_restart:
            time.sleep(_RESTART_SECONDS)
        return self._can_restart


class LocalBackend(Backend):
    """Parameter servers and workers as devices of this process.

    Parameter server ``i`` is ``devices[i]`` and worker ``j`` is ``devices[num_ps + j]``,
    wrapping around when there are fewer devices than tasks (e.g. one CPU device: all on
    it). With ``--xla_force_host_platform_device_count=8`` every task has its own device.
    """

    def __init__(self, num_workers: int, num_ps: int, strategy: Any, devices=None):
        devices = list(devices if devices is not None else jax.local_devices())
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.ps_devices = [devices[i % len(devices)] for i in range(num_ps)]
        self.worker_devices = [devices[(num_ps + j) % len(devices)] for j in range(num_workers)]
        self._stores = [LocalStoreClient(i, d) for i, d in enumerate(self.ps_devices)]
        self._strategy = strategy

    def store(self, ps_index: int) -> LocalStoreClient:
        return self._stores[ps_index]

    def worker(self, worker_index: int) -> LocalWorker:
        return LocalWorker(
            worker_index, self.num_workers, self.worker_devices[worker_index], self._strategy
        )

    def simulate_parameter_server_failure(self, ps_index: int) -> None:
        self._stores[ps_index].alive = False


def to_numpy(tree: Any) -> Any:
    """Array leaves to NumPy (one transfer for all), other leaves as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    fetched = jax.device_get([leaves[i] for i in arrays])
    for i, value in zip(arrays, fetched, strict=True):
        leaves[i] = np.asarray(value)
    return jax.tree.unflatten(treedef, leaves)
