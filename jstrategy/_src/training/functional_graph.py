"""The graph of a functional model (Keras's ``Model(inputs, outputs)``) and the linen
module that replays it.

`trace` walks back from the outputs through the `Node` objects that layer calls on
symbolic tensors recorded (`jstrategy._src.layers.symbolic`), to the inputs; it names the
layers as Keras does (``dense``, ``dense_1``, ...) and gives each tensor a number.
`FunctionalModule` holds the layers (each once: a layer called twice shares its
weights, Keras's shared layers) and the calls in order, and replays them on arrays. It
is an ordinary linen module, so the strategies, the train state, checkpoints and
`get_weights` (whose order is the order of first calls, Keras's) treat it as any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax
import numpy as np

from jstrategy._src.layers.base import auto_name
from jstrategy._src.layers.core import InputLayer
from jstrategy._src.layers.symbolic import KerasTensor
from jstrategy._src.layers.symbolic import Node

__all__ = ["Call", "FunctionalModule", "Graph", "InputSpec", "trace"]


@dataclasses.dataclass(frozen=True)
class Call:
    """One layer call of the graph: which layer, on which tensors, making which.

    Attributes:
      layer: the layer's index in `FunctionalModule.layers`.
      structure: the treedef of the call's input (a tensor, or a list/dict of them).
      inputs: the numbers of the input tensors, flattened.
      training: the call's own ``training=``, or None for the model's mode.
      outputs: the numbers of the output tensors, flattened.
    """

    layer: int
    structure: Any
    inputs: tuple[int, ...]
    training: bool | None
    outputs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One input of the model: its name (its key in a dict of inputs), row shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class FunctionalModule(nn.Module):
    """The linen module of a functional model: its layer calls replayed in order.

    Its layers keep the names they were given (``preserve_adopted_names``), so variables
    live at Keras's paths (``dense/kernel``).

    Attributes:
      layers: the layers, each once, in the order of their first call.
      calls: the calls, in an order where each tensor is made before it is used.
      inputs: the inputs (tensors 0, 1, ...).
      input_kind: how the inputs were given: ``"single"``, ``"list"`` or ``"dict"``.
      outputs: ``(treedef, numbers)``: the outputs' structure and tensors.
    """

    layers: tuple[Any, ...] = ()
    calls: tuple[Call, ...] = ()
    inputs: tuple[InputSpec, ...] = ()
    input_kind: str = "single"
    outputs: Any = None

    preserve_adopted_names: ClassVar[bool] = True

    def __call__(self, inputs: Any, training: bool = False) -> Any:
        values: dict[int, Any] = dict(enumerate(self._input_arrays(inputs)))
        for call in self.calls:
            args = jax.tree.unflatten(call.structure, [values[i] for i in call.inputs])
            flag = training if call.training is None else call.training
            out = self.layers[call.layer](args, training=flag)
            values.update(zip(call.outputs, jax.tree.leaves(out), strict=True))
        structure, numbers = self.outputs
        return jax.tree.unflatten(structure, [values[i] for i in numbers])

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def _input_arrays(self, inputs: Any) -> list[Any]:
        """`inputs` (an array, a list/tuple or a dict by input name, as Keras matches
        ``fit``'s x) as one array per input, each checked against its `InputSpec`."""
        names = [spec.name for spec in self.inputs]
        if isinstance(inputs, Mapping):
            if set(inputs) != set(names):
                raise ValueError(
                    f"The model's inputs are {names}; x is a dict with keys "
                    f"{sorted(map(str, inputs))}. Key the arrays by the inputs' names "
                    "(Input(..., name=...)), or pass a list in the inputs' order."
                )
            arrays = [inputs[name] for name in names]
        elif isinstance(inputs, (list, tuple)):
            if len(inputs) != len(names):
                raise ValueError(
                    f"The model has {len(names)} input(s) {names}; x is a "
                    f"{type(inputs).__name__} of {len(inputs)} arrays. Pass one array per "
                    "input, in order (or a dict by name)."
                )
            arrays = list(inputs)
        elif len(names) == 1:
            arrays = [inputs]
        else:
            raise ValueError(
                f"The model has {len(names)} inputs {names}; x is one array. Pass a list of "
                f"{len(names)} arrays in that order, or a dict by name."
            )
        for spec, array in zip(self.inputs, arrays, strict=True):
            row = tuple(np.shape(array)[1:])
            if row != spec.shape:
                raise ValueError(
                    f"The input {spec.name!r} takes rows of shape {spec.shape} (its "
                    f"jstrategy.Input); got rows of shape {row} (an array of shape "
                    f"{tuple(np.shape(array))})."
                )
        return arrays


@dataclasses.dataclass
class Graph:
    """A traced functional model.

    Attributes:
      module: the `FunctionalModule` that replays it.
      inputs: the input tensors, in order.
      outputs: the output tensors, flattened.
      input_layers: the `InputLayer` of each input, in order.
      keras_layers: every layer, inputs' included, in Keras's order of ``model.layers``.
      nodes: the layer calls, in the module's order.
      output_names: one name per output: a dict's keys, else the name of the layer that
        made it (Keras's ``output_names``, the prefix of the per-output logs).
      numbers: each tensor's number, by ``id``.
    """

    module: FunctionalModule
    inputs: list[KerasTensor]
    outputs: list[KerasTensor]
    input_layers: list[Any]
    keras_layers: list[Any]
    nodes: list[Node]
    output_names: list[str]
    numbers: dict[int, int]

    @property
    def layers(self) -> list[Any]:
        """The layers of the module (the inputs' excluded), in order."""
        return list(self.module.layers)

    def sample(self, batch: Any = 1) -> Any:
        """`jax.ShapeDtypeStruct` inputs of `batch` rows, in the form the inputs were given."""
        specs = [jax.ShapeDtypeStruct((batch, *s.shape), s.dtype) for s in self.module.inputs]
        kind = self.module.input_kind
        if kind == "single":
            return specs[0]
        if kind == "dict":
            return {s.name: spec for s, spec in zip(self.module.inputs, specs, strict=True)}
        return tuple(specs)


def _flatten(value: Any, argument: str) -> tuple[list[KerasTensor], Any, str]:
    """`value`'s tensors, its treedef and its kind (``"single"``, ``"list"``, ``"dict"``)."""
    if isinstance(value, KerasTensor):
        kind = "single"
    elif isinstance(value, (list, tuple)) and value:
        kind = "list"
        value = list(value)
    elif isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value):
        kind = "dict"
        value = dict(value)
    else:
        kind = ""
    leaves, structure = jax.tree.flatten(value)
    bad = [leaf for leaf in leaves if not isinstance(leaf, KerasTensor)]
    if not kind or bad or len(leaves) != (len(value) if kind != "single" else 1):
        shown = type(bad[0]).__name__ if bad else type(value).__name__
        raise TypeError(
            f"`{argument}` must be a symbolic tensor, or a non-empty list or dict (string "
            f"keys) of them, as Keras's Model({argument}=...): jstrategy.Input(...) for "
            f"inputs, the result of layer calls for outputs; got {shown}. To train a Flax "
            "module, pass it: jstrategy.Model(module, input_shape=...)."
        )
    return leaves, structure, kind


