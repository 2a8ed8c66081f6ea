"""What a model's layers say about training: Keras's ``trainable`` and weight constraints.

Keras's optimizer updates a model's trainable variables only, then projects each one that
has a constraint. Here a `LayerPlan` says the same of a linen model's parameters: the
submodules whose parameters are frozen (`jstrategy.layers` made or set with
``trainable=False``, or all of them for ``model.trainable = False``) and each constrained
parameter with its constraint. `honour` wraps the optimizer so that the optimizer sees
the trained parameters only (its state holds nothing for the frozen ones, weight decay
never touches them) and the frozen ones get a zero update, and applies each constraint to
the updated parameter: every strategy's step applies the update through it.

The plan is read from the layers the module calls while it is initialized: when the
state is created (`create_train_state`) and again when a `jstrategy.Model` is compiled,
so setting ``layer.trainable`` takes effect at the next ``compile``, as in Keras.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax import traverse_util

from jstrategy._src.layers.base import Layer
from jstrategy._src.layers.base import train_kwargs
from jstrategy._src.training.state import weight_order
from jstrategy._src.training.state.weight_order import Path

__all__ = ["LayerPlan", "fingerprint", "honour", "plan_of", "read_plan", "with_trained"]

_SUFFIX = "_constraint"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Which parameters train, and their constraints.

    Attributes:
      frozen: the paths (below ``params``) of the submodules whose parameters are
        frozen; ``()`` freezes every parameter.
      constraints: ``(parameter path, constraint)`` pairs.
    """

    frozen: tuple[Path, ...] = ()
    constraints: tuple[tuple[Path, Any], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.frozen or self.constraints)

    def is_frozen(self, path: Path) -> bool:
        """Whether the parameter at `path` (below ``params``) is frozen."""
        return any(path[: len(prefix)] == prefix for prefix in self.frozen)


def _constraints(layer: Layer) -> Iterable[tuple[str, Any]]:
    for field in dataclasses.fields(layer):
        if field.name.endswith(_SUFFIX) and getattr(layer, field.name) is not None:
            yield field.name[: -len(_SUFFIX)], getattr(layer, field.name)


def plan_of(
    calls: list[tuple[Path, Any]],
    *,
    everything_frozen: bool = False,
    layers: Mapping[Path, Any] | None = None,
) -> LayerPlan:
    """The plan of the submodules a module called (`weight_order.recording_calls`).

    `layers` are the objects a user holds for some of those paths (a `Sequential`'s
    layers, `Model.layers`), read instead of the traced copies: a flag set on a Flax
    module (``model.layers[1].trainable = False``) lives on that object only.
    """
    frozen: list[Path] = [()] if everything_frozen else []
    constraints: list[tuple[Path, Any]] = []
    for path, module in calls:
        module = (layers or {}).get(path, module)
        if getattr(module, "trainable", True) is False:
            frozen.append(path)
        if isinstance(module, Layer):
            constraints.extend(((*path, name), c) for name, c in _constraints(module))
    return LayerPlan(tuple(frozen), tuple(constraints))


def read_plan(
    module: nn.Module,
    sample: Any,
    init_kwargs: dict[str, Any],
    *,
    everything_frozen: bool,
    layers: Mapping[Path, Any] | None = None,
) -> LayerPlan:
    """The plan of `module`'s layers as they are now (a trace of its initialization on
    `sample`, a `jax.ShapeDtypeStruct`: nothing is computed); `layers` as `plan_of`'s."""

    def init(key: jax.Array, x: Any) -> Any:
        return module.init({"params": key, "dropout": key}, x, **init_kwargs)

    with weight_order.recording_calls() as calls:
        jax.eval_shape(init, jax.random.key(0), sample)
    return plan_of(calls, everything_frozen=everything_frozen, layers=layers)


def fingerprint(
    module: Any, model_trainable: bool, layers: Mapping[Path, Any] | None = None
) -> tuple[Any, ...]:
    """What can change a plan after the module was made: the ``trainable`` flags and
    constraints of the layers its fields hold (layers made inside ``__call__`` are made
    anew, as written, at every call) and of `layers` (`plan_of`'s), and the model's own
    flag."""
    out: list[Any] = [model_trainable]
    out.extend((path, getattr(obj, "trainable", True)) for path, obj in (layers or {}).items())
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Layer):
            out.append((id(obj), obj.trainable, tuple(_constraints(obj))))
        if isinstance(obj, nn.Module):
            for field in dataclasses.fields(obj):
                if field.name not in ("parent", "name"):
                    walk(getattr(obj, field.name))
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)

    walk(module)
    return tuple(out)


