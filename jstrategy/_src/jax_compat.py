"""The JAX APIs that moved between the supported releases, and the private internals read.

Supported: jax 0.10 to 0.12. Where JAX has a public API it is used; a private internal is
read only where no public one exists, and never through a silent fallback: when a JAX
release removes one, the function that needs it raises `UnsupportedJaxError` naming the
JAX version, so the change is seen at once (`tests/test_jax_compat.py` checks each one
exists on the running JAX).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
from jax._src import distributed as _distributed
from jax._src import xla_bridge as _xla_bridge

__all__ = [
    "UnsupportedJaxError",
    "all_gather_invariant",
    "backends_started",
    "bind_cpu_collectives_to",
    "cpu_collectives_internals",
    "distributed_client",
    "inside_staging_trace",
    "preemption_sync_manager",
    "scan_counts",
]


class UnsupportedJaxError(RuntimeError):
    """The running JAX lacks an API jstrategy needs (it supports jax 0.10 to 0.12)."""


def _unsupported(what: str) -> UnsupportedJaxError:
    return UnsupportedJaxError(
        f"jstrategy needs {what}, which jax {jax.__version__} does not have. jstrategy "
        "supports jax>=0.10,<0.13: install a supported JAX (pip install 'jax>=0.10,<0.13')."
    )


def _all_gather_invariant() -> Callable[..., Any]:
    # Public since jax 0.10: `to="invarying"` types the result as the same on every replica
    # (its transpose is a slice, not a reduce-scatter), which out_specs=P() needs under
    # check_vma. The private `all_gather_invariant` it replaces is gone in jax 0.12.
    if "to" in inspect.signature(jax.lax.all_gather).parameters:

        def gather(x: Any, axis_name: Any, *, axis: int = 0, tiled: bool = False) -> Any:
            return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")

        return gather

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise _unsupported('jax.lax.all_gather(..., to="invarying")')

    return missing


#: An all-gather whose result is typed as the same on every replica (its gradient is a
#: slice): `jax.lax.all_gather(..., to="invarying")`.
all_gather_invariant = _all_gather_invariant()


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
    with gloo's `hostname` given. Any other CPU collectives (MPI) are left alone. If these
    internals are gone, `UnsupportedJaxError`: a silent fallback would listen beyond
    loopback.
    """
    from jax._src import config

    if config.cpu_collectives_implementation.value != "gloo":
        return
    make_collectives, make_cpu_client, register = cpu_collectives_internals()

    def make_client() -> Any:
        collectives = make_collectives(
            distributed_client=_distributed.global_state.client, hostname=host
        )
        return make_cpu_client(collectives=collectives)

    register("cpu", make_client, priority=0, fail_quietly=False)


def cpu_collectives_internals() -> tuple[
    Callable[..., Any], Callable[..., Any], Callable[..., Any]
]:
    """JAX's gloo factory, CPU client factory and backend registration (private)."""
    try:
        from jax._src.lib import _jax

        return (
            _jax.make_gloo_tcp_collectives,
            _xla_bridge.make_cpu_client,
            _xla_bridge.register_backend_factory,
        )
    except (ImportError, AttributeError) as e:
        raise _unsupported("jax._src.lib._jax.make_gloo_tcp_collectives (gloo on loopback)") from e


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(consts, carries)``: how many of a ``scan`` equation's inputs are each (its
    params: ``num_consts``/``num_carry`` before jax 0.12, the ``ft_in`` groups since)."""
    if "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    try:
        consts, carries, _ = params["ft_in"].unpack()
    except (KeyError, AttributeError, ValueError) as e:
        raise _unsupported("a scan equation's num_consts/num_carry or ft_in params") from e
    return len(consts), len(carries)


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
