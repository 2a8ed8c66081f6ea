"""Keras-named optimizers, thin over optax: the rate you set is the rate applied.

`jstrategy.optimizers.SGD(learning_rate=0.01, momentum=0.0, nesterov=False)`, `Adam`,
`AdamW`, `RMSprop`, `Adagrad`, `Adadelta`, `Adamax`, `Nadam` and `Lion` take Keras's
argument names and defaults and build the optax transformation of the same name (its
formulas, e.g. where epsilon enters, are optax's). The learning rate is a value in the
optimizer state (``optax.inject_hyperparams``), so `Model.learning_rate`,
`LearningRateScheduler` and `ReduceLROnPlateau` read and set the rate that is applied,
without recompiling; a schedule (a `jstrategy.optimizers.schedules` object or any
``step -> rate`` callable) sets it from the step count instead.

The same object is TF's optimizer in a custom loop: `Optimizer.apply_gradients` inside
`Strategy.run` sums per-replica gradients across replicas (TF's aggregation; gradients
already combined are used as they are), then updates the variables it is given (a
`jstrategy.Model`'s ``trainable_variables``) and its own slots, both threaded through
`run`'s compiled program (`tracked.py`).
"""

from __future__ import annotations

import math
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
from jstrategy._src.tracked import TrackedState
from jstrategy._src.tracked import TrainableHolder
from jstrategy._src.tracked import owner_of_trainable
from jstrategy._src.training import schedules as schedules_lib
from jstrategy._src.values import local_copy
from jstrategy._src.values import varying_axes

__all__ = [
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Lion",
    "Nadam",
    "Optimizer",
    "RMSprop",
    "deserialize",
    "get",
    "injected_state",
    "serialize",
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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"`learning_rate` must be a non-negative float or a schedule (a "
            f"jstrategy.optimizers.schedules object, or a callable step -> rate); got {value!r}."
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"`learning_rate` must be a non-negative finite float; got {value!r}.")
    return float(value)


def _in_range(value: Any, name: str, low: float, high: float, *, high_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"`{name}` must be a float in [{low}, {high}{bracket}; got {value!r}.")
    return float(value)


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`{name}` must be a positive float; got {value!r}.")
    return float(value)


def _clip_by_norm(max_norm: float) -> optax.GradientTransformation:
    """Keras's ``clipnorm``: each gradient's own L2 norm clipped to `max_norm`."""

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        del params

        def clip(g: jax.Array) -> jax.Array:
            norm = jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))
            return (g * (max_norm / jnp.maximum(norm, max_norm))).astype(g.dtype)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)  # type: ignore[arg-type]


