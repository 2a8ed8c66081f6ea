"""Cluster resolvers: who the processes of a multi-worker job are, and which one this is.

As in ``tf.distribute.cluster_resolver``: a `ClusterSpec` maps job names (``"chief"``,
``"worker"``, ``"ps"``, ``"evaluator"``) to the ``"host:port"`` addresses of their tasks, and a
`ClusterResolver` says which task the current process is. `training_process_layout` turns a
resolver into what ``jax.distributed.initialize`` needs.

Everything here is validated when it is constructed, before any network activity, so a
misconfigured job fails at once with a message that says what to fix instead of hanging in a
rendezvous. Nothing here initializes a JAX backend except `ClusterResolver.num_accelerators`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import itertools
import json
import os
import re
import socket
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from jstrategy._src.rendezvous import is_loopback_host
from jstrategy._src.rendezvous import split_address

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "ProcessLayout",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "is_this_machine",
    "tasks_on_other_hosts",
    "training_process_layout",
]

# The task types TF's multi-worker utilities accept; "master" is TF1/Estimator's name for the
# chief and is treated as one.
TASK_TYPES = ("chief", "evaluator", "master", "ps", "worker")
_CHIEF_TYPES = ("chief", "master")
# Task types that take part in the training collectives, in process-id order.
_TRAINING_TYPES = ("chief", "master", "worker")

_JOB_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_ADDRESS = re.compile(r"^(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>\d+)$")
_EXAMPLE_TF_CONFIG = (
    '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}'
)


def _quoted(names: Iterable[str]) -> str:
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
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
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


def _format_master_url(address: str, rpc_layer: str | None) -> str:
    return f"{rpc_layer}://{address}" if rpc_layer else address


# JAX's platform names for accelerators, in TF's device-type names.
_ACCELERATOR_TYPES = {"gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}


class ClusterResolver(abc.ABC):
    """Base class of cluster resolvers, as ``tf.distribute.cluster_resolver.ClusterResolver``.

    Subclasses implement `cluster_spec` and `master`, and set ``_task_type``, ``_task_id``
    and ``_rpc_layer`` (or override the properties).

    Example:

    >>> from jstrategy.cluster_resolver import ClusterResolver, TFConfigClusterResolver
    >>> resolver = TFConfigClusterResolver()          # without TF_CONFIG: no cluster
    >>> isinstance(resolver, ClusterResolver), resolver.cluster_spec().as_dict()
    (True, {})
    """

    _task_type: str | None = None
    _task_id: int | None = None
    _rpc_layer: str | None = None

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` of the whole job."""

    @abc.abstractmethod
    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """The address of a task (this one by default), prefixed with ``rpc_layer + "://"``."""

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """The accelerators of a task, by type: ``{"GPU": n}`` or ``{"TPU": n}``; ``{}`` on CPU.

        Counts this process's ``jax.local_devices()`` (which initializes JAX's backends on
        first use, so nothing calls it at construction). As JAX cannot query another
        process's devices, the count for another `task_type`/`task_id` assumes the same
        hardware on every task.

        Args:
          task_type: unused (accepted for TF compatibility).
          task_id: unused (accepted for TF compatibility).
          config_proto: unused (accepted for TF compatibility).
        """
        del task_type, task_id, config_proto
        import jax  # Deferred: importing a resolver must not start JAX.

        counts: dict[str, int] = {}
        for device in jax.local_devices():
            kind = _ACCELERATOR_TYPES.get(device.platform)
            if kind is not None:
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    @property
    def task_type(self) -> str | None:
        """This process's task type (``"chief"``, ``"worker"``, ...), or None if unknown."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This process's index within its task type, or None if unknown."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol tasks talk over (``"grpc"``), or None."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        """The environment the job runs in (TF uses ``"google"`` or ``""``)."""
        return ""


def _fix_task(source: str, task_type: Any = "worker", index: Any = "...") -> str:
    if source == "TF_CONFIG":
        return f'Fix "task": {{"type": {json.dumps(task_type)}, "index": {index}}}.'
    return "Fix task_type/task_id."


def _validate_cluster(spec: ClusterSpec, task_type: Any, task_id: Any, source: str) -> None:
    """Checks a non-empty cluster and this process's task; messages start with `source`."""
    unknown = [job for job in spec.jobs if job not in TASK_TYPES]
    if unknown:
        raise ValueError(
            f"{source} cluster has unknown job {_quoted(unknown)}; the known task types are "
            f"{_quoted(TASK_TYPES)}. Rename the job."
        )
    chiefs = [(job, i) for job in _CHIEF_TYPES if job in spec.jobs for i in spec.task_indices(job)]
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
    if not any(job in spec.jobs for job in _TRAINING_TYPES):
        raise ValueError(
            f"{source} cluster has no chief or worker task to train (its jobs are "
            f'{_quoted(spec.jobs)}). Add a "worker" job listing the training processes.'
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
            f"{source} has a cluster (jobs {_quoted(spec.jobs)}) but no task type: every process "
            f"of a multi-worker job must say which task it is. {_fix_task(source)}"
        )
    if not isinstance(task_type, str) or task_type not in TASK_TYPES:
        raise ValueError(
            f"{source} task type {task_type!r} is not a known task type; expected one of "
            f"{_quoted(TASK_TYPES)}. {_fix_task(source)}"
        )
    if task_id is None:
        raise ValueError(
            f'{source} task of type "{task_type}" has no index. {_fix_task(source, task_type)}'
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int):
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
            f'{_quoted(spec.jobs)}. Add a "{task_type}" job to the cluster, or fix this '
            f"process's task type (one of {_quoted(spec.jobs)})."
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


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this process's task from the ``TF_CONFIG`` environment variable.

    ``TF_CONFIG`` is JSON such as::

        {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
         "task": {"type": "worker", "index": 0}}

    with optional ``"rpc_layer"``, ``"environment"`` and ``"session_master"`` keys. It is read
    and validated once, at construction (TF re-reads it on every call), so every mistake is
    reported before any network activity: bad JSON, a cluster without a task or a task
    without a cluster, unknown task types, bad or out-of-range indices, the same address used
    twice, more than one chief, more than one evaluator. An unset or empty ``TF_CONFIG`` is
    a single local process: an empty cluster, and task type and id None, as in TF.

    Args:
      task_type: overrides the task type of ``TF_CONFIG``.
      task_id: overrides the task index of ``TF_CONFIG``.
      rpc_layer: overrides the ``"rpc_layer"`` of ``TF_CONFIG``.
      environment: overrides the ``"environment"`` of ``TF_CONFIG``.

    Raises:
      ValueError: if ``TF_CONFIG`` (with the overrides) is invalid; the message says what
        is wrong, what was given and how to fix it.

    Example:

    >>> import json, os
    >>> from unittest import mock
    >>> from jstrategy.cluster_resolver import TFConfigClusterResolver
    >>> tf_config = {"cluster": {"worker": ["host0:2222", "host1:2222"]},
    ...              "task": {"type": "worker", "index": 1}}
    >>> with mock.patch.dict(os.environ, {"TF_CONFIG": json.dumps(tf_config)}):
    ...     resolver = TFConfigClusterResolver()
    >>> resolver.task_type, resolver.task_id, resolver.master(rpc_layer="grpc")
    ('worker', 1, 'grpc://host1:2222')
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
    ):
        config = _load_tf_config()
        for key in ("rpc_layer", "environment", "session_master"):
            if config.get(key) is not None and not isinstance(config[key], str):
                raise ValueError(
                    f'TF_CONFIG "{key}" must be a string; got {config[key]!r}. Fix or remove it.'
                )
        has_cluster = bool(config.get("cluster"))
        has_task = bool(config.get("task"))
        if has_task and not has_cluster:
            raise ValueError(
                f'TF_CONFIG has a "task" ({json.dumps(config["task"])}) but no "cluster". Add '
                f'"cluster": {{"worker": ["host0:2222", ...], ...}} listing every task\'s '
                f'"host:port", or unset TF_CONFIG to run a single local process.'
            )
        try:
            self._cluster_spec = ClusterSpec(config.get("cluster") or None)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f'TF_CONFIG "cluster" is invalid: {e} Expected e.g. {_EXAMPLE_TF_CONFIG}.'
            ) from e

        task = config.get("task") or {}
        if not isinstance(task, Mapping):
            raise ValueError(
                f'TF_CONFIG "task" must be an object such as {{"type": "worker", "index": 0}}; '
                f"got {json.dumps(task)}."
            )
        if has_cluster and not has_task:
            raise ValueError(
                f'TF_CONFIG has a "cluster" (jobs {_quoted(self._cluster_spec.jobs)}) but no '
                f'"task": every process of a multi-worker job must say which task it is. Add '
                f'"task": {{"type": "worker", "index": ...}} (with this process\'s type and index).'
            )
        self._task_type = task_type if task_type is not None else task.get("type")
        self._task_id = task_id if task_id is not None else task.get("index")
        self._rpc_layer = rpc_layer if rpc_layer is not None else config.get("rpc_layer")
        self._environment = environment if environment is not None else config.get("environment")
        self._session_master = config.get("session_master")

        if self._cluster_spec:
            _validate_cluster(self._cluster_spec, self._task_type, self._task_id, "TF_CONFIG")
        elif task_type is not None or task_id is not None:
            raise ValueError(
                f"task_type={task_type!r}, task_id={task_id!r} were given but TF_CONFIG has no "
                f"cluster to find that task in. Set TF_CONFIG (e.g. {_EXAMPLE_TF_CONFIG}) or "
                f"drop the overrides for a single local process."
            )

    def cluster_spec(self) -> ClusterSpec:
        """The cluster of ``TF_CONFIG``; empty when it is unset."""
        return ClusterSpec(self._cluster_spec)

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """The address of a task (this one by default), as TF's ``master``.

        ``""`` when the cluster has at most one task; ``TF_CONFIG``'s ``"session_master"``
        if set.

        Raises:
          ValueError: if the cluster has no such task.
        """
        if self._session_master is not None:
            return self._session_master
        spec = self._cluster_spec
        if not spec or (len(spec.jobs) == 1 and spec.num_tasks(spec.jobs[0]) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        address = spec.task_address(task_type, task_id)  # type: ignore[arg-type]
        return _format_master_url(address, rpc_layer if rpc_layer is not None else self.rpc_layer)

    @property
    def environment(self) -> str | None:
        """``TF_CONFIG``'s ``"environment"`` (or the override), None if absent."""
        return self._environment


def _load_tf_config() -> dict[str, Any]:
    text = os.environ.get("TF_CONFIG", "")
    if not text.strip():
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        shown = text if len(text) <= 200 else text[:200] + "..."
        raise ValueError(
            f"TF_CONFIG is not valid JSON ({e}); got {shown!r}. Set it to a JSON object such as "
            f"{_EXAMPLE_TF_CONFIG}, or unset it to run a single local process."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"TF_CONFIG must be a JSON object; got {type(config).__name__} {text!r}. Set it to "
            f"e.g. {_EXAMPLE_TF_CONFIG}."
        )
    return config


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns what it was given, as TF's ``SimpleClusterResolver``.

    Args:
      cluster_spec: a `ClusterSpec`, or a dict `ClusterSpec` accepts.
      master: the address `master` returns when not asked for a specific task.
      task_type: this process's task type.
      task_id: this process's index within its task type.
      environment: what `environment` returns.
      num_accelerators: what `num_accelerators` returns, e.g. ``{"GPU": 4}``; None to count
        the local JAX devices.
      rpc_layer: the protocol prefixed to `master`'s addresses, e.g. ``"grpc"``.

    Raises:
      TypeError: if an argument has the wrong type.

    Example:

    >>> from jstrategy.cluster_resolver import ClusterSpec, SimpleClusterResolver
    >>> resolver = SimpleClusterResolver(
    ...     ClusterSpec({"worker": ["w0:2222", "w1:2222"]}), task_type="worker", task_id=1,
    ...     rpc_layer="grpc")
    >>> resolver.master("worker", 0)
    'grpc://w0:2222'
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Any],
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
    ):
        if not isinstance(cluster_spec, (ClusterSpec, Mapping)):
            raise TypeError(
                f"`cluster_spec` must be a ClusterSpec or a dict of job names to addresses; "
                f"got {type(cluster_spec).__name__}: {cluster_spec!r}."
            )
        if not isinstance(master, str):
            raise TypeError(f"`master` must be a string; got {master!r}. Pass '' for none.")
        if task_type is not None and not isinstance(task_type, str):
            raise TypeError(f"`task_type` must be a string or None; got {task_type!r}.")
        if task_id is not None and (isinstance(task_id, bool) or not isinstance(task_id, int)):
            raise TypeError(f"`task_id` must be an int or None; got {task_id!r}.")
        if num_accelerators is not None and not isinstance(num_accelerators, Mapping):
            raise TypeError(
                f"`num_accelerators` must be a dict such as {{'GPU': 4}} or None; got "
                f"{num_accelerators!r}."
            )
        self._cluster_spec = ClusterSpec(cluster_spec)
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = dict(num_accelerators) if num_accelerators is not None else None
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` given at construction."""
        return ClusterSpec(self._cluster_spec)

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """The address of `task_type`/`task_id` if both are given, else the `master` given.

        Raises:
          ValueError: if the cluster has no such task.
        """
        if task_type is not None and task_id is not None:
            address = self._cluster_spec.task_address(task_type, task_id)
        else:
            address = self._master
        return _format_master_url(address, rpc_layer or self._rpc_layer)

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """The `num_accelerators` given, or else the local JAX accelerators by type."""
        if self._num_accelerators is None:
            return super().num_accelerators(task_type, task_id, config_proto)
        return dict(self._num_accelerators)

    @property
    def environment(self) -> str | None:
        """The `environment` given at construction."""
        return self._environment


# --- SLURM -----------------------------------------------------------------------------------

_HOSTLIST_PART = re.compile(r"([^\[\]]*)(?:\[([^\[\]]*)\])?")
_HOSTLIST_NAME = re.compile(r"(?:[^\[\]]|\[[^\[\]]*\])+")
_TASKS_PER_NODE_PART = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def _expand_range(spec: str) -> list[str]:
    values = []
    for item in spec.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {item!r}")
        high = high if sep else low
        if int(high) < int(low):
            raise ValueError(f"range {item!r} runs backwards")
        # SLURM pads every number to the width of the range's lower bound: node[01-10].
        values += [str(i).zfill(len(low)) for i in range(int(low), int(high) + 1)]
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a SLURM hostlist such as ``"node[01-03,7],gpu-a[1-2]"``, keeping its order.

    Zero padding is kept (``node[08-10]`` is node08, node09, node10), and a name may have
    several bracket groups (``r[1-2]n[1-2]`` is r1n1, r1n2, r2n1, r2n2).

    Raises:
      ValueError: if `hostlist` is malformed.

    Example:

    >>> expand_hostlist("node[01-03,7],gpu-a[1-2]")
    ['node01', 'node02', 'node03', 'node7', 'gpu-a1', 'gpu-a2']
    """
    hosts: list[str] = []
    try:
        if not hostlist.strip() or hostlist.count("[") != hostlist.count("]"):
            raise ValueError("unbalanced brackets" if hostlist.strip() else "it is empty")
        for part in _split_outside_brackets(hostlist.strip()):
            if not part:
                raise ValueError("empty host name")
            if not _HOSTLIST_NAME.fullmatch(part):
                raise ValueError(f"misplaced brackets in {part!r}")
            choices: list[list[str]] = []
            for match in _HOSTLIST_PART.finditer(part):
                if not match.group(0):
                    continue
                prefix, ranges = match.groups()
                choices.append([prefix])
                if ranges is not None:
                    choices.append(_expand_range(ranges))
            hosts += ["".join(pieces) for pieces in itertools.product(*choices)]
    except ValueError as e:
        raise ValueError(
            f"Invalid SLURM hostlist {hostlist!r}: {e}. Expected e.g. 'node[01-03,7],gpu-a1'."
        ) from None
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expands SLURM's tasks-per-node list such as ``"2(x3),1"`` into ``[2, 2, 2, 1]``.

    Raises:
      ValueError: if `tasks_per_node` is malformed.

    Example:

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    result: list[int] = []
    for part in tasks_per_node.split(","):
        match = _TASKS_PER_NODE_PART.match(part.strip())
        if match is None:
            raise ValueError(
                f"Invalid SLURM tasks-per-node list {tasks_per_node!r}: bad part {part!r}. "
                f"Expected e.g. '2(x3),1'."
            )
        result += [int(match[1])] * int(match[2] or 1)
    return result


def _slurm_var(*names: str) -> str:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    raise RuntimeError(
        f"{' or '.join(names)} is not set: this process is not running inside a SLURM job step. "
        f"Start it with `srun` (or `sbatch` + `srun`), or use TFConfigClusterResolver."
    )


def _slurm_int(*names: str) -> int:
    value = _slurm_var(*names)
    if not value.strip().isdigit():
        raise ValueError(f"{names[0]} must be a non-negative integer; got {value!r}.")
    return int(value)


class SlurmClusterResolver(ClusterResolver):
    """Resolves the cluster from the SLURM job step this process runs in, as TF's.

    Reads ``SLURM_PROCID`` (this task's rank), ``SLURM_STEP_NUM_TASKS`` (or
    ``SLURM_NTASKS``), ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``) and
    ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``). The ranks on each host get
    ports ``port_base``, ``port_base + 1``, ...; ranks are then given to the jobs in sorted
    job-name order, as TF does (so a ``"chief"`` gets rank 0). Unlike TF, hosts keep SLURM's
    node order rather than being sorted as strings, because SLURM's block distribution hands
    out ranks in node-list order (TF would place ``node10`` before ``node9``), and zero
    padding in host names is kept.

    Args:
      jobs: ``{job_name: num_tasks}``; defaults to ``{"worker": <number of SLURM tasks>}``.
      port_base: the port of the first task on each host.
      gpus_per_node: GPUs on each node; defaults to the number of ``CUDA_VISIBLE_DEVICES``
        (0 if unset: this resolver does not run ``nvidia-smi``).
      gpus_per_task: GPUs per task; defaults to ``gpus_per_node // max tasks per node``.
      tasks_per_node: an int for every node, or ``{host: num_tasks}`` (hosts in the dict's
        order); defaults to SLURM's.
      auto_set_gpu: set ``CUDA_VISIBLE_DEVICES`` to this task's GPUs, at construction (so
        before JAX starts; TF does it in ``cluster_spec()``).
      rpc_layer: the protocol prefixed to `master`'s addresses.

    Raises:
      RuntimeError: if not running under SLURM, or more GPUs are asked for than there are.
      ValueError: if a SLURM variable or an argument is malformed or inconsistent.

    Example:

    >>> import os
    >>> from unittest import mock
    >>> from jstrategy.cluster_resolver import SlurmClusterResolver
    >>> slurm = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
    ...          "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    >>> with mock.patch.dict(os.environ, slurm):
    ...     resolver = SlurmClusterResolver(jobs={"chief": 1, "worker": 3})
    >>> resolver.cluster_spec()
    ClusterSpec({'chief': ['node1:8888'], 'worker': ['node1:8889', 'node2:8888', 'node2:8889']})
    >>> resolver.task_type, resolver.task_id
    ('worker', 2)
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = False,
        rpc_layer: str | None = "grpc",
    ):
        rank = _slurm_int("SLURM_PROCID")
        num_tasks = _slurm_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if os.environ.get("SLURM_STEP_NODELIST"):
            nodelist_vars = ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")
        else:
            nodelist_vars = ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE")
        hosts = expand_hostlist(_slurm_var(nodelist_vars[0]))
        if len(set(hosts)) != len(hosts):
            raise ValueError(
                f"{nodelist_vars[0]} names a host twice: {hosts}. Each node appears once."
            )

        if tasks_per_node is None:
            counts = expand_tasks_per_node(_slurm_var(nodelist_vars[1]))
            if len(counts) != len(hosts):
                raise ValueError(
                    f"{nodelist_vars[1]} gives task counts for {len(counts)} nodes {counts} but "
                    f"{nodelist_vars[0]} has {len(hosts)} nodes {hosts}. Pass tasks_per_node."
                )
            configuration = dict(zip(hosts, counts, strict=True))
        elif isinstance(tasks_per_node, Mapping):
            configuration = {str(host): int(n) for host, n in tasks_per_node.items()}
        elif isinstance(tasks_per_node, int) and not isinstance(tasks_per_node, bool):
            configuration = dict.fromkeys(hosts, tasks_per_node)
        else:
            raise TypeError(
                f"`tasks_per_node` must be an int, a dict {{host: num_tasks}} or None; got "
                f"{tasks_per_node!r}."
            )
        if not configuration or any(n < 0 for n in configuration.values()):
            raise ValueError(
                f"`tasks_per_node` must give each node a non-negative task count and at least "
                f"one node; got {configuration}."
            )
        total = sum(configuration.values())
        if total != num_tasks:
            raise ValueError(
                f"The SLURM step has {num_tasks} tasks but the nodes hold {total} "
                f"({configuration}). Fix `tasks_per_node`."
            )

        if jobs is None:
            jobs = {"worker": num_tasks}
        if not isinstance(jobs, Mapping) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in jobs.values()
        ):
            raise TypeError(
                f"`jobs` must be a dict {{job_name: num_tasks}} with non-negative int counts; "
                f"got {jobs!r}."
            )
        if sum(jobs.values()) != total:
            raise ValueError(
                f"`jobs` asks for {sum(jobs.values())} tasks ({dict(jobs)}) but SLURM placed "
                f"{total} tasks on the nodes ({configuration}). Make the counts add up to "
                f"{total}, or change srun's --ntasks."
            )
        if not 0 <= rank < total:
            raise ValueError(
                f"SLURM_PROCID={rank} is out of range for a step of {total} tasks (0-{total - 1})."
            )

        max_per_node = max(configuration.values())
        if gpus_per_node is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            gpus_per_node = len([g for g in visible.split(",") if g.strip()])
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_per_node if max_per_node else 0
        if max_per_node * gpus_per_task > gpus_per_node:
            raise RuntimeError(
                f"Requested {gpus_per_task} GPUs per task for up to {max_per_node} tasks per node, "
                f"but a node has {gpus_per_node} GPUs. Lower gpus_per_task or the tasks per node."
            )
        if auto_set_gpu and gpus_per_task == 0:
            raise RuntimeError(
                f"auto_set_gpu=True but there are no GPUs to give each task (gpus_per_node="
                f"{gpus_per_node}, gpus_per_task={gpus_per_task}, up to {max_per_node} tasks per "
                f"node; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Pass "
                f"gpus_per_node (and gpus_per_task)."
            )
        if not 1 <= port_base <= 65535 - max_per_node + 1:
            raise ValueError(
                f"`port_base` must leave room for {max_per_node} ports below 65536; got "
                f"{port_base}."
            )

        addresses, gpu_allocation = [], []
        for host, count in configuration.items():
            for local_rank in range(count):
                addresses.append(f"{host}:{port_base + local_rank}")
                first = local_rank * gpus_per_task
                gpu_allocation.append(",".join(map(str, range(first, first + gpus_per_task))))

        cluster: dict[str, list[str]] = {}
        start = 0
        for job, count in sorted(jobs.items()):
            cluster[job] = addresses[start : start + count]
            if start <= rank < start + count:
                self._task_type, self._task_id = job, rank - start
            start += count
        self._cluster_spec = ClusterSpec({job: tasks for job, tasks in cluster.items() if tasks})
        self._rpc_layer = rpc_layer
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        self._rank = rank
        if auto_set_gpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu_allocation[rank]

    def cluster_spec(self) -> ClusterSpec:
        """The cluster of the SLURM step."""
        return ClusterSpec(self._cluster_spec)

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this process, as TF's."""
        return self.task_type, self.task_id

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """The address of a task (this one by default), prefixed with the rpc layer.

        Raises:
          ValueError: if the cluster has no such task.
        """
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        address = self._cluster_spec.task_address(task_type, task_id)
        return _format_master_url(address, rpc_layer or self.rpc_layer)

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """``{"GPU": gpus_per_task}``, or the local JAX accelerators when no GPUs are known."""
        if self._gpus_per_task:
            return {"GPU": self._gpus_per_task}
        return super().num_accelerators(task_type, task_id, config_proto)


# --- Process layout --------------------------------------------------------------------------


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
    _validate_cluster(spec, task_type, task_id, source)
    for job in _TRAINING_TYPES:
        if job in spec.jobs and spec.task_indices(job) != list(range(spec.num_tasks(job))):
            raise ValueError(
                f'{source} cluster lists the "{job}" job sparsely (task indices '
                f"{spec.task_indices(job)}), but every training process must know every other "
                f"to rank itself. List all {job} tasks, indices 0-{max(spec.task_indices(job))}."
            )
    chief_job = next((job for job in _CHIEF_TYPES if job in spec.jobs), None)
    num_chiefs = 1 if chief_job is not None else 0
    num_workers = spec.num_tasks("worker") if "worker" in spec.jobs else 0
    coordinator = spec.task_address(chief_job or "worker", 0)

    process_id: int | None = None
    if task_type in _CHIEF_TYPES:
        process_id = 0
    elif task_type == "worker":
        assert task_id is not None  # _validate_cluster checked it.
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
