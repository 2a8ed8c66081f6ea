"""`jstrategy.Model`: Keras's compile/fit/evaluate/predict for a Flax module, on a strategy.

A facade, split along Keras's seams: `data_adapters.py` cuts the data into executions,
`fit_loop.py` runs epochs, evaluation and prediction (through the strategy's
`Strategy.run_fit_epoch`), `optimizers.py` turns `compile`'s optimizer into optax and
controls the learning rate, and the train state (`TrainStateProtocol`, linen or NNX) knows
its model. A `Model` captures the strategy current when it is created (``with
strategy.scope():``), as Keras models do.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jstrategy._src import devices as devices_lib
from jstrategy._src.layers.symbolic import KerasTensor
from jstrategy._src.precision import policy as mp
from jstrategy._src.registry import register_kind
from jstrategy._src.registry import register_saveable
from jstrategy._src.registry import saveable_class
from jstrategy._src.strategy import Strategy
from jstrategy._src.strategy import get_strategy
from jstrategy._src.training import data_adapters
from jstrategy._src.training import fit_loop
from jstrategy._src.training import input_checks
from jstrategy._src.training import summary as summary_lib
from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.training.callbacks.base import History
from jstrategy._src.training.callbacks.callback_list import CallbackList
from jstrategy._src.training.fit_runner import FitState
from jstrategy._src.training.model_variables import CustomLoopMixin
from jstrategy._src.training.saving.model_dir import SavingMixin
from jstrategy._src.training.state import trainable as trainable_lib
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.training.state.nnx import create_nnx_train_state
from jstrategy._src.training.state.train_state import create_train_state
from jstrategy._src.training.state.train_state import train_state_shapes
from jstrategy._src.training.step import body as step_lib
from jstrategy._src.training.trainer import Trainer
from jstrategy._src.utils.random_seed import default_seed
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import check_non_negative_int
from jstrategy._src.validation import check_positive_int
from jstrategy._src.validation import check_row_shape
from jstrategy._src.validation import is_int

__all__ = ["Model"]


@register_saveable(kind="model")
class Model(SavingMixin, CustomLoopMixin):
    """A Keras-like model around a Flax module (linen or NNX), trained by a strategy.

    Create it inside ``strategy.scope()``: it captures `jstrategy.get_strategy()` and
    keeps its variables as that strategy places them (one copy per replica for
    `MirroredStrategy`). Then `compile`, `fit`, `evaluate` and `predict` as in Keras.

    ``jstrategy.Model(inputs, outputs)`` is Keras's functional API instead: a model of
    `jstrategy.layers` called on `jstrategy.Input` tensors (several inputs and outputs,
    shared layers), with this same surface (`jstrategy._src.training.functional`).

    Args:
      module: a `flax.linen.Module` (initialized here, from `input_shape` or the first
        data) or an initialized `flax.nnx.Module`.
      input_shape: the shape of one input row, without the batch axis, e.g. ``(10,)``;
        None to build from the first data the model sees.
      input_dtype: the dtype of the sample input used to initialize the module.
      seed: seeds shuffling and, for linen modules, parameter initialization and dropout
        (an NNX module brings its own ``nnx.Rngs``); the same seed gives the same run.
        None: the seed of `jstrategy.utils.set_random_seed`, else 0.
      name: the name shown by `summary`; defaults to the module's class name.
      train_arg: the linen module's training-mode keyword (``"train"``, ``"training"``,
        ``"deterministic"``), found in ``__call__``'s signature by default (``"auto"``).
      dtype_policy: the precision policy, as Keras's layer and model ``dtype`` argument: a
        `jstrategy.mixed_precision.Policy` or its name (``"mixed_bfloat16"``, ...); None
        means `jstrategy.mixed_precision.global_policy()`, read now. Variables (and the
        optimizer state) are kept in its variable dtype; training, evaluation and
        prediction run the module in its compute dtype, losses and metrics in float32. A
        float16 compute dtype adds dynamic loss scaling (`loss_scale`).

    Attributes:
      history: the `History` of the latest `fit`.

    Example:

    >>> import numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     model = jstrategy.Model(nn.Dense(1), input_shape=(3,))
    ...     model.compile(optax.sgd(0.1), loss="mse")
    >>> x, y = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
    >>> history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    >>> len(history.history["loss"]), model.predict(x, verbose=0).shape
    (2, (8, 1))
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Keras's functional API, ``Model(inputs, outputs)``, makes a `Functional` (as
        # ``keras.Model`` does); a module makes a Model of that module.
        # Found in the registry, where `Functional` registers itself (importing
        # jstrategy imports it): its module imports this one.
        functional = saveable_class("model", "Functional")
        if cls is Model and functional is not None and _is_functional_call(args, kwargs):
            return super().__new__(functional)
        return super().__new__(cls)

    def __init__(
        self,
        module: Any,
        input_shape: Sequence[int] | int | None = None,
        *,
        input_dtype: Any = jnp.float32,
        seed: int | None = None,
        name: str | None = None,
        train_arg: str | None = "auto",
        dtype_policy: mp.Policy | str | None = None,
    ):
        is_nnx = isinstance(module, nnx.Module)
        if not is_nnx and not hasattr(module, "init"):
            raise TypeError(
                f"`module` must be a flax.linen.Module or a flax.nnx.Module; got "
                f"{type(module).__name__} {module!r}."
            )
        seed = default_seed(seed)
        if not is_int(seed):
            raise TypeError(f"`seed` must be an int; got {seed!r}.")
        self.module = module
        self.name = name or type(module).__name__.lower()
        self._input_shape = (
            None if input_shape is None else check_row_shape(input_shape, "input_shape")
        )
        self._input_dtype = input_dtype
        self._train_arg = train_arg
        self._trainable = True
        self._layer_views: dict[tuple[str, ...], Any] = {}
        policy = mp.as_policy(dtype_policy, argument="dtype_policy")
        self._trainer = Trainer(get_strategy(), int(seed), policy)
        self._trainer.plan_reader = self._with_layer_plan
        self.history: History | None = None
        if is_nnx:
            state = create_nnx_train_state(
                module, optax.identity(), strategy=self.strategy, dtype_policy=policy
            )
            self._trainer.set_state(state)
        elif self._input_shape is not None and not self._compile_only():
            # A TPU topology's compile-only devices hold no variables: the model is
            # planned (`jstrategy.experimental.plan`) and summarized from its shapes.
            self._build(jnp.zeros((1, *self._input_shape), input_dtype))

    # Properties ---------------------------------------------------------------------------
    @classmethod
    def _from_saved(cls, config: dict[str, Any], module: Any, path: str) -> Model:
        """The model a saved config describes, around `module` (how `load_model` builds a
        saved ``"Model"``; `Sequential` builds its own)."""
        if module is None:
            raise ValueError(
                f"The model saved in {path} is a jstrategy.Model of a {config.get('module')} "
                "module, whose code is not saved. Pass the module: load_model(path, module)."
            )
        input_shape = config["input_shape"]
        return Model(
            module,
            None if input_shape is None else tuple(input_shape),
            input_dtype=np.dtype(config["input_dtype"]),
            seed=int(config["seed"]),
            name=config["name"],
            train_arg=config["train_arg"],
            dtype_policy=config.get("dtype_policy", "float32"),
        )

    @property
    def strategy(self) -> Strategy:
        """The strategy captured when the model was created."""
        return self._trainer.strategy

    @property
    def trainable(self) -> bool:
        """Keras's ``model.trainable``: False freezes every parameter.

        Read, with the ``trainable`` flags of the `jstrategy.layers` the module holds and
        their weight constraints, when the model is compiled (and by the first `fit` after
        it): as in Keras, set it, then ``compile``. A change after the model trained,
        without compiling again, raises at `fit`.
        """
        return self._trainable

    @trainable.setter
    def trainable(self, value: bool) -> None:
        self._trainable = check_bool(value, "trainable")

    def _with_layer_plan(self, state: Any) -> Any:
        """`state` with what the layers say about training now (`trainable.py`)."""
        layers = self._user_layers()
        self._trainer.plan_seen = trainable_lib.fingerprint(self.module, self._trainable, layers)
        return trainable_lib.with_current_plan(
            state, self.module, self._sample_row(), self._trainable, self.strategy, layers
        )

    @property
    def dtype_policy(self) -> mp.Policy:
        """The precision policy (`jstrategy.mixed_precision.Policy`) the model runs under."""
        return self._trainer.policy

    @property
    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (float16 compute), or None without loss scaling.

        TF's ``LossScaleOptimizer.loss_scale``, read from the train state (a host read).
        The whole `jstrategy.mixed_precision.DynamicLossScale`, with its count of finite
        steps, is ``model.state.loss_scale``; checkpoints save it with the state.
        """
        loss_scale = self.state.loss_scale
        return None if loss_scale is None else float(loss_scale.loss_scale)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Batches per optimizer update, as given to `compile` (1 before it)."""
        spec = self._trainer.spec
        return 1 if spec is None else spec.accumulation_steps

    @property
    def sync_batch_norm(self) -> BatchNormSync:
        """The rows BatchNorm normalizes over in training, as given to `compile`."""
        spec = self._trainer.spec
        return BatchNormSync.GLOBAL if spec is None else spec.sync_batch_norm

    @property
    def built(self) -> bool:
        """Whether the variables exist (after `input_shape` or the first data)."""
        return self._trainer.state is not None

    @property
    def compiled(self) -> bool:
        """Whether `compile` has been called."""
        return self._trainer.spec is not None

    @property
    def state(self) -> Any:
        """The train state (`TrainState` or `NNXTrainState`), placed by the strategy."""
        self._trainer.require_state("state")
        return self._trainer.state

    @property
    def variables(self) -> Any:
        """The Flax variables as placed by the strategy.

        For linen, ``{"params": ..., "batch_stats": ...}`` (the latter if any); for NNX,
        the module's `nnx.State` (parameters and other variables).
        """
        return self.state.variables

    @property
    def optimizer(self) -> Any:
        """The compiled optimizer: a `jstrategy.optimizers` object (also for a name given to
        `compile`, as in Keras), or the optax transformation `compile` got."""
        return self._trainer.optimizer

    def _compiled(self, field: str, default: Any) -> Any:
        """`field` of the compiled step's `StepSpec`, or `default` before `compile`."""
        spec = self._trainer.spec
        return default if spec is None else getattr(spec, field)

    @property
    def loss(self) -> Any:
        """The compiled `jstrategy.losses.Loss`."""
        return self._compiled("loss", None)

    @property
    def metrics(self) -> list[Any]:
        """The compiled metrics (`jstrategy.metrics.Metric` objects)."""
        return [m for _, m in self._compiled("metrics", ())]

    @property
    def weighted_metrics(self) -> list[Any]:
        """The compiled weighted metrics (`compile`'s ``weighted_metrics``)."""
        return [m for _, m in self._compiled("weighted_metrics", ())]

    @property
    def remat(self) -> Any:
        """The checkpoint policy `compile`'s ``remat`` resolved to, or None."""
        return self._compiled("remat", None)

    @property
    def metrics_names(self) -> list[str]:
        """The keys of the logs: ``"loss"`` then each metric's name."""
        return list(self._compiled("names", ()))

    @property
    def steps_per_execution(self) -> int:
        """How many training steps each dispatched program runs."""
        return self._trainer.steps_per_execution

    @property
    def stop_training(self) -> bool:
        """Set to True (e.g. by `EarlyStopping`) to end `fit` after the current step."""
        return self._trainer.stop_training

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        self._trainer.stop_training = bool(value)

    @property
    def fit_state(self) -> FitState | None:
        """Where `fit` is, while it runs (else None): the epoch, the step within it, and
        what callbacks save and restore (`FitState.checkpoint_tree`, `restore_backup`)."""
        return self._trainer.fit_state

    @property
    def learning_rate(self) -> float:
        """The learning rate the next step applies, read from and written to the optimizer
        state (nothing is recompiled when it changes).

        `jstrategy.optimizers` objects (also optimizers given by name) and optax
        transformations built with ``optax.inject_hyperparams`` (e.g.
        ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``) keep their rate in
        their state. A schedule sets the rate from the step count: it is read, not set.

        Raises:
          RuntimeError: before `compile`.
          TypeError: for a plain optax transformation (``optax.sgd(0.1)``), whose rate is
            fixed inside it (the message shows the fix), or when setting a scheduled rate.
        """
        return self._trainer.get_learning_rate()

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._trainer.set_learning_rate(value)

    def get_config(self) -> dict[str, Any]:
        """How to create this model again, besides its module (Keras's ``get_config``).

        Returns:
          `Model`'s arguments as JSON types: ``name``, ``input_shape`` (None if built from
          data), ``input_dtype``, ``seed``, ``train_arg`` and ``dtype_policy`` (its name).

        Example:

        >>> import flax.linen as nn, jstrategy
        >>> jstrategy.Model(nn.Dense(2), input_shape=(3,), seed=1).get_config()["input_shape"]
        [3]
        """
        shape = self._input_shape
        return {
            "name": self.name,
            "input_shape": None if shape is None else list(shape),
            "input_dtype": np.dtype(self._input_dtype).name,
            "seed": self._trainer.seed,
            "train_arg": self._train_arg,
            "dtype_policy": self.dtype_policy.name,
        }

    # Building and compiling -----------------------------------------------------------
    def _build(self, sample_x: Any) -> None:
        trainer = self._trainer
        state = create_train_state(
            self.module,
            trainer.initial_tx(),
            sample_x,
            rng=trainer.seed,
            strategy=self.strategy,
            train_arg=self._train_arg,
            dtype_policy=trainer.policy,
        )
        trainer.set_state(state)

    def compile(
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Sequence[Any] | None = None,
        steps_per_execution: int = 1,
        gradient_accumulation_steps: int = 1,
        weighted_metrics: Sequence[Any] | None = None,
        sync_batch_norm: BatchNormSync | str = BatchNormSync.GLOBAL,
        *,
        remat: Any = None,
        loss_weights: Any = None,
        run_eagerly: bool = False,
        jit_compile: bool | str = "auto",
        auto_scale_loss: bool = True,
    ) -> None:
        """Configures training, as Keras's ``compile``.

        Compiling again keeps the variables and starts a fresh optimizer state.

        Args:
          optimizer: a `jstrategy.optimizers` object (e.g. ``SGD(learning_rate=0.1,
            momentum=0.9)``), a Keras name (``"sgd"``, ``"adam"``, ``"adamw"``,
            ``"rmsprop"``, ``"adagrad"``, ``"adadelta"``, ``"adamax"``, ``"nadam"``,
            ``"lion"``: that object with Keras's defaults), or an optax transformation (whose
            learning rate, unless made with ``optax.inject_hyperparams``, cannot be read or
            set: see `learning_rate`).
          loss: a loss name, a `jstrategy.losses` object or a callable ``(y_true, y_pred)
            -> losses`` (batch axis first, e.g. ``(b, t)`` per time step). The step
            computes Keras's ``"sum_over_batch_size"`` loss over the real rows of the
            global batch: each element's loss times its ``sample_weight`` (per row, or
            per element such as a ``(b, t)`` padding mask), summed and divided by the
            number of elements.
          metrics: metric names (``"accuracy"``, ``"mae"``, ...), `jstrategy.metrics`
            objects or callables returning values with the batch axis first; unweighted,
            as Keras's `metrics`.
          steps_per_execution: training steps fused into one dispatched program; larger
            values cut host overhead without changing the result.
          gradient_accumulation_steps: batches per optimizer update (Keras 3's optimizer
            argument of that name): k batches give the update of one k-times-larger batch,
            each real row weighing the same (a padded batch counts its real rows only).
            The sums live in the train state, so checkpoints and `BackupAndRestore` resume
            a cycle exactly; any ``steps_per_execution`` works with any k. ``fit``'s steps,
            ``steps_per_epoch`` and ``state.step`` count batches; the optimizer (and an
            optax schedule) counts updates.
          weighted_metrics: metrics (as `metrics`) weighted by the data's
            ``sample_weight``, as Keras's: ``sum(value * weight) / sum(weight)`` over the
            elements (a ``(b, t)`` weight weighs time steps); `metrics` ignore the weights.
            One named as a metric in `metrics` is logged as ``"weighted_" + name``.
          sync_batch_norm: which rows a BatchNorm built without ``axis_name`` (linen
            ``nn.BatchNorm``, ``nnx.BatchNorm``) normalizes over in training:
            ``"global"`` (the default) the global batch, as on one device, as Keras's
            ``BatchNormalization(synchronized=True)`` and Keras 3's JAX ``DataParallel``;
            ``"per_replica"`` each replica's rows, as TF's BatchNormalization under a
            ``tf.distribute`` strategy (the running statistics averaged over the
            replicas after each step). A `jstrategy.training.BatchNormSync` or its value.
            Dropout follows one device under every strategy either way.

          remat: rematerialization of the module's repeated blocks (those it wraps with
            `jstrategy.training.remat`), as `make_train_step`'s ``remat``: None or False
            (off), True, a ``jax.checkpoint_policies`` policy or its name.
          loss_weights: Keras's weights of a multi-output model's losses; only None
            (`compile` takes one loss over the module's whole output: weigh inside it).
          run_eagerly: Keras's eager mode; only False (every step is compiled).
          jit_compile: Keras's switch; ``"auto"`` or True (the steps are always compiled).
          auto_scale_loss: Keras's loss scaling under float16; True (the state gets a
            dynamic loss scale, as Keras's ``LossScaleOptimizer``), or False where the
            policy computes in another dtype (nothing to scale).

        Raises:
          ValueError: for a missing loss, unknown names, or a bad `steps_per_execution` or
            `gradient_accumulation_steps`, an unknown `sync_batch_norm`, a `remat` that
            is not a policy, or a Keras option that would mean something else here
            (`loss_weights`, ``run_eagerly=True``, ``jit_compile=False``,
            ``auto_scale_loss=False`` under float16): each message shows the fix.

        Example:

        >>> import flax.linen as nn
        >>> import jstrategy
        >>> model = jstrategy.Model(nn.Dense(3), input_shape=(4,))
        >>> model.compile("adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        >>> model.metrics_names, round(model.learning_rate, 6)
        (['loss', 'accuracy'], 0.001)
        """
        self._trainer.check_scope("compile")
        _check_keras_compile_options(
            loss_weights, run_eagerly, jit_compile, auto_scale_loss, self._trainer.policy
        )
        steps_per_execution = check_positive_int(
            steps_per_execution,
            "steps_per_execution",
            "1 dispatches every step; e.g. 8 fuses 8 steps into one program.",
        )
        spec = step_lib.make_spec(
            step_lib.resolve_loss(loss),
            metrics,
            self.strategy,
            dtype_policy=self._trainer.policy,
            gradient_accumulation_steps=gradient_accumulation_steps,
            weighted_metrics=weighted_metrics,
            sync_batch_norm=sync_batch_norm,
            remat=remat,
        )
        self._trainer.compile(optimizer, spec, steps_per_execution)

    def _ensure_ready(self, x_sample: Any = None, *, training: bool) -> None:
        if x_sample is not None and not self.built:
            self._build(jax.tree.map(lambda a: np.asarray(a[:1]), x_sample))
        self._trainer.ready(training=training)

    def summary(self, print_fn: Callable[[str], Any] | None = None) -> None:
        """Prints a Keras-like table of the module's layers, output shapes and parameters.

        Args:
          print_fn: called with the table; defaults to `print`.

        Example:

        >>> import flax.linen as nn
        >>> import jstrategy
        >>> model = jstrategy.Model(nn.Sequential([nn.Dense(4), nn.Dense(1)]), input_shape=(3,))
        >>> model.summary()  # doctest: +ELLIPSIS
        Model: "sequential"
        ...
        Total params: 21 (84.00 B)
        ...
        """
        state = self._trainer.state
        if state is None and self._input_shape is not None and self._compile_only():
            state = self._state_shapes()
        else:
            state = self.state
        # The layers' trainable flags as they are now, as Keras's summary counts them.
        state = trainable_lib.with_current_plan(
            state, self.module, self._sample_row(), self._trainable, None, self._user_layers()
        )
        table = summary_lib.model_table(
            state, self.module, self._input_shape, self._input_dtype, self.name
        )
        (print_fn or print)(table)

    @property
    def layers(self) -> list[Any]:
        """The module's direct submodules, in the order the model calls them (Keras's
        ``layers``; for NNX, its child modules). Each call gives the same objects, so
        ``model.layers[0].trainable = False`` freezes that layer at the next `compile`,
        as in Keras.

        Example:

        >>> import flax.linen as nn, jstrategy
        >>> model = jstrategy.Model(nn.Sequential([nn.Dense(4), nn.Dense(1)]), input_shape=(3,))
        >>> [type(layer).__name__ for layer in model.layers]
        ['Dense', 'Dense']
        """
        found = summary_lib.direct_layers(self.state, self.module, self._sample_row())
        if isinstance(self.module, nnx.Module):
            return found
        # The same objects at each call: a flag set on one (``model.layers[0].trainable =
        # False``) is read at the next compile (`_user_layers`).
        return [self._layer_views.setdefault((layer.name,), layer) for layer in found]

    def _user_layers(self) -> dict[tuple[str, ...], Any]:
        """The layer objects a user holds, by path: `layers`' (read by the layer plan)."""
        return dict(self._layer_views)

    def count_params(self) -> int:
        """The number of scalars in the model's floating-point variables, trained or not
        (Keras's ``count_params``: the summary's "Total params").

        Example:

        >>> import flax.linen as nn, jstrategy
        >>> jstrategy.Model(nn.Dense(4), input_shape=(3,)).count_params()
        16
        """
        return summary_lib.count_params(self.state.variables)

    def _compile_only(self) -> bool:
        """Whether the strategy's devices can only be compiled for (`topology_devices`)."""
        mesh = getattr(self.strategy, "mesh", None)
        return mesh is not None and devices_lib.compile_only(mesh.devices.flat[0])

    def _state_shapes(self) -> Any:
        """The train state's shapes, placed as the strategy would, without creating it."""
        trainer = self._trainer
        return train_state_shapes(
            self.module,
            trainer.initial_tx(),
            self._sample_row(),
            rng=trainer.seed,
            strategy=self.strategy,
            train_arg=self._train_arg,
            dtype_policy=trainer.policy,
        )

    def _sample_row(self) -> Any:
        shape = self._input_shape
        return None if shape is None else jax.ShapeDtypeStruct((1, *shape), self._input_dtype)

    # Data ---------------------------------------------------------------------------------
    def _adapter(
        self, x: Any, y: Any, w: Any, *, labels_for: str | None = None, **kwargs: Any
    ) -> data_adapters.DataAdapter:
        """The adapter of the data `x`, `y`, `w` (building the model from its first `x`); a
        call that needs labels (`labels_for`, how to pass them) refuses arrays without."""
        if labels_for is not None and data_adapters.is_array_tree(x) and y is None:
            raise ValueError(f"`y` is required when `x` holds arrays; pass {labels_for}.")
        adapter = data_adapters.make_adapter(
            self.strategy, x, y, w, seed=self._trainer.seed, **kwargs
        )
        if not self.built:
            sample = adapter.first_x()
            if self._input_shape is None and data_adapters.is_array(sample):
                self._input_shape = tuple(sample.shape[1:])
                self._input_dtype = jax.dtypes.canonicalize_dtype(sample.dtype)
            self._ensure_ready(sample, training=False)
        elif isinstance(adapter, data_adapters.ArrayAdapter):
            input_checks.check_row_shape(self._input_shape, adapter.data[0], kwargs["arg"])
        return adapter

    def _check_labels(self, data: data_adapters.DataAdapter, arg: str) -> None:
        if isinstance(data, data_adapters.ArrayAdapter):
            trainer = self._trainer
            input_checks.check_class_labels(
                trainer.compiled_spec.functions,
                trainer.state,
                data,
                arg=arg,
                cache=trainer.class_counts,
            )

    def _callbacks(self, callbacks: Any, verbose: Any, **params: Any) -> Any:
        return CallbackList(
            callbacks, model=self, add_progbar=verbose != 0, verbose=verbose, **params
        )

    # fit, evaluate, predict ---------------------------------------------------------------
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: int | str = "auto",
        callbacks: Sequence[Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        sample_weight: Any = None,
        class_weight: dict[int, float] | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | Sequence[int] = 1,
    ) -> History:
        """Trains the model, as Keras's ``fit``.

        Args:
          x: inputs: arrays (or a dict/tuple of arrays), or a dataset: an iterable of
            ``(x, y)`` / ``(x, y, sample_weight)`` batches, or a distributed dataset.
          y: targets, for array inputs.
          batch_size: the global batch size for array inputs (default 32); the last batch
            may be partial (it is padded and masked, never dropped).
          epochs: the index of the last epoch to train.
          verbose: 0 silent, 1 progress bar, 2 one line per epoch, ``"auto"`` 1 in a
            terminal and 2 elsewhere.
          callbacks: `jstrategy.callbacks.Callback` objects, called in order.
          validation_split: the fraction of array data, taken from the end before
            shuffling, held out for validation.
          validation_data: ``(x_val, y_val)`` arrays or a dataset, evaluated after each
            epoch (``val_``-prefixed logs).
          shuffle: whether to shuffle array data each epoch (seeded by the model's seed).
          initial_epoch: the epoch to start at (to resume training). A
            `jstrategy.callbacks.BackupAndRestore` backup overrides it: training resumes
            at the backup's epoch and step, with the same data order.
          steps_per_epoch: steps per epoch; for datasets, batches are drawn from one
            iterator that continues across epochs (restarted when exhausted).
          sample_weight: per-example weights for array inputs.
          class_weight: ``{class index: weight}`` for array inputs, as Keras: each training
            row's weight is the weight of its label (the label itself, or the argmax of a
            one-hot label; classes not named weigh 1). Not with `sample_weight`; not
            applied to validation data.
          validation_steps: the number of validation batches evaluated after each epoch
            (default: all of them).
          validation_batch_size: the batch size of array validation data (default: the
            training `batch_size`).
          validation_freq: as Keras: validate after every N-th epoch (an int), or after
            the epochs listed (1-based, a list of ints).

        Returns:
          The `History` of the run.

        Raises:
          RuntimeError: if the model is not compiled.
          ValueError: for inconsistent arguments or data.
        """
        self._trainer.check_scope("fit")
        epochs = check_non_negative_int(epochs, "epochs")
        initial_epoch = check_non_negative_int(initial_epoch, "initial_epoch")
        if steps_per_epoch is not None:
            check_positive_int(steps_per_epoch, "steps_per_epoch", "Pass None for whole epochs.")
        if validation_steps is not None:
            check_positive_int(
                validation_steps, "validation_steps", "Pass None for every validation batch."
            )
        validate = _validation_epochs(validation_freq)
        x, y = data_adapters.as_arrays(x), data_adapters.as_arrays(y)
        sample_weight = data_adapters.as_arrays(sample_weight)
        x, y, sample_weight, validation_data = data_adapters.split_validation(
            x, y, sample_weight, validation_split, validation_data
        )
        if class_weight is not None:
            sample_weight = data_adapters.class_weight_to_sample_weight(
                x, y, sample_weight, class_weight
            )
        data = self._adapter(
            x,
            y,
            sample_weight,
            labels_for="fit(x, y, ...)",
            batch_size=batch_size,
            shuffle=shuffle,
            steps=steps_per_epoch,
            arg="x",
        )
        self._ensure_ready(training=True)
        self._trainer.follow_layer_changes(
            trainable_lib.fingerprint(self.module, self._trainable, self._user_layers())
        )
        self._trainer.stepped = True
        self._check_labels(data, "x")
        val_data = None
        if validation_data is not None:
            vbatch = batch_size if validation_batch_size is None else validation_batch_size
            vx, vy, vw, vbatch = data_adapters.validation_inputs(validation_data, vbatch)
            if validation_batch_size is not None and vy is None:
                raise ValueError(
                    f"`validation_batch_size` ({validation_batch_size!r}) is for array "
                    "validation data; a validation dataset's batches have their size. Drop "
                    "validation_batch_size, or batch the dataset with it."
                )
            val_data = self._adapter(
                vx,
                vy,
                vw,
                batch_size=vbatch,
                shuffle=False,
                steps=validation_steps,
                arg="validation_data",
                bucket_batch=True,
            )
            self._check_labels(val_data, "validation_data")
        cbs = self._callbacks(
            callbacks,
            verbose,
            add_history=True,
            epochs=epochs,
            steps=data.epoch_steps(steps_per_epoch),
        )
        self.history = fit_loop.fit(
            self._trainer,
            data,
            val_data,
            cbs,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validate=validate,
        )
        self.state.write_back(self.module)
        return self.history

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """Computes the loss and metrics over data, as Keras's ``evaluate``.

        Every real row counts once: the partial last batch is padded and masked.

        Args:
          x: inputs (arrays) or a dataset of ``(x, y)`` batches.
          y: targets, for array inputs.
          batch_size: the global batch size for arrays (default 32). Each batch is
            padded (and masked) to one of a few sizes, so that calls with many batch sizes
            (a serving loop's ``batch_size=len(x)``) share a few compiled programs.
          verbose: 0, 1, 2 or ``"auto"``, as in `fit`.
          sample_weight: per-example weights for array inputs.
          steps: for datasets, how many batches to evaluate (default: all).
          callbacks: callbacks whose ``on_test_*`` hooks are called.
          return_dict: return ``{name: value}`` instead of a list.

        Returns:
          The loss (a float) when there are no metrics, else ``[loss, *metrics]``; or the
          dict with `return_dict`.
        """
        self._trainer.check_scope("evaluate")
        data = self._adapter(
            x,
            y,
            sample_weight,
            labels_for="evaluate(x, y)",
            batch_size=batch_size,
            shuffle=False,
            steps=steps,
            arg="x",
            bucket_batch=True,
        )
        self._ensure_ready(training=True)
        self._check_labels(data, "x")
        cbs = self._callbacks(callbacks, verbose, steps=data.steps)
        result = fit_loop.evaluate(self._trainer, data, cbs)
        if return_dict:
            return result
        values = [result[name] for name in self.metrics_names]
        return values[0] if len(values) == 1 else values

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
    ) -> Any:
        """The model's outputs (inference mode), one row for each input row.

        Args:
          x: inputs (arrays) or a dataset of batches (``x`` or ``(x, ...)``).
          batch_size: the global batch size for arrays (default 32). Each batch is
            padded (and masked) to one of a few sizes, so that calls with many batch sizes
            (a serving loop's ``batch_size=len(x)``) share a few compiled programs.
          verbose: 0, 1, 2 or ``"auto"``, as in `fit`.
          steps: for datasets, how many batches to predict (default: all).
          callbacks: callbacks whose ``on_predict_*`` hooks are called.

        Returns:
          NumPy arrays (a pytree, as the module returns) with one row per input row.
        """
        self._trainer.check_scope("predict")
        data = self._adapter(
            x,
            None,
            None,
            batch_size=batch_size,
            shuffle=False,
            steps=steps,
            arg="x",
            bucket_batch=True,
        )
        self._ensure_ready(training=False)
        cbs = self._callbacks(callbacks, verbose, steps=data.steps)
        return fit_loop.predict(self._trainer, data, cbs)

    def __repr__(self) -> str:
        return f"Model(name={self.name!r}, strategy={self.strategy!r}, built={self.built})"


