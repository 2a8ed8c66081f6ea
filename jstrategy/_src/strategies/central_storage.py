"""`CentralStorageStrategy`: one copy of the variables in host memory, compute replicated.

As `tf.distribute.experimental.CentralStorageStrategy`: the variables (parameters and
optimizer state) are not mirrored on every device but kept once, centrally; every compute
device runs the model on its slice of the batch; the gradients are all-reduced and the
update is applied once, to the central copy.

In JAX the central copy lives in host memory: each leaf is a `jax.Array` with a
``make_single_device_sharding(parameter_device, memory_kind="pinned_host")``, one buffer whatever
the number of compute devices. Everything decides this through one method,
`Strategy.variable_sharding`: `jstrategy.training.place_state` (hence
`create_train_state` and `jstrategy.Model`) places the state there and checkpoints restore
into it. Two hooks say how computation reaches it: `stage_train_step` copies the
parameters to the compute devices for each step and writes the updated state back there
(`staging.host_update_train_program`), and `read_on_replicas` copies variables to the
replicas for evaluation, prediction and `run`. Between steps no parameter or optimizer
state is left in device memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import make_single_device_sharding

from jstrategy._src import devices as devices_lib
from jstrategy._src import placement
from jstrategy._src import staging
from jstrategy._src.strategy import Strategy

__all__ = ["CentralStorageStrategy", "HOST_MEMORY"]

#: The memory kind of the central copy (pinned host memory, which devices reach by DMA).
HOST_MEMORY = "pinned_host"


class CentralStorageStrategy(Strategy):
    """Variables in host memory as one copy; computation replicated on the compute devices.

    With several compute devices, parameters and optimizer state live once in host memory
    (``memory_kind="pinned_host"`` of `parameter_device`). Each step copies the parameters
    to every compute device (the optimizer state stays on the host), computes the
    gradients of each replica's rows, all-reduces them with `cross_device_ops`, and
    applies the update once to the central copy, in place (the state is donated). Memory
    on the compute devices is only used during a step, which frees device memory for
    activations, at the cost of a host-to-device copy of the parameters per step.

    With a single compute device, parameters and computation both live on it, in device
    memory, as in TF (unless another `parameter_device` is named).

    `run`, `reduce`, `gather` and the distributed datasets work as for `MirroredStrategy`
    over the compute devices; arrays that `run` receives from the central storage are
    copied to the replicas first. Single process only, as in TF.

    Args:
      compute_devices: the devices that compute (TF-style strings or `jax.Device` objects); None
        means every local device of JAX's default backend.
      parameter_device: the device whose host memory holds the variables. None means the
        first compute device. A CPU device while the compute devices are accelerators
        (TF's ``parameter_device="/cpu:0"``) means the host memory next to the first
        compute device. Naming the only compute device keeps the variables in its device
        memory.

    Raises:
      ValueError: if `compute_devices` is invalid (empty, repeated, mixed platforms,
        missing), if `parameter_device` is not one of the compute devices (or a CPU
        device), or if the devices have no host memory to keep variables in.

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
        home, memory_kind = _home(compute, parameter_device)
        self._parameter_device = home
        self._variable_sharding: jax.sharding.Sharding
        if memory_kind == "device":
            # One compute device: variables and computation together, as in TF.
            self._variable_sharding = self.replicated_sharding()
        else:
            placement.check_memory_kind(
                home,
                memory_kind,
                keeper="CentralStorageStrategy",
                fix="Use a backend with host memory (CPU, GPU, TPU), or a single compute device.",
            )
            self._variable_sharding = make_single_device_sharding(home, memory_kind=memory_kind)

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
          leaf: the variable's shape and dtype.
          path: the variable's keys in the state.

        Returns:
          ``make_single_device_sharding(parameter_device, memory_kind="pinned_host")`` with several
          compute devices; `replicated_sharding` (that device's memory) with one.
        """
        del leaf, path  # every variable lives in the same place
        return self._variable_sharding

    def _central(self) -> bool:
        return self._variable_sharding != self.replicated_sharding()

    def stage_train_step(
        self, fns: staging.StepFunctions, *, steps: int = 0, stacked: bool = True
    ) -> staging.TrainProgram:
        """The gradients on the replicas, the update applied once where the variables live.

        Two programs per step: on the compute devices, the variables are copied in, each
        replica differentiates its rows and the gradients are all-reduced; on the parameter
        device, the update is applied once, in place, where the variables live. With one
        compute device (variables in its memory), the default single program (see
        `Strategy.stage_train_step`).
        """
        if not self._central():
            return super().stage_train_step(fns, steps=steps, stacked=stacked)
        return staging.host_update_train_program(self, fns, steps=steps, stacked=stacked)

    def read_on_replicas(self, tree: Any) -> Any:
        """Centrally stored arrays of `tree` copied to every replica; see `Strategy`."""
        if not self._central():
            return tree
        central, replicated = self._variable_sharding, self.replicated_sharding()
        leaves, treedef = jax.tree.flatten(tree)
        moving = [i for i, x in enumerate(leaves) if _is_on(x, central)]
        # Into device memory first: a program's host-memory output cannot be device_put
        # straight to other devices on jax 0.12.1's CPU client (see `in_device_memory`).
        moving_leaves = placement.in_device_memory([leaves[i] for i in moving])
        moved = jax.device_put(moving_leaves, replicated)  # one transfer
        for i, x in zip(moving, moved, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def run(self, fn: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """`Strategy.run`, reading centrally stored arrays onto the replicas first.

        See `Strategy.run`. Outputs stay on the compute devices; put updated variables
        back into the central storage with ``jstrategy.training.place_state``.
        """
        if isinstance(args, (tuple, list)):
            args = self.read_on_replicas(tuple(args))
            kwargs = None if kwargs is None else self.read_on_replicas(kwargs)
        return super().run(fn, args, kwargs)


def _is_on(x: Any, sharding: jax.sharding.Sharding) -> bool:
    return isinstance(x, jax.Array) and x.sharding == sharding


def _home(compute: Sequence[jax.Device], parameter_device: Any) -> tuple[jax.Device, str]:
    """The variables' device and memory kind."""
    if parameter_device is None:
        return compute[0], "device" if len(compute) == 1 else HOST_MEMORY
    device = devices_lib.resolve_device(parameter_device)
    if device in compute:
        return device, "device" if list(compute) == [device] else HOST_MEMORY
    if device.platform == "cpu" and compute[0].platform != "cpu":
        # TF's "/cpu:0": the host memory that the accelerators reach directly.
        return compute[0], HOST_MEMORY
    raise ValueError(
        f"`parameter_device` must be one of the compute devices (whose host memory then "
        f"holds the variables) or a CPU device; got {devices_lib.canonical_name(device)}, "
        f"compute devices {[devices_lib.canonical_name(d) for d in compute]}. Pass "
        "parameter_device=None for the first compute device."
    )
