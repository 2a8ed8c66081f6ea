"""What `Strategy.scope` enters for Keras 3: the strategy's ``keras.distribution``.

Imported with jstrategy; it imports Keras only when the user already has (and on the JAX
backend), so Keras stays optional and a program without it never loads it.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from jstrategy._src import context
from jstrategy._src.keras3.backend import keras_on_jax
from jstrategy._src.strategy_like import StrategyLike

__all__ = ["keras_distribution_scope"]


def keras_distribution_scope(strategy: StrategyLike) -> contextlib.AbstractContextManager[Any]:
    """The strategy's ``keras.distribution`` scope when Keras (JAX) is imported; else
    nothing. Keras's variables created inside are placed by the strategy, and a model
    compiled inside keeps it (`distribution.capture`)."""
    if not keras_on_jax():
        return contextlib.nullcontext()
    route = importlib.import_module("jstrategy._src.keras3.distribution")
    route.capture()
    refused = route.refusal(strategy)
    if refused is not None:
        return route.refusing(refused)
    return route.distribution_for(strategy).scope()


context.add_scope_hook(keras_distribution_scope)
