"""`OneDeviceStrategy`: everything on one device."""

from __future__ import annotations

import jax

from jstrategy._src import context
from jstrategy._src import devices as devices_lib
from jstrategy._src.strategy import Strategy

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """Places variables and computation on a single device.

    Useful to test code written for a distributed strategy on one device, and the oracle
    every other strategy is compared with.

    Args:
      device: a TF-style device string (``"/gpu:0"``, ``"cpu:0"``, ...) or a `jax.Device`.

    Raises:
      ValueError: if the device does not exist (the message lists those that do).

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.OneDeviceStrategy(device="/cpu:0")
    >>> strategy.num_replicas_in_sync
    1
    """

    def __init__(self, device: devices_lib.DeviceSpec):
        super().__init__([devices_lib.resolve_device(device)])

    @property
    def device(self) -> jax.Device:
        """The strategy's device."""
        return self.devices[0]


class _DefaultStrategy(OneDeviceStrategy):
    """The strategy in force outside any `scope()`: JAX's default device, this process's
    first (in a multi-process job, ``jax.devices()[0]`` belongs to process 0)."""

    def __init__(self) -> None:
        super().__init__(jax.local_devices()[0])

    def __repr__(self) -> str:
        return "DefaultStrategy()"


context.set_default_strategy_factory(_DefaultStrategy)
