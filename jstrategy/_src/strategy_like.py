"""`StrategyLike`: what the core's lower modules use of a `Strategy`.

`strategy.py` builds on `context.py`, `extended.py`, `input/`, `placement.py`, `run/`,
`staging.py` and `tracked.py`; they take strategies as arguments but must not import
`strategy.py` back, not even for a type, or the import graph has a cycle. They name this
protocol instead, which `Strategy` satisfies structurally (mypy checks it wherever a
`Strategy` is passed). Code above the core gets the full type from
`jstrategy.get_strategy` (`strategy.get_strategy`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding

__all__ = ["StrategyLike"]


class StrategyLike(Protocol):
    """The part of `jstrategy.Strategy` that the core's lower modules read."""

    @property
    def mesh(self) -> Mesh: ...

    @property
    def axis_name(self) -> str: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def batch_multiple(self) -> int: ...

    @property
    def devices(self) -> tuple[jax.Device, ...]: ...

    @property
    def local_devices(self) -> tuple[jax.Device, ...]: ...

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]: ...

    @property
    def parameter_devices(self) -> tuple[jax.Device, ...]: ...

    @property
    def extended(self) -> Any: ...

    @property
    def cross_device_ops(self) -> Any: ...

    def replicated_sharding(self) -> NamedSharding: ...

    def batch_sharding(self) -> NamedSharding: ...

    def per_replica_sharding(self) -> NamedSharding: ...

    def variable_sharding(
        self, leaf: jax.ShapeDtypeStruct | jax.Array, path: tuple[str, ...] = ()
    ) -> jax.sharding.Sharding: ...

    def annotation_axis(self, name: str) -> str | None: ...

    def read_on_replicas(self, tree: Any) -> Any: ...

    def scope(self) -> contextlib.AbstractContextManager[Any]: ...

    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any: ...
