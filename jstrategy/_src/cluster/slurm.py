"""`SlurmClusterResolver`: the job of a SLURM allocation, and SLURM's host lists."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from typing import Any

from jstrategy._src.cluster.resolver import ClusterResolver
from jstrategy._src.cluster.spec import ClusterSpec
from jstrategy._src.cluster.spec import format_master_url
from jstrategy._src.validation import is_int

__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]

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
        elif is_int(tasks_per_node):
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
        if not isinstance(jobs, Mapping) or not all(is_int(n) and n >= 0 for n in jobs.values()):
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
        return format_master_url(address, rpc_layer or self.rpc_layer)

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
