"""`MultiWorkerMirroredStrategy`: Mirrored across processes on JAX's distributed runtime."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import jax

from jstrategy._src.cluster import join as cluster_lib
from jstrategy._src.cluster.join import PeerFailureError
from jstrategy._src.cluster.tf_config import TFConfigClusterResolver
from jstrategy._src.collective_util import CommunicationImplementation
from jstrategy._src.collective_util import CommunicationOptions
from jstrategy._src.collective_util import check_communication_options
from jstrategy._src.cross_device_ops import CollectiveAllReduce
from jstrategy._src.strategy import Strategy

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver

__all__ = ["MultiWorkerMirroredStrategy", "PeerFailureError"]


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of several processes (workers).

    The strategy joins the job (`jstrategy.cluster_resolver.join`: JAX's distributed
    runtime, the chief or worker 0 as coordinator) and lays one replica on every device of
    every worker. Without ``TF_CONFIG`` it is a one-worker strategy over the local devices;
    an evaluator task gets a local strategy. Create it before any other JAX computation:
    the distributed runtime must start before JAX's backends do.

    Args:
      cluster_resolver: the cluster and this task; by default `TFConfigClusterResolver()`
        (``TF_CONFIG``).
      communication_options: `CommunicationOptions` (implementation, bytes_per_pack,
        timeout_seconds).

    Raises:
      RuntimeError: if JAX's backends already started, so the runtime cannot.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.MultiWorkerMirroredStrategy()   # no TF_CONFIG: this process alone
    >>> strategy.num_replicas_in_sync, len(strategy.extended.worker_devices)
    (8, 8)
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
    ):
        options = check_communication_options(communication_options)
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        self._cluster_resolver = resolver
        self._communication_options = options
        # The handshake, the bounds and SIGTERM's hand-back: `cluster.join`.
        self._cluster = cluster_lib.join(resolver, timeout_seconds=options.timeout_seconds)
        super().__init__(
            jax.devices() if self._cluster.connected else jax.local_devices(),
            cross_device_ops=CollectiveAllReduce(options.implementation, options.bytes_per_pack),
        )

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver this strategy was built from."""
        return self._cluster_resolver

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._communication_options

    @property
    def is_chief(self) -> bool:
        """Whether this worker is the chief (or worker 0 without one), which writes what is
        written once."""
        return cluster_lib.is_chief(self._cluster)

    @property
    def num_workers(self) -> int:
        """How many processes train together."""
        return self._cluster.num_workers


class _DeprecatedMultiWorkerMirroredStrategy(MultiWorkerMirroredStrategy):
    """`jstrategy.experimental.MultiWorkerMirroredStrategy(communication, cluster_resolver)`,
    deprecated as in TF: use `jstrategy.MultiWorkerMirroredStrategy` (`CommunicationOptions`).

    Example:

    >>> import warnings, jstrategy
    >>> with warnings.catch_warnings(record=True):
    ...     warnings.simplefilter("always")
    ...     strategy = jstrategy.experimental.MultiWorkerMirroredStrategy(communication="RING")
    >>> strategy.num_replicas_in_sync
    8
    """

    def __init__(
        self,
        communication: CommunicationImplementation | str = CommunicationImplementation.AUTO,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
    ):
        warnings.warn(
            "jstrategy.experimental.MultiWorkerMirroredStrategy is deprecated; use "
            "jstrategy.MultiWorkerMirroredStrategy(communication_options="
            "jstrategy.experimental.CommunicationOptions(implementation=...)).",
            DeprecationWarning,
            stacklevel=2,
        )
        if communication_options is None:
            communication_options = CommunicationOptions(implementation=communication)
        super().__init__(cluster_resolver, communication_options)
