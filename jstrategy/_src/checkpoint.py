"""Checkpoints that restore under any strategy, built on orbax-checkpoint.

Every checkpoint (a step of a `CheckpointManager`, or a `save_weights` directory) holds two
orbax items:

* ``state``: the pytree, written by orbax's array handlers. Each process writes the shards it
  holds (replicated shards once), so a sharded state is never gathered on one host.
* ``jstrategy``: a small JSON record with one entry per leaf (path, dtype, shape and a
  32-bit fingerprint of its bits, and for a typed PRNG key array, saved as its raw data,
  the key's implementation), the user's metadata and the metrics.

Restoring reads the record first, restores every leaf straight into the layout the target
strategy wants (`_target_sharding`), then recomputes the fingerprints on the devices and
compares them, so a damaged file gives `CheckpointError` rather than wrong weights: orbax
and tensorstore read a checkpoint whose data bytes were overwritten without any error.

Writes are atomic: orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it
when every item is complete, so a process killed mid-write leaves the previous step as the
latest; the next `CheckpointManager` on the directory removes the leftover. Deletions are
atomic too: a step dropped by `max_to_keep` is renamed into ``.jstrategy-deleted`` before
its files are removed (see `_Trash`), so a listed step is always a whole one.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src import context
from jstrategy._src import coordination
from jstrategy._src import dispatch
from jstrategy._src.names import path_names
from jstrategy._src.placement import in_device_memory
from jstrategy._src.values import PerReplica
from jstrategy._src.values import is_per_replica

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = ["BestMode", "CheckpointError", "CheckpointManager", "load_weights", "save_weights"]

_STATE_ITEM = "state"
_RECORD_ITEM = "jstrategy"
_FORMAT = "jstrategy.checkpoint/1"
# Left by an interrupted `save_weights(..., overwrite=True)` next to the weights directory.
_NEW_SUFFIX = ".jstrategy-new"
_OLD_SUFFIX = ".jstrategy-old"

_HOST_SCALARS = (bool, int, float)
_SAVABLE = (jax.Array, np.ndarray, np.generic, *_HOST_SCALARS)


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or incomplete; the message names it and says what to do.

    Attributes:
      path: the checkpoint directory concerned.
    """

    def __init__(self, message: str, *, path: os.PathLike | str):
        super().__init__(message)
        self.path = os.fspath(path)


class BestMode(enum.Enum):
    """Whether a lower (``MIN``, e.g. a loss) or higher (``MAX``) metric is better."""

    MIN = "min"
    MAX = "max"


# Where restored leaves live -----------------------------------------------------------------
def _target_sharding(
    strategy: Strategy, leaf: jax.ShapeDtypeStruct, *, path: tuple[str, ...] = ()
) -> jax.sharding.Sharding:
    """The sharding a restored leaf gets under `strategy`: `Strategy.variable_sharding`.

    A strategy decides where its variables live in that one method, for checkpoints as for
    training: OneDevice and Mirrored strategies keep one full copy per replica
    (`strategy.replicated_sharding()`); CentralStorage keeps one copy in host memory;
    MultiWorkerMirrored's replicated sharding spans every worker's devices (orbax reads on
    each process only the shards that process holds); a partitioned strategy returns e.g.
    ``NamedSharding(mesh, P("ps"))`` for the variables it shards. Orbax then reads each
    shard straight into place, never the whole array.

    Args:
      strategy: the strategy the state is restored into.
      leaf: the leaf's shape and dtype (no sharding).
      path: the leaf's keys in the state, as strings (e.g. ``("params", "dense", "kernel")``).

    Returns:
      A `jax.sharding.Sharding` for the leaf.

    Raises:
      TypeError: if the strategy's `variable_sharding` returns something that is not a
        Sharding.
    """
    sharding = strategy.variable_sharding(leaf, path)
    if not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(
            f"{type(strategy).__name__}.variable_sharding must return a "
            f"jax.sharding.Sharding for leaf {'/'.join(path)}; got {type(sharding).__name__}."
        )
    if not sharding.addressable_devices:
        # E.g. the default strategy (JAX's first device, process 0's) on another worker.
        raise ValueError(
            f"Cannot restore into {strategy!r}: none of its devices belongs to this process "
            f"(process {jax.process_index()} of {jax.process_count()}). In a multi-worker "
            "job, pass "
            "strategy=<the job's MultiWorkerMirroredStrategy> (or restore inside its "
            "scope()) on every worker."
        )
    return sharding


# Paths and fingerprints ---------------------------------------------------------------------
# Orbax names leaves by the same strings as `path_names`, so a TrainState's `.params` and
# the dict key 'params' of a target-less restore are the same leaf.
def _show(path: tuple[str, ...]) -> str:
    return "/".join(path) or "<root>"


def _numeric(dtype: np.dtype) -> bool:
    # ml_dtypes' types (bfloat16, float8_*, int4) have NumPy kind "V", like raw bytes.
    return dtype.kind in "biufc" or dtype.type.__module__.startswith("ml_dtypes")


# Sub-byte types pack several elements per byte on devices: not bitcast per element.
_SUB_BYTE = frozenset({"int2", "uint2", "int4", "uint4", "float4_e2m1fn"})


def _hashable_dtype(dtype: np.dtype) -> bool:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or dtype.name in _SUB_BYTE:
        return False
    if np.issubdtype(dtype, np.complexfloating):
        return dtype.itemsize in (8, 16)
    return dtype.itemsize in (1, 2, 4, 8) and dtype.kind in "biufV"


def _mix(u: Any, xp: Any) -> Any:
    # A position-dependent 32-bit mix (murmur3's finalizer), summed with wraparound: a
    # changed, moved or truncated element changes the sum, except with chance 2**-32.
    i = xp.arange(u.shape[0], dtype=xp.uint32)
    h = u * xp.uint32(0x9E3779B1) + i * xp.uint32(0x85EBCA77) + xp.uint32(1)
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * xp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return xp.sum(h, dtype=xp.uint32)


def _words_np(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.bool_:
        x = x.view(np.uint8)
    if np.issubdtype(x.dtype, np.complexfloating):
        x = x.view(np.float32 if x.dtype.itemsize == 8 else np.float64)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize]
    return x.view(unsigned).astype(np.uint32)


