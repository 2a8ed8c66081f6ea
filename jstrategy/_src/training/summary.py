"""Keras-like ``model.summary()`` tables for Flax linen and NNX modules.

The forward pass runs under `jax.eval_shape`, so summarizing costs a trace, no compute.
Submodule calls are observed with `flax.linen.intercept_methods` (linen) or by giving each
submodule of a private clone a recording subclass (NNX, which has no interceptors).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jstrategy._src import trace_context
from jstrategy._src.names import path_str
from jstrategy._src.names import snake_case
from jstrategy._src.strategy import REPLICA_AXIS

__all__ = [
    "Count",
    "count_params",
    "direct_layers",
    "layout_table",
    "model_table",
    "render",
    "summarize",
]


@dataclasses.dataclass
class _Row:
    order: int
    path: tuple[str, ...]
    type_name: str
    method: str
    output: str = "?"


@dataclasses.dataclass
class Count:
    """A number of scalars and their bytes (a summary's parameter counts)."""

    size: int = 0
    nbytes: int = 0

    @classmethod
    def of(cls, tree: Any) -> Count:
        """The count of the arrays (or shape-dtype structs) in `tree`."""
        count = cls()
        for leaf in jax.tree.leaves(tree):
            count.add(leaf)
        return count

    def add(self, leaf: Any) -> None:
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            return
        size = int(np.prod(shape, dtype=np.int64))
        self.size += size
        self.nbytes += size * np.dtype(dtype).itemsize

    def __add__(self, other: Count) -> Count:
        return Count(self.size + other.size, self.nbytes + other.nbytes)

    def __sub__(self, other: Count) -> Count:
        return Count(self.size - other.size, self.nbytes - other.nbytes)


def _readable_size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1024:
            return f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} PB"


def _shape_repr(output: Any) -> str:
    shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(output) if hasattr(leaf, "shape")]
    if len(shapes) == 1:
        return str(shapes[0])
    if not shapes:
        return "?"
    return "[" + ", ".join(str(s) for s in shapes) + "]"


def _record_call(rows: dict, counter: Any, path: tuple[str, ...], type_name: str, method: str):
    """Adds a row at call entry (pre-order, as Keras lists layers); None if already seen.

    Only a path's first call counts: a shared module, or a method calling another method
    of the same module, keeps one row with the outermost call's output.
    """
    if path in rows:
        return None
    row = _Row(next(counter), path, type_name, method)
    rows[path] = row
    return row


def render(
    name: str,
    rows: list[tuple[Any, ...]],
    total: Count,
    trainable: Count,
) -> str:
    """A summary table: rows of ``(layer, output shape, param count)``, with a fourth
    column, Keras's functional "Connected to", when the rows have one; then the totals."""
    non_trainable = Count(total.size - trainable.size, total.nbytes - trainable.nbytes)
    headers: tuple[str, ...] = ("Layer (type)", "Output Shape", "Param #")
    cells = [(layer, shape, f"{count:,}", *rest) for layer, shape, count, *rest in rows]
    mins = [28, 26, 10]
    if cells and len(cells[0]) == 4:
        headers += ("Connected to",)
        mins.append(20)
    widths = [
        max(low, *(len(c[i]) + (1 if i == 2 else 2) for c in cells)) if cells else low
        for i, low in enumerate(mins)
    ]
    width = 1 + sum(widths)

    def line(values: tuple[str, ...]) -> str:
        return (" " + "".join(v.ljust(w) for v, w in zip(values, widths, strict=True))).rstrip()

    out = [f'Model: "{name}"', "_" * width, line(headers), "=" * width]
    out += [line(c) for c in cells]
    out += [
        "=" * width,
        f"Total params: {total.size:,} ({_readable_size(total.nbytes)})",
        f"Trainable params: {trainable.size:,} ({_readable_size(trainable.nbytes)})",
        f"Non-trainable params: {non_trainable.size:,} ({_readable_size(non_trainable.nbytes)})",
        "_" * width,
    ]
    return "\n".join(out)


def _layer_label(path: tuple[str, ...], type_name: str, method: str) -> str:
    suffix = "" if method == "__call__" else f".{method}"
    return "  " * (len(path) - 1) + f"{path[-1]} ({type_name}{suffix})"


