"""How things are named: variables by their path in a pytree, layers and losses by class.

Placement (`Strategy.variable_sharding`), checkpoints, parameter-server variables and error
messages all name a variable by the keys that lead to it, as strings:
``("params", "Dense_0", "kernel")``, shown as ``params/Dense_0/kernel``. They use the same
strings (`jax.tree_util.keystr`'s simple form of each key), so a path means the same leaf
everywhere: a `TrainState`'s ``.params`` attribute and the dict key ``"params"`` of a
restored tree are one name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["path_names", "path_str", "snake_case"]


def path_names(keypath: Sequence[Any]) -> tuple[str, ...]:
    """The keys of a pytree key path as strings.

    Example:

    >>> import jax
    >>> [path_names(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0]]
    [('a', '0'), ('a', '1')]
    """
    return tuple(jax.tree_util.keystr((key,), simple=True) for key in keypath)


def path_str(keypath: Sequence[Any], default: str = "<root>") -> str:
    """A key path as ``a/b/c`` (`default` for the root).

    Example:

    >>> import jax
    >>> path_str(jax.tree_util.tree_flatten_with_path({"params": {"w": 1}})[0][0][0])
    'params/w'
    """
    return "/".join(path_names(keypath)) or default


def snake_case(name: str) -> str:
    """``"MeanSquaredError"`` -> ``"mean_squared_error"``, as Keras names layers and losses.

    Example:

    >>> snake_case("SparseCategoricalAccuracy")
    'sparse_categorical_accuracy'
    """
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
