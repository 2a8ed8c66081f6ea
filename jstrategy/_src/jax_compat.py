"""The private JAX internals jstrategy reads, in one place.

JAX does not expose these publicly; when a JAX release moves one, only this module changes.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
from jax._src import distributed as _distributed
from jax._src.lax import parallel as _parallel

__all__ = [
    "all_gather_invariant",
    "distributed_client",
    "inside_staging_trace",
    "preemption_sync_manager",
]

#: An all-gather whose result is typed as the same on every replica (its gradient is a
#: slice), where this JAX has it; else `jax.lax.all_gather`.
all_gather_invariant = getattr(_parallel, "all_gather_invariant", jax.lax.all_gather)


def distributed_client() -> Any:
    """The client of JAX's distributed runtime, or None before `jax.distributed.initialize`."""
    return _distributed.global_state.client


def preemption_sync_manager() -> Any:
    """JAX's preemption sync manager, or None when the preemption service is off."""
    return _distributed.global_state.preemption_sync_manager


_TOP_LEVEL: list[Any] = []


def _top_level_state() -> Any:
    # Taken on a fresh thread, which is outside any trace whatever this one is doing.
    if not _TOP_LEVEL:
        box: list[Any] = []
        thread = threading.Thread(
            target=lambda: box.append(jax.extend.core.get_opaque_trace_state())
        )
        thread.start()
        thread.join()
        _TOP_LEVEL.append(box[0])
    return _TOP_LEVEL[0]


def inside_staging_trace() -> bool:
    """Whether this thread is tracing a program that JAX compiles (`jit`, `eval_shape`, ...).

    Eager transformations (`grad`, `vmap` outside `jit`) run their reads each call, so they
    do not count.
    """
    if jax.extend.core.get_opaque_trace_state() == _top_level_state():
        return False
    return isinstance(jnp.zeros((), jnp.int32), jax.core.Tracer)