def _is_array_like(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _trace(fn: Any, state: Any, args: tuple, kwargs: dict) -> None:
    """Traces ``fn(state, args, kwargs)`` for shapes only, computing nothing.

    Only array inputs are traced; others (``train=True``, strings, ...) stay Python
    values, as the module expects. The trace runs inside a one-device `jax.shard_map`
    over jstrategy's replica axis, so modules written for a strategy (e.g. BatchNorm
    with ``axis_name="replica"`` in training mode) trace as they would in a train step.
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    traced = [i for i, leaf in enumerate(leaves) if _is_array_like(leaf)]

    def body(state, traced_leaves):
        full = list(leaves)
        for i, leaf in zip(traced, traced_leaves, strict=True):
            full[i] = leaf
        call_args, call_kwargs = jax.tree.unflatten(treedef, full)
        fn(state, call_args, call_kwargs)
        # Shapes were recorded during the trace; the outputs themselves are not needed.
        return jnp.zeros(())

    mesh = Mesh(np.array(jax.local_devices()[:1]), (REPLICA_AXIS,))
    sharded = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    jax.eval_shape(sharded, state, [leaves[i] for i in traced])


# Collections that are bookkeeping of one forward pass, not model state.
_NOT_WEIGHTS = ("intermediates",)


def _subtree(collection: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(collection, Mapping) or key not in collection:
            return None
        collection = collection[key]
    return collection


def _summarize_linen(
    module: nn.Module, variables: Any, args: tuple, kwargs: dict, frozen: tuple = ()
) -> str:
    if not isinstance(variables, Mapping):
        raise ValueError(
            f"`variables` must be the collections dict from module.init (e.g. "
            f"{{'params': ...}}); got {type(variables).__name__}."
        )
    weights = {col: tree for col, tree in variables.items() if col not in _NOT_WEIGHTS}
    rows: dict[tuple[str, ...], _Row] = {}
    counter = itertools.count()

    def interceptor(next_fun, call_args, call_kwargs, context):
        if context.method_name == "setup":
            return next_fun(*call_args, **call_kwargs)
        mod = context.module
        row = _record_call(rows, counter, tuple(mod.path), type(mod).__name__, context.method_name)
        out = next_fun(*call_args, **call_kwargs)
        if row is not None:
            row.output = _shape_repr(out)
        return out

    def forward(variables, args, kwargs):
        with nn.intercept_methods(interceptor):
            # Everything but params may change (batch statistics in training mode, sown
            # values); params may not, so missing params fail instead of being created.
            # The "params" stream doubles as every other stream (dropout, ...).
            return module.apply(
                variables,
                *args,
                rngs={"params": jax.random.key(0)},
                mutable=nn.DenyList("params"),
                **kwargs,
            )

    _trace(forward, variables, args, kwargs)

    table = []
    called_tops = set()
    for row in sorted(rows.values(), key=lambda r: r.order):
        if not row.path:
            continue
        called_tops.add(row.path[0])
        count = sum((Count.of(_subtree(tree, row.path)) for tree in weights.values()), Count())
        table.append((_layer_label(row.path, row.type_name, row.method), row.output, count.size))
    # Variables no call accounts for: the root's own (self.param in a compact root) and
    # submodules that exist but were not called with these inputs.
    own = Count()
    for tree in weights.values():
        for key, value in tree.items():
            if key in called_tops:
                continue
            if isinstance(value, Mapping):
                table.append((f"{key} (not called)", "-", Count.of(value).size))
            else:
                own += Count.of(value)
    if own.size:
        root_output = rows[()].output if () in rows else "?"
        table.append((f"(own variables) ({type(module).__name__})", root_output, own.size))

    params = weights.get("params", {})
    # Frozen layers' parameters (Keras's trainable=False) count as non-trainable.
    outermost = [p for p in frozen if not any(q != p and p[: len(q)] == q for q in frozen)]
    trainable = Count.of(params)
    for prefix in outermost:
        trainable -= Count.of(_subtree(params, prefix))
    total = Count.of(weights)
    name = module.name or snake_case(type(module).__name__)
    return render(name, table, total, trainable)


_nnx_recording_classes: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of `cls` whose ``__call__`` reports to the active recorder."""
    if cls not in _nnx_recording_classes:
        original = cls.__call__

        def __call__(self, *args, **kwargs):
            record = trace_context.current().summary_recorder
            path = self.__dict__.get("_jstrategy_summary_path")
            row = None if record is None or path is None else record(path, cls.__name__)
            out = original(self, *args, **kwargs)
            if row is not None:
                row.output = _shape_repr(out)
            return out

        _nnx_recording_classes[cls] = type(
            cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__}
        )
    return _nnx_recording_classes[cls]


def _nnx_value(variable: Any) -> Any:
    get_value = getattr(variable, "get_value", None)
    return get_value() if get_value is not None else variable.value


