"""Finding a `Model`'s variables, by path, in any checkpoint directory."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jstrategy._src.checkpoint.array_format import STATE_ITEM
from jstrategy._src.checkpoint.errors import show
from jstrategy._src.checkpoint.weights import read_weights
from jstrategy._src.names import path_names

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "latest_step_dir",
    "read_by_paths",
]


# Reading a Model's variables from any checkpoint directory, by path -------------------------
def latest_step_dir(path: str) -> str | None:
    """The newest committed step of a `CheckpointManager` directory, or None if it is none.

    Read from the directory listing rather than by opening a manager, which would remove
    the temporary directory of a save that another process is writing there now.
    """
    if not os.path.isdir(path) or os.path.isdir(os.path.join(path, STATE_ITEM)):
        return None
    steps = [int(name) for name in os.listdir(path) if name.isdigit()]
    return os.path.join(path, str(max(steps))) if steps else None


def _lookup(tree: Any, path: tuple[str, ...], location: str) -> Any:
    node = tree
    for name in path:
        try:
            node = node[int(name)] if isinstance(node, (list, tuple)) else node[name]
        except (KeyError, IndexError, ValueError, TypeError):
            raise ValueError(
                f"The checkpoint in {location} has no variable {show(path)}: it was saved "
                "from a different model. Load it into a model built like the one that saved "
                "it."
            ) from None
    return node


def _pick(saved: Any, like: Any, location: str) -> Any:
    """The leaves of `like`'s structure, found by path in a target-less restore `saved`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for keypath, leaf in flat:
        path = path_names(keypath)
        value = _lookup(saved, path, location)
        if np.shape(value) != np.shape(leaf):
            raise ValueError(
                f"Variable {show(path)} in {location} has shape {np.shape(value)}; the "
                f"model's has {np.shape(leaf)}. Load it into a model built like the one that "
                "saved it."
            )
        if value.dtype != leaf.dtype:
            value = value.astype(leaf.dtype)
        leaves.append(value)
    return jax.tree.unflatten(treedef, leaves)


def read_by_paths(
    step_dir: str,
    like: Any,
    roots: tuple[str, ...],
    strategy: Strategy,
    *,
    optional: dict[str, Any] | None = None,
) -> Any:
    """`like`'s leaves, read by path under the first of `roots` found in a checkpoint step.

    A step written by `jstrategy.Model`'s callbacks holds ``{"weights": ...}`` or
    ``{"train_state": ...}`` (a full state holds the weights as fields of its train state),
    so weights are found in either by their paths.

    Args:
      step_dir: the step's directory.
      like: the structure to read.
      roots: where to look for it, in order.
      strategy: places the arrays (`Strategy.variable_sharding`).
      optional: more roots to read if the step has them, each with its structure; then
        the result is ``(found, {root: value for the optional roots present})``.

    Raises:
      ValueError: if the step holds none of `roots`, or not `like`'s variables.
    """
    saved = read_weights(step_dir, None, strategy, as_variables=False)
    root = next((r for r in roots if isinstance(saved, dict) and r in saved), None)
    if root is None:
        raise ValueError(
            f"The checkpoint in {step_dir} holds none of {list(roots)}; it was not written "
            "by a jstrategy Model callback, or holds weights only (use load_weights)."
        )
    found = _pick(saved[root], like, step_dir)
    if optional is None:
        return found
    present = {k: _pick(saved[k], v, step_dir) for k, v in optional.items() if k in saved}
    return found, present
