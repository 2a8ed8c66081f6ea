"""What `fit`, `evaluate` and `predict` check in array inputs before any work.

Each mistake that would otherwise train on nothing, fail deep inside a program or train on
NaN without a word gets an error that names the argument, what was expected, what was
given and the fix: empty arrays, row counts that differ between ``x``, ``y`` and
``sample_weight``, inputs that are not numbers, and class labels outside
``[0, num_classes)`` for sparse categorical losses and metrics (TF raises for these too).
The label check runs once per call on the host, over the label array; the numerics check
inside the step (`jstrategy.config.enable_check_numerics`) covers what the host cannot see.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src.numerics import row_count
from jstrategy._src.training import losses as losses_lib
from jstrategy._src.training import metrics as metrics_lib

__all__ = ["array_rows", "check_class_labels", "check_row_shape", "class_label_functions"]

# The functions whose labels are class indices into the last axis of the predictions.
_CLASS_INDEX_TYPES = (
    losses_lib.SparseCategoricalCrossentropy,
    metrics_lib.SparseCategoricalAccuracy,
)


def _names(arg: str) -> tuple[str, str, str]:
    """How errors name ``x``, ``y`` and ``sample_weight`` of `fit`'s `arg` argument."""
    if arg == "x":
        return "x", "y", "sample_weight"
    return f"{arg}[0]", f"{arg}[1]", f"{arg}[2]"