def _words_jax(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    size = x.dtype.itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    # An 8-byte element becomes two words, low word first, as NumPy's view on little-endian.
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


def _fingerprint_np(x: np.ndarray) -> int:
    return int(_mix(_words_np(x), np))


@jax.jit
def _fingerprint_jax(x: jax.Array) -> jax.Array:
    return _mix(_words_jax(x), jnp)


def _fingerprints(leaves: list[Any]) -> list[int | None]:
    """One fingerprint per leaf (None where the dtype has no fixed-width bits)."""
    out: list[Any] = [None] * len(leaves)
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            if _hashable_dtype(np.dtype(x.dtype)):
                # One small program per leaf rather than one for the whole state: it compiles
                # once per distinct shape, dtype and sharding (a model repeats a few), where a
                # program over hundreds of leaves took seconds to compile.
                out[i] = _fingerprint_jax(in_device_memory(x))
                # Sharded leaves all-reduce their partial sums: keep the queue short.
                dispatch.track(out[i])
        else:
            a = np.asarray(x)
            if _hashable_dtype(a.dtype):
                out[i] = _fingerprint_np(a)
    return [None if v is None else int(v) for v in jax.device_get(out)]


# Saving ---------------------------------------------------------------------------------------
def _flatten_state(state: Any, argname: str) -> list[tuple[tuple[str, ...], Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    if not flat:
        raise ValueError(
            f"`{argname}` must contain at least one array; got {type(state).__name__} with no "
            "leaves."
        )
    out = []
    for keypath, leaf in flat:
        path = path_names(keypath)
        if not isinstance(leaf, _SAVABLE) or (
            isinstance(leaf, (np.ndarray, np.generic)) and not _numeric(leaf.dtype)
        ):
            raise TypeError(
                f"`{argname}` leaf {_show(path)} is a {type(leaf).__name__}"
                f"{f' of {leaf.dtype}' if hasattr(leaf, 'dtype') else ''}; checkpoints hold "
                "numeric jax.Arrays and NumPy arrays and Python numbers. Keep other values "
                "out of the pytree (e.g. a flax.struct field with pytree_node=False) or put "
                "JSON-able values in `metadata`."
            )
        out.append((path, leaf))
    return out


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _prepare(state: Any, argname: str) -> tuple[Any, list[tuple[tuple[str, ...], Any]], dict]:
    """What is written for `state`: (the pytree of arrays, its flat leaves, key impls).

    Containers of variables give their arrays (`_as_saveable`); `PerReplica` values become
    one copy (`_one_copy`); typed PRNG keys become their raw data, and the record keeps
    their implementation so that a restore without a target gives keys back.
    """
    state = _as_saveable(state)

    def arrays(keypath: Any, leaf: Any) -> Any:
        if isinstance(leaf, PerReplica):
            return _one_copy(leaf, path_names(keypath), argname)
        return leaf

    state = jax.tree_util.tree_map_with_path(arrays, state, is_leaf=is_per_replica)
    impls: dict[tuple[str, ...], str] = {}

    def key_data(keypath: Any, leaf: Any) -> Any:
        if not _is_key(leaf):
            return leaf
        impls[path_names(keypath)] = str(jax.random.key_impl(leaf))
        return jax.random.key_data(leaf)

    state = jax.tree_util.tree_map_with_path(key_data, state)
    return state, _flatten_state(state, argname), impls


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
            f"`{argname}` leaf {_show(path)} is a PerReplica of rows (a distributed batch), "
            "not a variable. Save variables; gather rows first with "
            "strategy.gather(value, axis=0) if they must be kept."
        )
    x = value.value
    keys = _is_key(x)
    data = jax.random.key_data(x) if keys else x
    sharding = x.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise TypeError(
            f"`{argname}` leaf {_show(path)} is a PerReplica not laid over a strategy's mesh "
            f"({sharding}). Save values made by a strategy's `run`."
        )
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    first, agree = jax.jit(_agreement, out_shardings=(replicated, replicated))(data)
    if not bool(agree):  # every process computes and reads the same verdict
        raise ValueError(
            f"`{argname}` leaf {_show(path)} is a PerReplica whose {value.num_replicas} "
            "replicas hold different values, but a checkpoint keeps one value per variable. "
            f'Save their mean, `strategy.reduce("MEAN", {argname}, axis=None)` (in one '
            "process or several), or make the replicas agree: all-reduce the gradients "
            "inside `run` (jstrategy.get_replica_context().all_reduce)."
        )
    return jax.random.wrap_key_data(first, impl=jax.random.key_impl(x)) if keys else first


def _record(
    flat: list[tuple[tuple[str, ...], Any]],
    metadata: Mapping[str, Any] | None,
    metrics: dict[str, float] | None,
    key_impls: Mapping[tuple[str, ...], str],
) -> dict[str, Any]:
    fingerprints = _fingerprints([leaf for _, leaf in flat])
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


def _check_metadata(metadata: Any) -> None:
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


def _save_args(flat, state, metadata, metrics, key_impls):
    import orbax.checkpoint as ocp

    return ocp.args.Composite(
        **{
            _STATE_ITEM: ocp.args.StandardSave(state),
            _RECORD_ITEM: ocp.args.JsonSave(_record(flat, metadata, metrics, key_impls)),
        }
    )


# Restoring -------------------------------------------------------------------------------------
_JAX, _NUMPY, _PYTHON = "jax", "numpy", "python"


class _Plan:
    """How one leaf is read (`read`, a spec orbax understands) and what it becomes."""

    __slots__ = ("dtype", "key_impl", "kind", "path", "read", "record", "sharding", "target")

    def __init__(self, path, record, kind, dtype, sharding, target, key_impl=None):
        self.path, self.record, self.kind = path, record, kind
        self.dtype, self.sharding, self.target = dtype, sharding, target
        # The raw data read is wrapped into typed PRNG keys of this implementation.
        self.key_impl = key_impl
        saved = _dtype(record["dtype"])
        shape = tuple(record["shape"])
        if kind == _JAX and jax.dtypes.canonicalize_dtype(saved) == saved:
            # Straight into the target layout: orbax reads each shard where it belongs.
            self.read = jax.ShapeDtypeStruct(shape, saved, sharding=sharding)
        else:
            # A 64-bit value JAX cannot hold (or a host value): read it as NumPy in the saved
            # dtype, check it, then convert.
            self.read = jax.ShapeDtypeStruct(shape, saved)


def _dtype(name: str) -> np.dtype:
    # jnp.dtype also knows the ml_dtypes names NumPy lacks ("bfloat16", "float8_e4m3fn").
    return np.dtype(jnp.dtype(name))


def _leaf_records(record: dict, location: str) -> dict[tuple[str, ...], dict]:
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
            _dtype(rec["dtype"])
        return records
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(
            f"The checkpoint record in {location} is malformed. {_advice(location)}", path=location
        ) from None


def _advice(location: str) -> str:
    """What to do about a damaged checkpoint: a manager's step, or a weights directory."""
    if os.path.basename(os.fspath(location)).isdigit():
        return "Restore another step (restore(step=...)), or delete this directory and save again."
    return "Save the weights again (save_weights), or load another copy of them."


def _plan_restore(
    records: dict[tuple[str, ...], dict],
    target: Any,
    strategy: Strategy | None,
    location: str,
    abstract_from_orbax: Callable[[], Any],
):
    """Decides how each leaf is read and placed; returns (plans, treedef of the result)."""
    if target is None:
        strategy_ = strategy if strategy is not None else _current_strategy(location)
        target = abstract_from_orbax()
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        plans = []
        for keypath, meta in flat:
            path = path_names(keypath)
            rec = _record_for(records, path, location)
            dtype = jax.dtypes.canonicalize_dtype(_dtype(rec["dtype"]))
            leaf = jax.ShapeDtypeStruct(tuple(rec["shape"]), dtype)
            sharding = _target_sharding(strategy_, leaf, path=path)
            plans.append(_Plan(path, rec, _JAX, dtype, sharding, meta, rec["key_impl"]))
        if len(plans) != len(records):
            raise CheckpointError(
                f"The checkpoint in {location} has {len(plans)} arrays but its record lists "
                f"{len(records)}; the directory is damaged. {_advice(location)}",
                path=location,
            )
        return plans, treedef

    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    if not flat:
        raise ValueError("`target` must contain at least one array leaf; got none.")
    paths = [path_names(k) for k, _ in flat]
    _check_same_leaves(records, paths, location)
    plans = []
    for path, (_, leaf) in zip(paths, flat, strict=True):
        rec = records[path]
        shape = tuple(rec["shape"])
        key_impl = None
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and jax.dtypes.issubdtype(
            leaf.dtype, jax.dtypes.prng_key
        ):
            # A typed key is restored from its raw data (what was saved), then wrapped.
            key_impl = _key_impl(leaf, rec, path)
            data = jax.eval_shape(jax.random.key_data, leaf)
            # The key's sharding fits its data: the data's extra last axis is not split.
            own_sharding = getattr(leaf, "sharding", None)
            leaf = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=own_sharding)
        if not isinstance(leaf, (*_SAVABLE, jax.ShapeDtypeStruct)) or isinstance(leaf, str):
            raise TypeError(
                f"`target` leaf {_show(path)} is a {type(leaf).__name__}; pass arrays, "
                "jax.ShapeDtypeStruct (e.g. jax.eval_shape output) or Python numbers."
            )
        if tuple(np.shape(leaf)) != shape:
            raise ValueError(
                f"`target` leaf {_show(path)} has shape {tuple(np.shape(leaf))} but the "
                f"checkpoint in {location} holds shape {shape}. Pass a target built for the "
                "same model as the checkpoint."
            )
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            dtype = np.dtype(leaf.dtype)
        else:
            dtype = np.asarray(leaf).dtype
        is_device = isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
        if strategy is not None or is_device:
            dtype = jax.dtypes.canonicalize_dtype(dtype)
            abstract = jax.ShapeDtypeStruct(shape, dtype)
            own = getattr(leaf, "sharding", None)
            if strategy is not None:
                sharding = _target_sharding(strategy, abstract, path=path)
            elif own is not None:
                sharding = own
            else:
                sharding = _target_sharding(_current_strategy(location), abstract, path=path)
            plans.append(_Plan(path, rec, _JAX, dtype, sharding, leaf, key_impl))
        else:
            kind = _NUMPY if isinstance(leaf, (np.ndarray, np.generic)) else _PYTHON
            plans.append(_Plan(path, rec, kind, dtype, None, leaf))
    return plans, treedef


def _current_strategy(location: str) -> Strategy:
    """The strategy a restore without `strategy=` places leaves with."""
    if jax.process_count() > 1 and not context.has_strategy():
        # Outside any scope that is the default strategy: one device, process 0's.
        raise ValueError(
            f"Restoring {location} in a multi-worker job needs the job's strategy: pass "
            "strategy=<your MultiWorkerMirroredStrategy>, or restore inside its scope(), on "
            "every worker."
        )
    return context.get_strategy()


def _key_impl(leaf: Any, record: dict, path: tuple[str, ...]) -> str:
    """The PRNG implementation of a typed-key `target` leaf (an array or an abstract one)."""
    if isinstance(leaf, jax.Array):
        return str(jax.random.key_impl(leaf))
    if record["key_impl"] is not None:
        return record["key_impl"]
    # An abstract key says its implementation only through its dtype.
    for name in ("threefry2x32", "rbg", "unsafe_rbg"):
        if jax.random.key(0, impl=name).dtype == leaf.dtype:
            return name
    raise TypeError(
        f"`target` leaf {_show(path)} is an abstract key array of {leaf.dtype}, whose "
        "implementation cannot be told. Pass a concrete key array for this leaf."
    )


def _record_for(records, path, location):
    rec = records.get(path)
    if rec is None:
        raise CheckpointError(
            f"The checkpoint in {location} has a leaf {_show(path)} that its record does not "
            f"list; the directory is damaged or not a jstrategy checkpoint. {_advice(location)}",
            path=location,
        )
    return rec


def _check_same_leaves(records, paths, location) -> None:
    wanted, saved = set(paths), set(records)
    if wanted == saved:
        return
    missing = sorted(_show(p) for p in wanted - saved)
    extra = sorted(_show(p) for p in saved - wanted)
    raise ValueError(
        f"`target` does not match the checkpoint in {location}: leaves missing from the "
        f"checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}; leaves in the "
        f"checkpoint but not in `target`: {extra[:5]}{' ...' if len(extra) > 5 else ''}. "
        "Pass a target with the structure of the saved state (or target=None to get the "
        "saved structure as nested dicts)."
    )


def _finish(plans: list[_Plan], values: list[Any], location: str) -> list[Any]:
    """Verifies fingerprints, then converts each leaf to what its plan wants."""
    fingerprints = _fingerprints(values)
    bad = [
        p.path
        for p, fp in zip(plans, fingerprints, strict=True)
        if p.record["fingerprint"] is not None and fp != p.record["fingerprint"]
    ]
    if bad:
        shown = ", ".join(_show(p) for p in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise CheckpointError(
            f"The checkpoint in {location} is corrupt: the data read for {len(bad)} "
            f"leaves ({shown}) differs from what was saved. {_advice(location)}",
            path=location,
        )
    out = []
    for plan, value in zip(plans, values, strict=True):
        if plan.kind == _JAX:
            if not isinstance(value, jax.Array):
                value = jax.device_put(np.asarray(value, plan.dtype), plan.sharding)
            elif value.dtype != plan.dtype:
                # Elementwise, so the cast keeps the layout the value was read into.
                value = jax.device_put(value.astype(plan.dtype), plan.sharding)
            if plan.key_impl is not None:
                value = jax.random.wrap_key_data(value, impl=plan.key_impl)
        elif plan.kind == _NUMPY:
            value = np.asarray(value).astype(plan.dtype, copy=False)
            if isinstance(plan.target, np.generic):
                value = value[()]
        else:
            value = type(plan.target)(np.asarray(value).item())
        out.append(value)
    return out


def _wrap_read_error(e: Exception, location: str, what: str) -> CheckpointError:
    text = str(e).split("[tensorstore_spec", 1)[0].strip()
    if len(text) > 400:
        text = text[:400] + " ..."
    return CheckpointError(
        f"Cannot read {what} of the checkpoint in {location}: it is damaged or incomplete "
        f"({type(e).__name__}: {text}). {_advice(location)}",
        path=location,
    )


_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError)


def _restore_into(
    read: Callable[..., Any],
    location: str,
    target: Any,
    strategy: Strategy | None,
    *,
    as_variables: bool = True,
) -> Any:
    """Restores a state laid out as `strategy` says (`Strategy.restore_variables`).

    The strategy gets a reader: with a strategy it restores each leaf into that strategy's
    `variable_sharding`; with None, to the host as NumPy arrays (for a strategy whose
    variables are not arrays, e.g. `ParameterServerStrategy`'s on parameter servers).
    With `as_variables=False` every leaf is an array placed by `variable_sharding`, what a
    `Model`'s train state holds under any strategy.
    """
    if strategy is None or not as_variables:
        return _restore(read, location, target, strategy)[0]

    def read_as(layout: Strategy | None) -> Any:
        state, _ = _restore(read, location, target, layout)
        return state if layout is not None else jax.tree.map(np.asarray, state)

    return strategy.restore_variables(read_as)


def _as_saveable(state: Any) -> Any:
    """A state as a pytree of arrays: containers of variables say how (`checkpoint_value`)."""
    value = getattr(state, "checkpoint_value", None)
    return value() if callable(value) else state


def _restore(
    read: Callable[..., Any],
    location: str,
    target: Any,
    strategy: Strategy | None,
) -> tuple[Any, dict]:
    """Shared by `CheckpointManager.restore` and `load_weights`.

    Args:
      read: calls orbax's restore with a `Composite` of args and returns the Composite.
      location: the checkpoint directory, for messages.
      target: as in `CheckpointManager.restore`.
      strategy: as in `CheckpointManager.restore`.

    Returns:
      (state, record).
    """
    import orbax.checkpoint as ocp

    record = _read_record(read, location)
    records = _leaf_records(record, location)

    def abstract_from_orbax():
        try:
            metadata = read(None, metadata=True)
        except _READ_ERRORS as e:
            raise _wrap_read_error(e, location, "the state's structure") from e
        tree = getattr(metadata, "tree", None)
        if tree is None:
            raise CheckpointError(
                f"Cannot read the state's structure of the checkpoint in {location}: its "
                "metadata (state/_METADATA) is missing or damaged. Pass `target=` (e.g. "
                f"jax.eval_shape of the state's initializer) to restore without it. {_advice(location)}",
                path=location,
            )
        # Orbax's metadata leaves are objects with shape and dtype; containers are dicts
        # and lists.
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)

    plans, treedef = _plan_restore(records, target, strategy, location, abstract_from_orbax)
    specs = jax.tree.unflatten(treedef, [p.read for p in plans])
    try:
        restored = read(ocp.args.StandardRestore(specs))
    except _READ_ERRORS as e:
        raise _wrap_read_error(e, location, "the arrays") from e
    values = jax.tree.leaves(restored)
    if len(values) != len(plans):
        raise CheckpointError(
            f"The checkpoint in {location} returned {len(values)} leaves for {len(plans)} "
            f"expected. {_advice(location)}",
            path=location,
        )
    return jax.tree.unflatten(treedef, _finish(plans, values, location)), record


