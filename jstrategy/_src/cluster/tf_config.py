"""`TFConfigClusterResolver`: the job and this process's task, read from ``TF_CONFIG``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jstrategy._src.cluster.resolver import ClusterResolver
from jstrategy._src.cluster.spec import EXAMPLE_TF_CONFIG
from jstrategy._src.cluster.spec import ClusterSpec
from jstrategy._src.cluster.spec import format_master_url
from jstrategy._src.cluster.spec import quoted
from jstrategy._src.cluster.spec import validate_cluster

__all__ = ["TFConfigClusterResolver"]


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
                f'TF_CONFIG "cluster" is invalid: {e} Expected e.g. {EXAMPLE_TF_CONFIG}.'
            ) from e

        task = config.get("task") or {}
        if not isinstance(task, Mapping):
            raise ValueError(
                f'TF_CONFIG "task" must be an object such as {{"type": "worker", "index": 0}}; '
                f"got {json.dumps(task)}."
            )
        if has_cluster and not has_task:
            raise ValueError(
                f'TF_CONFIG has a "cluster" (jobs {quoted(self._cluster_spec.jobs)}) but no '
                f'"task": every process of a multi-worker job must say which task it is. Add '
                f'"task": {{"type": "worker", "index": ...}} (with this process\'s type and index).'
            )
        self._task_type = task_type if task_type is not None else task.get("type")
        self._task_id = task_id if task_id is not None else task.get("index")
        self._rpc_layer = rpc_layer if rpc_layer is not None else config.get("rpc_layer")
        self._environment = environment if environment is not None else config.get("environment")
        self._session_master = config.get("session_master")

        if self._cluster_spec:
            validate_cluster(self._cluster_spec, self._task_type, self._task_id, "TF_CONFIG")
        elif task_type is not None or task_id is not None:
            raise ValueError(
                f"task_type={task_type!r}, task_id={task_id!r} were given but TF_CONFIG has no "
                f"cluster to find that task in. Set TF_CONFIG (e.g. {EXAMPLE_TF_CONFIG}) or "
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
        return format_master_url(address, rpc_layer if rpc_layer is not None else self.rpc_layer)

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
            f"{EXAMPLE_TF_CONFIG}, or unset it to run a single local process."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"TF_CONFIG must be a JSON object; got {type(config).__name__} {text!r}. Set it to "
            f"e.g. {EXAMPLE_TF_CONFIG}."
        )
    return config
