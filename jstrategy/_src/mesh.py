"""`DeviceMesh`: a named N-D grid of devices, Keras 3's `keras.distribution.DeviceMesh`.

A strategy lays its replicas along one axis of a mesh (its data axis); the other axes hold
the pieces of variables that a layout shards (`ModelParallelStrategy`). The device order
comes from `jax.make_mesh`, which follows the physical interconnect on TPU (and sorts GPUs
by their global id), so that neighbouring mesh positions are neighbouring chips.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh

from jstrategy._src import devices as devices_lib
from jstrategy._src import jax_compat
from jstrategy._src.cluster.layout import training_process_layout
from jstrategy._src.cluster.tf_config import TFConfigClusterResolver
from jstrategy._src.validation import is_int

__all__ = ["DeviceMesh", "auto_mesh", "devices_known"]


class DeviceMesh:
    """A grid of devices with a name for each axis, as `keras.distribution.DeviceMesh`.

    Args:
      shape: the extent of each axis, e.g. ``(2, 4)``; the product must equal the number
        of devices.
      axis_names: one distinct name per axis, e.g. ``("batch", "model")``.
      devices: the devices (TF-style strings or `jax.Device` objects, in any nesting); None means
        every device of JAX's default backend (of every process). `jax.make_mesh` arranges
        them so that the mesh follows the physical topology.

    Raises:
      ValueError: if `shape` and `axis_names` differ in length, a name repeats, an extent
        is not a positive int, or the shape does not multiply to the number of devices.

    Example:

    >>> import jstrategy
    >>> mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    >>> mesh.shape, mesh.axis_names
    ((2, 4), ('batch', 'model'))
    >>> mesh.devices.shape
    (2, 4)
    """

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        devices: Any = None,
    ):
        shape = _check_shape(shape)
        axis_names = _check_axis_names(axis_names, shape)
        self._shape = shape
        self._axis_names = axis_names
        self._mesh_or_none: Mesh | None = None
        self._given = devices
        if devices is not None or not _job_not_joined_yet():
            self._build()
        # Else every process's devices are known only once the strategy built on this mesh
        # joins the job described by TF_CONFIG: JAX's distributed runtime must start
        # before its backends, which `jax.devices()` would start.

    def _build(self) -> Mesh:
        if self._mesh_or_none is not None:
            return self._mesh_or_none
        shape, devices = self._shape, self._given
        if devices is None:
            flat = list(jax.devices())
        else:
            flat = devices_lib.resolve_devices(
                list(np.asarray(devices, dtype=object).flat), argument="devices"
            )
        if math.prod(shape) != len(flat):
            raise ValueError(
                f"`shape` {shape} multiplies to {math.prod(shape)} devices, but there are "
                f"{len(flat)} devices. Give a shape whose product is {len(flat)}, or pass "
                f"the {math.prod(shape)} devices to use as `devices`."
            )
        self._mesh_or_none = jax.make_mesh(
            shape, self._axis_names, axis_types=(AxisType.Auto,) * len(shape), devices=flat
        )
        return self._mesh_or_none

    @property
    def _mesh(self) -> Mesh:
        return self._build()

    @property
    def shape(self) -> tuple[int, ...]:
        """The extent of each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The name of each axis."""
        return self._axis_names

    @property
    def devices(self) -> np.ndarray:
        """The devices, an array of shape `shape` in mesh order."""
        return self._mesh.devices

    @property
    def jax_mesh(self) -> Mesh:
        """The `jax.sharding.Mesh` (every axis of type ``Auto``)."""
        return self._mesh

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and other._mesh == self._mesh

    def __hash__(self) -> int:
        return hash(self._mesh)

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={self._shape}, axis_names={self._axis_names})"


def auto_mesh(mesh: Mesh | DeviceMesh) -> Mesh:
    """`mesh` as a `jax.sharding.Mesh` whose axes are all ``Auto``.

    Strategies compile with shardings as annotations (``Auto`` axes); ``Explicit`` axes
    (the default of `jax.make_mesh`) would make shardings part of every array's type.
    """
    if isinstance(mesh, DeviceMesh):
        return mesh.jax_mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"Expected a jstrategy.experimental.DeviceMesh or a jax.sharding.Mesh; got "
            f"{type(mesh).__name__} {mesh!r}."
        )
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def _job_not_joined_yet() -> bool:
    """Whether ``TF_CONFIG`` describes a multi-process job this process has not joined yet
    (and still can: JAX's backends have not started)."""
    if jax_compat.backends_started() or jax_compat.distributed_client() is not None:
        return False
    try:
        layout = training_process_layout(TFConfigClusterResolver())
    except ValueError:
        return False  # the strategy that joins the job says what is wrong with it
    return layout.process_id is not None and layout.num_processes > 1


def _check_shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if not dims or any(not is_int(d) or d < 1 for d in dims):
        raise ValueError(
            f"`shape` must be a non-empty sequence of positive ints, one per mesh axis, "
            f"e.g. (2, 4); got {shape!r}."
        )
    return tuple(int(d) for d in dims)


def _check_axis_names(axis_names: Any, shape: tuple[int, ...]) -> tuple[str, ...]:
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"`axis_names` must be non-empty strings, one per mesh axis, e.g. "
            f"('batch', 'model'); got {axis_names!r}."
        )
    if len(names) != len(shape):
        raise ValueError(
            f"`axis_names` must name each of the {len(shape)} axes of `shape` {shape}; got "
            f"{len(names)} names {names}."
        )
    if len(set(names)) != len(names):
        raise ValueError(f"`axis_names` must be distinct; got {names}.")
    return names


def devices_known(mesh: DeviceMesh) -> bool:
    """Whether `mesh`'s devices are resolved (False while it waits for a job to be joined)."""
    return mesh._mesh_or_none is not None
