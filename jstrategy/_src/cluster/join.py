"""Joining a multi-process job: the one place that starts JAX's distributed runtime.

Every strategy that spans processes (`MultiWorkerMirroredStrategy`, `FSDPStrategy`,
`ModelParallelStrategy`, `TPUStrategy` and `experimental_connect_to_cluster` on a multi-host
slice, `ParameterServerStrategy`'s chief) calls `join`, which does what a careful start
needs, once per process:

1. Validates the cluster (`training_process_layout`) and refuses to start after JAX's
   backends did, before any network activity.
2. Meets the other processes with a deadline (`rendezvous.meet`), so a missing task is
   named instead of hanging in ``jax.distributed.initialize``; a local job binds its
   coordination service and gloo's collectives to loopback only.
3. Starts the runtime (``jax.distributed.initialize``), with `timeout_seconds` bounding the
   rest of the start-up, the heartbeat, shutdown and CPU collectives.
4. Gives SIGTERM its default action back (JAX's preemption service takes it), registers the
   per-job translation of a failed collective into `PeerFailureError`, and sets the bound
   of jstrategy's own waits on the other workers (`coordination`).

A second `join` describing the same process returns the same `Cluster`; one that
contradicts the running runtime raises.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

import jax

from jstrategy._src import dispatch
from jstrategy._src import jax_compat
from jstrategy._src import validation
from jstrategy._src.cluster import coordination
from jstrategy._src.cluster import rendezvous
from jstrategy._src.cluster import signals
from jstrategy._src.cluster.layout import ProcessLayout
from jstrategy._src.cluster.layout import training_process_layout
from jstrategy._src.cluster.resolver import ClusterResolver
from jstrategy._src.cluster.tf_config import TFConfigClusterResolver

__all__ = ["Cluster", "PeerFailureError", "is_chief", "join"]


class PeerFailureError(RuntimeError):
    """A collective failed because another worker died or stopped responding.

    Raised in the surviving workers within the job's ``timeout_seconds``; catch it to stop
    (or to restart from the last checkpoint).

    Example:

    >>> import jstrategy
    >>> issubclass(jstrategy.PeerFailureError, RuntimeError)
    True
    """


_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The job this process joined, as `join` returns it.

    Attributes:
      process_id: this process's rank among the training processes (the chief is 0);
        None for a ps or evaluator task, which stays out of the training collectives.
      num_processes: how many training processes the job has (chief plus workers).
      task_type: this process's task type; None for a single local process.
      task_id: this process's index within its task type; None for a single local process.
      is_chief: whether this process is the chief (or worker 0 without a chief).
      coordinator_address: the ``"host:port"`` of process 0; None for a single local
        process, or where JAX found the job itself (a Cloud TPU slice).
      tasks: every training process as ``(task_type, task_index, "host:port")``.
      connected: whether JAX's distributed runtime connects this process to the others
        (so `jax.devices()` are every process's devices).

    Example:

    >>> from jstrategy.cluster_resolver import TFConfigClusterResolver, join
    >>> cluster = join(TFConfigClusterResolver())    # no TF_CONFIG: this process, nothing started
    >>> cluster.num_processes, cluster.is_chief, cluster.coordinator_address
    (1, True, None)
    """

    process_id: int | None
    num_processes: int
    task_type: str | None
    task_id: int | None
    is_chief: bool
    coordinator_address: str | None
    tasks: tuple[tuple[str, int, str], ...] = ()
    connected: bool = False

    @property
    def num_workers(self) -> int:
        """How many processes train together: `num_processes` when connected, else 1."""
        return self.num_processes if self.connected else 1

    def _translate_error(self, error: Exception) -> Exception | None:
        text = str(error)
        markers = ("Gloo", "gloo", "Connection reset", "heartbeat", "coordination", "NCCL", "peer")
        if not any(m in text for m in markers):
            return None
        message = (
            f"A collective failed on worker {self.task_type}:{self.task_id} (process "
            f"{self.process_id} of {self.num_processes}); another worker most likely died or "
            "stopped responding, or skipped this collective (every worker must run the same "
            "steps). Restart the job (with BackupAndRestore it resumes from the last backup). "
            f"Cause: {text.splitlines()[0]}"
        )
        # The runtime may terminate this process moments later; say why first.
        print(message, file=sys.stderr, flush=True)
        return PeerFailureError(message)


