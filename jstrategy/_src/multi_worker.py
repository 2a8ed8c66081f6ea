"""`MultiWorkerMirroredStrategy`: Mirrored across processes on JAX's distributed runtime."""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import TYPE_CHECKING
from typing import Any

import jax

from jstrategy._src import coordination
from jstrategy._src import dispatch
from jstrategy._src import fault_tolerance
from jstrategy._src import jax_compat
from jstrategy._src import rendezvous
from jstrategy._src.cluster_resolver import TFConfigClusterResolver
from jstrategy._src.cluster_resolver import training_process_layout
from jstrategy._src.collective_util import CommunicationImplementation
from jstrategy._src.collective_util import CommunicationOptions
from jstrategy._src.cross_device_ops import CollectiveAllReduce
from jstrategy._src.strategy import Strategy

if TYPE_CHECKING:
    from jstrategy._src.cluster_resolver import ClusterResolver

__all__ = ["MultiWorkerMirroredStrategy", "PeerFailureError"]


class PeerFailureError(RuntimeError):
    """A collective failed because another worker died or stopped responding."""


_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


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


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of several processes (workers).

    The cluster comes from `cluster_resolver` (by default `TFConfigClusterResolver`, which
    reads ``TF_CONFIG``). The strategy starts JAX's distributed runtime
    (`jax.distributed.initialize`: the coordination service, gloo collectives on CPU, NCCL
    on GPU) with the chief, or worker 0 when there is no chief, as coordinator, and lays one
    replica on every device of every worker. Without ``TF_CONFIG`` it is a one-worker
    strategy over the local devices. An evaluator task stays out of the training
    collectives and gets a local strategy.

    Create it before any other JAX computation in the program: the distributed runtime must
    start before JAX's backends do.

    Args:
      cluster_resolver: describes the cluster and this task; defaults to
        `TFConfigClusterResolver()`.
      communication_options: `CommunicationOptions` (implementation RING/NCCL/AUTO,
        bytes_per_pack, timeout_seconds).

    Raises:
      RuntimeError: if JAX's backends already started, so the runtime cannot.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
    ):
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise TypeError(
                "`communication_options` must be a jstrategy.experimental.CommunicationOptions; "
                f"got {type(communication_options).__name__}."
            )
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        self._cluster_resolver = resolver
        self._communication_options = communication_options
        self._layout = training_process_layout(resolver)
        participant = self._layout.process_id is not None and self._layout.num_processes > 1
        if participant:
            self._initialize_runtime()
            dispatch.add_error_translator(self._translate_error)
            coordination.set_timeout_seconds(communication_options.timeout_seconds)
        devices = jax.devices() if participant else jax.local_devices()
        super().__init__(
            devices,
            cross_device_ops=CollectiveAllReduce(
                communication_options.implementation, communication_options.bytes_per_pack
            ),
        )

    def _initialize_runtime(self) -> None:
        layout = self._layout
        client = jax_compat.distributed_client()
        if client is not None:
            if (
                jax.process_index() != layout.process_id
                or jax.process_count() != layout.num_processes
            ):
                raise RuntimeError(
                    "JAX's distributed runtime is already running as process "
                    f"{jax.process_index()} of {jax.process_count()}, but the cluster resolver "
                    f"says process {layout.process_id} of {layout.num_processes}."
                )
            return
        if jax_compat.backends_started():
            # Checked before meeting the others, who would otherwise wait for this process.
            raise RuntimeError(
                "MultiWorkerMirroredStrategy must be created before any other JAX "
                "computation in the program, because JAX's distributed runtime has to start "
                "before its backends. Move the strategy's creation earlier."
            )
        assert layout.process_id is not None and layout.coordinator_address is not None
        timeout = self._communication_options.timeout_seconds
        # Without a setting, 300 s: JAX's own start-up timeout.
        startup_timeout = timeout if timeout is not None else coordination.DEFAULT_TIMEOUT_S
        # Only the address TF_CONFIG names, not every interface (JAX's default): one stray
        # connection to the coordination service can abort the whole job.
        bind_address = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or (
            layout.coordinator_address
        )
        rendezvous.meet(
            layout.tasks, layout.process_id, bind_address=bind_address, timeout=startup_timeout
        )
        own_host = rendezvous.split_address(layout.tasks[layout.process_id][2])[0]
        if rendezvous.is_loopback_host(own_host):
            # A local job's collectives stay on loopback too, whatever the hostname says.
            jax_compat.bind_cpu_collectives_to(own_host)
        kwargs: dict[str, Any] = {
            # Everyone is here already; this bounds what is left of the start-up.
            "initialization_timeout": max(1, math.ceil(startup_timeout)),
            "coordinator_bind_address": bind_address,
        }
        if timeout is not None:
            kwargs["heartbeat_timeout_seconds"] = max(1, int(timeout))
            kwargs["shutdown_timeout_seconds"] = max(1, int(timeout))
            _bound_cpu_collectives(timeout)
        jax.distributed.initialize(
            coordinator_address=layout.coordinator_address,
            num_processes=layout.num_processes,
            process_id=layout.process_id,
            **kwargs,
        )
        # JAX's preemption service now holds SIGTERM, which then no longer stops the
        # process; it gets it only while something saves on preemption.

        fault_tolerance.take_sigterm_from_jax()

    def _translate_error(self, error: Exception) -> Exception | None:
        text = str(error)
        markers = ("Gloo", "gloo", "Connection reset", "heartbeat", "coordination", "NCCL", "peer")
        if not any(m in text for m in markers):
            return None
        message = (
            f"MultiWorkerMirroredStrategy: a collective failed on worker "
            f"{self._layout.task_type}:{self._layout.task_id} (process "
            f"{self._layout.process_id} of {self._layout.num_processes}); another worker most "
            "likely died or stopped responding, or skipped this collective (every worker must "
            "run the same steps). Restart the job (with BackupAndRestore it resumes from the "
            f"last backup). Cause: {text.splitlines()[0]}"
        )
        # The runtime may terminate this process moments later; say why first.
        print(message, file=sys.stderr, flush=True)
        return PeerFailureError(message)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver this strategy was built from."""
        return self._cluster_resolver

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._communication_options

    @property
    def is_chief(self) -> bool:
        """Whether this worker is the chief (or worker 0 without a chief): it writes what is
        written once, such as checkpoints' metadata and summaries."""
        return self._layout.is_chief

    @property
    def num_workers(self) -> int:
        """How many processes train together."""
        return max(1, self._layout.num_processes) if self._layout.process_id is not None else 1


class _DeprecatedMultiWorkerMirroredStrategy(MultiWorkerMirroredStrategy):
    """`jstrategy.experimental.MultiWorkerMirroredStrategy(communication, cluster_resolver)`.

    Deprecated, as in TF: use `jstrategy.MultiWorkerMirroredStrategy` with
    `CommunicationOptions(implementation=...)`.
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
