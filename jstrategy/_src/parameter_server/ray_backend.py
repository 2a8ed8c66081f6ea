"""The Ray backend: parameter servers and workers as Ray actors (``pip install 'jstrategy[ray]'``).

Each parameter server is an actor holding an `ArrayStore` on its process's first JAX
device; Ray runs one method of an actor at a time, so its updates are atomic. Each worker
is an actor with its own `ResourceTable` (per-worker datasets and iterators); a scheduled
function travels to it by cloudpickle, with the `VariableTree` objects it uses, whose variables
hold the parameter servers' actor handles: workers pull and push directly, never through
the coordinator.

A worker actor that dies (its process killed, its node lost) surfaces as a Ray actor
error on the coordinator's call: that is a `WorkerFailureError`; the coordinator starts a
fresh actor for the slot, which rebuilds its datasets. A parameter-server actor that dies
surfaces, in the worker using it, as a Ray actor error turned into
`ParameterServerFailureError`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jstrategy._src.parameter_server import backend as backend_lib

__all__ = ["RayBackend"]

# Scheduled functions each worker actor keeps deserialized (most programs schedule a few).
_FUNCTIONS_KEPT = 256
# What a worker actor answers when asked to run a function it no longer has.
_MISSING = "__jstrategy_missing_function__"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "ParameterServerStrategy(backend='ray') needs Ray; install it with "
            "pip install 'jstrategy[ray]' (or pip install ray), or use backend='local'."
        ) from None
    return ray


# ---------------------------------------------------------------------------------------
# Actors (plain classes; wrapped with ray.remote when the backend starts)
# ---------------------------------------------------------------------------------------
class _ParameterServerActor:
    def __init__(self, ps_index: int):
        self._index = ps_index
        self._store = backend_lib.ArrayStore(jax.local_devices()[0])

    def ready(self) -> bool:
        return True

    def create(self, ids, values, tx_key, tx) -> None:
        self._store.create(ids, values, tx_key, tx)

    def read(self, ids) -> list[np.ndarray]:
        return [np.asarray(v) for v in jax.device_get(self._store.read(ids))]

    def read_opt_states(self, ids) -> list[Any]:
        return backend_lib.to_numpy(self._store.read_opt_states(ids))

    def assign_opt_states(self, ids, states) -> None:
        self._store.assign_opt_states(ids, states)

    def apply(self, ids, kind, args) -> None:
        self._store.apply(ids, kind, args)
        # Finish before acknowledging, so an acknowledged update is applied.
        jax.block_until_ready(self._store.read(ids))


class _WorkerActor:
    def __init__(self, worker_index: int, num_workers: int):
        device = jax.local_devices()[0]
        self._context = backend_lib.WorkerContext(worker_index, num_workers, device)
        self._table = backend_lib.ResourceTable(worker_index, num_workers, device)
        self._functions: collections.OrderedDict[int, Any] = collections.OrderedDict()

    def ready(self) -> bool:
        return True

    def run(self, fn_id, fn, args, kwargs, specs):
        # A function arrives once per actor and is kept: unpickling it again would give new
        # `jax.jit` wrappers, and every step would compile anew.
        functions = self._functions
        if fn is None:
            fn = functions.get(fn_id)
            if fn is None:
                return _MISSING
        functions[fn_id] = fn
        functions.move_to_end(fn_id)
        while len(functions) > _FUNCTIONS_KEPT:
            functions.popitem(last=False)
        table = self._table
        with backend_lib.worker_scope(self._context):
            table.sync(specs)
            args, kwargs = table.resolve((args, kwargs))
            result = fn(*args, **kwargs)
            return backend_lib.to_numpy(jax.block_until_ready(result))


# ---------------------------------------------------------------------------------------
# Clients and handles (coordinator side; store clients also travel to workers)
# ---------------------------------------------------------------------------------------
_STARTUP_S = 300.0


def _bounded_get(ray: Any, refs: Any, timeout: float | None, who: str) -> Any:
    """`ray.get` within the strategy's `timeout_seconds`: a task that hangs (an actor
    stuck, a node gone quiet) becomes a clear error instead of a wait without end."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"{who} did not answer within {timeout:g} s. Pass "
            "ParameterServerStrategy(..., timeout_seconds=...) to allow more time (None "
            "waits without bound)."
        ) from None


def _startup_bound(timeout: float | None) -> float | None:
    # A new actor is a new Python process that imports JAX: seconds on a busy machine,
    # however short the bound on calls is.
    return None if timeout is None else max(timeout, _STARTUP_S)


