"""`jstrategy.Sequential`: Keras's ``Sequential`` model, a `jstrategy.Model` of a layer list.

A `Sequential` is a `Model` whose module (`SequentialModule`) calls its layers in order,
passing the train step's training flag to each (Keras's ``training``; Flax modules get
theirs: ``train``, ``training`` or ``deterministic``). Layers are named when added, as
Keras names them (``dense``, ``dense_1``, ``conv2d``, ...; an explicit ``name`` is kept),
and the module keeps those names, so variables live at Keras's paths (``dense/kernel``)
and `LayoutMap` keys written for Keras match. Keras counts names across a session (a
second model's first Dense is ``dense_2``); here each model counts its own, so two
models of the same layers have the same paths and exchange weights and checkpoints.

The variables are created from the first layer's ``input_shape`` (or an `Input`) when
first needed (``summary``, ``count_params``, ``fit``, ...), else from the first data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax
import numpy as np

from jstrategy._src.layers import serialization
from jstrategy._src.layers.base import Layer
from jstrategy._src.layers.base import auto_name
from jstrategy._src.layers.base import call_layer
from jstrategy._src.layers.core import InputLayer
from jstrategy._src.layers.symbolic import KerasTensor
from jstrategy._src.layers.symbolic import input_layer_of
from jstrategy._src.precision import policy as mp
from jstrategy._src.registry import register_saveable
from jstrategy._src.training.model import Model
from jstrategy._src.training.saving import config as saved_config
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import check_row_shape

__all__ = ["KerasLayers", "Sequential", "SequentialModule"]


class SequentialModule(nn.Module):
    """The linen module of a `Sequential`: its layers called in order.

    Its layers keep the names they were given (``preserve_adopted_names``) instead of
    Flax's ``layers_0``, ``layers_1``.

    Attributes:
      layers: the layers (linen modules, or plain functions of one array).
    """

    layers: tuple[Any, ...] = ()

    preserve_adopted_names: ClassVar[bool] = True

    def __call__(self, inputs: Any, training: bool = False) -> Any:
        x = inputs
        for layer in self.layers:
            x = call_layer(layer, x, training)
        return x


class KerasLayers:
    """What Keras's models of layers share (`Sequential`, the functional `Functional`):
    ``trainable`` setting every layer's flag, ``layers`` and ``get_layer``, over
    ``_layers``."""

    _layers: list[Any]
    _trainable: bool

    @property
    def trainable(self) -> bool:
        """Keras's ``model.trainable``: setting it sets every layer's ``trainable`` too,
        as Keras does (so a frozen model's `BatchNormalization` layers run in inference
        mode); read when the model is compiled."""
        return self._trainable

    @trainable.setter
    def trainable(self, value: bool) -> None:
        self._trainable = check_bool(value, "trainable")
        for layer in self._layers:
            if isinstance(layer, Layer):
                layer.trainable = value

    @property
    def layers(self) -> list[Any]:
        """The layers, in order, with the names they carry in the model (Keras's ``layers``:
        a `Sequential`'s Input is not one, a functional model's inputs are)."""
        return list(self._layers)

    def get_layer(self, name: str | None = None, index: int | None = None) -> Any:
        """A layer by name or by index (Keras's ``get_layer``).

        Raises:
          ValueError: for neither or both, or an unknown name or index.

        Example:

        >>> import jstrategy
        >>> model = jstrategy.Sequential([jstrategy.layers.Dense(2), jstrategy.layers.Dense(1)])
        >>> model.get_layer("dense_1").units, model.get_layer(index=0).name
        (1, 'dense')
        """
        if (name is None) == (index is None):
            raise ValueError("Pass get_layer a `name` or an `index`, one of them.")
        if index is not None:
            if not isinstance(index, int) or not -len(self._layers) <= index < len(self._layers):
                raise ValueError(
                    f"`index` must be in [0, {len(self._layers)}) for this model's "
                    f"{len(self._layers)} layers; got {index!r}."
                )
            return self._layers[index]
        for layer in self._layers:
            if getattr(layer, "name", None) == name:
                return layer
        names = [getattr(layer, "name", None) for layer in self._layers]
        raise ValueError(f"No such layer: {name!r}. Existing layers are: {names}.")

    def _with_layer_configs(self, config: dict[str, Any]) -> dict[str, Any]:
        """`config` with ``layer_classes`` and ``layers`` (each layer's config, or None
        when one has none, with ``layers_not_saved`` saying why)."""
        config["layer_classes"] = [serialization.class_name(layer) for layer in self._layers]
        try:
            config["layers"] = [serialization.serialize(layer) for layer in self._layers]
        except serialization.NotSerializable as e:
            config["layers"] = None
            config["layers_not_saved"] = str(e)
        return config


@register_saveable(kind="model")
class Sequential(KerasLayers, Model):
    """Keras's ``Sequential``: a stack of layers, built, compiled and trained as a `Model`.

    Create it inside ``strategy.scope()`` (it captures the strategy, as every `Model`),
    from a list of layers or by `add`-ing them. The first layer's ``input_shape`` (or a
    leading `jstrategy.layers.Input`) gives the shape of one row; without one the model is
    built from the first data. `jstrategy.layers` take the training flag; Flax linen
    modules may be mixed in.

    Args:
      layers: the layers, in order (or None, to `add` them).
      trainable: Keras's argument: False freezes every layer (`Model.trainable`).
      name: the model's name (default ``"sequential"``), shown by `summary`.
      seed: seeds parameter initialization, dropout and shuffling (None: the seed of
        `jstrategy.utils.set_random_seed`, else 0).
      dtype_policy: the precision policy, as `Model`'s.

    Raises:
      ValueError: for a `trainable` that is not a bool, or layers that `add` refuses.
      TypeError: for layers that are not modules or functions.

    Example:

    >>> import numpy as np, jstrategy
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     model = jstrategy.Sequential()
    ...     model.add(jstrategy.layers.Dense(16, activation="relu", input_shape=(10,)))
    ...     model.add(jstrategy.layers.Dense(1))
    ...     model.compile(loss="mse", optimizer=jstrategy.optimizers.SGD(0.1))
    >>> [layer.name for layer in model.layers], model.count_params()
    (['dense', 'dense_1'], 193)
    >>> x, y = np.ones((8, 10), np.float32), np.zeros((8, 1), np.float32)
    >>> len(model.fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"])
    2
    """

    def __init__(
        self,
        layers: Sequence[Any] | None = None,
        trainable: bool = True,
        name: str | None = None,
        *,
        seed: int | None = None,
        dtype_policy: mp.Policy | str | None = None,
    ):
        check_bool(trainable, "trainable")
        super().__init__(
            SequentialModule(),
            None,
            name=name or "sequential",
            seed=seed,
            train_arg="training",
            dtype_policy=dtype_policy,
        )
        self._layers: list[Any] = []
        self._trainer.build_pending = self._maybe_build
        if layers is not None:
            if not isinstance(layers, (list, tuple)):
                raise TypeError(
                    f"`layers` must be a list of layers; got {type(layers).__name__}. "
                    "E.g. Sequential([Dense(16, input_shape=(10,)), Dense(1)])."
                )
            for layer in layers:
                self.add(layer)
        if not trainable:
            self.trainable = False

    # Layers -------------------------------------------------------------------------------
    def add(self, layer: Any) -> None:
        """Appends `layer` (Keras's ``add``), naming it as Keras does unless it has a name.

        Args:
          layer: a `jstrategy.layers` layer, a Flax linen module, a plain function of one
            array, or (first only) a `jstrategy.Input` (or an `InputLayer`).

        Raises:
          ValueError: after the model has variables (``summary``, ``fit``, ...: add every
            layer first), for an `Input` that is not first, or a duplicate name.
          TypeError: for anything else.
        """
        if self._trainer.state is not None:
            raise ValueError(
                "Layers cannot be added once the model has variables (they were created by "
                "summary, count_params, fit, ... from the layers so far). Add every layer "
                "first, then build: Sequential([...]) or model.add(...) before model.summary()."
            )
        if isinstance(layer, KerasTensor):
            if not isinstance(layer.node.layer, InputLayer):
                raise TypeError(
                    f"`layer` must be a layer; got a symbolic tensor, the output of "
                    f"{type(layer.node.layer).__name__} {layer.name!r}. A Sequential takes "
                    "layers (and an Input first); a model of layer calls on tensors is a "
                    "functional model: jstrategy.Model(inputs, outputs)."
                )
            layer = layer.node.layer
        if isinstance(layer, InputLayer):
            if self._layers or self._input_shape is not None:
                raise ValueError(
                    "An Input must be the first element of a Sequential; got one after "
                    f"{len(self._layers)} layer(s). Put Input(shape=...) first, or pass "
                    "input_shape= to the first layer."
                )
            self._input_shape = layer.shape
            self._input_dtype = np.dtype(layer.dtype)
            return
        if isinstance(layer, Model):
            raise TypeError(
                f"`layer` must be a layer; got the model {layer.name!r}. Add its layers "
                "instead: for layer in other.layers: model.add(layer)."
            )
        if not isinstance(layer, nn.Module):
            if callable(layer):
                self._layers.append(layer)
                self.module = SequentialModule(tuple(self._layers))
                return
            raise TypeError(
                f"`layer` must be a jstrategy.layers layer, a Flax linen module or a "
                f"function; got {type(layer).__name__} {layer!r}."
            )
        if not self._layers and self._input_shape is None:
            shape = getattr(layer, "input_shape", None)
            if shape is not None:
                self._input_shape = check_row_shape(shape, "input_shape")
                dtype = layer.sample_dtype if isinstance(layer, Layer) else "float32"
                self._input_dtype = np.dtype(dtype)
        name = layer.name or auto_name(layer, [getattr(e, "name", None) for e in self._layers])
        if any(getattr(existing, "name", None) == name for existing in self._layers):
            raise ValueError(
                f"All layers of a Sequential must have unique names; {name!r} is already "
                f"taken (layers: {[getattr(e, 'name', None) for e in self._layers]}). Give "
                "the layer another name=, or none to have one made."
            )
        if layer.name is None:
            # Named in place, as Keras names the layer object itself: `model.layers[0] is
            # layer`, so a flag the user sets on it (`layer.trainable = False`) is the
            # model's.
            object.__setattr__(layer, "name", name)
        self._layers.append(layer)
        self.module = SequentialModule(tuple(self._layers))

    def _user_layers(self) -> dict[tuple[str, ...], Any]:
        # A Sequential's layers are the objects its module calls, at their names.
        return {(str(layer.name),): layer for layer in self._layers if isinstance(layer, nn.Module)}

    # Building -----------------------------------------------------------------------------
    def _maybe_build(self) -> None:
        if self._trainer.state is None and self._input_shape is not None:
            # The first use may be inside a trace (TF's custom loop reads
            # `model.trainable_variables` first inside `strategy.run`): the variables are
            # made from concrete values all the same, as TF creates a lazily built model's
            # variables outside its tf.function's graph.
            with jax.ensure_compile_time_eval():
                self._build(np.zeros((1, *self._input_shape), self._input_dtype))

    def _build(self, sample_x: Any) -> None:
        if not self._layers:
            raise ValueError(
                "The Sequential has no layers; add some first: model.add(Dense(16)), or "
                "Sequential([Dense(16, input_shape=(10,)), Dense(1)])."
            )
        super()._build(sample_x)

    @property
    def built(self) -> bool:
        """Whether the variables exist (they are created once the row shape is known)."""
        self._maybe_build()
        return super().built

    @classmethod
    def _from_saved(cls, config: dict[str, Any], module: Any, path: str) -> Sequential:
        """A `Sequential` from a saved config (`module`: its layers, if the config lacks them)."""
        if isinstance(module, Sequential):
            layers: list[Any] = module.layers
        elif isinstance(module, (list, tuple)):
            layers = [input_layer_of(layer) for layer in module]
        elif module is None and config.get("layers") is not None:
            layers = _rebuilt_layers(config, path)
        else:
            why = config.get("layers_not_saved") or "some are not jstrategy.layers"
            classes = config.get("layer_classes")
            order = f" ({', '.join(classes)})" if classes else ""
            raise ValueError(
                f"The Sequential saved in {path} has layers whose config was not saved ({why}), "
                f"so they cannot be rebuilt from the file. Pass them: load_model(path, "
                f"[layer, ...]), new layers of the saved classes in the saved order{order}."
            )
        model = Sequential(
            name=config["name"],
            seed=int(config["seed"]),
            dtype_policy=config.get("dtype_policy", "float32"),
        )
        shape = config["input_shape"]
        if shape is not None and not any(isinstance(layer, InputLayer) for layer in layers):
            model.add(InputLayer(shape=tuple(shape), dtype=config["input_dtype"]))
        for layer in layers:
            model.add(layer)
        return model

    def get_config(self) -> dict[str, Any]:
        """`Model.get_config` plus ``layers``: each layer's config (None when a layer has
        none, e.g. a Flax module or a function given as an activation: pass the layers to
        `load_model` then), ``layers_not_saved`` (why ``layers`` is None) and
        ``layer_classes`` (the layers' class names, which `load_model` checks the layers
        it is given against)."""
        return self._with_layer_configs(super().get_config())


def _rebuilt_layers(config: dict[str, Any], path: str) -> list[Any]:
    """The layers a saved config describes (its errors name the file and the field)."""
    layers = []
    for i, entry in enumerate(config["layers"]):
        try:
            layers.append(serialization.deserialize(entry))
        except (TypeError, ValueError) as e:
            raise saved_config.field_error(
                path, f"layers[{i}]", f"does not build a jstrategy layer: {e}"
            ) from e
    return layers
