"""`ModelParallelStrategy`: variables split by a layout map (as `keras.distribution.ModelParallel`),
a preset of `ParallelStrategy` on Keras's mesh as given."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

from jstrategy._src import flax_annotations
from jstrategy._src import mesh as mesh_lib
from jstrategy._src.activation_rows import TensorActivations
from jstrategy._src.context_parallel.axis import CONTEXT_AXIS
from jstrategy._src.cross_device_ops import CrossDeviceOps
from jstrategy._src.layout_map import LayoutMap
from jstrategy._src.mesh import DeviceMesh
from jstrategy._src.offload import OffloadPolicy
from jstrategy._src.strategies.parallel import MeshPlan
from jstrategy._src.strategies.parallel import ParallelStrategy
from jstrategy._src.strategies.parallel import entry_axes
from jstrategy._src.strategies.sharded import ShardedStrategy

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver
    from jstrategy._src.collective_util import CommunicationOptions

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(ParallelStrategy):
    """Variables laid out over a multi-axis mesh by a `LayoutMap`; the batch split over one axis.

    Which layout a leaf of a train state gets (`variable_sharding`): a parameter (a leaf
    under ``params``) is looked up by its path without ``params``, joined by ``/``
    (``Dense_0/kernel``), with Keras's semantics: the key equal to the path, else the one
    key whose regex `re.search` finds in it, else replicated; its layout must fit its
    shape. Any other leaf (an optimizer moment ``opt_state/1/0/mu/Dense_0/kernel``) takes
    the layout of the parameter whose path ends its own where it fits, else replicated.

    A mesh axis named ``"context"`` splits sequences (context parallelism, as under
    `ParallelStrategy`). Inside `run` a replica is one entry of `batch_dim_name`; the
    mesh's other axes are automatic (XLA partitions the computation over them).

    Args:
      layout_map: the `LayoutMap`; its `device_mesh` is the strategy's mesh.
      batch_dim_name: the mesh axis the batch is split over (the data axis, `axis_name`).
      cross_device_ops: how replicas' values are combined across the data axis; defaults
        to `NcclAllReduce(num_packs=0)`.
      cluster_resolver: the multi-process job to join; defaults to ``TF_CONFIG``'s when
        the mesh's devices are not known yet.
      communication_options: `jstrategy.experimental.CommunicationOptions` for the job.
      offload_optimizer, offload, tensor_activations: as `ParallelStrategy` (the tensor
        axis being ``"model"``).

    Raises:
      TypeError: if `layout_map` is not a `LayoutMap`, or `offload` not an `OffloadPolicy`.
      ValueError: if `batch_dim_name` is not an axis of the mesh, or is ``"context"``, or
        the offloading is invalid.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import jstrategy
    >>> mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    >>> layout_map = jstrategy.experimental.LayoutMap(mesh)
    >>> layout_map["Dense_0/kernel"] = (None, "model")
    >>> layout_map["Dense_1/kernel"] = ("model", None)
    >>> strategy = jstrategy.experimental.ModelParallelStrategy(layout_map)
    >>> strategy.num_replicas_in_sync, strategy.axis_name
    (2, 'batch')
    >>> kernel = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    >>> strategy.variable_sharding(kernel, ("params", "Dense_1", "kernel")).spec
    P('model', None)
    >>> strategy.variable_sharding(kernel, ("opt_state", "0", "mu", "Dense_1", "kernel")).spec
    P('model', None)
    """

    def __init__(
        self,
        layout_map: LayoutMap,
        *,
        batch_dim_name: str = "batch",
        logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        offload_optimizer: bool = False,
        offload: OffloadPolicy | None = None,
        tensor_activations: TensorActivations | str = TensorActivations.FEATURES,
    ):
        tensor_activations = TensorActivations.of(tensor_activations)
        if not isinstance(layout_map, LayoutMap):
            raise TypeError(
                f"`layout_map` must be a jstrategy.experimental.LayoutMap; got "
                f"{type(layout_map).__name__} {layout_map!r}. Build one with "
                "LayoutMap(DeviceMesh(shape, axis_names)) and set its layouts."
            )
        mesh = layout_map.device_mesh
        if not isinstance(batch_dim_name, str) or batch_dim_name not in mesh.axis_names:
            raise ValueError(
                f"`batch_dim_name` must be an axis of the layout map's mesh, whose axes are "
                f"{mesh.axis_names}; got {batch_dim_name!r}. Pass the axis to split the "
                f"batch over, e.g. batch_dim_name={mesh.axis_names[0]!r}."
            )
        if batch_dim_name == CONTEXT_AXIS:
            raise ValueError(
                f"`batch_dim_name` must not be {CONTEXT_AXIS!r}: a mesh axis of that name "
                "splits every sequence (context parallelism), not the batch; got "
                f"batch_dim_name={batch_dim_name!r} on a mesh with axes {mesh.axis_names}. "
                "Name the batch axis otherwise, e.g. DeviceMesh(shape, ('batch', 'context'))."
            )
        self._rules = _check_rules(logical_axis_rules, mesh)
        if (
            not mesh_lib.devices_known(mesh)
            or cluster_resolver is not None
            or communication_options is not None
        ):
            # A mesh over every process's devices: join the job first (TF_CONFIG's).
            across = self._join_job(cluster_resolver, communication_options)
            if cross_device_ops is None:
                cross_device_ops = across  # across processes, or None for one
        jax_mesh = mesh_lib.auto_mesh(mesh)
        shape = dict(jax_mesh.shape)
        degrees = {"replicas": shape[batch_dim_name], "context": shape.get(CONTEXT_AXIS, 1)}
        degrees["tensor"] = math.prod(shape.values()) // math.prod(degrees.values())
        kept = frozenset({"replicas", "tensor"})
        plan = MeshPlan(tuple(degrees), kept, None, (batch_dim_name,), batch_dim_name)
        processes = sorted({d.process_index for d in jax_mesh.devices.flat})
        hosts = [[d for d in jax_mesh.devices.flat if d.process_index == p] for p in processes]
        self._build(
            plan,
            degrees,
            hosts,
            cross_device_ops,
            mesh=jax_mesh,
            offload=offload,
            offload_optimizer=offload_optimizer,
            tensor_activations=tensor_activations,
        )
        self._layout_map, self._device_mesh = layout_map, mesh  # Keras's axes (none renamed)

    @property
    def logical_axis_rules(self) -> tuple[tuple[str, Any], ...]:
        """The logical axis rules given to the strategy (``logical_axis_rules=``)."""
        return self._rules

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh (the layout map's)."""
        return self._device_mesh

    @property
    def batch_dim_name(self) -> str:
        """The mesh axis the batch is split over (`axis_name`)."""
        return self.axis_name

    #: Keras's reading: an annotation's axes are this mesh's own, a data axis its batch axis.
    annotation_axis = ShardedStrategy.annotation_axis

    def _tensor_layout(self, names: tuple[str, ...], shape: tuple[int, ...]) -> list[Any]:
        """The layout map's layout as written, else the annotation's; strict (the fold's
        only rule here: no stages, no FSDP)."""
        spec: list[Any] = [None] * len(shape)
        found = flax_annotations.find_layout(self, self._layout_map, names)
        if found is None:
            return spec
        axes = [a for entry in found.layout for a in entry_axes(entry)]
        missing = [] if found.from_map else [a for a in axes if a not in self.mesh.axis_names]
        if missing and found.is_parameter:
            raise ValueError(
                f"Variable {found.path!r} is annotated (nn.with_partitioning, "
                f"nnx.with_partitioning or logical names mapped by logical axis rules) "
                f"with {tuple(found.layout)}, which names mesh axes {missing} that the mesh "
                f"lacks; its axes are {self.mesh.axis_names}. Name the mesh's axes in "
                "the annotation, map logical names to them with logical_axis_rules=, or "
                "override the variable's layout with a LayoutMap entry."
            )
        if not missing:
            fitted = found.fitted(found.layout, shape, self.mesh.shape, strict=True)
            spec[: len(fitted or ())] = list(fitted or ())
        return spec

    def __repr__(self) -> str:
        return self._with_offload(
            f"ModelParallelStrategy(mesh={self.device_mesh!r}, "
            f"batch_dim_name={self.axis_name!r}, layouts={len(self._layout_map or ())})"
        )