def _read_record(read, location: str) -> dict:
    import orbax.checkpoint as ocp

    try:
        record = read(ocp.args.JsonRestore(), item=_RECORD_ITEM)
    except _READ_ERRORS as e:
        raise CheckpointError(
            f"The checkpoint in {location} has no readable jstrategy record (the "
            f"'{_RECORD_ITEM}' item): it is damaged, incomplete, or was not written by "
            f"jstrategy ({type(e).__name__}: {str(e)[:300]}). {_advice(location)}",
            path=location,
        ) from e
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise CheckpointError(
            f"The checkpoint record in {location} is not a {_FORMAT} record; got "
            f"{str(record)[:200]}. {_advice(location)}",
            path=location,
        )
    return record


def _metrics_dict(metrics: Any, keep_best: str | None) -> dict[str, float] | None:
    if metrics is None:
        if keep_best is not None:
            raise ValueError(
                f"`metrics` must include {keep_best!r} because the manager keeps the best "
                f"checkpoints by it (keep_best={keep_best!r}); got metrics=None. Pass "
                f"metrics={{{keep_best!r}: value}}."
            )
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"`metrics` must be a dict of numbers; got {type(metrics).__name__}.")
    out = {}
    for k, v in metrics.items():
        try:
            out[str(k)] = float(np.asarray(v))
        except (TypeError, ValueError):
            raise TypeError(
                f"`metrics[{k!r}]` must be a number or a scalar array; got {type(v).__name__}."
            ) from None
    if keep_best is not None and keep_best not in out:
        raise ValueError(
            f"`metrics` must include {keep_best!r} because the manager keeps the best "
            f"checkpoints by it (keep_best={keep_best!r}); got keys {sorted(out)}."
        )
    return out


