"""`Model.save` and `jstrategy.models.load_model`: a model in one directory, as Keras's.

A saved model is a directory holding:

* ``jstrategy_model.json``: how to build and compile it again: the model's
  ``input_shape``, ``input_dtype``, ``seed``, ``name`` and ``train_arg``, and the compile
  configuration (the optimizer by its Keras config, the loss and metrics by class and
  config, ``steps_per_execution``, ``gradient_accumulation_steps``; the dtype policy);
* ``state/``: the train state (variables, optimizer state, step), written with orbax by
  `jstrategy.save_weights`; under `ParameterServerStrategy` also each variable's optimizer
  state on the parameter servers.

The module's code is not saved (a Flax module is Python code): `load_model(path, module)`
takes a module of the same architecture, builds the model, compiles it from the config and
restores the state. Losses, metrics and optimizers that jstrategy does not define (a
function, an optax transformation) are saved by name; pass them to `load_model` in
``custom_objects``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import numpy as np

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src import fault_tolerance
from jstrategy._src.placement import place_state
from jstrategy._src.training import keras_optimizers
from jstrategy._src.training import losses as losses_lib
from jstrategy._src.training import metrics as metrics_lib

if TYPE_CHECKING:
    from jstrategy._src.training.model import Model

__all__ = ["CONFIG_FILE", "STATE_DIR", "load_model", "save_model"]

CONFIG_FILE = "jstrategy_model.json"
STATE_DIR = "state"
_FORMAT = "jstrategy.Model"
_VERSION = 1
_CUSTOM = "custom"


# Configurations ------------------------------------------------------------------------
def _serialize_loss(loss: Any) -> dict[str, Any]:
    cls = type(loss)
    if getattr(losses_lib, cls.__name__, None) is cls and cls is not losses_lib.LossFunctionWrapper:
        return {"class_name": cls.__name__, "config": loss.get_config()}
    return {"class_name": _CUSTOM, "name": loss.name}


def _serialize_metric(metric: Any) -> dict[str, Any]:
    cls = type(metric)
    if cls is metrics_lib.MeanMetricWrapper and isinstance(metric.fn, losses_lib.Loss):
        fn = _serialize_loss(metric.fn)
        if fn["class_name"] != _CUSTOM:
            config = {"name": metric.name, "direction": metric.direction}
            return {"class_name": "MeanMetricWrapper", "loss": fn, "config": config}
    if getattr(metrics_lib, cls.__name__, None) is cls and cls is not metrics_lib.MeanMetricWrapper:
        return {"class_name": cls.__name__, "config": metric.get_config()}
    if metric.name in ("accuracy", "acc"):  # resolved from the loss and shapes at compile
        return {"identifier": metric.name}
    return {"class_name": _CUSTOM, "name": metric.name}


def _serialize_optimizer(optimizer: Any) -> dict[str, Any]:
    if isinstance(optimizer, keras_optimizers.Optimizer):
        try:
            return keras_optimizers.serialize(optimizer)
        except TypeError:  # a schedule that is a plain function
            return {"class_name": _CUSTOM, "name": "optimizer"}
    return {"class_name": _CUSTOM, "name": "optimizer"}


def _custom(config: dict[str, Any], custom_objects: Mapping[str, Any], what: str) -> Any:
    name = config["name"]
    if name not in custom_objects:
        raise ValueError(
            f"The saved model's {what} {name!r} is not one jstrategy defines (a function, "
            f"an optax transformation or your own class), so it was saved by name. Pass it "
            f"to load_model: custom_objects={{{name!r}: ...}}."
        )
    return custom_objects[name]


def _deserialize_loss(config: dict[str, Any], custom_objects: Mapping[str, Any]) -> Any:
    if config["class_name"] == _CUSTOM:
        return _custom(config, custom_objects, "loss")
    return getattr(losses_lib, config["class_name"])(**config["config"])


def _deserialize_metric(
    config: dict[str, Any], loss: Any, custom_objects: Mapping[str, Any]
) -> Any:
    if "identifier" in config:
        return metrics_lib.get(config["identifier"], loss=loss)
    if config["class_name"] == _CUSTOM:
        return _custom(config, custom_objects, "metric")
    if config["class_name"] == "MeanMetricWrapper":
        fn = _deserialize_loss(config["loss"], custom_objects)
        return metrics_lib.MeanMetricWrapper(fn, **config["config"])
    return getattr(metrics_lib, config["class_name"])(**config["config"])


def _deserialize_optimizer(config: dict[str, Any], custom_objects: Mapping[str, Any]) -> Any:
    if config["class_name"] == _CUSTOM:
        return _custom(config, custom_objects, "optimizer")
    return keras_optimizers.deserialize(config)


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


# Saving --------------------------------------------------------------------------------
def _is_saved_model(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def save_model(model: Model, filepath: os.PathLike | str, *, overwrite: bool = True) -> None:
    """Writes `model` to the directory `filepath`: the behaviour of `Model.save`."""
    from orbax.checkpoint import multihost

    if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
        raise TypeError(f"`filepath` must be a directory path; got {filepath!r}.")
    path = os.path.abspath(os.fspath(filepath))
    if os.path.exists(path):
        if not overwrite:
            raise FileExistsError(
                f"{path} already exists. Pass overwrite=True to replace it, or another path."
            )
        if not os.path.isdir(path) or (os.listdir(path) and not _is_saved_model(path)):
            raise FileExistsError(
                f"{path} exists and is not a directory written by model.save, so it is not "
                "replaced. Pass a new path, or remove it first."
            )
    trainer = model._trainer
    state = model.state
    spec = trainer.spec
    config: dict[str, Any] = {
        "format": _FORMAT,
        "version": _VERSION,
        "module": type(model.module).__name__,
        "name": model.name,
        "input_shape": None if model._input_shape is None else list(model._input_shape),
        "input_dtype": _dtype_name(model._input_dtype),
        "seed": trainer.seed,
        "train_arg": model._train_arg,
        "dtype_policy": model.dtype_policy.name,
        "compile": None,
    }
    tree: dict[str, Any] = {"train_state": fault_tolerance.to_savable(state)}
    if spec is not None:
        config["compile"] = {
            "optimizer": _serialize_optimizer(trainer.optimizer),
            "loss": None if spec.loss is None else _serialize_loss(spec.loss),
            "metrics": [_serialize_metric(m) for _, m in spec.metrics],
            "steps_per_execution": trainer.steps_per_execution,
            "gradient_accumulation_steps": model.gradient_accumulation_steps,
        }
        extra = model.strategy.fit_backup_state(model, state)
        if extra is not None:
            tree["strategy_state"] = extra
    os.makedirs(path, exist_ok=True)
    checkpoint_lib.save_weights(os.path.join(path, STATE_DIR), tree, overwrite=True)
    if multihost.is_primary_host(0):
        temporary = os.path.join(path, CONFIG_FILE + ".tmp")
        with open(temporary, "w") as f:
            json.dump(config, f, indent=2)
        os.replace(temporary, os.path.join(path, CONFIG_FILE))
    multihost.sync_global_processes("jstrategy_save_model")


# Loading -------------------------------------------------------------------------------
def _read_config(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"No saved model at {path}. Pass a directory written by model.save(path)."
        )
    if not _is_saved_model(path):
        hint = ""
        if os.path.isdir(path) and checkpoint_lib.latest_step_dir(path) is not None:
            hint = " It holds checkpoints: build the model and call model.load_weights(path)."
        elif os.path.isdir(path):
            hint = " For a save_weights directory, build the model and call load_weights."
        raise ValueError(
            f"{path} is not a directory written by model.save (it has no {CONFIG_FILE}).{hint}"
        )
    with open(os.path.join(path, CONFIG_FILE)) as f:
        config = json.load(f)
    if config.get("format") != _FORMAT or config.get("version") != _VERSION:
        raise ValueError(
            f"{os.path.join(path, CONFIG_FILE)} describes format {config.get('format')!r} "
            f"version {config.get('version')!r}; this jstrategy reads {_FORMAT!r} version "
            f"{_VERSION}."
        )
    return config


def load_model(
    filepath: os.PathLike | str,
    module: Any,
    *,
    custom_objects: Mapping[str, Any] | None = None,
    compile: bool = True,
) -> Model:
    """Loads a model that `Model.save` wrote: builds it from `module`, compiles it, restores
    its state (Keras's ``load_model``).

    The model is created under the current strategy (call it inside ``strategy.scope()``
    to train it there), whatever strategy saved it; its variables, optimizer state and
    step are restored into that strategy's layout.

    Args:
      filepath: the directory `Model.save` wrote.
      module: a Flax module of the saved model's architecture (linen, or an NNX module
        instance); its code is not saved.
      custom_objects: losses, metrics or the optimizer the model was compiled with that
        jstrategy does not define (functions, optax transformations, your own classes), by
        the name the error names (a function's ``__name__``; ``"optimizer"``).
      compile: compile the model as it was saved and restore the optimizer state too;
        False: restore the variables only, uncompiled.

    Returns:
      A `jstrategy.Model`.

    Raises:
      FileNotFoundError: if nothing is at `filepath`.
      ValueError: if `filepath` is not a directory `Model.save` wrote (the message says
        what to use for weights or checkpoints), a custom object is missing, or `module`
        does not match the saved variables.

    Example:

    >>> import os, tempfile, numpy as np, flax.linen as nn, jstrategy
    >>> model = jstrategy.Model(nn.Dense(2), input_shape=(3,))
    >>> model.compile(jstrategy.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    >>> path = os.path.join(tempfile.mkdtemp(), "model")
    >>> model.save(path)
    >>> loaded = jstrategy.models.load_model(path, nn.Dense(2))
    >>> loaded.metrics_names, type(loaded.optimizer).__name__, round(loaded.learning_rate, 6)
    (['loss', 'mae'], 'Adam', 0.01)
    """
    # model.py imports this module for Model.save; the reverse import waits for the call.
    from jstrategy._src.training.model import Model

    path = os.path.abspath(os.fspath(filepath))
    config = _read_config(path)
    custom_objects = dict(custom_objects or {})
    input_shape = config["input_shape"]
    model = Model(
        module,
        None if input_shape is None else tuple(input_shape),
        input_dtype=np.dtype(config["input_dtype"]),
        seed=int(config["seed"]),
        name=config["name"],
        train_arg=config["train_arg"],
        dtype_policy=config.get("dtype_policy", "float32"),
    )
    if not model.built:
        raise ValueError(
            f"The model saved in {path} was built from its first data (no input_shape); "
            "create it with jstrategy.Model(module, input_shape=...) before model.save, or "
            "load its weights into a built model with load_weights."
        )
    compiled = config["compile"]
    state_dir = os.path.join(path, STATE_DIR)
    if compile and compiled is not None:
        loss = (
            None
            if compiled["loss"] is None
            else _deserialize_loss(compiled["loss"], custom_objects)
        )
        model.compile(
            _deserialize_optimizer(compiled["optimizer"], custom_objects),
            loss=loss,
            metrics=[_deserialize_metric(m, loss, custom_objects) for m in compiled["metrics"]],
            steps_per_execution=int(compiled["steps_per_execution"]),
            gradient_accumulation_steps=int(compiled.get("gradient_accumulation_steps", 1)),
        )
        model._ensure_ready(training=True)
        _restore_state(model, state_dir)
    else:
        model.load_weights(path)
    return model


def _restore_state(model: Model, state_dir: str) -> None:
    trainer = model._trainer
    like = trainer.state
    target: dict[str, Any] = {"train_state": fault_tolerance.to_savable(like)}
    extra = model.strategy.fit_backup_state(model, like)
    if extra is not None:
        target["strategy_state"] = extra
    # Every leaf goes where the target's arrays are: where the model's strategy keeps them.
    saved = checkpoint_lib.load_weights(state_dir, target=target)
    state = place_state(fault_tolerance.from_savable(saved["train_state"], like), model.strategy)
    trainer.set_state(state)
    if extra is not None:
        model.strategy.restore_fit_backup_state(model, trainer.state, saved["strategy_state"])
