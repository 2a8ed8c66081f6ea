"""Elements made of per-replica batches: `distribute_datasets_from_function`'s pipelines,
one per replica (``PER_REPLICA``) or one per process whose consecutive batches go to its
replicas (``PER_WORKER``, as TF), each batch padded to one replica's static rows.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jstrategy._src.input.checks import flatten_batch
from jstrategy._src.input.placement import Placer
from jstrategy._src.input.placement import put_rows
from jstrategy._src.input.rows import process_local_batch
from jstrategy._src.values import PerReplica

__all__ = ["init_per_pipeline", "place_per_replica"]


def init_per_pipeline(
    placer: Placer, flat: list[tuple[list[Any], Any, int]], where: str, *, per_replica: bool
) -> None:
    """Fixes the static sizes from the first batch of each pipeline (the largest wins)."""
    leaves, treedef, rows = flat[0]
    if per_replica:
        # Every replica gets the same static rows: the largest first batch, on each replica.
        biggest = max(item[2] for item in flat)
        placer.init(leaves, treedef, biggest * placer.local_replicas, where)
    else:
        placer.init(leaves, treedef, rows, where)


def place_per_replica(placer: Placer, batches: list[Any], where: str, *, on_host: bool) -> Any:
    """One element made of one per-replica batch for each local replica, in replica order.

    With one pipeline per replica (`InputReplicationMode.PER_REPLICA`) each replica takes
    the next batch of its own pipeline; with one pipeline per process (``PER_WORKER``) the
    replicas take its next consecutive batches, in replica order, as in TF. A pipeline that
    ends before the others (or mid-step) gives empty (all-padding) batches until every
    pipeline has ended, so uneven pipelines still step in lockstep.

    Args:
      placer: the dataset's placer.
      batches: each local replica's batch; None for a pipeline that has ended.
      where: how errors name the element.
      on_host: keep the element on the host (NumPy values and mask).

    Returns:
      The batches' pytree with each leaf a split `PerReplica`, all sharing one row mask.
    """
    flat: list[tuple[list[Any], Any, int] | None] = [
        None if batch is None else flatten_batch(batch, f"{where} of pipeline {r}")
        for r, batch in enumerate(batches)
    ]
    if placer.spec is None:
        init_per_pipeline(placer, [f for f in flat if f is not None], where, per_replica=True)
    per = placer.static_rows // placer.local_replicas
    for r, item in enumerate(flat):
        if item is None:
            continue
        leaves, treedef, rows = item
        here = f"{where} of pipeline {r}"
        placer.check(leaves, treedef, rows, here)
        if rows > per:
            raise ValueError(
                f"{here} has {rows} rows, more than the static per-replica batch size {per} "
                f"(from {placer.source_of_size}). Make the first batch the largest, or pass "
                f"global_batch_size={rows * placer.num_replicas}."
            )
    spec = placer.spec
    assert spec is not None
    pieces: list[list[np.ndarray]] = []  # one list of padded leaves per replica
    masks = []
    for item in flat:
        if item is None:
            leaves = [
                np.zeros((0, *s), d) for s, d in zip(spec.row_shapes, spec.dtypes, strict=True)
            ]
            rows = 0
        else:
            leaves, _, rows = item
            leaves = [np.asarray(x) for x in leaves]
        padded, replica_mask = process_local_batch(leaves, rows, per, None)
        pieces.append(padded)
        masks.append(replica_mask)
    shapes = placer.static_shapes()
    values: list[Any]
    mask: Any
    if on_host:
        mask = np.concatenate(masks)
        mask.flags.writeable = False
        values = [np.concatenate(per_leaf) for per_leaf in zip(*pieces, strict=True)]
    else:
        # This process's rows are its replicas' batches, in replica order.
        columns = [*zip(*pieces, strict=True), masks]
        local = [np.concatenate(column) for column in columns]
        sharding = placer.strategy.batch_sharding()
        each = [*placer.leaf_shardings(), sharding]  # sequences split over a context axis
        *values, mask = put_rows(each, local, [*shapes, (placer.static_global,)])
    return jax.tree.unflatten(
        spec.treedef, [PerReplica(v, stacked=False, mask=mask) for v in values]
    )
