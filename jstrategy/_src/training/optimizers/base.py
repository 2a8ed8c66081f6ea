"""`Optimizer`: the base of the Keras-named optimizers, Keras 3's formulas over optax.

`jstrategy.optimizers.SGD(learning_rate=0.01, momentum=0.0, nesterov=False)`, `Adam`,
`AdamW`, `RMSprop`, `Adagrad`, `Adadelta`, `Adamax`, `Nadam` and `Lion` (one family a
file beside this one) take Keras 3's arguments and defaults and update as Keras 3 does
(`transform.py`: each class's `_rule` is its ``update_step``, e.g. SGD's momentum
accumulates ``v = m * v - lr * g``, so a changing rate scales only the new steps, not the
whole velocity as optax's trace does). The learning rate is a value in the optimizer state (``optax.inject_hyperparams``),
so `Model.learning_rate`, `LearningRateScheduler` and `ReduceLROnPlateau` read and set the
rate that is applied, without recompiling; a schedule (a
`jstrategy.optimizers.schedules` object or any ``step -> rate`` callable) sets it from
Keras's iteration count instead.

The same object is TF's optimizer in a custom loop: `Optimizer.apply_gradients` inside
`Strategy.run` sums per-replica gradients across replicas (TF's aggregation; gradients
already combined are used as they are), then updates the variables it is given (a
`jstrategy.Model`'s ``trainable_variables``) and its own slots, both threaded through
`run`'s compiled program (`tracked.py`). Outside `run` under a strategy it raises TF's
cross-replica error.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jstrategy._src import context
from jstrategy._src.names import snake_case
from jstrategy._src.placement import in_device_memory
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.registry import register_kind
from jstrategy._src.tracked import TrackedState
from jstrategy._src.tracked import TrainableHolder
from jstrategy._src.tracked import owner_of_trainable
from jstrategy._src.training.optimizers import learning_rate as learning_rate_lib
from jstrategy._src.training.optimizers import schedules as schedules_lib
from jstrategy._src.training.optimizers import transform as keras_transform
from jstrategy._src.validation import check_number
from jstrategy._src.validation import is_number
from jstrategy._src.values import local_copy
from jstrategy._src.values import varying_axes

__all__ = [
    "Optimizer",
    "cast_like",
    "ema_average",
    "injected_state",
]

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def injected_state(opt_state: Any) -> Any:
    """The ``inject_hyperparams`` state inside an optimizer state, if there is one."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _INJECTED))
        if isinstance(s, _INJECTED)
    ]
    return found[0] if len(found) == 1 else None


def _rate(value: Any) -> Any:
    if schedules_lib.is_schedule(value):
        return value
    if not is_number(value):
        raise ValueError(
            f"`learning_rate` must be a non-negative float or a schedule (a "
            f"jstrategy.optimizers.schedules object, or a callable step -> rate); got {value!r}."
        )
    return check_number(
        value, "learning_rate", low=0, finite=True, expected="a non-negative finite float"
    )


def _keras_options(
    *,
    weight_decay: Any,
    clipnorm: Any,
    clipvalue: Any,
    global_clipnorm: Any,
    use_ema: Any,
    ema_momentum: Any,
    ema_overwrite_frequency: Any,
    loss_scale_factor: Any,
    gradient_accumulation_steps: Any,
) -> keras_transform.KerasOptions:
    """Keras 3's ``BaseOptimizer.__init__`` checks, with its messages, then ours."""
    if gradient_accumulation_steps:
        ok = isinstance(gradient_accumulation_steps, int) and not isinstance(
            gradient_accumulation_steps, bool
        )
        if not ok or not gradient_accumulation_steps >= 2:
            raise ValueError(
                "`gradient_accumulation_steps` must be an integer >= 2. Received: "
                f"gradient_accumulation_steps={gradient_accumulation_steps}"
            )
    if use_ema:
        if not isinstance(ema_momentum, (int, float)) or not 0 <= ema_momentum <= 1:
            raise ValueError(
                f"`ema_momentum` must be in the range [0, 1]. Received: ema_momentum={ema_momentum}"
            )
        if ema_overwrite_frequency and (
            not isinstance(ema_overwrite_frequency, int) or ema_overwrite_frequency < 1
        ):
            raise ValueError(
                "`ema_overwrite_frequency` must be an integer >= 1 or None. Received: "
                f"ema_overwrite_frequency={ema_overwrite_frequency}"
            )
    if sum(a is not None for a in (clipnorm, clipvalue, global_clipnorm)) > 1:
        raise ValueError(
            "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. "
            f"Received: clipnorm={clipnorm}, clipvalue={clipvalue}, "
            f"global_clipnorm={global_clipnorm}"
        )
    return keras_transform.KerasOptions(
        weight_decay=None
        if weight_decay is None
        else check_number(weight_decay, "weight_decay", low=0),
        clipnorm=None
        if clipnorm is None
        else check_number(clipnorm, "clipnorm", low=0, low_open=True),
        clipvalue=None
        if clipvalue is None
        else check_number(clipvalue, "clipvalue", low=0, low_open=True),
        global_clipnorm=(
            None
            if global_clipnorm is None
            else check_number(global_clipnorm, "global_clipnorm", low=0, low_open=True)
        ),
        use_ema=bool(use_ema),
        ema_momentum=float(ema_momentum),
        ema_overwrite_frequency=ema_overwrite_frequency if use_ema else None,
        loss_scale_factor=(
            None
            if loss_scale_factor is None
            else check_number(loss_scale_factor, "loss_scale_factor", low=0, low_open=True)
        ),
        gradient_accumulation_steps=gradient_accumulation_steps or None,
    )