def _keras_order(outputs: list[KerasTensor]) -> tuple[list[Node], list[Any]]:
    """The nodes the outputs depend on, in an order that runs each after the nodes making
    its inputs, and their layers, in Keras's order (Keras 3's ``map_graph``).

    Keras orders a functional model's layers (``model.layers``, and so its weights) by
    depth, the inputs' side first, and within a depth by when a walk back from the
    outputs first met them; the nodes run in the same order. Here the same walk and
    depths, so `get_weights` lists the weights as Keras's does.
    """
    finished: set[int] = set()
    walked: list[Node] = []  # each node after the nodes it depends on
    first_met: dict[int, int] = {}

    def walk(tensor: KerasTensor) -> None:
        node = tensor.node
        if id(node) in finished:
            return
        first_met.setdefault(id(node.layer), len(first_met))
        for t in node.inputs:
            walk(t)
        finished.add(id(node))
        walked.append(node)

    for t in outputs:
        walk(t)
    node_depth: dict[int, int] = {}
    layer_depth: dict[int, int] = {}
    for node in reversed(walked):
        depth = max(node_depth.setdefault(id(node), 0), layer_depth.get(id(node.layer), 0))
        layer_depth[id(node.layer)] = node_depth[id(node)] = depth
        for t in node.inputs:
            node_depth[id(t.node)] = max(depth + 1, node_depth.get(id(t.node), 0))
    nodes = sorted(walked, key=lambda n: (-node_depth[id(n)], first_met[id(n.layer)]))
    layers = list({id(n.layer): n.layer for n in nodes}.values())
    layers.sort(key=lambda layer: (-layer_depth[id(layer)], first_met[id(layer)]))
    return nodes, layers


