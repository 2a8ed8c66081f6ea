"""What every batch of a dataset must be: a pytree of arrays with one leading row count, and
the same structure, row shapes and dtypes as the first batch (`BatchSpec`), so the compiled
step is reused. Each check names the batch and the leaf, what was expected and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jstrategy._src.validation import short_repr

__all__ = ["BatchSpec", "check_matches", "flatten_batch", "spec_of"]


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """What every batch of a dataset must share with the first: structure, row shapes, dtypes."""

    treedef: Any
    row_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]


def _leaf_paths(treedef: Any) -> list[str]:
    dummy = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    return [
        jax.tree_util.keystr(path) or "<root>"
        for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]
    ]


def flatten_batch(batch: Any, where: str) -> tuple[list[Any], Any, int]:
    """Flattens one batch and checks its leaves; returns (leaves, treedef, rows)."""
    leaves, treedef = jax.tree.flatten(batch)
    if not leaves:
        raise ValueError(
            f"{where} has no arrays (got {short_repr(batch)}); expected a pytree (array, "
            "tuple, dict, ...) of NumPy or JAX arrays with a leading batch dimension."
        )
    rows = None
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, (np.ndarray, jax.Array)):
            if isinstance(leaf, (str, bytes, int, float, complex, np.generic)) or not hasattr(
                leaf, "__array__"
            ):
                path = _leaf_paths(treedef)[i]
                raise TypeError(
                    f"{where}: leaf {path} is a {type(leaf).__name__} ({short_repr(leaf)}); "
                    "every leaf must be a NumPy or JAX array with a leading batch "
                    "dimension. Convert it with np.asarray, or drop it from the batch."
                )
            leaf = leaves[i] = np.asarray(leaf)
        if leaf.ndim == 0:
            path = _leaf_paths(treedef)[i]
            raise ValueError(
                f"{where}: leaf {path} is a scalar (shape ()); every leaf must have a leading "
                "batch dimension. Give it one (e.g. np.full((batch_size,), value)) or drop it."
            )
        if leaf.dtype == object:
            path = _leaf_paths(treedef)[i]
            raise TypeError(
                f"{where}: leaf {path} has dtype object (a ragged or non-numeric array); "
                "every leaf must be a numeric NumPy or JAX array. Pad variable-length rows "
                "to one length in the input pipeline."
            )
        if rows is None:
            rows = leaf.shape[0]
        elif leaf.shape[0] != rows:
            paths = _leaf_paths(treedef)
            first = leaves[0].shape[0]
            raise ValueError(
                f"{where} is ragged: leaf {paths[i]} has {leaf.shape[0]} rows but leaf "
                f"{paths[0]} has {first}. Every leaf of a batch must have the same leading "
                "(batch) dimension; batch all features and labels together."
            )
    assert rows is not None
    return leaves, treedef, int(rows)


def spec_of(leaves: Sequence[Any], treedef: Any) -> BatchSpec:
    return BatchSpec(
        treedef,
        tuple(tuple(x.shape[1:]) for x in leaves),
        tuple(np.dtype(x.dtype) for x in leaves),
    )


def check_matches(spec: BatchSpec, leaves: Sequence[Any], treedef: Any, where: str, first: str):
    if treedef != spec.treedef:
        raise ValueError(
            f"{where} has structure {treedef} but {first} had {spec.treedef}. Every batch must "
            "have the same structure so the compiled step is reused."
        )
    for i, x in enumerate(leaves):
        if x.shape[1:] != spec.row_shapes[i] or x.dtype != spec.dtypes[i]:
            path = _leaf_paths(treedef)[i]
            raise ValueError(
                f"{where}: leaf {path} has rows of shape {tuple(x.shape[1:])} and dtype "
                f"{x.dtype}, but {first} had {spec.row_shapes[i]} and {spec.dtypes[i]}. "
                "Batches may differ only in their number of rows, so the compiled step is "
                "reused; reshape or cast in the input pipeline."
            )
