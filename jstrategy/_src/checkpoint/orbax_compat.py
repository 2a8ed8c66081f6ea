"""Every workaround of an orbax-checkpoint behaviour, each with the orbax versions it is for.

Checked against the oldest supported orbax-checkpoint (0.12.3) and the newest tested
(0.12.8); a workaround that neither needs any more goes, with its line here.

1. A save in flight at exit (`hold_until_committed`): orbax finishes a write in threads
   that stop taking work when the interpreter shuts down.
2. Step directories made in `save`, not in the background (`_async_options`).
3. Deleted steps renamed away first, and temporary directories of killed writes removed
   by us (`Trash`): orbax deletes a step in place, file by file, and its own cleanup
   thread fails noisily when the program ends soon after.
4. The items' handlers declared when a checkpoint is opened (`handler_registry`,
   `weights_checkpointer`), so that a new process can read a step's metadata.

Dropped: the probe for ``AsyncOptions.create_directories_asynchronously``, which orbax
older than the floor lacked (0.12.3 has it). Typed PRNG keys are saved as their raw data
with the key's implementation in the record: orbax 0.12.3 saves typed keys itself, but
that is the checkpoint format (`array_format`), which the fingerprints read as bits and
which checkpoints already written use, not a workaround.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax

from jstrategy._src.checkpoint.array_format import RECORD_ITEM
from jstrategy._src.checkpoint.array_format import STATE_ITEM

__all__ = [
    "Trash",
    "handler_registry",
    "hold_until_committed",
    "manager_options",
    "mark_committed",
    "weights_checkpointer",
]


# 1. A save in flight at exit (orbax-checkpoint 0.12.3 to 0.12.8) ------------------------
# Orbax managers whose last save may still be writing, held until it is committed.
_IN_FLIGHT: dict[int, Any] = {}
_IN_FLIGHT_LOCK = threading.Lock()
_EXIT_HOOK: list[bool] = []
# Not orbax's but CPython's: CPython 3.12.0-3.12.2 refuse to start threads once the main thread has ended
# (python/cpython#113964, fixed in 3.12.3), and orbax starts some to finish a write.
_EXIT_STARTS_NO_THREADS = (3, 12) <= sys.version_info[:3] < (3, 12, 3)


def _finish_in_flight() -> None:
    with _IN_FLIGHT_LOCK:
        managers = list(_IN_FLIGHT.values())
        _IN_FLIGHT.clear()
    for manager in managers:
        try:
            manager.wait_until_finished()
        except Exception as e:  # at exit: say it once and let the process end
            why = (
                f" Python {sys.version.split()[0]} cannot start threads at exit "
                "(python/cpython#113964, fixed in 3.12.3), which the write needs: call "
                "manager.wait_until_finished() or close() before the program ends, or use "
                "Python 3.12.3 or newer. The previous step is still the latest."
                if _EXIT_STARTS_NO_THREADS
                else ""
            )
            print(
                f"jstrategy: a checkpoint save still being written at exit failed: "
                f"{type(e).__name__}: {e}.{why}",
                file=sys.stderr,
                flush=True,
            )
        finally:
            with contextlib.suppress(Exception):
                manager.close()


def hold_until_committed(manager: Any) -> None:
    """Makes a program that ends with a save in flight finish it instead of losing it.

    Orbax writes in background threads that use `concurrent.futures` executors, which stop
    accepting work when the interpreter starts to shut down, before `atexit` handlers run:
    the pending step would be left uncommitted (and the previous one stays the latest).
    `threading._register_atexit` callbacks run in reverse order of registration, so ours
    runs before the executors shut down. The orbax manager is held here, not the
    `CheckpointManager`, so the save completes even if the program dropped the latter.
    """
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[id(manager)] = manager
        if _EXIT_HOOK:
            return
        _EXIT_HOOK.append(True)
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("threading._register_atexit is not available")
        register(_finish_in_flight)
    except RuntimeError:
        atexit.register(_finish_in_flight)


def mark_committed(manager: Any) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.pop(id(manager), None)


# 2. Step directories made in the background (orbax-checkpoint 0.12.3 to 0.12.8) ----------
def _async_options(ocp: Any) -> Any:
    """Orbax's async options: step directories made in `save`.

    An unwritable destination then raises in `save`. Made in the background (the default
    of orbax 0.12.3 to 0.12.8, ``create_directories_asynchronously=True``), its failure
    left orbax's other background threads waiting 10 minutes for the directory, and the
    process could not exit.
    """
    return ocp.AsyncOptions(create_directories_asynchronously=False)


# 3. Steps deleted in place, and orbax's own cleanup (orbax-checkpoint 0.12.3 to 0.12.8) ---
# Where orbax moves the steps that `max_to_keep` drops. Deleting in place (orbax's default)
# unlinks a step's files first and its directories last: a process killed in between left
# a listed step without metadata that could not be read. A rename is atomic, so a listed
# step is always whole; the renamed steps are removed from here afterwards.
_TRASH = ".jstrategy-deleted"
_COMMITTED_MARKERS = ("commit_success.txt", "_CHECKPOINT_METADATA")
_TMP_MARK = ".orbax-checkpoint-tmp"


class Trash:
    """Empties `_TRASH` and repairs what a killed deletion left, on the primary process."""

    def __init__(self, directory: str):
        self._directory = directory
        self._path = os.path.join(directory, _TRASH)
        self._thread: threading.Thread | None = None
        # Orbax deletes steps on process 0 only; the others have nothing to do here.
        self._primary = jax.process_index() == 0

    def repair(self) -> None:
        """Moves here, before orbax lists the steps, what interrupted processes left.

        Orbax's temporary directories of unfinished writes go, and so do step directories
        without orbax's commit markers.

        Orbax writes both markers before it renames a finished step into place, so a step
        directory that lacks one was half deleted by an older jstrategy (or half copied by
        hand): it cannot be restored, and listing it would offer it to `restore`.
        """
        if not self._primary:
            return
        for name in sorted(os.listdir(self._directory)):
            path = os.path.join(self._directory, name)
            if _TMP_MARK in name and os.path.isdir(path):
                # What a process killed mid-write left: never a committed step. (Orbax's
                # own cleanup runs in a thread that fails noisily if the program ends soon.)
                os.makedirs(self._path, exist_ok=True)
                os.replace(path, os.path.join(self._path, f"{name}-{time.time_ns()}"))
                continue
            if not name.isdigit() or not os.path.isdir(path):
                continue
            if all(os.path.exists(os.path.join(path, m)) for m in _COMMITTED_MARKERS):
                continue
            os.makedirs(self._path, exist_ok=True)
            os.replace(path, os.path.join(self._path, f"{name}.incomplete-{time.time_ns()}"))
            print(
                f"jstrategy: removed step {name} from {self._directory}: it is incomplete "
                "(an interrupted deletion or copy left it without orbax's commit markers).",
                file=sys.stderr,
                flush=True,
            )
        self.empty(background=True)

    def empty(self, *, background: bool) -> None:
        """Removes the steps moved here: in a daemon thread, or now and the folder too (the
        manager must be closed then)."""
        if not self._primary or not os.path.isdir(self._path):
            return
        if self._thread is not None and self._thread.is_alive():
            if background:
                return  # still emptying; the next call takes the rest
            self._thread.join()
        if background:
            self._thread = threading.Thread(
                target=self._remove_entries, name="jstrategy-trash", daemon=True
            )
            self._thread.start()
        else:
            self._remove_entries()
            # Orbax is done (the manager is closed): the folder itself can go too.
            with contextlib.suppress(OSError):
                os.rmdir(self._path)

    def _remove_entries(self) -> None:
        # Entry by entry, not the folder, which orbax may be renaming a step into meanwhile.
        with contextlib.suppress(OSError):
            for name in os.listdir(self._path):
                shutil.rmtree(os.path.join(self._path, name), ignore_errors=True)


def manager_options(ocp: Any) -> dict[str, Any]:
    """The `ocp.CheckpointManagerOptions` that workarounds 2 and 3 set."""
    return {
        "async_options": _async_options(ocp),
        # `Trash.repair` removes what a process killed mid-write left behind.
        "cleanup_tmp_directories": False,
        # Old steps are renamed away (atomic), then emptied there: see `Trash`.
        "todelete_subdir": _TRASH,
    }


# 4. Handlers declared up front (orbax-checkpoint 0.12.3 to 0.12.8) -------------------------
# Orbax learns which handler reads an item from the save or restore that names it: without
# the registry, a new process's `item_metadata(step)` has None for ``state`` (0.12.3, 0.12.8).
def handler_registry(ocp: Any) -> Any:
    """A `CheckpointManager`'s handlers of the ``state`` and ``jstrategy`` items."""
    # Registered up front so that a new process can read a step's metadata before any
    # save or restore told orbax which handler each item uses.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state_handler, record_handler = ocp.StandardCheckpointHandler(), ocp.JsonCheckpointHandler()
    registry.add(STATE_ITEM, ocp.args.StandardSave, state_handler)
    registry.add(STATE_ITEM, ocp.args.StandardRestore, state_handler)
    registry.add(RECORD_ITEM, ocp.args.JsonSave, record_handler)
    registry.add(RECORD_ITEM, ocp.args.JsonRestore, record_handler)
    return registry


def weights_checkpointer():
    import orbax.checkpoint as ocp

    # The same two items as a manager's step, declared so that metadata() can describe them.
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            **{
                STATE_ITEM: ocp.StandardCheckpointHandler(),
                RECORD_ITEM: ocp.JsonCheckpointHandler(),
            }
        )
    )
