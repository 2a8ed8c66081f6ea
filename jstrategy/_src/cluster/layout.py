"""Where a process stands in a job: `training_process_layout`, a pure function of a resolver.

`join` passes its `ProcessLayout` to ``jax.distributed.initialize``; the parameter-server
strategy asks which tasks run on other hosts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Iterable

from jstrategy._src.cluster.rendezvous import is_loopback_host
from jstrategy._src.cluster.rendezvous import split_address
from jstrategy._src.cluster.resolver import ClusterResolver
from jstrategy._src.cluster.spec import CHIEF_TYPES
from jstrategy._src.cluster.spec import TRAINING_TYPES
from jstrategy._src.cluster.spec import ClusterSpec
from jstrategy._src.cluster.spec import validate_cluster
from jstrategy._src.cluster.tf_config import TFConfigClusterResolver

__all__ = ["ProcessLayout", "is_this_machine", "tasks_on_other_hosts", "training_process_layout"]


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """Where this process stands in the training collectives: ``jax.distributed``'s arguments.

    Attributes:
      coordinator_address: the ``"host:port"`` of process 0, which hosts JAX's coordination
        service: the chief's address if there is a chief, else worker 0's; None for a single
        local process (no cluster).
      num_processes: the number of training processes, chief plus workers (ps and evaluator
        tasks do not take part).
      process_id: this process's rank among them: the chief is 0, worker ``i`` is
        ``i + number of chiefs``; None for ps and evaluator tasks, which stay out of the
        training collectives; 0 for a single local process.
      is_chief: whether this process is the chief (or worker 0 when there is no chief), the
        one that writes checkpoints and summaries.
      task_type: this process's task type; None for a single local process.
      task_id: this process's index within its task type; None for a single local process.
      tasks: every training process as ``(task_type, task_index, "host:port")``, in process
        id order (the chief first, then the workers); empty for a single local process.

    Example:

    >>> from jstrategy.cluster_resolver import ClusterSpec, SimpleClusterResolver
    >>> from jstrategy.cluster_resolver import training_process_layout
    >>> spec = ClusterSpec({"chief": ["a:2222"], "worker": ["b:2222", "c:2222"]})
    >>> layout = training_process_layout(SimpleClusterResolver(spec, task_type="worker", task_id=1))
    >>> layout.coordinator_address, layout.num_processes, layout.process_id, layout.is_chief
    ('a:2222', 3, 2, False)
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int | None
    is_chief: bool
    task_type: str | None
    task_id: int | None
    tasks: tuple[tuple[str, int, str], ...] = ()


