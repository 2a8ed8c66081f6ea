"""Restoring a checkpoint's leaves straight into the layout a strategy wants.

`_restore` reads the record, plans each leaf (`_plan_restore`: where it goes, in which
dtype), has orbax read every shard into place, then checks the fingerprints (`_finish`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jstrategy._src import context
from jstrategy._src.checkpoint.array_format import SAVABLE
from jstrategy._src.checkpoint.array_format import leaf_records
from jstrategy._src.checkpoint.array_format import read_record
from jstrategy._src.checkpoint.array_format import saved_dtype
from jstrategy._src.checkpoint.errors import READ_ERRORS
from jstrategy._src.checkpoint.errors import CheckpointError
from jstrategy._src.checkpoint.errors import advice
from jstrategy._src.checkpoint.errors import show
from jstrategy._src.checkpoint.errors import wrap_read_error
from jstrategy._src.checkpoint.fingerprint import leaf_fingerprints
from jstrategy._src.names import path_names
from jstrategy._src.strategy import get_strategy
from jstrategy._src.values import key_data
from jstrategy._src.values import keys_from_data

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "restore_into",
]


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


_JAX, _NUMPY, _PYTHON = "jax", "numpy", "python"


class _Plan:
    """How one leaf is read (`read`, a spec orbax understands) and what it becomes."""

    __slots__ = ("dtype", "key_impl", "kind", "path", "read", "record", "sharding", "target")

    def __init__(self, path, record, kind, dtype, sharding, target, key_impl=None):
        self.path, self.record, self.kind = path, record, kind
        self.dtype, self.sharding, self.target = dtype, sharding, target
        # The raw data read is wrapped into typed PRNG keys of this implementation.
        self.key_impl = key_impl
        saved = saved_dtype(record["dtype"])
        shape = tuple(record["shape"])
        if kind == _JAX and jax.dtypes.canonicalize_dtype(saved) == saved:
            # Straight into the target layout: orbax reads each shard where it belongs.
            self.read = jax.ShapeDtypeStruct(shape, saved, sharding=sharding)
        else:
            # A 64-bit value JAX cannot hold (or a host value): read it as NumPy in the saved
            # dtype, check it, then convert.
            self.read = jax.ShapeDtypeStruct(shape, saved)


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
            dtype = jax.dtypes.canonicalize_dtype(saved_dtype(rec["dtype"]))
            leaf = jax.ShapeDtypeStruct(tuple(rec["shape"]), dtype)
            sharding = _target_sharding(strategy_, leaf, path=path)
            plans.append(_Plan(path, rec, _JAX, dtype, sharding, meta, rec["key_impl"]))
        if len(plans) != len(records):
            raise CheckpointError(
                f"The checkpoint in {location} has {len(plans)} arrays but its record lists "
                f"{len(records)}; the directory is damaged. {advice(location)}",
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
            data = jax.eval_shape(key_data, leaf)
            # The key's sharding fits its data: the data's extra last axis is not split.
            own_sharding = getattr(leaf, "sharding", None)
            leaf = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=own_sharding)
        if not isinstance(leaf, (*SAVABLE, jax.ShapeDtypeStruct)) or isinstance(leaf, str):
            raise TypeError(
                f"`target` leaf {show(path)} is a {type(leaf).__name__}; pass arrays, "
                "jax.ShapeDtypeStruct (e.g. jax.eval_shape output) or Python numbers."
            )
        if tuple(np.shape(leaf)) != shape:
            raise ValueError(
                f"`target` leaf {show(path)} has shape {tuple(np.shape(leaf))} but the "
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
            # A typed key's data has one more (last) axis than the key, which no strategy
            # splits: its layout is the key's (a spec shorter than the data leaves it whole).
            logical = shape if key_impl is None else shape[:-1]
            abstract = jax.ShapeDtypeStruct(logical, dtype)
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
    return get_strategy()


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
        f"`target` leaf {show(path)} is an abstract key array of {leaf.dtype}, whose "
        "implementation cannot be told. Pass a concrete key array for this leaf."
    )


def _record_for(records, path, location):
    rec = records.get(path)
    if rec is None:
        raise CheckpointError(
            f"The checkpoint in {location} has a leaf {show(path)} that its record does not "
            f"list; the directory is damaged or not a jstrategy checkpoint. {advice(location)}",
            path=location,
        )
    return rec


def _check_same_leaves(records, paths, location) -> None:
    wanted, saved = set(paths), set(records)
    if wanted == saved:
        return
    missing = sorted(show(p) for p in wanted - saved)
    extra = sorted(show(p) for p in saved - wanted)
    raise ValueError(
        f"`target` does not match the checkpoint in {location}: leaves missing from the "
        f"checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}; leaves in the "
        f"checkpoint but not in `target`: {extra[:5]}{' ...' if len(extra) > 5 else ''}. "
        "Pass a target with the structure of the saved state (or target=None to get the "
        "saved structure as nested dicts)."
    )


def _finish(plans: list[_Plan], values: list[Any], location: str) -> list[Any]:
    """Verifies fingerprints, then converts each leaf to what its plan wants."""
    fingerprints = leaf_fingerprints(values)
    bad = [
        p.path
        for p, fp in zip(plans, fingerprints, strict=True)
        if p.record["fingerprint"] is not None and fp != p.record["fingerprint"]
    ]
    if bad:
        shown = ", ".join(show(p) for p in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise CheckpointError(
            f"The checkpoint in {location} is corrupt: the data read for {len(bad)} "
            f"leaves ({shown}) differs from what was saved. {advice(location)}",
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
                value = keys_from_data(value, plan.key_impl)
        elif plan.kind == _NUMPY:
            value = np.asarray(value).astype(plan.dtype, copy=False)
            if isinstance(plan.target, np.generic):
                value = value[()]
        else:
            value = type(plan.target)(np.asarray(value).item())
        out.append(value)
    return out


def restore_into(
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

    record = read_record(read, location)
    records = leaf_records(record, location)

    def abstract_from_orbax():
        try:
            metadata = read(None, metadata=True)
        except READ_ERRORS as e:
            raise wrap_read_error(e, location, "the state's structure") from e
        tree = getattr(metadata, "tree", None)
        if tree is None:
            raise CheckpointError(
                f"Cannot read the state's structure of the checkpoint in {location}: its "
                "metadata (state/_METADATA) is missing or damaged. Pass `target=` (e.g. "
                f"jax.eval_shape of the state's initializer) to restore without it. {advice(location)}",
                path=location,
            )
        # Orbax's metadata leaves are objects with shape and dtype; containers are dicts
        # and lists.
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)

    plans, treedef = _plan_restore(records, target, strategy, location, abstract_from_orbax)
    specs = jax.tree.unflatten(treedef, [p.read for p in plans])
    try:
        restored = read(ocp.args.StandardRestore(specs))
    except READ_ERRORS as e:
        raise wrap_read_error(e, location, "the arrays") from e
    values = jax.tree.leaves(restored)
    if len(values) != len(plans):
        raise CheckpointError(
            f"The checkpoint in {location} returned {len(values)} leaves for {len(plans)} "
            f"expected. {advice(location)}",
            path=location,
        )
    return jax.tree.unflatten(treedef, _finish(plans, values, location)), record
