"""The step factory: compiled, strategy-aware train, eval and predict steps for Flax.

`make_train_step` and friends wrap the one step body (`step.py`) in the programs the
strategy stages (`Strategy.stage_train_step`): for most strategies ONE compiled SPMD
program, ``jax.jit(jax.shard_map(...))`` over the strategy's mesh, with the train state
replicated (in_specs ``P()``) and donated and each replica seeing its slice of the global
batch. They work for linen (`TrainState`) and NNX (`NNXTrainState`) alike, through
`TrainStateProtocol`. Every call goes through `dispatch.track`, so a loop of steps never
queues more than a few programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jstrategy._src import dispatch
from jstrategy._src.context_parallel.axis import batch_shardings
from jstrategy._src.input.placement import is_full_mask
from jstrategy._src.placement import check_placed
from jstrategy._src.precision import policy as mp
from jstrategy._src.strategy import get_strategy
from jstrategy._src.training import data_adapters
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.training.state.train_state import TrainStateProtocol
from jstrategy._src.training.state.train_state import as_train_state
from jstrategy._src.training.step import body as step_lib
from jstrategy._src.training.step import check_numerics
from jstrategy._src.values import PerReplica

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "EvalStep",
    "PredictStep",
    "TrainStep",
    "make_eval_step",
    "make_predict_step",
    "make_train_step",
]


def _check_not_spent(state: Any, leaves: list[Any]) -> None:
    """Refuses a state that an earlier train step was given, and so donated, before its
    program runs: JAX would raise "Array has been deleted", or, with the earlier step still
    running, hang a multi-device program on the buffers it deleted."""
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        return
    spent = [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if isinstance(x, jax.Array) and x.is_deleted()
    ]
    raise ValueError(
        f"`state` holds arrays that an earlier train step deleted ({len(spent)} of its "
        f"{len(leaves)} leaves, e.g. {spent[0]}): a train step donates the state it is "
        "given (the new state reuses its buffers), so a state passed to one is spent. Pass "
        "the state that step returned (`state, metrics = train_step(state, batch)`); to keep "
        "a state past the next step, copy it before that step: `kept = jax.tree.map(lambda "
        "a: a.copy(), state)`."
    )


class _Step:
    _what = "step"
    # Whether host arrays are placed with their sequences split over a context axis (a
    # train step's); evaluation and prediction read whole sequences.
    _split_sequences = False

    def __init__(self, spec: step_lib.StepSpec):
        self._spec = spec
        self._checked: set[Any] = set()
        self._calls = 0
        self._watch = check_numerics.Watch(spec, "call number", f" of this {self._what}")

    def _watched(self, logs: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The logs without the numerics counts, which the watch checks once ready."""
        self._calls += 1
        return self._watch.add(logs, self._calls)

    @property
    def strategy(self) -> Strategy:
        """The strategy the step runs on."""
        return self._spec.strategy

    def _prepare(self, state: TrainStateProtocol) -> TrainStateProtocol:
        """The state as this step's program takes it (a train step adds what it keeps)."""
        return state

    def _inputs(self, state: Any, batch: Any) -> tuple[TrainStateProtocol, Any, Any]:
        strategy = self._spec.strategy
        state = as_train_state(state)
        leaves, key = jax.tree.flatten(state)
        _check_not_spent(state, leaves)
        state = self._prepare(state)
        if key not in self._checked:
            check_placed(state, strategy)
            self._checked.add(key)
        values, mask = data_adapters.split_batch(batch, strategy)
        # Host arrays split by rows over the replicas, as a distributed batch is: a step
        # in the global view (FSDP, ModelParallel) would otherwise take them whole on
        # every device (up to a quarter more memory at its peak). A train step's also
        # along their sequence over a context axis, as a distributed batch's are.
        if self._split_sequences:
            shardings = batch_shardings(strategy, values)
        else:
            shardings = jax.tree.map(lambda _: strategy.batch_sharding(), values)
        values = jax.tree.map(
            lambda v, s: jax.device_put(v, s) if isinstance(v, np.ndarray) and v.ndim else v,
            values,
            shardings,
        )
        # A batch without padding (arrays, or a distributed batch whose mask is all true)
        # runs the program for full batches, which reads no mask (`body.row_weights`).
        if is_full_mask(mask):
            mask = None
        return state, values, mask


