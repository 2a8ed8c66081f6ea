"""`TPUStrategy`, `TPUClusterResolver` and the TPU system setup calls of tf.distribute."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils

from jstrategy._src import devices as devices_lib
from jstrategy._src.cluster import join as cluster_lib
from jstrategy._src.cluster.spec import ClusterSpec
from jstrategy._src.strategy import Strategy

__all__ = [
    "ALLOW_NON_TPU_ENV",
    "TPUClusterResolver",
    "TPUStrategy",
    "Topology",
    "experimental_connect_to_cluster",
    "initialize_tpu_system",
    "tpu_device_order",
]

#: Environment variable that lets TPU code run on other devices (tests, notebooks).
ALLOW_NON_TPU_ENV = "JSTRATEGY_ALLOW_NON_TPU"


def _allow_non_tpu() -> bool:
    return os.environ.get(ALLOW_NON_TPU_ENV, "").lower() in ("1", "true", "yes")


def tpu_device_order(devices: Sequence[Any]) -> list[Any]:
    """`devices` (TPU cores, or descriptions of them) in an order whose neighbours are
    physical neighbours, as `mesh_utils` knows each TPU generation; others as they are."""
    devices = list(devices)
    if not devices or devices[0].platform != "tpu":
        return devices
    mesh = mesh_utils.create_device_mesh(
        (len(devices),), devices=devices, allow_split_physical_axes=True
    )
    return list(np.asarray(mesh).flat)


@dataclasses.dataclass(frozen=True)
class Topology:
    """The TPU system's shape, as `tf.tpu.experimental.Topology` describes it.

    Attributes:
      mesh_shape: the physical extent ``(x, y, z, cores_per_chip)``.
      device_coordinates: per task, per device, ``(x, y, z, core)``.
      num_tasks: how many hosts (JAX processes).
      num_tpus_per_task: how many cores each host drives.
      device_kind: e.g. ``"TPU v4"``; the platform name when not on TPU.

    Example:

    >>> import jax, jstrategy
    >>> topology = jstrategy.tpu.experimental.Topology.from_devices(jax.devices())
    >>> topology.num_tasks, topology.num_tpus_per_task
    (1, 8)
    """

    mesh_shape: tuple[int, ...]
    device_coordinates: np.ndarray
    num_tasks: int
    num_tpus_per_task: int
    device_kind: str

    @classmethod
    def from_devices(cls, devices: Sequence[Any]) -> Topology:
        """Builds the topology of `devices` (TPU cores, or any devices when not on TPU)."""
        devices = list(devices)
        process = np.array([d.process_index for d in devices])
        tasks = sorted(set(process.tolist()))
        arr = np.array(
            [(*getattr(d, "coords", (d.id, 0, 0)), getattr(d, "core_on_chip", 0)) for d in devices],
            dtype=np.int32,
        )
        shape = tuple(int(v) for v in arr.max(0) - arr.min(0) + 1)
        by_task = np.stack([arr[process == t] for t in tasks])
        per_task = len(devices) // max(1, len(tasks))
        return cls(shape, by_task, len(tasks), per_task, devices[0].device_kind)


class TPUClusterResolver:
    """Finds the TPU cores, as `tf.distribute.cluster_resolver.TPUClusterResolver`.

    Args:
      tpu: None, ``""`` or ``"local"``: the TPU attached to this VM (Colab, Cloud TPU VMs);
        JAX does not support remote TPU nodes over gRPC.
      zone: accepted for compatibility; unused (JAX discovers the slice itself).
      project: accepted for compatibility; unused.

    Raises:
      ValueError: for a remote TPU address.

    Example:

    >>> resolver = TPUClusterResolver(tpu="local")
    >>> resolver.task_type
    'worker'
    """

    def __init__(self, tpu: str | None = None, zone: str | None = None, project: str | None = None):
        if tpu not in (None, "", "local") and (tpu.startswith("grpc://") or ":" in tpu):
            raise ValueError(
                f"`tpu` must be None or 'local' (a TPU attached to this VM); got {tpu!r}. "
                "Remote TPU nodes over gRPC are not supported by JAX: run on the TPU VM "
                "itself (Colab: Runtime > Change runtime type > TPU)."
            )
        self.tpu = tpu or "local"
        self.zone = zone
        self.project = project
        self.task_type = "worker"
        self.task_id = int(os.environ.get("TPU_WORKER_ID", "0") or 0)
        self.rpc_layer = None
        self.environment = ""

    def _hosts(self) -> list[str]:
        names = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
        return [f"{h}:8470" for h in names] or ["localhost:8470"]

    def cluster_spec(self) -> Any:
        """The ``worker`` job: one task per TPU host."""
        return ClusterSpec({"worker": self._hosts()})

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """The session target; empty for the local TPU, as on TPU VMs."""
        return ""

    def get_master(self) -> str:
        return self.master()

    def num_hosts(self) -> int:
        """How many hosts the slice spans."""
        return len(self._hosts())

    def devices(self) -> list[jax.Device]:
        """The TPU cores of the whole slice.

        Raises:
          RuntimeError: when there is no TPU (unless ``JSTRATEGY_ALLOW_NON_TPU=1``, which
            returns the default backend's devices instead).
        """
        with contextlib.suppress(RuntimeError):  # no TPU backend
            if tpus := jax.devices("tpu"):
                return list(tpus)
        if _allow_non_tpu():
            return list(jax.devices())
        found = ", ".join(f"{d.platform}:{d.id}" for d in jax.devices()) or "none"
        raise RuntimeError(
            f"No TPU found: JAX sees {found}. On Colab choose Runtime > Change runtime type "
            f"> TPU; to run TPU code on these devices instead (tests, notebooks), set "
            f"{ALLOW_NON_TPU_ENV}=1."
        )

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict[str, int]:
        local = [d for d in self.devices() if d.process_index == jax.process_index()]
        return {"TPU": len(local)} if local and local[0].platform == "tpu" else {}

    def __repr__(self) -> str:
        return f"TPUClusterResolver(tpu={self.tpu!r})"


def experimental_connect_to_cluster(cluster_spec_or_resolver: Any = None, **_: Any) -> None:
    """Connects this host to the rest of its TPU slice.

    As `tf.config.experimental_connect_to_cluster`: on a multi-host slice it joins the job
    (`jstrategy.cluster_resolver.join`); on one host there is nothing to connect. Call it
    before any other JAX computation.

    Args:
      cluster_spec_or_resolver: a `TPUClusterResolver` (or anything with `num_hosts()`).

    Example:

    >>> import jstrategy
    >>> resolver = jstrategy.cluster_resolver.TPUClusterResolver(tpu="local")
    >>> jstrategy.config.experimental_connect_to_cluster(resolver)   # one host: nothing to do
    """
    if callable(getattr(cluster_spec_or_resolver, "num_hosts", None)):
        cluster_lib.join(cluster_spec_or_resolver)


def initialize_tpu_system(cluster_resolver: TPUClusterResolver | None = None) -> Topology:
    """Finds the TPU cores and returns the topology (`tf.tpu.experimental.initialize_tpu_system`).

    JAX initializes TPUs on first use: this only resolves the devices and describes them.

    Args:
      cluster_resolver: the resolver; a default `TPUClusterResolver()` when None.

    Returns:
      The `Topology` of the slice.

    Example:

    >>> import os
    >>> from unittest import mock
    >>> import jstrategy
    >>> resolver = jstrategy.cluster_resolver.TPUClusterResolver(tpu="local")
    >>> with mock.patch.dict(os.environ, {"JSTRATEGY_ALLOW_NON_TPU": "1"}):  # no TPU here
    ...     topology = jstrategy.tpu.experimental.initialize_tpu_system(resolver)
    >>> isinstance(topology, jstrategy.tpu.experimental.Topology)
    True
    """
    return Topology.from_devices((cluster_resolver or TPUClusterResolver()).devices())


class TPUStrategy(Strategy):
    """Synchronous data parallelism over TPU cores, one replica per core.

    Args:
      tpu_cluster_resolver: a `TPUClusterResolver`; a default one when None.
      experimental_device_assignment: accepted for compatibility; must be None (the
        replica order always follows the physical topology).
      cluster_resolver: keyword alias of `tpu_cluster_resolver`.
      devices: the TPU cores to replicate over instead of every core the resolver finds
        (no cluster joined): e.g. a topology's compile-only devices
        (`jstrategy.experimental.topology_devices`), to `jstrategy.experimental.plan` a
        slice this process does not have.

    Raises:
      RuntimeError: without a TPU, naming the devices found (see ``JSTRATEGY_ALLOW_NON_TPU``).
      ValueError: for `devices` that are empty, repeated, missing or not TPU cores.

    Example:

    >>> import os
    >>> from unittest import mock
    >>> import jstrategy
    >>> with mock.patch.dict(os.environ, {"JSTRATEGY_ALLOW_NON_TPU": "1"}):  # no TPU here
    ...     strategy = jstrategy.TPUStrategy()
    >>> strategy.num_replicas_in_sync
    8
    """

    def __init__(
        self,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        experimental_device_assignment: Any = None,
        *,
        cluster_resolver: TPUClusterResolver | None = None,
        devices: Sequence[devices_lib.DeviceSpec] | None = None,
    ):
        if tpu_cluster_resolver is not None and cluster_resolver is not None:
            raise ValueError(
                "Pass the resolver once: `tpu_cluster_resolver` or `cluster_resolver`, not both."
            )
        if experimental_device_assignment is not None:
            raise ValueError(
                "`experimental_device_assignment` must be None; got "
                f"{experimental_device_assignment!r}. TPUStrategy always uses every core of "
                "the slice in topology order; use jax.sharding directly for custom layouts."
            )
        given = None if devices is None else _tpu_cores(devices)
        resolver = tpu_cluster_resolver or cluster_resolver or TPUClusterResolver()
        self._cluster_resolver = resolver
        # Devices named by the caller (compile-only cores among them): nothing to find or
        # join; else a multi-host slice not connected yet joins now.
        self._cluster = None if given is not None else cluster_lib.join(resolver)
        super().__init__(tpu_device_order(resolver.devices() if given is None else given))

    @property
    def cluster_resolver(self) -> TPUClusterResolver:
        return self._cluster_resolver


def _tpu_cores(devices: Sequence[devices_lib.DeviceSpec]) -> list[jax.Device]:
    """`TPUStrategy`'s ``devices=``, checked: TPU cores (real or compile-only)."""
    cores = devices_lib.resolve_devices(devices)
    others = sorted({d.platform for d in cores} - {"tpu"})
    if others and not _allow_non_tpu():
        raise ValueError(
            f"`devices` must be TPU cores; got devices of {others}. Pass a TPU's devices "
            '(jax.devices("tpu"), or jstrategy.experimental.topology_devices("v5e:2x4") '
            f"without a TPU), or set {ALLOW_NON_TPU_ENV}=1 to run TPU code on other devices."
        )
    return cores