#: Every `Cluster` returned so far: equal descriptions get the same object.
_CLUSTERS: dict[Cluster, Cluster] = {}


def join(
    cluster_resolver: Any = None,
    *,
    timeout_seconds: float | None = None,
    start_runtime: bool = True,
) -> Cluster:
    """Joins the multi-process job `cluster_resolver` describes; idempotent.

    With several training processes (chief and workers) and this one among them, starts
    JAX's distributed runtime as the module docstring says; a single process (no
    ``TF_CONFIG``), or a ps or evaluator task, starts nothing. A TPU resolver (anything
    with ``num_hosts()``, such as `TPUClusterResolver`) spanning several hosts starts the
    runtime with JAX's own discovery of the slice (``jax.distributed.initialize()``).
    Call it (or create the strategy that calls it) before any other JAX computation.

    Args:
      cluster_resolver: a `ClusterResolver` or a `TPUClusterResolver`; defaults to
        `TFConfigClusterResolver()`.
      timeout_seconds: how long any wait on another process may last before it becomes an
        error (`CommunicationOptions.timeout_seconds`); None keeps the defaults (300 s to
        start, JAX's 100 s heartbeat, no bound on CPU collectives).
      start_runtime: False only describes and validates the job, starting nothing (the
        parameter-server chief, whose tasks are threads or Ray actors).

    Returns:
      The `Cluster`: the same object for every call that describes the same process.

    Raises:
      TypeError: if `cluster_resolver` is neither kind of resolver.
      ValueError: if the cluster is invalid, or `timeout_seconds` is not positive.
      RuntimeError: if the runtime must start after JAX's backends did, or is already
        running as another process of another job.
      ClusterStartupError: if the other processes do not all arrive in time.

    Example:

    >>> from jstrategy.cluster_resolver import SimpleClusterResolver, join
    >>> cluster = join(SimpleClusterResolver({}))  # one local process: nothing starts
    >>> cluster.num_processes, cluster.is_chief, cluster.connected
    (1, True, False)
    >>> join(SimpleClusterResolver({})) is cluster
    True
    """
    if timeout_seconds is not None:
        timeout_seconds = validation.check_positive_float(
            timeout_seconds, "timeout_seconds", "Pass e.g. timeout_seconds=60, or None."
        )
    validation.check_bool(start_runtime, "start_runtime")
    resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
    if isinstance(resolver, ClusterResolver):
        layout = training_process_layout(resolver)
        cluster = _describe(layout, connected=False)
        if start_runtime and layout.process_id is not None and layout.num_processes > 1:
            _start_runtime(layout, timeout_seconds)
            cluster = _describe(layout, connected=True)
    elif callable(getattr(resolver, "num_hosts", None)):
        cluster = _join_tpu_slice(resolver, timeout_seconds, start_runtime)
    else:
        raise TypeError(
            "`cluster_resolver` must be a jstrategy.cluster_resolver.ClusterResolver (e.g. "
            "TFConfigClusterResolver()) or a TPUClusterResolver; got "
            f"{type(resolver).__name__}: {resolver!r}."
        )
    if cluster.connected:
        dispatch.add_error_translator(cluster._translate_error)
        coordination.set_timeout_seconds(timeout_seconds)
    return _CLUSTERS.setdefault(cluster, cluster)


def is_chief(cluster: Cluster | None = None) -> bool:
    """Whether this process is the chief (or worker 0 without a chief): the one that writes
    what is written once (summaries, messages, the checkpoints' shared files).

    Read from `cluster`, by default the job this process joined (the last one `join`
    connected it to); a process that joined none is its own job's chief when it is JAX's
    process 0.

    Example:

    >>> is_chief()   # this process alone
    True
    """
    if cluster is None:
        cluster = next((c for c in reversed(_CLUSTERS) if c.connected), None)
    return cluster.is_chief if cluster is not None else jax.process_index() == 0


def _describe(layout: ProcessLayout, *, connected: bool) -> Cluster:
    """The `Cluster` of `layout` (whose fields it shares)."""
    return Cluster(**dataclasses.asdict(layout), connected=connected)


