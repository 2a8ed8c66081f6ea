"""The training side of `jstrategy.Model`: train state, compiled step, optimizer, programs.

`Model` is the Keras-shaped facade; `Trainer` holds what it trains and does the work that
does not depend on Keras's argument conventions: applying the compiled optimizer to the
state, the learning rate, and reading and writing the model's variables in checkpoints.
What it sets once per `compile` or state, it holds: the compiled programs (`Programs`) and
the model's fit runner (`fit_runner.py`). The loops in `fit_loop.py` run on it: they take
the state from it and pass it through each epoch by value (`FitEpoch`, `FitEpochResult`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import numpy as np
import optax

from jstrategy._src import checkpoint as checkpoint_lib
from jstrategy._src import context
from jstrategy._src.checkpoint.paths import latest_step_dir
from jstrategy._src.checkpoint.paths import read_by_paths
from jstrategy._src.checkpoint.weights import load_arrays
from jstrategy._src.placement import create_placed
from jstrategy._src.placement import place_state
from jstrategy._src.precision import policy as mp
from jstrategy._src.strategy import get_strategy
from jstrategy._src.training.coordinated_fit import CoordinatedFitRunner
from jstrategy._src.training.fit_runner import FitRunner
from jstrategy._src.training.fit_runner import FitState
from jstrategy._src.training.optimizers import learning_rate as learning_rate_lib
from jstrategy._src.training.optimizers import serialization as optimizers
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.optimizers.base import ema_average
from jstrategy._src.training.programs import Programs
from jstrategy._src.training.saving import config as saved_config
from jstrategy._src.training.state import trainable
from jstrategy._src.training.step import body as step_lib
from jstrategy._src.values import keys_as_data
from jstrategy._src.values import keys_like

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = ["Trainer"]


class Trainer:
    """The training side of a `jstrategy.Model`: state, compiled step, programs, counters.

    Args:
      strategy: the model's strategy.
      seed: seeds the shuffling order of every epoch.
      policy: the model's precision policy.

    Attributes:
      state: the train state (a `TrainStateProtocol`), placed by the strategy; None until
        the model is built.
      spec: the compiled step (`StepSpec`); None until `compile`.
      optimizer: the compiled optimizer: a `jstrategy.optimizers` object (also for a
        name given to `compile`) or the optax transformation `compile` got.
      steps_per_execution: training steps per dispatched program.
      epochs_run: epochs whose shuffling order was drawn (the order of epoch ``e`` is a
        function of ``(seed, e)``, so a backup that records it resumes the same order).
      stop_training: set to end `fit` after the current step (`Model.stop_training`).
      fit_state: where `fit` is, while it runs.
      probed: the one-off checks of the compiled step done (`check_numerics.Watch`).
      programs: the compiled programs (`Programs`), set anew by `compile` and `set_state`.
      fit_runner: how `fit`'s epochs run and what a backup holds besides the state
        (`CoordinatedFitRunner` for a strategy whose ``should_use_with_coordinator`` is
        True, else the default `FitRunner`); one for the model's life.
      class_counts: the model's number of classes by input layout (`input_checks`).
    """

    def __init__(self, strategy: Strategy, seed: int, policy: mp.Policy):
        self.strategy = strategy
        self.seed = seed
        self.policy = policy
        self.state: Any = None
        self.spec: step_lib.StepSpec | None = None
        self.optimizer: Any = None
        self.steps_per_execution = 1
        self.epochs_run = 0
        self.stop_training = False
        self.fit_state: FitState | None = None
        self.fit_runner: FitRunner = (
            CoordinatedFitRunner(strategy) if strategy.should_use_with_coordinator else FitRunner()
        )
        self.class_counts: dict[Any, int | None] = {}
        self.programs = Programs(strategy, policy, None)
        # What the watches of this model's steps have checked once (`check_numerics.Watch`).
        self.probed: set[str] = set()
        self._raw_tx: optax.GradientTransformation | None = None  # compiled, to apply
        self._tx: optax.GradientTransformation | None = None  # applied to the state
        # Builds the state when its shape became known after the model was made (a
        # `Sequential` whose layers are added one by one); None: nothing to build.
        self.build_pending: Callable[[], None] | None = None
        # The state with what its layers say about training now (frozen layers, weight
        # constraints: `trainable.py`), read when an optimizer state is made; the layers'
        # flags it read (`trainable.fingerprint`); and whether a step ran since.
        self.plan_reader: Callable[[Any], Any] | None = None
        self.plan_seen: Any = None
        self.stepped = False

    def _build_pending(self) -> None:
        if self.state is None and self.build_pending is not None:
            self.build_pending()
            # Compiled before it was built: the state takes the compiled optimizer now, so
            # that what is saved or restored holds its optimizer state.
            self.apply_optimizer()

    def require_state(self, what: str) -> Any:
        """The train state, or a clear error naming `what` needed it before it existed."""
        self._build_pending()
        if self.state is None:
            raise ValueError(
                f"The model has no variables yet, so `{what}` is not available. Pass "
                "input_shape=(...) to Model, or call fit/evaluate/predict first."
            )
        return self.state

    def check_scope(self, what: str) -> None:
        """Refuses `what` (a `Model` method) inside another strategy's scope."""
        current = get_strategy() if context.has_strategy() else None
        if current is not None and current is not self.strategy:
            raise ValueError(
                f"The model was created under {self.strategy!r}, but `{what}` is called "
                f"inside the scope of {current!r}. A model runs under the strategy it was "
                "created in (its variables live there); create it inside that scope: `with "
                "strategy.scope(): model = jstrategy.Model(...); model.compile(...)`."
            )

    def ready(self, *, training: bool) -> None:
        """Checks the model can run (built; compiled to train or evaluate), then gives the
        state the compiled optimizer."""
        self._build_pending()
        if self.state is None:
            raise ValueError(
                "The model has no variables: pass input_shape=(...) to Model or give fit "
                "arrays so it can build from them."
            )
        if training and self.spec is None:
            raise RuntimeError(
                "The model must be compiled before training or evaluation; call "
                "model.compile(optimizer, loss, metrics) first."
            )
        self.apply_optimizer()

    @property
    def compiled_spec(self) -> step_lib.StepSpec:
        return self.programs.spec

    # Optimizer ----------------------------------------------------------------------------
    def set_state(self, state: Any) -> None:
        """A new state (built or restored): the programs are redone."""
        self.state = state
        self.programs = Programs(self.strategy, self.policy, self.spec)

    def initial_tx(self) -> optax.GradientTransformation:
        """The optimizer a new state starts with (identity until `compile`)."""
        return self._tx if self._tx is not None else optax.identity()

    def compile(self, optimizer: Any, spec: step_lib.StepSpec, steps_per_execution: int) -> None:
        """Sets the step and the optimizer; a built state gets a fresh optimizer state."""
        optimizer, tx = optimizers.resolve_optimizer(optimizer)
        if isinstance(optimizer, Optimizer):
            # Under the model's accumulation its schedule counts micro-batches, as Keras's.
            tx = optimizer.attach(self, micro_batches=spec.accumulation_steps)
            if optimizer.loss_scale_factor is not None:
                spec = dataclasses.replace(spec, loss_scale_factor=optimizer.loss_scale_factor)
        self.optimizer = optimizer
        self.spec = spec
        self.programs = Programs(self.strategy, self.policy, spec)
        self.probed = set()  # a new loss: its first step's predictions are checked anew
        self.steps_per_execution = steps_per_execution
        self._raw_tx, self._tx = tx, None
        if self.state is not None:
            self.apply_optimizer()

    def apply_optimizer(self) -> None:
        """Gives the state the compiled optimizer, a fresh optimizer state and step 0 (once)."""
        if self._raw_tx is None or self._tx is not None:
            return
        if self.plan_reader is not None:
            self.state = self.plan_reader(self.state)
        self.stepped = False
        # Optimizer state is created in device memory (JAX cannot build arrays "like" a
        # host-memory array outside a program); place_state then puts it where it lives.
        # Where variables are split (FSDP, ModelParallel) it is created where it lives.
        tx = self._tx = self._raw_tx
        state = create_placed(
            lambda state: state.with_optimizer(tx),
            self.state,
            strategy=self.strategy,
            eager=lambda: self.state.with_optimizer(tx),
        )
        self.set_state(step_lib.prepare_state(self.compiled_spec, state))

    def follow_layer_changes(self, current: Any) -> None:
        """Before `fit` trains: `current` (`trainable.fingerprint`) is how the layers' flags
        are now. Changed since the optimizer state was made, they take effect at once if
        no step ran since (the optimizer state is fresh anyway); after training, Keras
        needs ``compile`` again, and so does this (a clear error rather than silently
        training a frozen layer)."""
        if self.plan_reader is None or self.plan_seen is None or current == self.plan_seen:
            return
        if not self.stepped:
            self._tx = None
            self.apply_optimizer()
            return
        before = getattr(self.state, "layer_plan", None)
        state = self.plan_reader(self.state)
        if getattr(state, "layer_plan", None) != before:
            raise ValueError(
                "A layer's `trainable` flag or weight constraint (or model.trainable) "
                "changed after the model was compiled and trained, so the optimizer state "
                "was made for other variables. As in Keras, compile again to apply it: "
                "model.compile(...) (a fresh optimizer state), then fit."
            )
        self.state = state

    def finalize_variables(self) -> None:
        """At the end of `fit`: an optimizer with ``use_ema`` replaces the variables by
        their moving average (Keras's ``finalize_variable_values``)."""
        optimizer = self.optimizer
        if not isinstance(optimizer, Optimizer) or not optimizer.use_ema:
            return
        if self.state is None or self._tx is None:
            return
        average = ema_average(self.state.opt_state)
        plan = getattr(self.state, "layer_plan", None)
        if plan is not None:  # the optimizer averaged the trained parameters only
            average = trainable.with_trained(self.state.params, average, plan)
        state = self.state.with_variables(average, self.state.model_state)
        self.state = place_state(state, self.strategy)

    def _opt_state(self) -> Any:
        if self.spec is None or self.state is None or self._tx is None:
            raise RuntimeError(
                "`learning_rate` is kept in the optimizer state, which exists after "
                "`compile` and once the model is built. Call model.compile(...) first."
            )
        return self.state.opt_state

    def get_learning_rate(self) -> float:
        """`Model.learning_rate`: read from the optimizer state (`learning_rate.read`; a
        `jstrategy.optimizers` object's schedule at the state's update count)."""
        optimizer = self.optimizer
        schedule = optimizer.update_schedule if isinstance(optimizer, Optimizer) else None
        return learning_rate_lib.read(self._opt_state(), schedule)

    def set_learning_rate(self, value: float) -> None:
        """Sets `Model.learning_rate` in the optimizer state (nothing recompiles)."""
        opt_state = learning_rate_lib.write(self._opt_state(), value)
        self.state = self.state.replace(opt_state=opt_state)

    # Epochs -------------------------------------------------------------------------------
    def next_order_seed(self) -> tuple[int, int]:
        """The seed of the next epoch's shuffling order (and count the epoch)."""
        seed = (self.seed, self.epochs_run)
        self.epochs_run += 1
        return seed

    # Variables ----------------------------------------------------------------------------
    def set_weights(self, weights: list[Any]) -> None:
        """`Model.set_weights`: a list like `get_weights`, checked and placed."""
        old = self.state.get_weights()
        names = self.state.weight_names()
        if len(weights) != len(old):
            shown = ", ".join(f"{n} {tuple(w.shape)}" for n, w in zip(names, old, strict=True))
            raise ValueError(
                f"`weights` must hold {len(old)} arrays, as get_weights() returns them "
                f"(Keras's order: {shown}); got {len(weights)}."
            )
        new = []
        for i, (w, like) in enumerate(zip(weights, old, strict=True)):
            w = np.asarray(w)
            if w.shape != like.shape:
                raise ValueError(
                    f"`weights[{i}]` is {names[i]}, of shape {tuple(like.shape)}; got an "
                    f"array of shape {w.shape}. Pass the arrays in get_weights()'s order "
                    "(Keras's: layer by layer, kernel before bias, gamma, beta, "
                    "moving_mean, moving_variance)."
                )
            new.append(w.astype(like.dtype))
        self.state = place_state(self.state.with_weight_list(new), self.strategy)

    def weights_tree(self) -> dict[str, Any]:
        """The variables as checkpoints hold them (typed keys as raw data)."""
        return keys_as_data(self.state.weights())

    def load_weights(self, filepath: os.PathLike | str) -> None:
        """`Model.load_weights`: from a `save_weights` directory or a checkpoint's latest step."""
        like = self.state.weights()
        target = keys_as_data(like)
        path = os.path.abspath(os.fspath(filepath))
        step_dir = latest_step_dir(path)
        if step_dir is None and saved_config.is_saved_model(path):
            step_dir = os.path.join(path, saved_config.STATE_DIR)  # a model.save directory
        if step_dir is None:
            saved = load_arrays(path, target=target, strategy=self.strategy)
        else:
            roots = ("weights", "train_state")
            saved = read_by_paths(step_dir, target, roots, self.strategy)
        saved = place_state(keys_like(saved, like), self.strategy)
        self.state = self.state.with_weights(saved)

    def restore_checkpoint(self, directory: os.PathLike | str) -> None:
        """`Model.restore_checkpoint`: the whole train state of a checkpoint's latest step or
        of a `Model.save` directory, with what the fit runner keeps besides
        (`FitRunner.backup_state`)."""
        path = os.path.abspath(os.fspath(directory))
        if saved_config.is_saved_model(path):
            self._restore_saved_state(os.path.join(path, saved_config.STATE_DIR))
            return
        step_dir = latest_step_dir(path)
        if step_dir is None:
            raise FileNotFoundError(
                f"No checkpoint in {path}. Pass a directory written by ModelCheckpoint or "
                "BackupAndRestore (for save_weights directories use load_weights)."
            )
        target = keys_as_data(self.state)
        extra = self.fit_runner.backup_state(self.state)
        optional = {} if extra is None else {"strategy_state": extra}
        saved, present = read_by_paths(
            step_dir, target, ("train_state",), self.strategy, optional=optional
        )
        saved = keys_like(saved, self.state)
        self.state = place_state(saved, self.strategy)
        if "strategy_state" in present:
            self.fit_runner.restore_backup_state(self.state, present["strategy_state"])
        self.stepped = True  # the optimizer state is the checkpoint's

    def _restore_saved_state(self, state_dir: str) -> None:
        like = self.state
        target: dict[str, Any] = {"train_state": keys_as_data(like)}
        extra = self.fit_runner.backup_state(like)
        if extra is not None:
            target["strategy_state"] = extra
        # Every leaf goes where the target's arrays are: where the model's strategy keeps them.
        saved = checkpoint_lib.load_weights(state_dir, target=target)
        self.set_state(place_state(keys_like(saved["train_state"], like), self.strategy))
        if extra is not None:
            self.fit_runner.restore_backup_state(self.state, saved["strategy_state"])
        self.stepped = True  # the optimizer state is the saved one
