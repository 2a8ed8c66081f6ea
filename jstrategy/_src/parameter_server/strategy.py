"""`ParameterServerStrategy`: variables on parameter servers, workers training asynchronously."""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jstrategy._src.cluster import coordination
from jstrategy._src.cluster import join as cluster_lib
from jstrategy._src.cluster.layout import tasks_on_other_hosts
from jstrategy._src.cluster.resolver import ClusterResolver
from jstrategy._src.cluster.simple import SimpleClusterResolver
from jstrategy._src.cluster.tf_config import TFConfigClusterResolver
from jstrategy._src.input.options import InputContext
from jstrategy._src.parameter_server import backend as backend_lib
from jstrategy._src.parameter_server import run_capture
from jstrategy._src.parameter_server import sharded_variable
from jstrategy._src.parameter_server.partitioners import Partitioner
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.strategy import Strategy
from jstrategy._src.validation import check_number
from jstrategy._src.values import is_per_replica

__all__ = ["Backend", "ParameterServerStrategy", "local_cluster_resolver"]


class Backend(enum.Enum):
    """Where the parameter servers and workers of a `ParameterServerStrategy` run.

    * ``LOCAL``: devices and threads of this process (the default).
    * ``RAY``: Ray actors, on one machine or a Ray cluster (``pip install 'jstrategy[ray]'``).

    Example:

    >>> from jstrategy.coordinator import Backend
    >>> Backend("ray") is Backend.RAY, Backend.LOCAL.value
    (True, 'local')
    """

    LOCAL = "local"
    RAY = "ray"


def local_cluster_resolver(num_workers: int = 2, num_ps: int = 1) -> Any:
    """A cluster resolver for a parameter-server cluster started by this process.

    The addresses are placeholders on localhost: the tasks are started by the strategy
    (threads, or Ray actors), not by you. This process is the ``"chief"`` (coordinator).

    Args:
      num_workers: how many workers.
      num_ps: how many parameter servers.

    Returns:
      A `SimpleClusterResolver` with jobs ``chief``, ``worker`` and ``ps``.

    Example:

    >>> resolver = local_cluster_resolver(num_workers=3, num_ps=2)
    >>> resolver.cluster_spec().num_tasks("worker"), resolver.task_type
    (3, 'chief')
    """

    for name, value in (("num_workers", num_workers), ("num_ps", num_ps)):
        check_number(value, name, integer=True, low=1)
    ports = itertools.count(20000)
    cluster = {
        "chief": [f"localhost:{next(ports)}"],
        "worker": [f"localhost:{next(ports)}" for _ in range(num_workers)],
        "ps": [f"localhost:{next(ports)}" for _ in range(num_ps)],
    }
    return SimpleClusterResolver(cluster, task_type="chief", task_id=0)


def _resolve_backend(backend: Backend | str) -> Backend:
    if isinstance(backend, Backend):
        return backend
    try:
        return Backend(str(backend).lower())
    except ValueError:
        raise ValueError(
            f"`backend` must be 'local' or 'ray' (or a jstrategy.coordinator.Backend); got "
            f"{backend!r}."
        ) from None


def _refuse_other_hosts(spec: Any) -> None:
    """The local backend runs every task on this machine: a cluster on other hosts is an
    error, never a silent single-machine run."""
    hosts = tasks_on_other_hosts(spec, ("worker", "ps"))
    if not hosts:
        return
    named = "; ".join(f"{host} ({', '.join(tasks)})" for host, tasks in hosts.items())
    raise ValueError(
        "ParameterServerStrategy(backend='local') runs every worker and ps task as a thread "
        f"of this process, on this machine's devices, but the cluster names other hosts: "
        f"{named}. To run the tasks on those hosts, start a Ray cluster with one node per "
        "host (`ray start --head` on this one, `ray start --address=<this host>:6379` on "
        "each of the others) and pass backend='ray', ray_address='auto': each task is placed "
        "on the Ray node at its host's address. To train on this machine alone, pass "
        f"jstrategy.coordinator.local_cluster_resolver(num_workers={spec.num_tasks('worker')}, "
        f"num_ps={spec.num_tasks('ps')})."
    )


