"""Flax's own sharding annotations, read where a model's variables are created.

Flax users say where a variable lives in the model: linen boxes it (`nn.with_partitioning`
gives an `nn.Partitioned`, `nn.with_logical_partitioning` an `nn.LogicallyPartitioned`
whose logical names logical axis rules map to mesh axes); NNX keeps it in the variable's
metadata (``out_sharding``, set by `nnx.with_partitioning` or ``sharding_names=``). The
train-state creation code hands the variables here once:

* `unbox` strips linen's boxes (the train state holds plain arrays, so the steps,
  checkpoints and summaries see the paths users write, ``Dense_0/kernel``, not
  ``Dense_0/kernel/value``) and returns each annotated variable's `PartitionSpec`;
  `nnx_specs` reads the same from NNX variables.
* `record` tells the strategy: its `variable_sharding` then finds the annotation of a
  variable (or of the parameter an optimizer moment belongs to) with `annotation`.
  `ModelParallelStrategy` places annotated variables as annotated (its `LayoutMap`
  overrides them); `FSDPStrategy` honours an annotation's data axis; the other strategies
  replicate variables whatever their annotations say.

Annotations are kept per strategy, by variable path: the latest model created under a
strategy decides the annotation of a path.
"""

from __future__ import annotations

import dataclasses
import difflib
import threading
import weakref
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
from flax.core import meta
from flax.core import spmd as flax_spmd
from flax.linen import spmd as linen_spmd
from jax.sharding import PartitionSpec as P

from jstrategy._src import axes
from jstrategy._src.layout_map import NNX_VALUE
from jstrategy._src.layout_map import matches_path
from jstrategy._src.layout_map import misfit
from jstrategy._src.names import path_names

if TYPE_CHECKING:
    from jstrategy._src.strategy_like import StrategyLike

__all__ = [
    "DATA_AXES",
    "FoundLayout",
    "PARAMS",
    "annotation",
    "candidate_paths",
    "check_layout_keys",
    "data_dim",
    "find_layout",
    "logical_rules",
    "nnx_specs",
    "prepare",
    "prepare_nnx",
    "record",
    "step_rules",
    "unbox",
    "user_path",
]

#: The collection of Flax's parameters (and the train state's field holding them): not part
#: of the paths that layouts and annotations are looked up by, as in Keras.
PARAMS = "params"


_LOCK = threading.Lock()
_RECORDED: weakref.WeakKeyDictionary[Any, dict[str, P]] = weakref.WeakKeyDictionary()


#: The mesh axis names that mean data parallelism in the annotations users write (Flax's
#: guides' ``"data"``, MaxText's ``"fsdp"``, ``"batch"``): a sharded strategy reads them
#: as its own data axis.
DATA_AXES = axes.DATA_AXES


def logical_rules(strategy: StrategyLike | None) -> tuple[tuple[str, Any], ...]:
    """The logical axis rules in force: the strategy's (``logical_axis_rules=``), then
    those of Flax's ``nn.logical_axis_rules`` context."""
    own = tuple(getattr(strategy, "logical_axis_rules", ()) or ())
    return own + tuple(flax_spmd.get_logical_axis_rules())


def _mesh_axes_on(strategy: StrategyLike, target: Any) -> Any:
    """A rule's mesh axes (a name, a tuple of names or None) as `strategy` reads them."""
    if target is None:
        return None
    names = (target,) if isinstance(target, str) else tuple(target)
    mapped = tuple(dict.fromkeys(a for a in map(strategy.annotation_axis, names) if a))
    if not mapped:
        return None
    return mapped[0] if isinstance(target, str) or len(mapped) == 1 else mapped


