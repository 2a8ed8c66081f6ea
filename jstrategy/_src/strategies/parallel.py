"""`ParallelStrategy`: every parallel degree on one mesh, each split across hosts, and its
`MeshPlan` (what a preset's mesh holds), shared by the presets.
"""

from __future__ import annotations

import dataclasses
import math
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
from jstrategy._src.activation_rows import TensorActivations
from jstrategy._src.axes import CONTEXT_AXIS
from jstrategy._src.axes import EXPERT_AXIS
from jstrategy._src.axes import FSDP_AXIS
from jstrategy._src.axes import REPLICA_AXIS
from jstrategy._src.axes import STAGE_AXIS
from jstrategy._src.axes import TENSOR_AXIS
from jstrategy._src.collective_util import CommunicationOptions
from jstrategy._src.layout_map import LayoutMap
from jstrategy._src.mesh import DeviceMesh
from jstrategy._src.moe.axis import EXPERT_HIDDEN
from jstrategy._src.offload import OffloadPolicy
from jstrategy._src.pipeline.schedules import PipelineConfig
from jstrategy._src.pipeline.schedules import PipelineSchedule
from jstrategy._src.pipeline.schedules import check_pipeline
from jstrategy._src.pipeline.schedules import is_stacked
from jstrategy._src.pipeline.schedules import layers_error
from jstrategy._src.strategies.sharded import ShardedStrategy
from jstrategy._src.validation import check_number

if TYPE_CHECKING:
    from jstrategy._src.cluster.resolver import ClusterResolver
    from jstrategy._src.cross_device_ops import CrossDeviceOps

__all__ = [
    "DEFAULT_MIN_SHARD_SIZE",
    "FSDP_AXIS",
    "TENSOR_AXIS",
    "ParallelStrategy",
    "check_min_shard_size",
    "entry_axes",
    "shard_dim",
]

#: Variables with fewer elements stay whole: gathering a bias or a norm's scale costs a
#: collective per use and saves next to nothing.
DEFAULT_MIN_SHARD_SIZE = 1024

#: The degrees in mesh order (the argument's name, its mesh axis); an optional axis is in
#: the mesh only when its degree is above one.
_DEGREES = (
    ("replicas", REPLICA_AXIS),
    ("stages", STAGE_AXIS),
    ("fsdp", FSDP_AXIS),
    ("experts", EXPERT_AXIS),
    ("context", CONTEXT_AXIS),
    ("tensor", TENSOR_AXIS),
)
_OPTIONAL = ("stages", "experts", "context")


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """What a preset's mesh holds and what its axes do; the rest of the strategy is shared.

    Attributes:
      order: the degrees in mesh order (names as `ParallelStrategy`'s arguments).
      kept: the degrees whose axis is in the mesh even at degree one.
      fsdp: the mesh axis FSDP's split runs over; None for none.
      rows: the mesh axes a batch's rows are split over (those in the mesh).
      data: the data axis (the replicas').
    """

    order: tuple[str, ...]
    kept: frozenset[str]
    fsdp: str | None
    rows: tuple[str, ...]
    data: str = REPLICA_AXIS

    def axes(self, degrees: dict[str, int]) -> tuple[str, ...]:
        """The mesh's axis names for `degrees`."""
        return tuple(_AXIS_OF[k] for k in self.order if k in self.kept or degrees[k] > 1)


_AXIS_OF = dict(_DEGREES)
_SPEC = MeshPlan(
    order=tuple(name for name, _ in _DEGREES),
    kept=frozenset({"replicas", "fsdp", "tensor"}),
    fsdp=FSDP_AXIS,
    rows=(REPLICA_AXIS, FSDP_AXIS, EXPERT_AXIS),
)

#: What another mesh's axis names mean here (annotations, layout maps, logical rules): a
#: model axis is the tensor axis; a data axis is FSDP's (variables are never split over the
#: replicas, which hold whole copies).
_AXIS_ALIASES = {
    "model": TENSOR_AXIS,
    TENSOR_AXIS: TENSOR_AXIS,
    EXPERT_AXIS: EXPERT_AXIS,
    **{name: FSDP_AXIS for name in flax_annotations.DATA_AXES},
}


