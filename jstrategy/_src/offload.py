"""Which variables a sharded strategy keeps in host memory between steps (`OffloadPolicy`;
how placement and the train step follow it: docs/ARCHITECTURE.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence

import jax

from jstrategy._src import placement
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import short_repr

__all__ = ["HOST_MEMORY_KIND", "OffloadPolicy", "resolve_offload"]

#: The memory kind offloaded variables live in: pinned host memory, which devices reach by
#: DMA (as `CentralStorageStrategy`'s central copy).
HOST_MEMORY_KIND = "pinned_host"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    """Which leaves of a train state live in host memory between steps.

    Given as ``offload=`` to `jstrategy.experimental.FSDPStrategy`, `ModelParallelStrategy`
    or `HybridStrategy` (``offload_optimizer=True`` is ``offload=OffloadPolicy()``). Each
    chosen leaf keeps its layout in host memory (``memory_kind="pinned_host"``); the
    compiled train step moves it to device memory for its step and back. Scalars (step
    counts) stay in device memory: they weigh nothing.

    Args:
      optimizer: offload the optimizer state (the leaves under ``opt_state``).
      params: offload the trained parameters (under ``params``) too: they then move to
        device memory at the start of each step, and evaluation and prediction copy them
        to device memory for their call.
      where: a predicate on a leaf's path in the train state, a tuple of str (its keys,
        e.g. ``("opt_state", "inner_state", "slots", "0", "Dense_0", "kernel")``), that
        further restricts the chosen leaves; None keeps them all.

    Raises:
      ValueError: if `optimizer` or `params` is not a bool, or both are False.
      TypeError: if `where` is neither callable nor None.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import jstrategy
    >>> policy = jstrategy.experimental.OffloadPolicy(where=lambda path: "kernel" in path)
    >>> strategy = jstrategy.experimental.FSDPStrategy(min_shard_size=64, offload=policy)
    >>> mu = jax.ShapeDtypeStruct((12, 16), jnp.float32)
    >>> s = strategy.variable_sharding(mu, ("opt_state", "0", "mu", "Dense_0", "kernel"))
    >>> s.spec, s.memory_kind
    (P(None, 'replica'), 'pinned_host')
    >>> strategy.variable_sharding(mu, ("params", "Dense_0", "kernel")).memory_kind
    'device'
    """

    optimizer: bool = True
    params: bool = False
    where: Callable[[tuple[str, ...]], bool] | None = None

    def __post_init__(self) -> None:
        check_bool(self.optimizer, "optimizer", "Pass optimizer=True to offload its state.")
        check_bool(self.params, "params", "Pass params=True to offload the parameters.")
        if not (self.optimizer or self.params):
            raise ValueError(
                "An OffloadPolicy must offload something: `optimizer` and `params` are both "
                "False. Pass optimizer=True and/or params=True, or give the strategy no "
                "`offload` at all."
            )
        if self.where is not None and not callable(self.where):
            raise TypeError(
                "`where` must be a function of a leaf's path (a tuple of str) returning "
                f"whether to offload it, or None; got {short_repr(self.where)}. Pass e.g. "
                'where=lambda path: "kernel" in path.'
            )

    def offloads(self, leaf: jax.ShapeDtypeStruct | jax.Array, path: tuple[str, ...]) -> bool:
        """Whether the variable `leaf` at `path` of a train state lives in host memory.

        Example:

        >>> import jax, jax.numpy as jnp
        >>> policy = OffloadPolicy()
        >>> kernel = jax.ShapeDtypeStruct((4, 8), jnp.float32)
        >>> policy.offloads(kernel, ("opt_state", "0", "mu", "kernel"))
        True
        >>> policy.offloads(kernel, ("params", "kernel"))
        False
        >>> policy.offloads(jax.ShapeDtypeStruct((), jnp.int32), ("opt_state", "count"))
        False
        """
        if not path or not tuple(leaf.shape):
            return False
        names = tuple(str(k) for k in path)
        # The train state's top-level fields (linen's `TrainState` and `NNXTrainState`).
        chosen = (self.optimizer and names[0] == "opt_state") or (
            self.params and names[0] == "params"
        )
        return chosen and (self.where is None or bool(self.where(names)))


def resolve_offload(
    offload: OffloadPolicy | None, offload_optimizer: bool, devices: Sequence[jax.Device]
) -> OffloadPolicy | None:
    """A sharded strategy's constructor arguments ``offload=`` and ``offload_optimizer=``,
    checked: the policy, or None to keep everything in device memory.

    Raises:
      TypeError: if `offload` is not an `OffloadPolicy` (or None).
      ValueError: if `offload_optimizer` is not a bool, both are given, or a device of
        this process has no pinned host memory.

    Example:

    >>> import jax
    >>> resolve_offload(None, True, jax.devices())
    OffloadPolicy(optimizer=True, params=False, where=None)
    >>> print(resolve_offload(None, False, jax.devices()))
    None
    """
    check_bool(
        offload_optimizer,
        "offload_optimizer",
        "Pass offload_optimizer=True to keep the optimizer state in host memory.",
    )
    if offload is not None and not isinstance(offload, OffloadPolicy):
        raise TypeError(
            "`offload` must be a jstrategy.experimental.OffloadPolicy or None; got "
            f"{short_repr(offload)}. Pass e.g. offload=OffloadPolicy(optimizer=True, "
            "params=False), or offload_optimizer=True."
        )
    if offload is not None and offload_optimizer:
        raise ValueError(
            f"Pass `offload_optimizer=True` or `offload={offload!r}`, not both: "
            "offload_optimizer=True is offload=OffloadPolicy(). Drop offload_optimizer, or "
            "say optimizer=True in the policy."
        )
    policy = OffloadPolicy() if offload_optimizer else offload
    if policy is None:
        return None
    # Another process checks its own devices.
    for device in [d for d in devices if d.process_index == jax.process_index()]:
        placement.check_memory_kind(
            device,
            HOST_MEMORY_KIND,
            keeper=f"{policy!r}",
            fix="Train without `offload`/`offload_optimizer`, or on a backend with host "
            "memory (CPU, GPU, TPU).",
        )
    return policy