class TrainStep(_Step):
    """``train_step(state, batch) -> (state, metrics)``; see `make_train_step`.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn, jstrategy
    >>> from jstrategy.training import TrainStep, create_train_state, make_train_step
    >>> with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
    ...     state = create_train_state(nn.Dense(1), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     step = make_train_step("mse")
    >>> state, metrics = step(state, (np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32)))
    >>> isinstance(step, TrainStep), int(state.step)
    (True, 1)
    """

    _what = "train step"
    _split_sequences = True

    def __init__(self, spec: step_lib.StepSpec):
        super().__init__(spec)
        self._program = step_lib.build_train_program(spec)

    def prepare_state(self, state: Any) -> Any:
        """`state` with what this step keeps in it: the state the step returns looks like it.

        The step adds them itself on its first call, so a plain loop needs nothing; call
        this to build the target a checkpoint is restored into (a loss scale for float16
        compute, gradient accumulators for ``gradient_accumulation_steps`` > 1).

        Raises:
          ValueError: if `state` holds gradient accumulators and this step does not
            accumulate.
        """
        return step_lib.prepare_state(self._spec, as_train_state(state))

    def _prepare(self, state: TrainStateProtocol) -> TrainStateProtocol:
        return step_lib.prepare_state(self._spec, state)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        """Runs one step: returns the new state and ``{"loss": ..., metric: ...}``.

        The input state is donated: its arrays are deleted once the step runs (see
        `make_train_step`), so use the state returned, or a copy made before the call.

        Raises:
          ValueError: if `state` was given to an earlier train step (its arrays deleted).
        """
        state, values, mask = self._inputs(state, batch)
        state, _, logs = self._program(state, None, values, mask)
        dispatch.track(logs)
        return state, self._watched(logs)

    def lower(self, state: Any, batch: Any) -> Any:
        """The lowered program (``jax.stages.Lowered``) for inspecting its HLO.

        For a strategy that stages the update apart (`CentralStorageStrategy`), the
        gradient program, which holds the cross-device communication.
        """
        state, values, mask = self._inputs(state, batch)
        return self._program.lower(state, None, values, mask)


class EvalStep(_Step):
    """``eval_step(state, batch) -> metrics``; see `make_eval_step`.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn, jstrategy
    >>> from jstrategy.training import EvalStep, create_train_state, make_eval_step
    >>> with jstrategy.OneDeviceStrategy("cpu:0").scope():
    ...     state = create_train_state(nn.Dense(1), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     evaluate = make_eval_step("mse")
    >>> isinstance(evaluate, EvalStep), sorted(evaluate(state, (np.ones((2, 3)), np.zeros((2, 1)))))
    (True, ['loss'])
    """

    _what = "evaluation step"

    def __init__(self, spec: step_lib.StepSpec):
        super().__init__(spec)
        self._program = step_lib.build_eval_program(spec)

    def __call__(self, state: Any, batch: Any) -> dict[str, jax.Array]:
        """Evaluates one batch: ``{"loss": ..., metric: ...}``, means over its real rows.

        Raises:
          ValueError: if `state` was given to a train step since (its arrays deleted).
        """
        state, values, mask = self._inputs(state, batch)
        _, logs = self._program(state, None, values, mask)
        dispatch.track(logs)
        return self._watched(logs)


class PredictStep(_Step):
    """``predict_step(state, x) -> PerReplica``; see `make_predict_step`.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn, jstrategy
    >>> from jstrategy.training import PredictStep, create_train_state, make_predict_step
    >>> with jstrategy.OneDeviceStrategy("cpu:0").scope():
    ...     state = create_train_state(nn.Dense(2), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     predict = make_predict_step()
    >>> isinstance(predict, PredictStep), predict(state, np.ones((5, 3), np.float32)).value.shape
    (True, (5, 2))
    """

    def __init__(self, spec: step_lib.StepSpec):
        super().__init__(spec)
        self._program = step_lib.build_predict_program(spec.strategy, spec.policy)

    def __call__(self, state: Any, x: Any) -> Any:
        """The model's outputs for the inputs `x` (a distributed or global batch of inputs).

        Returns:
          A pytree of split `PerReplica` values (global arrays, row i for input row i),
          carrying the input's row mask so padding rows can be dropped.

        Raises:
          ValueError: if `state` was given to a train step since (its arrays deleted).
        """
        state, values, mask = self._inputs(state, (x,))
        y_pred = self._program(state, values[0])
        dispatch.track(y_pred)
        return jax.tree.map(lambda v: PerReplica(v, stacked=False, mask=mask), y_pred)