class Optimizer:
    """Base class of the Keras-named optimizers: a configuration that builds optax.

    Args:
      learning_rate: a non-negative float, or a schedule: a
        `jstrategy.optimizers.schedules` object or any ``step -> rate`` callable (e.g. an
        optax schedule).
      weight_decay: decoupled weight decay, as Keras's: each step subtracts
        ``learning_rate * weight_decay * variable``; None for none.
      clipnorm: clip each gradient to this L2 norm.
      clipvalue: clip each gradient element to ``[-clipvalue, clipvalue]``.
      global_clipnorm: clip all gradients together to this global L2 norm.
      name: the optimizer's name.

    Raises:
      ValueError: for a bad argument, or both `clipnorm` and `global_clipnorm`.
    """

    def __init__(
        self,
        learning_rate: Any,
        *,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        name: str | None = None,
    ):
        self._learning_rate = _rate(learning_rate)
        self.weight_decay = (
            None if weight_decay is None else _non_negative(weight_decay, "weight_decay")
        )
        if clipnorm is not None and global_clipnorm is not None:
            raise ValueError(
                "Only one of `clipnorm` and `global_clipnorm` can be set (as in Keras); got "
                f"clipnorm={clipnorm!r} and global_clipnorm={global_clipnorm!r}."
            )
        self.clipnorm = None if clipnorm is None else _positive(clipnorm, "clipnorm")
        self.clipvalue = None if clipvalue is None else _positive(clipvalue, "clipvalue")
        self.global_clipnorm = (
            None if global_clipnorm is None else _positive(global_clipnorm, "global_clipnorm")
        )
        self.name = name if name is not None else snake_case(type(self).__name__)
        self._tx: optax.GradientTransformation | None = None
        self._owner: Any = None  # a weakref to the Trainer of the model it is compiled into
        self._target: TrainableHolder | None = None  # what apply_gradients trains
        self._slots: TrackedState | None = None  # its optimizer state, in a custom loop

    # What subclasses say ----------------------------------------------------------------
    #: The subclass's own constructor arguments, kept as attributes of the same names.
    _hyperparameters: tuple[str, ...] = ()

    def _inner(self, learning_rate: Any) -> optax.GradientTransformation:
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._hyperparameters}

    # The optax transformation -------------------------------------------------------------
    @property
    def schedule(self) -> Callable[[Any], Any] | None:
        """The learning-rate schedule, or None for a fixed (settable) rate."""
        return self._learning_rate if callable(self._learning_rate) else None

    @property
    def tx(self) -> optax.GradientTransformation:
        """The optax transformation: clipping, then the optimizer with its rate in its state."""
        if self._tx is None:
            decay = self.weight_decay

            def factory(learning_rate: Any) -> optax.GradientTransformation:
                inner = self._inner(learning_rate)
                if decay:
                    inner = optax.chain(inner, optax.add_decayed_weights(-learning_rate * decay))
                return inner

            core = optax.inject_hyperparams(factory)(learning_rate=self._learning_rate)
            clips = []
            if self.clipnorm is not None:
                clips.append(_clip_by_norm(self.clipnorm))
            if self.global_clipnorm is not None:
                clips.append(optax.clip_by_global_norm(self.global_clipnorm))
            if self.clipvalue is not None:
                clips.append(optax.clip(self.clipvalue))
            self._tx = optax.chain(*clips, core) if clips else core
        return self._tx

    # Keras's attributes -------------------------------------------------------------------
    def _trainer(self) -> Any:
        return None if self._owner is None else self._owner()

    def attach(self, trainer: Any) -> None:
        """Binds the optimizer to the model it is compiled into (one model per optimizer)."""
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
        self._owner = weakref.ref(trainer)

    def _custom_state(self) -> Any:
        if self._slots is None:
            return None
        value = self._slots.read()
        if context.inside_run() is None:
            value = jax.tree.map(local_copy, value)
        return value

    @property
    def learning_rate(self) -> float:
        """The rate the next step applies (for a schedule, its value at `iterations`).

        Settable for a fixed rate; with a schedule, setting raises a `TypeError` (as in
        Keras).
        """
        trainer = self._trainer()
        if trainer is not None:
            return trainer.get_learning_rate()
        state = self._custom_state()
        if state is None:
            if self.schedule is not None:
                return float(self.schedule(0))
            return float(self._learning_rate)
        injected = injected_state(state)
        if self.schedule is not None:
            return float(self.schedule(injected.count))
        return float(injected.hyperparams["learning_rate"])

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        if self.schedule is not None:
            raise TypeError(_SCHEDULE_NOT_SETTABLE)
        trainer = self._trainer()
        if trainer is not None:
            trainer.set_learning_rate(value)
            return
        value = _rate(value)
        if self._slots is None:
            self._learning_rate = value
            self._tx = None
            return
        state = self._slots.read()
        injected = injected_state(state)
        hyper = dict(injected.hyperparams)
        hyper["learning_rate"] = jnp.asarray(value, hyper["learning_rate"].dtype)
        new = jax.tree.map(
            lambda x: injected._replace(hyperparams=hyper) if x is injected else x,
            state,
            is_leaf=lambda x: x is injected,
        )
        self._slots.write(new)

    @property
    def iterations(self) -> int:
        """How many updates the optimizer applied."""
        trainer = self._trainer()
        if trainer is not None:
            return int(trainer.state.step)
        state = self._custom_state()
        return 0 if state is None else int(injected_state(state).count)

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
            "weight_decay": self.weight_decay,
            "clipnorm": self.clipnorm,
            "clipvalue": self.clipvalue,
            "global_clipnorm": self.global_clipnorm,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Optimizer:
        """The optimizer `get_config` describes."""
        config = dict(config)
        rate = config.get("learning_rate")
        if isinstance(rate, dict):
            config["learning_rate"] = schedules_lib.deserialize(rate)
        return cls(**config)

    def __repr__(self) -> str:
        rate = self._learning_rate
        return f"{type(self).__name__}(learning_rate={rate!r}, name={self.name!r})"


_SCHEDULE_NOT_SETTABLE = (
    "This optimizer was created with a learning-rate schedule, so its rate follows the "
    "step count and cannot be set (as in Keras). Create it with a float learning_rate to "
    "set the rate, e.g. from LearningRateScheduler or ReduceLROnPlateau."
)


