"""`ClusterResolver`: the base of the resolvers, which say who a job's processes are.

As in ``tf.distribute.cluster_resolver``: a `ClusterSpec` (`spec.py`) maps job names
(``"chief"``, ``"worker"``, ``"ps"``, ``"evaluator"``) to the ``"host:port"`` addresses of
their tasks, and a resolver says which task the current process is: one a file
(`tf_config.py`, `simple.py`, `slurm.py`; TPU's in `strategies/tpu.py`).
`training_process_layout` (`layout.py`) turns a resolver into what
``jax.distributed.initialize`` needs.

Everything is validated when it is constructed, before any network activity, so a
misconfigured job fails at once with a message that says what to fix instead of hanging in a
rendezvous. Nothing here initializes a JAX backend except `ClusterResolver.num_accelerators`.
"""

from __future__ import annotations

import abc
from typing import Any

from jstrategy._src.cluster.spec import ClusterSpec

__all__ = ["ClusterResolver"]


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
