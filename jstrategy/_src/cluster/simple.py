"""`SimpleClusterResolver`: a resolver that returns what it was given, as TF's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jstrategy._src.cluster.resolver import ClusterResolver
from jstrategy._src.cluster.spec import ClusterSpec
from jstrategy._src.cluster.spec import format_master_url
from jstrategy._src.validation import is_int

__all__ = ["SimpleClusterResolver"]


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
        if task_id is not None and not is_int(task_id):
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
        return format_master_url(address, rpc_layer or self._rpc_layer)

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