def _rank(value: float, mode: BestMode) -> float:
    """A `keep_best` metric as orbax ranks it: NaN and +-inf rank below every finite value.

    A run whose metric became NaN (or overflowed) must keep its best finite step; sorting
    raw NaNs is undefined, and an infinite loss in "max" mode (or -inf in "min") is a
    diverged run, not a good one.
    """
    value = float(value)
    if math.isfinite(value):
        return value
    return math.inf if mode is BestMode.MIN else -math.inf


# Orbax managers whose last save may still be writing, held until it is committed.
_IN_FLIGHT: dict[int, Any] = {}
_IN_FLIGHT_LOCK = threading.Lock()
_EXIT_HOOK: list[bool] = []
# CPython 3.12.0-3.12.2 refuse to start threads once the main thread has ended
# (python/cpython#113964, fixed in 3.12.3), and orbax starts some to finish a write.
_EXIT_STARTS_NO_THREADS = (3, 12) <= sys.version_info[:3] < (3, 12, 3)


def _finish_in_flight() -> None:
    with _IN_FLIGHT_LOCK:
        managers = list(_IN_FLIGHT.values())
        _IN_FLIGHT.clear()
    for manager in managers:
        try:
            manager.wait_until_finished()
        except Exception as e:  # at exit: say it once and let the process end
            why = (
                f" Python {sys.version.split()[0]} cannot start threads at exit "
                "(python/cpython#113964, fixed in 3.12.3), which the write needs: call "
                "manager.wait_until_finished() or close() before the program ends, or use "
                "Python 3.12.3 or newer. The previous step is still the latest."
                if _EXIT_STARTS_NO_THREADS
                else ""
            )
            print(
                f"jstrategy: a checkpoint save still being written at exit failed: "
                f"{type(e).__name__}: {e}.{why}",
                file=sys.stderr,
                flush=True,
            )
        finally:
            with contextlib.suppress(Exception):
                manager.close()


