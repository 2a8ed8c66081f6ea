"""Placing variables where a strategy keeps them (`Strategy.variable_sharding`).

Train states, checkpoints and the compiled steps all ask the strategy, through the
functions here, where each variable lives; a variable's path is named by `names.path_names`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jstrategy._src import context
from jstrategy._src.devices import canonical_name
from jstrategy._src.names import path_names
from jstrategy._src.names import path_str
from jstrategy._src.values import device_put_global

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = [
    "HOST_MEMORY_KINDS",
    "abstract",
    "check_memory_kind",
    "check_placed",
    "create_placed",
    "creation_shardings",
    "in_device_memory",
    "in_host_memory",
    "lower_creation",
    "moved_to_device",
    "moved_to_host",
    "place_state",
    "splits",
    "variable_shardings",
]

#: Memory kinds of host memory: arrays there must be copied to device memory to compute.
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype of an array (or array-like), without its sharding."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    a = np.asarray(x)
    return jax.ShapeDtypeStruct(a.shape, jax.dtypes.canonicalize_dtype(a.dtype))


def variable_shardings(tree: Any, strategy: StrategyLike) -> Any:
    """``strategy.variable_sharding`` of every leaf of `tree`, as a pytree of shardings."""
    return jax.tree_util.tree_map_with_path(
        lambda keypath, x: strategy.variable_sharding(abstract(x), path_names(keypath)), tree
    )


def place_state(tree: Any, strategy: StrategyLike | None = None) -> Any:
    """Places a train state (or any pytree of variables) where `strategy` keeps variables.

    Each leaf goes to ``strategy.variable_sharding(leaf, path)``: one full copy per replica
    for OneDevice, Mirrored and TPU strategies, one copy in host memory for
    `CentralStorageStrategy` with several compute devices.

    Args:
      tree: a pytree of arrays (NumPy or JAX).
      strategy: the strategy; None means `jstrategy.get_strategy()`.

    Returns:
      The same pytree, its arrays placed as the strategy says.

    Example:

    >>> import jax.numpy as jnp
    >>> import jstrategy
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> placed = place_state({"w": jnp.ones(3)}, strategy)
    >>> len(placed["w"].sharding.device_set)
    2
    """
    strategy = strategy if strategy is not None else context.get_strategy()
    shardings = variable_shardings(tree, strategy)
    tree = jax.tree.map(_to_device_memory_first, tree, shardings)
    if all(s.is_fully_addressable for s in jax.tree.leaves(shardings)):
        return jax.device_put(tree, shardings)  # one batched transfer
    # Shardings spanning other processes' devices (MultiWorkerMirrored): each process
    # places the pieces its own devices hold.
    return jax.tree.map(device_put_global, tree, shardings)


def _to_device_memory_first(x: Any, sharding: jax.sharding.Sharding) -> Any:
    """`x` on `sharding`'s devices in device memory, when it goes to host memory from
    device memory elsewhere: JAX refuses a replicated array of several devices straight
    into one device's host memory ("Memory kind mismatch with xla::PjRtBuffers", as an NNX
    module created on a mesh of its own meets `CentralStorageStrategy`)."""
    if (
        sharding.memory_kind in HOST_MEMORY_KINDS
        and isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)  # traced abstractly (`plan`): no buffer to move
        and x.sharding.memory_kind not in HOST_MEMORY_KINDS
        and x.sharding.device_set != sharding.device_set
    ):
        return jax.device_put(x, sharding.with_memory_kind("device"))
    return x


def check_memory_kind(device: jax.Device, memory_kind: str, *, keeper: str, fix: str) -> None:
    """Raises a `ValueError` naming `keeper`, the device and its memories, and `fix`, when
    `device` has no memory of `memory_kind` (e.g. ``"pinned_host"``) to keep variables in."""
    kinds = [m.kind for m in device.addressable_memories()]
    if memory_kind not in kinds:
        raise ValueError(
            f"{keeper} keeps variables in {memory_kind!r} memory, but "
            f"{canonical_name(device)} has only {kinds}. {fix}"
        )


def splits(shardings: Any) -> bool:
    """Whether any sharding of the pytree `shardings` splits its variable across devices
    (each device holding a slice, not a whole copy)."""
    return any(not s.is_fully_replicated for s in jax.tree.leaves(shardings))


def creation_shardings(fn: Callable[..., Any], *args: Any, strategy: StrategyLike) -> Any:
    """Where `strategy` keeps each output of ``fn(*args)``, from its shapes alone.

    ``fn`` is traced by `jax.eval_shape` (nothing is computed) and every leaf of its
    result gets ``strategy.variable_sharding(leaf, path)``, as `place_state` would give
    it.

    Returns:
      A pytree of shardings shaped like ``fn(*args)``.
    """
    return variable_shardings(jax.eval_shape(fn, *args), strategy)


def _creation_inputs(args: Any, strategy: StrategyLike) -> Any:
    # Arrays already placed (committed) stay where they are; anything else (NumPy sample
    # inputs, a fresh key) reaches every device whole, also across processes.
    replicated = strategy.replicated_sharding()

    def put(x: Any) -> Any:
        if isinstance(x, jax.Array) and x.committed:
            return x
        return device_put_global(x, replicated)

    return jax.tree.map(put, args)


def lower_creation(
    fn: Callable[..., Any], *args: Any, strategy: StrategyLike, shardings: Any = None
) -> jax.stages.Lowered:
    """The program that creates ``fn(*args)`` where `strategy` keeps it, lowered.

    ``jax.jit(fn, out_shardings=...)`` with `creation_shardings` (or `shardings`, when
    already computed): XLA computes each device's slice of every output on that device, so
    no device ever holds a whole variable that its layout splits. ``.compile()`` it to run
    it or to read its ``memory_analysis()`` (the creation's peak per device).
    """
    if shardings is None:
        shardings = creation_shardings(fn, *args, strategy=strategy)
    return jax.jit(fn, out_shardings=shardings).lower(*_creation_inputs(args, strategy))


def create_placed(
    fn: Callable[..., Any],
    *args: Any,
    strategy: StrategyLike,
    eager: Callable[[], Any] | None = None,
    place_args: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
) -> Any:
    """``fn(*args)``, placed where `strategy` keeps variables: created there when split.

    When `variable_sharding` splits any output across devices (FSDP, ModelParallel), the
    outputs are created where they live by one jitted program (`lower_creation`): no whole
    copy of a split variable ever exists on one device. Otherwise `eager` (by default
    ``fn(*args)``) runs op by op and `place_state` places its result: each op's kernel is
    cached across models, while a jitted creation compiles a new program per model.

    Both paths compute the same values (the same keys give the same parameters).

    Args:
      fn: a pure function of `args` returning a pytree of arrays (static fields allowed).
      *args: its arguments (arrays or pytrees of arrays).
      strategy: where the outputs live.
      eager: the eager creation when nothing is split, returning what ``fn(*args)`` does.
      place_args: places `args` for the jitted creation; by default arrays already placed
        stay where they are and everything else is put whole on every device.

    Returns:
      The outputs, placed by `variable_sharding`.
    """
    try:
        abstract_outputs = jax.eval_shape(fn, *args)
    except Exception:
        # Models are created without JAX's mesh, so that Flax's annotations naming another
        # mesh's axes (which Flax would constrain to on a mesh) do not stop their creation.
        # A model whose own code constrains with a bare PartitionSpec
        # (``with_sharding_constraint(x, P("data"))``) needs the mesh while it is traced:
        # nothing was computed yet (the trace above is abstract), so it is traced again
        # under the strategy's, if it has one.
        mesh_context = getattr(strategy, "mesh_context", None)
        if mesh_context is None:
            raise
        with mesh_context():
            shardings = creation_shardings(fn, *args, strategy=strategy)
            return _create(fn, args, shardings, strategy, eager, place_args)
    shardings = variable_shardings(abstract_outputs, strategy)
    return _create(fn, args, shardings, strategy, eager, place_args)


def _create(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    shardings: Any,
    strategy: StrategyLike,
    eager: Callable[[], Any] | None,
    place_args: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None,
) -> Any:
    if not splits(shardings):
        return place_state(eager() if eager is not None else fn(*args), strategy)
    inputs = place_args(args) if place_args is not None else _creation_inputs(args, strategy)
    return jax.jit(fn, out_shardings=shardings)(*inputs)


def in_device_memory(tree: Any) -> Any:
    """`tree` with every array held in host memory copied to device memory, same devices.

    Eager JAX operations that create an array "like" another (``jnp.zeros_like``, hence
    optax's ``tx.init``) and XLA computations fail on host-memory arrays such as
    `CentralStorageStrategy`'s ("Memory kind mismatch with xla::PjRtBuffers"). Run them on
    this copy and put the results back with `place_state`. Arrays in device memory are
    returned as they are.

    Args:
      tree: a pytree of arrays (or one array).

    Returns:
      The same pytree, every array in device memory.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> host = jax.sharding.make_single_device_sharding(jax.devices()[0], memory_kind="pinned_host")
    >>> w = in_device_memory({"w": jax.device_put(jnp.ones(2), host)})["w"]
    >>> w.sharding.memory_kind
    'device'
    """

    leaves, treedef = jax.tree.flatten(tree)
    where = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)  # inside a creation program
        and x.sharding.memory_kind in HOST_MEMORY_KINDS
    ]
    if where:
        # A program copies them, not `jax.device_put`: jax 0.12.1's CPU client refuses to
        # device_put a program's output held in host memory ("Unsupported layout used for
        # PjRt CPU buffers: {0:S(5)}"), and one program moves them all in one dispatch.
        moving = [leaves[i] for i in where]
        targets = [x.sharding.with_memory_kind("device") for x in moving]
        # The copy is written in the program (an identity would keep the host memory space
        # in the outputs' types).
        moved = _mover(tuple(targets))(moving)
        for i, x in zip(where, moved, strict=True):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=64)
def _mover(targets: tuple) -> Any:
    """The program that copies arrays to `targets` (one per layout: CentralStorage runs it
    every step, so it is built once, not wrapped anew by `jax.jit` each call)."""

    def moved(xs: list) -> list:
        return [jax.device_put(x, s) for x, s in zip(xs, targets, strict=True)]

    return jax.jit(moved, out_shardings=list(targets))


def moved_to_device(tree: Any, shardings: Any) -> Any:
    """Inside a program: each leaf of `tree` whose sharding (in `shardings`, shaped like
    `tree`) is in host memory, moved to device memory with the same layout; the others as
    they are.

    XLA computes only on device memory: a program that takes variables kept in host memory
    (`CentralStorageStrategy`'s, a sharded strategy's `OffloadPolicy`) moves them in with
    this, and its ``out_shardings`` write them back.
    """

    def move(x: Any, sharding: jax.sharding.Sharding) -> Any:
        if sharding.memory_kind in HOST_MEMORY_KINDS:
            return jax.device_put(x, sharding.with_memory_kind("device"))
        return x

    return jax.tree.map(move, tree, shardings)


def moved_to_host(tree: Any, shardings: Any) -> Any:
    """Inside a program: each leaf of `tree` whose sharding (in `shardings`, shaped like
    `tree`) is in host memory, moved there; the others as they are.

    The leaves that stay in device memory are not put at all: the TPU compiler refuses a
    program that puts a PRNG key (an extended dtype) beside a move between memory kinds
    (its sharding constraint takes the key's logical rank for its physical one).
    """

    def move(x: Any, sharding: jax.sharding.Sharding) -> Any:
        return jax.device_put(x, sharding) if sharding.memory_kind in HOST_MEMORY_KINDS else x

    return jax.tree.map(move, tree, shardings)


def in_host_memory(shardings: Any) -> bool:
    """Whether any sharding of the pytree `shardings` keeps its variable in host memory."""
    return any(s.memory_kind in HOST_MEMORY_KINDS for s in jax.tree.leaves(shardings))


def _placement(sharding: jax.sharding.Sharding) -> tuple[tuple[jax.Device, ...], str]:
    mesh = getattr(sharding, "mesh", None)
    devices = tuple(mesh.devices.flat) if mesh is not None else tuple(sharding.device_set)
    return devices, sharding.memory_kind or "device"


def check_placed(state: Any, strategy: StrategyLike) -> None:
    """Raises a clear error if `state`'s first array is not where `strategy` keeps it.

    Raises:
      ValueError: naming where the leaf is, where the strategy keeps it, and the fix.
    """
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    found = next(((k, x) for k, x in flat if isinstance(x, jax.Array)), None)
    if found is None:
        return
    keypath, leaf = found
    expected = strategy.variable_sharding(abstract(leaf), path_names(keypath))
    (devices, memory), (want, want_memory) = _placement(leaf.sharding), _placement(expected)
    if set(devices) != set(want) or (len(want) > 1 and devices != want) or memory != want_memory:
        raise ValueError(
            f"The train state is not placed on the step's strategy {strategy!r} (leaf "
            f"{path_str(keypath)} is in {memory} memory of {[str(d) for d in devices]}; the "
            f"strategy keeps it in {want_memory} memory of {[str(d) for d in want]}). Create "
            "the state inside the same strategy.scope(), or call place_state(state, strategy)."
        )
