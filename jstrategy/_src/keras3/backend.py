"""Keras 3, imported and checked: the one door the Keras route goes through."""

from __future__ import annotations

import os
import sys
from types import ModuleType

__all__ = ["keras_on_jax", "require_keras"]

#: The oldest Keras 3 whose Distribution, stateless_call and JAX trainer the route reads.
MIN_KERAS = (3, 10)


def keras_on_jax() -> bool:
    """Whether Keras is already imported, on the JAX backend (imports nothing).

    Example:

    >>> isinstance(keras_on_jax(), bool)
    True
    """
    keras = sys.modules.get("keras")
    if keras is None:
        return False
    try:
        return keras.backend.backend() == "jax"
    except AttributeError:  # a Keras 2 or a half-imported module: not ours to drive
        return False


def require_keras(feature: str) -> ModuleType:
    """Keras 3 on the JAX backend, imported.

    Args:
      feature: what needs it, for the errors.

    Raises:
      ImportError: Keras is not installed, or older than 3.10.
      ValueError: Keras runs on another backend.
    """
    if "keras" not in sys.modules:
        # The route runs Keras on JAX only: where nobody chose a backend, choose JAX rather
        # than Keras's default (TensorFlow, which fails to import where it is not installed).
        os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        import keras
    except ImportError as e:
        raise ImportError(
            f"{feature} needs Keras 3 (JAX backend): pip install 'jstrategy[keras]' "
            f"(importing keras failed: {e})."
        ) from e
    version = tuple(int(p) for p in keras.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_KERAS:
        raise ImportError(
            f"{feature} needs keras>=3.10; found keras {keras.__version__}. "
            "pip install 'jstrategy[keras]' upgrades it."
        )
    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            f"{feature} runs Keras on JAX; Keras's backend is {backend!r} "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Set "
            "KERAS_BACKEND=jax before Keras is first imported."
        )
    return keras