def _trained(tree: Any, plan: LayerPlan) -> Any:
    """`tree` (shaped like the parameters) without the frozen parameters."""
    if not plan.frozen:
        return tree
    flat = traverse_util.flatten_dict(tree)
    return traverse_util.unflatten_dict({p: v for p, v in flat.items() if not plan.is_frozen(p)})


def with_trained(params: Any, trained: Any, plan: LayerPlan) -> Any:
    """`params` with the trained parameters replaced by `trained` (shaped like
    `_trained`'s result: an optimizer's moving average, say)."""
    if not plan.frozen:
        return trained
    flat = traverse_util.flatten_dict(params)
    flat.update(traverse_util.flatten_dict(trained))
    return traverse_util.unflatten_dict(flat)


def honour(tx: optax.GradientTransformation, plan: LayerPlan) -> optax.GradientTransformation:
    """`tx` restricted to the trained parameters, frozen ones given a zero update, and each
    constraint applied to its parameter after the update (Keras's optimizer's order).

    The same `tx` and `plan` give the same object: a state's optimizer is part of its
    tree structure, which a state traced twice (its shapes, then where it lives) must
    repeat.
    """
    if not plan:
        return tx
    return _honoured(tx, plan)


@functools.lru_cache(maxsize=256)
def _honoured(tx: optax.GradientTransformation, plan: LayerPlan) -> optax.GradientTransformation:

    def init(params: Any) -> Any:
        return tx.init(_trained(params, plan))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        trained, state = tx.update(
            _trained(updates, plan), state, None if params is None else _trained(params, plan)
        )
        flat = traverse_util.flatten_dict(updates)
        new = traverse_util.flatten_dict(trained) if trained else {}
        out = {p: new[p] if p in new else jnp.zeros_like(u) for p, u in flat.items()}
        if params is not None and plan.constraints:
            values = traverse_util.flatten_dict(params)
            for path, constraint in plan.constraints:
                if path in out and not plan.is_frozen(path):
                    value = values[path]
                    projected = constraint(value + out[path].astype(value.dtype))
                    out[path] = (projected - value).astype(out[path].dtype)
        return traverse_util.unflatten_dict(out), state

    return optax.GradientTransformation(init, update)


def with_current_plan(
    state: Any,
    module: Any,
    sample: Any,
    model_trainable: bool,
    strategy: Any = None,
    layers: Mapping[Path, Any] | None = None,
) -> Any:
    """`state` (a `jstrategy.Model`'s) with the plan of its layers as they are now, read
    on `sample` (the model's sample row, or None where unknown: the plan read when the
    state was created stays); `strategy`, where the plan is for training, is checked to
    support it.

    Raises:
      ValueError: for ``model.trainable = False`` (or a submodule's ``trainable``) on an
        NNX model, or a plan under a strategy whose `fit` applies gradients on parameter
        servers.
    """
    if not hasattr(state, "layer_plan"):  # NNX: its optimizer's `wrt` says what trains
        flagged = [
            "/".join(map(str, path))
            for path, node in nnx.iter_graph(module)
            if isinstance(node, nnx.Module) and getattr(node, "trainable", True) is False
        ]
        if not model_trainable or flagged:
            what = (
                "model.trainable = False"
                if not model_trainable
                else f"{flagged[0]}.trainable = False"
            )
            raise ValueError(
                f"{what}: an NNX model trains what its optimizer's `wrt` filter selects, "
                "and a `trainable` attribute means nothing to it. Freeze with "
                "jstrategy.training.create_nnx_train_state(module, tx, wrt=...) (e.g. a "
                "filter excluding the frozen submodules' nnx.Param), and drop the flag."
            )
        return state
    if sample is None:
        plan = state.layer_plan
        frozen = tuple(p for p in plan.frozen if p) + (() if model_trainable else ((),))
        plan = LayerPlan(frozen, plan.constraints)
    else:
        kwargs = train_kwargs(state.train_arg, False)
        plan = read_plan(
            module, sample, kwargs, everything_frozen=not model_trainable, layers=layers
        )
    if plan and strategy is not None and strategy.should_use_with_coordinator:
        raise ValueError(
            f"{type(strategy).__name__}'s fit applies each variable's gradients on the "
            "parameter servers, so frozen layers (trainable=False) and weight constraints "
            "are not supported there. Train the frozen part with another strategy, or "
            "make every layer trainable and drop the constraints."
        )
    return state.replace(layer_plan=plan)
