"""`save_weights` and `load_weights`: one checkpoint directory, written atomically."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING
from typing import Any

from jstrategy._src.checkpoint.array_format import STATE_ITEM
from jstrategy._src.checkpoint.array_format import is_single_checkpoint
from jstrategy._src.checkpoint.array_format import prepare
from jstrategy._src.checkpoint.array_format import save_args
from jstrategy._src.checkpoint.errors import CheckpointError
from jstrategy._src.checkpoint.errors import write_error
from jstrategy._src.checkpoint.orbax_compat import weights_checkpointer
from jstrategy._src.checkpoint.restore_layout import restore_into
from jstrategy._src.checkpoint.workers import EVERY_WORKER
from jstrategy._src.checkpoint.workers import chief_directory
from jstrategy._src.cluster import coordination
from jstrategy._src.validation import check_bool

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "load_arrays",
    "load_weights",
    "read_weights",
    "save_weights",
]


# Left by an interrupted `save_weights(..., overwrite=True)` next to the weights directory.
_NEW_SUFFIX = ".jstrategy-new"
_OLD_SUFFIX = ".jstrategy-old"


def save_weights(path: os.PathLike | str, variables: Any, *, overwrite: bool = True) -> None:
    """Writes `variables` (e.g. a model's params) as one checkpoint directory at `path`.

    The write is synchronous and atomic: the weights are written beside `path` and moved
    into place when complete, so an interrupted save leaves the previous weights readable.

    Args:
      path: the directory to write.
      variables: a pytree of arrays and numbers, under any strategy's sharding (as
        `CheckpointManager.save`'s `state`: typed PRNG keys and agreeing `PerReplica`
        values included).
      overwrite: replace existing weights at `path`; if False, an existing `path` raises.

    Raises:
      FileExistsError: if `path` exists and `overwrite` is False.
      TypeError: if `variables` holds something that is not an array or number.

    Example:

    >>> import os, tempfile, jax.numpy as jnp, jstrategy
    >>> path = os.path.join(tempfile.mkdtemp(), "weights")
    >>> jstrategy.save_weights(path, {"kernel": jnp.eye(2)})
    >>> jstrategy.load_weights(path)["kernel"].tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    from orbax.checkpoint import multihost

    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"`path` must be a non-empty path (str or os.PathLike); got {path!r}.")
    path = os.path.abspath(os.fspath(path))
    check_bool(overwrite, "overwrite", error=TypeError)
    name = f"weights-{coordination.next_id()}" if coordination.active() else None
    if name is not None:
        path = chief_directory(name, path, f"save_weights({path!r})")
    variables, flat, key_impls = prepare(variables, "variables")
    exists = os.path.exists(path)
    if exists and not overwrite:
        raise FileExistsError(
            f"{path} already exists. Pass overwrite=True to replace it, or another path."
        )
    if exists and not os.path.isdir(path):
        raise FileExistsError(f"{path} is a file, not a weights directory. Pass another path.")
    primary = multihost.is_primary_host(0)
    new = path + _NEW_SUFFIX if exists else path
    if primary and os.path.exists(path + _NEW_SUFFIX):
        shutil.rmtree(path + _NEW_SUFFIX)  # from an earlier interrupted overwrite
    checkpointer = weights_checkpointer()
    try:
        checkpointer.save(new, args=save_args(flat, variables, None, None, key_impls))
    except OSError as e:
        raise write_error(e, path) from e
    finally:
        checkpointer.close()
    if exists:
        if primary:
            old = path + _OLD_SUFFIX
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(path, old)
            os.rename(new, path)
            shutil.rmtree(old)
        if name is not None:  # nobody reads `path` before the chief has swapped it
            coordination.barrier(f"{name}/swap", what=f"save_weights({path!r})", fix=EVERY_WORKER)


def load_weights(
    path: os.PathLike | str, *, target: Any = None, strategy: Strategy | None = None
) -> Any:
    """Reads weights written by `save_weights` into a strategy's layout.

    Leaves are placed as by `CheckpointManager.restore` (`strategy` first, then the
    shardings in `target`, then the current strategy) and checked against the fingerprints
    saved with them.

    Args:
      path: the directory `save_weights` wrote.
      target: a pytree like the saved variables (concrete or `jax.eval_shape` output); None
        restores the saved structure as nested dicts.
      strategy: the strategy to place the weights in.

    Returns:
      The restored variables.

    Raises:
      FileNotFoundError: if `path` does not exist.
      CheckpointError: if the weights are damaged or incomplete.
      ValueError: if `target` does not match the saved leaves or shapes.

    Example:

    >>> import os, tempfile, jax.numpy as jnp, jstrategy
    >>> path = os.path.join(tempfile.mkdtemp(), "weights")
    >>> jstrategy.save_weights(path, {"w": jnp.arange(4.0)})
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> w = jstrategy.load_weights(path, strategy=strategy)["w"]
    >>> w.tolist(), w.sharding.num_devices
    ([0.0, 1.0, 2.0, 3.0], 2)
    """
    return read_weights(path, target, strategy, as_variables=True)


def load_arrays(path: os.PathLike | str, *, target: Any, strategy: Strategy) -> Any:
    """`load_weights` for a `Model`'s train state: arrays placed by `strategy`'s
    `variable_sharding`, never its own variable containers (`restore_variables`)."""
    return read_weights(path, target, strategy, as_variables=False)


def read_weights(
    path: os.PathLike | str, target: Any, strategy: Strategy | None, *, as_variables: bool
) -> Any:
    import orbax.checkpoint as ocp

    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"`path` must be a non-empty path (str or os.PathLike); got {path!r}.")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        left = [p for p in (path + _NEW_SUFFIX, path + _OLD_SUFFIX) if os.path.isdir(p)]
        if left:
            raise CheckpointError(
                f"No weights at {path}, but an interrupted save_weights left {left}. "
                f"{left[0]} holds complete weights: rename it to {path} to use it.",
                path=path,
            )
        raise FileNotFoundError(f"No weights at {path}. Check the path or save_weights first.")
    if not is_single_checkpoint(path):
        steps = sorted(int(n) for n in os.listdir(path) if n.isdigit())
        if steps:
            latest = os.path.join(path, str(steps[-1]))
            raise CheckpointError(
                f"{path} holds the numbered steps {steps} of a CheckpointManager, and "
                f"load_weights reads one checkpoint. Load the latest step with "
                f"jstrategy.load_weights({latest!r}), or restore it with "
                f"jstrategy.CheckpointManager({path!r}).restore().",
                path=path,
            )
    if coordination.active():
        # Restoring is collective too (the fingerprints are checked across workers).
        coordination.barrier(
            f"weights-{coordination.next_id()}/load",
            what=f"load_weights({path!r})",
            fix=EVERY_WORKER,
        )
    checkpointer = weights_checkpointer()

    def read(args, *, item=STATE_ITEM, metadata=False):
        if metadata:
            return checkpointer.metadata(path).item_metadata[STATE_ITEM]
        return checkpointer.restore(path, args=ocp.args.Composite(**{item: args}))[item]

    try:
        state = restore_into(read, path, target, strategy, as_variables=as_variables)
    finally:
        checkpointer.close()
    return state
