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
restores the state; it refuses a module of another class than the saved one. Losses and
metrics are saved by class name and config when their class is registered
(`jstrategy._src.registry.register_saveable`); those that jstrategy does not define (a function, an
optax transformation) are saved by name, and two different ones under one name are
refused; pass them to `load_model` in ``custom_objects``. What the file holds is written,
read and checked by `saved_config`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import cast

import numpy as np
from orbax.checkpoint import multihost

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src.checkpoint.paths import latest_step_dir
from jstrategy._src.cluster import coordination
from jstrategy._src.registry import saveable_class
from jstrategy._src.training.saving import config as saved_config
from jstrategy._src.training.saving.config import CONFIG_FILE
from jstrategy._src.training.saving.config import STATE_DIR
from jstrategy._src.training.saving.config import CompiledModel
from jstrategy._src.training.saving.config import is_saved_model
from jstrategy._src.values import keys_as_data
from jstrategy._src.values import to_host

if TYPE_CHECKING:
    from jstrategy._src.training.trainer import Trainer

__all__ = [
    "CONFIG_FILE",
    "STATE_DIR",
    "SavableModel",
    "SavingMixin",
    "is_saved_model",
    "model_class",
    "read_config",
    "save_model",
]

_EVERY_WORKER = "In a multi-worker job every worker calls model.save with the same path."
# Beside a saved model while `save` writes the new one, and the one it replaces.
_STAGING = ".jstrategy-new"
_REPLACED = ".jstrategy-old"


# Model classes -------------------------------------------------------------------------
def model_class(config: dict[str, Any]) -> Any:
    """The registered model class (kind ``"model"``) a saved config's ``class_name`` names:
    `load_model` builds the model with its ``_from_saved``. A config without a class name
    (written before classes were recorded), or naming a subclass of `Model` that is not
    registered, is built as a `Model` around the given module."""
    name = config.get("class_name", "Model")
    found = saveable_class("model", name) if isinstance(name, str) else None
    return found if found is not None else saveable_class("model", "Model")


# Saving --------------------------------------------------------------------------------
class SavableModel(CompiledModel, Protocol):
    """What `save_model` reads of a `jstrategy.Model` besides its compile arguments."""

    @property
    def module(self) -> Any: ...

    @property
    def compiled(self) -> bool: ...

    def get_config(self) -> dict[str, Any]: ...


