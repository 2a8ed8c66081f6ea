"""Precision policies: the dtype variables are kept in and the dtype the model computes in.

Keras's names and meanings (`tf.keras.mixed_precision.Policy`): a policy has a
`variable_dtype` (parameters and optimizer state) and a `compute_dtype` (the forward and
backward passes). ``"mixed_bfloat16"`` keeps float32 variables and computes in bfloat16,
which is what TPUs and recent GPUs' matrix units run at full speed; ``"mixed_float16"``
does the same in float16 and needs loss scaling (`DynamicLossScale`) so that small
gradients do not flush to zero.

A policy works on any Flax module without changing it, the way DeepMind's ``jmp`` does
it: inside the differentiated function, the step casts the float32 parameters and the
inputs to the compute dtype (`cast_to_compute`), runs the module, and casts its outputs
back to float32 (`cast_to_float32`) before the loss and metrics. The cast's gradient is a
cast back, so the gradients arrive in the variable dtype and the optimizer never sees the
compute dtype. Flax layers promote their inputs and parameters to a common dtype, so a
module given bfloat16 parameters and inputs computes in bfloat16; modules with an explicit
``dtype`` attribute keep it. Integer, boolean and PRNG-key leaves (token ids, masks, keys)
are never cast.

Example:

>>> import jax.numpy as jnp
>>> policy = Policy("mixed_bfloat16")
>>> policy.variable_dtype, policy.compute_dtype
('float32', 'bfloat16')
>>> tree = cast_to_compute({"w": jnp.ones(2), "ids": jnp.arange(2)}, policy)
>>> str(tree["w"].dtype), str(tree["ids"].dtype)
('bfloat16', 'int32')
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Policy",
    "as_policy",
    "cast_to_compute",
    "cast_to_float32",
    "cast_to_variable",
    "global_policy",
    "set_global_policy",
]

# name -> (variable dtype, compute dtype), as Keras defines them.
_POLICIES: dict[str, tuple[str, str]] = {
    "float32": ("float32", "float32"),
    "float16": ("float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "mixed_float16": ("float32", "float16"),
    "mixed_bfloat16": ("float32", "bfloat16"),
}


class Policy:
    """A dtype policy: the dtype of variables and the dtype of computations.

    The names and their meanings are Keras's:

    ====================  ==============  =============
    name                  variable_dtype  compute_dtype
    ====================  ==============  =============
    ``"float32"``         float32         float32
    ``"mixed_bfloat16"``  float32         bfloat16
    ``"mixed_float16"``   float32         float16
    ``"bfloat16"``        bfloat16        bfloat16
    ``"float16"``         float16         float16
    ====================  ==============  =============

    A policy is immutable, hashable and equal to any other policy of the same name.

    Args:
      name: one of the names above.

    Raises:
      ValueError: if `name` is not one of them.

    Example:

    >>> policy = Policy("mixed_float16")
    >>> policy
    <Policy "mixed_float16">
    >>> policy.name, policy.variable_dtype, policy.compute_dtype
    ('mixed_float16', 'float32', 'float16')
    """

    __slots__ = ("_name",)

    def __init__(self, name: str):
        if not isinstance(name, str) or name not in _POLICIES:
            raise ValueError(
                f"`name` must be one of {sorted(_POLICIES)}; got {name!r}. For bfloat16 "
                "compute with float32 variables, the usual choice on TPUs and recent GPUs, "
                "use Policy('mixed_bfloat16')."
            )
        self._name = name

    @property
    def name(self) -> str:
        """The policy's name, e.g. ``"mixed_bfloat16"``."""
        return self._name

    @property
    def variable_dtype(self) -> str:
        """The dtype parameters and optimizer state are kept in, e.g. ``"float32"``."""
        return _POLICIES[self._name][0]

    @property
    def compute_dtype(self) -> str:
        """The dtype of the forward and backward passes, e.g. ``"bfloat16"``."""
        return _POLICIES[self._name][1]

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other._name == self._name

    def __hash__(self) -> int:
        return hash((Policy, self._name))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Policy, (self._name,))


def as_policy(value: Policy | str | None, *, argument: str = "policy") -> Policy:
    """A `Policy` from a policy, a policy name, or None (the global policy).

    Args:
      value: a `Policy`, one of its names, or None.
      argument: the caller's argument name, for the error message.

    Returns:
      The `Policy`.

    Raises:
      ValueError: if `value` is a string that names no policy.
      TypeError: if `value` is of another type.

    Example:

    >>> as_policy("bfloat16")
    <Policy "bfloat16">
    """
    if value is None:
        return global_policy()
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        if value not in _POLICIES:
            raise ValueError(
                f"`{argument}` must be a jstrategy.mixed_precision.Policy or one of "
                f"{sorted(_POLICIES)}; got {value!r}."
            )
        return Policy(value)
    raise TypeError(
        f"`{argument}` must be a jstrategy.mixed_precision.Policy, one of "
        f"{sorted(_POLICIES)}, or None; got {type(value).__name__} {value!r}."
    )


