"""The weights of Keras's `Dense`, `Conv2D` and `Embedding`, and the checks of a kernel and bias."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jstrategy._src.layers import activations
from jstrategy._src.layers import constraints
from jstrategy._src.layers import initializers
from jstrategy._src.layers import regularizers

__all__ = ["check_kernel_and_bias", "resolve_constraints", "weight"]


def check_kernel_and_bias(layer: Any) -> None:
    """Checks `layer`'s activation, kernel and bias initializers, regularizers and
    constraints, in `validate`.

    The regularizers and constraints are replaced by the objects they name, as Keras
    resolves them.
    """
    activations.get(layer.activation)
    initializers.get(layer.kernel_initializer, "kernel_initializer")
    initializers.get(layer.bias_initializer, "bias_initializer")
    object.__setattr__(layer, "kernel_regularizer", regularizers.get(layer.kernel_regularizer))
    object.__setattr__(
        layer, "bias_regularizer", regularizers.get(layer.bias_regularizer, "bias_regularizer")
    )
    resolve_constraints(layer, "kernel", "bias")


def resolve_constraints(layer: Any, *weights: str) -> None:
    """Replaces `layer`'s ``{weight}_constraint`` arguments by the objects they name."""
    for name in weights:
        argument = f"{name}_constraint"
        object.__setattr__(layer, argument, constraints.get(getattr(layer, argument), argument))


def weight(layer: Any, name: str, shape: tuple[int, ...]) -> Any:
    """The float32 param `name` of `layer`, from its ``{name}_initializer``, with the loss of
    its ``{name}_regularizer`` added; call it in a compact ``__call__``."""
    value = layer.param(
        name,
        initializers.get(getattr(layer, f"{name}_initializer"), f"{name}_initializer"),
        shape,
        jnp.float32,
    )
    regularizers.add_weight_loss(layer, name, value, getattr(layer, f"{name}_regularizer"))
    return value
