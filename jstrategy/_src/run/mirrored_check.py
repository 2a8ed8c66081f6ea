"""A debug mode that makes replicas disagreeing on a value that must be mirrored an error.

`Strategy.run` hands each replica its own copy of a replicated argument (TF's mirrored
variable components), so the gradient with respect to it is the replica's own and an
all-reduce combines them. Forget the all-reduce, and parameters updated from the local
gradients drift apart, replica by replica, with no error: each replica trains on its own
data.

Which outputs must be mirrored is a matter of types: an output computed only from
replicated arguments, constants and collectives' results is the same on every replica in a
correct program. `run` finds them by tracing the function once more with replicated
arguments typed as one shared value (JAX's "invariant"): the outputs that come out
invariant there, but per-replica in the real program, are those. With the check on, the
program also compares a fingerprint of each (the sum and the sum of squares of its
elements, compared with one small all-reduce) across replicas, and `run` raises when they
differ. It costs a pass over those outputs and a host read per call, hence a debug mode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.validation import check_bool
from jstrategy._src.values import key_data

__all__ = ["disagreement", "enabled", "experimental_check_mirrored"]

_GLOBAL = {"enabled": False}


def experimental_check_mirrored(enabled: bool = True) -> None:
    """Makes `Strategy.run` raise when replicas disagree on a value that must be mirrored.

    A debug mode. An output of the function given to `run` that is computed only from
    replicated arguments, constants and collectives (an `all_reduce`'s result) must be the
    same on every replica: parameters updated from all-reduced gradients are such values.
    With the check on, `run` compares those outputs across replicas after every call and
    raises a `ValueError` naming the output when they differ, e.g. when the gradients were
    not all-reduced. The check costs a pass over those outputs and a host synchronization
    per call, so leave it off for speed. Programs compiled before the switch keep their
    mode: switch it on before the first `run`.

    Args:
      enabled: True to check, False to stop checking.

    Raises:
      TypeError: if `enabled` is not a bool.

    Example:

    >>> import jstrategy
    >>> jstrategy.config.experimental_check_mirrored(True)
    >>> jstrategy.config.experimental_check_mirrored(False)
    """
    check_bool(enabled, "enabled", error=TypeError)
    _GLOBAL["enabled"] = enabled


def enabled() -> bool:
    """Whether `experimental_check_mirrored` is on."""
    return _GLOBAL["enabled"]


def _fingerprint(x: Any) -> jax.Array:
    x = key_data(jnp.asarray(x)).astype(jnp.float32)
    return jnp.stack([jnp.sum(x), jnp.sum(x * x)])


def disagreement(leaves: list[Any], axis_name: str) -> jax.Array:
    """One bool per leaf, the same on every replica: whether the replicas' values differ.

    Replicas that computed the same value with the same program hold the same bits, so the
    fingerprints are compared exactly.
    """
    prints = jnp.stack([_fingerprint(x) for x in leaves])
    high = jax.lax.pmax(prints, axis_name)
    low = jax.lax.pmin(prints, axis_name)
    # NaN fingerprints compare unequal to themselves; they are not a disagreement.
    same = (high == low) | (jnp.isnan(high) & jnp.isnan(low))
    return ~jnp.all(same, axis=-1)
