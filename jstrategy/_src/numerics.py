"""Numeric helpers with one home each, as optax keeps its own: sizes, per-example values, means.

The train step, the data adapters, the input pipeline, the losses and metrics and the
parameter-server runner all count rows and average sums the same way; they do it here.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import overload

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "COUNT",
    "WEIGHT_SUM",
    "bucket",
    "host_means",
    "means",
    "per_example",
    "round_up",
    "row_count",
    "static_rows",
    "weight_key",
]

#: The key of the count of real (unpadded) rows among a step's loss and metric sums.
COUNT = "count"
#: The prefix of the keys holding a weighted metric's sum of sample weights, the
#: denominator of its mean (Keras's ``weighted_metrics``): `weight_key`.
WEIGHT_SUM = "weight_sum/"


@overload
def row_count(tree: Any, name: str) -> int: ...


@overload
def row_count(tree: Any, name: None = None) -> int | None: ...


def row_count(tree: Any, name: str | None = None) -> int | None:
    """The number of rows of `tree`: the leading dimension of its arrays (scalars and
    leaves without a leading axis are not counted). The one row count of the library.

    Args:
      tree: a pytree of arrays (a batch, its inputs, a model's outputs).
      name: how errors name `tree`; None counts the first array's rows and raises nothing.

    Returns:
      The rows, or None (no `name` given) when `tree` has no array with a leading axis.

    Raises:
      ValueError: with `name`, when `tree` has no such array or its arrays disagree.

    Example:

    >>> row_count({"a": np.ones((4, 2)), "b": np.ones(4)}, "x")
    4
    >>> row_count({"a": np.ones((4, 2)), "b": np.ones(3)}, "x")
    Traceback (most recent call last):
    ...
    ValueError: The arrays of `x` must have the same number of rows (examples); `x['a']` has 4, `x['b']` has 3.
    """
    rows: dict[int, str] = {}  # each row count, with the first leaf that has it
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if np.ndim(leaf) > 0:
            rows.setdefault(int(np.shape(leaf)[0]), jax.tree_util.keystr(path))
    if name is not None and len(rows) != 1:
        if not rows:
            raise ValueError(
                f"`{name}` must contain at least one array with a leading axis of rows "
                "(examples); it has none."
            )
        detail = ", ".join(f"`{name}{where}` has {count}" for count, where in rows.items())
        raise ValueError(
            f"The arrays of `{name}` must have the same number of rows (examples); {detail}."
        )
    return next(iter(rows), None)


def weight_key(name: str) -> str:
    """The key of the sum of sample weights that the sum `name` is divided by.

    Example:

    >>> weight_key("accuracy")
    'weight_sum/accuracy'
    """
    return WEIGHT_SUM + name


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `x`.

    Example:

    >>> round_up(25, 8), round_up(32, 8)
    (32, 32)
    """
    return -(-x // multiple) * multiple


def bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (``2**k`` and ``3 * 2**k``) >= `n`.

    Two sizes per octave: a batch padded to its bucket grows by less than half, and the
    sizes up to ``m`` are at most ``2 * log2(m) + 1``.

    Example:

    >>> [bucket(n) for n in (1, 3, 5, 7, 9, 13, 17, 100, 600)]
    [1, 3, 6, 8, 12, 16, 24, 128, 768]
    """
    if n <= 2:
        return max(n, 1)
    power = 1 << (n - 1).bit_length()
    three = 3 * power // 4
    return three if three >= n else power


def static_rows(rows: int, batch_size: int, replicas: int, *, bucket_batch: bool = False) -> int:
    """The rows a batch of at most `batch_size` is padded to, split among `replicas`.

    A full batch gets `batch_size` rounded up to divide among the replicas; fewer rows
    (all of the data being less than one batch) get the next power of two per replica, no
    more than a full batch. So `fit`, `evaluate` and `predict` compile at most
    ``log2(batch_size / replicas) + 2`` programs whatever the number of rows, and pad a small
    input less than twice over.

    With `bucket_batch` (`evaluate` and `predict`, whose results do not depend on how rows
    are batched), a full batch is padded further, to its `bucket` per replica: any sequence
    of batch sizes up to ``m`` per replica then shares at most ``2 * log2(m) + 1`` programs
    (a serving loop calling ``predict(x, batch_size=len(x))``), for at most half a batch of
    padding. Powers of two and three times them are their own buckets.

    Example:

    >>> static_rows(100, 32, 8), static_rows(10, 32, 8), static_rows(5, 32, 1), static_rows(30, 32, 1)
    (32, 16, 8, 32)
    >>> static_rows(100, 100, 1), static_rows(100, 100, 1, bucket_batch=True)
    (100, 128)
    """
    per_replica = -(-min(rows, batch_size) // replicas)
    full = -(-batch_size // replicas)
    if bucket_batch:
        full = bucket(full)
    return replicas * min(1 << max(per_replica - 1, 0).bit_length(), full)


def per_example(values: Any, rows: int, what: str) -> jax.Array:
    """`values` as one value per example: shape ``(rows,)``, non-batch axes averaged.

    Args:
      values: what a loss or metric returned for a batch of `rows` examples.
      rows: the batch size.
      what: the function's description for the error, e.g. ``"The loss"``.

    Returns:
      A ``(rows,)`` array (`values` itself when it already has that shape).

    Raises:
      ValueError: if `values` has no leading axis of `rows` entries.

    Example:

    >>> import jax.numpy as jnp
    >>> per_example(jnp.ones((4, 3)), 4, "The loss").shape
    (4,)
    """
    values = jnp.asarray(values)
    if values.ndim == 0 or values.shape[0] != rows:
        raise ValueError(
            f"{what} must return one value per example, shape ({rows},) or ({rows}, ...); "
            f"got shape {values.shape}. Return per-example values (jstrategy.losses objects "
            "do) and leave the reduction over the batch to the train step."
        )
    if values.ndim == 1:
        return values
    return jnp.mean(values, axis=tuple(range(1, values.ndim)))


def _is_sum(key: str) -> bool:
    return key != COUNT and not key.startswith(WEIGHT_SUM)


def means(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Each sum divided by the count of real rows (`COUNT`), or by its sum of sample
    weights (`weight_key`, 0 for weights summing to 0, as Keras's ``divide_no_nan``); the
    counts are dropped.

    Example:

    >>> import jax.numpy as jnp
    >>> sums = {"loss": 6.0, "acc": 1.0, "count": 3.0, "weight_sum/acc": 4.0}
    >>> {k: float(v) for k, v in means(jax.tree.map(jnp.float32, sums)).items()}
    {'acc': 0.25, 'loss': 2.0}
    """
    denom = jnp.maximum(sums[COUNT], 1.0)
    out = {}
    for key, value in sums.items():
        if not _is_sum(key):
            continue
        weights = sums.get(weight_key(key))
        if weights is None:
            out[key] = value / denom
        else:
            out[key] = jnp.where(weights != 0, value / jnp.where(weights != 0, weights, 1), 0.0)
    return out


def host_means(sums: Mapping[str, float], names: Iterable[str]) -> dict[str, float]:
    """`means` for Python floats summed on the host, for the keys `names`, in that order.

    Example:

    >>> host_means({"loss": 6.0, "count": 3.0}, ["loss"])
    {'loss': 2.0}
    """
    if not sums:
        return {}
    denom = max(sums.get(COUNT, 0.0), 1.0)
    out = {}
    for name in names:
        if name not in sums:
            continue
        weights = sums.get(weight_key(name))
        if weights is None:
            out[name] = sums[name] / denom
        else:
            out[name] = sums[name] / weights if weights else 0.0
    return out
