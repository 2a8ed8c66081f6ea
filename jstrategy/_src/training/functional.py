"""Keras's functional API: ``jstrategy.Model(inputs, outputs)``, a model of layer calls.

``x = jstrategy.Input((10,)); y = Dense(1)(Dense(16)(x)); jstrategy.Model(x, y)`` makes a
`Functional`: a `Model` whose module (`FunctionalModule`, `functional_graph.py`) replays
the layer calls recorded on the symbolic tensors. It is an ordinary linen module, so
every strategy, checkpoint and `get_weights` treats it as any other; what is Keras's here
is the surface: several inputs (a list, or a dict matched to ``fit``'s x by name),
several outputs (a list or a dict) with a loss each (`functional_outputs.py`), shared
layers, `summary`'s "Connected to" column, and `save` / `load_model` of the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jstrategy._src.layers import serialization
from jstrategy._src.layers.base import Layer
from jstrategy._src.layers.core import Input
from jstrategy._src.layers.core import InputLayer
from jstrategy._src.layers.symbolic import KerasTensor
from jstrategy._src.layers.symbolic import input_layer_of
from jstrategy._src.precision import policy as mp
from jstrategy._src.registry import register_saveable
from jstrategy._src.training import functional_graph
from jstrategy._src.training import functional_outputs
from jstrategy._src.training import summary as summary_lib
from jstrategy._src.training.model import Model
from jstrategy._src.training.saving import config as saved_config
from jstrategy._src.training.sequential import KerasLayers
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.validation import check_bool

__all__ = ["Functional"]


@register_saveable(kind="model")
class Functional(KerasLayers, Model):
    """A model of layer calls on symbolic tensors: what ``jstrategy.Model(inputs,
    outputs)`` makes (Keras's functional API).

    Create it inside ``strategy.scope()`` as every `Model`; its variables are created at
    once (the graph knows every shape). A layer object called more than once shares its
    weights (Keras's shared layers).

    Args:
      inputs: the `jstrategy.Input` tensors: one, a list (``fit``'s x a list or tuple
        of arrays in that order, or a dict by the inputs' names), or a dict (x a dict
        with the same keys).
      outputs: the tensors the model returns: one, a list or a dict (what `predict`
        returns; the labels take the same form, or a dict by output name).
      name: the model's name (default ``"functional"``).
      trainable: False freezes every layer (`Model.trainable`).
      seed: seeds parameter initialization, dropout and shuffling, as `Model`'s.
      dtype_policy: the precision policy, as `Model`'s.

    Raises:
      TypeError: for inputs or outputs that are not symbolic tensors.
      ValueError: if the outputs depend on an input not in `inputs`, or two layers have
        one name.

    Example:

    >>> import numpy as np, jstrategy
    >>> from jstrategy import layers as L
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     x = jstrategy.Input(shape=(8,))
    ...     shared = L.Dense(4, activation="relu")
    ...     y = L.Dense(1)(L.Concatenate()([shared(x), shared(x)]))
    ...     model = jstrategy.Model(x, y)
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> [layer.name for layer in model.layers], model.count_params()
    (['input_layer', 'dense', 'concatenate', 'dense_1'], 45)
    >>> history = model.fit(np.ones((8, 8)), np.zeros((8, 1)), batch_size=4, verbose=0)
    >>> model.predict(np.ones((2, 8)), verbose=0).shape
    (2, 1)
    """

    def __init__(
        self,
        inputs: Any,
        outputs: Any,
        name: str | None = None,
        *,
        trainable: bool = True,
        seed: int | None = None,
        dtype_policy: mp.Policy | str | None = None,
    ):
        check_bool(trainable, "trainable")
        graph = functional_graph.trace(inputs, outputs)
        super().__init__(
            graph.module,
            None,
            name=name or "functional",
            seed=seed,
            train_arg="training",
            dtype_policy=dtype_policy,
        )
        self._graph = graph
        #: What `compile` gave each output of a multi-output model (`save` writes it).
        self.output_compile: functional_outputs.PerOutput | None = None
        # Every layer, the inputs' included, in the order Keras's functional ``layers``
        # lists them.
        self._layers = list(graph.keras_layers)
        specs = graph.module.inputs
        self._input_dtype = np.dtype(specs[0].dtype)
        if len(specs) == 1:
            self._input_shape = specs[0].shape
        self._build(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), graph.sample(1)))
        if not trainable:
            self.trainable = False

    def _user_layers(self) -> dict[tuple[str, ...], Any]:
        return {(str(layer.name),): layer for layer in self._graph.layers}

    @property
    def inputs(self) -> list[KerasTensor]:
        """The input tensors, in order (Keras's ``model.inputs``)."""
        return list(self._graph.inputs)

    @property
    def outputs(self) -> list[KerasTensor]:
        """The output tensors, flattened in order (Keras's ``model.outputs``)."""
        return list(self._graph.outputs)

    @property
    def input_names(self) -> list[str]:
        """The inputs' names: the keys of a dict of input arrays."""
        return [spec.name for spec in self._graph.module.inputs]

    @property
    def output_names(self) -> list[str]:
        """The outputs' names (Keras's ``output_names``): a dict's keys, else the names of
        the layers that make them; the prefix of each output's logs (``dense_1_loss``)."""
        return list(self._graph.output_names)

    def _sample_row(self) -> Any:
        return self._graph.sample(1)

    # Training --------------------------------------------------------------------------
    def compile(
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Any = None,
        steps_per_execution: int = 1,
        gradient_accumulation_steps: int = 1,
        weighted_metrics: Any = None,
        sync_batch_norm: BatchNormSync | str = BatchNormSync.GLOBAL,
        *,
        loss_weights: Any = None,
        **kwargs: Any,
    ) -> None:
        """`Model.compile`, with Keras's forms for several outputs.

        For a model of several outputs, `loss` is one loss for every output, a list (one
        per output, None for none) or a dict by output name (`output_names`); the loss
        minimized is the sum of the outputs' losses, each times its ``loss_weights``
        entry (a list or a dict; default 1). `metrics` and `weighted_metrics` are a list
        of one entry per output (a metric, a list of them, or None) or a dict by output
        name. The logs hold ``loss``, each output's ``<output>_loss`` and each metric as
        ``<output>_<metric>`` (``dense_1_accuracy``), as Keras's. The labels are a list
        in the outputs' order or a dict by output name; a ``sample_weight`` weighs each
        row of every output.

        Example:

        >>> import jstrategy
        >>> from jstrategy import layers as L
        >>> x = jstrategy.Input((4,))
        >>> model = jstrategy.Model(x, [L.Dense(3)(x), L.Dense(1, name="price")(x)])
        >>> model.compile("adam", loss=["sparse_categorical_crossentropy", "mse"],
        ...               loss_weights=[1.0, 0.5], metrics=[["accuracy"], None])
        >>> model.metrics_names
        ['loss', 'dense_loss', 'price_loss', 'dense_accuracy']
        """
        names = self._graph.output_names
        record = None
        if len(names) == 1:
            loss = _single(loss, names)
            if loss_weights is not None:
                weights = [_single(loss_weights, names)]
                loss = functional_outputs.compile_arguments(names, [loss], weights, None, None)[0]
            metrics, weighted_metrics = _single(metrics, names), _single(weighted_metrics, names)
        else:
            loss, metrics, weighted_metrics, record = functional_outputs.compile_arguments(
                names, loss, loss_weights, metrics, weighted_metrics
            )
        super().compile(
            optimizer,
            loss,
            metrics,
            steps_per_execution,
            gradient_accumulation_steps,
            weighted_metrics,
            sync_batch_norm,
            **kwargs,
        )
        self.output_compile = record

    # Data: Keras passes several inputs (or outputs) as a list; the adapters take tuples.
    def fit(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        validation = kwargs.get("validation_data")
        if isinstance(validation, (tuple, list)):
            kwargs["validation_data"] = tuple(_tupled(v) for v in validation)
        return super().fit(_tupled(x), _tupled(y), *args, **kwargs)

    def evaluate(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        return super().evaluate(_tupled(x), _tupled(y), *args, **kwargs)

    def predict(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return super().predict(_tupled(x), *args, **kwargs)

    fit.__doc__ = Model.fit.__doc__
    evaluate.__doc__ = Model.evaluate.__doc__
    predict.__doc__ = Model.predict.__doc__

    # Summary ---------------------------------------------------------------------------
    def summary(self, print_fn: Callable[[str], Any] | None = None) -> None:
        """Prints Keras's functional summary: each layer (inputs first) with its output
        shape, its parameters and the layers it is connected to
        (``layer[node][tensor]``, as Keras writes them).

        Example:

        >>> import jstrategy
        >>> from jstrategy import layers as L
        >>> a, b = jstrategy.Input((3,)), jstrategy.Input((2,))
        >>> model = jstrategy.Model([a, b], L.Dense(1)(L.Concatenate()([a, b])))
        >>> model.summary()  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        Model: "functional"
        ...
         concatenate (Concatenate)  (None, 5)    0    input_layer[0][0], input_layer_1[0][0]
         dense (Dense)              (None, 1)    6    concatenate[0][0]
        ...
        """
        variables = self.state.variables
        nodes: dict[int, list[Any]] = {}
        for node in self._graph.nodes:
            nodes.setdefault(id(node.layer), []).append(node)
        rows = []
        trainable = summary_lib.Count()
        for layer in self._layers:
            if isinstance(layer, InputLayer):
                rows.append((f"{layer.name} (InputLayer)", str((None, *layer.shape)), 0, "-"))
                continue
            own = nodes[id(layer)]
            outputs = own[0].outputs
            shape = str(outputs[0].shape) if len(outputs) == 1 else str([t.shape for t in outputs])
            links = [
                f"{t.name}[{self._node_index(t)}][{t.index}]" for node in own for t in node.inputs
            ]
            count = summary_lib.Count.of(
                {col: tree[layer.name] for col, tree in variables.items() if layer.name in tree}
            )
            if self._trainable and layer.trainable:
                trainable += summary_lib.Count.of(variables.get("params", {}).get(layer.name, {}))
            rows.append(
                (f"{layer.name} ({type(layer).__name__})", shape, count.size, ", ".join(links))
            )
        total = summary_lib.Count.of(variables)
        table = summary_lib.render(self.name, rows, total, trainable)
        layouts = summary_lib.layout_table(self.state.weights())
        (print_fn or print)(table if layouts is None else f"{table}\n{layouts}")

    def _node_index(self, tensor: KerasTensor) -> int:
        """Which call of its layer made `tensor` (0 for an input), as Keras counts them."""
        if isinstance(tensor.node.layer, InputLayer):
            return 0
        own = [node for node in self._graph.nodes if node.layer is tensor.node.layer]
        return next(i for i, node in enumerate(own) if node is tensor.node)

    # Saving ----------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """`Model.get_config` plus the graph: ``layers`` (each layer's config, inputs'
        first, or None when one has none, e.g. a `jstrategy.layers.Lambda`),
        ``layer_classes``, and ``graph``: the inputs' names and the kind of `inputs`,
        each call as ``[layer index, input tensors, training]`` (a tensor is its number:
        the inputs first, then each call's outputs in order) and the outputs."""
        config = self._with_layer_configs(super().get_config())
        module = self._graph.module
        index = {id(layer): i for i, layer in enumerate(self._layers)}
        structure, numbers = module.outputs
        config["graph"] = {
            "input_kind": module.input_kind,
            "input_names": [spec.name for spec in module.inputs],
            "calls": [
                [
                    index[id(node.layer)],
                    _json_tree(jax.tree.unflatten(call.structure, call.inputs)),
                    call.training,
                ]
                for node, call in zip(self._graph.nodes, module.calls, strict=True)
            ],
            "outputs": _json_tree(jax.tree.unflatten(structure, numbers)),
        }
        return config

    @classmethod
    def _from_saved(cls, config: dict[str, Any], module: Any, path: str) -> Functional:
        """The functional model a saved config describes (`module`: None, or its layers
        in the saved order when their config was not saved)."""
        if isinstance(module, (list, tuple, Functional)):
            layers = (
                module.layers
                if isinstance(module, Functional)
                else [input_layer_of(layer) for layer in module]
            )
        elif module is None and config.get("layers") is not None:
            layers = [serialization.deserialize(entry) for entry in config["layers"]]
        else:
            why = config.get("layers_not_saved") or "some are not jstrategy.layers"
            raise ValueError(
                f"The functional model saved in {path} has layers whose config was not saved "
                f"({why}). Pass them: load_model(path, [layer, ...]), new layers of the saved "
                f"classes in the saved order ({', '.join(config.get('layer_classes') or [])})."
            )
        try:
            inputs, outputs = _replay(config["graph"], layers)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise saved_config.field_error(path, "graph", f"does not rebuild the model: {e}") from e
        return Functional(
            inputs,
            outputs,
            name=config["name"],
            seed=int(config["seed"]),
            dtype_policy=config.get("dtype_policy", "float32"),
        )


def _single(value: Any, names: list[str]) -> Any:
    """A single-output model's entry of `compile`'s list or dict form (Keras takes both)."""
    if isinstance(value, Mapping) and set(value) <= set(names):
        return value.get(names[0])
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return value[0]
    return value


def _tupled(value: Any) -> Any:
    """A list of arrays (Keras's form of several inputs or outputs) as a tuple."""
    if isinstance(value, list) and value and all(hasattr(v, "shape") for v in value):
        return tuple(value)
    return value


def _json_tree(tree: Any) -> Any:
    """A call's inputs (tensor numbers in lists, tuples, dicts) as JSON."""
    if isinstance(tree, Mapping):
        return {str(k): _json_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_json_tree(v) for v in tree]
    return int(tree)


def _replay(graph: dict[str, Any], layers: list[Any]) -> tuple[Any, Any]:
    """The inputs and outputs of a saved graph, its calls made again on `layers`."""
    tensors: list[Any] = []
    for layer in layers:
        if isinstance(layer, InputLayer):
            tensors.append(Input(shape=layer.shape, dtype=layer.dtype, name=layer.name))
    inputs: Any = list(tensors)
    if graph["input_kind"] == "single":
        inputs = tensors[0]
    elif graph["input_kind"] == "dict":
        inputs = dict(zip(graph["input_names"], tensors, strict=True))

    def tree(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: tree(v) for k, v in value.items()}
        if isinstance(value, list):
            return [tree(v) for v in value]
        return tensors[value]

    for layer_index, args, training in graph["calls"]:
        layer = layers[layer_index]
        if not isinstance(layer, Layer) or isinstance(layer, InputLayer):
            raise ValueError(f"call of layers[{layer_index}], which is not a layer to call")
        out = layer(tree(args)) if training is None else layer(tree(args), training=training)
        tensors.extend(jax.tree.leaves(out))
    return inputs, tree(graph["outputs"])
