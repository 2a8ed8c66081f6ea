"""Optimizers for `jstrategy.Model`: what `compile` takes, to optax.

`resolve_optimizer` turns what `Model.compile` accepts (a Keras name such as ``"adam"``, a
`jstrategy.optimizers` object, or an optax transformation) into the optimizer object and
the optax transformation to apply. The learning rate that transformation keeps in the
optimizer state is read and set in `learning_rate.py`; the Keras-named optimizers
themselves live in `keras_optimizers.py`.
"""

from __future__ import annotations

from typing import Any

import optax

from jstrategy._src.training import keras_optimizers

__all__ = ["resolve_optimizer"]


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
    if isinstance(optimizer, (str, dict, keras_optimizers.Optimizer)):
        obj = keras_optimizers.get(optimizer)
        return obj, obj.tx
    raise TypeError(
        f"`optimizer` must be a jstrategy.optimizers object (e.g. Adam(learning_rate=1e-3)), "
        f"a Keras name (e.g. 'adam') or an optax.GradientTransformation; got "
        f"{type(optimizer).__name__} {optimizer!r}."
    )
