"""SIGTERM in a job: the preemption notice, and who handles the signal.

A job is told it will be preempted by SIGTERM, some seconds before it is killed. Training
cannot save at that instant (a step is in flight, and with several workers every one must
save the same step), so the notice is only recorded, and the save happens at the next step
boundary that all workers agree on (`PreemptionWatcher`):

* One process: a Python SIGTERM handler sets a flag, read at each step boundary.
* Several processes (`jax.process_count() > 1`): JAX's preemption service
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`), which
  `jax.distributed.initialize` starts. Its SIGTERM handler announces the notice to every
  worker through the distributed runtime's coordination service; each worker then reports
  the step boundary it has reached, and all of them stop at the largest one plus one. This
  is the protocol of TF's PreemptionCheckpointHandler. It was chosen over an all-reduce of a
  "preempted" flag at every boundary, which would add a collective and a host
  synchronization to every step (the flag must be read to decide), or read it a few steps
  late: the service costs nothing until a notice arrives.

`jstrategy.experimental.PreemptionCheckpointHandler` (`checkpoint/preemption.py`) applies
this to a custom training loop; `jstrategy.callbacks.BackupAndRestore` to `Model.fit`.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import threading
from typing import Any

import jax

from jstrategy._src import jax_compat

__all__ = ["PREEMPTION_EXIT_CODE", "PreemptionWatcher", "take_sigterm_from_jax"]

#: The exit status of a process that saved on a preemption notice (by default): it stopped
#: cleanly, and starting the same command again resumes.
PREEMPTION_EXIT_CODE = 0


# Step boundaries passed to JAX's preemption service. The service compares these numbers
# across processes, so they must advance by one per boundary, in the same order on every
# process; one counter per process keeps them increasing across handlers and `fit` calls.
_SYNC_POINTS = itertools.count()


# SIGTERM and JAX's preemption service -------------------------------------------------------
# `jax.distributed.initialize` starts JAX's preemption notifier, whose C signal handler keeps
# SIGTERM for good: a multi-worker process no longer stopped on SIGTERM (a scheduler's usual
# "stop"), even with nothing to save, and needed SIGKILL. MultiWorkerMirroredStrategy gives
# SIGTERM its default action back right after starting the runtime (`take_sigterm_from_jax`);
# `PreemptionWatcher` hands it to JAX's handler while a preemption-aware `fit` or a
# `PreemptionCheckpointHandler` runs, and puts back what it replaced when it closes.
_JAX_SIGTERM_HANDLER: list[int] = []


def _set_c_sigterm_handler(handler: int | None) -> int | None:
    """Installs a C-level SIGTERM handler (None: the default action); returns the previous.

    Python's `signal.signal` cannot name a handler installed from C, so libc's is used.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    install = libc.signal
    install.restype = ctypes.c_void_p
    install.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return install(signal.SIGTERM, handler)


def take_sigterm_from_jax() -> None:
    """Gives SIGTERM its default action back, keeping JAX's handler for `PreemptionWatcher`."""
    if os.name != "posix" or threading.current_thread() is not threading.main_thread():
        return
    previous = _set_c_sigterm_handler(None)
    if previous:
        _JAX_SIGTERM_HANDLER[:] = [previous]


# Watching for the notice -----------------------------------------------------------------
class PreemptionWatcher:
    """Says, at each step boundary, whether every process should save at this one.

    Every process must call `reached_sync_point` at every step boundary, in the same order.
    """

    def __init__(self, *, owner: str):
        self._event = threading.Event()
        self._previous: Any = None
        self._installed = False
        self._multi = jax.process_count() > 1
        if self._multi:
            if jax_compat.preemption_sync_manager() is None:
                raise RuntimeError(
                    f"{owner} needs JAX's preemption service when several processes train "
                    "together; it is off. Leave jax.config.jax_enable_preemption_service "
                    "at True (the default) before the strategy starts the distributed "
                    "runtime, or pass save_before_preemption=False to BackupAndRestore."
                )
            if _JAX_SIGTERM_HANDLER:
                # SIGTERM is now a notice to save at the next step boundary.
                self._previous = _set_c_sigterm_handler(_JAX_SIGTERM_HANDLER[0])
                self._installed = True
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"{owner} must be created in the main thread: only the main thread can "
                "handle SIGTERM in Python. Create it (and run training) in the main thread, "
                "or pass save_before_preemption=False to BackupAndRestore."
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        del signum, frame
        self._event.set()

    def reached_sync_point(self) -> bool:
        """Called at every step boundary: True where every process must save now."""
        if self._multi:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(next(_SYNC_POINTS)))
        return self._event.is_set()

    def clear(self) -> None:
        """Forgets a notice (after a save whose exit function returned)."""
        self._event.clear()

    def close(self) -> None:
        """Gives SIGTERM back to the handler it had before."""
        if not self._installed:
            return
        self._installed = False
        if self._multi:
            _set_c_sigterm_handler(self._previous)
            return
        previous = signal.SIG_DFL if self._previous is None else self._previous
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
