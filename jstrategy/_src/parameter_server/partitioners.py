"""Variable partitioners, with TensorFlow's arithmetic (``tf.distribute.experimental.partitioners``).

A partitioner maps a variable's shape and dtype to the number of shards along each axis;
`ParameterServerStrategy` only splits the first axis, so every entry but the first is 1.
`shard_offsets` is TF's "div" layout of rows over shards: the first ``rows % shards`` shards
get one extra row (13 rows over 5 shards: 3, 3, 3, 2, 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jstrategy._src.validation import check_positive_int

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "shard_offsets",
]


def _element_bytes(dtype: Any, bytes_per_string: int) -> int:
    """Bytes per element; strings (and Python objects) count `bytes_per_string`, as in TF."""
    if dtype is str or dtype is bytes or dtype is object:
        return bytes_per_string
    dt = np.dtype(dtype)
    if dt.kind in ("U", "S", "O", "T"):
        return bytes_per_string
    return dt.itemsize


def _check_shape(shape: Any, axis: int) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError:
        raise TypeError(
            f"`shape` must be a sequence of ints such as (10, 3); got {shape!r}."
        ) from None
    if not dims:
        raise ValueError("`shape` must have at least one axis to partition; got a scalar ().")
    if not -len(dims) <= axis < len(dims):
        raise ValueError(f"`axis` must index `shape` {dims}; got axis={axis}.")
    return dims


class Partitioner:
    """Base class of partitioners: ``partitioner(shape, dtype, axis=0) -> [n0, n1, ...]``.

    Subclasses return, for each axis of `shape`, how many shards to split it into.
    `ParameterServerStrategy` splits only along the first axis, so it accepts results whose
    entries other than the first are 1.

    Example:

    >>> import numpy as np
    >>> from jstrategy.experimental.partitioners import MinSizePartitioner, Partitioner
    >>> partitioner = MinSizePartitioner(min_shard_bytes=64, max_shards=4)
    >>> isinstance(partitioner, Partitioner), partitioner((10, 8), np.float32)
    (True, [4, 1])
    """

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        """Partitions `shape`.

        Args:
          shape: the variable's shape (a sequence of ints).
          dtype: its dtype (a NumPy/JAX dtype; strings count ``bytes_per_string`` bytes).
          axis: the axis to partition along.

        Returns:
          One int per axis: the number of shards along it.
        """
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """Splits a variable into a fixed number of shards (fewer if the axis is shorter).

    Args:
      num_shards: the number of shards.

    Raises:
      ValueError: if `num_shards` is not a positive int.

    Example:

    >>> FixedShardsPartitioner(num_shards=2)((10, 3), "float32")
    [2, 1]
    >>> FixedShardsPartitioner(num_shards=5)((3, 4), "float32")
    [3, 1]
    """

    def __init__(self, num_shards: int):
        self._num_shards = check_positive_int(num_shards, "num_shards", "E.g. num_shards=2.")

    @property
    def num_shards(self) -> int:
        return self._num_shards

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        del dtype
        dims = _check_shape(shape, axis)
        result = [1] * len(dims)
        result[axis] = min(self._num_shards, dims[axis])
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as possible while each holds at least `min_shard_bytes`.

    TF's ``min_max_variable_partitioner``: ``ceil(total_bytes / min_shard_bytes)`` shards,
    at most `max_shards` and at most the length of the axis, at least 1.

    Args:
      min_shard_bytes: the least bytes of a shard (256 KiB by default).
      max_shards: the most shards (1 by default).
      bytes_per_string: the bytes counted per element of a string variable.

    Raises:
      ValueError: if an argument is not a positive int.

    Example:

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), "float32")
    [6, 1]
    """

    def __init__(
        self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16
    ):
        self._min_shard_bytes = check_positive_int(
            min_shard_bytes, "min_shard_bytes", "E.g. 256 << 10 for 256 KiB."
        )
        self._max_shards = check_positive_int(max_shards, "max_shards", "E.g. max_shards=4.")
        self._bytes_per_string = check_positive_int(
            bytes_per_string, "bytes_per_string", "The default is 16."
        )

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims = _check_shape(shape, axis)
        total = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        partitions = total / self._min_shard_bytes
        result = [1] * len(dims)
        result[axis] = max(1, min(dims[axis], self._max_shards, math.ceil(partitions)))
        return result

    def __repr__(self) -> str:
        return (
            f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, "
            f"max_shards={self._max_shards}, bytes_per_string={self._bytes_per_string})"
        )


class MaxSizePartitioner(Partitioner):
    """As few shards as possible while each holds at most `max_shard_bytes`.

    TF's ``variable_axis_size_partitioner``: as many whole slices of the axis as fit in
    `max_shard_bytes` go in each shard (at least one), capped at `max_shards`, so with the
    cap a shard may exceed `max_shard_bytes`.

    Args:
      max_shard_bytes: the most bytes of a shard.
      max_shards: the most shards; None for no limit.
      bytes_per_string: the bytes counted per element of a string variable.

    Raises:
      ValueError: if an argument is not a positive int (or None for `max_shards`).

    Example:

    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
    [6, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), "float32")
    [2, 1]
    >>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), "float32")
    [1, 1]
    """

    def __init__(
        self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16
    ):
        self._max_shard_bytes = check_positive_int(
            max_shard_bytes, "max_shard_bytes", "E.g. (64 << 20) - 1 for just under 64 MiB."
        )
        self._max_shards = (
            None
            if max_shards is None
            else check_positive_int(max_shards, "max_shards", "Pass None for no limit.")
        )
        self._bytes_per_string = check_positive_int(
            bytes_per_string, "bytes_per_string", "The default is 16."
        )

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims = _check_shape(shape, axis)
        element = _element_bytes(dtype, self._bytes_per_string)
        result = [1] * len(dims)
        if dims[axis] == 0:
            return result
        bytes_per_slice = 1.0 * (math.prod(dims) / dims[axis]) * element
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        axis_shards = math.ceil(1.0 * dims[axis] / slices_per_shard)
        if self._max_shards:
            axis_shards = min(self._max_shards, axis_shards)
        result[axis] = axis_shards
        return result

    def __repr__(self) -> str:
        return (
            f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, "
            f"max_shards={self._max_shards}, bytes_per_string={self._bytes_per_string})"
        )


def shard_offsets(rows: int, num_shards: int) -> list[int]:
    """The row offsets of TF's "div" layout: shard i holds rows ``offsets[i]:offsets[i+1]``.

    The first ``rows % num_shards`` shards get ``rows // num_shards + 1`` rows, the others
    ``rows // num_shards``.

    Args:
      rows: the length of the first axis.
      num_shards: the number of shards, 1 to `rows`.

    Returns:
      ``num_shards + 1`` increasing offsets from 0 to `rows`.

    Raises:
      ValueError: if `num_shards` is not in ``[1, rows]``.

    Example:

    >>> shard_offsets(13, 5)
    [0, 3, 6, 9, 11, 13]
    >>> shard_offsets(10, 4)
    [0, 3, 6, 8, 10]
    """
    if not 1 <= num_shards <= max(rows, 1):
        raise ValueError(
            f"`num_shards` must be in [1, {rows}] for a first axis of {rows} rows; got "
            f"{num_shards}."
        )
    base, extra = divmod(rows, num_shards)
    offsets = [0]
    for i in range(num_shards):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets
