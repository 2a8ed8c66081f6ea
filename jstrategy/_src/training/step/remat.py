"""Rematerialization per layer: the train step's ``remat`` option and `remat`, its hook.

A train step built with ``remat=`` (`make_train_step`, `Model.compile`) traces the model's
forward pass with that checkpoint policy in effect (`applying`). The library cannot
rewrite the user's module, so the module says where the layers are: it wraps its repeated
block class with `remat` inside its own ``__call__`` (before `nn.scan`, or before the
unrolled loop). `remat` returns ``nn.remat(block, policy=...)`` while a train step with
``remat`` set traces the model, and the block itself otherwise (initialization,
evaluation, prediction, a step without ``remat``), so the parameters are the same either
way and one checkpoint serves both.

Checkpointing the whole forward pass instead would save nothing: the backward pass would
recompute every activation at once and hold them all, as without remat. Per layer, only
each block's input (a scan's carry) is kept between the passes and one block's
activations are live at a time in the backward pass.

The same marker says where the activations are placed: while a sharded strategy's train
step traces the model (`activation_rows.placing`, with or without ``remat``), `remat`
returns a subclass of the block that first splits its input's rows as the batch's
(`Strategy.activation_rows`), so XLA keeps each replica's rows on its devices between the
blocks instead of gathering them (the model needs no sharding constraint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax

from jstrategy._src import activation_rows
from jstrategy._src import trace_context

__all__ = ["POLICY_NAMES", "RematUnusedError", "applying", "policy_name", "remat", "resolve_remat"]

Policy = Callable[..., bool]

# The policies `remat=` accepts by name: those in jax.checkpoint_policies that are
# policies themselves (not factories taking names).
POLICY_NAMES = (
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
)

# Factories in jax.checkpoint_policies: passing one uncalled is a likely mistake.
_FACTORIES = {
    name: getattr(jax.checkpoint_policies, name)
    for name in (
        "save_only_these_names",
        "save_any_names_but_these",
        "save_anything_except_these_names",
        "save_and_offload_only_these_names",
        "save_from_both_policies",
    )
    if hasattr(jax.checkpoint_policies, name)
}

_HOW = (
    "Pass None or False (no rematerialization), True (recompute everything in each "
    "block: jax.checkpoint_policies.nothing_saveable), a policy from "
    "jax.checkpoint_policies (e.g. dots_saveable, or save_only_these_names('name', ...)) "
    f"or a policy's name, one of {', '.join(map(repr, POLICY_NAMES))}."
)


def policy_name(policy: Policy | None) -> str | None:
    """How `model.save` records a resolved policy: None, its name in
    ``jax.checkpoint_policies``, or ``"custom"`` (a policy built by a factory, e.g.
    ``save_only_these_names(...)``: code, given back to `load_model` by the caller).

    Example:

    >>> import jax
    >>> policy_name(jax.checkpoint_policies.dots_saveable), policy_name(None)
    ('dots_saveable', None)
    >>> policy_name(jax.checkpoint_policies.save_only_these_names("h"))
    'custom'
    """
    if policy is None:
        return None
    for name in POLICY_NAMES:
        if getattr(jax.checkpoint_policies, name, None) is policy:
            return name
    return "custom"


def resolve_remat(value: Any, *, argument: str = "remat") -> Policy | None:
    """The checkpoint policy `value` means, or None for no rematerialization.

    Raises:
      TypeError: for a value that is not a bool, a policy's name or a policy.
      ValueError: for an unknown name, or an uncalled policy factory.

    Example:

    >>> import jax
    >>> resolve_remat(True) is jax.checkpoint_policies.nothing_saveable
    True
    >>> resolve_remat("dots_saveable") is jax.checkpoint_policies.dots_saveable
    True
    >>> resolve_remat(None) is resolve_remat(False) is None
    True
    """
    if value is None or value is False:
        return None
    if value is True:
        return jax.checkpoint_policies.nothing_saveable
    if isinstance(value, str):
        if value not in POLICY_NAMES:
            raise ValueError(
                f"`{argument}` must name a checkpoint policy, one of "
                f"{', '.join(map(repr, POLICY_NAMES))}; got {value!r}. {_HOW}"
            )
        return getattr(jax.checkpoint_policies, value)  # type: ignore[no-any-return]
    for name, factory in _FACTORIES.items():
        if value is factory:
            raise ValueError(
                f"`{argument}` got jax.checkpoint_policies.{name} itself, which makes a "
                f"policy and is not one: call it, e.g. {argument}=jax.checkpoint_policies."
                f"{name}(...) with the names given to jax.ad_checkpoint.checkpoint_name."
            )
    if isinstance(value, (int, float)) or not callable(value):
        raise TypeError(
            f"`{argument}` must be None, a bool, a policy's name or a checkpoint policy "
            f"(a callable); got {value!r} of type {type(value).__name__}. {_HOW}"
        )
    return value  # type: ignore[no-any-return]


@dataclasses.dataclass
class Active:
    """The step's remat record (`trace_context.TraceContext.remat`): its policy, and
    whether the model called `remat` while the step traced it (`check_used`)."""

    policy: Policy
    used: bool = False


def record(policy: Policy | None) -> Active | None:
    """The record a step traces its model with for `policy` (None: no policy in effect)."""
    return None if policy is None else Active(policy)


@contextlib.contextmanager
def applying(policy: Policy | None) -> Iterator[Active | None]:
    """Traces what runs inside with `policy` in effect for `remat` (None: none in effect):
    the remat field of the `trace_context.TraceContext` alone (the step sets it with the
    others).

    Yields the record whose ``used`` says whether the model called `remat`.
    """
    active = record(policy)
    with trace_context.replaced(remat=active):
        yield active


class RematUnusedError(ValueError):
    """A train step with ``remat`` set traced a model that never called `remat`
    (`check_used`); `jstrategy.experimental.plan` reads it as "this model cannot take
    ``remat=True``"."""