def _name_layers(layers: list[Any]) -> None:
    """Names the unnamed layers in place as Keras would; refuses two layers of one name."""
    named: dict[str, Any] = {}
    for layer in layers:
        name = layer.name
        if name is not None and named.setdefault(name, layer) is not layer:
            raise ValueError(
                f"All layers of a model must have unique names; {name!r} names two of them "
                f"({type(named[name]).__name__} and {type(layer).__name__}). Give one "
                "another name=, or none to have one made."
            )
    for layer in sorted(layers, key=lambda layer: getattr(layer, "_made", 0)):
        if layer.name is None:
            name = auto_name(layer, named)
            named[name] = layer
            # Named in place, as Keras names the layer object itself (Sequential does too).
            object.__setattr__(layer, "name", name)


def trace(inputs: Any, outputs: Any) -> Graph:
    """The `Graph` from `inputs` to `outputs` (symbolic tensors, or lists/dicts of them).

    Raises:
      TypeError: if `inputs` or `outputs` are not symbolic tensors, or an input is not a
        `jstrategy.Input`.
      ValueError: if the outputs depend on an input not in `inputs`, or two layers share
        a name.
    """
    in_tensors, _, input_kind = _flatten(inputs, "inputs")
    out_tensors, out_structure, _ = _flatten(outputs, "outputs")
    for t in in_tensors:
        if not isinstance(t.node.layer, InputLayer):
            raise TypeError(
                f"`inputs` must be tensors made by jstrategy.Input; got the output of "
                f"{type(t.node.layer).__name__} {t.name!r}. A model's inputs are where its "
                "data enters: pass the jstrategy.Input tensors the layers were first called on."
            )
    if len({id(t) for t in in_tensors}) != len(in_tensors):
        raise ValueError("`inputs` lists one jstrategy.Input twice; list each input once.")
    order, ordered_layers = _keras_order(out_tensors)
    given = {id(t.node) for t in in_tensors}
    for node in order:
        if isinstance(node.layer, InputLayer) and id(node) not in given:
            raise ValueError(
                f"The outputs depend on an Input of shape {node.outputs[0].shape} "
                f"(name {node.layer.name!r}) that is not in `inputs`. Add it to "
                "jstrategy.Model(inputs=[...], ...)."
            )
    nodes = [node for node in order if not isinstance(node.layer, InputLayer)]
    input_layers = [t.node.layer for t in in_tensors]
    layers = [layer for layer in ordered_layers if not isinstance(layer, InputLayer)]
    index = {id(layer): i for i, layer in enumerate(layers)}
    _name_layers(input_layers + layers)
    numbers = {id(t): i for i, t in enumerate(in_tensors)}
    calls = []
    for node in nodes:
        for t in node.outputs:
            numbers[id(t)] = len(numbers)
        calls.append(
            Call(
                index[id(node.layer)],
                node.structure,
                tuple(numbers[id(t)] for t in node.inputs),
                node.training,
                tuple(numbers[id(t)] for t in node.outputs),
            )
        )
    keys = list(outputs) if isinstance(outputs, Mapping) else None
    specs = tuple(
        InputSpec(name, tuple(t.shape[1:]), t.dtype.name)
        for name, t in zip(
            list(inputs) if input_kind == "dict" else [t.name for t in in_tensors],
            in_tensors,
            strict=True,
        )
    )
    module = FunctionalModule(
        layers=tuple(layers),
        calls=tuple(calls),
        inputs=specs,
        input_kind=input_kind,
        outputs=(out_structure, tuple(numbers[id(t)] for t in out_tensors)),
    )
    names = keys or _output_names(out_tensors)
    # Keras lists an input no output depends on last (depth 0).
    unused = [layer for layer in input_layers if all(layer is not o for o in ordered_layers)]
    every = ordered_layers + unused
    return Graph(module, in_tensors, out_tensors, input_layers, every, nodes, names, numbers)


def _output_names(tensors: list[KerasTensor]) -> list[str]:
    """Keras's output names: the name of the layer making each output (numbered where a
    layer makes several)."""
    names = [str(t.name) for t in tensors]
    return [
        name if names.count(name) == 1 else f"{name}_{names[:i].count(name)}"
        for i, name in enumerate(names)
    ]