def _check_rules(rules: Any, mesh: DeviceMesh) -> tuple[tuple[str, Any], ...]:
    """`rules` as a tuple of ``(logical name, mesh axes)`` pairs, each axis in `mesh`."""
    if rules is None:
        return ()
    example = "e.g. logical_axis_rules=[('batch', 'batch'), ('hidden', 'model'), ('embed', None)]"
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(
            f"`logical_axis_rules` must be a sequence of (logical name, mesh axes) pairs, "
            f"{example}; got {type(rules).__name__} {rules!r}."
        )
    checked = []
    for rule in rules:
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise TypeError(
                f"Each of `logical_axis_rules` must be a (logical name, mesh axes) pair, "
                f"{example}; got {rule!r}."
            )
        name, target = rule
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        if not all(isinstance(a, str) for a in axes):
            raise TypeError(
                f"The logical axis rule {rule!r} must map {name!r} to a mesh axis name, a "
                "tuple of them, or None."
            )
        missing = [a for a in axes if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"The logical axis rule {rule!r} names mesh axes {missing} that the mesh "
                f"lacks; its axes are {mesh.axis_names}. Map {name!r} to one of them, or to "
                "None to keep that dimension whole."
            )
        checked.append((name, target if isinstance(target, str) or target is None else axes))
    return tuple(checked)
