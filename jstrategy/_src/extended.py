"""`Strategy.extended`: what TF programs read from ``strategy.extended``.

TF's ``StrategyExtended`` exposes a strategy's devices and variable ownership to library
code; TF users mostly read three things from it, given here from the strategy's own
answers: the devices that compute (`worker_devices`), the devices that hold the variables
(`parameter_devices`, what `Strategy.variable_sharding` places them on) and whether a
variable belongs to the strategy (`variable_created_in_scope`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

import jax

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = ["StrategyExtended"]


class StrategyExtended:
    """TF's ``strategy.extended``, for one strategy.

    Args:
      strategy: the strategy it describes.

    Example:

    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> [str(d) for d in strategy.extended.worker_devices]
    ['cpu:0', 'cpu:1']
    >>> strategy.extended.parameter_devices == strategy.extended.worker_devices
    True
    """

    def __init__(self, strategy: StrategyLike):
        self._strategy = strategy

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """The devices this process computes on, in replica order (TF's local replicas'
        devices)."""
        return self._strategy.worker_devices

    @property
    def parameter_devices(self) -> tuple[jax.Device, ...]:
        """The devices that hold the variables: the replicas' (Mirrored), the one parameter
        device (CentralStorage), the parameter servers' (ParameterServer)."""
        return self._strategy.parameter_devices

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether `v` belongs to this strategy, as TF's ``variable_created_in_scope``.

        `v` is an object created in a strategy's scope that records it (a
        `jstrategy.Model`, an optimizer or metric with a ``strategy``), or an array: it
        belongs when it lives on the devices this strategy keeps variables on, as its
        variables are placed (`Strategy.variable_sharding`).

        Raises:
          TypeError: for anything else, which no strategy owns.
        """
        owner = getattr(v, "strategy", None)
        if owner is not None and hasattr(owner, "variable_sharding"):
            return owner is self._strategy
        if isinstance(v, jax.Array):
            expected = self._strategy.variable_sharding(jax.ShapeDtypeStruct(v.shape, v.dtype))
            return v.sharding.device_set == expected.device_set and (
                v.sharding.memory_kind == expected.memory_kind
            )
        raise TypeError(
            f"`v` must be a variable: a jax.Array, or an object with its strategy (a "
            f"jstrategy.Model, optimizer or metric); got {type(v).__name__}."
        )
