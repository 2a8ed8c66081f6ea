"""Keras's order of a model's weights, for `Model.get_weights` and `Model.set_weights`.

Keras lists a model's weights layer by layer in the order the layers were made (a
`Sequential`'s order), each layer's own weights before its sublayers', and within a layer
its trainable weights before its other ones, each in the order it made them: ``kernel``,
``bias``; ``gamma``, ``beta``, ``moving_mean``, ``moving_variance``. A list from Keras's
``get_weights`` therefore goes into ``set_weights`` of the same model here, and back.

The same rule, for any Flax module:

* linen: submodules in the order they are first called while the module is initialized
  (its layers, in a `jstrategy.Sequential`), recorded when the state is created; within a
  submodule its ``params`` (in the order it made them), then its ``batch_stats``;
* NNX: attributes in the order they were assigned (definition order); within a module its
  `nnx.Param` variables, then its other variables, then its submodules.

Flax's own dicts, and `jax.tree.leaves`, sort keys as strings instead (``bias`` before
``kernel``, ``dense_10`` before ``dense_2``), which is why the order is kept here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax import traverse_util

__all__ = [
    "Path",
    "get_leaves",
    "leaf_paths",
    "linen_order",
    "nnx_order",
    "path_keys",
    "recording_calls",
    "set_leaves",
]

#: A variable's place in a Flax variables dict: the collection, then the keys below it.
Path = tuple[str, ...]

_COLLECTION_RANK = {"params": 0, "batch_stats": 1}


@contextlib.contextmanager
def recording_calls() -> Iterator[list[tuple[Path, Any]]]:
    """Records the linen submodules called inside it, ``(path, module)`` in first-call
    order (parents before their children, as a parent calls them)."""
    calls: list[tuple[Path, Any]] = []
    seen: set[Path] = set()

    def record(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        path = tuple(str(k) for k in context.module.path)
        if path not in seen:
            seen.add(path)
            calls.append((path, context.module))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        yield calls


def _in_insertion_order(tree: Any, prefix: Path) -> Iterator[Path]:
    """The leaf paths of nested mappings, in the order their keys were inserted."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _in_insertion_order(value, (*prefix, str(key)))
    else:
        yield prefix


def linen_order(variables: Mapping[str, Any], calls: list[tuple[Path, Any]]) -> tuple[Path, ...]:
    """The paths of `variables` (``module.init``'s dict, before any tree operation, which
    would sort its keys) in Keras's order, given the submodules' first-call order."""
    rank = {path: i for i, (path, _) in enumerate(calls)}
    entries = []
    for collection in variables:
        for i, path in enumerate(_in_insertion_order(variables[collection], (collection,))):
            owner = path[1:-1]
            entries.append(
                ((rank.get(owner, len(rank)), _COLLECTION_RANK.get(collection, 2), i), path)
            )
    return tuple(path for _, path in sorted(entries))


def get_leaves(variables: Mapping[str, Any], order: tuple[Path, ...]) -> list[Any] | None:
    """The leaves of `variables` in `order`, or None where `order` is not their paths."""
    flat = traverse_util.flatten_dict(variables)
    if set(flat) != set(order):
        return None
    return [flat[path] for path in order]


def set_leaves(
    variables: Mapping[str, Any], order: tuple[Path, ...], leaves: list[Any]
) -> dict[str, Any]:
    """`variables` with the leaves at `order`'s paths replaced by `leaves`."""
    flat = traverse_util.flatten_dict(variables)
    flat.update(zip(order, leaves, strict=True))
    return traverse_util.unflatten_dict(flat)


def path_keys(key_path: tuple[Any, ...]) -> Path:
    """A JAX key path (dict keys, attributes, sequence indices) as a tuple of names."""
    names = []
    for key in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
    return tuple(names)


def nnx_order(module: nnx.Module) -> dict[Path, int]:
    """Each variable path of an NNX module (as `path_keys` names the module's state's
    paths, ``.value`` left out) with its rank in definition order."""
    ranks: dict[Path, int] = {}

    def children(node: Any) -> list[tuple[str, Any]]:
        if isinstance(node, Mapping):
            return [(str(k), v) for k, v in node.items()]
        if isinstance(node, (list, tuple)):
            return [(str(i), v) for i, v in enumerate(node)]
        items = getattr(node, "__dict__", {})
        return [(str(k), v) for k, v in items.items() if not str(k).startswith("_")]

    def walk(node: Any, prefix: Path, seen: set[int]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        pairs = children(node)
        variables = [(k, v) for k, v in pairs if isinstance(v, nnx.Variable)]
        # Trained parameters first, then the other variables, as Keras's trainable first.
        variables.sort(key=lambda kv: not isinstance(kv[1], nnx.Param))
        for key, _ in variables:
            ranks.setdefault((*prefix, key), len(ranks))
        for key, value in pairs:
            if not isinstance(value, nnx.Variable) and _holds_variables(value):
                walk(value, (*prefix, key), seen)

    walk(module, (), set())
    return ranks


def _holds_variables(value: Any) -> bool:
    if isinstance(value, (nnx.Module, Mapping, list, tuple)):
        return True
    return hasattr(nnx, "Pytree") and isinstance(value, nnx.Pytree)


def leaf_paths(tree: Any, is_leaf: Any = None) -> list[Path]:
    """`tree`'s leaf paths as tuples of names, in `jax.tree.leaves` order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [path_keys(path) for path, _ in flat]
