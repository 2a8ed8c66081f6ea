"""`ShardedStrategy`: the common base of strategies whose variables are split across devices
(how they join a job, read annotations, keep variables in host memory, stage a step)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
from flax.core import spmd as flax_spmd

from jstrategy._src import devices as devices_lib
from jstrategy._src import flax_annotations
from jstrategy._src import placement
from jstrategy._src import staging
from jstrategy._src.activation_rows import TENSOR_AXES
from jstrategy._src.activation_rows import TensorActivations
from jstrategy._src.cluster import join as cluster_lib
from jstrategy._src.cluster.tf_config import TFConfigClusterResolver
from jstrategy._src.collective_util import check_communication_options
from jstrategy._src.context_parallel import axis as context_axis_lib
from jstrategy._src.cross_device_ops import CollectiveAllReduce
from jstrategy._src.offload import HOST_MEMORY_KIND
from jstrategy._src.offload import OffloadPolicy
from jstrategy._src.offload import resolve_offload
from jstrategy._src.strategy import Strategy

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver
    from jstrategy._src.collective_util import CommunicationOptions

__all__ = ["ShardedStrategy"]


class ShardedStrategy(Strategy):
    """A `Strategy` whose `variable_sharding` splits variables across devices.

    Its train steps run in the global view (`staging.sharded_train_program`), traced under
    `mesh_context`, so models' sharding constraints name its axes. Its `scope()` sets no
    mesh: a model created there, annotated for any mesh, is placed by `variable_sharding`.
    """

    #: The job this strategy joined (`_join_job`), or None for a local one.
    _cluster: cluster_lib.Cluster | None = None
    _cluster_resolver: ClusterResolver | None = None
    #: Which variables live in host memory between steps; None: none.
    _offload: OffloadPolicy | None = None
    _tensor_activations: TensorActivations = TensorActivations.FEATURES

    def _set_options(
        self, offload: OffloadPolicy | None, offload_optimizer: bool, value: TensorActivations
    ) -> None:
        """Checks and keeps the constructor's ``offload=`` / ``offload_optimizer=`` and
        ``tensor_activations=`` (a member already) against the mesh, once it is set."""
        self._offload = resolve_offload(offload, offload_optimizer, self.devices)
        if value is TensorActivations.SEQUENCE:
            shape = dict(self.mesh.shape)
            if not any(int(shape.get(a, 1)) > 1 for a in TENSOR_AXES):
                raise ValueError(
                    "`tensor_activations=TensorActivations.SEQUENCE` splits the activations "
                    "between blocks over the tensor axis, which needs a mesh axis "
                    f"{' or '.join(map(repr, TENSOR_AXES))} of more than one device; got a "
                    f"mesh {shape}. Give a tensor degree above 1 (e.g. tensor=2), or leave "
                    "tensor_activations at its default."
                )
            if self.context_parallelism > 1:
                raise ValueError(
                    "`tensor_activations=TensorActivations.SEQUENCE` cannot split the "
                    "sequence over the tensor axis where the context axis already splits "
                    f"it (context={self.context_parallelism}). Leave tensor_activations at "
                    "its default (the features), or drop context=."
                )
        self._tensor_activations = value

    @property
    def tensor_activations(self) -> TensorActivations:
        """Which dimension of the activations between blocks the train step splits over
        the tensor axis (`TensorActivations`)."""
        return self._tensor_activations

    def _in_memory(
        self, sharding: jax.sharding.Sharding, leaf: Any, path: tuple[str, ...]
    ) -> jax.sharding.Sharding:
        """`sharding` in host memory where the offload policy chooses the leaf: the last
        rule of every sharded strategy's `variable_sharding`."""
        policy = self._offload
        if policy is None or not policy.offloads(leaf, path):
            return sharding
        return sharding.with_memory_kind(HOST_MEMORY_KIND)

    @property
    def offload(self) -> OffloadPolicy | None:
        """Which variables live in host memory between steps (None: all in device memory).

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.FSDPStrategy(offload_optimizer=True).offload
        OffloadPolicy(optimizer=True, params=False, where=None)
        """
        return self._offload

    def __repr__(self) -> str:
        return self._with_offload(super().__repr__())

    def _with_offload(self, text: str) -> str:
        """A repr ``Name(...)`` with ``tensor_activations=`` and ``offload=`` added where
        they are not the defaults."""
        if self._tensor_activations is not TensorActivations.FEATURES:
            text = f"{text[:-1]}, tensor_activations={self._tensor_activations.value!r})"
        return text if self._offload is None else f"{text[:-1]}, offload={self._offload!r})"

    def read_on_replicas(self, tree: Any) -> Any:
        """Variables kept in host memory (offloaded parameters) copied to device memory,
        where evaluation, prediction and `run` compute; the others as they are."""
        if self._offload is None:
            return tree
        return placement.in_device_memory(tree)

    def _join_job(
        self,
        cluster_resolver: ClusterResolver | None,
        communication_options: CommunicationOptions | None,
    ) -> CollectiveAllReduce | None:
        """Joins the job `cluster_resolver` (by default ``TF_CONFIG``) describes, as
        `MultiWorkerMirroredStrategy` does: the collectives across the processes, or None
        when this process trains alone."""
        options = check_communication_options(communication_options)
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        self._cluster_resolver = resolver
        self._cluster = cluster_lib.join(resolver, timeout_seconds=options.timeout_seconds)
        if self._cluster.num_workers == 1:
            return None
        return CollectiveAllReduce(options.implementation, options.bytes_per_pack)

    def _join_and_resolve(
        self,
        devices: Sequence[devices_lib.DeviceSpec] | None,
        cluster_resolver: ClusterResolver | None,
        communication_options: CommunicationOptions | None,
    ) -> tuple[CollectiveAllReduce | None, list[jax.Device]]:
        """``(collectives across processes or None, the devices)``: the job joined
        (`_join_job`) where no devices are given or a job is named, then `devices`
        resolved, None meaning every device of every process of the job."""
        cross = None
        if devices is None or cluster_resolver is not None or communication_options is not None:
            cross = self._join_job(cluster_resolver, communication_options)
        # After joining, JAX's devices are every worker's.
        resolved = jax.devices() if devices is None else devices_lib.resolve_devices(devices)
        return cross, list(resolved)

    @property
    def logical_axis_rules(self) -> tuple[tuple[str, Any], ...]:
        """Flax logical axis rules (``(logical name, mesh axes)`` pairs) the strategy adds."""
        return ()

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The job's resolver (None when the strategy joined no job)."""
        return self._cluster_resolver

    @property
    def num_workers(self) -> int:
        """How many processes train together (whose devices hold replicas)."""
        return len({d.process_index for d in self.devices})

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief (or worker 0 without a chief): it writes what
        is written once."""
        return cluster_lib.is_chief(self._cluster)

    @property
    def activation_rows(self) -> str | tuple[str, ...] | None:
        """The axes of a batch's rows (`batch_sharding`): the step splits the input of each
        marked block over them as it splits the batch (see `Strategy.activation_rows`).

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.FSDPStrategy().activation_rows
        'replica'
        >>> jstrategy.experimental.HybridStrategy(fsdp=4).activation_rows
        ('replica', 'fsdp')
        """
        rows: str | tuple[str, ...] | None = self.batch_sharding().spec[0]
        return rows

    @property
    def context_parallelism(self) -> int:
        """How many shards a train step splits the sequence into: the size of the mesh's
        ``"context"`` axis (1 without one). See `jstrategy.experimental.dot_product_attention`.

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.FSDPStrategy(context=4).context_parallelism
        4
        """
        axis = context_axis_lib.of_mesh(self.mesh, self.axis_name)
        return 1 if axis is None else axis.size

    def annotation_axis(self, name: str) -> str | None:
        """An axis of the mesh means itself; a data axis of another mesh (``"data"``,
        ``"fsdp"``, ``"batch"``) means this one's (`axis_name`); any other axis None.

        Example:

        >>> import jstrategy
        >>> strategy = jstrategy.experimental.FSDPStrategy()
        >>> strategy.annotation_axis("data"), strategy.annotation_axis("model")
        ('replica', None)
        """
        if name in self.mesh.axis_names:
            return name
        return self.axis_name if name in flax_annotations.DATA_AXES else None

    @contextlib.contextmanager
    def mesh_context(self) -> Iterator[None]:
        """JAX's mesh set to the strategy's, Flax's logical axis rules to
        `flax_annotations.step_rules` (while a program is traced)."""
        with (
            jax.set_mesh(self.mesh),
            flax_spmd.logical_axis_rules(flax_annotations.step_rules(self)),
        ):
            yield

    def stage_train_step(
        self, fns: staging.StepFunctions, *, steps: int = 0, stacked: bool = True
    ) -> staging.TrainProgram:
        """One program per call: see `staging.sharded_train_program`; traced and run under
        `mesh_context`."""
        return _UnderMesh(
            self, staging.sharded_train_program(self, fns, steps=steps, stacked=stacked)
        )


class _UnderMesh:
    """A `TrainProgram` called (hence traced) under its strategy's `mesh_context`: models'
    sharding constraints name the strategy's axes (`jax.set_mesh` cannot be entered inside
    a trace)."""

    def __init__(self, strategy: ShardedStrategy, program: staging.TrainProgram):
        self._strategy = strategy
        self._program = program

    def __call__(self, state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any, Any]:
        with self._strategy.mesh_context():
            return self._program(state, acc, batch, mask)

    def lower(self, state: Any, acc: Any, batch: Any, mask: Any) -> Any:
        """The program lowered under the strategy's mesh."""
        with self._strategy.mesh_context():
            return self._program.lower(state, acc, batch, mask)