def save_model(
    model: SavableModel, trainer: Trainer, filepath: os.PathLike | str, *, overwrite: bool = True
) -> None:
    """Writes `model` (its training side: `trainer`) to the directory `filepath`: the
    behaviour of `Model.save`."""
    if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
        raise TypeError(f"`filepath` must be a directory path; got {filepath!r}.")
    path = os.path.abspath(os.fspath(filepath))
    if os.path.exists(path):
        if not overwrite:
            raise FileExistsError(
                f"{path} already exists. Pass overwrite=True to replace it, or another path."
            )
        if not os.path.isdir(path) or (os.listdir(path) and not is_saved_model(path)):
            raise FileExistsError(
                f"{path} exists and is not a directory written by model.save, so it is not "
                "replaced. Pass a new path, or remove it first."
            )
    state = trainer.state
    config: dict[str, Any] = {
        "format": saved_config.FORMAT,
        "version": saved_config.VERSION,
        "class_name": type(model).__name__,
        "module": type(model.module).__name__,
        **model.get_config(),
        "compile": None,
    }
    tree: dict[str, Any] = {"train_state": keys_as_data(state)}
    if model.compiled:
        config["compile"] = saved_config.serialize_compile(model)  # before anything is written
        extra = trainer.fit_runner.backup_state(state)
        if extra is not None:
            tree["strategy_state"] = extra
    meeting = coordination.next_id() if coordination.active() else None
    what = f"model.save({path!r})"
    # The whole model is written beside `path`, then moved into place: a save interrupted
    # at any point leaves the previous model whole (ModelCheckpoint saves over it each epoch).
    staging = path + _STAGING
    primary = multihost.is_primary_host(0)
    if primary and os.path.exists(staging):
        shutil.rmtree(staging)  # what an interrupted save left
    if meeting is not None:  # nobody writes into it before the chief emptied it
        coordination.barrier(f"save-model-{meeting}/staging", what=what, fix=_EVERY_WORKER)
    os.makedirs(staging, exist_ok=True)
    checkpoint_lib.save_weights(os.path.join(staging, STATE_DIR), tree, overwrite=True)
    if primary:
        with open(os.path.join(staging, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2)
        _move_into_place(staging, path)
    if meeting is not None:  # the model is in place before any worker returns
        coordination.barrier(f"save-model-{meeting}/written", what=what, fix=_EVERY_WORKER)


def _move_into_place(staging: str, path: str) -> None:
    """Renames the complete model `staging` to `path`, replacing a model saved there."""
    if not os.path.exists(path):
        os.rename(staging, path)
        return
    old = path + _REPLACED
    if os.path.exists(old):
        shutil.rmtree(old)
    os.rename(path, old)  # killed here: `old` and `staging` both hold a whole model
    os.rename(staging, path)
    shutil.rmtree(old)


# Loading -------------------------------------------------------------------------------
def read_config(path: str) -> dict[str, Any]:
    """The configuration in a `Model.save` directory, checked to be one this version reads
    (`saved_config.read_config`: every error names the file and the field)."""
    if not os.path.exists(path):
        left = [p for p in (path + _STAGING, path + _REPLACED) if is_saved_model(p)]
        if left:
            raise FileNotFoundError(
                f"No saved model at {path}, but an interrupted model.save left {left}, each "
                f"a whole model: rename {left[0]} to {path} to use it."
            )
        raise FileNotFoundError(
            f"No saved model at {path}. Pass a directory written by model.save(path)."
        )
    if not is_saved_model(path):
        hint = ""
        if os.path.isdir(path) and latest_step_dir(path) is not None:
            hint = " It holds checkpoints: build the model and call model.load_weights(path)."
        elif os.path.isdir(path):
            hint = " For a save_weights directory, build the model and call load_weights."
        raise ValueError(
            f"{path} is not a directory written by model.save (it has no {CONFIG_FILE}).{hint}"
        )
    return saved_config.read_config(path)


class SavingMixin:
    """`Model`'s weights and saving methods (Keras's ``save``, ``save_weights``, ...)."""

    _trainer: Trainer

    # Weights ----------------------------------------------------------------------------
    def get_weights(self) -> list[np.ndarray]:
        """The variables' values as NumPy arrays (parameters and statistics), in a fixed order.

        Every process of a multi-worker job must call it: variables split across processes
        (FSDP) are gathered from all of them.
        """
        state = self._trainer.require_state("get_weights")
        return [np.asarray(w) for w in to_host(state.get_weights())]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Sets the variables from a list like `get_weights` returns.

        Raises:
          ValueError: if the number of arrays or a shape does not match.
        """
        self._trainer.require_state("set_weights")
        self._trainer.set_weights(list(weights))

    def save_weights(self, filepath: os.PathLike | str, overwrite: bool = True) -> None:
        """Writes the model's variables to the directory `filepath` (`jstrategy.save_weights`).

        Parameters and other variables (BatchNorm statistics, NNX random streams) are saved
        from wherever the strategy keeps them; the write is atomic. Every process of a
        multi-worker job must call it.

        Args:
          filepath: the directory to write.
          overwrite: replace existing weights at `filepath`; if False, they raise.

        Raises:
          ValueError: if the model has no variables yet.
          FileExistsError: if `filepath` exists and `overwrite` is False.

        Example:

        >>> import os, tempfile, flax.linen as nn, jstrategy
        >>> path = os.path.join(tempfile.mkdtemp(), "weights")
        >>> model = jstrategy.Model(nn.Dense(2), input_shape=(3,), seed=1)
        >>> model.save_weights(path)
        >>> other = jstrategy.Model(nn.Dense(2), input_shape=(3,), seed=2)
        >>> other.load_weights(path)
        >>> bool((other.get_weights()[1] == model.get_weights()[1]).all())
        True
        """
        self._trainer.require_state("save_weights")
        checkpoint_lib.save_weights(filepath, self._trainer.weights_tree(), overwrite=overwrite)

    def save(self, filepath: os.PathLike | str, overwrite: bool = True) -> None:
        """Writes the whole model to the directory `filepath`, as Keras's ``model.save``.

        The directory holds the variables, the optimizer state and the step (written with
        orbax, from wherever the strategy keeps them) and a JSON configuration: the
        model's ``input_shape``, dtype, seed and name, and how it was compiled (the
        optimizer by its Keras config, the loss and metrics by class and config,
        ``steps_per_execution``). `jstrategy.models.load_model(filepath, module)` builds,
        compiles and restores it; the module's code is not saved. Every process of a
        multi-worker job must call it.

        Args:
          filepath: the directory to write.
          overwrite: replace a model saved there before; if False, an existing `filepath`
            raises.

        Raises:
          ValueError: if the model has no variables yet.
          FileExistsError: if `filepath` exists and `overwrite` is False, or it holds
            something other than a saved model.
        """
        self._trainer.require_state("save")
        save_model(cast("SavableModel", self), self._trainer, filepath, overwrite=overwrite)

    def load_weights(self, filepath: os.PathLike | str) -> None:
        """Loads variables saved by `save_weights`, `ModelCheckpoint` or `BackupAndRestore`.

        `filepath` is a `save_weights` directory, a checkpoint directory of
        `jstrategy.callbacks.ModelCheckpoint` (weights only or the full training state) or
        `BackupAndRestore`, whose latest step is read, or a `save` directory. The variables are placed as this
        model's strategy keeps them, whatever strategy saved them; the optimizer state is
        left as it is. Every process of a multi-worker job must call it.

        Args:
          filepath: the weights or checkpoint directory.

        Raises:
          ValueError: if the model has no variables yet, or the saved variables are not
            this model's.
          FileNotFoundError: if there is nothing at `filepath`.
          CheckpointError: if the checkpoint is damaged.
        """
        self._trainer.require_state("load_weights")
        self._trainer.load_weights(filepath)

    def restore_checkpoint(self, directory: os.PathLike | str) -> None:
        """Restores the training state (variables, optimizer state, step) of a checkpoint.

        Reads the latest step of a `ModelCheckpoint(save_weights_only=False)` or
        `BackupAndRestore` directory, or the state of a `save` directory, into this model,
        compiled with the same optimizer. Every process of a multi-worker job must call it.

        Args:
          directory: the checkpoint or `save` directory.

        Raises:
          FileNotFoundError: if `directory` holds no checkpoint.
          ValueError: if the model is not compiled, or the checkpoint holds weights only
            or another model's state.
          CheckpointError: if the checkpoint is damaged.
        """
        self._trainer.ready(training=True)
        self._trainer.restore_checkpoint(directory)