def step_rules(strategy: StrategyLike) -> tuple[tuple[str, Any], ...]:
    """The logical axis rules a program of `strategy` is traced under.

    `logical_rules`, each rule's mesh axes read by ``strategy.annotation_axis``: a model
    whose rules name another mesh's axes (``("mlp", "model")`` under `FSDPStrategy`)
    constrains its activations on this strategy's axes, or not at all. When no rule
    names an axis of this strategy, no rule is left, so ``nn.with_logical_constraint``
    does nothing (as outside any mesh).

    Example:

    >>> import flax.linen as nn, jstrategy
    >>> with nn.logical_axis_rules([("batch", "data"), ("mlp", "model")]):
    ...     step_rules(jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]))
    ()
    """
    rules = tuple(
        (name, _mesh_axes_on(strategy, target)) for name, target in logical_rules(strategy)
    )
    return rules if any(target is not None for _, target in rules) else ()


def _logical_to_mesh(names: Sequence[Any], rules: Sequence[Any]) -> P:
    return P(*(linen_spmd.logical_to_mesh_axes(tuple(names), tuple(rules)) or ()))


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def unbox(variables: Any, strategy: StrategyLike | None = None) -> tuple[Any, dict[str, P]]:
    """``(variables without linen's boxes, {path: PartitionSpec} of the annotated ones)``.

    Works on concrete and on abstract (``jax.eval_shape``) variables alike. A
    `nn.LogicallyPartitioned` variable's logical names are mapped to mesh axes by its own
    rules if it has some, else by `logical_rules` (the strategy's, then Flax's context's);
    a logical name no rule maps stays whole, as in Flax.

    Args:
      variables: a linen ``module.init`` result (``{"params": ..., ...}``) or any pytree.
      strategy: the strategy whose ``logical_axis_rules`` apply, if any.

    Returns:
      The unboxed pytree, and each annotated variable's mesh axes by its path without the
      collection (``"Dense_0/kernel"``).

    Example:

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    >>> variables = nn.Dense(8, kernel_init=kernel_init).init(jax.random.key(0), jnp.ones((1, 4)))
    >>> plain, specs = unbox(variables)
    >>> type(plain["params"]["kernel"]).__name__, specs
    ('ArrayImpl', {'kernel': P(None, 'model')})
    """
    rules = None
    specs: dict[str, P] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(variables, is_leaf=_is_box)
    for keypath, leaf in flat:
        if not isinstance(leaf, meta.Partitioned):
            continue
        names = leaf.names
        if isinstance(leaf, linen_spmd.LogicallyPartitioned):
            if leaf.rules is not None:
                spec = _logical_to_mesh(names, leaf.rules)
            else:
                rules = logical_rules(strategy) if rules is None else rules
                spec = _logical_to_mesh(names, rules)
        else:
            spec = P(*names)
        specs[user_path(path_names(keypath))] = spec
    return meta.unbox(variables), specs


def nnx_specs(state: Any, strategy: StrategyLike | None = None) -> dict[str, P]:
    """``{path: PartitionSpec}`` of an NNX state's variables that carry ``out_sharding``.

    Logical names are mapped by the variable's own ``sharding_rules`` together with
    `logical_rules`, as `nnx.get_partition_spec` does.

    Args:
      state: an `nnx.State` (e.g. ``nnx.split(model)[1]``), its leaves `nnx.Variable`s.
      strategy: the strategy whose ``logical_axis_rules`` apply, if any.

    Returns:
      Each annotated variable's mesh axes by its path (``"dot1/kernel"``).
    """
    from flax import nnx

    specs: dict[str, P] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    for keypath, leaf in flat:
        if not isinstance(leaf, nnx.Variable):
            continue
        metadata = leaf.get_metadata()
        names = metadata.get("out_sharding")
        if not names:
            continue
        if isinstance(names, jax.sharding.NamedSharding):
            spec = names.spec
        else:
            local = tuple(metadata.get("sharding_rules") or ())
            rules = flax_spmd.composite_rules(logical_rules(strategy), local)
            spec = P(*flax_spmd.from_sharding_rules(tuple(names), rules))
        specs[user_path(path_names(keypath))] = spec
    return specs


