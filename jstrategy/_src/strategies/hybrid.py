"""`HybridStrategy`: model replicas x FSDP shards x tensor shards on one 3-D mesh (HSDP x TP).

The mesh has the axes ``("replica", "fsdp", "tensor")``. A *replica* (the data axis,
`axis_name`, as for `ModelParallelStrategy`) is one copy of the model, spread over
``fsdp x tensor`` devices; variables are split over ``"fsdp"`` (ZeRO-3, as
`FSDPStrategy`) on a dimension the tensor layout leaves free, and over ``"tensor"`` as a
`LayoutMap` or the model's Flax annotations say (as `ModelParallelStrategy`). Each
replica's rows are split over its ``"fsdp"`` devices too inside a train step (both are data
parallel), so every device computes on ``batch / (replicas x fsdp)`` rows.

Each degree is split, as MaxText's ``ici_*_parallelism`` / ``dcn_*_parallelism``, into a
within-host part and an across-host part (``dcn_*``): the devices are grouped by host
(process) and the mesh is laid so that each host's devices are contiguous along each axis's
within-host part. With the defaults, the replicas cross the hosts and FSDP and tensor stay
within one: the slow links carry one gradient all-reduce per step, never a layer's
all-gather (torchtitan's and PyTorch's HSDP).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import devices as devices_lib
from jstrategy._src import flax_annotations
from jstrategy._src import staging
from jstrategy._src.collective_util import CommunicationOptions
from jstrategy._src.layout_map import LayoutMap
from jstrategy._src.layout_map import misfit
from jstrategy._src.mesh import DeviceMesh
from jstrategy._src.offload import OffloadPolicy
from jstrategy._src.strategies.fsdp import DEFAULT_MIN_SHARD_SIZE
from jstrategy._src.strategies.fsdp import check_min_shard_size
from jstrategy._src.strategies.fsdp import shard_dim
from jstrategy._src.strategies.sharded import ShardedStrategy
from jstrategy._src.strategy import REPLICA_AXIS
from jstrategy._src.validation import check_number

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver

__all__ = ["FSDP_AXIS", "TENSOR_AXIS", "HybridStrategy"]

#: The mesh axis variables are split over by FSDP (ZeRO-3), within a replica.
FSDP_AXIS = "fsdp"
#: The mesh axis of tensor (Megatron-style) parallelism.
TENSOR_AXIS = "tensor"

#: What another mesh's axis names mean here (annotations, layout maps, logical rules): a
#: model axis is the tensor axis; a data axis is FSDP's (variables are never split over the
#: replicas, which hold whole copies).
_AXIS_ALIASES = {
    "model": TENSOR_AXIS,
    TENSOR_AXIS: TENSOR_AXIS,
    **{name: FSDP_AXIS for name in flax_annotations.DATA_AXES},
}


class HybridStrategy(ShardedStrategy):
    """Replicas x FSDP x tensor parallelism on one mesh, each degree split across hosts.

    The mesh is ``(replicas, fsdp, tensor)`` with axes ``("replica", "fsdp", "tensor")``.

    * **replicas** (`num_replicas_in_sync`, the data axis `axis_name` = ``"replica"``):
      whole copies of the model. Each takes its rows of every batch; gradients are
      all-reduced over this axis. `run`, the replica context, `reduce` and distributed
      datasets work over it as under `ModelParallelStrategy`: a replica is a group of
      ``fsdp x tensor`` devices, XLA partitioning its computation over them.
    * **fsdp**: within a replica, variables with at least `min_shard_size` elements are
      split over this axis (ZeRO-3) along their largest dimension that divides by `fsdp`
      and that the tensor layout does not split (or along the dimension a Flax annotation
      names with a data axis: ``"data"``, ``"fsdp"``, ``"batch"``); optimizer moments
      follow their parameters. Inside a train step each replica's rows are split over it
      too, so a global batch divides by ``replicas x fsdp`` (`batch_multiple`; `Model.fit`
      pads to it).
    * **tensor**: variables split as `layout_map` says (keys matched as for
      `ModelParallelStrategy`), else as the model's Flax annotations (``nn.with_partitioning``,
      logical axis rules) say, where an annotation's ``"model"`` or ``"tensor"`` axis
      means this one.

    **Hosts.** Each degree is the product of a within-host part and an across-host part
    (`dcn_replicas`, `dcn_fsdp`, `dcn_tensor`, as MaxText's ``dcn_*_parallelism``; the
    within-host part is the degree over it, MaxText's ``ici_*``). The devices are cut into
    ``dcn_replicas x dcn_fsdp x dcn_tensor`` hosts: with several processes each host is
    one process's devices (so the product must equal the number of processes); in one
    process, a host is a group of neighbouring devices (``devices[0:k]``, ``devices[k:2k]``,
    ...), which is how one process over fake devices stands in for several hosts. The mesh
    is laid out as `jax.experimental.mesh_utils.create_hybrid_device_mesh` lays one: a
    host's devices are contiguous along each axis's within-host part (within a host they
    are in `devices` order, as JAX lists them: no TPU-topology-aware order, which
    `mesh_utils.create_device_mesh` would give a TPU slice). By default the
    replicas alone cross hosts (``dcn_replicas`` = the number of processes), so an FSDP
    all-gather or a tensor collective never leaves a host and the only collective across
    hosts is the replicas' gradient all-reduce.

    Which degree to grow: tensor parallelism costs collectives in every layer's forward
    and backward pass and suits the fastest links (within a host) and wide layers; FSDP
    costs an all-gather per layer (and a reduce-scatter of its gradient) and divides the
    parameters and optimizer state; replicas cost one gradient all-reduce per step and
    divide nothing. Grow FSDP until the state fits, tensor when a replica's activations do
    not, and replicas for throughput across hosts.

    Args:
      replicas: the number of model replicas (data-parallel groups); -1 means the devices
        left over by `fsdp` and `tensor`.
      fsdp: the FSDP degree: how many devices of a replica split its variables and rows;
        -1 means the rest.
      tensor: the tensor-parallel degree; -1 means the rest.
      dcn_replicas: how many hosts the replicas are spread over (the across-host part of
        `replicas`); None means the number of processes over ``dcn_fsdp x dcn_tensor``.
      dcn_fsdp: how many hosts FSDP's split spans (1: each all-gather within a host).
      dcn_tensor: how many hosts the tensor split spans (1: within a host).
      layout_map: the tensor layouts: a `LayoutMap` whose layouts name ``"tensor"`` or
        ``"model"`` (and optionally ``"fsdp"``, ``"data"`` or ``"batch"`` for the FSDP
        split) axes; its own mesh's shape is not used. None: the Flax annotations only.
      min_shard_size: the fewest elements a variable needs to be split over ``"fsdp"``.
      devices: the devices (TF-style strings or `jax.Device` objects), in host order. None
        means every device of every process of the job.
      cluster_resolver: the job to join, as for `FSDPStrategy`; defaults to
        `TFConfigClusterResolver()` when `devices` is None.
      communication_options: `jstrategy.experimental.CommunicationOptions` for the job.
      offload_optimizer: keep the optimizer state in host memory between steps (laid out
        as above), moved to device memory for the update inside the compiled step:
        ``offload=OffloadPolicy()``.
      offload: a `jstrategy.experimental.OffloadPolicy`: which variables live in host
        memory between steps.

    Raises:
      ValueError: if a degree is not a positive int (or -1), the degrees do not multiply
        to the number of devices, an across-host part does not divide its degree, the
        hosts do not match the processes, `layout_map` names an axis this mesh cannot
        mean, or offloading is asked twice or on devices without host memory.
      TypeError: if `layout_map` is not a `LayoutMap`, or `offload` not an `OffloadPolicy`.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import jstrategy
    >>> mesh = jstrategy.experimental.DeviceMesh((2, 2, 2), ("replica", "fsdp", "tensor"))
    >>> layout_map = jstrategy.experimental.LayoutMap(mesh)
    >>> layout_map["Dense_0/kernel"] = (None, "tensor")
    >>> strategy = jstrategy.experimental.HybridStrategy(
    ...     replicas=2, fsdp=2, tensor=2, dcn_replicas=2, layout_map=layout_map,
    ...     min_shard_size=0)
    >>> dict(strategy.mesh.shape), strategy.num_replicas_in_sync, strategy.batch_multiple
    ({'replica': 2, 'fsdp': 2, 'tensor': 2}, 2, 4)
    >>> kernel = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    >>> strategy.variable_sharding(kernel, ("params", "Dense_0", "kernel")).spec
    P('fsdp', 'tensor')
    >>> strategy.hosts  # two groups of four devices, each one replica
    ((0, 1, 2, 3), (4, 5, 6, 7))
    """

    def __init__(
        self,
        *,
        replicas: int = -1,
        fsdp: int = 1,
        tensor: int = 1,
        dcn_replicas: int | None = None,
        dcn_fsdp: int = 1,
        dcn_tensor: int = 1,
        layout_map: LayoutMap | None = None,
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        devices: Sequence[devices_lib.DeviceSpec] | None = None,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        offload_optimizer: bool = False,
        offload: OffloadPolicy | None = None,
    ):
        degrees = {"replicas": replicas, "fsdp": fsdp, "tensor": tensor}
        for name, value in degrees.items():
            if value != -1:
                check_number(
                    value,
                    name,
                    integer=True,
                    low=1,
                    expected="a positive int, or -1 for the devices the other degrees leave",
                    fix=f"Pass e.g. {name}=2.",
                )
        rest = [name for name, value in degrees.items() if value == -1]
        if len(rest) > 1:
            raise ValueError(
                f"At most one of `replicas`, `fsdp` and `tensor` may be -1 (the devices the "
                f"others leave); got {degrees}. Give all but one of them."
            )
        across = {"dcn_fsdp": dcn_fsdp, "dcn_tensor": dcn_tensor}
        if dcn_replicas is not None:
            across = {"dcn_replicas": dcn_replicas, **across}
        for name, value in across.items():
            check_number(
                value,
                name,
                integer=True,
                low=1,
                expected="a positive int (how many hosts that degree spans)",
                fix=f"Pass e.g. {name}=1 to keep that degree within a host.",
            )
        check_min_shard_size(min_shard_size)
        if layout_map is not None and not isinstance(layout_map, LayoutMap):
            raise TypeError(
                f"`layout_map` must be a jstrategy.experimental.LayoutMap or None; got "
                f"{type(layout_map).__name__} {layout_map!r}. Build one with "
                "LayoutMap(DeviceMesh(shape, ('replica', 'fsdp', 'tensor')))."
            )
        _check_layout_axes(layout_map)
        cross_device_ops = None  # across processes, when it joins a job of several
        if devices is None or cluster_resolver is not None or communication_options is not None:
            cross_device_ops = self._join_job(cluster_resolver, communication_options)
        # After joining (a mesh of JAX's devices would start its backends before).
        self._layouts = _mapped_layouts(layout_map)
        resolved = list(jax.devices() if devices is None else devices_lib.resolve_devices(devices))
        n = len(resolved)
        if rest:
            known = math.prod(v for v in degrees.values() if v != -1)
            if n % known:
                raise ValueError(
                    f"The degrees {degrees} leave no whole number of devices for "
                    f"`{rest[0]}`=-1: {n} devices do not divide by {known}. Give degrees "
                    f"whose product divides {n}."
                )
            degrees[rest[0]] = n // known
        if math.prod(degrees.values()) != n:
            raise ValueError(
                f"`replicas` x `fsdp` x `tensor` must be the number of devices, {n}; got "
                f"{degrees} (product {math.prod(degrees.values())}). Change a degree, or "
                "pass -1 for one of them to take the rest."
            )
        processes = len({d.process_index for d in resolved})
        defaulted = dcn_replicas is None
        if dcn_replicas is None:
            # One host per process; the hosts FSDP and tensor do not span hold replicas.
            dcn_replicas = max(processes // (dcn_fsdp * dcn_tensor), 1)
        dcn = {"replicas": dcn_replicas, "fsdp": dcn_fsdp, "tensor": dcn_tensor}
        for name, part in dcn.items():
            if degrees[name] % part:
                why = (
                    f"dcn_replicas={part} (by default, the {processes} processes over "
                    "dcn_fsdp x dcn_tensor)"
                    if defaulted and name == "replicas"
                    else f"dcn_{name}={part}"
                )
                raise ValueError(
                    f"`dcn_{name}` (how many hosts `{name}` spans) must divide `{name}`, "
                    f"{degrees[name]}; got {why}. Pass a divisor of {degrees[name]}, e.g. "
                    f"dcn_{name}=1, and spread another degree over the hosts (dcn_fsdp= or "
                    "dcn_tensor=)."
                )
        hosts = _host_groups(resolved, math.prod(dcn.values()), processes, dcn)
        mesh = _hybrid_mesh(hosts, degrees, dcn)
        super().__init__(mesh, cross_device_ops=cross_device_ops, data_axis=REPLICA_AXIS)
        self._hosts = tuple(tuple(d.id for d in host) for host in hosts)
        self._min_shard_size = min_shard_size
        self._degrees = degrees
        self._dcn = dcn
        self._set_offload(offload, offload_optimizer)

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The device ids of each host, in host order: one process's devices each, or in one
        process groups of neighbouring devices (see the class's "Hosts")."""
        return self._hosts

    @property
    def degrees(self) -> dict[str, int]:
        """``{"replicas": r, "fsdp": f, "tensor": t}``, -1 resolved."""
        return dict(self._degrees)

    @property
    def dcn_degrees(self) -> dict[str, int]:
        """The across-host part of each degree (MaxText's ``dcn_*_parallelism``)."""
        return dict(self._dcn)

    @property
    def min_shard_size(self) -> int:
        """The fewest elements a variable must have to be split over ``"fsdp"``."""
        return self._min_shard_size

    @property
    def batch_multiple(self) -> int:
        """``replicas x fsdp``: each replica's rows are split over its FSDP devices.

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.HybridStrategy(fsdp=4).batch_multiple
        8
        """
        return self.num_replicas_in_sync * int(self.mesh.shape[FSDP_AXIS])

    @property
    def activation_rows(self) -> tuple[str, ...]:
        """``("replica", "fsdp")``: a marked block's input split by rows as the step splits
        the batch (see `Strategy.activation_rows`).

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.HybridStrategy(fsdp=4).activation_rows
        ('replica', 'fsdp')
        """
        return (REPLICA_AXIS, FSDP_AXIS)

    def annotation_axis(self, name: str) -> str | None:
        """An axis of the mesh means itself; another mesh's model axis (``"model"``) the
        tensor axis, its data axes (``"data"``, ``"batch"``) FSDP's: variables are never
        split over the replicas, and a model's constraint on its rows splits them over
        ``"fsdp"`` within each replica.

        Example:

        >>> import jstrategy
        >>> strategy = jstrategy.experimental.HybridStrategy(fsdp=2, tensor=2)
        >>> [strategy.annotation_axis(a) for a in ("model", "data", "replica", "stage")]
        ['tensor', 'fsdp', 'replica', None]
        """
        if name in self.mesh.axis_names:
            return name
        return _AXIS_ALIASES.get(name)

    def variable_sharding(
        self, leaf: jax.ShapeDtypeStruct | jax.Array, path: tuple[str, ...] = ()
    ) -> jax.sharding.Sharding:
        """The tensor layout (`layout_map`'s, else the Flax annotation's), plus FSDP's split.

        Args:
          leaf: the variable's shape and dtype.
          path: the variable's keys in the state (a parameter's optimizer moments follow it).

        Returns:
          ``NamedSharding(mesh, spec)``, never split over ``"replica"``.

        Raises:
          ValueError: if a parameter's `layout_map` layout does not fit its shape (the
            message names the path, the shape and the axis).
        """
        shape = tuple(leaf.shape)
        names = tuple(str(k) for k in path)
        spec = self._tensor_layout(names, shape)
        used = tuple(i for i, entry in enumerate(spec) if entry is not None)
        if FSDP_AXIS in {a for entry in spec if entry is not None for a in _axes(entry)}:
            return NamedSharding(self.mesh, P(*spec))
        dim = shard_dim(shape, int(self.mesh.shape[FSDP_AXIS]), self._min_shard_size, exclude=used)
        if dim is not None:
            spec[dim] = FSDP_AXIS
        if all(entry is None for entry in spec):
            return self.replicated_sharding()
        return NamedSharding(self.mesh, P(*spec))

    def _tensor_layout(self, names: tuple[str, ...], shape: tuple[int, ...]) -> list[Any]:
        """The leaf's layout on this mesh from the layout map or its annotation, one entry
        per dimension (None where nothing is split)."""
        is_parameter, candidates = flax_annotations.candidate_paths(names)
        layout, source = None, ""
        if self._layouts is not None:
            for candidate in candidates:
                key, found = self._layouts.lookup(candidate)
                if found is not None:
                    layout, source = found, f"the layout {tuple(found)} of LayoutMap key {key!r}"
                    break
        if layout is None:
            annotated = flax_annotations.annotation(self, names)
            if annotated is not None:
                layout = P(*(self._on_mesh(entry) for entry in annotated[1]))
                source = f"its Flax sharding annotation {tuple(annotated[1])}"
        spec: list[Any] = [None] * len(shape)
        if layout is None:
            return spec
        problem = misfit(layout, shape, self.mesh.shape)
        if problem is not None:
            if is_parameter and self._layouts is not None and source.startswith("the layout"):
                raise ValueError(
                    f"Variable {'/'.join(names)!r} of shape {shape} does not fit {source}: "
                    f"{problem}. Change the layout, or the variable's shape."
                )
            return spec  # an annotation for another mesh, or a moment of another shape
        spec[: len(layout)] = list(layout)
        return spec

    def _on_mesh(self, entry: Any) -> Any:
        """An annotation's entry for one dimension, its axes read on this mesh."""
        if entry is None:
            return None
        mapped = tuple(dict.fromkeys(a for a in map(self.annotation_axis, _axes(entry)) if a))
        mapped = tuple(a for a in mapped if a != REPLICA_AXIS)  # replicas hold whole copies
        if not mapped:
            return None
        return mapped[0] if len(mapped) == 1 else mapped

    def stage_train_step(
        self, fns: staging.StepFunctions, *, steps: int = 0, stacked: bool = True
    ) -> staging.TrainProgram:
        """`ShardedStrategy`'s program, each batch's rows split over ``("replica", "fsdp")``
        at the step's start (each device slices the rows its replica holds: no transfer)."""
        if fns.global_gradients is not None and int(self.mesh.shape[FSDP_AXIS]) > 1:
            rows = NamedSharding(self.mesh, P((REPLICA_AXIS, FSDP_AXIS)))
            fns = dataclasses.replace(
                fns, global_gradients=_rows_over_fsdp(fns.global_gradients, rows)
            )
        return super().stage_train_step(fns, steps=steps, stacked=stacked)

    def __repr__(self) -> str:
        d, c = self._degrees, self._dcn
        return self._with_offload(
            f"HybridStrategy(replicas={d['replicas']}, fsdp={d['fsdp']}, tensor={d['tensor']}, "
            f"dcn_replicas={c['replicas']}, dcn_fsdp={c['fsdp']}, dcn_tensor={c['tensor']}, "
            f"min_shard_size={self._min_shard_size})"
        )


def _axes(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _rows_over_fsdp(
    global_gradients: Callable[..., Any], rows: NamedSharding
) -> Callable[..., Any]:
    """`global_gradients` on a batch whose rows are constrained to `rows`."""

    def gradients(params: Any, rest: Any, batch: Any, mask: Any) -> Any:
        batch, mask = jax.lax.with_sharding_constraint((batch, mask), rows)
        return global_gradients(params, rest, batch, mask)

    return gradients


def _check_layout_axes(layout_map: LayoutMap | None) -> None:
    """Refuses a layout naming an axis this mesh cannot mean (before any work)."""
    for key in layout_map or ():
        layout = layout_map[key] if layout_map is not None else None
        for axis in (a for entry in layout or () if entry is not None for a in _axes(entry)):
            if axis not in _AXIS_ALIASES:
                raise ValueError(
                    f"LayoutMap key {key!r} names mesh axis {axis!r} in {tuple(layout or ())}; "
                    f"HybridStrategy splits variables over {TENSOR_AXIS!r} (also written "
                    f"'model') and {FSDP_AXIS!r} (also 'data' or 'batch') only, never over "
                    "the replicas. Name one of those axes."
                )


def _mapped_layouts(layout_map: LayoutMap | None) -> LayoutMap | None:
    """`layout_map`'s layouts, their axes renamed to this mesh's (``"model"`` to
    ``"tensor"``, a data axis to ``"fsdp"``), in a `LayoutMap` over the hybrid axes."""
    if layout_map is None:
        return None
    # A mesh of one device per axis only names the axes: the layouts' sizes are the
    # strategy's (checked per variable by `misfit`); its devices are never read.
    target = LayoutMap(DeviceMesh((1, 1, 1), (REPLICA_AXIS, FSDP_AXIS, TENSOR_AXIS), [[[_any()]]]))
    for key in layout_map:
        layout = layout_map[key]
        target[key] = tuple(
            None if entry is None else _one_or_tuple([_AXIS_ALIASES[a] for a in _axes(entry)])
            for entry in layout or ()
        )
    return target


def _one_or_tuple(axes: list[str]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else tuple(axes)


def _any() -> jax.Device:
    return jax.local_devices()[0]


def _host_groups(
    devices: list[jax.Device], hosts: int, processes: int, dcn: dict[str, int]
) -> list[list[jax.Device]]:
    """The devices cut into `hosts` groups of neighbours, each within one process."""
    # Each across-host part divides its degree, so `hosts` divides the devices.
    spec = ", ".join(f"dcn_{k}={v}" for k, v in dcn.items())
    if processes > 1 and hosts != processes:
        raise ValueError(
            f"The across-host parts ({spec}) make {hosts} hosts, but the job has "
            f"{processes} processes, one per host. Give across-host parts that multiply to "
            f"{processes} (e.g. dcn_replicas={processes})."
        )
    ordered = sorted(devices, key=lambda d: d.process_index) if processes > 1 else devices
    size = len(devices) // hosts
    groups = [ordered[i * size : (i + 1) * size] for i in range(hosts)]
    for group in groups:
        if len({d.process_index for d in group}) > 1:
            raise ValueError(
                f"A host's devices must belong to one process, but the {size} devices "
                f"{[d.id for d in group]} span processes "
                f"{sorted({d.process_index for d in group})} (the processes hold unequal "
                "numbers of the devices). Give every process as many devices."
            )
    return groups


def _hybrid_mesh(
    hosts: list[list[jax.Device]], degrees: dict[str, int], dcn: dict[str, int]
) -> Mesh:
    """The ``("replica", "fsdp", "tensor")`` mesh: the hosts on a ``dcn`` grid, each
    host's devices on the within-host grid, as `mesh_utils.create_hybrid_device_mesh`."""
    order = ("replicas", "fsdp", "tensor")
    ici = [degrees[k] // dcn[k] for k in order]
    # Host h is cell h of the dcn grid (row-major), its devices its ici grid (row-major).
    flat = np.empty(sum(len(h) for h in hosts), dtype=object)
    flat[:] = [d for host in hosts for d in host]
    cells = flat.reshape(*(dcn[k] for k in order), *ici)
    # (dcn_r, dcn_f, dcn_t, ici_r, ici_f, ici_t) -> (dcn_r, ici_r, dcn_f, ici_f, dcn_t, ici_t)
    devices = cells.transpose(0, 3, 1, 4, 2, 5).reshape([degrees[k] for k in order])
    return Mesh(devices, (REPLICA_AXIS, FSDP_AXIS, TENSOR_AXIS), axis_types=(AxisType.Auto,) * 3)
