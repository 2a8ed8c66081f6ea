"""`ClusterSpec`: the addresses of a job's tasks, and the checks of a cluster and a task.

Everything here is validated when it is constructed, before any network activity, so a
misconfigured job fails at once with a message that says what to fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from jstrategy._src.validation import is_int

__all__ = [
    "CHIEF_TYPES",
    "EXAMPLE_TF_CONFIG",
    "TASK_TYPES",
    "TRAINING_TYPES",
    "ClusterSpec",
    "format_master_url",
    "quoted",
    "validate_cluster",
]

# The task types TF's multi-worker utilities accept; "master" is TF1/Estimator's name for the
# chief and is treated as one.
TASK_TYPES = ("chief", "evaluator", "master", "ps", "worker")
CHIEF_TYPES = ("chief", "master")
# Task types that take part in the training collectives, in process-id order.
TRAINING_TYPES = ("chief", "master", "worker")

_JOB_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_ADDRESS = re.compile(r"^(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>\d+)$")
EXAMPLE_TF_CONFIG = (
    '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}'
)


def quoted(names: Iterable[str]) -> str:
    """`names`, each in double quotes, comma-separated: how messages list jobs."""
    return ", ".join(f'"{name}"' for name in names)


def _check_address(address: Any, where: str) -> str:
    if not isinstance(address, str):
        raise TypeError(
            f'{where} must be a "host:port" string; got {address!r} '
            f"({type(address).__name__}). Write the address as a string such as "
            f'"host0:2222".'
        )
    match = _ADDRESS.match(address)
    if match is None:
        hint = 'Write it as "host:port", e.g. "host0:2222" or "[::1]:2222" for IPv6'
        if "://" in address:
            hint += " (without a protocol prefix: pass the protocol as rpc_layer)"
        raise ValueError(f'{where} must be a "host:port" address; got {address!r}. {hint}.')
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise ValueError(
            f"{where} has port {port}, which is not a usable port; got {address!r}. "
            f"Use a port in 1-65535."
        )
    return address


def _check_index(index: Any, where: str) -> int:
    if isinstance(index, str) and index.isdigit():
        # JSON object keys are always strings, so a sparse job read from TF_CONFIG has them.
        return int(index)
    if not is_int(index) or index < 0:
        raise ValueError(
            f"{where} task indices must be non-negative ints; got {index!r}. "
            f'Key a sparse job by task index, e.g. {{"worker": {{0: "host0:2222"}}}}.'
        )
    return index


class ClusterSpec:
    """The addresses of every task of a multi-worker job, by job name, as ``tf.train.ClusterSpec``.

    Args:
      cluster: ``{job_name: [address, ...]}`` (task ``i`` is the i-th address),
        ``{job_name: {task_index: address}}`` (sparse: some indices absent), another
        `ClusterSpec`, or None / ``{}`` for an empty cluster (a single local process).
        Addresses are ``"host:port"`` strings.

    Raises:
      TypeError: if `cluster`, a job's tasks or an address has the wrong type.
      ValueError: if a job name, task index or address is malformed, or a job has no tasks.

    Example:

    >>> from jstrategy.cluster_resolver import ClusterSpec
    >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "ps": {1: "ps1:2222"}})
    >>> spec.jobs
    ['ps', 'worker']
    >>> spec.num_tasks("worker"), spec.task_indices("ps"), spec.job_tasks("ps")
    (2, [1], [None, 'ps1:2222'])
    >>> spec.as_dict()
    {'ps': {1: 'ps1:2222'}, 'worker': ['w0:2222', 'w1:2222']}
    """

    def __init__(self, cluster: ClusterSpec | Mapping[str, Any] | None = None):
        if cluster is None:
            cluster = {}
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, dict[int, str]] = {
                job: dict(tasks) for job, tasks in cluster._jobs.items()
            }
            return
        if not isinstance(cluster, Mapping):
            raise TypeError(
                f"`cluster` must be a dict mapping job names to lists (or dicts keyed by task "
                f"index) of 'host:port' addresses, a ClusterSpec, or None; got "
                f"{type(cluster).__name__}: {cluster!r}."
            )
        jobs: dict[str, dict[int, str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not _JOB_NAME.match(job):
                raise ValueError(
                    f"`cluster` job names must be identifiers such as 'worker' or 'ps'; "
                    f"got {job!r}."
                )
            where = f"job {job!r}"
            if isinstance(tasks, Mapping):
                parsed = {
                    _check_index(index, where): _check_address(
                        address, f"{where} task {index!r} address"
                    )
                    for index, address in tasks.items()
                }
            elif isinstance(tasks, (list, tuple)):
                parsed = {
                    i: _check_address(address, f"{where} task {i} address")
                    for i, address in enumerate(tasks)
                }
            else:
                raise TypeError(
                    f"{where} must list its tasks as a list of 'host:port' addresses or a dict "
                    f"{{task_index: address}}; got {type(tasks).__name__}: {tasks!r}."
                )
            if not parsed:
                raise ValueError(
                    f"{where} has no tasks; got {tasks!r}. List at least one 'host:port' "
                    f"address or remove the job."
                )
            jobs[job] = dict(sorted(parsed.items()))
        self._jobs = dict(sorted(jobs.items()))

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """The cluster as a dict: a list per dense job, ``{index: address}`` per sparse job."""
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            if list(tasks) == list(range(len(tasks))):
                result[job] = list(tasks.values())
            else:
                result[job] = dict(tasks)
        return result

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def _tasks(self, job_name: str) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except KeyError:
            raise ValueError(
                f"No job {job_name!r} in the cluster; its jobs are {self.jobs}."
            ) from None

    def num_tasks(self, job_name: str) -> int:
        """The number of tasks of `job_name`.

        Raises:
          ValueError: if the cluster has no such job.
        """
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The sorted task indices of `job_name`.

        Raises:
          ValueError: if the cluster has no such job.
        """
        return list(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The ``"host:port"`` address of task `task_index` of `job_name`.

        Raises:
          ValueError: if the cluster has no such job or task.
        """
        tasks = self._tasks(job_name)
        try:
            return tasks[task_index]
        except (KeyError, TypeError):
            raise ValueError(
                f"Job {job_name!r} has no task {task_index!r}; its task indices are {list(tasks)}."
            ) from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The addresses of `job_name` by task index, None where a sparse job has no task.

        Raises:
          ValueError: if the cluster has no such job.
        """
        tasks = self._tasks(job_name)
        return [tasks.get(i) for i in range(max(tasks) + 1)]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            try:
                other = ClusterSpec(other)
            except (TypeError, ValueError):
                return False
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._jobs == other._jobs

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def format_master_url(address: str, rpc_layer: str | None) -> str:
    return f"{rpc_layer}://{address}" if rpc_layer else address


def _fix_task(source: str, task_type: Any = "worker", index: Any = "...") -> str:
    if source == "TF_CONFIG":
        return f'Fix "task": {{"type": {json.dumps(task_type)}, "index": {index}}}.'
    return "Fix task_type/task_id."


def validate_cluster(spec: ClusterSpec, task_type: Any, task_id: Any, source: str) -> None:
    """Checks a non-empty cluster and this process's task; messages start with `source`."""
    unknown = [job for job in spec.jobs if job not in TASK_TYPES]
    if unknown:
        raise ValueError(
            f"{source} cluster has unknown job {quoted(unknown)}; the known task types are "
            f"{quoted(TASK_TYPES)}. Rename the job."
        )
    chiefs = [(job, i) for job in CHIEF_TYPES if job in spec.jobs for i in spec.task_indices(job)]
    if len(chiefs) > 1:
        listed = ", ".join(f'"{job}" task {i}' for job, i in chiefs)
        raise ValueError(
            f"{source} cluster has {len(chiefs)} chief tasks ({listed}); there can be at most "
            f'one ("master" is another name for "chief"). Make the others "worker" tasks.'
        )
    if "evaluator" in spec.jobs and spec.num_tasks("evaluator") > 1:
        raise ValueError(
            f'{source} cluster has {spec.num_tasks("evaluator")} "evaluator" tasks '
            f"({spec.job_tasks('evaluator')}); there can be at most one. Remove the others."
        )
    if not any(job in spec.jobs for job in TRAINING_TYPES):
        raise ValueError(
            f"{source} cluster has no chief or worker task to train (its jobs are "
            f'{quoted(spec.jobs)}). Add a "worker" job listing the training processes.'
        )
    seen: dict[str, tuple[str, int]] = {}
    for job in spec.jobs:
        for i in spec.task_indices(job):
            address = spec.task_address(job, i)
            if address in seen:
                first_job, first_i = seen[address]
                raise ValueError(
                    f'{source} cluster uses address "{address}" for both "{first_job}" task '
                    f'{first_i} and "{job}" task {i}; every task needs its own "host:port". '
                    f"Give each task a distinct port or host."
                )
            seen[address] = (job, i)

    if task_type is None:
        raise ValueError(
            f"{source} has a cluster (jobs {quoted(spec.jobs)}) but no task type: every process "
            f"of a multi-worker job must say which task it is. {_fix_task(source)}"
        )
    if not isinstance(task_type, str) or task_type not in TASK_TYPES:
        raise ValueError(
            f"{source} task type {task_type!r} is not a known task type; expected one of "
            f"{quoted(TASK_TYPES)}. {_fix_task(source)}"
        )
    if task_id is None:
        raise ValueError(
            f'{source} task of type "{task_type}" has no index. {_fix_task(source, task_type)}'
        )
    if not is_int(task_id):
        # Suggest the int that was probably meant: "1" or 1.0.
        digits = isinstance(task_id, str) and task_id.strip().isdigit()
        whole = isinstance(task_id, float) and task_id.is_integer() and task_id >= 0
        meant = str(int(task_id)) if digits or whole else "..."
        raise ValueError(
            f"{source} task index must be an int; got {task_id!r} ({type(task_id).__name__}). "
            f"{_fix_task(source, task_type, meant)}"
        )
    if task_id < 0:
        raise ValueError(
            f"{source} task index must be non-negative; got {task_id}. "
            f"{_fix_task(source, task_type)}"
        )
    if task_type == "evaluator" and task_id != 0:
        raise ValueError(
            f"{source} task index {task_id} is invalid for the evaluator: there is at most one "
            f"evaluator, with index 0. {_fix_task(source, task_type)}"
        )
    if task_type not in spec.jobs:
        # TF lets the evaluator stay out of the cluster: nobody connects to it.
        if task_type == "evaluator":
            return
        raise ValueError(
            f'{source} task type "{task_type}" is not in the cluster, whose jobs are '
            f'{quoted(spec.jobs)}. Add a "{task_type}" job to the cluster, or fix this '
            f"process's task type (one of {quoted(spec.jobs)})."
        )
    indices = spec.task_indices(task_type)
    if task_id not in indices:
        count = len(indices)
        plural = "task" if count == 1 else "tasks"
        if indices == list(range(count)):
            have = f"indices 0-{count - 1}" if count > 1 else "index 0"
        else:
            have = f"indices {', '.join(map(str, indices))}"
        raise ValueError(
            f"{source} task index {task_id} is out of range: the cluster has {count} "
            f'"{task_type}" {plural} ({have}). {_fix_task(source, task_type)}'
        )