class ParallelStrategy(ShardedStrategy):
    """Replicas x FSDP x experts x context x tensor on one mesh, each degree across hosts.

    One spec of degrees (MaxText's ``ici_*``/``dcn_*``, torchtitan's ``ParallelDims``):

    * **replicas** (`num_replicas_in_sync`, the data axis ``"replica"``): whole copies of
      the model (each a group of devices), gradients all-reduced over them.
    * **fsdp**: variables with at least `min_shard_size` elements split (ZeRO-3) along
      their largest dimension that divides and the tensor layout leaves free; each
      replica's rows split over it too.
    * **experts**: the expert layers' experts (annotated ``"expert"``) split over it,
      tokens sent with ``all_to_all``; rows and FSDP's split span it too.
    * **context**: each sequence split over it, attention as a ring
      (`jstrategy.experimental.dot_product_attention`); FSDP's split spans it too.
    * **tensor**: variables split as `layout_map` says, else as the model's Flax
      annotations say (``"model"`` means ``"tensor"``).

    A global batch divides by ``replicas x fsdp x experts`` (`batch_multiple`), its
    sequence length by ``context``. Each degree is a within-host part times an across-host
    part (``dcn_*``; a host is one process's devices, or in one process a group of
    neighbouring devices); by default only the replicas cross hosts. Which degree to grow,
    and how hosts are laid out: docs/guides/large-models.md.

    Args:
      replicas: the number of model replicas (data-parallel groups); -1 means the devices
        left over by the other degrees.
      fsdp: the FSDP degree; -1 means the rest.
      tensor: the tensor-parallel degree; -1 means the rest.
      experts: the expert-parallel degree; it must divide each expert layer's experts.
      context: the context-parallel degree; it must divide the sequence length.
      dcn_replicas: how many hosts the replicas span; None means the number of processes
        over the other across-host parts.
      dcn_fsdp, dcn_tensor, dcn_experts, dcn_context: how many hosts that degree's split
        spans (1: within a host).
      layout_map: the tensor layouts: a `LayoutMap` naming ``"tensor"`` or ``"model"``
        (and optionally ``"fsdp"``, ``"data"``, ``"batch"``, ``"expert"``); its own
        mesh's shape is not used. None: the Flax annotations only.
      min_shard_size: the fewest elements a variable needs to be split over ``"fsdp"``.
      devices: the devices (TF-style strings or `jax.Device` objects), in host order. None
        means every device of every process of the job.
      cluster_resolver: the job to join; defaults to ``TF_CONFIG``'s when `devices` is None.
      communication_options: `jstrategy.experimental.CommunicationOptions` for the job.
      offload_optimizer: keep the optimizer state in host memory between steps.
      offload: a `jstrategy.experimental.OffloadPolicy`: which variables live in host
        memory between steps.
      tensor_activations: which dimension of the activations between blocks the step
        splits over ``"tensor"`` (`TensorActivations`): ``"features"`` under remat, or
        ``"sequence"`` (it needs ``tensor`` > 1 and no ``context``).

    Raises:
      ValueError: if a degree is not a positive int (or -1 where allowed), the degrees do
        not multiply to the number of devices, an across-host part does not divide its
        degree, the hosts do not match the processes, `layout_map` names an axis this
        mesh cannot mean, or offloading is asked twice or on devices without host memory.
      TypeError: if `layout_map` is not a `LayoutMap`, or `offload` not an `OffloadPolicy`.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.experimental.ParallelStrategy(
    ...     replicas=2, experts=2, tensor=2, min_shard_size=0)
    >>> dict(strategy.mesh.shape), strategy.batch_multiple
    ({'replica': 2, 'fsdp': 1, 'expert': 2, 'tensor': 2}, 4)
    >>> strategy.batch_sharding().spec
    P(('replica', 'fsdp', 'expert'),)
    """

    def __init__(
        self,
        *,
        replicas: int = -1,
        fsdp: int = 1,
        tensor: int = 1,
        experts: int = 1,
        context: int = 1,
        stages: int = 1,
        num_microbatches: int | None = None,
        schedule: PipelineSchedule | str = PipelineSchedule.GPIPE,
        num_repeats: int = 1,
        dcn_replicas: int | None = None,
        dcn_fsdp: int = 1,
        dcn_tensor: int = 1,
        dcn_experts: int = 1,
        dcn_context: int = 1,
        dcn_stages: int = 1,
        layout_map: LayoutMap | None = None,
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        devices: Sequence[devices_lib.DeviceSpec] | None = None,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        offload_optimizer: bool = False,
        offload: OffloadPolicy | None = None,
        tensor_activations: TensorActivations | str = TensorActivations.FEATURES,
    ):
        degrees = {"replicas": replicas, "fsdp": fsdp, "tensor": tensor}
        fixed = {"experts": experts, "context": context, "stages": stages}
        for name, value in {**degrees, **fixed}.items():
            if value != -1 or name in fixed:
                check_number(
                    value,
                    name,
                    integer=True,
                    low=1,
                    expected="a positive int"
                    + ("" if name in fixed else ", or -1 for the devices the other degrees leave"),
                    fix=f"Pass e.g. {name}=2.",
                )
        rest = [name for name, value in degrees.items() if value == -1]
        if len(rest) > 1:
            raise ValueError(
                f"At most one of `replicas`, `fsdp` and `tensor` may be -1 (the devices the "
                f"others leave); got {degrees}. Give all but one of them."
            )
        degrees = {name: {**degrees, **fixed}[name] for name, _ in _DEGREES}
        pipeline = _check_pipeline_settings(
            stages, num_microbatches, schedule, num_repeats, experts, context
        )
        given = {"replicas": dcn_replicas, "fsdp": dcn_fsdp, "tensor": dcn_tensor}
        given |= {"experts": dcn_experts, "context": dcn_context, "stages": dcn_stages}
        for name, part in given.items():
            if part is None:
                continue
            check_number(
                part,
                f"dcn_{name}",
                integer=True,
                low=1,
                expected="a positive int (how many hosts that degree spans)",
                fix=f"Pass e.g. dcn_{name}=1 to keep that degree within a host.",
            )
        check_min_shard_size(min_shard_size)
        tensor_activations = TensorActivations.of(tensor_activations)
        if layout_map is not None and not isinstance(layout_map, LayoutMap):
            raise TypeError(
                f"`layout_map` must be a jstrategy.experimental.LayoutMap or None; got "
                f"{type(layout_map).__name__} {layout_map!r}. Build one with "
                "LayoutMap(DeviceMesh(shape, ('replica', 'fsdp', 'tensor')))."
            )
        _check_layout_axes(layout_map, type(self).__name__)
        cross_device_ops, resolved = self._join_and_resolve(
            devices, cluster_resolver, communication_options
        )
        n = len(resolved)
        if rest:
            known = math.prod(v for v in degrees.values() if v != -1)
            if n % known:
                raise ValueError(
                    f"The degrees {self._shown(degrees)} leave no whole number of devices "
                    f"for `{rest[0]}`=-1: {n} devices do not divide by {known}. Give "
                    f"degrees whose product divides {n}."
                )
            degrees[rest[0]] = n // known
        if math.prod(degrees.values()) != n:
            names = " x ".join(f"`{k}`" for k in self._shown(degrees))
            raise ValueError(
                f"{names} must be the number of devices, {n}; got {self._shown(degrees)} "
                f"(product {math.prod(degrees.values())}). Change a degree, or pass -1 for "
                "one of them to take the rest."
            )
        processes = len({d.process_index for d in resolved})
        defaulted = dcn_replicas is None
        if dcn_replicas is None:
            # One host per process; the hosts the other degrees do not span hold replicas.
            others = dcn_fsdp * dcn_tensor * dcn_experts * dcn_context * dcn_stages
            dcn_replicas = max(processes // others, 1)
        dcn = {name: given[name] or dcn_replicas for name, _ in _DEGREES}  # only it is None
        for name, part in dcn.items():
            if degrees[name] % part:
                why = (
                    f"dcn_replicas={part} (by default, the {processes} processes over "
                    "the other across-host parts)"
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
        self._build(
            _SPEC,
            degrees,
            hosts,
            cross_device_ops,
            dcn=dcn,
            pipeline=pipeline,
            layout_map=layout_map,
            min_shard_size=min_shard_size,
            offload=offload,
            offload_optimizer=offload_optimizer,
            tensor_activations=tensor_activations,
        )

    def _build(
        self,
        plan: MeshPlan,
        degrees: dict[str, int],
        hosts: list[list[jax.Device]],
        cross_device_ops: CrossDeviceOps | None,
        *,
        mesh: Mesh | None = None,
        dcn: dict[str, int] | None = None,
        pipeline: tuple[int, int, PipelineSchedule, int] | None = None,
        layout_map: LayoutMap | None = None,
        min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
        offload: OffloadPolicy | None = None,
        offload_optimizer: bool = False,
        tensor_activations: TensorActivations = TensorActivations.FEATURES,
    ) -> None:
        """The one construction of this strategy and its presets, after their checks: over
        `hosts` (device groups) with `degrees` (resolved) laid out as `plan` says, or on
        `mesh` as given."""
        degrees = {name: degrees.get(name, 1) for name, _ in _DEGREES}
        dcn = dcn or dict.fromkeys(degrees, 1)
        self._plan = plan
        self._layout_map = layout_map
        self._layouts = _mapped_layouts(layout_map)
        mesh = mesh or _mesh(hosts, degrees, dcn, plan)
        super().__init__(mesh, cross_device_ops=cross_device_ops, data_axis=plan.data)
        self._hosts = tuple(tuple(d.id for d in host) for host in hosts)
        self._min_shard_size = min_shard_size
        self._degrees = degrees
        self._dcn = dcn
        self._set_options(offload, offload_optimizer, tensor_activations)
        self._pipeline: PipelineConfig | None = None
        if pipeline is not None:
            self._pipeline = PipelineConfig(*pipeline[:3], self.mesh, pipeline[3])

    @staticmethod
    def _shown(degrees: dict[str, int]) -> dict[str, int]:
        """`degrees` as a message shows them: the optional ones only when taken."""
        return {k: v for k, v in degrees.items() if k not in _OPTIONAL or v != 1}

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The device ids of each host, in host order."""
        return self._hosts

    @property
    def degrees(self) -> dict[str, int]:
        """Each degree, -1 resolved; the optional ones where above one."""
        order = ("replicas", "fsdp", "tensor", "experts", "context", "stages")
        kept, degrees = self._plan.kept, self._degrees
        return {
            k: degrees[k] for k in order if k in kept or (k in self._plan.order and degrees[k] > 1)
        }

    @property
    def dcn_degrees(self) -> dict[str, int]:
        """The across-host part of each degree (MaxText's ``dcn_*_parallelism``)."""
        return {k: self._dcn[k] for k in self.degrees}

    @property
    def pipeline(self) -> PipelineConfig | None:
        """The pipeline a `Repeated` block runs on when ``stages`` > 1, else None."""
        return self._pipeline

    @property
    def expert_parallelism(self) -> int:
        """The expert-parallel degree: the size of the ``"expert"`` axis (1 without one)."""
        return self._degrees["experts"]

    @property
    def logical_axis_rules(self) -> tuple[tuple[str, Any], ...]:
        """The expert layers' logical names: their experts on the expert axis, their
        hidden units on the tensor axis, where present.

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.ParallelStrategy(experts=2, tensor=2).logical_axis_rules
        (('expert', 'expert'), ('expert_hidden', 'tensor'))
        """
        rules: tuple[tuple[str, Any], ...] = ()
        if self._degrees["experts"] > 1:
            rules += ((EXPERT_AXIS, EXPERT_AXIS),)
        if self._degrees["tensor"] > 1:
            rules += ((EXPERT_HIDDEN, TENSOR_AXIS),)
        return rules

    @property
    def layout_map(self) -> LayoutMap | None:
        """The tensor layouts given (``layout_map=``), or None; its keys are checked
        against a model's variables as `ModelParallelStrategy`'s."""
        return self._layout_map

    @property
    def min_shard_size(self) -> int:
        """The fewest elements a variable must have to be split over ``"fsdp"``."""
        return self._min_shard_size

    @property
    def _row_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self._plan.rows if a in self.mesh.shape)

    @property
    def batch_multiple(self) -> int:
        """``replicas x fsdp x experts`` (times the microbatches).

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.HybridStrategy(fsdp=4).batch_multiple
        8
        """
        rows = math.prod(int(self.mesh.shape[a]) for a in self._row_axes)
        return rows * (1 if self._pipeline is None else self._pipeline.num_microbatches)

    def batch_sharding(self) -> NamedSharding:
        """Rows split over ``("replica", "fsdp")`` (and ``"expert"``): replica *i* owns the
        *i*-th slice of a global batch, cut over its FSDP (and expert) devices.

        Example:

        >>> import jstrategy
        >>> jstrategy.experimental.HybridStrategy(fsdp=4).batch_sharding().spec
        P(('replica', 'fsdp'),)
        """
        return NamedSharding(self.mesh, P(self._row_axes))

    def annotation_axis(self, name: str) -> str | None:
        """An axis of the mesh means itself; another mesh's model axis (``"model"``) the
        tensor axis, its data axes (``"data"``, ``"batch"``) FSDP's.

        Example:

        >>> import jstrategy
        >>> strategy = jstrategy.experimental.HybridStrategy(fsdp=2, tensor=2)
        >>> [strategy.annotation_axis(a) for a in ("model", "data", "replica", "stage")]
        ['tensor', 'fsdp', 'replica', None]
        """
        if name in self.mesh.axis_names:
            return name
        alias = _AXIS_ALIASES.get(name)
        if alias == FSDP_AXIS:  # a data axis: the one FSDP's split runs over, if any
            alias = self._plan.fsdp
        return alias if alias in self.mesh.axis_names else None

    def variable_sharding(
        self, leaf: jax.ShapeDtypeStruct | jax.Array, path: tuple[str, ...] = ()
    ) -> jax.sharding.Sharding:
        """Where the variable lives: a fold of the per-axis rules, each on what the last
        left free: a `Repeated` block's stacked layers over ``"stage"``, the tensor layout,
        FSDP's split (`shard_dim`), the offload policy's memory kind.

        Args:
          leaf: the variable's shape and dtype.
          path: the variable's keys in the state (a parameter's optimizer moments follow it).

        Returns:
          ``NamedSharding(mesh, spec)``.

        Raises:
          ValueError: if a parameter's `layout_map` layout does not fit its shape, or a
            stacked parameter's layers do not divide by the (virtual) stages.
        """
        names = tuple(str(k) for k in path)
        return self._in_memory(self._layout(tuple(leaf.shape), names), leaf, path)

    def _layout(self, shape: tuple[int, ...], names: tuple[str, ...]) -> NamedSharding:
        if self._stacked(names, shape):
            # A Repeated block's layers over the stages; each layer's own layout after.
            spec = [STAGE_AXIS, *self._tensor_layout(names, shape[1:])]
        else:
            spec = self._tensor_layout(names, shape)
        fsdp = self._plan.fsdp
        taken = {a for entry in spec if entry is not None for a in entry_axes(entry)}
        used = tuple(i for i, entry in enumerate(spec) if entry is not None)
        # FSDP's split spans the expert and context axes a layout leaves free (MaxText's
        # ``embed`` rule), where a dimension divides by all of them; else FSDP's alone.
        # (Axes of size one left out: XLA's partitioner fails on some programs that split
        # a dimension over a tuple of axes holding one of size one.)
        wide = tuple(
            a
            for a in (fsdp, EXPERT_AXIS, CONTEXT_AXIS)
            if a is not None and (a == fsdp or a not in taken) and self._size(a) > 1
        )
        if fsdp in taken:
            # A dimension the layout splits over FSDP's axis alone: widened where it divides.
            dim = spec.index(fsdp) if fsdp in spec else None
            widened = fsdp in wide and len(wide) > 1
            if dim is not None and widened and shape[dim] % self._size(*wide) == 0:
                spec[dim] = wide
        elif fsdp is not None:
            for split in (wide, (fsdp,)):
                size = self._size(*split)
                dim = shard_dim(shape, size, self._min_shard_size, exclude=used)
                if dim is not None and size > 1:
                    spec[dim] = split[0] if len(split) == 1 else split
                    break
        if all(entry is None for entry in spec):
            return self.replicated_sharding()
        return NamedSharding(self.mesh, P(*spec))

    def _size(self, *axes: str) -> int:
        return math.prod(int(self.mesh.shape.get(a, 1)) for a in axes)

    def _stacked(self, names: tuple[str, ...], shape: tuple[int, ...]) -> bool:
        """Whether the leaf is a `Repeated` block's stacked variable split over the stages
        (a stacked parameter whose layers they do not divide refused)."""
        pipeline = self._pipeline
        if pipeline is None or not shape or not is_stacked(names):
            return False
        if shape[0] % (pipeline.num_stages * pipeline.num_repeats) == 0:
            return True
        is_parameter, candidates = flax_annotations.candidate_paths(names)
        if is_parameter:
            what = (
                f"The repeated block's variable {candidates[0]!r} stacks {shape[0]} layers, which"
            )
            raise ValueError(layers_error(what, shape[0], pipeline))
        return False  # an optimizer leaf shaped otherwise: not split over the stages

    def _tensor_layout(self, names: tuple[str, ...], shape: tuple[int, ...]) -> list[Any]:
        """The leaf's layout on this mesh from the layout map or its annotation, one entry
        per dimension (None where nothing is split)."""
        spec: list[Any] = [None] * len(shape)
        found = flax_annotations.find_layout(self, self._layouts, names)
        if found is None:
            return spec
        layout = found.layout
        if found.from_map:
            # An optional axis at degree one ("expert") is not in the mesh: a layout map
            # naming it keeps that dimension whole, as a split over one device would.
            layout = P(*(self._present(entry) for entry in layout))
        else:
            layout = P(*(self._on_mesh(entry) for entry in layout))
        # A layout map is strict; an annotation may be written for another mesh.
        fitted = found.fitted(
            layout, shape, self.mesh.shape, strict=found.from_map, shown="/".join(names)
        )
        if fitted is not None:
            spec[: len(fitted)] = list(fitted)
        return spec

    def _present(self, entry: Any) -> Any:
        """A layout map's entry for one dimension without the axes this mesh lacks."""
        kept = tuple(a for a in entry_axes(entry or ()) if a in self.mesh.axis_names)
        return _one_or_tuple(list(kept)) if kept else None

    def _on_mesh(self, entry: Any) -> Any:
        """An annotation's entry for one dimension, its axes read on this mesh."""
        if entry is None:
            return None
        mapped = tuple(dict.fromkeys(a for a in map(self.annotation_axis, entry_axes(entry)) if a))
        # Replicas hold whole copies, unless they are FSDP's axis (`FSDPStrategy`).
        mapped = tuple(a for a in mapped if a != REPLICA_AXIS or a == self._plan.fsdp)
        return _one_or_tuple(list(mapped)) if mapped else None

    def __repr__(self) -> str:
        shown = self.degrees
        degrees = ", ".join(f"{k}={v}" for k, v in shown.items())
        dcn = ", ".join(f"dcn_{k}={self._dcn[k]}" for k in shown)
        pipeline = ""
        if self._pipeline is not None:
            p = self._pipeline
            pipeline = f", num_microbatches={p.num_microbatches}, schedule={p.schedule.value!r}"
            pipeline += f", num_repeats={p.num_repeats}" if p.num_repeats > 1 else ""
        return self._with_offload(
            f"{type(self).__name__}({degrees}{pipeline}, {dcn}, "
            f"min_shard_size={self._min_shard_size})"
        )


def _check_pipeline_settings(
    stages: int,
    microbatches: int | None,
    schedule: Any,
    repeats: int,
    experts: int,
    context: int,
) -> tuple[int, int, PipelineSchedule, int] | None:
    """The pipeline's settings checked (None without stages), before any work."""
    if stages == 1:
        if microbatches is not None or repeats != 1:
            raise ValueError(
                f"`num_microbatches` and `num_repeats` set a pipeline, which needs stages "
                f"> 1; got stages=1, num_microbatches={microbatches}, num_repeats={repeats}. "
                "Pass e.g. stages=2, or leave them out."
            )
        return None
    if microbatches is None:
        raise ValueError(
            f"A pipeline (stages={stages}) cuts each replica's rows into microbatches: "
            f"`num_microbatches` must be given; got None. Pass e.g. "
            f"num_microbatches={2 * stages}."
        )
    if experts > 1 or context > 1:
        raise ValueError(
            f"stages={stages} cannot be combined with experts={experts} or "
            f"context={context} yet: a pipeline's stages run the expert layers and ring "
            "attention densely. Pass experts=1 and context=1 with stages, or stages=1."
        )
    return check_pipeline(stages, microbatches, schedule, repeats)


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes a `PartitionSpec` entry names (None names none)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _check_layout_axes(layout_map: LayoutMap | None, strategy: str) -> None:
    """Refuses a layout naming an axis this mesh cannot mean (before any work)."""
    for key in layout_map or ():
        layout = layout_map[key] if layout_map is not None else None
        for axis in (a for entry in layout or () if entry is not None for a in entry_axes(entry)):
            if axis not in _AXIS_ALIASES:
                raise ValueError(
                    f"LayoutMap key {key!r} names mesh axis {axis!r} in {tuple(layout or ())}; "
                    f"{strategy} splits variables over {TENSOR_AXIS!r} (also written "
                    f"'model'), {FSDP_AXIS!r} (also 'data' or 'batch') and {EXPERT_AXIS!r} "
                    "only, never over the replicas. Name one of those axes."
                )


def _mapped_layouts(layout_map: LayoutMap | None) -> LayoutMap | None:
    """`layout_map`'s layouts, their axes renamed to this mesh's (``"model"`` to
    ``"tensor"``, a data axis to ``"fsdp"``), in a `LayoutMap` over the hybrid axes."""
    if layout_map is None:
        return None
    # A mesh of one device per axis only names the axes: the layouts' sizes are the
    # strategy's (checked per variable by `misfit`); its devices are never read.
    names = tuple(axis for _, axis in _DEGREES)
    one = np.empty((1,) * len(names), dtype=object)
    one.flat[0] = jax.local_devices()[0]
    target = LayoutMap(DeviceMesh(one.shape, names, one.tolist()))
    for key in layout_map:
        layout = layout_map[key]
        target[key] = tuple(
            None if entry is None else _one_or_tuple([_AXIS_ALIASES[a] for a in entry_axes(entry)])
            for entry in layout or ()
        )
    return target


def _one_or_tuple(axes: list[str]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else tuple(axes)


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


def _mesh(
    hosts: list[list[jax.Device]], degrees: dict[str, int], dcn: dict[str, int], plan: MeshPlan
) -> Mesh:
    """The mesh: the hosts on a ``dcn`` grid, each host's devices on the within-host grid,
    as `mesh_utils.create_hybrid_device_mesh`; `plan`'s axes, in its order."""
    order = list(plan.order)
    ici = [degrees[k] // dcn[k] for k in order]
    # Host h is cell h of the dcn grid (row-major), its devices its ici grid (row-major).
    flat = np.empty(sum(len(h) for h in hosts), dtype=object)
    flat[:] = [d for host in hosts for d in host]
    cells = flat.reshape(*(dcn[k] for k in order), *ici)
    # (dcn_0, ..., dcn_k, ici_0, ..., ici_k) -> (dcn_0, ici_0, ..., dcn_k, ici_k)
    k = len(order)
    pairs = [i for axis in range(k) for i in (axis, k + axis)]
    devices = cells.transpose(pairs).reshape([degrees[name] for name in order])
    names = plan.axes(degrees)
    devices = devices.reshape([degrees[name] for name in order if _AXIS_OF[name] in names])
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def check_min_shard_size(min_shard_size: int) -> int:
    """`min_shard_size` if it is a non-negative int, else the `ValueError` with the fix."""
    return check_number(
        min_shard_size,
        "min_shard_size",
        integer=True,
        low=0,
        expected="a non-negative int (the fewest elements a variable needs to be sharded)",
        fix=f"Pass e.g. min_shard_size={DEFAULT_MIN_SHARD_SIZE}, or 0 to shard every "
        "variable that divides.",
    )


def shard_dim(
    shape: tuple[int, ...], n: int, min_shard_size: int, *, exclude: tuple[int, ...] = ()
) -> int | None:
    """The dimension FSDP splits a variable of `shape` along over `n` devices, or None.

    The largest dimension (the first of equally large ones) that divides by `n`, not in
    `exclude`, when the variable has at least `min_shard_size` elements.

    Example:

    >>> shard_dim((12, 16), 8, 64), shard_dim((16,), 8, 64), shard_dim((4, 8, 8), 8, 0, exclude=(1,))
    (1, None, 2)
    """
    if n == 1 or math.prod(shape) < max(min_shard_size, 1):
        return None
    dims = [i for i, d in enumerate(shape) if d >= n and d % n == 0 and i not in exclude]
    if not dims:
        return None
    return max(dims, key=lambda i: (shape[i], -i))