def _summarize_nnx(module: nnx.Module, state: Any, args: tuple, kwargs: dict) -> str:
    clone = nnx.clone(module)
    if state is not None:
        nnx.update(clone, state)
    # RNG stream state is bookkeeping, not weights (as Keras does not count seeds).
    flat = []
    for path, variable in nnx.to_flat_state(nnx.state(clone)):
        if isinstance(variable, (nnx.RngState, nnx.Intermediate)):
            continue
        flat.append(
            (tuple(str(p) for p in path), isinstance(variable, nnx.Param), _nnx_value(variable))
        )
    # Path tuples are static attributes, so they survive the split and the merge inside
    # the trace, where new module objects are built from the clone's graph.
    # nnx.iter_modules replaced the Module.iter_modules method in flax 0.12.
    iter_modules = getattr(nnx, "iter_modules", None)
    modules = iter_modules(clone) if iter_modules is not None else clone.iter_modules()
    for path, sub in modules:
        path = tuple(str(p) for p in path)
        object.__setattr__(sub, "_jstrategy_summary_path", path)
        sub.__class__ = _recording_class(type(sub))

    rows: dict[tuple[str, ...], _Row] = {}
    counter = itertools.count()

    def record(path: tuple[str, ...], type_name: str) -> _Row | None:
        return _record_call(rows, counter, path, type_name, "__call__")

    with trace_context.replaced(summary_recorder=record):
        graphdef, graph_state = nnx.split(clone)
        _trace(lambda st, a, k: nnx.merge(graphdef, st)(*a, **k), graph_state, args, kwargs)

    def count_under(prefix: tuple[str, ...]) -> Count:
        count = Count()
        for path, _, value in flat:
            if path[: len(prefix)] == prefix:
                count.add(value)
        return count

    table = []
    for row in sorted(rows.values(), key=lambda r: r.order):
        if row.path:
            label = _layer_label(row.path, row.type_name, row.method)
            table.append((label, row.output, count_under(row.path).size))
    called = {row.path for row in rows.values()}
    own = Count()
    for path, _, value in flat:
        if not any(path[: len(p)] == p for p in called if p):
            own.add(value)
    if own.size:
        table.append((f"(other variables) ({type(module).__name__})", "-", own.size))

    total, trainable = Count(), Count()
    for _, is_param, value in flat:
        total.add(value)
        if is_param:
            trainable.add(value)
    name = snake_case(type(module).__name__)
    return render(name, table, total, trainable)


def summarize(
    module: Any, variables: Any, *sample_args: Any, frozen: tuple = (), **sample_kwargs: Any
) -> str:
    """Returns a Keras-like summary table of `module` called on sample inputs.

    One row per submodule in call order (nested ones indented), with its output shape
    on the sample inputs and its parameter count (all collections, submodules included,
    as Keras counts a layer's weights), then totals: trainable parameters are the
    ``params`` collection (NNX: `nnx.Param`), non-trainable ones every other collection
    such as ``batch_stats``. Output shapes are those of the sample batch.

    The forward pass is traced with `jax.eval_shape`, so nothing is computed and the
    sample inputs may be `jax.ShapeDtypeStruct` objects.

    Args:
      module: a `flax.linen.Module` or a `flax.nnx.Module`.
      variables: for linen, the collections from ``module.init`` (arrays or
        `jax.ShapeDtypeStruct` objects); for NNX, None (the module's own state) or an
        `nnx.State` to summarize instead.
      *sample_args: positional inputs for one forward call.
      frozen: (linen) the paths below ``params`` of frozen submodules, whose parameters
        count as non-trainable, as Keras counts a ``trainable=False`` layer's.
      **sample_kwargs: keyword inputs for it (e.g. ``train=False``).

    Returns:
      The table as a string.

    Raises:
      ValueError: if `module` is neither kind of Flax module, or `variables` does not fit.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> mlp = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((4, 10))
    >>> print(summarize(mlp, mlp.init(jax.random.key(0), x), x))
    Model: "sequential"
    _________________________________________________________________
     Layer (type)                Output Shape              Param #
    =================================================================
     layers_0 (Dense)            (4, 16)                   176
     layers_2 (Dense)            (4, 1)                    17
    =================================================================
    Total params: 193 (772.00 B)
    Trainable params: 193 (772.00 B)
    Non-trainable params: 0 (0.00 B)
    _________________________________________________________________
    """
    if isinstance(module, nnx.Module):
        return _summarize_nnx(module, variables, sample_args, sample_kwargs)
    if isinstance(module, nn.Module):
        return _summarize_linen(module, variables, sample_args, sample_kwargs, frozen)
    raise ValueError(
        f"`module` must be a flax.linen.Module or a flax.nnx.Module; got {type(module).__name__}."
    )


