"""Bounded in-flight steps: the one place that knows the XLA CPU rendezvous hazard.

JAX dispatches asynchronously, so a Python loop can queue thousands of steps before the
first finishes. On XLA's CPU backend with several (fake) devices, a deep queue of programs
with collectives deadlocks inside the collective rendezvous ("Expected 8 threads to join the
rendezvous, but only 7 of them arrived") and aborts the process. Waiting on a step's output
every few dozen steps never hung in 20,000 steps and costs nothing, because a handful of
queued steps already keeps the devices busy. Everything jstrategy dispatches repeatedly
(`Strategy.run`, `Strategy.reduce` and `gather`, `CrossDeviceOps.reduce`, input prefetch,
`Model.fit`, checkpoint fingerprints) goes through `track`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "InFlightLimiter", "get_limiter", "track"]

DEFAULT_MAX_IN_FLIGHT = 8


class InFlightLimiter:
    """Keeps at most `max_in_flight` dispatched steps unfinished.

    Each tracked step is represented by its smallest output array, so the limiter keeps
    little memory alive; executions on the same devices finish in order, so waiting on the
    oldest step's output bounds the queue.

    Args:
      max_in_flight: how many steps may be queued before the host waits for the oldest.

    Example:

    >>> import jax.numpy as jnp
    >>> limiter = InFlightLimiter(max_in_flight=2)
    >>> for i in range(5):
    ...     limiter.track(jnp.ones(3) * i)
    >>> limiter.in_flight <= 2
    True
    """

    def __init__(self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT):
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(
                f"`max_in_flight` must be a positive int; got {max_in_flight!r}. "
                f"The default, {DEFAULT_MAX_IN_FLIGHT}, keeps devices busy."
            )
        self.max_in_flight = max_in_flight
        self._queue: collections.deque[jax.Array] = collections.deque()
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """The number of tracked steps not yet waited on."""
        return len(self._queue)

    def track(self, outputs: Any) -> None:
        """Records one dispatched step and waits for old ones beyond the bound.

        Args:
          outputs: the step's outputs (any pytree); non-array leaves are ignored.
        """
        arrays = [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)]
        if not arrays:
            return
        marker = min(arrays, key=lambda x: x.size)
        with self._lock:
            self._queue.append(marker)
            while len(self._queue) > self.max_in_flight:
                _wait(self._queue.popleft())

    def wait_all(self) -> None:
        """Waits until every tracked step has finished."""
        with self._lock:
            while self._queue:
                _wait(self._queue.popleft())


def _wait(marker: jax.Array) -> None:
    # A marker donated to a later step is gone; that later step is tracked and waited on.
    if marker.is_deleted():
        return
    try:
        marker.block_until_ready()
    except jax.errors.JaxRuntimeError as e:
        for translate in _ERROR_TRANSLATORS:
            clearer = translate(e)
            if clearer is not None:
                raise clearer from e
        raise


_ERROR_TRANSLATORS: list[Callable[[Exception], Exception | None]] = []


def add_error_translator(translate: Callable[[Exception], Exception | None]) -> None:
    """Registers a function that turns a runtime error from a step into a clearer one.

    Multi-worker strategies use it to say that a peer died when a collective fails.
    """
    if translate not in _ERROR_TRANSLATORS:
        _ERROR_TRANSLATORS.append(translate)


_LIMITER = InFlightLimiter()


def get_limiter() -> InFlightLimiter:
    """The process-wide limiter shared by every strategy, iterator and training loop."""
    return _LIMITER


def track(outputs: Any) -> None:
    """Tracks one dispatched step on the process-wide limiter."""
    _LIMITER.track(outputs)
