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
from jax._src import xla_bridge as _xla_bridge
from jax._src.lax import parallel as _parallel

__all__ = [
    "all_gather_invariant",
    "backends_started",
    "bind_cpu_collectives_to",
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


def backends_started() -> bool:
    """Whether JAX's backends have started (after which its runtime cannot)."""
    return bool(_xla_bridge.backends_are_initialized())


def bind_cpu_collectives_to(host: str) -> None:
    """Makes gloo, JAX's CPU collectives across processes, listen on `host`.

    Without a host, gloo listens on the address this machine's hostname resolves to, which
    on many machines is a network address, for a job that runs on loopback only. JAX
    offers no setting for it, so the CPU backend's factory is replaced by JAX's own one
    with gloo's `hostname` given. Any other CPU collectives (MPI) are left alone; if these
    internals change, JAX's default stays.
    """
    try:
        from jax._src import config
        from jax._src.lib import _jax

        if config.cpu_collectives_implementation.value != "gloo":
            return
        make_collectives = _jax.make_gloo_tcp_collectives
        make_cpu_client = _xla_bridge.make_cpu_client
        register = _xla_bridge.register_backend_factory
    except (ImportError, AttributeError):
        return

    def make_client() -> Any:
        collectives = make_collectives(
            distributed_client=_distributed.global_state.client, hostname=host
        )
        return make_cpu_client(collectives=collectives)

    register("cpu", make_client, priority=0, fail_quietly=False)


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