def model_table(
    state: Any, module: Any, input_shape: tuple[int, ...] | None, input_dtype: Any, name: str
) -> str:
    """`jstrategy.Model.summary`'s table: `state`'s variables in `module` on a sample batch.

    The batch axis is symbolic (the table shows ``(batch, 16)`` as Keras shows None), or 1
    for modules that need concrete shapes (e.g. reshapes).

    Raises:
      ValueError: if `input_shape` is unknown.
    """
    if input_shape is None:
        raise ValueError(
            "The sample input shape is unknown. Pass input_shape=(...) to Model (the "
            "shape of one row, without the batch axis)."
        )
    (batch,) = jax.export.symbolic_shape("batch")
    try:
        sample = jax.ShapeDtypeStruct((batch, *input_shape), input_dtype)
        table = state.summary_table(module, sample)
    except Exception:  # some modules need concrete shapes
        sample = jax.ShapeDtypeStruct((1, *input_shape), input_dtype)
        table = state.summary_table(module, sample)
    if name and table.startswith("Model: "):
        table = f'Model: "{name}"' + table[table.index("\n") :]
    layouts = layout_table(state.weights())
    return table if layouts is None else f"{table}\n{layouts}"


def layout_table(weights: Any) -> str | None:
    """Where each variable of `weights` lives, when any is split across devices.

    One row per variable: its path, its shape, its layout (the `PartitionSpec` over the
    mesh's axes, or ``replicated``) and the shape of the piece each device holds. None
    when every variable is whole on each of its devices (nothing to show).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("replica",))
    >>> w = jax.device_put(jnp.zeros((4, 16)), NamedSharding(mesh, P(None, "replica")))
    >>> print(layout_table({"params": {"kernel": w, "bias": jnp.zeros(16)}}))
    Variable layouts over mesh {'replica': 8}:
     Variable                    Shape         Layout                   Per device
     params/bias                 (16,)         replicated               (16,)
     params/kernel               (4, 16)       P(None, 'replica')       (4, 2)
    Optimizer state is laid out like its parameter.
    """
    flat = [
        (path_str(keypath), leaf)
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]
        if isinstance(leaf, jax.Array)
    ]
    split = [leaf for _, leaf in flat if not leaf.sharding.is_fully_replicated]
    if not split:
        return None
    mesh = getattr(split[0].sharding, "mesh", None)
    where = f" over mesh {dict(mesh.shape)}" if mesh is not None else ""
    rows = [("Variable", "Shape", "Layout", "Per device")]
    for path, leaf in flat:
        spec = getattr(leaf.sharding, "spec", None)
        replicated = leaf.sharding.is_fully_replicated or spec is None
        layout = "replicated" if replicated else str(spec)
        piece = leaf.sharding.shard_shape(leaf.shape)
        rows.append((path, str(tuple(leaf.shape)), layout, str(tuple(piece))))
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(3)]
    widths = [max(w, m) for w, m in zip(widths, (28, 14, 25), strict=True)]
    lines = [f"Variable layouts{where}:"]
    for row in rows:
        cells = "".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True))
        lines.append(f" {cells}{row[3]}")
    lines.append("Optimizer state is laid out like its parameter.")
    return "\n".join(lines)


def count_params(variables: Any) -> int:
    """The scalars in the floating-point arrays of `variables` (Keras's ``count_params``;
    random-stream keys and counters are not weights).

    Example:

    >>> import numpy as np
    >>> count_params({"params": {"w": np.zeros((3, 4)), "b": np.zeros(4)}})
    16
    """
    return sum(
        int(np.size(leaf))
        for leaf in jax.tree.leaves(variables)
        if jnp.issubdtype(getattr(leaf, "dtype", np.float32), jnp.floating)
    )


def direct_layers(state: Any, module: Any, sample: Any) -> list[Any]:
    """`module`'s direct submodules, in call order (`jstrategy.Model.layers`).

    For linen, the modules the forward pass calls at the top level, found by tracing
    `state`'s forward pass on `sample` (a `jax.ShapeDtypeStruct`; shapes only, nothing is
    computed); for NNX, the module's child modules.

    Raises:
      ValueError: for a linen module when `sample` is None (the row shape is unknown).
    """
    if isinstance(module, nnx.Module):
        iter_children = getattr(nnx, "iter_children", None)
        children = iter_children(module) if iter_children is not None else module.iter_children()
        return [child for _, child in children]
    if sample is None:
        raise ValueError(
            "The model's row shape is unknown, so its layers cannot be found; pass "
            "input_shape=(...) to Model (the shape of one row, without the batch axis)."
        )
    found: dict[str, Any] = {}

    def interceptor(next_fun, call_args, call_kwargs, context):
        mod = context.module
        if context.method_name != "setup" and len(mod.path) == 1 and mod.path[0] not in found:
            found[mod.path[0]] = mod.clone(parent=None)
        return next_fun(*call_args, **call_kwargs)

    def forward(state: Any, x: Any) -> Any:
        with nn.intercept_methods(interceptor):
            return state.forward(state.params, x, train=False, axis_name=None)[0]

    jax.eval_shape(forward, state.replica_view(with_params=True), sample)
    return list(found.values())
