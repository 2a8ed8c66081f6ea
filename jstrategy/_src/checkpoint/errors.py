"""Checkpoint errors: `CheckpointError`, and messages that name the checkpoint and the fix."""

from __future__ import annotations

import os

__all__ = [
    "READ_ERRORS",
    "CheckpointError",
    "advice",
    "show",
    "wrap_read_error",
    "write_error",
]


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or incomplete; the message names it and says what to do.

    Attributes:
      path: the checkpoint directory concerned.

    Example:

    >>> import tempfile, jstrategy
    >>> try:
    ...     jstrategy.CheckpointManager(tempfile.mkdtemp()).restore()
    ... except (jstrategy.CheckpointError, FileNotFoundError) as error:
    ...     print(type(error).__name__)
    FileNotFoundError
    >>> issubclass(jstrategy.CheckpointError, ValueError)
    True
    """

    def __init__(self, message: str, *, path: os.PathLike | str):
        super().__init__(message)
        self.path = os.fspath(path)


# Orbax names leaves by the same strings as `path_names`, so a TrainState's `.params` and
# the dict key 'params' of a target-less restore are the same leaf.
def show(path: tuple[str, ...]) -> str:
    return "/".join(path) or "<root>"


def advice(location: str) -> str:
    """What to do about a damaged checkpoint: a manager's step, or a weights directory."""
    if os.path.basename(os.fspath(location)).isdigit():
        return "Restore another step (restore(step=...)), or delete this directory and save again."
    return "Save the weights again (save_weights), or load another copy of them."


def wrap_read_error(e: Exception, location: str, what: str) -> CheckpointError:
    text = str(e).split("[tensorstore_spec", 1)[0].strip()
    if len(text) > 400:
        text = text[:400] + " ..."
    return CheckpointError(
        f"Cannot read {what} of the checkpoint in {location}: it is damaged or incomplete "
        f"({type(e).__name__}: {text}). {advice(location)}",
        path=location,
    )


READ_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError)


def write_error(e: OSError, location: str) -> OSError:
    """`e` (same type and errno) with a message that names the checkpoint and the fix."""
    where = f" ({e.filename})" if e.filename else ""
    message = (
        f"Cannot write the checkpoint {location}: {e.strerror or e}{where}. Make sure the "
        "directory is writable, is not below a file and has free space, or pass another "
        "directory."
    )
    return type(e)(e.errno, message) if e.errno is not None else type(e)(message)