def user_path(names: Sequence[str]) -> str:
    """A variable's path as users write it: without ``params/`` and NNX's ``/value``.

    Example:

    >>> user_path(("params", "Dense_0", "kernel")), user_path(("params", "dot1", "kernel", "value"))
    ('Dense_0/kernel', 'dot1/kernel')
    """
    names = list(names)
    if len(names) > 1 and names[0] == PARAMS:
        names = names[1:]
    if len(names) > 1 and names[-1] == NNX_VALUE:
        names = names[:-1]
    return "/".join(names)


def candidate_paths(names: Sequence[str]) -> tuple[bool, list[str]]:
    """``(is_parameter, paths)``: what a leaf of a train state is looked up by.

    A parameter (a leaf under ``params``) by its `user_path`; any other leaf (an optimizer
    moment ``opt_state/1/0/mu/Dense_0/kernel``, a BatchNorm statistic) by the suffixes of
    its path, longest first, so that it follows the parameter whose path ends its own.

    Example:

    >>> candidate_paths(("opt_state", "0", "mu", "Dense_0", "kernel"))
    (False, ['opt_state/0/mu/Dense_0/kernel', '0/mu/Dense_0/kernel', 'mu/Dense_0/kernel', 'Dense_0/kernel', 'kernel'])
    """
    names = tuple(str(k) for k in names)
    if len(names) > 1 and names[-1] == NNX_VALUE:
        names = names[:-1]
    if len(names) > 1 and names[0] == PARAMS:
        return True, ["/".join(names[1:])]
    return False, ["/".join(names[i:]) for i in range(len(names))]


def record(strategy: StrategyLike, specs: Mapping[str, P]) -> None:
    """Makes `specs` (from `unbox` or `nnx_specs`) the annotations `strategy` sees.

    They replace those recorded for the same paths by an earlier model.
    """
    if not specs:
        return
    with _LOCK:
        _RECORDED.setdefault(strategy, {}).update(specs)


def annotation(strategy: StrategyLike, names: Sequence[str]) -> tuple[str, P] | None:
    """``(path, spec)`` of the annotation recorded for the leaf at `names`, or None.

    Looked up as `candidate_paths` says: a parameter by its own path, another leaf by the
    first of its suffixes that names an annotated parameter.
    """
    recorded = _RECORDED.get(strategy)
    if not recorded:
        return None
    for candidate in candidate_paths(names)[1]:
        spec = recorded.get(candidate)
        if spec is not None:
            return candidate, spec
    return None


@dataclasses.dataclass(frozen=True)
class FoundLayout:
    """Where a leaf's layout comes from (`find_layout`).

    Attributes:
      path: the path the layout was found by (the leaf's, or its parameter's).
      layout: the layout, as the `LayoutMap` or the annotation names its axes.
      from_map: whether a `LayoutMap` key gave it (else a Flax annotation).
      source: how a message names it.
      is_parameter: whether the leaf is a parameter (not an optimizer moment or a statistic).
    """

    path: str
    layout: P
    from_map: bool
    source: str
    is_parameter: bool

    def fitted(
        self,
        layout: P,
        shape: Sequence[int],
        mesh_shape: Any,
        *,
        strict: bool,
        shown: str | None = None,
    ) -> P | None:
        """`layout` (this one, its axes read on a mesh) if it fits `shape` on a mesh of
        `mesh_shape`; else None, or for a parameter (under `strict`) the error naming the
        path (`shown`, by default the path it was found by), the shape, the source and
        the fix."""
        problem = misfit(layout, tuple(shape), mesh_shape)
        if problem is None:
            return layout
        if strict and self.is_parameter:
            raise ValueError(
                f"Variable {(shown or self.path)!r} of shape {tuple(shape)} does not fit "
                f"{self.source}: {problem}. Change the layout, or the variable's shape."
            )
        return None  # an annotation for another mesh, or a moment of another shape