class RayStoreClient(backend_lib.StoreClient):
    """A parameter server that is a Ray actor; picklable (it holds the actor handle)."""

    def __init__(self, ps_index: int, actor: Any, timeout_seconds: float | None):
        self.ps_index = ps_index
        self.actor = actor
        self.timeout_seconds = timeout_seconds

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RayStoreClient) and other.ps_index == self.ps_index

    def __hash__(self) -> int:
        return hash(("ray-ps", self.ps_index))

    @staticmethod
    def _get(refs: Sequence[Any], clients: Sequence[RayStoreClient]) -> list[Any]:
        ray = _ray()
        out = []
        for ref, client in zip(refs, clients, strict=True):
            try:
                out.append(_bounded_get(ray, ref, client.timeout_seconds, f"ps:{client.ps_index}"))
            except ray.exceptions.RayActorError:
                raise backend_lib._unavailable(client.ps_index) from None
        return out

    def create(self, ids, values, tx_key, tx) -> None:
        self._get([self.actor.create.remote(list(ids), list(values), tx_key, tx)], [self])

    @classmethod
    def read_groups(cls, groups, device):
        clients = list(groups)
        refs = [c.actor.read.remote(groups[c]) for c in clients]
        values = cls._get(refs, clients)
        moved = jax.device_put(values, device)
        return dict(zip(clients, moved, strict=True))

    @classmethod
    def apply_groups(cls, groups, kind):
        clients = list(groups)
        # One transfer to the host for every group, then all groups in parallel.
        host = backend_lib.to_numpy([list(groups[c][1]) for c in clients])
        refs = [
            c.actor.apply.remote(list(groups[c][0]), kind, args)
            for c, args in zip(clients, host, strict=True)
        ]
        cls._get(refs, clients)

    def read_opt_states(self, ids):
        return self._get([self.actor.read_opt_states.remote(list(ids))], [self])[0]

    def assign_opt_states(self, ids, states):
        states = backend_lib.to_numpy(list(states))
        self._get([self.actor.assign_opt_states.remote(list(ids), states)], [self])

    def __repr__(self) -> str:
        return f"RayStoreClient(ps:{self.ps_index})"


class RayWorker(backend_lib.WorkerHandle):
    """One worker slot; a fresh actor replaces a dead one on `restart`."""

    def __init__(self, backend: RayBackend, index: int):
        self.index = index
        self._backend = backend
        self._built = 0
        self._sent: set[int] = set()
        self.actor, self._ready = backend._new_worker_actor(index)

    def execute(self, fn, args, kwargs, specs):
        ray = _ray()
        try:
            timeout, who = self._backend.timeout_seconds, f"worker:{self.index}"
            if self._ready is not None:
                _bounded_get(ray, self._ready, _startup_bound(timeout), who)
                self._ready = None
            fn_id = self._backend._function_id(fn)
            new_specs = list(specs[self._built :])
            result = _MISSING
            if fn_id in self._sent:
                ref = self.actor.run.remote(fn_id, None, args, kwargs, new_specs)
                result = _bounded_get(ray, ref, timeout, who)
            if isinstance(result, str) and result == _MISSING:  # not sent, or let go
                self._sent.add(fn_id)
                ref = self.actor.run.remote(fn_id, fn, args, kwargs, new_specs)
                result = _bounded_get(ray, ref, timeout, who)
        except ray.exceptions.RayActorError as e:
            raise backend_lib.WorkerFailureError(
                f"Worker {self.index} (a Ray actor) died: {type(e).__name__}"
            ) from e
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None
            raise
        self._built = len(specs)
        return result

    def restart(self) -> bool:
        ray = _ray()
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        try:
            self.actor, self._ready = self._backend._new_worker_actor(self.index)
        except Exception:
            return False
        self._built = 0
        self._sent = set()
        return True

    def simulate_failure(self, *, restart: bool = True) -> None:
        ray = _ray()
        ray.kill(self.actor, no_restart=True)
        if not restart:
            self._backend._no_restart.add(self.index)

    def shutdown(self) -> None:
        ray = _ray()
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


def _start_ray(ray: Any, address: str | None) -> None:
    """Joins the Ray cluster at `address` (or ``RAY_ADDRESS``), or starts a private one.

    A Ray cluster's processes (GCS, raylet, workers, agents) listen on its node's address,
    which Ray takes from the network, so a job meant for one machine listened on every
    interface. A local instance started here has node address 127.0.0.1 and no dashboard:
    everything listens on loopback only. Joining a cluster is the user's explicit choice,
    with the cluster's own settings.
    """
    if address is not None or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return
    with _loopback_node_address():
        ray.init(address="local", include_dashboard=False, log_to_driver=False)