def _leaf_rows(tree: Any, name: str) -> int:
    """The one number of rows of the arrays of `tree`, which must be numbers."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"{name}{jax.tree_util.keystr(path)}"
        dtype = np.asarray(leaf).dtype if not hasattr(leaf, "dtype") else leaf.dtype
        if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
            raise TypeError(
                f"`{where}` must hold numbers; got an array of dtype {dtype}. Convert it, "
                f"e.g. {name}.astype(np.float32), or encode strings and objects as numbers."
            )
        if np.ndim(leaf) == 0:
            raise ValueError(
                f"`{where}` must have a leading axis of examples; got a scalar. Pass one "
                "value per example, e.g. np.full((rows,), value)."
            )
    return row_count(tree, name)


def array_rows(x: Any, y: Any, w: Any, *, arg: str) -> int:
    """The number of examples of array inputs, checked; `arg` is ``"x"`` or the argument
    holding ``(x, y[, sample_weight])`` (``"validation_data"``).

    Raises:
      ValueError: for no rows, scalars, or row counts that differ between arrays.
      TypeError: for arrays that do not hold numbers, or a `sample_weight` that is not
        one array.

    Example:

    >>> import numpy as np
    >>> array_rows(np.ones((3, 2)), np.ones(4), None, arg="x")
    Traceback (most recent call last):
    ...
    ValueError: `x` has 3 rows but `y` has 4: pass one label per example (the same number of rows).
    """
    x_name, y_name, w_name = _names(arg)
    if w is not None and not hasattr(w, "shape"):
        raise TypeError(
            f"`{w_name}` must be one array of per-example weights, shape (rows,); got "
            f"{type(w).__name__}."
        )
    rows = _leaf_rows(x, x_name)
    for tree, name in ((y, y_name), (w, w_name)):
        if tree is None:
            continue
        other = _leaf_rows(tree, name)
        if other != rows:
            what = "one label" if name == y_name else "one weight"
            raise ValueError(
                f"`{x_name}` has {rows} rows but `{name}` has {other}: pass {what} per "
                "example (the same number of rows)."
            )
    if rows == 0:
        raise ValueError(
            f"`{x_name}` has no rows (shape {np.shape(jax.tree.leaves(x)[0])}): there is "
            "nothing to train on, evaluate or predict. Pass at least one example."
        )
    return rows


def class_label_functions(functions: Iterable[Any]) -> list[Any]:
    """Those of a step's loss and metrics (`StepSpec.functions`) whose labels are class
    indices (sparse categorical)."""
    return [f for f in functions if isinstance(f, _CLASS_INDEX_TYPES)]


def _num_classes(train_state: Any, x: Any, cache: dict[Any, int | None]) -> int | None:
    """The last axis of the model's output for inputs like `x` (None: not one array),
    kept in `cache` by model and input layout: tracing a large model takes a tenth of a
    second, too much to repeat at every `evaluate`."""
    # Shapes only: the variables may live in host memory (CentralStorageStrategy).
    leaves, treedef = jax.tree.flatten(train_state.replica_view(with_params=True))
    state = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in leaves]
    # The dtype the arrays get on the devices: float64 data (NumPy's default) is float32
    # there, and a float64 ShapeDtypeStruct would warn that it is truncated.
    row = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), jax.dtypes.canonicalize_dtype(a.dtype)),
        x,
    )
    key = (treedef, tuple(state), jax.tree.structure(row), tuple(jax.tree.leaves(row)))
    if key not in cache:
        out = jax.eval_shape(
            lambda s, v: s.forward(s.params, v, train=False, axis_name=None)[0],
            jax.tree.unflatten(treedef, state),
            row,
        )
        cache[key] = int(out.shape[-1]) if len(getattr(out, "shape", ())) >= 2 else None
    return cache[key]


def check_class_labels(
    functions: Iterable[Any], train_state: Any, data: Any, *, arg: str, cache: dict[Any, int | None]
) -> None:
    """Integer labels in ``[0, num_classes)`` for sparse categorical losses and metrics.

    `functions` are the step's loss and metrics (`StepSpec.functions`); `data` is an `ArrayAdapter`; the number of classes is the last axis of the model's
    output of `train_state`'s model, found by tracing it on one row (no computation) and
    kept in `cache`. Runs on the host, once per call, over the label array.

    Raises:
      ValueError: for a label outside the range, or a float label that is not a whole
        number.
    """
    functions = class_label_functions(functions)
    x, y, _ = data.data
    if not functions or not isinstance(y, np.ndarray) or y.size == 0:
        return
    num_classes = _num_classes(train_state, x, cache)
    if num_classes is None:
        return  # the functions raise their own shape error in the step
    name = _names(arg)[1]
    users = ", ".join(type(f).__name__ for f in functions)
    if jnp.issubdtype(y.dtype, jnp.floating) and not np.all(np.floor(y) == y):
        index = int(np.flatnonzero(np.floor(y) != y)[0])
        raise ValueError(
            f"`{name}` must hold integer class labels for {users}; got {y.flat[index].item()!r} "
            f"(flat index {index}). Pass integer labels (y.astype(np.int32)), or one-hot "
            "labels with CategoricalCrossentropy."
        )
    bad = (y < 0) | (y >= num_classes)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"`{name}` holds class labels outside [0, {num_classes}), the model's "
            f"{num_classes} outputs, for {users}: {int(bad.sum())} of {y.size} labels, "
            f"the first {y.flat[index].item()!r} at flat index {index} (labels range over "
            f"[{y.min().item()!r}, {y.max().item()!r}]). Fix the labels, or give the model one output per "
            "class."
        )


def check_row_shape(expected: tuple[int, ...] | None, x: Any, arg: str) -> None:
    """Array inputs whose rows have the shape the model was built for.

    Checked before any work, so a wrong feature count names the argument instead of
    failing inside the program with the module's parameter-shape error.

    Raises:
      ValueError: if `x` is one array whose row shape differs from `expected`.
    """
    if expected is None or not hasattr(x, "shape") or np.ndim(x) < 1:
        return
    given = tuple(int(d) for d in np.shape(x)[1:])
    if given != tuple(expected):
        name = _names(arg)[0]
        raise ValueError(
            f"`{name}` must have rows of shape {tuple(expected)}, the shape the model was "
            f"built for; got rows of shape {given} ({name} of shape {tuple(np.shape(x))}). Pass "
            "inputs with that shape, or build a new model for these (input_shape="
            f"{given})."
        )