def check_used(active: Active | None) -> None:
    """Raises `RematUnusedError` if a step with ``remat`` set traced a model that never
    called `remat`."""
    if active is not None and not active.used:
        raise RematUnusedError(
            "The train step has `remat` set, but the model never called "
            "jstrategy.training.remat, so nothing would be rematerialized. Wrap the "
            "repeated block class inside the model's __call__, e.g. "
            "`blocks = nn.scan(jstrategy.training.remat(Block, prevent_cse=False), "
            "variable_axes={'params': 0}, split_rngs={'params': True}, length=n)`, or "
            "build the step with remat=None."
        )


@functools.lru_cache(maxsize=256)
def _placed(block: type[nn.Module]) -> type[nn.Module]:
    """`block` whose call first places its first argument's rows (`activation_rows.place`).

    A subclass of the same name, fields and variables: the parameters are the block's,
    Flax names unnamed instances as the block's, and a checkpoint serves both. The
    placement is read when the block is called, so a pipeline's stages (which suspend it)
    run the block as written.
    """

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (activation_rows.place(args[0]), *args[1:])
        return block.__call__(self, *args, **kwargs)

    __call__.__doc__ = block.__call__.__doc__
    namespace = {
        "__call__": __call__,
        "__module__": block.__module__,
        "__qualname__": block.__qualname__,
        "__doc__": block.__doc__,
    }
    return type(block.__name__, (block,), namespace)


@functools.lru_cache(maxsize=256)
def _rematted(
    block: type[nn.Module], policy: Policy, prevent_cse: bool, static_argnums: tuple[int, ...]
) -> type[nn.Module]:
    rematted = nn.remat(
        block, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums
    )
    # Flax names an unnamed instance after its class: ``nn.remat``'s is "CheckpointBlock",
    # so unrolled blocks created without names would look for parameters ("CheckpointBlock_0")
    # that the model, created without the step's remat, does not have ("Block_0").
    rematted.__name__, rematted.__qualname__ = block.__name__, block.__qualname__
    return rematted  # type: ignore[no-any-return]


def remat(
    block: type[nn.Module], *, prevent_cse: bool = True, static_argnums: tuple[int, ...] = ()
) -> type[nn.Module]:
    """`block` rematerialized with the train step's ``remat`` policy, or `block` itself.

    Call it inside the model's ``__call__`` (``nn.compact``), where the step's policy is
    in effect while the step traces the model; create the blocks from the class it
    returns, scanned or unrolled. Outside a train step it returns `block` unchanged, and
    ``nn.remat`` adds no level to the parameters, so they are the same with and without
    rematerialization. Under a sharded strategy's train step (FSDP, ModelParallel, Hybrid,
    Pipeline), with or without ``remat``, the class it returns also constrains its first
    argument's rows to the batch's split (`Strategy.activation_rows`; same name, fields
    and parameters as `block`).

    Args:
      block: a Flax linen Module class (the repeated layer).
      prevent_cse: as ``nn.remat``'s: keep True for unrolled blocks; False is safe and
        faster for blocks under ``nn.scan``.
      static_argnums: as ``nn.remat``'s, where ``self`` is argument 0 (e.g. ``(2,)`` for
        a ``train`` flag in ``__call__(self, x, train)``).

    Returns:
      A Module class: ``nn.remat(block, policy=...)``, `block`, or either with its input's
      rows placed.

    Raises:
      TypeError: if `block` is not a linen Module class.

    Example:

    >>> import flax.linen as nn, jax.numpy as jnp, optax, jstrategy
    >>> from jstrategy import training
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, _):
    ...         return x + nn.Dense(x.shape[-1])(jnp.tanh(x)), None
    >>> class Deep(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         block = training.remat(Block, prevent_cse=False)
    ...         scan = nn.scan(block, variable_axes={"params": 0},
    ...                        split_rngs={"params": True}, length=4)
    ...         return scan(name="blocks")(x, None)[0]
    >>> with jstrategy.OneDeviceStrategy("cpu:0").scope():
    ...     state = training.create_train_state(Deep(), optax.sgd(0.1), jnp.ones((1, 3)))
    ...     step = training.make_train_step("mse", remat=True)
    >>> state, logs = step(state, (jnp.ones((2, 3)), jnp.zeros((2, 3))))
    >>> sorted(logs)
    ['loss']
    """
    if not (isinstance(block, type) and issubclass(block, nn.Module)):
        raise TypeError(
            f"`block` must be a flax.linen Module class (the repeated layer, e.g. Block, "
            f"not Block(...)); got {block!r} of type {type(block).__name__}. Pass the class "
            "and create the layers from the class remat returns."
        )
    active = trace_context.current().remat
    key: Any = block  # classes hash by identity
    if activation_rows.current():  # a sharded step: the block's input placed by rows
        key = _placed(key)
    if active is None:
        return key
    active.used = True
    return _rematted(key, active.policy, bool(prevent_cse), tuple(static_argnums))
