"""Keras's ``keras.utils.set_random_seed``: one seed for a whole program.

Keras seeds Python's `random`, NumPy's global generator and its own global seed
generator, from which layers draw their initial weights. jstrategy draws a model's
initial weights, dropout masks and shuffling order from the model's ``seed`` argument; a
model created without one takes the seed set here (0 if none was set), so the same
program gives the same run, as in Keras.
"""

from __future__ import annotations

import random

import numpy as np

from jstrategy._src.validation import is_int

__all__ = ["default_seed", "get_random_seed", "set_random_seed"]

_SEED: int | None = None


def set_random_seed(seed: int) -> None:
    """Seeds Python's `random`, NumPy's global generator and the models made afterwards.

    A `jstrategy.Model` or `jstrategy.Sequential` created without ``seed=`` after this call
    uses `seed` (for its initial weights, dropout and shuffling).

    Args:
      seed: a non-negative int.

    Raises:
      ValueError: if `seed` is not an int.

    Example:

    >>> import numpy as np
    >>> set_random_seed(7)
    >>> first = np.random.rand()
    >>> set_random_seed(7)
    >>> bool(np.random.rand() == first), get_random_seed()
    (True, 7)
    >>> set_random_seed(0)
    """
    global _SEED
    if not is_int(seed) or seed < 0:
        raise ValueError(
            f"`seed` must be a non-negative int; got {seed!r}. E.g. set_random_seed(42)."
        )
    _SEED = int(seed)
    random.seed(_SEED)
    np.random.seed(_SEED)


def get_random_seed() -> int | None:
    """The seed `set_random_seed` set, or None: what a model made without ``seed=`` uses
    (0 when None).

    Example:

    >>> set_random_seed(3)
    >>> get_random_seed()
    3
    >>> set_random_seed(0)
    """
    return _SEED


def default_seed(seed: int | None) -> int:
    """A model's seed: `seed` if given, else the one `set_random_seed` set, else 0."""
    if seed is not None:
        return seed
    return 0 if _SEED is None else _SEED