def _spec(loss: Any, metrics: Any, strategy: Strategy | None, **options: Any) -> step_lib.StepSpec:
    strategy = strategy if strategy is not None else get_strategy()
    return step_lib.make_spec(loss, metrics, strategy, **options)


def make_train_step(
    loss: Any,
    *,
    metrics: Sequence[Any] | None = None,
    strategy: Strategy | None = None,
    dtype_policy: mp.Policy | str | None = None,
    gradient_accumulation_steps: int = 1,
    sync_batch_norm: BatchNormSync | str = BatchNormSync.GLOBAL,
    remat: Any = None,
) -> TrainStep:
    """Builds ``train_step(state, batch) -> (state, metrics)``, one compiled SPMD program.

    Works for linen (`TrainState` from `create_train_state`) and NNX (`NNXTrainState` from
    `create_nnx_train_state`). There is no host synchronization inside, so calls dispatch
    asynchronously, and the step bounds the steps in flight itself (it waits for old steps
    once a few are queued), so a plain Python loop over thousands of steps is safe.

    **The state is donated**: the step writes the new state into the buffers of the one
    it is given, so no step holds two states in device memory, and the given state's
    arrays are deleted once the step runs. Reading one then raises JAX's ``RuntimeError:
    Array has been deleted``, and passing the state to a step again a `ValueError` that
    says so. Keep only the state a step returns (``state, metrics = train_step(state,
    batch)``). To keep a state past the next step (the best one so far, one to compare
    with), copy it before that step, each array where it lives (its layout and memory
    kind), so that a step takes the copy again: ``kept = jax.tree.map(lambda a: a.copy(),
    state)``. ``jax.device_get(state.params)``
    gives NumPy copies of the parameters (``jax.device_get`` leaves typed PRNG keys, which
    a state holds, device arrays).

    Each replica runs the model (training mode) on its rows, and the gradients of the
    mask-weighted loss sums are all-reduced with the strategy's `cross_device_ops`; the
    loss is the mean over the real rows of the global batch. The step follows
    `OneDeviceStrategy`'s for the same global batch on any mesh: Flax's Dropout layers
    (linen ``nn.Dropout``, ``nnx.Dropout``) keep their rows of the mask one device draws
    for the whole batch, and BatchNorm layers take their statistics over the global batch
    (see `sync_batch_norm`). Random numbers the model draws itself (``jax.random`` with
    ``make_rng``) use the same key on every replica.

    Under a precision policy other than ``"float32"`` the step casts the parameters and
    floating inputs to the compute dtype inside the differentiated function (gradients,
    parameters and optimizer state stay in the variable dtype) and the outputs to float32
    before the loss and metrics. When the state holds a loss scale (``state.loss_scale``;
    added for float16 compute), the loss is scaled before differentiating, the gradients
    unscaled, and a step whose gradients are not finite is skipped (the whole state kept)
    and the scale halved; it doubles after ``dynamic_growth_steps`` (2000) finite steps.

    With ``gradient_accumulation_steps=k``, the step adds each batch's gradient sums and
    count of real rows to accumulators in the state (``state.grad_accumulator``) and
    updates on every k-th batch with their mean: the update of one k-times-larger batch,
    padded rows excluded. ``state.step`` counts batches; the optimizer's own count, which
    drives optax schedules, counts updates.

    Args:
      loss: a per-example loss: a name (``"mse"``, ...), a `jstrategy.losses` object, or
        a callable ``(y_true, y_pred) -> (batch,)`` values.
      metrics: names, `jstrategy.metrics` objects or callables returning per-example values;
        each is reported as its mean over real rows.
      strategy: the strategy; None means `jstrategy.get_strategy()`.
      dtype_policy: a `jstrategy.mixed_precision.Policy` or its name; None means
        `jstrategy.mixed_precision.global_policy()` (read now). Create the state with the
        same policy (`create_train_state`'s ``dtype_policy``).
      gradient_accumulation_steps: batches (micro-batches) per optimizer update.
      sync_batch_norm: which rows a BatchNorm built without ``axis_name`` (linen
        ``nn.BatchNorm``, ``nnx.BatchNorm``) normalizes over: ``"global"`` (the default)
        the global batch, as on one device and as Keras's
        ``BatchNormalization(synchronized=True)``; ``"per_replica"`` each replica's rows,
        as TF's BatchNormalization under a strategy (its running statistics averaged over
        the replicas after the step). A `jstrategy.training.BatchNormSync` or its value.
      remat: rematerialization of the model's repeated blocks in the backward pass, to
        trade compute for memory: None or False (off, the default), True (recompute
        everything in each block: ``jax.checkpoint_policies.nothing_saveable``), a
        policy from ``jax.checkpoint_policies`` (e.g. ``dots_saveable``, or
        ``save_only_these_names(...)``) or the name of one (``"dots_saveable"``). It
        acts on the block classes the model wraps with `jstrategy.training.remat` in its
        ``__call__`` (e.g. before ``nn.scan``); a model that wraps none raises when the
        step is traced. The loss and gradients are the same as without.

    Returns:
      A `TrainStep`. Call it with the state and a batch ``(x, y)`` or ``(x, y,
      sample_weight)`` whose leaves are split `PerReplica` values (from a distributed
      dataset) or global arrays whose rows divide among the replicas. It returns the new
      state and ``{"loss": ..., name: ...}``, replicated scalars.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> from jstrategy.training import create_train_state
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     state = create_train_state(nn.Dense(1), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     step = make_train_step(lambda y, p: (y - p[:, 0]) ** 2)
    >>> x, y = np.ones((4, 3), np.float32), np.zeros(4, np.float32)
    >>> state, metrics = step(state, (x, y))
    >>> int(state.step), sorted(metrics)
    (1, ['loss'])

    The state given is spent; a copy made before the step is kept:

    >>> import jax
    >>> kept = jax.tree.map(lambda a: a.copy(), state)
    >>> new_state, _ = step(state, (x, y))
    >>> state.params["kernel"].is_deleted(), int(kept.step), int(new_state.step)
    (True, 1, 2)
    >>> step(state, (x, y))
    Traceback (most recent call last):
    ...
    ValueError: `state` holds arrays that an earlier train step deleted (...): a train step donates ...
    >>> int(step(kept, (x, y))[0].step)  # the copy trains on
    2
    """
    return TrainStep(
        _spec(
            loss,
            metrics,
            strategy,
            dtype_policy=dtype_policy,
            gradient_accumulation_steps=gradient_accumulation_steps,
            sync_batch_norm=sync_batch_norm,
            remat=remat,
        )
    )