def _join_tpu_slice(resolver: Any, timeout_seconds: float | None, start_runtime: bool) -> Cluster:
    """A TPU slice: JAX finds its hosts and this host's rank itself (Cloud TPU metadata)."""
    hosts = int(resolver.num_hosts())
    task_id = getattr(resolver, "task_id", 0)
    if hosts <= 1 or not start_runtime:
        return Cluster(0 if hosts <= 1 else task_id, hosts, "worker", task_id, task_id == 0, None)
    if not _running(hosts, None):
        _refuse_after_backends()
        jax.distributed.initialize(**_runtime_timeouts(timeout_seconds))
        signals.take_sigterm_from_jax()
    rank = jax.process_index()
    return Cluster(rank, jax.process_count(), "worker", rank, rank == 0, None, connected=True)


def _running(num_processes: int, process_id: int | None) -> bool:
    """Whether JAX's runtime runs already, as this process (raises if as another)."""
    if jax_compat.distributed_client() is None:
        return False
    if jax.process_count() != num_processes or process_id not in (None, jax.process_index()):
        said = f"process {process_id} of" if process_id is not None else "a process of"
        raise RuntimeError(
            "JAX's distributed runtime is already running as process "
            f"{jax.process_index()} of {jax.process_count()}, but the cluster resolver "
            f"says {said} {num_processes}. One process joins one job: pass the resolver "
            "that describes the job it joined."
        )
    return True


def _refuse_after_backends() -> None:
    # Checked before meeting the others, who would otherwise wait for this process.
    if jax_compat.backends_started():
        raise RuntimeError(
            "Joining a multi-process job (MultiWorkerMirroredStrategy, FSDPStrategy, "
            "ModelParallelStrategy, TPUStrategy on several hosts, or "
            "jstrategy.cluster_resolver.join) must come before any other JAX computation "
            "in the program, because JAX's distributed runtime has to start before its "
            "backends. Move the strategy's creation earlier."
        )


def _runtime_timeouts(timeout: float | None) -> dict[str, Any]:
    """``jax.distributed.initialize``'s bounds for `timeout` (None: 300 s to start)."""
    # Without a setting, 300 s: JAX's own start-up timeout.
    startup = timeout if timeout is not None else coordination.DEFAULT_TIMEOUT_S
    kwargs: dict[str, Any] = {"initialization_timeout": max(1, math.ceil(startup))}
    if timeout is not None:
        kwargs["heartbeat_timeout_seconds"] = max(1, int(timeout))
        kwargs["shutdown_timeout_seconds"] = max(1, int(timeout))
        _bound_cpu_collectives(timeout)
    return kwargs


def _start_runtime(layout: ProcessLayout, timeout: float | None) -> None:
    if _running(layout.num_processes, layout.process_id):
        return
    _refuse_after_backends()
    assert layout.process_id is not None and layout.coordinator_address is not None
    startup_timeout = timeout if timeout is not None else coordination.DEFAULT_TIMEOUT_S
    # Only the address TF_CONFIG names, not every interface (JAX's default): one stray
    # connection to the coordination service can abort the whole job.
    bind_address = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or layout.coordinator_address
    rendezvous.meet(
        layout.tasks, layout.process_id, bind_address=bind_address, timeout=startup_timeout
    )
    own_host = rendezvous.split_address(layout.tasks[layout.process_id][2])[0]
    if rendezvous.is_loopback_host(own_host):
        # A local job's collectives stay on loopback too, whatever the hostname says.
        jax_compat.bind_cpu_collectives_to(own_host)
    # Everyone is here already; the start-up timeout bounds what is left of it.
    jax.distributed.initialize(
        coordinator_address=layout.coordinator_address,
        num_processes=layout.num_processes,
        process_id=layout.process_id,
        coordinator_bind_address=bind_address,
        **_runtime_timeouts(timeout),
    )
    # JAX's preemption service now holds SIGTERM, which then no longer stops the
    # process; it gets it only while something saves on preemption.
    signals.take_sigterm_from_jax()


def _bound_cpu_collectives(seconds: float) -> None:
    """Makes a cross-process collective on CPU (gloo) that waits `seconds` an error.

    A worker that is alive but never joins a collective (one worker skipped a step or a
    `reduce`) otherwise blocks the others until it exits. XLA reads its flags when the
    backend starts, which is after this. A flag the user set already wins.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _COLLECTIVE_TIMEOUT_FLAG in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} {_COLLECTIVE_TIMEOUT_FLAG}={max(1, math.ceil(seconds))}"
