"""The private JAX internals jstrategy reads, in one place.

JAX does not expose these publicly; when a JAX release moves one, only this module changes.
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src import distributed as _distributed
from jax._src.lax import parallel as _parallel

__all__ = ["all_gather_invariant", "distributed_client", "preemption_sync_manager"]

#: An all-gather whose result is typed as the same on every replica (its gradient is a
#: slice), where this JAX has it; else `jax.lax.all_gather`.
all_gather_invariant = getattr(_parallel, "all_gather_invariant", jax.lax.all_gather)


def distributed_client() -> Any:
    """The client of JAX's distributed runtime, or None before `jax.distributed.initialize`."""
    return _distributed.global_state.client


def preemption_sync_manager() -> Any:
    """JAX's preemption sync manager, or None when the preemption service is off."""
    return _distributed.global_state.preemption_sync_manager