@contextlib.contextmanager
def _loopback_node_address() -> Iterator[None]:
    """Makes a Ray node started meanwhile take 127.0.0.1 as its address.

    Ray gives a node the loopback address only where it does not support clusters
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, read into a private constant when Ray is
    imported) and otherwise rewrites an explicit ``127.0.0.1`` to the network address.
    This is the one place that touches Ray's internals; if they change, Ray's default
    stays.
    """
    variable = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    previous_env = os.environ.get(variable)
    os.environ[variable] = "0"  # read by the processes the node starts
    constants: Any = None
    with contextlib.suppress(ImportError):
        from ray._private import ray_constants as constants
    previous = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if previous is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if previous is not None:
            constants.ENABLE_RAY_CLUSTER = previous
        if previous_env is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = previous_env


def _node_ids_by_host(ray: Any) -> dict[str, str]:
    nodes = {}
    for node in ray.nodes():
        if node.get("Alive"):
            nodes[node["NodeManagerAddress"]] = node["NodeID"]
    return nodes


class RayBackend(backend_lib.Backend):
    """Parameter servers and workers as Ray actors.

    Args:
      num_workers: worker actors.
      num_ps: parameter-server actors.
      address: the Ray cluster to join; None joins ``RAY_ADDRESS`` if set, else starts a
        private local instance that listens on loopback only (see `_start_ray`).
      cluster_spec: the cluster; a task whose host resolves to a Ray node's address is
        placed on that node (softly: elsewhere if the node cannot take it).
    """

    def __init__(
        self,
        num_workers: int,
        num_ps: int,
        *,
        address: str | None,
        cluster_spec,
        timeout_seconds: float | None,
    ):
        ray = _ray()
        if not ray.is_initialized():
            _start_ray(ray, address)
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.timeout_seconds = timeout_seconds
        self._no_restart: set[int] = set()
        self._functions: collections.OrderedDict[int, tuple[int, Any]] = collections.OrderedDict()
        self._function_ids = itertools.count()
        self._functions_lock = threading.Lock()
        self._cluster_spec = cluster_spec
        self._nodes = _node_ids_by_host(ray)
        self._ps_cls = ray.remote(num_cpus=0, max_restarts=0)(_ParameterServerActor)
        self._worker_cls = ray.remote(num_cpus=0, max_restarts=0)(_WorkerActor)
        actors = [self._ps_cls.options(**self._placement("ps", i)).remote(i) for i in range(num_ps)]
        ready = [a.ready.remote() for a in actors]
        _bounded_get(ray, ready, _startup_bound(timeout_seconds), "the ps actors")
        self._stores = [RayStoreClient(i, a, timeout_seconds) for i, a in enumerate(actors)]

    def _placement(self, job: str, index: int) -> dict[str, Any]:
        try:
            host = self._cluster_spec.task_address(job, index).rsplit(":", 1)[0].strip("[]")
            ip = socket.gethostbyname(host)
        except (ValueError, OSError):
            return {}
        node_id = self._nodes.get(ip)
        if node_id is None:
            return {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)}

    def _function_id(self, fn: Any) -> int:
        """An id per scheduled function object; ids are never reused."""
        with self._functions_lock:
            known = self._functions.get(id(fn))
            if known is not None and known[1] is fn:
                self._functions.move_to_end(id(fn))
                return known[0]
            fn_id = next(self._function_ids)
            # The function is kept alive with its entry, so its id() is not reused meanwhile.
            self._functions[id(fn)] = (fn_id, fn)
            while len(self._functions) > _FUNCTIONS_KEPT:
                self._functions.popitem(last=False)
            return fn_id

    def _new_worker_actor(self, index: int) -> Any:
        _ray()
        if index in self._no_restart:
            raise RuntimeError(f"worker {index} is not restarted")
        actor = self._worker_cls.options(**self._placement("worker", index)).remote(
            index, self.num_workers
        )
        return actor, actor.ready.remote()

    def store(self, ps_index: int) -> RayStoreClient:
        return self._stores[ps_index]

    def worker(self, worker_index: int) -> RayWorker:
        return RayWorker(self, worker_index)

    def simulate_parameter_server_failure(self, ps_index: int) -> None:
        _ray().kill(self._stores[ps_index].actor, no_restart=True)

    def shutdown(self) -> None:
        ray = _ray()
        for store in self._stores:
            with contextlib.suppress(Exception):
                ray.kill(store.actor, no_restart=True)