def _hold_until_committed(manager: Any) -> None:
    """Makes a program that ends with a save in flight finish it instead of losing it.

    Orbax writes in background threads that use `concurrent.futures` executors, which stop
    accepting work when the interpreter starts to shut down, before `atexit` handlers run:
    the pending step would be left uncommitted (and the previous one stays the latest).
    `threading._register_atexit` callbacks run in reverse order of registration, so ours
    runs before the executors shut down. The orbax manager is held here, not the
    `CheckpointManager`, so the save completes even if the program dropped the latter.
    """
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[id(manager)] = manager
        if _EXIT_HOOK:
            return
        _EXIT_HOOK.append(True)
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("threading._register_atexit is not available")
        register(_finish_in_flight)
    except RuntimeError:
        atexit.register(_finish_in_flight)


def _write_error(e: OSError, location: str) -> OSError:
    """`e` (same type and errno) with a message that names the checkpoint and the fix."""
    where = f" ({e.filename})" if e.filename else ""
    message = (
        f"Cannot write the checkpoint {location}: {e.strerror or e}{where}. Make sure the "
        "directory is writable, is not below a file and has free space, or pass another "
        "directory."
    )
    return type(e)(e.errno, message) if e.errno is not None else type(e)(message)


def _committed(manager: Any) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.pop(id(manager), None)


def _async_options(ocp: Any) -> Any:
    """Orbax's async options: step directories made in `save`, where orbax can.

    An unwritable destination then raises in `save`. Made in the background (the default
    of recent orbax), its failure left orbax's other background threads waiting 10 minutes
    for the directory, and the process could not exit.
    """
    fields = {f.name for f in dataclasses.fields(ocp.AsyncOptions)}
    if "create_directories_asynchronously" not in fields:
        return None  # older orbax makes them in `save` anyway
    return ocp.AsyncOptions(create_directories_asynchronously=False)


# Deleted steps ------------------------------------------------------------------------------------
# Where orbax moves the steps that `max_to_keep` drops. Deleting in place (orbax's default)
# unlinks a step's files first and its directories last: a process killed in between left
# a listed step without metadata that could not be read. A rename is atomic, so a listed
# step is always whole; the renamed steps are removed from here afterwards.
_TRASH = ".jstrategy-deleted"
_COMMITTED_MARKERS = ("commit_success.txt", "_CHECKPOINT_METADATA")
_TMP_MARK = ".orbax-checkpoint-tmp"


class _Trash:
    """Empties `_TRASH` and repairs what a killed deletion left, on the primary process."""

    def __init__(self, directory: str):
        self._directory = directory
        self._path = os.path.join(directory, _TRASH)
        self._thread: threading.Thread | None = None
        # Orbax deletes steps on process 0 only; the others have nothing to do here.
        self._primary = jax.process_index() == 0

    def repair(self) -> None:
        """Moves here, before orbax lists the steps, what interrupted processes left.

        Orbax's temporary directories of unfinished writes go, and so do step directories
        without orbax's commit markers.

        Orbax writes both markers before it renames a finished step into place, so a step
        directory that lacks one was half deleted by an older jstrategy (or half copied by
        hand): it cannot be restored, and listing it would offer it to `restore`.
        """
        if not self._primary:
            return
        for name in sorted(os.listdir(self._directory)):
            path = os.path.join(self._directory, name)
            if _TMP_MARK in name and os.path.isdir(path):
                # What a process killed mid-write left: never a committed step. (Orbax's
                # own cleanup runs in a thread that fails noisily if the program ends soon.)
                os.makedirs(self._path, exist_ok=True)
                os.replace(path, os.path.join(self._path, f"{name}-{time.time_ns()}"))
                continue
            if not name.isdigit() or not os.path.isdir(path):
                continue
            if all(os.path.exists(os.path.join(path, m)) for m in _COMMITTED_MARKERS):
                continue
            os.makedirs(self._path, exist_ok=True)
            os.replace(path, os.path.join(self._path, f"{name}.incomplete-{time.time_ns()}"))
            print(
                f"jstrategy: removed step {name} from {self._directory}: it is incomplete "
                "(an interrupted deletion or copy left it without orbax's commit markers).",
                file=sys.stderr,
                flush=True,
            )
        self.empty(background=True)

    def empty(self, *, background: bool) -> None:
        """Removes the steps moved here: in a daemon thread, or now and the folder too (the
        manager must be closed then)."""
        if not self._primary or not os.path.isdir(self._path):
            return
        if self._thread is not None and self._thread.is_alive():
            if background:
                return  # still emptying; the next call takes the rest
            self._thread.join()
        if background:
            self._thread = threading.Thread(
                target=self._remove_entries, name="jstrategy-trash", daemon=True
            )
            self._thread.start()
        else:
            self._remove_entries()
            # Orbax is done (the manager is closed): the folder itself can go too.
            with contextlib.suppress(OSError):
                os.rmdir(self._path)

    def _remove_entries(self) -> None:
        # Entry by entry, not the folder, which orbax may be renaming a step into meanwhile.
        with contextlib.suppress(OSError):
            for name in os.listdir(self._path):
                shutil.rmtree(os.path.join(self._path, name), ignore_errors=True)


