"""`CentralStorageStrategy`: one copy of the variables in host memory, compute replicated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import make_single_device_sharding

from jstrategy._src import devices as devices_lib
from jstrategy._src import placement
from jstrategy._src import staging
from jstrategy._src.offload import HOST_MEMORY_KIND
from jstrategy._src.strategy import Strategy

__all__ = ["CentralStorageStrategy"]


class CentralStorageStrategy(Strategy):
    """Variables in host memory as one copy; computation replicated on the compute devices.

    As `tf.distribute.experimental.CentralStorageStrategy`. With several compute devices,
    parameters and optimizer state live once in host memory (``memory_kind="pinned_host"``
    of `parameter_device`). Each step copies the parameters to every compute device,
    all-reduces the replicas' gradients and applies the update once to the central copy,
    in place: device memory is used only during a step, at the cost of a host-to-device
    copy of the parameters per step. With a single compute device, parameters and
    computation both live on it, as in TF. `run` and the rest work as for
    `MirroredStrategy` over the compute devices. Single process only, as in TF.

    Args:
      compute_devices: the devices that compute (TF-style strings or `jax.Device`
        objects); None means every local device of JAX's default backend.
      parameter_device: the device whose host memory holds the variables; None means the
        first compute device, and so does a CPU device while they are accelerators (TF's
        ``"/cpu:0"``). The only compute device keeps them in its device memory.

    Raises:
      ValueError: if `compute_devices` is invalid (empty, repeated, mixed platforms,
        missing), `parameter_device` is neither a compute device nor a CPU device, or the
        devices have no host memory.

    Example:

    >>> import jax.numpy as jnp
    >>> import jstrategy
    >>> strategy = jstrategy.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    >>> strategy.num_replicas_in_sync
    2
    >>> w = jstrategy.training.place_state(jnp.ones(3), strategy)
    >>> [(str(s.device), s.data.sharding.memory_kind) for s in w.addressable_shards]
    [('cpu:0', 'pinned_host')]
    """

    def __init__(
        self,
        compute_devices: Sequence[devices_lib.DeviceSpec] | None = None,
        parameter_device: devices_lib.DeviceSpec | None = None,
    ):
        compute = (
            jax.local_devices()
            if compute_devices is None
            else devices_lib.resolve_devices(compute_devices, argument="compute_devices")
        )
        super().__init__(compute)
        home, self._central = _home(compute, parameter_device)
        self._parameter_device = home
        # One compute device: variables and computation together, as in TF.
        self._variable_sharding: jax.sharding.Sharding = self.replicated_sharding()
        if self._central:
            placement.check_memory_kind(
                home,
                HOST_MEMORY_KIND,
                keeper="CentralStorageStrategy",
                fix="Use a backend with host memory (CPU, GPU, TPU), or a single compute device.",
            )
            self._variable_sharding = make_single_device_sharding(
                home, memory_kind=HOST_MEMORY_KIND
            )

    @property
    def compute_devices(self) -> tuple[jax.Device, ...]:
        """The devices that run the replicas, in replica order."""
        return self.devices

    @property
    def parameter_device(self) -> jax.Device:
        """The device whose memory (host memory, with several compute devices) holds the
        variables."""
        return self._parameter_device

    def variable_sharding(
        self, leaf: jax.ShapeDtypeStruct | jax.Array, path: tuple[str, ...] = ()
    ) -> jax.sharding.Sharding:
        """One copy of every variable: in host memory, or on the only compute device.

        Args:
          leaf, path: as `Strategy.variable_sharding`.

        Returns:
          `parameter_device`'s ``"pinned_host"`` memory with several compute devices;
          `replicated_sharding` (that device's memory) with one.
        """
        del leaf, path  # every variable lives in the same place
        return self._variable_sharding

    def stage_train_step(
        self, fns: staging.StepFunctions, *, steps: int = 0, stacked: bool = True
    ) -> staging.TrainProgram:
        """The gradients on the replicas, the update applied once where the variables live
        (`staging.host_update_train_program`); with one compute device, `Strategy`'s."""
        if not self._central:
            return super().stage_train_step(fns, steps=steps, stacked=stacked)
        return staging.host_update_train_program(self, fns, steps=steps, stacked=stacked)

    def read_on_replicas(self, tree: Any) -> Any:
        """Centrally stored arrays of `tree` copied to every replica; see `Strategy`."""
        if not self._central:
            return tree
        central, replicated = self._variable_sharding, self.replicated_sharding()
        leaves, treedef = jax.tree.flatten(tree)
        moving = [
            i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.sharding == central
        ]
        # Into device memory first: a program's host-memory output cannot be device_put
        # straight to other devices on jax 0.12.1's CPU client (see `in_device_memory`).
        moved = jax.device_put(placement.in_device_memory([leaves[i] for i in moving]), replicated)
        for i, x in zip(moving, moved, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def run(self, fn: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """`Strategy.run`, reading centrally stored arrays onto the replicas first; outputs
        stay on the compute devices (``jstrategy.training.place_state`` puts them back)."""
        if isinstance(args, (tuple, list)):
            args = self.read_on_replicas(tuple(args))
            kwargs = None if kwargs is None else self.read_on_replicas(kwargs)
        return super().run(fn, args, kwargs)


def _home(compute: Sequence[jax.Device], parameter_device: Any) -> tuple[jax.Device, bool]:
    """The variables' device, and whether they live in its host memory."""
    if parameter_device is None:
        return compute[0], len(compute) > 1
    device = devices_lib.resolve_device(parameter_device)
    if device in compute:
        return device, list(compute) != [device]
    if device.platform == "cpu" and compute[0].platform != "cpu":
        # TF's "/cpu:0": the host memory that the accelerators reach directly.
        return compute[0], True
    raise ValueError(
        f"`parameter_device` must be one of the compute devices (whose host memory then "
        f"holds the variables) or a CPU device; got {devices_lib.canonical_name(device)}, "
        f"compute devices {[devices_lib.canonical_name(d) for d in compute]}. Pass "
        "parameter_device=None for the first compute device."
    )
