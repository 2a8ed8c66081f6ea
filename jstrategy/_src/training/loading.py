"""`jstrategy.models.load_model`: a model that `Model.save` wrote, built and restored.

Apart from `saving.py` because it builds a `Model`, whose `save` is defined there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jstrategy._src.training import functional  # noqa: F401  (registers "Functional" for load_model)
from jstrategy._src.training.model import Model
from jstrategy._src.training.saving import config as saved_config
from jstrategy._src.training.saving import model_dir as saving

__all__ = ["load_model"]


def load_model(
    filepath: os.PathLike | str,
    module: Any = None,
    *,
    custom_objects: Mapping[str, Any] | None = None,
    compile: bool = True,
    allow_other_module: bool = False,
) -> Model:
    """Loads a model that `Model.save` wrote: builds it from `module`, compiles it, restores
    its state (Keras's ``load_model``).

    The model is created under the current strategy (call it inside ``strategy.scope()``
    to train it there), whatever strategy saved it; its variables, optimizer state and
    step are restored into that strategy's layout.

    Args:
      filepath: the directory `Model.save` wrote.
      module: a Flax module of the saved model's architecture (linen, or an NNX module
        instance); its code is not saved. None for a `jstrategy.Sequential` of
        `jstrategy.layers` (rebuilt from its saved config); for one holding other
        modules (or a layer given a function, e.g. as its activation), the list of its
        layers: new layers of the saved classes, in the saved order.
      custom_objects: losses, metrics or the optimizer the model was compiled with that
        jstrategy does not define (functions, optax transformations, your own classes), by
        the name the error names (a function's ``__name__``, or the name it was wrapped
        with; ``"optimizer"``).
      compile: compile the model as it was saved and restore the optimizer state too;
        False: restore the variables only, uncompiled.
      allow_other_module: load into a module of another class than the saved one (the
        file records the class name). By default that is an error: two architectures
        with the same variables (a ReLU and a tanh network) would load each other's
        weights silently. Pass True when it is meant, e.g. the class was renamed.

    Returns:
      A `jstrategy.Model`.

    Raises:
      FileNotFoundError: if nothing is at `filepath`.
      ValueError: if `filepath` is not a directory `Model.save` wrote (the message says
        what to use for weights or checkpoints), its configuration file is damaged (the
        message names the file and the field), a custom object is missing, `module` is
        of another class than the saved one, or it does not match the saved variables.

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
    path = os.path.abspath(os.fspath(filepath))
    config = saving.read_config(path)
    if module is not None:
        saved_config.check_module(config, module, path, allow_other_module=allow_other_module)
    model = saving.model_class(config)._from_saved(config, module, path)
    if not model.built:
        how = (
            "start it with jstrategy.Input(shape=...)"
            if config.get("class_name") == "Sequential"
            else "create it with jstrategy.Model(module, input_shape=...)"
        )
        raise ValueError(
            f"The model saved in {path} was built from its first data (no input_shape); "
            f"{how} before model.save, or build the model the same way, call it on data "
            "(e.g. model.predict(x)) and load the weights with model.load_weights(path)."
        )
    compiled = config["compile"]
    if compile and compiled is not None:
        model.compile(**saved_config.compile_arguments(compiled, custom_objects, path))
        model.restore_checkpoint(path)
    else:
        model.load_weights(path)
    return model
