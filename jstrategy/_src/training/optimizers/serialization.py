"""An optimizer from a name, a config or itself: `get`, `serialize`, `deserialize`, and
what `compile` takes, to optax.

`resolve_optimizer` turns what `Model.compile` accepts (a Keras name such as ``"adam"``, a
`jstrategy.optimizers` object, or an optax transformation) into the optimizer object and
the optax transformation to apply. The learning rate that transformation keeps in the
optimizer state is read and set in `learning_rate.py`; the optimizers themselves live one
family a file (`sgd.py`, `adam.py`, ...) over `base.py`.
"""

from __future__ import annotations

from typing import Any

import optax

from jstrategy._src.registry import saveable_classes

# Each optimizer's module registers it as it is imported: these imports make every
# optimizer a name or a saved config may give known here.
from jstrategy._src.training.optimizers import adagrad  # noqa: F401
from jstrategy._src.training.optimizers import adam  # noqa: F401
from jstrategy._src.training.optimizers import lion  # noqa: F401
from jstrategy._src.training.optimizers import rmsprop  # noqa: F401
from jstrategy._src.training.optimizers import sgd  # noqa: F401
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.validation import refuse_keras_3_object

__all__ = ["deserialize", "get", "resolve_optimizer", "serialize"]


def _by_key() -> dict[str, Any]:
    """The registered optimizers by lower-case name (each has Keras's default learning rate)."""
    return {name.lower(): cls for name, cls in saveable_classes("optimizer").items()}


def serialize(optimizer: Optimizer) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}``, Keras's form.

    Example:

    >>> from jstrategy._src.training.optimizers.sgd import SGD
    >>> serialize(SGD(0.1))["class_name"]
    'SGD'
    """
    return {"class_name": type(optimizer).__name__, "config": optimizer.get_config()}


def deserialize(config: dict[str, Any]) -> Optimizer:
    """The optimizer `serialize` described.

    Raises:
      ValueError: for an unknown class name.

    Example:

    >>> import jstrategy
    >>> config = jstrategy.optimizers.serialize(jstrategy.optimizers.SGD(0.1, momentum=0.9))
    >>> optimizer = jstrategy.optimizers.deserialize(config)
    >>> type(optimizer).__name__, optimizer.learning_rate
    ('SGD', 0.1)
    """
    name = str(config.get("class_name", "")).lower()
    classes = _by_key()
    if name not in classes:
        raise ValueError(
            f"Unknown optimizer {config.get('class_name')!r}; known: "
            f"{sorted(saveable_classes('optimizer'))}."
        )
    return classes[name].from_config(config.get("config", {}))


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
        classes = _by_key()
        if key not in classes:
            raise ValueError(
                f"Unknown optimizer {identifier!r}. Valid names: {sorted(classes)}; or pass "
                "a jstrategy.optimizers object such as Adam(learning_rate=1e-3), or an "
                "optax.GradientTransformation."
            )
        return classes[key]()
    raise TypeError(
        f"An optimizer must be a jstrategy.optimizers.Optimizer, a name or a config dict; "
        f"got {type(identifier).__name__} {identifier!r}."
    )


def resolve_optimizer(optimizer: Any) -> tuple[Any, optax.GradientTransformation]:
    """``(the optimizer object, its optax transformation)`` for what `compile` was given.

    A Keras name gives the `jstrategy.optimizers` object with Keras's defaults (as
    ``model.optimizer`` in Keras is an object); an optax transformation is its own object.

    Raises:
      ValueError: for an unknown name.
      TypeError: for anything else.

    Example:

    >>> obj, tx = resolve_optimizer("adam")
    >>> type(obj).__name__, isinstance(tx, optax.GradientTransformation)
    ('Adam', True)
    """
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer, optimizer
    refuse_keras_3_object(optimizer)
    if isinstance(optimizer, (str, dict, Optimizer)):
        obj = get(optimizer)
        return obj, obj.tx
    raise TypeError(
        f"`optimizer` must be a jstrategy.optimizers object (e.g. Adam(learning_rate=1e-3)), "
        f"a Keras name (e.g. 'adam') or an optax.GradientTransformation; got "
        f"{type(optimizer).__name__} {optimizer!r}."
    )