# Several workers ----------------------------------------------------------------------------------
_EVERY_WORKER = (
    "In a multi-worker job every worker opens the same checkpoints and calls save and "
    "restore with the same steps, at the same point of the program: jstrategy writes what is "
    "written once on the chief only, so do not guard them with `if strategy.is_chief`."
)


def _chief_directory(name: str, directory: str, what: str) -> str:
    """The chief's `directory`, on every worker: the one a collective checkpoint lives in.

    TF's multi-worker tutorials give each non-chief worker its own temporary directory and
    discard what it writes there. Here every worker writes its part of the chief's
    checkpoint, so a worker that names another directory writes into the chief's; its own
    directory is created, and stays empty for the program to delete as TF's do.
    """
    chief = coordination.share_from_chief(
        f"{name}/directory", directory, what=f"Opening {what}", fix=_EVERY_WORKER
    )
    coordination.barrier(f"{name}/open", what=f"Opening {what}", fix=_EVERY_WORKER)
    if chief != directory:
        with contextlib.suppress(OSError):
            os.makedirs(directory, exist_ok=True)
    return chief


# CheckpointManager -------------------------------------------------------------------------------
class CheckpointManager:
    """Numbered checkpoints of a training state in one directory, on orbax's CheckpointManager.

    Saves are asynchronous by default: `save` returns once the state is copied off the
    devices, and the files are written while training goes on (`wait_until_finished` waits
    for them). Each step is written to a temporary directory and renamed when complete, so
    the latest step is always a whole checkpoint, even if the process is killed mid-write.

    A checkpoint saved under any strategy restores under any other: `restore(strategy=...)`
    reads every leaf straight into that strategy's layout (see `_target_sharding`). Each
    restore checks every leaf against a fingerprint saved with it, and a damaged or partial
    checkpoint raises `CheckpointError` naming the directory.

    Args:
      directory: where the step directories (``<directory>/<step>``) go; created if absent.
      max_to_keep: keep at most this many checkpoints (the most recent, or the best with
        `keep_best`); None keeps all.
      keep_best: a metric name; `max_to_keep` then keeps the best checkpoints by it (every
        `save` must pass it in `metrics`), and the latest one as well, so training can
        always resume.
      best_mode: ``"min"`` if a lower `keep_best` metric is better (a loss), ``"max"`` if
        higher is (an accuracy); or a `BestMode`.
      save_interval_steps: `save` writes only steps that are multiples of this (unless
        ``force=True``).
      async_save: write in the background. False makes `save` return after the commit.

    Raises:
      ValueError: for an invalid setting, or if `directory` is a file.
      TypeError: if `directory` is not a path.
      CheckpointError: if orbax cannot list the existing steps.

    Example:

    >>> import tempfile, jax.numpy as jnp, jstrategy
    >>> state = {"w": jnp.ones((2, 3)), "step": 0}
    >>> with jstrategy.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as manager:
    ...     for step in range(1, 4):
    ...         _ = manager.save(step, state, metadata={"epoch": step})
    ...     restored = manager.restore(target=state, strategy=jstrategy.MirroredStrategy())
    ...     print(manager.all_steps(), manager.restore_metadata())
    [2, 3] {'epoch': 3}
    >>> restored["w"].sharding.num_devices, int(restored["step"])
    (8, 0)
    """

    def __init__(
        self,
        directory: os.PathLike | str,
        *,
        max_to_keep: int | None = None,
        keep_best: str | None = None,
        best_mode: BestMode | str = BestMode.MIN,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(
                f"`directory` must be a non-empty path (str or os.PathLike); got {directory!r}."
            )
        directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(
                f"`directory` must be a directory; {directory} is a file. Pass another path."
            )
        if max_to_keep is not None and (
            not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1
        ):
            raise ValueError(
                f"`max_to_keep` must be a positive int or None (keep all); got {max_to_keep!r}."
            )
        if keep_best is not None and (not isinstance(keep_best, str) or not keep_best):
            raise ValueError(f"`keep_best` must be a metric name (str) or None; got {keep_best!r}.")
        try:
            mode = BestMode(best_mode.value if isinstance(best_mode, BestMode) else best_mode)
        except ValueError:
            raise ValueError(
                f"`best_mode` must be 'min' or 'max' (or jstrategy BestMode); got {best_mode!r}."
            ) from None
        if (
            not isinstance(save_interval_steps, int)
            or isinstance(save_interval_steps, bool)
            or save_interval_steps < 1
        ):
            raise ValueError(
                f"`save_interval_steps` must be a positive int; got {save_interval_steps!r}."
            )
        if not isinstance(async_save, bool):
            raise TypeError(f"`async_save` must be a bool; got {async_save!r}.")
        self._meeting: int | None = None
        self._restores = 0
        if coordination.active():
            self._meeting = coordination.next_id()
            directory = _chief_directory(
                f"checkpoint-{self._meeting}", directory, f"CheckpointManager({directory!r})"
            )
        self._directory = directory
        self._keep_best = keep_best
        self._best_mode = mode
        self._max_to_keep = max_to_keep
        self._closed = False
        self._trash = _Trash(directory)
        try:
            os.makedirs(directory, exist_ok=True)
            self._trash.repair()
        except OSError as e:
            raise _write_error(e, directory) from e
        if self._meeting is not None:  # the others list the steps once the chief repaired
            coordination.barrier(
                f"checkpoint-{self._meeting}/repaired",
                what=f"Opening {directory}",
                fix=_EVERY_WORKER,
            )
        self._manager = self._open(
            directory, max_to_keep, keep_best, mode, save_interval_steps, async_save
        )

    @staticmethod
    def _open(directory, max_to_keep, keep_best, mode, save_interval_steps, async_save):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as cm

        def metric(metrics):
            return _rank(metrics[keep_best], mode)

        if keep_best is None:
            preservation = cm.LatestN(n=max_to_keep)
        else:
            preservation = cm.AnyPreservationPolicy(
                [
                    cm.BestN(get_metric_fn=metric, reverse=mode is BestMode.MIN, n=max_to_keep),
                    # The latest is kept too: resuming after a crash must not go back.
                    cm.LatestN(n=1),
                ]
            )
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=cm.AnySavePolicy(
                [cm.FixedIntervalPolicy(save_interval_steps), cm.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=preservation,
            best_fn=metric if keep_best is not None else None,
            best_mode=mode.value,
            enable_async_checkpointing=async_save,
            async_options=_async_options(ocp),
            # `_Trash.repair` removes what a process killed mid-write left behind.
            cleanup_tmp_directories=False,
            # Old steps are renamed away (atomic), then emptied there: see `_Trash`.
            todelete_subdir=_TRASH,
            create=True,
        )
        # Registered up front so that a new process can read a step's metadata before any
        # save or restore told orbax which handler each item uses.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        state_handler, record_handler = ocp.StandardCheckpointHandler(), ocp.JsonCheckpointHandler()
        registry.add(_STATE_ITEM, ocp.args.StandardSave, state_handler)
        registry.add(_STATE_ITEM, ocp.args.StandardRestore, state_handler)
        registry.add(_RECORD_ITEM, ocp.args.JsonSave, record_handler)
        registry.add(_RECORD_ITEM, ocp.args.JsonRestore, record_handler)
        try:
            return ocp.CheckpointManager(directory, options=options, handler_registry=registry)
        except _READ_ERRORS as e:
            raise _wrap_read_error(e, directory, "the step list") from e

    # Properties --------------------------------------------------------------------------
    @property
    def directory(self) -> str:
        """The absolute path of the checkpoint directory."""
        return self._directory

    def _step_dir(self, step: int) -> str:
        return os.path.join(self._directory, str(step))

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(
                f"This CheckpointManager for {self._directory} is closed. Create a new one."
            )

    # Saving ------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves `state` as checkpoint `step`, in the background unless `async_save=False`.

        Returns once the state's arrays are copied to host memory, so the caller may then
        update or donate them. A previous save still being written is waited for first.

        Args:
          step: the step number (a non-negative int, larger than any saved before).
          state: a pytree of jax.Arrays (any sharding, typed PRNG keys included), NumPy
            arrays and Python numbers: e.g. `jstrategy.training.create_train_state`'s
            state, `Model.state` or a Flax `TrainState` with its optax state. A `PerReplica`
            value from `Strategy.run` whose replicas agree (parameters updated from
            all-reduced gradients: TF's Mirrored) is saved as one copy; one whose replicas
            differ is refused: save ``strategy.reduce("MEAN", state, axis=None)`` instead.
          metrics: numbers saved with the step; required to hold `keep_best` if set.
          metadata: JSON-able values saved with the step (e.g. the epoch and the data
            iterator's position), read back with `restore_metadata`.
          force: save even if `step` is not a multiple of `save_interval_steps`.

        Returns:
          True if a checkpoint was written; False if `step` was skipped by the interval or
          is not after the latest step.

        Raises:
          ValueError: if the step is invalid or already saved, `metrics` lacks `keep_best`,
            or a `PerReplica` leaf's replicas differ.
          TypeError: if `state` holds something that is not an array or number, or
            `metadata` is not JSON-able.
          OSError: if the directory cannot be written (the message names it).
        """
        self._check_open()
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"`step` must be a non-negative int; got {step!r}.")
        step = int(step)
        metrics_ = _metrics_dict(metrics, self._keep_best)
        _check_metadata(metadata)
        if not force and not self._manager.should_save(step):
            _flatten_state(_as_saveable(state), "state")  # the same errors on every step
            return False
        if step in self._manager.all_steps():
            raise ValueError(
                f"Step {step} is already saved in {self._directory}. Save a later step, or "
                "delete that step's directory first."
            )
        if self._meeting is not None:
            # A checkpoint is written by every worker; orbax alone waits 10 min for one.
            coordination.barrier(
                f"checkpoint-{self._meeting}/save-{step}",
                what=f"Saving step {step} in {self._directory}",
                fix=_EVERY_WORKER,
            )
        state, flat, key_impls = _prepare(state, "state")
        args = _save_args(flat, state, metadata, metrics_, key_impls)
        self._trash.empty(background=True)  # the steps deleted by earlier saves
        _hold_until_committed(self._manager)
        try:
            return bool(self._manager.save(step, args=args, metrics=metrics_, force=True))
        except OSError as e:
            _committed(self._manager)
            raise _write_error(e, self._step_dir(step)) from e

    def wait_until_finished(self) -> None:
        """Blocks until every save started so far is written and committed.

        Raises:
          Exception: the error of a background write that failed.
        """
        try:
            self._manager.wait_until_finished()
        except OSError as e:
            raise _write_error(e, self._directory) from e
        finally:
            _committed(self._manager)

    # Steps -------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """The saved steps, ascending (including one whose background write is in flight)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest saved step, or None if there is none."""
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The step with the best `keep_best` metric, or None if there is none.

        Raises:
          ValueError: if the manager was created without `keep_best`.
        """
        if self._keep_best is None:
            raise ValueError(
                "`best_step` needs a metric to compare; create the CheckpointManager with "
                "keep_best='<metric name>' and pass metrics to save()."
            )
        return self._manager.best_step()

    def _resolve_step(self, step: int | None) -> int:
        self._check_open()
        # A step still being written is listed; wait for it rather than read half of it.
        self.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            if not steps:
                if _is_single_checkpoint(self._directory):
                    raise FileNotFoundError(
                        f"No numbered steps in {self._directory}: it is one checkpoint itself "
                        "(written by save_weights, or one step of a CheckpointManager). Read "
                        f"it with jstrategy.load_weights({self._directory!r})."
                    )
                raise FileNotFoundError(
                    f"No checkpoint in {self._directory}. Save one first, or check the path."
                )
            return steps[-1]
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool):
            raise TypeError(f"`step` must be an int or None; got {step!r}.")
        if int(step) not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {self._directory}; saved steps: {steps}."
            )
        return int(step)

    def _reader(self, step: int):
        import orbax.checkpoint as ocp

        def read(args, *, item=_STATE_ITEM, metadata=False):
            if metadata:
                return self._manager.item_metadata(step)[_STATE_ITEM]
            return self._manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]

        return read

    # Restoring ---------------------------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        strategy: Strategy | None = None,
    ) -> Any:
        """Restores checkpoint `step` (default: the latest) into a strategy's layout.

        Where each leaf goes:

        * ``strategy`` given: every leaf becomes a jax.Array in that strategy's layout
          (replicated over its mesh for OneDevice/Mirrored).
        * else a `target` leaf with a sharding (a jax.Array, or a `jax.ShapeDtypeStruct`
          with ``sharding=``) keeps it; a NumPy array or Python number stays one; a
          `jax.ShapeDtypeStruct` without sharding goes to the current strategy
          (`jstrategy.get_strategy()`).
        * without `target`, every leaf goes to `strategy` (or the current strategy), in the
          saved structure as nested dicts and lists.

        Args:
          step: the step to restore; None means the latest.
          target: a pytree like the saved state (concrete, or abstract such as
            `jax.eval_shape` output); the result has its structure and dtypes. None
            restores the saved structure.
          strategy: the strategy to place the state in.

        Returns:
          The restored state.

        Raises:
          FileNotFoundError: if there is no such step.
          CheckpointError: if the checkpoint is damaged or incomplete.
          ValueError: if `target` does not match the checkpoint's leaves or shapes.
        """
        step = self._resolve_step(step)
        if self._meeting is not None:
            self._restores += 1
            coordination.barrier(
                f"checkpoint-{self._meeting}/restore-{self._restores}",
                what=f"Restoring step {step} from {self._directory}",
                fix=_EVERY_WORKER,
            )
        return _restore_into(self._reader(step), self._step_dir(step), target, strategy)

    def restore_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The `metadata` saved with `step` (default: the latest); {} if none was.

        Raises:
          FileNotFoundError: if there is no such step.
          CheckpointError: if the checkpoint is damaged or incomplete.
        """
        step = self._resolve_step(step)
        record = _read_record(self._reader(step), self._step_dir(step))
        return dict(record.get("metadata") or {})

    def metrics(self, step: int | None = None) -> dict[str, float] | None:
        """The `metrics` saved with `step` (default: the latest), or None if none were.

        Raises:
          FileNotFoundError: if there is no such step.
          CheckpointError: if the checkpoint is damaged or incomplete.
        """
        step = self._resolve_step(step)
        record = _read_record(self._reader(step), self._step_dir(step))
        return record.get("metrics")

    # Lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Waits for pending saves and releases the manager. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.wait_until_finished()
        finally:
            _committed(self._manager)
            self._manager.close()
            self._trash.empty(background=False)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self._directory!r}, max_to_keep={self._max_to_keep}, "
            f"keep_best={self._keep_best!r})"
        )


# Weights files ------------------------------------------------------------------------------------
# Reading a Model's variables from any checkpoint directory, by path -------------------------
def latest_step_dir(path: str) -> str | None:
    """The newest committed step of a `CheckpointManager` directory, or None if it is none.

    Read from the directory listing rather than by opening a manager, which would remove
    the temporary directory of a save that another process is writing there now.
    """
    if not os.path.isdir(path) or os.path.isdir(os.path.join(path, _STATE_ITEM)):
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
                f"The checkpoint in {location} has no variable {_show(path)}: it was saved "
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
                f"Variable {_show(path)} in {location} has shape {np.shape(value)}; the "
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
    saved = _load_weights(step_dir, None, strategy, as_variables=False)
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


def _is_single_checkpoint(path: str) -> bool:
    """Whether `path` is one checkpoint (a weights directory or a manager's step)."""
    return os.path.isdir(os.path.join(path, _RECORD_ITEM)) or os.path.isdir(
        os.path.join(path, _STATE_ITEM)
    )


def _weights_checkpointer():
    import orbax.checkpoint as ocp

    # The same two items as a manager's step, declared so that metadata() can describe them.
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            **{
                _STATE_ITEM: ocp.StandardCheckpointHandler(),
                _RECORD_ITEM: ocp.JsonCheckpointHandler(),
            }
        )
    )


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
    if not isinstance(overwrite, bool):
        raise TypeError(f"`overwrite` must be a bool; got {overwrite!r}.")
    name = f"weights-{coordination.next_id()}" if coordination.active() else None
    if name is not None:
        path = _chief_directory(name, path, f"save_weights({path!r})")
    variables, flat, key_impls = _prepare(variables, "variables")
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
    checkpointer = _weights_checkpointer()
    try:
        checkpointer.save(new, args=_save_args(flat, variables, None, None, key_impls))
    except OSError as e:
        raise _write_error(e, path) from e
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
            coordination.barrier(f"{name}/swap", what=f"save_weights({path!r})", fix=_EVERY_WORKER)


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
    """
    return _load_weights(path, target, strategy, as_variables=True)


def load_arrays(path: os.PathLike | str, *, target: Any, strategy: Strategy) -> Any:
    """`load_weights` for a `Model`'s train state: arrays placed by `strategy`'s
    `variable_sharding`, never its own variable containers (`restore_variables`)."""
    return _load_weights(path, target, strategy, as_variables=False)


def _load_weights(
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
    if not _is_single_checkpoint(path):
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
            fix=_EVERY_WORKER,
        )
    checkpointer = _weights_checkpointer()

    def read(args, *, item=_STATE_ITEM, metadata=False):
        if metadata:
            return checkpointer.metadata(path).item_metadata[_STATE_ITEM]
        return checkpointer.restore(path, args=ocp.args.Composite(**{item: args}))[item]

    try:
        state = _restore_into(read, path, target, strategy, as_variables=as_variables)
    finally:
        checkpointer.close()
    return state