def training_process_layout(resolver: ClusterResolver) -> ProcessLayout:
    """Where the process `resolver` describes stands among the training processes.

    The multi-worker strategy passes ``coordinator_address``, ``num_processes`` and
    ``process_id`` to ``jax.distributed.initialize`` when ``num_processes > 1``. The cluster
    and task are validated first, as for ``TF_CONFIG``.

    Args:
      resolver: any `ClusterResolver`.

    Returns:
      A `ProcessLayout`. An empty cluster is one local process: no coordinator, one process,
      process id 0, chief.

    Raises:
      ValueError: if the cluster or this process's task is invalid (unknown job names, more
        than one chief, a task not in the cluster, ...).

    Example:

    >>> from jstrategy.cluster_resolver import SimpleClusterResolver, training_process_layout
    >>> cluster = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p:2222"]}
    >>> layout = training_process_layout(
    ...     SimpleClusterResolver(cluster, task_type="worker", task_id=1))
    >>> layout.coordinator_address, layout.num_processes, layout.process_id, layout.is_chief
    ('c:2222', 3, 2, False)
    """
    if not isinstance(resolver, ClusterResolver):
        raise TypeError(
            f"`resolver` must be a ClusterResolver such as TFConfigClusterResolver(); got "
            f"{type(resolver).__name__}: {resolver!r}."
        )
    spec = resolver.cluster_spec()
    task_type, task_id = resolver.task_type, resolver.task_id
    if not spec:
        return ProcessLayout(
            coordinator_address=None,
            num_processes=1,
            process_id=0,
            is_chief=True,
            task_type=task_type,
            task_id=task_id,
        )
    is_tf_config = isinstance(resolver, TFConfigClusterResolver)
    source = "TF_CONFIG" if is_tf_config else type(resolver).__name__
    validate_cluster(spec, task_type, task_id, source)
    for job in TRAINING_TYPES:
        if job in spec.jobs and spec.task_indices(job) != list(range(spec.num_tasks(job))):
            raise ValueError(
                f'{source} cluster lists the "{job}" job sparsely (task indices '
                f"{spec.task_indices(job)}), but every training process must know every other "
                f"to rank itself. List all {job} tasks, indices 0-{max(spec.task_indices(job))}."
            )
    chief_job = next((job for job in CHIEF_TYPES if job in spec.jobs), None)
    num_chiefs = 1 if chief_job is not None else 0
    num_workers = spec.num_tasks("worker") if "worker" in spec.jobs else 0
    coordinator = spec.task_address(chief_job or "worker", 0)

    process_id: int | None = None
    if task_type in CHIEF_TYPES:
        process_id = 0
    elif task_type == "worker":
        assert task_id is not None  # validate_cluster checked it.
        process_id = task_id + num_chiefs
    tasks = [(chief_job, 0, coordinator)] if chief_job is not None else []
    tasks += [("worker", i, spec.task_address("worker", i)) for i in range(num_workers)]
    return ProcessLayout(
        coordinator_address=coordinator,
        num_processes=num_chiefs + num_workers,
        process_id=process_id,
        is_chief=process_id == 0,
        task_type=task_type,
        task_id=task_id,
        tasks=tuple(tasks),
    )


def _this_machine() -> tuple[set[str], set[str]]:
    """This machine's host names (lower case) and the addresses they resolve to."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    addresses: set[str] = set()
    for name in names:
        with contextlib.suppress(OSError):  # a name that does not resolve gives no address
            addresses.update(socket.gethostbyname_ex(name)[2])
    return names, addresses


def is_this_machine(host: str) -> bool:
    """Whether `host` (a name or an address, as in a ``TF_CONFIG`` task) is this machine.

    True for ``localhost``, loopback addresses, this machine's host names, and names or
    addresses that resolve to one of those; a name that does not resolve is another host.

    Example:

    >>> is_this_machine("localhost"), is_this_machine("127.0.0.1"), is_this_machine("203.0.113.1")
    (True, True, False)
    """
    if is_loopback_host(host):
        return True
    names, addresses = _this_machine()
    if host.lower() in names or host in addresses:
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    resolved = {str(info[4][0]) for info in infos}
    return any(is_loopback_host(a) or a in addresses for a in resolved)


def tasks_on_other_hosts(spec: ClusterSpec, jobs: Iterable[str]) -> dict[str, list[str]]:
    """The hosts of `jobs`' tasks that are not this machine, each with its tasks.

    Args:
      spec: the cluster.
      jobs: the job names to look at (those `spec` lacks are skipped).

    Returns:
      ``{host: ["worker:0", ...]}`` in the order the tasks are listed; empty when every
      task is on this machine.

    Example:

    >>> spec = ClusterSpec({"worker": ["203.0.113.1:2222", "localhost:2223"]})
    >>> tasks_on_other_hosts(spec, ["worker", "ps"])
    {'203.0.113.1': ['worker:0']}
    """
    hosts: dict[str, list[str]] = {}
    local: dict[str, bool] = {}
    for job in jobs:
        if job not in spec.jobs:
            continue
        for index in spec.task_indices(job):
            host = split_address(spec.task_address(job, index))[0]
            if host not in local:
                local[host] = is_this_machine(host)
            if not local[host]:
                hosts.setdefault(host, []).append(f"{job}:{index}")
    return hosts
