"""What a checkpoint holds on disk: the ``state`` item and the ``jstrategy`` record.

The state is written as a pytree of arrays (`prepare`: containers give their arrays,
agreeing `PerReplica` values one copy, typed PRNG keys their raw data); the record lists
each leaf's path, dtype, shape and fingerprint (and a key's implementation), with the
user's metadata and the metrics (`_record`, read back by `read_record`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src.checkpoint.errors import READ_ERRORS
from jstrategy._src.checkpoint.errors import CheckpointError
from jstrategy._src.checkpoint.errors import advice
from jstrategy._src.checkpoint.errors import show
from jstrategy._src.checkpoint.fingerprint import leaf_fingerprints
from jstrategy._src.names import path_names
from jstrategy._src.values import PerReplica
from jstrategy._src.values import is_key
from jstrategy._src.values import is_per_replica
from jstrategy._src.values import key_data
from jstrategy._src.values import keys_from_data

__all__ = [
    "RECORD_ITEM",
    "SAVABLE",
    "STATE_ITEM",
    "as_saveable",
    "check_metadata",
    "flatten_state",
    "is_single_checkpoint",
    "leaf_records",
    "prepare",
    "read_record",
    "save_args",
    "saved_dtype",
]


STATE_ITEM = "state"
RECORD_ITEM = "jstrategy"
_FORMAT = "jstrategy.checkpoint/1"


_HOST_SCALARS = (bool, int, float)
SAVABLE = (jax.Array, np.ndarray, np.generic, *_HOST_SCALARS)


def _numeric(dtype: np.dtype) -> bool:
    # ml_dtypes' types (bfloat16, float8_*, int4) have NumPy kind "V", like raw bytes.
    return dtype.kind in "biufc" or dtype.type.__module__.startswith("ml_dtypes")


# Saving ---------------------------------------------------------------------------------------
def as_saveable(state: Any) -> Any:
    """A state as a pytree of arrays: containers of variables say how (`checkpoint_value`)."""
    value = getattr(state, "checkpoint_value", None)
    return value() if callable(value) else state


def flatten_state(state: Any, argname: str) -> list[tuple[tuple[str, ...], Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    if not flat:
        raise ValueError(
            f"`{argname}` must contain at least one array; got {type(state).__name__} with no "
            "leaves."
        )
    out = []
    for keypath, leaf in flat:
        path = path_names(keypath)
        if not isinstance(leaf, SAVABLE) or (
            isinstance(leaf, (np.ndarray, np.generic)) and not _numeric(leaf.dtype)
        ):
            raise TypeError(
                f"`{argname}` leaf {show(path)} is a {type(leaf).__name__}"
                f"{f' of {leaf.dtype}' if hasattr(leaf, 'dtype') else ''}; checkpoints hold "
                "numeric jax.Arrays and NumPy arrays and Python numbers. Keep other values "
                "out of the pytree (e.g. a flax.struct field with pytree_node=False) or put "
                "JSON-able values in `metadata`."
            )
        out.append((path, leaf))
    return out


def prepare(state: Any, argname: str) -> tuple[Any, list[tuple[tuple[str, ...], Any]], dict]:
    """What is written for `state`: (the pytree of arrays, its flat leaves, key impls).

    Containers of variables give their arrays (`as_saveable`); `PerReplica` values become
    one copy (`_one_copy`); typed PRNG keys become their raw data, and the record keeps
    their implementation so that a restore without a target gives keys back.
    """
    state = as_saveable(state)

    def arrays(keypath: Any, leaf: Any) -> Any:
        if isinstance(leaf, PerReplica):
            return _one_copy(leaf, path_names(keypath), argname)
        return leaf

    state = jax.tree_util.tree_map_with_path(arrays, state, is_leaf=is_per_replica)
    impls: dict[tuple[str, ...], str] = {}

    def as_data(keypath: Any, leaf: Any) -> Any:
        if is_key(leaf):
            impls[path_names(keypath)] = str(jax.random.key_impl(leaf))
        return key_data(leaf)

    state = jax.tree_util.tree_map_with_path(as_data, state)
    return state, flatten_state(state, argname), impls


def _agreement(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    first = x[0]
    same = x == first
    if jnp.issubdtype(x.dtype, jnp.inexact):
        same = same | (jnp.isnan(x) & jnp.isnan(first))  # NaN where every replica has NaN
    return first, jnp.all(same)


def _one_copy(value: PerReplica, path: tuple[str, ...], argname: str) -> jax.Array:
    """The value of a `PerReplica` whose replicas agree, as one mirrored array.

    This is what TF saves for a mirrored variable, and what `run` returns for parameters
    updated from all-reduced gradients: a `PerReplica` whose replicas hold the same value.
    Replicas that differ cannot be one checkpoint value, and are refused.
    """
    if not value.stacked:
        raise TypeError(
            f"`{argname}` leaf {show(path)} is a PerReplica of rows (a distributed batch), "
            "not a variable. Save variables; gather rows first with "
            "strategy.gather(value, axis=0) if they must be kept."
        )
    x = value.value
    data = key_data(x)
    sharding = x.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise TypeError(
            f"`{argname}` leaf {show(path)} is a PerReplica not laid over a strategy's mesh "
            f"({sharding}). Save values made by a strategy's `run`."
        )
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    first, agree = jax.jit(_agreement, out_shardings=(replicated, replicated))(data)
    if not bool(agree):  # every process computes and reads the same verdict
        raise ValueError(
            f"`{argname}` leaf {show(path)} is a PerReplica whose {value.num_replicas} "
            "replicas hold different values, but a checkpoint keeps one value per variable. "
            f'Save their mean, `strategy.reduce("MEAN", {argname}, axis=None)` (in one '
            "process or several), or make the replicas agree: all-reduce the gradients "
            "inside `run` (jstrategy.get_replica_context().all_reduce)."
        )
    return keys_from_data(first, jax.random.key_impl(x)) if is_key(x) else first


def _record(
    flat: list[tuple[tuple[str, ...], Any]],
    metadata: Mapping[str, Any] | None,
    metrics: dict[str, float] | None,
    key_impls: Mapping[tuple[str, ...], str],
) -> dict[str, Any]:
    fingerprints = leaf_fingerprints([leaf for _, leaf in flat])
    leaves = []
    for (path, leaf), fp in zip(flat, fingerprints, strict=True):
        dtype = leaf.dtype if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) else None
        dtype = np.dtype(dtype) if dtype is not None else np.asarray(leaf).dtype
        entry = [list(path), str(dtype), list(np.shape(leaf)), fp]
        if path in key_impls:
            # The raw data of a typed PRNG key array, and the key's implementation.
            entry.append(key_impls[path])
        leaves.append(entry)
    return {
        "format": _FORMAT,
        "leaves": leaves,
        "metadata": None if metadata is None else dict(metadata),
        "metrics": metrics,
    }


def check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"`metadata` must be a dict of JSON-able values; got {type(metadata).__name__}."
        )
    try:
        json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`metadata` must be JSON-able (str keys; str, numbers, bools, None, lists, "
            f"dicts); {e}. Convert arrays with .tolist() or int()/float()."
        ) from None


def save_args(flat, state, metadata, metrics, key_impls):
    import orbax.checkpoint as ocp

    return ocp.args.Composite(
        **{
            STATE_ITEM: ocp.args.StandardSave(state),
            RECORD_ITEM: ocp.args.JsonSave(_record(flat, metadata, metrics, key_impls)),
        }
    )


# Reading ---------------------------------------------------------------------------------------
def saved_dtype(name: str) -> np.dtype:
    # jnp.dtype also knows the ml_dtypes names NumPy lacks ("bfloat16", "float8_e4m3fn").
    return np.dtype(jnp.dtype(name))


def leaf_records(record: dict, location: str) -> dict[tuple[str, ...], dict]:
    try:
        records = {}
        for path, dtype, shape, fp, *key_impl in record["leaves"]:
            records[tuple(path)] = {
                "dtype": dtype,
                "shape": shape,
                "fingerprint": fp,
                "key_impl": key_impl[0] if key_impl else None,
            }
        for rec in records.values():
            saved_dtype(rec["dtype"])
        return records
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(
            f"The checkpoint record in {location} is malformed. {advice(location)}", path=location
        ) from None


def read_record(read, location: str) -> dict:
    import orbax.checkpoint as ocp

    try:
        record = read(ocp.args.JsonRestore(), item=RECORD_ITEM)
    except READ_ERRORS as e:
        raise CheckpointError(
            f"The checkpoint in {location} has no readable jstrategy record (the "
            f"'{RECORD_ITEM}' item): it is damaged, incomplete, or was not written by "
            f"jstrategy ({type(e).__name__}: {str(e)[:300]}). {advice(location)}",
            path=location,
        ) from e
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise CheckpointError(
            f"The checkpoint record in {location} is not a {_FORMAT} record; got "
            f"{str(record)[:200]}. {advice(location)}",
            path=location,
        )
    return record


def is_single_checkpoint(path: str) -> bool:
    """Whether `path` is one checkpoint (a weights directory or a manager's step)."""
    return os.path.isdir(os.path.join(path, RECORD_ITEM)) or os.path.isdir(
        os.path.join(path, STATE_ITEM)
    )