# Process-wide, as in TF (Keras 3 keeps it per thread): threads that build models, such as
# a parameter-server coordinator's, see the policy the main thread set.
_LOCK = threading.Lock()
_GLOBAL = Policy("float32")


def global_policy() -> Policy:
    """The policy used where none is given; ``"float32"`` until `set_global_policy`.

    Returns:
      The process-wide `Policy`.

    Example:

    >>> global_policy()
    <Policy "float32">
    """
    with _LOCK:
        return _GLOBAL


def set_global_policy(policy: Policy | str | None) -> None:
    """Sets the policy used where none is given, as `tf.keras.mixed_precision.set_global_policy`.

    The setting is process-wide and safe to call from any thread.

    Args:
      policy: a `Policy`, a policy name such as ``"mixed_bfloat16"``, or None to restore
        the default ``"float32"``.

    Raises:
      ValueError: if `policy` is a string that names no policy.
      TypeError: if `policy` is of another type.

    Example:

    >>> set_global_policy("mixed_bfloat16")
    >>> global_policy().compute_dtype
    'bfloat16'
    >>> set_global_policy(None)
    >>> global_policy().name
    'float32'
    """
    global _GLOBAL
    resolved = Policy("float32") if policy is None else as_policy(policy, argument="policy")
    with _LOCK:
        _GLOBAL = resolved


def _is_floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    # PRNG keys have an extended dtype that is not a subtype of floating.
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """`tree` with its floating-point leaves cast to `dtype`; other leaves as they are.

    NumPy arrays stay NumPy arrays and JAX arrays stay JAX arrays; leaves already of
    `dtype` are returned unchanged. Python scalars have no dtype and are left alone (JAX
    treats them as weakly typed, so they adopt the dtype they meet).

    Args:
      tree: any pytree.
      dtype: the floating-point dtype, e.g. ``"bfloat16"`` or ``jnp.float32``.

    Returns:
      The same pytree structure with floating leaves of `dtype`.

    Example:

    >>> import numpy as np
    >>> out = cast_floating({"x": np.ones(2), "n": np.arange(2)}, "float16")
    >>> out["x"].dtype, out["n"].dtype == np.arange(2).dtype
    (dtype('float16'), True)
    """
    target = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if not _is_floating(x) or x.dtype == target:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, target, sharding=x.sharding)
        return x.astype(target)

    return jax.tree.map(cast, tree)


def cast_to_compute(tree: Any, policy: Policy | str | None = None) -> Any:
    """Casts the floating leaves of `tree` (parameters, inputs) to the compute dtype.

    Call it inside the differentiated function, so that gradients flow back through the
    cast to the variables in their own dtype.

    Args:
      tree: a pytree of parameters or inputs.
      policy: a `Policy` or its name; None means `global_policy()`.

    Returns:
      `tree` with floating leaves in ``policy.compute_dtype``; integer, boolean and PRNG
      key leaves untouched.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> p = {"kernel": jnp.ones((2, 2)), "key": jax.random.key(0)}
    >>> out = cast_to_compute(p, "mixed_float16")
    >>> str(out["kernel"].dtype), out["key"] is p["key"]
    ('float16', True)
    """
    return cast_floating(tree, as_policy(policy).compute_dtype)


def cast_to_variable(tree: Any, policy: Policy | str | None = None) -> Any:
    """Casts the floating leaves of `tree` to the variable dtype (for newly created variables).

    Args:
      tree: a pytree of parameters, e.g. from ``module.init``.
      policy: a `Policy` or its name; None means `global_policy()`.

    Returns:
      `tree` with floating leaves in ``policy.variable_dtype``; other leaves untouched.

    Example:

    >>> import jax.numpy as jnp
    >>> str(cast_to_variable({"w": jnp.ones(2)}, "bfloat16")["w"].dtype)
    'bfloat16'
    """
    return cast_floating(tree, as_policy(policy).variable_dtype)


def cast_to_float32(tree: Any) -> Any:
    """Casts the floating leaves of `tree` to float32: model outputs before losses and metrics.

    Args:
      tree: a pytree, e.g. a model's logits.

    Returns:
      `tree` with floating leaves in float32; other leaves untouched.

    Example:

    >>> import jax.numpy as jnp
    >>> str(cast_to_float32(jnp.ones(2, jnp.bfloat16)).dtype)
    'float32'
    """
    return cast_floating(tree, np.float32)