class ParameterServerStrategy(Strategy):
    """Asynchronous data parallelism with variables on parameter servers, as TF's.

    The cluster (from `cluster_resolver`, e.g. ``TF_CONFIG``) has ``worker`` and ``ps``
    tasks; this process is the coordinator (the ``chief``). Variables created with
    `create_variables` are placed on the parameter servers round-robin (split into shards
    by `variable_partitioner`); a `ClusterCoordinator` schedules training functions on the
    workers, each of which pulls the current variables, computes an update on its own
    device and pushes it to the parameter servers, which apply it at once, without any
    barrier between workers.

    With ``backend="local"`` (the default) the tasks are devices and threads of this
    process: parameter server ``i`` is local device ``i`` and worker ``j`` is device
    ``num_ps + j`` (wrapping around when there are fewer devices), so with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` every task has its own CPU
    device; a cluster whose worker or ps tasks name other hosts is refused (it would train
    on this machine alone). With ``backend="ray"`` every parameter server and worker is a
    Ray actor, in the Ray cluster at `ray_address` (or the one this process already joined,
    or a new local one that listens on 127.0.0.1 only); a task whose ``TF_CONFIG`` host is
    a Ray node's address is placed there.

    Inside a scheduled function, `run` runs on the executing worker's device and
    `num_replicas_in_sync` is 1 (one replica per worker, as TF's CPU workers). Outside,
    the strategy behaves as a one-device strategy on the coordinator's device (worker 0's
    device locally), which is where `jstrategy.Model` evaluates and predicts.

    Args:
      cluster_resolver: describes the cluster; it needs at least one ``worker`` and one
        ``ps`` task, and this process must be the ``chief`` (or have no task type). None
        reads ``TF_CONFIG``. For a cluster started here, `local_cluster_resolver`.
      variable_partitioner: a `jstrategy.experimental.partitioners.Partitioner` (or any
        callable ``(shape, dtype) -> [num_shards, 1, ...]``) that splits variables along
        their first axis; None keeps every variable whole.
      backend: ``"local"`` or ``"ray"`` (see `Backend`).
      ray_address: the Ray cluster to join with the Ray backend (``"auto"`` for the one
        running on this machine, or ``"ray://host:10001"``); None joins ``RAY_ADDRESS`` if
        set, else starts a private local instance on loopback, without dashboard.
      timeout_seconds: how long `Model.fit` waits for the workers to finish an epoch's
        steps, and the Ray backend for any worker or parameter-server call, before a
        `TimeoutError` (default 300 s; None waits without bound).

    Raises:
      ValueError: if the cluster has no worker or no ps task, or this process is a
        worker or ps task (those are started by the coordinator here), or, with the local
        backend, the cluster's worker or ps tasks are on other hosts.
      ImportError: with ``backend="ray"`` when Ray is not installed.

    Example:

    >>> import jax.numpy as jnp
    >>> import jstrategy
    >>> from jstrategy.coordinator import local_cluster_resolver
    >>> from jstrategy.experimental.partitioners import FixedShardsPartitioner
    >>> strategy = jstrategy.ParameterServerStrategy(
    ...     local_cluster_resolver(num_workers=2, num_ps=2),
    ...     variable_partitioner=FixedShardsPartitioner(2))
    >>> variables = strategy.create_variables({"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)})
    >>> w = variables.variables["w"]
    >>> [s.shape for s in w.shards], [s.ps_task for s in w.shards]
    ([(3, 3), (2, 3)], [0, 1])
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        variable_partitioner: Partitioner | Callable[..., Sequence[int]] | None = None,
        *,
        backend: Backend | str = Backend.LOCAL,
        ray_address: str | None = None,
        timeout_seconds: float | None = coordination.DEFAULT_TIMEOUT_S,
    ):

        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        if not isinstance(resolver, ClusterResolver):
            raise TypeError(
                "`cluster_resolver` must be a jstrategy.cluster_resolver.ClusterResolver "
                f"(e.g. TFConfigClusterResolver()); got {type(resolver).__name__}."
            )
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "`variable_partitioner` must be a Partitioner such as "
                "FixedShardsPartitioner(2), or None; got "
                f"{type(variable_partitioner).__name__}."
            )
        spec = resolver.cluster_spec()
        jobs = spec.jobs
        num_workers = spec.num_tasks("worker") if "worker" in jobs else 0
        num_ps = spec.num_tasks("ps") if "ps" in jobs else 0
        if num_workers < 1 or num_ps < 1:
            raise ValueError(
                "ParameterServerStrategy needs at least one worker and one ps task; the "
                f"cluster has {num_workers} worker and {num_ps} ps tasks ({spec.as_dict()}). "
                "Set TF_CONFIG's cluster, or pass "
                "jstrategy.coordinator.local_cluster_resolver(num_workers=2, num_ps=1)."
            )
        task_type = resolver.task_type
        if task_type not in (None, "chief", "master"):
            raise ValueError(
                "ParameterServerStrategy runs on the coordinator only: TF_CONFIG's task must be "
                f"{{'type': 'chief', 'index': 0}}, and this process is task "
                f"{task_type!r}:{resolver.task_id}. In TF, worker and ps tasks do not run the "
                "training program: they run tf.distribute.Server(...).join() and wait. Here "
                "the coordinator starts the workers and parameter servers itself: as threads "
                "of its own process (backend='local'), or as Ray actors on the hosts TF_CONFIG "
                "names (backend='ray'). So on a worker or ps host, run `ray start "
                "--address=<the Ray head's host>:6379` (the counterpart of server.join()) "
                "instead of this program, and run this program once, as the chief."
            )
        # The chief's view of the job, validated as every strategy's; its tasks are threads
        # or Ray actors, not JAX processes, so no runtime starts. A coordinator that names
        # no task (as TF allows) has no place in the job to describe.
        self._cluster = (
            cluster_lib.join(resolver, start_runtime=False) if task_type is not None else None
        )
        self._backend_kind = _resolve_backend(backend)
        if self._backend_kind is Backend.LOCAL:
            _refuse_other_hosts(spec)
        if timeout_seconds is not None:
            timeout_seconds = check_number(
                timeout_seconds,
                "timeout_seconds",
                low=0,
                low_open=True,
                expected="a positive number of seconds or None",
                fix="E.g. timeout_seconds=600 bounds each wait on a worker or parameter server "
                "at 10 minutes.",
            )
        self._timeout_seconds = timeout_seconds
        self._cluster_resolver = resolver
        self._variable_partitioner = variable_partitioner
        self._num_workers = num_workers
        self._num_ps = num_ps
        self._variable_count = 0
        self._count_lock = threading.Lock()
        self._coordinator: Any = None
        self._worker_strategies: dict[Any, Strategy] = {}
        self._capture = run_capture.RunCapture()
        self._remote = False
        if self._backend_kind is Backend.LOCAL:
            self._backend: backend_lib.Backend = backend_lib.LocalBackend(num_workers, num_ps, self)
            coordinator_device = self._backend.worker_devices[0]
        else:
            # Ray is an optional dependency: its backend loads only when asked for.
            from jstrategy._src.parameter_server import ray_backend

            self._backend = ray_backend.RayBackend(
                num_workers,
                num_ps,
                address=ray_address,
                cluster_spec=spec,
                timeout_seconds=self._timeout_seconds,
            )
            coordinator_device = jax.local_devices()[0]
        super().__init__([coordinator_device])

    # Properties -------------------------------------------------------------------------
    @property
    def timeout_seconds(self) -> float | None:
        """The bound of every wait on a worker or parameter server (None: no bound)."""
        return self._timeout_seconds

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver this strategy was built from."""
        return self._cluster_resolver

    @property
    def variable_partitioner(self) -> Any:
        return self._variable_partitioner

    @property
    def backend(self) -> Backend:
        return self._backend_kind

    @property
    def num_workers(self) -> int:
        """How many worker tasks the cluster has."""
        return self._num_workers

    @property
    def num_ps(self) -> int:
        """How many parameter-server tasks the cluster has."""
        return self._num_ps

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """The local backend's worker devices, in worker order (empty with Ray)."""
        return tuple(getattr(self._backend, "worker_devices", ()))

    @property
    def parameter_devices(self) -> tuple[jax.Device, ...]:
        """The local backend's parameter-server devices, in task order (empty with Ray)."""
        return tuple(getattr(self._backend, "ps_devices", ()))

    def _require_backend(self) -> backend_lib.Backend:
        if self._remote:
            raise RuntimeError(
                "This is a worker's copy of the ParameterServerStrategy; variables and "
                "coordinators are created on the coordinator only."
            )
        return self._backend

    # Variables ----------------------------------------------------------------------------
    def _next_ps(self) -> int:
        with self._count_lock:
            index = self._variable_count % self._num_ps
            self._variable_count += 1
        return index

    def create_variables(
        self, tree: Any, *, optimizer: optax.GradientTransformation | None = None
    ) -> sharded_variable.VariableTree:
        """Places every leaf of `tree` on the parameter servers.

        Leaves go to the parameter servers round-robin, in the tree's flattening order,
        continuing from the previous call (as TF creates variables). With a
        `variable_partitioner`, a leaf of rank >= 1 that it splits becomes a
        `ShardedVariable` whose shards go round-robin too. With `optimizer`, each variable
        (or shard) gets its optimizer state, kept beside it on its parameter server.

        Args:
          tree: a pytree of arrays (e.g. Flax params, or ``{"params": ..., "step": ...}``).
          optimizer: an optax transformation for `VariableTree.apply_gradients`; it runs
            per variable on the parameter servers (see `VariableTree`).

        Returns:
          A `VariableTree`: `read` pulls values, `apply_gradients` pushes gradients.

        Raises:
          TypeError: if a leaf is not numeric or `optimizer` is not an optax transformation.
          ValueError: if the partitioner returns an invalid result.
        """
        backend = self._require_backend()
        if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                "`optimizer` must be an optax.GradientTransformation such as optax.adam(1e-3), "
                f"or None; got {type(optimizer).__name__}."
            )
        stores = [backend.store(i) for i in range(self._num_ps)]
        return sharded_variable.build_variable_tree(
            tree,
            stores=stores,
            next_ps=self._next_ps,
            partitioner=self._variable_partitioner,
            optimizer=optimizer,
            coordinator_device=self.devices[0],
        )

    # Running on workers -------------------------------------------------------------------
    def worker_strategy(self, device: jax.Device) -> Strategy:
        """The one-replica strategy on a worker's `device`: `run` inside a scheduled
        function, and `Model.fit`'s steps there, run on it."""
        strategy = self._worker_strategies.get(device)
        if strategy is None:
            strategy = self._worker_strategies.setdefault(device, Strategy([device]))
        return strategy

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None):
        """Runs `fn` on the executing worker's device (inside a scheduled function).

        Outside a scheduled function it runs on the coordinator's device. `fn` is compiled
        as in `Strategy.run`, and may read and update parameter-server variables as in TF's
        tutorial: ``variables.read()`` inside it gives the current values at every call
        (they are pulled before the compiled program runs), and ``apply_gradients``,
        ``assign``, ``assign_add`` and ``assign_sub`` push this call's values after it
        runs, in the order `fn` made them. Reading a variable after updating it in the same
        call is an error (the read could not see the update). A function defined inside
        the scheduled function, as TF's ``replica_fn``, is compiled once as long as it
        closes over the same objects at every call; pass per-call values as `args`.

        Args:
          fn: the per-replica function (one replica: this worker).
          args: positional arguments for `fn`.
          kwargs: keyword arguments for `fn`.

        Returns:
          `fn`'s outputs, as `Strategy.run`'s; `reduce` them with this strategy.

        Example:

        >>> import jax, jax.numpy as jnp, optax
        >>> import jstrategy
        >>> from jstrategy.coordinator import ClusterCoordinator, local_cluster_resolver
        >>> strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1))
        >>> variables = strategy.create_variables({"w": jnp.ones(3)}, optimizer=optax.sgd(0.5))
        >>> coordinator = ClusterCoordinator(strategy)
        >>> def step_fn(x):
        ...     def replica_fn(x):
        ...         loss, grads = jax.value_and_grad(
        ...             lambda p: jnp.sum(p["w"] * x))(variables.read())
        ...         variables.apply_gradients(grads)
        ...         return loss
        ...     losses = strategy.run(replica_fn, args=(x,))
        ...     return strategy.reduce("SUM", losses, axis=None)
        >>> losses = [coordinator.schedule(step_fn, args=(jnp.ones(3),)) for _ in range(2)]
        >>> coordinator.join()
        >>> variables.numpy()["w"].tolist(), [float(v.fetch()) for v in losses]
        ([0.0, 0.0, 0.0], [3.0, 1.5])
        >>> coordinator.shutdown()
        """
        worker = backend_lib.current_worker()
        if worker is None:
            return self._capture.run(super().run, fn, args, kwargs)
        return self._capture.run(self.worker_strategy(worker.device).run, fn, args, kwargs)

    # Input: inside a per-worker dataset function, as in TF's tutorial ----------------------
    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[Any], Any],
        options: Any = None,
        *,
        global_batch_size: int | None = None,
    ) -> Any:
        """Builds input pipelines with `dataset_fn(InputContext)`; see `Strategy`'s.

        Inside the function given to `ClusterCoordinator.create_per_worker_dataset` (TF's
        ``per_worker_dataset_fn``), it builds the executing worker's pipeline: `dataset_fn`
        gets the worker's `InputContext` (``input_pipeline_id`` is the worker's index, out
        of ``num_workers`` pipelines, one replica each) and the batches land on the worker's
        device. Elsewhere it is `Strategy.distribute_datasets_from_function` on the
        coordinator's device.
        """
        worker = backend_lib.current_worker()
        if worker is None or not callable(dataset_fn):
            return super().distribute_datasets_from_function(
                dataset_fn, options, global_batch_size=global_batch_size
            )

        context = InputContext(
            num_input_pipelines=worker.num_workers,
            input_pipeline_id=worker.worker_index,
            num_replicas_in_sync=1,
        )
        return self.worker_strategy(worker.device).distribute_datasets_from_function(
            lambda _: dataset_fn(context), options, global_batch_size=global_batch_size
        )

    def experimental_distribute_dataset(
        self, dataset: Any, options: Any = None, *, global_batch_size: int | None = None
    ) -> Any:
        """Distributes an iterable of batches; see `Strategy.experimental_distribute_dataset`.

        Inside a per-worker dataset function it is the executing worker's pipeline, on the
        worker's device (each worker iterates the dataset it was given: shard it there).
        """
        worker = backend_lib.current_worker()
        target = self if worker is None else self.worker_strategy(worker.device)
        return Strategy.experimental_distribute_dataset(
            target, dataset, options, global_batch_size=global_batch_size
        )

    # Every replica context of this strategy has one replica (a worker, or the
    # coordinator's device), so reducing and gathering are local: no collective program.
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines `run`'s per-replica values, as `Strategy.reduce` (one replica per worker).

        Inside a scheduled function it reduces the executing worker's values, on its device,
        as TF's ``strategy.reduce`` in the tutorial's ``step_fn``.
        """
        op = ReduceOp.from_value(reduce_op)

        def one(leaf: Any) -> Any:
            x = sharded_variable.only_replica(leaf)
            if axis is None:
                return x if isinstance(x, jax.Array) else jnp.asarray(x)
            return jnp.sum(x, axis) if op is ReduceOp.SUM else jnp.mean(x, axis)

        return jax.tree.map(one, value, is_leaf=is_per_replica)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' values along `axis`: with one replica, its value."""

        def one(leaf: Any) -> Any:
            x = jnp.asarray(sharded_variable.only_replica(leaf))
            if not -x.ndim <= axis < x.ndim:
                raise ValueError(
                    f"`axis` must index each replica's value of rank {x.ndim}; got axis={axis}."
                )
            return x

        return jax.tree.map(one, value, is_leaf=is_per_replica)

    # Hooks (see `Strategy`) ---------------------------------------------------------------
    @property
    def should_use_with_coordinator(self) -> bool:
        """True: `jstrategy.Model.fit` schedules one step per batch on the workers (each
        pulls the variables, computes its gradients and pushes them to the ps)."""
        return True

    def restore_variables(self, read: Callable[[Strategy | None], Any]) -> Any:
        """A checkpoint saved under any strategy lands on the parameter servers, round-robin
        and partitioned (read to the host first)."""
        return self.create_variables(read(None))

    def __reduce__(self):
        # Scheduled functions that use the strategy travel to Ray workers; there it is a
        # copy that runs `run` on the worker's device.
        return (_worker_copy, (self._num_workers, self._num_ps, self._backend_kind.value))

    def __repr__(self) -> str:
        return (
            f"ParameterServerStrategy(num_workers={self._num_workers}, num_ps={self._num_ps}, "
            f"backend={self._backend_kind.value!r})"
        )


def _worker_copy(num_workers: int, num_ps: int, backend: str) -> ParameterServerStrategy:
    strategy = ParameterServerStrategy.__new__(ParameterServerStrategy)
    strategy._backend_kind = Backend(backend)
    strategy._timeout_seconds = None
    strategy._num_workers = num_workers
    strategy._num_ps = num_ps
    strategy._cluster_resolver = None  # type: ignore[assignment]
    strategy._variable_partitioner = None
    strategy._coordinator = None
    strategy._worker_strategies = {}
    strategy._capture = run_capture.RunCapture()
    strategy._remote = True
    Strategy.__init__(strategy, [jax.local_devices()[0]])
    return strategy
