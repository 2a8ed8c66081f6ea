"""Checkpoints in a multi-worker job: every worker writes into the chief's directory."""

from __future__ import annotations

import contextlib
import os

from jstrategy._src.cluster import coordination

__all__ = [
    "EVERY_WORKER",
    "chief_directory",
]


# Several workers ----------------------------------------------------------------------------------
EVERY_WORKER = (
    "In a multi-worker job every worker opens the same checkpoints and calls save and "
    "restore with the same steps, at the same point of the program: jstrategy writes what is "
    "written once on the chief only, so do not guard them with `if strategy.is_chief`."
)


def chief_directory(name: str, directory: str, what: str) -> str:
    """The chief's `directory`, on every worker: the one a collective checkpoint lives in.

    TF's multi-worker tutorials give each non-chief worker its own temporary directory and
    discard what it writes there. Here every worker writes its part of the chief's
    checkpoint, so a worker that names another directory writes into the chief's; its own
    directory is created, and stays empty for the program to delete as TF's do.
    """
    chief = coordination.share_from_chief(
        f"{name}/directory", directory, what=f"Opening {what}", fix=EVERY_WORKER
    )
    coordination.barrier(f"{name}/open", what=f"Opening {what}", fix=EVERY_WORKER)
    if chief != directory:
        with contextlib.suppress(OSError):
            os.makedirs(directory, exist_ok=True)
    return chief