def _check_keras_compile_options(
    loss_weights: Any, run_eagerly: Any, jit_compile: Any, auto_scale_loss: Any, policy: mp.Policy
) -> None:
    """Keras 3's `compile` options that exist here only as what jstrategy always does:
    anything else would silently mean something else, so it is an error with the fix."""
    if loss_weights is not None:
        raise ValueError(
            f"`loss_weights` weighs the losses of a multi-output Keras model; got "
            f"{loss_weights!r}, but this model's compile takes one loss over the module's "
            "whole output (a dict or tuple output goes to one loss function). Build the "
            "model with Keras's functional API, jstrategy.Model(inputs, outputs), whose "
            "compile takes a loss per output and loss_weights; or weigh inside the loss: "
            "loss=lambda y, p: 0.7 * loss_a(y['a'], p['a']) + 0.3 * loss_b(y['b'], p['b']) "
            "(a def, to save the model), and pass loss_weights=None."
        )
    if run_eagerly is not False:
        raise ValueError(
            f"`run_eagerly` must be False: every jstrategy step is one compiled program over "
            f"the strategy's devices; got {run_eagerly!r}. To look inside the model, use "
            "jax.debug.print or jax.debug.breakpoint in its __call__ (they run in the "
            "compiled step), or call module.apply(variables, x) on a batch outside fit."
        )
    if jit_compile not in (True, "auto"):
        raise ValueError(
            f"`jit_compile` must be 'auto' or True: jstrategy's steps are always compiled "
            f"with XLA; got {jit_compile!r}. Drop the argument (see run_eagerly's message "
            "for debugging inside the step)."
        )
    if auto_scale_loss not in (True, False):
        raise ValueError(f"`auto_scale_loss` must be True or False; got {auto_scale_loss!r}.")
    if not auto_scale_loss and policy.compute_dtype == "float16":
        raise ValueError(
            f"`auto_scale_loss=False` under the {policy.name!r} policy: float16 gradients "
            "underflow without loss scaling, so jstrategy always scales the loss under a "
            "float16 compute dtype (Keras's LossScaleOptimizer). Keep auto_scale_loss=True, "
            "or train with dtype_policy='mixed_bfloat16', which needs no loss scale."
        )


