"""Keras's symbolic tensors: what `jstrategy.Input` gives and layers called on it return.

Keras's functional API writes a model as calls of layers on symbolic tensors
(``x = Input((10,)); y = Dense(1)(x); Model(x, y)``). Here a `KerasTensor` knows its shape
(the batch axis None), its dtype and the `Node` that made it: the layer and the tensors it
was called on. A `jstrategy.layers.Layer` called on them (before any model binds it)
records a `Node` and returns new tensors, whose shapes come from `jax.eval_shape` of the
layer on those inputs; nothing is computed and no weight is kept. `jstrategy.Model(inputs,
outputs)` walks the nodes back from its outputs (`training/functional_graph.py`).

A Flax module that is not a jstrategy layer, a JAX function or arithmetic on a symbolic
tensor raises a `TypeError` that names the fix (a layer, `jstrategy.layers.Lambda`, or a
Flax module of one's own trained with ``jstrategy.Model(module, input_shape=...)``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np

__all__ = [
    "KerasTensor",
    "Node",
    "contains_symbolic",
    "input_layer_of",
    "input_tensor",
    "symbolic_call",
]

_FIX = (
    "Use a jstrategy.layers layer for it, wrap the computation in jstrategy.layers.Lambda(fn) "
    "or in a jstrategy.layers.Layer subclass (a Flax module whose __call__(inputs, "
    "training=None) does it), or write the whole model as a Flax module and train it "
    "with jstrategy.Model(module, input_shape=...)."
)


class Node:
    """One call of a layer on symbolic tensors (an `InputLayer`'s node has no inputs).

    Attributes:
      layer: the layer object (shared layers have one node per call).
      structure: the treedef of the call's input (one tensor, or a list/dict of them).
      inputs: the input tensors, flattened.
      training: the call's ``training=`` if it gave one (True/False), else None: the
        model's mode.
      outputs: the output tensors, flattened.
    """

    def __init__(self, layer: Any, structure: Any, inputs: tuple[KerasTensor, ...], training: Any):
        self.layer = layer
        self.structure = structure
        self.inputs = inputs
        self.training = training
        self.outputs: tuple[KerasTensor, ...] = ()


def _refuse(what: str) -> TypeError:
    return TypeError(
        f"{what} on a symbolic tensor of jstrategy's functional API (from jstrategy.Input "
        f"or a layer call): it holds no values, and only jstrategy.layers layers record "
        f"their calls on it. {_FIX}"
    )


class KerasTensor:
    """A symbolic tensor of the functional API (Keras's ``KerasTensor``).

    Attributes:
      shape: the shape, batch axis first as None: ``(None, 10)``.
      dtype: the NumPy dtype.
      name: the name of the layer that made it (an `Input`'s name), once it has one (a
        model names its layers when it is created).

    Example:

    >>> import jstrategy
    >>> x = jstrategy.Input(shape=(10,), name="features")
    >>> x.shape, x.dtype.name, x.name
    ((None, 10), 'float32', 'features')
    >>> jstrategy.layers.Dense(4)(x).shape
    (None, 4)
    """

    def __init__(self, shape: tuple[Any, ...], dtype: Any, node: Node, index: int):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.node = node
        self.index = index

    @property
    def name(self) -> str | None:
        return getattr(self.node.layer, "name", None)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"<KerasTensor shape={self.shape}, dtype={self.dtype.name}, name={self.name}>"

    # Anything that would need values: an error naming the fix, not NumPy's. (JAX's
    # functions raise their own TypeError naming the KerasTensor type; a __jax_array__
    # that raised would be reported as ignored by JAX's C++ attribute checks.)
    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("A NumPy function was called")

    def __bool__(self) -> bool:
        raise _refuse("A truth value was asked")

    def _operator(self, *args: Any) -> Any:
        raise _refuse("An operator (+, *, [...], ...) was applied")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _operator
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __pow__ = __neg__ = _operator
    __getitem__ = __lt__ = __le__ = __gt__ = __ge__ = _operator


def contains_symbolic(args: Any, kwargs: Any = None) -> bool:
    """Whether `args` / `kwargs` hold a `KerasTensor` anywhere."""
    return any(isinstance(leaf, KerasTensor) for leaf in jax.tree.leaves((args, kwargs)))


def input_layer_of(value: Any) -> Any:
    """The `InputLayer` of a `jstrategy.Input` tensor; anything else as it is (a list of
    layers may start with ``jstrategy.Input(...)``, as Keras's Sequential's does)."""
    if isinstance(value, KerasTensor) and not value.node.inputs and value.node.structure is None:
        return value.node.layer
    return value


def input_tensor(layer: Any) -> KerasTensor:
    """The symbolic tensor of an `InputLayer`: what `jstrategy.Input` returns."""
    node = Node(layer, None, (), None)
    node.outputs = (KerasTensor((None, *layer.shape), layer.dtype, node, 0),)
    return node.outputs[0]


def _layer_name(layer: Any) -> str:
    name = getattr(layer, "name", None)
    return type(layer).__name__ + (f" ({name!r})" if name else "")


def symbolic_call(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``layer(*args, **kwargs)`` on symbolic tensors: records a `Node`, returns its outputs.

    Raises:
      TypeError: for a call that is not ``layer(inputs)`` or ``layer(inputs,
        training=...)`` on symbolic tensors only.
      ValueError: if the layer refuses inputs of these shapes (its own error, chained).
    """
    what = _layer_name(layer)
    kwargs = dict(kwargs)
    training = kwargs.pop("training", None)
    if len(args) != 1 or kwargs or training not in (None, True, False):
        given = [*(type(a).__name__ for a in args), *(f"{k}=" for k in kwargs)]
        if training not in (None, True, False):
            given.append(f"training={training!r}")
        raise TypeError(
            f"{what} was called on symbolic tensors with ({', '.join(given)}); the functional "
            "API records layer(inputs) or layer(inputs, training=True/False), inputs one "
            "tensor or a list/dict of them. Give other settings to the layer's constructor."
        )
    leaves, structure = jax.tree.flatten(args[0])
    plain = [leaf for leaf in leaves if not isinstance(leaf, KerasTensor)]
    if plain or not leaves:
        shown = type(plain[0]).__name__ if plain else "nothing"
        raise TypeError(
            f"{what} was called on symbolic tensors mixed with {shown}: in the functional API "
            "a layer's inputs are all symbolic tensors (jstrategy.Input or layer outputs). "
            "Make a constant part of a layer (its initializer, or a Lambda)."
        )
    key = jax.random.key(0)

    def forward(*arrays: Any) -> Any:
        inputs = jax.tree.unflatten(structure, arrays)
        rngs = {"params": key, "dropout": key}
        return layer.init_with_output(rngs, inputs, training=bool(training))[0]

    samples = [jax.ShapeDtypeStruct((1, *t.shape[1:]), t.dtype) for t in leaves]
    try:
        out = jax.eval_shape(forward, *samples)
    except (TypeError, ValueError) as e:
        shapes = jax.tree.unflatten(structure, [t.shape for t in leaves])
        raise ValueError(f"{what} cannot be called on inputs of shape {shapes}: {e}") from e
    out_leaves, out_structure = jax.tree.flatten(out)
    node = Node(layer, structure, tuple(leaves), training)
    node.outputs = tuple(
        KerasTensor((None, *s.shape[1:]), s.dtype, node, i) for i, s in enumerate(out_leaves)
    )
    return jax.tree.unflatten(out_structure, node.outputs)


def _install_foreign_module_refusal() -> None:
    """Makes a Flax module that is not a jstrategy layer, called unbound on a symbolic
    tensor, raise `_refuse`'s error instead of Flax's ``CallCompactUnboundModuleError``
    (which does not say that the module cannot take part in the functional API).

    Flax checks whether a module is bound in ``Module._call_wrapped_method`` before it
    looks at the arguments; the check added here runs only for unbound modules (whose
    call raises anyway), so bound calls, the only ones that compute, are unchanged.
    """
    original = getattr(nn.Module, "_call_wrapped_method", None)
    if original is None or getattr(original, "_jstrategy_refusal", False):
        return

    def _call_wrapped_method(self: Any, fun: Any, args: Any, kwargs: Any) -> Any:
        if self.scope is None and contains_symbolic(args, kwargs):
            raise _refuse(
                f"The Flax module {type(self).__name__}, not a jstrategy layer, was called"
            )
        return original(self, fun, args, kwargs)

    _call_wrapped_method._jstrategy_refusal = True  # type: ignore[attr-defined]
    nn.Module._call_wrapped_method = _call_wrapped_method  # type: ignore[method-assign]


_install_foreign_module_refusal()