def find_layout(
    strategy: StrategyLike, layout_map: Any, names: Sequence[str]
) -> FoundLayout | None:
    """The layout of the leaf at `names`: the first `LayoutMap` key matching one of its
    `candidate_paths`, else the Flax annotation recorded for it; None without either.

    The one lookup of the strategies that lay variables out by a map and annotations
    (`ModelParallelStrategy`, `ParallelStrategy`).
    """
    is_parameter, candidates = candidate_paths(names)
    for candidate in candidates if layout_map is not None else ():
        key, layout = layout_map.lookup(candidate)
        if layout is not None:
            source = f"the layout {tuple(layout)} of LayoutMap key {key!r}"
            return FoundLayout(candidate, layout, True, source, is_parameter)
    found = annotation(strategy, names)
    if found is None:
        return None
    source = f"its Flax sharding annotation {tuple(found[1])}"
    return FoundLayout(found[0], found[1], False, source, is_parameter)


def data_dim(
    strategy: StrategyLike, names: Sequence[str], shape: Sequence[int], axes: Sequence[str]
) -> int | None:
    """The dimension of the leaf at `names` that its annotation splits over one of `axes`.

    None when it has no annotation, the annotation splits no dimension over `axes`, or
    that dimension does not divide by the strategy's replicas.
    """
    found = annotation(strategy, names)
    if found is None:
        return None
    for dim, entry in enumerate(found[1]):
        named = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if dim < len(shape) and any(name in axes for name in named):
            return dim if shape[dim] % strategy.num_replicas_in_sync == 0 else None
    return None


def prepare(variables: Any, strategy: StrategyLike) -> Any:
    """Linen variables as the train state holds them, their annotations told to `strategy`.

    Strips the boxes (`unbox`), `record`s the annotations, and checks a `LayoutMap`'s keys
    against the variables (`check_layout_keys`), before any work on the variables. Works on
    abstract (``jax.eval_shape``) variables too.

    Args:
      variables: a linen ``module.init`` result, concrete or abstract.
      strategy: the strategy that will hold them.

    Returns:
      The variables without boxes.

    Raises:
      ValueError: if a `LayoutMap` key matches no variable.
    """
    plain, specs = unbox(variables, strategy)
    _check_layouts(strategy, plain)
    record(strategy, specs)
    return plain


def prepare_nnx(state: Any, strategy: StrategyLike) -> None:
    """`prepare` for an NNX module's state (``nnx.split(model)[1]``): its variables'
    ``out_sharding`` annotations told to `strategy`, a `LayoutMap`'s keys checked."""
    _check_layouts(strategy, state)
    record(strategy, nnx_specs(state, strategy))


def _check_layouts(strategy: StrategyLike, tree: Any) -> None:
    layout_map = getattr(strategy, "layout_map", None)
    if layout_map is not None:
        check_layout_keys(layout_map, tree, where="LayoutMap key")


def check_layout_keys(keys: Iterable[str], tree: Any, *, where: str) -> None:
    """Raises if a layout key (a regex) matches none of the parameters of `tree`.

    Args:
      keys: the `LayoutMap`'s keys.
      tree: the model's variables (``{"params": ...}``, or an NNX state), whose paths under
        ``params`` (all of them for an NNX state) the keys must match.
      where: what the keys belong to, for the message (``"LayoutMap key"``).

    Raises:
      ValueError: naming the key and the nearest variable paths, before any work.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)
    paths = sorted({user_path(path_names(keypath)) for keypath, _ in flat})
    for key in keys:
        if any(key == path or matches_path(key, path) for path in paths):
            continue
        nearest = difflib.get_close_matches(key, paths, n=3, cutoff=0.0)
        raise ValueError(
            f"{where} {key!r} matches no variable of the model, so its layout would be "
            f"silently unused. The nearest variable paths are {nearest}. Fix the key (keys "
            "are regexes searched in paths such as 'Dense_0/kernel', without 'params/'), "
            "or delete it."
        )
