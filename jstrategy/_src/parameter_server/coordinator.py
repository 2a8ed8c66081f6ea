"""`ClusterCoordinator`: schedules functions on the workers of a `ParameterServerStrategy`.

As ``tf.distribute.experimental.coordinator``: `schedule` queues a function and returns a
`RemoteValue` at once; one coordinator thread per worker takes functions from the queue
and runs them on its worker (a device of this process, or a Ray actor), so every worker
trains at its own pace and pushes its updates to the parameter servers as soon as they
are computed. `join` waits for everything scheduled.

Failures follow TF:

* a worker that dies while running a function: the function goes back to the front of the
  queue and runs on another worker; the failed worker is restarted and its per-worker
  datasets are rebuilt (its iterators start over); training completes;
* a parameter server that dies: the function fails with `ParameterServerFailureError`,
  and `join`, `done` and every later `schedule` raise it (training must be restarted);
* an error raised by a scheduled function: `join` (or `done`, or the next `schedule`)
  raises it once, the functions still queued are cancelled (their `RemoteValue` objects raise
  `FunctionCancelledError`), and the coordinator can be used again.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax

from jstrategy._src.parameter_server import backend as backend_lib
from jstrategy._src.parameter_server.backend import ParameterServerFailureError
from jstrategy._src.parameter_server.backend import ResourceRef
from jstrategy._src.parameter_server.backend import ResourceSpec
from jstrategy._src.parameter_server.backend import WorkerFailureError

__all__ = [
    "ClusterCoordinator",
    "FunctionCancelledError",
    "NoWorkersAvailableError",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "PerWorkerValues",
    "RemoteValue",
]

# Functions queued per worker before `schedule` blocks (TF's bound is 256 per worker).
_QUEUE_SIZE_PER_WORKER = 256


class FunctionCancelledError(RuntimeError):
    """A scheduled function was cancelled because an earlier one failed; schedule it again.

    Example:

    >>> import threading
    >>> import jstrategy, jstrategy.coordinator as jc
    >>> one_worker = jc.local_cluster_resolver(num_workers=1)
    >>> coordinator = jc.ClusterCoordinator(jstrategy.ParameterServerStrategy(one_worker))
    >>> all_scheduled = threading.Event()
    >>> def fails():
    ...     all_scheduled.wait()
    ...     raise ValueError("a bug")
    >>> results = [coordinator.schedule(fails)] + [coordinator.schedule(lambda: 1) for _ in range(2)]
    >>> all_scheduled.set()
    >>> try:
    ...     coordinator.join()
    ... except ValueError as error:
    ...     print(error)
    a bug
    >>> try:
    ...     results[-1].fetch()                  # queued behind the failure: cancelled
    ... except jc.FunctionCancelledError as error:
    ...     print(type(error).__name__)
    FunctionCancelledError
    >>> coordinator.shutdown()
    """


class NoWorkersAvailableError(RuntimeError):
    """Every worker has failed for good, so scheduled functions cannot run.

    Example:

    >>> from jstrategy.coordinator import NoWorkersAvailableError
    >>> issubclass(NoWorkersAvailableError, RuntimeError)
    True
    """


class _Status(enum.Enum):
    PENDING = "PENDING"
    READY = "READY"
    FAILED = "FAILED"


class RemoteValue:
    """The future result of a scheduled function, as TF's ``RemoteValue``.

    Returned by `ClusterCoordinator.schedule`. Wait for it with `fetch` (NumPy values) or
    `get` (the values as the function returned them).

    Example:

    >>> import jax.numpy as jnp, jstrategy
    >>> from jstrategy.coordinator import ClusterCoordinator, local_cluster_resolver
    >>> coordinator = ClusterCoordinator(
    ...     jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1)))
    >>> value = coordinator.schedule(lambda: jnp.arange(3))
    >>> value.fetch().tolist()
    [0, 1, 2]
    >>> coordinator.shutdown()
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._status = _Status.PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._worker_index: int | None = None

    def _set(self, value: Any, worker_index: int | None) -> None:
        self._value = value
        self._worker_index = worker_index
        self._status = _Status.READY
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._status = _Status.FAILED
        self._event.set()

    def _wait(self, timeout: float | None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(
                f"The scheduled function did not finish within {timeout} s. Wait longer, or "
                "check that the workers are alive (ClusterCoordinator.done())."
            )
        if self._error is not None:
            raise self._error

    def get(self, timeout: float | None = None) -> Any:
        """Waits for the function and returns its result as it returned it (JAX arrays).

        Args:
          timeout: seconds to wait at most; None waits as long as it takes.

        Raises:
          Exception: the function's error, `FunctionCancelledError` if it was cancelled,
            or `TimeoutError`.
        """
        self._wait(timeout)
        return self._value

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the function and returns its result with arrays as NumPy arrays.

        Args:
          timeout: seconds to wait at most; None waits as long as it takes.

        Raises:
          Exception: the function's error, `FunctionCancelledError` if it was cancelled,
            or `TimeoutError`.
        """
        return backend_lib.to_numpy(self.get(timeout))

    def done(self) -> bool:
        """Whether the function has finished (or failed, or was cancelled)."""
        return self._event.is_set()

    def __repr__(self) -> str:
        return f"RemoteValue(status={self._status.value})"


class PerWorkerValues:
    """One value per worker; as an argument of `schedule`, each worker gets its own.

    Args:
      values: a sequence with one value per worker, in worker order.

    Example:

    >>> values = PerWorkerValues([10, 20])
    >>> values.values
    (10, 20)
    """

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def _for_worker(self, index: int) -> Any:
        return self._values[index]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._values)} workers)"


class _PerWorkerResource(PerWorkerValues):
    """A resource each worker builds itself (and rebuilds after a restart)."""

    def __init__(self, resource_id: int, num_workers: int):
        super().__init__([ResourceRef(resource_id)] * num_workers)
        self._resource_id = resource_id

    def _for_worker(self, index: int) -> Any:
        return ResourceRef(self._resource_id)


class PerWorkerDatasetIterator(_PerWorkerResource):
    """Every worker's iterator over its own dataset; resolves to the executing worker's.

    Pass it to `ClusterCoordinator.schedule`; inside the function call ``next(it)``. Each
    element is the batch with its arrays on that worker's device.

    Example:

    >>> import numpy as np, jstrategy
    >>> from jstrategy.coordinator import ClusterCoordinator, local_cluster_resolver
    >>> coordinator = ClusterCoordinator(
    ...     jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1)))
    >>> iterator = iter(coordinator.create_per_worker_dataset(lambda ctx: iter(np.arange(5.0))))
    >>> sums = [coordinator.schedule(lambda it: next(it) * 2, args=(iterator,)) for _ in range(3)]
    >>> sorted(float(v.fetch()) for v in sums)
    [0.0, 2.0, 4.0]
    >>> coordinator.shutdown()
    """

    def __next__(self) -> Any:
        raise TypeError(
            "A per-worker iterator is advanced on the workers: pass it to "
            "coordinator.schedule(fn, args=(iterator,)) and call next(iterator) inside fn."
        )

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(
            "A per-worker iterator cannot be iterated on the coordinator; pass it to "
            "coordinator.schedule and call next() on it inside the scheduled function."
        )


class PerWorkerDataset:
    """One dataset per worker, built by each worker; ``iter()`` gives per-worker iterators.

    Created by `ClusterCoordinator.create_per_worker_dataset`.

    Example:

    >>> import numpy as np, jstrategy
    >>> from jstrategy.coordinator import ClusterCoordinator, local_cluster_resolver
    >>> coordinator = ClusterCoordinator(
    ...     jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=2)))
    >>> dataset = coordinator.create_per_worker_dataset(
    ...     lambda ctx: iter([np.full(2, ctx.input_pipeline_id)] * 4))
    >>> iterator = iter(dataset)
    >>> first = coordinator.schedule(lambda it: next(it).sum(), args=(iterator,))
    >>> float(first.fetch()) in (0.0, 2.0)   # worker 0's batch, or worker 1's
    True
    >>> coordinator.shutdown()
    """

    def __init__(self, coordinator: ClusterCoordinator, resource_id: int):
        self._coordinator = coordinator
        self._resource_id = resource_id

    def __iter__(self) -> PerWorkerDatasetIterator:
        coordinator = self._coordinator
        rid = coordinator._register("iterator", self._resource_id)
        return PerWorkerDatasetIterator(rid, coordinator.num_workers)

    def __repr__(self) -> str:
        return f"PerWorkerDataset({self._coordinator.num_workers} workers)"


class _Closure:
    __slots__ = ("args", "fn", "kwargs", "remote_value")

    def __init__(self, fn, args, kwargs):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.remote_value = RemoteValue()

    def cancel(self, cause: BaseException) -> None:
        error = FunctionCancelledError(
            "The scheduled function was cancelled because an earlier function failed "
            f"({type(cause).__name__}: {cause}). Schedule it again."
        )
        self.remote_value._fail(error)


class _ClosureQueue:
    """The queue of scheduled functions shared by the worker threads (TF's closure queue)."""

    def __init__(self, max_size: int, num_workers: int):
        self._cond = threading.Condition()
        self._queue: collections.deque[_Closure] = collections.deque()
        self._max_size = max_size
        self._inflight = 0
        self._error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._closed = False
        self._live_workers = num_workers

    def _cancel_queued(self, cause: BaseException) -> None:
        while self._queue:
            self._queue.popleft().cancel(cause)

    def _raise_error(self) -> None:
        # Called with the lock held. A fatal error stays; a function's error is raised once.
        if self._fatal is not None:
            raise self._fatal
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def put(self, closure: _Closure, timeout: float | None = None) -> None:
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError("The ClusterCoordinator was shut down; create a new one.")
            if not self._cond.wait_for(
                lambda: (
                    len(self._queue) < self._max_size
                    or self._fatal is not None
                    or self._error is not None
                ),
                timeout,
            ):
                raise TimeoutError(f"The queue of scheduled functions stayed full for {timeout} s.")
            self._raise_error()
            self._queue.append(closure)
            self._cond.notify_all()

    def get(self) -> _Closure | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            if self._closed:
                return None
            self._inflight += 1
            return self._queue.popleft()

    def put_back(self, closure: _Closure) -> None:
        with self._cond:
            self._inflight -= 1
            if self._fatal is not None:
                closure.cancel(self._fatal)
            else:
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def mark_done(self, closure: _Closure, result: Any, worker_index: int) -> None:
        closure.remote_value._set(result, worker_index)
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def mark_failed(self, closure: _Closure, error: BaseException, *, fatal: bool) -> None:
        closure.remote_value._fail(error)
        with self._cond:
            self._inflight -= 1
            if fatal:
                self._fatal = self._fatal or error
            elif self._error is None and self._fatal is None:
                self._error = error
            self._cancel_queued(error)
            self._cond.notify_all()

    def worker_lost(self) -> None:
        with self._cond:
            self._live_workers -= 1
            if self._live_workers == 0 and self._fatal is None:
                self._fatal = NoWorkersAvailableError(
                    "Every worker has failed and none could be restarted, so the scheduled "
                    "functions cannot run. Restart the job."
                )
                self._cancel_queued(self._fatal)
            self._cond.notify_all()

    def wait(self, timeout: float | None) -> None:
        with self._cond:
            finished = self._cond.wait_for(
                lambda: (not self._queue and self._inflight == 0) or self._fatal is not None,
                timeout,
            )
            if not finished:
                raise TimeoutError(
                    f"join: {len(self._queue)} scheduled functions queued and "
                    f"{self._inflight} running after {timeout} s."
                )
            self._raise_error()

    def done(self) -> bool:
        with self._cond:
            self._raise_error()
            return not self._queue and self._inflight == 0

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cancel_queued(RuntimeError("the coordinator was shut down"))
            self._cond.notify_all()


class _WorkerThread(threading.Thread):
    """Takes functions from the queue and runs them on one worker, until shutdown."""

    def __init__(self, coordinator: ClusterCoordinator, handle: backend_lib.WorkerHandle):
        super().__init__(name=f"jstrategy-ps-worker-{handle.index}", daemon=True)
        self._coordinator = coordinator
        self.handle = handle

    def run(self) -> None:
        coordinator = self._coordinator
        queue = coordinator._queue
        index = self.handle.index
        while True:
            closure = queue.get()
            if closure is None:
                return
            try:
                args, kwargs = coordinator._resolve_args(closure.args, closure.kwargs, index)
                result = self.handle.execute(
                    closure.fn, args, kwargs, tuple(coordinator._resources)
                )
            except WorkerFailureError:
                queue.put_back(closure)
                if not self.handle.restart():
                    queue.worker_lost()
                    return
            except ParameterServerFailureError as e:
                queue.mark_failed(closure, e, fatal=True)
            except Exception as e:
                queue.mark_failed(closure, e, fatal=False)
            else:
                queue.mark_done(closure, result, index)


class ClusterCoordinator:
    """Schedules functions on the workers of a `ParameterServerStrategy`, asynchronously.

    There is one coordinator per strategy: creating another for the same strategy returns
    the first. Its worker threads start at creation.

    Args:
      strategy: a `ParameterServerStrategy`.

    Raises:
      TypeError: if `strategy` is not a `ParameterServerStrategy`.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> import jstrategy
    >>> from jstrategy.coordinator import ClusterCoordinator, local_cluster_resolver
    >>> strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=2))
    >>> counter = strategy.create_variables({"n": jnp.zeros(())})
    >>> coordinator = ClusterCoordinator(strategy)
    >>> results = [coordinator.schedule(lambda: counter.assign_add({"n": 1.0}))
    ...            for _ in range(6)]
    >>> coordinator.join()
    >>> float(counter.numpy()["n"])
    6.0
    >>> coordinator.shutdown()
    """

    _initialized: bool

    def __new__(cls, strategy: Any):
        # Only ParameterServerStrategy creates variables on parameter servers (that module
        # imports this one, through its `fit` runner, so it is not imported here).
        if not callable(getattr(type(strategy), "create_variables", None)):
            raise TypeError(
                "`strategy` must be a jstrategy.ParameterServerStrategy; got "
                f"{type(strategy).__name__}. ClusterCoordinator schedules functions on a "
                "parameter-server cluster."
            )
        existing = strategy._coordinator
        if existing is not None and not existing._shut_down:
            return existing
        self = super().__new__(cls)
        self._initialized = False
        return self

    def __init__(self, strategy: Any):
        if self._initialized:
            return
        self._initialized = True
        self._strategy: Any = strategy
        self._backend = strategy._require_backend()
        num_workers = self._backend.num_workers
        self._queue = _ClosureQueue(_QUEUE_SIZE_PER_WORKER * num_workers, num_workers)
        self._resources: list[ResourceSpec] = []
        self._resource_ids = itertools.count()
        self._resource_lock = threading.Lock()
        self._shut_down = False
        self._threads = [_WorkerThread(self, self._backend.worker(i)) for i in range(num_workers)]
        for thread in self._threads:
            thread.start()
        strategy._coordinator = self

    # Properties ---------------------------------------------------------------------------
    @property
    def strategy(self) -> Any:
        """The strategy this coordinator schedules on."""
        return self._strategy

    @property
    def num_workers(self) -> int:
        return self._backend.num_workers

    # Scheduling ---------------------------------------------------------------------------
    def schedule(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        `PerWorkerValues` in the arguments (such as per-worker dataset iterators) become the
        executing worker's value; `RemoteValue` objects become their results. Blocks only when
        256 functions per worker are already queued.

        Args:
          fn: the function. It runs on a worker thread (local backend) or in a worker
            process (Ray backend); `jstrategy.get_strategy()` is the strategy inside it,
            and `VariableTree.read()` pulls values onto the worker's device.
          args: positional arguments.
          kwargs: keyword arguments.

        Returns:
          A `RemoteValue` for the function's result.

        Raises:
          ParameterServerFailureError: if a parameter server has failed.
          Exception: the error of an earlier scheduled function not yet raised.
        """
        if not callable(fn):
            raise TypeError(f"`fn` must be callable; got {type(fn).__name__} {fn!r}.")
        args = () if args is None else args
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"`args` must be a tuple or list; got {type(args).__name__}. Wrap a single "
                "argument: args=(x,)."
            )
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"`kwargs` must be a dict; got {type(kwargs).__name__}.")
        closure = _Closure(fn, tuple(args), dict(kwargs))
        self._queue.put(closure)
        return closure.remote_value

    def join(self, timeout: float | None = None) -> None:
        """Waits until every scheduled function has finished.

        Args:
          timeout: seconds to wait at most (an extension of TF's API); None waits as long
            as it takes.

        Raises:
          ParameterServerFailureError: if a parameter server failed.
          Exception: the first error of a scheduled function (once; the functions still
            queued then are cancelled).
          TimeoutError: if `timeout` passed first.
        """
        self._queue.wait(timeout)

    def done(self) -> bool:
        """Whether every scheduled function has finished; raises a pending error, as `join`."""
        return self._queue.done()

    def fetch(self, val: Any, timeout: float | None = None) -> Any:
        """The NumPy results of a structure of `RemoteValue` objects (other leaves as they are).

        Args:
          val: a `RemoteValue`, or a nested structure (lists, tuples, dicts) of them.
          timeout: seconds to wait at most for each value.
        """
        return jax.tree.map(
            lambda x: x.fetch(timeout) if isinstance(x, RemoteValue) else x,
            val,
            is_leaf=lambda x: isinstance(x, RemoteValue),
        )

    # Per-worker resources -----------------------------------------------------------------
    def _register(self, kind: str, payload: Any) -> int:
        with self._resource_lock:
            rid = next(self._resource_ids)
            self._resources.append(ResourceSpec(rid, kind, payload))
        return rid

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """A dataset on every worker, each built by ``dataset_fn`` on that worker.

        Each worker calls ``dataset_fn()``, or ``dataset_fn(input_context)`` if it takes an
        argument (a `jstrategy.InputContext` whose ``input_pipeline_id`` is the worker's
        index, to shard the data), before its first function that uses it, and again after
        it restarts. The result is any iterable of batches (lists of NumPy arrays,
        generators' owners, `tf.data` datasets); elements are put on the worker's device.

        Args:
          dataset_fn: builds one worker's dataset.

        Returns:
          A `PerWorkerDataset`; ``iter()`` of it gives the `PerWorkerDatasetIterator` to
          pass to `schedule`.
        """
        if not callable(dataset_fn):
            raise TypeError(
                f"`dataset_fn` must be a function that builds a dataset; got "
                f"{type(dataset_fn).__name__}. Wrap it: lambda: dataset."
            )
        return PerWorkerDataset(self, self._register("dataset", dataset_fn))

    def _create_per_worker_resources(self, fn: Callable[[], Any]) -> PerWorkerValues:
        """One ``fn()`` result per worker, built on each worker (TF's private API)."""
        rid = self._register("value", fn)
        return _PerWorkerResource(rid, self.num_workers)

    def _resolve_args(self, args: Any, kwargs: Any, worker_index: int) -> tuple[Any, Any]:
        def resolve(x):
            if isinstance(x, PerWorkerValues):
                return x._for_worker(worker_index)
            if isinstance(x, RemoteValue):
                return x.get()
            return x

        return jax.tree.map(
            resolve,
            (args, kwargs),
            is_leaf=lambda x: isinstance(x, (PerWorkerValues, RemoteValue)),
        )

    # Test hooks and shutdown ----------------------------------------------------------------
    def _simulate_worker_failure(self, worker_index: int, *, restart: bool = True) -> None:
        """Makes worker `worker_index` die during its next (or current) function.

        The local backend raises `WorkerFailureError` at the function's next push to the
        parameter servers (or when it returns); the Ray backend kills the worker's process.
        With ``restart=False`` the worker stays dead.
        """
        self._threads[worker_index].handle.simulate_failure(restart=restart)

    def _simulate_parameter_server_failure(self, ps_index: int) -> None:
        """Makes parameter server `ps_index` unavailable (the Ray backend kills it)."""
        self._backend.simulate_parameter_server_failure(ps_index)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the worker threads (cancelling queued functions) and releases the workers.

        An extension of TF's API, for programs that create several clusters. A function
        already running is waited for, at most `timeout` seconds in all.

        Raises:
          TimeoutError: if a worker still runs a function after `timeout` seconds.
        """
        if self._shut_down:
            return
        self._shut_down = True
        self._queue.close()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            thread.handle.shutdown()
        if self._strategy._coordinator is self:
            self._strategy._coordinator = None
        running = [thread.name for thread in self._threads if thread.is_alive()]
        if running:
            # Returning quietly would leave a function running on a worker device, its
            # programs dispatched among whatever the program runs next.
            raise TimeoutError(
                f"ClusterCoordinator.shutdown(timeout={timeout}): {', '.join(running)} still "
                f"ran a function after {timeout} s (queued ones were cancelled). Wait for "
                "what was scheduled (coordinator.join()) or give shutdown a longer timeout."
            )

    def __repr__(self) -> str:
        return f"ClusterCoordinator(strategy={self._strategy!r})"
