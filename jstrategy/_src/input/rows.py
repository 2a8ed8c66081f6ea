"""Which rows of a global batch each replica and each process owns, and the one pad-and-mask.

Pure host-side functions of sizes and NumPy arrays, so any process layout can be tested in
one process: replica *i* owns the *i*-th contiguous slice of rows, as in tf.distribute; a
process feeds the rows of its replicas, in mesh order (`process_row_slices`); a batch with
fewer rows than the static size is padded with zero rows and a row mask (`pad_rows`).
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence
from typing import Any

import numpy as np

from jstrategy._src.numerics import round_up

__all__ = ["pad_rows", "process_local_batch", "process_row_slices", "replica_row_slices"]


def replica_row_slices(global_batch_size: int, num_replicas: int) -> tuple[slice, ...]:
    """The rows of a global batch that each replica owns: replica *i* gets the *i*-th slice.

    Args:
      global_batch_size: rows in the (padded) global batch.
      num_replicas: replicas in sync; must divide `global_batch_size`.

    Returns:
      One `slice` per replica, in replica order.

    Raises:
      ValueError: if `global_batch_size` does not divide by `num_replicas`.

    Example:

    >>> replica_row_slices(8, 4)
    (slice(0, 2, None), slice(2, 4, None), slice(4, 6, None), slice(6, 8, None))
    """
    if num_replicas < 1 or global_batch_size % num_replicas:
        padded = round_up(global_batch_size, max(num_replicas, 1))
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must be a multiple of the number of "
            f"replicas ({num_replicas}); pad the batch to {padded} rows."
        )
    per = global_batch_size // num_replicas
    return tuple(slice(i * per, (i + 1) * per) for i in range(num_replicas))


def process_row_slices(
    global_batch_size: int,
    device_process_indices: Sequence[int | Collection[int]],
    process_index: int,
) -> tuple[slice, ...]:
    """The rows of a global batch that one process feeds, given which process owns each replica.

    Replica *i* (the *i*-th device of the strategy's mesh) owns the *i*-th contiguous slice
    of rows; a process feeds the rows of its replicas, in mesh order. Where a strategy
    splits each replica's rows over its devices too, the same holds of each block of rows
    (`values.row_blocks`), which is what the placement passes. Adjacent slices are
    merged, so a process whose devices are contiguous in the mesh gets a single slice (and
    its rows are a view of the batch, not a copy). The concatenation of the returned slices
    is exactly the process-local data `jax.make_array_from_process_local_data` expects.

    Args:
      global_batch_size: rows in the (padded) global batch.
      device_process_indices: the process index of each replica's device, in replica order
        (a collection of indices for a replica whose devices span several processes).
      process_index: the process asking.

    Returns:
      The row slices of `process_index`, in order; empty if it owns no replica.

    Raises:
      ValueError: if `global_batch_size` does not divide by the number of replicas.

    Example:

    >>> process_row_slices(8, [0, 0, 1, 1], 1)
    (slice(4, 8, None),)
    >>> process_row_slices(8, [0, 1, 0, 1], 0)
    (slice(0, 2, None), slice(4, 6, None))
    """
    rows = replica_row_slices(global_batch_size, len(device_process_indices))
    merged: list[slice] = []
    for owner, sl in zip(device_process_indices, rows, strict=True):
        if process_index not in (owner if isinstance(owner, Collection) else (owner,)):
            continue
        if merged and merged[-1].stop == sl.start:
            merged[-1] = slice(merged[-1].start, sl.stop)
        else:
            merged.append(sl)
    return tuple(merged)


def pad_rows(
    leaves: Sequence[Any], num_rows: int, static_size: int, lead: tuple[int, ...] = ()
) -> tuple[list[Any], np.ndarray]:
    """Pads each leaf's row axis to `static_size` rows of zeros; returns them with a row mask.

    The one pad-and-mask of jstrategy's input: distributed datasets (`process_local_batch`)
    and `jstrategy.Model`'s data adapters use it. Leaves that already have `static_size`
    rows are returned as they are.

    Args:
      leaves: arrays whose axis ``len(lead)`` holds `num_rows` rows.
      num_rows: the real rows.
      static_size: the rows after padding.
      lead: the sizes of the axes before the rows (several batches stacked), if any.

    Returns:
      ``(leaves, mask)``: the padded leaves and a bool array of shape ``lead +
      (static_size,)``, true for real rows.

    Example:

    >>> leaves, mask = pad_rows([np.ones((2, 3))], 3, 4, lead=(2,))
    >>> leaves[0].shape, mask.tolist()
    ((2, 4), [[True, True, True, False], [True, True, True, False]])
    """
    axis = len(lead)
    if num_rows < static_size:
        padded = []
        for x in leaves:
            x = np.asarray(x)
            out = np.zeros((*x.shape[:axis], static_size, *x.shape[axis + 1 :]), x.dtype)
            out[(slice(None),) * axis + (slice(0, num_rows),)] = x
            padded.append(out)
        leaves = padded
    mask = np.arange(static_size) < num_rows
    if lead:
        mask = np.broadcast_to(mask, (*lead, static_size)).copy()
    return list(leaves), mask


def process_local_batch(
    leaves: Sequence[np.ndarray],
    num_rows: int,
    static_size: int,
    row_slices: Sequence[slice] | None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Pads a global batch to `static_size` rows and keeps one process's rows, with a mask.

    The host-side half of placement, separate so it can be tested with any process layout.
    A full batch (``num_rows == static_size``) owned by one contiguous slice is returned
    without copying.

    Args:
      leaves: the batch's arrays, each with `num_rows` leading rows.
      num_rows: the real rows of the batch.
      static_size: the rows every element has after padding.
      row_slices: the rows this process feeds (from `process_row_slices`); None for all.

    Returns:
      ``(local_leaves, local_mask)``: the process's rows of each padded leaf, and a bool
      vector, true for real rows.

    Example:

    >>> leaves, mask = process_local_batch([np.arange(3)], 3, 4, [slice(2, 4)])
    >>> leaves[0].tolist(), mask.tolist()
    ([2, 0], [True, False])
    """
    leaves, mask = pad_rows(leaves, num_rows, static_size)
    if row_slices is None or (
        len(row_slices) == 1 and row_slices[0].start == 0 and row_slices[0].stop == static_size
    ):
        return list(leaves), mask
    if len(row_slices) == 1:
        sl = row_slices[0]
        return [x[sl] for x in leaves], mask[sl]
    return (
        [np.concatenate([np.asarray(x[sl]) for sl in row_slices]) for x in leaves],
        np.concatenate([mask[sl] for sl in row_slices]),
    )