def _non_negative(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative float; got {value!r}.")
    return float(value)


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


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum: Keras's ``SGD``, `optax.sgd`.

    Args:
      learning_rate: a float (default 0.01) or a schedule.
      momentum: in [0, 1]; 0 for plain gradient descent.
      nesterov: Nesterov momentum.
      **kwargs: `Optimizer`'s: `weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
        `name`.

    Example:

    >>> import jax.numpy as jnp
    >>> opt = SGD(learning_rate=0.1, momentum=0.9)
    >>> state = opt.tx.init({"w": jnp.ones(2)})
    >>> opt.get_config()["momentum"], opt.learning_rate
    (0.9, 0.1)
    """

    _hyperparameters: tuple[str, ...] = ("momentum", "nesterov")

    def __init__(
        self,
        learning_rate: Any = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.momentum = _in_range(momentum, "momentum", 0.0, 1.0)
        self.nesterov = bool(nesterov)

    def _inner(self, learning_rate: Any) -> optax.GradientTransformation:
        return optax.sgd(learning_rate, momentum=self.momentum or None, nesterov=self.nesterov)


class _AdamFamily(Optimizer):
    """What Adam, AdamW, Adamax and Nadam share: two moments and an epsilon."""

    _hyperparameters: tuple[str, ...] = ("beta_1", "beta_2", "epsilon")

    _factory: Callable[..., optax.GradientTransformation]

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.beta_1 = _in_range(beta_1, "beta_1", 0.0, 1.0, high_open=True)
        self.beta_2 = _in_range(beta_2, "beta_2", 0.0, 1.0, high_open=True)
        self.epsilon = _positive(epsilon, "epsilon")

    def _inner(self, learning_rate: Any) -> optax.GradientTransformation:
        return type(self)._factory(learning_rate, b1=self.beta_1, b2=self.beta_2, eps=self.epsilon)


class Adam(_AdamFamily):
    """Adam: Keras's ``Adam`` (`optax.adam`, or `optax.amsgrad` with `amsgrad`).

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      beta_1: the first moment's decay.
      beta_2: the second moment's decay.
      epsilon: added to the root of the second moment (optax's placement).
      amsgrad: use the AMSGrad variant.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Adam().get_config()["epsilon"]
    1e-07
    """

    _hyperparameters: tuple[str, ...] = ("beta_1", "beta_2", "epsilon", "amsgrad")

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, **kwargs)
        self.amsgrad = bool(amsgrad)

    def _inner(self, learning_rate: Any) -> optax.GradientTransformation:
        factory = optax.amsgrad if self.amsgrad else optax.adam
        return factory(learning_rate, b1=self.beta_1, b2=self.beta_2, eps=self.epsilon)


class AdamW(Adam):
    """Adam with decoupled weight decay: Keras's ``AdamW`` (default decay 0.004).

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      weight_decay: each step subtracts ``learning_rate * weight_decay * variable``.
      beta_1: the first moment's decay.
      beta_2: the second moment's decay.
      epsilon: added to the root of the second moment.
      amsgrad: use the AMSGrad variant.
      **kwargs: `Optimizer`'s.

    Example:

    >>> AdamW().weight_decay
    0.004
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs: Any,
    ):
        super().__init__(
            learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay=weight_decay, **kwargs
        )


class Adamax(_AdamFamily):
    """Adamax (Adam with the infinity norm): Keras's ``Adamax``, `optax.adamax`.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      beta_1: the first moment's decay.
      beta_2: the decay of the infinity norm.
      epsilon: added to the norm.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Adamax(learning_rate=0.002).learning_rate
    0.002
    """

    _factory = staticmethod(optax.adamax)


class Nadam(_AdamFamily):
    """Adam with Nesterov momentum: Keras's ``Nadam``, `optax.nadam`.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      beta_1: the first moment's decay.
      beta_2: the second moment's decay.
      epsilon: added to the root of the second moment.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Nadam().get_config()["beta_2"]
    0.999
    """

    _factory = staticmethod(optax.nadam)


class RMSprop(Optimizer):
    """RMSprop: Keras's ``RMSprop``, `optax.rmsprop` (epsilon inside the root, as Keras).

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      rho: the decay of the moving average of squared gradients.
      momentum: in [0, 1]; 0 for none.
      epsilon: added to the average before the root.
      centered: divide by the variance rather than the second moment.
      **kwargs: `Optimizer`'s.

    Example:

    >>> RMSprop().get_config()["rho"]
    0.9
    """

    _hyperparameters: tuple[str, ...] = ("rho", "momentum", "epsilon", "centered")

    def __init__(
        self,
        learning_rate: Any = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.rho = _in_range(rho, "rho", 0.0, 1.0, high_open=True)
        self.momentum = _in_range(momentum, "momentum", 0.0, 1.0)
        self.epsilon = _positive(epsilon, "epsilon")
        self.centered = bool(centered)

    def _inner(self, learning_rate: Any) -> optax.GradientTransformation:
        return optax.rmsprop(
            learning_rate,
            decay=self.rho,
            eps=self.epsilon,
            eps_in_sqrt=True,
            centered=self.centered,
            momentum=self.momentum or None,
        )


class Adagrad(Optimizer):
    """Adagrad: Keras's ``Adagrad``, `optax.adagrad`.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      initial_accumulator_value: the starting sum of squared gradients.
      epsilon: added to the sum before the root.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Adagrad().get_config()["initial_accumulator_value"]
    0.1
    """

    _hyperparameters: tuple[str, ...] = ("initial_accumulator_value", "epsilon")

    def __init__(
        self,
        learning_rate: Any = 0.001,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.initial_accumulator_value = _non_negative(
            initial_accumulator_value, "initial_accumulator_value"
        )
        self.epsilon = _positive(epsilon, "epsilon")

    def _inner(self, learning_rate: Any) -> optax.GradientTransformation:
        return optax.adagrad(
            learning_rate,
            initial_accumulator_value=self.initial_accumulator_value,
            eps=self.epsilon,
        )


class Adadelta(Optimizer):
    """Adadelta: Keras's ``Adadelta``, `optax.adadelta`.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      rho: the decay of the moving averages.
      epsilon: added inside the roots.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Adadelta().get_config()["rho"]
    0.95
    """

    _hyperparameters: tuple[str, ...] = ("rho", "epsilon")

    def __init__(
        self, learning_rate: Any = 0.001, rho: float = 0.95, epsilon: float = 1e-7, **kwargs: Any
    ):
        super().__init__(learning_rate, **kwargs)
        self.rho = _in_range(rho, "rho", 0.0, 1.0, high_open=True)
        self.epsilon = _positive(epsilon, "epsilon")

    def _inner(self, learning_rate: Any) -> optax.GradientTransformation:
        return optax.adadelta(learning_rate, rho=self.rho, eps=self.epsilon)


class Lion(Optimizer):
    """Lion (sign of an interpolated momentum): Keras's ``Lion``, `optax.lion`.

    Args:
      learning_rate: a float (default 0.001) or a schedule.
      beta_1: the interpolation factor of the update.
      beta_2: the momentum's decay.
      **kwargs: `Optimizer`'s.

    Example:

    >>> Lion().get_config()["beta_2"]
    0.99
    """

    _hyperparameters: tuple[str, ...] = ("beta_1", "beta_2")

    def __init__(
        self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.99, **kwargs: Any
    ):
        super().__init__(learning_rate, **kwargs)
        self.beta_1 = _in_range(beta_1, "beta_1", 0.0, 1.0)
        self.beta_2 = _in_range(beta_2, "beta_2", 0.0, 1.0)

    def _inner(self, learning_rate: Any) -> optax.GradientTransformation:
        return optax.lion(learning_rate, b1=self.beta_1, b2=self.beta_2, weight_decay=0.0)


_CLASSES: dict[str, Any] = {  # name -> class (each has Keras's default learning rate)
    cls.__name__.lower(): cls
    for cls in (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam, Lion)
}


def serialize(optimizer: Optimizer) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}``, Keras's form.

    Example:

    >>> serialize(SGD(0.1))["class_name"]
    'SGD'
    """
    return {"class_name": type(optimizer).__name__, "config": optimizer.get_config()}


def deserialize(config: dict[str, Any]) -> Optimizer:
    """The optimizer `serialize` described.

    Raises:
      ValueError: for an unknown class name.
    """
    name = str(config.get("class_name", "")).lower()
    if name not in _CLASSES:
        raise ValueError(
            f"Unknown optimizer {config.get('class_name')!r}; known: "
            f"{sorted(c.__name__ for c in _CLASSES.values())}."
        )
    return _CLASSES[name].from_config(config.get("config", {}))


def get(identifier: Any) -> Optimizer:
    """An optimizer from a Keras name (Keras's defaults), a `serialize` dict, or itself.

    Args:
      identifier: an `Optimizer`; a name such as ``"sgd"``, ``"adam"``, ``"adamw"``,
        ``"rmsprop"``, ``"adagrad"``, ``"adadelta"``, ``"adamax"``, ``"nadam"``,
        ``"lion"`` (any case); or ``{"class_name": ..., "config": ...}``.

    Returns:
      An `Optimizer` (a new one for a name or a dict).

    Raises:
      ValueError: for an unknown name.
      TypeError: for anything else.

    Example:

    >>> type(get("Adam")).__name__, get("sgd").learning_rate
    ('Adam', 0.01)
    """
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if isinstance(identifier, str):
        key = identifier.lower()
        if key not in _CLASSES:
            raise ValueError(
                f"Unknown optimizer {identifier!r}. Valid names: {sorted(_CLASSES)}; or pass "
                "a jstrategy.optimizers object such as Adam(learning_rate=1e-3), or an "
                "optax.GradientTransformation."
            )
        return _CLASSES[key]()
    raise TypeError(
        f"An optimizer must be a jstrategy.optimizers.Optimizer, a name or a config dict; "
        f"got {type(identifier).__name__} {identifier!r}."
    )