_BASE_ARGUMENTS = (
    "learning_rate",
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
    "name",
)


def _per_cycle(schedule: Callable[[Any], Any], micro_batches: int) -> Callable[[Any], Any]:
    """`schedule` at Keras's iteration count of the last micro-batch of update `count`."""

    def rate(count: Any) -> Any:
        return schedule(count * micro_batches + (micro_batches - 1))

    return rate


def _option(name: str) -> Any:
    """A read-only attribute for Keras's base argument `name`, kept in ``_options``."""
    return property(lambda self: getattr(self._options, name), doc=f"Keras's ``{name}``.")


class Optimizer:
    """Base class of the Keras-named optimizers: Keras 3's ``BaseOptimizer``, over optax.

    Args:
      learning_rate: a non-negative float, or a schedule: a
        `jstrategy.optimizers.schedules` object or any ``step -> rate`` callable (e.g. an
        optax schedule), called with Keras's iteration count.
      weight_decay: decoupled weight decay, as Keras's: each step first subtracts
        ``variable * weight_decay * learning_rate``; None for none.
      clipnorm: clip each gradient to this L2 norm.
      clipvalue: clip each gradient element to ``[-clipvalue, clipvalue]``.
      global_clipnorm: clip all gradients together to this global L2 norm.
      use_ema: keep an exponential moving average of the variables (Keras's EMA): after
        each step ``average = ema_momentum * average + (1 - ema_momentum) * variable``
        (the first step copies the variables).
      ema_momentum: the EMA's momentum, in [0, 1].
      ema_overwrite_frequency: with `use_ema`, replace the variables by their average
        every this many steps; None: only when training ends (`Model.fit`'s end, or
        `finalize_variable_values` in a custom loop).
      loss_scale_factor: a fixed loss scale: `Model.fit` multiplies the loss by it and
        the optimizer divides the gradients by it (in a custom loop, scale the loss with
        `scale_loss`).
      gradient_accumulation_steps: an int >= 2: the variables are updated every this
        many calls, with the mean of their gradients; the other calls only accumulate.
        A schedule sees every call (Keras's ``iterations``), bias corrections and EMA
        count updates, as in Keras.
      name: the optimizer's name.
      **kwargs: Keras's deprecated ``decay`` (ignored, with Keras's warning); anything
        else is an error.

    Raises:
      ValueError: for a bad argument (Keras's rules and messages: e.g. at most one of
        the clip options).

    Example:

    >>> import jstrategy
    >>> optimizer = jstrategy.optimizers.Adam(learning_rate=0.01, global_clipnorm=1.0)
    >>> isinstance(optimizer, jstrategy.optimizers.Optimizer), optimizer.learning_rate
    (True, 0.01)
    """

    def __init__(
        self,
        learning_rate: Any,
        *,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ):
        if kwargs.pop("decay", None) is not None:
            warnings.warn(
                "Argument `decay` is no longer supported and will be ignored (as in Keras 3). "
                "For a decaying rate pass a schedule, e.g. learning_rate="
                "jstrategy.optimizers.schedules.InverseTimeDecay(...).",
                stacklevel=3,
            )
        if kwargs:
            raise ValueError(
                f"Argument(s) not recognized: {kwargs}. {type(self).__name__} takes its own "
                f"arguments ({', '.join(self._hyperparameters) or 'none'}) and Keras's "
                f"optimizer arguments ({', '.join(_BASE_ARGUMENTS)})."
            )
        self._learning_rate = _rate(learning_rate)
        self._options = _keras_options(
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        self.name = name if name is not None else snake_case(type(self).__name__)
        self._tx: optax.GradientTransformation | None = None
        self._micro_batches = 1  # a model's gradient_accumulation_steps, once compiled
        self._owner: Any = None  # a weakref to the Trainer of the model it is compiled into
        self._target: TrainableHolder | None = None  # what apply_gradients trains
        self._slots: TrackedState | None = None  # its optimizer state, in a custom loop

    # Keras's base arguments, as read-only attributes ---------------------------------------
    weight_decay = _option("weight_decay")
    clipnorm = _option("clipnorm")
    clipvalue = _option("clipvalue")
    global_clipnorm = _option("global_clipnorm")
    use_ema = _option("use_ema")
    ema_momentum = _option("ema_momentum")
    ema_overwrite_frequency = _option("ema_overwrite_frequency")
    loss_scale_factor = _option("loss_scale_factor")
    gradient_accumulation_steps = _option("gradient_accumulation_steps")

    # What subclasses say ----------------------------------------------------------------
    #: The subclass's own constructor arguments, kept as attributes of the same names.
    _hyperparameters: tuple[str, ...] = ()

    def _rule(self) -> keras_transform.UpdateRule:
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._hyperparameters}

    # The optax transformation -------------------------------------------------------------
    @property
    def schedule(self) -> Callable[[Any], Any] | None:
        """The learning-rate schedule, or None for a fixed (settable) rate."""
        return self._learning_rate if callable(self._learning_rate) else None

    @property
    def update_schedule(self) -> Callable[[Any], Any] | None:
        """The schedule as the optimizer state's update count sees it: the schedule
        itself, or under a model's ``gradient_accumulation_steps`` k (one update per k
        micro-batches) the schedule at Keras's count of the update's last micro-batch,
        ``count * k + k - 1``; None for a fixed rate."""
        schedule = self.schedule
        if schedule is None or self._micro_batches == 1:
            return schedule
        return _per_cycle(schedule, self._micro_batches)

    def _factory(self, learning_rate: Any) -> optax.GradientTransformation:
        return keras_transform.keras_transform(self._rule(), self._options, learning_rate)

    def transformation(self, *, micro_batches: int = 1) -> optax.GradientTransformation:
        """The optax transformation, its rate in its state (``optax.inject_hyperparams``).

        Args:
          micro_batches: how many micro-batches each call of its ``update`` stands for
            (a model's ``gradient_accumulation_steps``): a schedule then sees Keras's
            count, which advances per micro-batch.

        Raises:
          ValueError: if the optimizer accumulates gradients itself too.
        """
        if micro_batches > 1 and self.gradient_accumulation_steps:
            raise ValueError(
                f"The optimizer {self.name!r} accumulates gradients itself "
                f"(gradient_accumulation_steps={self.gradient_accumulation_steps}) and the "
                f"model was compiled with gradient_accumulation_steps={micro_batches} too, "
                "which would accumulate twice. Set one of them (the optimizer's is Keras's "
                "form; the model's weighs micro-batches by their real rows)."
            )
        rate = self._learning_rate
        if callable(rate) and micro_batches > 1:
            rate = _per_cycle(rate, micro_batches)
        return optax.inject_hyperparams(self._factory)(learning_rate=rate)

    @property
    def tx(self) -> optax.GradientTransformation:
        """The optax transformation (see `transformation`)."""
        if self._tx is None:
            self._tx = self.transformation()
        return self._tx

    def scale_loss(self, loss: Any) -> Any:
        """`loss` times `loss_scale_factor` (Keras's ``scale_loss``), or `loss` as it is."""
        if self.loss_scale_factor is None:
            return loss
        return loss * self.loss_scale_factor

    # Keras's attributes -------------------------------------------------------------------
    def _trainer(self) -> Any:
        return None if self._owner is None else self._owner()

    def attach(self, trainer: Any, *, micro_batches: int = 1) -> optax.GradientTransformation:
        """Binds the optimizer to the model it is compiled into (one model per optimizer),
        whose ``gradient_accumulation_steps`` is `micro_batches`; returns the
        transformation to apply."""
        current = self._trainer()
        if current is not None and current is not trainer:
            raise ValueError(
                f"The optimizer {self.name!r} is already compiled into another model; create "
                "one optimizer per model (e.g. jstrategy.optimizers.get(config))."
            )
        if self._target is not None:
            raise ValueError(
                f"The optimizer {self.name!r} already trains variables in a custom loop "
                "(apply_gradients); create another one for compile."
            )
        tx = self.transformation(micro_batches=micro_batches)
        self._owner = weakref.ref(trainer)
        self._micro_batches = micro_batches
        return tx

    def _custom_state(self) -> Any:
        if self._slots is None:
            return None
        value = self._slots.read()
        if context.inside_run() is None:
            value = jax.tree.map(local_copy, value)
        return value

    @property
    def learning_rate(self) -> float:
        """The rate the next step applies (for a schedule, its value at Keras's
        iteration count).

        Settable for a fixed rate; with a schedule, setting raises a `TypeError` (as in
        Keras). Read from and written to the optimizer state it updates (`learning_rate.py`):
        the model's it is compiled into, or its own in a custom loop; the constructor's rate
        before either exists.
        """
        trainer = self._trainer()
        if trainer is not None:
            return trainer.get_learning_rate()
        state = self._custom_state()
        if state is not None:
            return learning_rate_lib.read(state, self.schedule)
        if self.schedule is not None:
            return float(self.schedule(0))
        return float(self._learning_rate)

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        if self.schedule is not None:
            raise TypeError(learning_rate_lib.SCHEDULE_NOT_SETTABLE)
        trainer = self._trainer()
        if trainer is not None:
            trainer.set_learning_rate(value)
            return
        value = _rate(value)
        if self._slots is None:
            self._learning_rate = value
            self._tx = None
            return
        self._slots.write(learning_rate_lib.write(self._slots.read(), value))

    @property
    def iterations(self) -> int:
        """How many steps the optimizer applied, as Keras counts them: calls of the update
        (a model's steps), divided by `gradient_accumulation_steps` if set."""
        trainer = self._trainer()
        if trainer is not None:
            calls = int(trainer.state.step)
        else:
            state = self._custom_state()
            calls = 0 if state is None else int(injected_state(state).count)
        return calls // (self.gradient_accumulation_steps or 1)

    @property
    def variables(self) -> list[jax.Array]:
        """The optimizer's state (slots, step count, rate), as a list of arrays."""
        trainer = self._trainer()
        if trainer is not None:
            return jax.tree.leaves(trainer.state.opt_state)
        state = self._custom_state()
        return [] if state is None else jax.tree.leaves(state)

    # Custom loops -----------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> None:
        """Updates variables from their gradients, as TF's ``optimizer.apply_gradients``.

        `grads_and_vars` pairs each gradient with its variable, e.g.
        ``zip(gradients, model.trainable_variables)`` with the list a `jstrategy.Model`
        gave (every trainable variable, in its order). Inside `Strategy.run`, gradients
        that differ across replicas (each replica's own) are summed over the replicas
        first, with one all-reduce, as TF aggregates them; gradients already combined
        (e.g. by ``ReplicaContext.all_reduce``) are used as they are. The update, and the
        optimizer's own state, are the same on every replica.

        Args:
          grads_and_vars: ``(gradient, variable)`` pairs.

        Raises:
          RuntimeError: outside `Strategy.run` inside a strategy's scope, or for
            variables on several devices (TF's cross-replica error).
          ValueError: if the variables are not a model's `trainable_variables`, or the
            optimizer trains other variables or is compiled into a model.
        """
        pairs = list(grads_and_vars)
        if not pairs:
            raise ValueError("`grads_and_vars` is empty; pass zip(grads, trainable_variables).")
        if any(len(p) != 2 for p in pairs) or isinstance(pairs[0][1], str):
            raise ValueError(
                "`grads_and_vars` must be (gradient, variable) pairs, e.g. "
                "zip(gradients, model.trainable_variables) with both lists (a zip of two "
                "dicts pairs their keys)."
            )
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        _check_replica_context("apply_gradients", variables)
        if self._trainer() is not None:
            raise ValueError(
                f"The optimizer {self.name!r} is compiled into a model, whose fit applies "
                "it; create another optimizer for a custom loop."
            )
        holder = owner_of_trainable(variables)
        if self._target is not None and self._target is not holder:
            raise ValueError(
                f"The optimizer {self.name!r} already trains other variables; create one "
                "optimizer per model, as Keras builds an optimizer for one set of variables."
            )
        grads = _combine_across_replicas(grads)
        value = holder.read()
        params = holder.trainable(value)
        treedef = jax.tree.structure(params)
        grads_tree = jax.tree.unflatten(treedef, grads)
        slots = self._build(holder)
        updates, opt_state = self.tx.update(grads_tree, slots.read(), params)
        new_params = optax.apply_updates(params, updates)
        holder.write(holder.with_trainable(value, new_params))
        slots.write(opt_state)

    def apply(self, grads: Any, trainable_variables: Any) -> None:
        """Keras 3's ``optimizer.apply(grads, trainable_variables)``: `apply_gradients` of
        ``zip(grads, trainable_variables)``."""
        self.apply_gradients(zip(list(grads), list(trainable_variables), strict=True))

    def build(self, var_list: Any) -> None:
        """Creates the optimizer state for `var_list` (a model's ``trainable_variables``),
        as Keras's ``optimizer.build``; `apply_gradients` does it on first use."""
        self._build(owner_of_trainable(list(var_list)))

    def _build(self, holder: TrainableHolder) -> TrackedState:
        if self._slots is None:
            concrete = holder.trainable(holder.current_value())
            with jax.ensure_compile_time_eval():
                opt_state = self.tx.init(in_device_memory(concrete))
            self._slots = TrackedState(opt_state, name=f"the optimizer {self.name!r}")
            self._target = holder
        return self._slots

    def finalize_variable_values(self, var_list: Any) -> None:
        """With `use_ema`, replaces the variables by their moving average (Keras's
        ``finalize_variable_values``; `Model.fit` does it when training ends).

        Args:
          var_list: the variables this optimizer trains in a custom loop (a model's
            ``trainable_variables``).

        Raises:
          ValueError: if the optimizer has not trained `var_list`.
        """
        if not self.use_ema:
            return
        holder = owner_of_trainable(list(var_list))
        if self._target is not holder or self._slots is None:
            raise ValueError(
                f"The optimizer {self.name!r} has not trained these variables (call "
                "apply_gradients with them first), so it holds no average of them."
            )
        average = ema_average(self._slots.read())
        value = holder.read()
        holder.write(holder.with_trainable(value, average))

    # Keras's configuration ----------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as Keras's (a schedule as its own config)."""
        rate = self._learning_rate
        if callable(rate):
            rate = schedules_lib.serialize(rate)  # type: ignore[arg-type]
        return {
            "name": self.name,
            "learning_rate": rate,
            **self._config(),
            **{k: getattr(self, k) for k in _BASE_ARGUMENTS if k not in ("name", "learning_rate")},
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Optimizer:
        """The optimizer `get_config` describes (Keras's configs too)."""
        config = dict(config)
        rate = config.get("learning_rate")
        if isinstance(rate, dict):
            config["learning_rate"] = schedules_lib.deserialize(rate)
        return cls(**config)

    def __repr__(self) -> str:
        rate = self._learning_rate
        return f"{type(self).__name__}(learning_rate={rate!r}, name={self.name!r})"


def ema_average(opt_state: Any) -> Any:
    """The `use_ema` moving average in an optimizer state (a tree like the parameters)."""
    inner = injected_state(opt_state).inner_state
    if not isinstance(inner, keras_transform.KerasOptimizerState):
        raise TypeError("Not the state of a jstrategy.optimizers optimizer.")
    return inner.average


def _check_replica_context(method: str, variables: list[Any]) -> None:
    """TF's error for an update outside `Strategy.run` where the variables are replicated."""
    if context.inside_run() is not None:
        return
    spread = any(isinstance(v, jax.Array) and len(v.sharding.device_set) > 1 for v in variables)
    if context.has_strategy() or spread:
        where = "inside a strategy's scope" if context.has_strategy() else "on several devices"
        raise RuntimeError(
            f"`{method}() cannot be called in cross-replica context. Use "
            f"`tf.distribute.Strategy.run` to enter replica context (jstrategy: call it in "
            f"the function given to `strategy.run(fn, args=...)`; the variables are {where})."
        )


def _combine_across_replicas(grads: list[Any]) -> list[Any]:
    """Inside `run`: the per-replica (varying) gradients summed over replicas, once."""
    ctx = context.inside_run()
    if ctx is None:
        return grads
    axis = ctx.strategy.axis_name
    varying = [i for i, g in enumerate(grads) if axis in varying_axes(g)]
    if not varying:
        return grads
    summed = ctx.all_reduce(ReduceOp.SUM, [grads[i] for i in varying])
    out = list(grads)
    for i, g in zip(varying, summed, strict=True):
        out[i] = g
    return out


def cast_like(x: Any, like: jax.Array) -> jax.Array:
    """`x` (a hyperparameter) in `like`'s dtype: an update step computes in the variable's."""
    return jnp.asarray(x).astype(like.dtype)


# Every optimizer a saved config names derives from Optimizer (checked as it registers).
register_kind("optimizer", Optimizer)