def _is_functional_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Model(*args, **kwargs)`` is Keras's ``Model(inputs, outputs)``: inputs
    by keyword, or symbolic tensors (or a list/dict of them) first."""
    if "inputs" in kwargs or "outputs" in kwargs:
        return True
    if not args:
        return False
    leaves = jax.tree.leaves(args[0], is_leaf=lambda v: not isinstance(v, (list, tuple, dict)))
    return bool(leaves) and all(isinstance(leaf, KerasTensor) for leaf in leaves)


def _validation_epochs(validation_freq: Any) -> Callable[[int], bool]:
    """Keras's ``validation_freq``: whether to validate after (0-based) epoch ``e``."""
    if is_int(validation_freq) and validation_freq >= 1:
        return lambda epoch: (epoch + 1) % validation_freq == 0
    if isinstance(validation_freq, (list, tuple)) and all(
        is_int(e) and e >= 1 for e in validation_freq
    ):
        chosen = frozenset(validation_freq)
        return lambda epoch: epoch + 1 in chosen
    raise ValueError(
        f"`validation_freq` must be a positive int (validate every N-th epoch) or a list "
        f"of epochs counted from 1 (e.g. [1, 5, 10]); got {validation_freq!r}."
    )


# Every model class a saved config names derives from Model (checked as it registers).
register_kind("model", Model)
