"""Bounded waits on the other workers of a multi-worker job, for what jstrategy coordinates.

Collective checkpoints need every worker: orbax's own waits for a worker that never comes
last 5 to 10 minutes, then fail with messages about its internals (a worker that saves
alone, or into another directory, waited 600 s for "array_metadatas base directory
creation"). So before orbax starts, the workers meet through JAX's coordination service
(its key-value store and barriers, which take timeouts and raise on expiry), for at most
`timeout_seconds()`: `CommunicationOptions.timeout_seconds` of the job's
`MultiWorkerMirroredStrategy`, or `DEFAULT_TIMEOUT_S`. A worker that is not there turns
into a `TimeoutError` that says what every worker must do.

Each meeting is named by a per-process sequence number: a multi-worker program runs the
same code on every worker (SPMD), so the n-th checkpoint opened on one worker is the n-th
on every other.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax

from jstrategy._src import jax_compat

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "active",
    "barrier",
    "next_id",
    "share_from_chief",
    "timeout_seconds",
]

#: How long a worker waits for the others without `CommunicationOptions.timeout_seconds`.
DEFAULT_TIMEOUT_S = 300.0

_TIMEOUT: list[float] = []
_IDS = itertools.count()


def set_timeout_seconds(seconds: float | None) -> None:
    """Sets the bound of every wait (the strategy's `CommunicationOptions.timeout_seconds`)."""
    _TIMEOUT[:] = [] if seconds is None else [float(seconds)]


def timeout_seconds() -> float:
    """The bound of every wait on the other workers, in seconds."""
    return _TIMEOUT[0] if _TIMEOUT else DEFAULT_TIMEOUT_S


def _client() -> Any:
    return jax_compat.distributed_client()


def active() -> bool:
    """Whether this process is one of several that JAX's distributed runtime connects."""
    return jax.process_count() > 1 and _client() is not None


def next_id() -> int:
    """A number that names the next coordinated operation the same way on every worker."""
    return next(_IDS)


def _cause(error: Exception) -> str:
    return str(error).strip().splitlines()[0][:300]


def share_from_chief(name: str, value: str, *, what: str, fix: str) -> str:
    """Process 0's `value` for meeting `name`, on every process.

    Raises:
      TimeoutError: if process 0 does not reach this meeting within `timeout_seconds()`.
    """
    client = _client()
    key = f"jstrategy/{name}"
    if jax.process_index() == 0:
        client.key_value_set(key, value)
    seconds = timeout_seconds()
    try:
        return str(client.blocking_key_value_get(key, int(seconds * 1000)))
    except jax.errors.JaxRuntimeError as e:
        raise TimeoutError(
            f"{what}: the chief (process 0) did not get there within {seconds:g} s "
            f"({_cause(e)}). {fix}"
        ) from e


def barrier(name: str, *, what: str, fix: str) -> None:
    """Returns when every process has reached meeting `name`.

    Raises:
      TimeoutError: if some process does not reach it within `timeout_seconds()`.
    """
    seconds = timeout_seconds()
    try:
        _client().wait_at_barrier(f"jstrategy/{name}", int(seconds * 1000))
    except jax.errors.JaxRuntimeError as e:
        raise TimeoutError(
            f"{what}: not every worker got there within {seconds:g} s (process "
            f"{jax.process_index()} of {jax.process_count()} waited; {_cause(e)}). {fix}"
        ) from e