def make_eval_step(
    loss: Any = None,
    *,
    metrics: Sequence[Any] | None = None,
    strategy: Strategy | None = None,
    dtype_policy: mp.Policy | str | None = None,
) -> EvalStep:
    """Builds ``eval_step(state, batch) -> metrics`` (inference mode, one compiled program).

    Args:
      loss: as in `make_train_step`, or None to report metrics only.
      metrics: as in `make_train_step`.
      strategy: the strategy; None means `jstrategy.get_strategy()`.
      dtype_policy: as in `make_train_step`: the model runs in its compute dtype, the
        loss and metrics in float32.

    Returns:
      An `EvalStep` returning ``{"loss": ..., name: ...}``: means over the batch's real rows.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> from jstrategy.training import create_train_state
    >>> with jstrategy.OneDeviceStrategy("cpu:0").scope():
    ...     state = create_train_state(nn.Dense(1), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     evaluate = make_eval_step(lambda y, p: jnp.abs(y - p[:, 0]))
    >>> sorted(evaluate(state, (np.ones((2, 3), np.float32), np.zeros(2, np.float32))))
    ['loss']
    """
    return EvalStep(_spec(loss, metrics, strategy, dtype_policy=dtype_policy))


def make_predict_step(
    *, strategy: Strategy | None = None, dtype_policy: mp.Policy | str | None = None
) -> PredictStep:
    """Builds ``predict_step(state, x) -> outputs`` (inference mode, one compiled program).

    Args:
      strategy: the strategy; None means `jstrategy.get_strategy()`.
      dtype_policy: as in `make_train_step`: the model runs in its compute dtype; under a
        policy other than ``"float32"`` floating outputs are returned in float32.

    Returns:
      A `PredictStep`; its outputs are split `PerReplica` values with the input's row mask.

    Example:

    >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> from jstrategy.training import create_train_state
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     state = create_train_state(nn.Dense(2), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     predict = make_predict_step()
    >>> predict(state, np.ones((4, 3), np.float32)).value.shape
    (4, 2)
    """
    return PredictStep(_spec(None, None, strategy, dtype_policy=dtype_policy))
