"""A model's sharding constraints on the batch, inside the sharded step's per-replica map.

The sharded strategies' train step (`step.global_gradients`) runs each replica's forward
pass under ``jax.vmap(..., spmd_axis_name=data axis)``: the replicas are a mapped
dimension laid out over the data axis. Models written for a global ``jax.jit`` (the Flax
sharding guides') constrain their activations with the data axis on the batch dimension,
``with_sharding_constraint(y, P("data", "model"))``, which JAX refuses inside such a map
("vmap spmd_axis_name ... cannot appear in with_sharding_constraint spec").

Inside a replica the batch dimension holds that replica's rows, and the map already puts
the replicas on the data axis: the constraint's data axis is the map's. So `drop_data_axis`
traces the replica's function once to a jaxpr, removes the data axis from the constraints
on values computed from the batch, and evaluates that jaxpr in the map, whose batching then
adds the data axis on the replica dimension: the global layout is the one the model asked
for (rows over ``"data"``, the rest as constrained). Constraints on values that do not
depend on the batch (a parameter's layout) are kept as they are. Values are unchanged:
constraints move data, never change it.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jstrategy._src import jax_compat

__all__ = ["drop_data_axis"]

_CONSTRAINT = jcore.primitives.sharding_constraint_p


def drop_data_axis(fn: Callable[..., Any], axis: str, batched: Sequence[bool]) -> Callable:
    """`fn` with the data axis `axis` taken out of its constraints on batched values.

    Args:
      fn: the per-replica function, called inside the replicas' ``vmap``.
      axis: the data axis (the map's ``spmd_axis_name``).
      batched: per positional argument of `fn`, whether it is mapped (the batch, the
        mask) or not (the parameters).

    Returns:
      A function of the same arguments and results.
    """

    def wrapped(*args: Any) -> Any:
        leaves, in_tree = jax.tree.flatten(args)
        flags = [
            flag
            for arg, flag in zip(args, batched, strict=True)
            for _ in range(len(jax.tree.leaves(arg)))
        ]
        out_tree: list[Any] = []

        def flat(*leaves: Any) -> list[Any]:
            out_leaves, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, leaves)))
            out_tree.append(tree)
            return out_leaves

        closed = jax.make_jaxpr(flat)(*leaves)
        rewrite = _Rewrite(axis)
        rewritten = rewrite.closed(closed, flags)[0]
        if not rewrite.dropped:
            # No constraint named the data axis: the model runs as written, not re-evaluated
            # from its jaxpr (only models that constrain their batch take this path).
            return fn(*args)
        return jax.tree.unflatten(out_tree[0], jcore.jaxpr_as_fun(rewritten)(*leaves))

    return wrapped


def _open(j: Any) -> Any:
    """The open jaxpr of `j` (a closed jaxpr, or on jax >= 0.12 a jaxpr with its consts)."""
    return j if isinstance(j, jcore.Jaxpr) else j.jaxpr


class _Rewrite:
    """One rewrite of a function's jaxpr: the data axis it drops, and whether it dropped it
    from some constraint (`dropped`)."""

    def __init__(self, axis: str):
        self.axis = axis
        self.dropped = False

    def closed(self, j: Any, flags: Sequence[bool]) -> tuple[Any, list[bool]]:
        new, out = self.open(_open(j), flags)
        return (new if isinstance(j, jcore.Jaxpr) else j.replace(jaxpr=new)), out

    def open(self, jaxpr: Any, flags: Sequence[bool]) -> tuple[Any, list[bool]]:
        """`jaxpr` with the axis dropped from constraints on batched values, and which of its
        outputs are batched (computed from an input whose flag is set)."""
        batched = {v: f for v, f in zip(jaxpr.invars, flags, strict=True)}

        def flag(v: Any) -> bool:
            return not isinstance(v, jcore.Literal) and batched.get(v, False)

        eqns = []
        for eqn in jaxpr.eqns:
            ins = [flag(v) for v in eqn.invars]
            params, outs = self.params(eqn, ins)
            if eqn.primitive is _CONSTRAINT and ins[0]:
                sharding = params["sharding"]
                if isinstance(sharding, NamedSharding) and _names(sharding.spec, self.axis):
                    params = {**params, "sharding": _without(sharding, self.axis)}
                    self.dropped = True
            for v, f in zip(eqn.outvars, outs, strict=True):
                batched[v] = f
            eqns.append(eqn.replace(params=params) if params is not eqn.params else eqn)
        return jaxpr.replace(eqns=eqns), [flag(v) for v in jaxpr.outvars]

    def params(self, eqn: Any, ins: list[bool]) -> tuple[Any, list[bool]]:
        """The equation's params with their inner jaxprs rewritten, and its outputs' flags.

        An inner jaxpr whose inputs are the equation's (calls, remat, custom derivatives'
        primal) is rewritten with their flags, and gives the outputs' flags when its outputs
        are the equation's; a scan's carries are batched once any iteration makes them so.
        Elsewhere (loops' and conditionals' inputs) every inner input is taken as batched when
        any input is: constraints there may lose the data axis, never their values.
        """
        any_in = any(ins)
        if eqn.primitive.name == "scan":
            return self.scan(eqn, ins)
        params = dict(eqn.params)
        changed = False
        found = []
        for key, value in eqn.params.items():
            if isinstance(value, tuple) and value and all(_is_jaxpr(v) for v in value):
                params[key] = tuple(
                    self.closed(v, [any_in] * len(_open(v).invars))[0] for v in value
                )
                changed = True
            elif _is_jaxpr(value):
                n = len(_open(value).invars)
                params[key], outs = self.closed(value, ins if n == len(ins) else [any_in] * n)
                if n == len(ins) and len(outs) == len(eqn.outvars):
                    found.append(outs)
                changed = True
        if not found:
            return (params if changed else eqn.params), [any_in] * len(eqn.outvars)
        return params, [any(fs) for fs in zip(*found, strict=True)]

    def scan(self, eqn: Any, ins: list[bool]) -> tuple[Any, list[bool]]:
        consts, carries = jax_compat.scan_counts(eqn.params)
        flags = list(ins)
        while True:  # a carry is batched once an iteration makes it so: a fixed point
            body, outs = self.closed(eqn.params["jaxpr"], flags)
            carried = [
                a or b
                for a, b in zip(flags[consts : consts + carries], outs[:carries], strict=True)
            ]
            if carried == flags[consts : consts + carries]:
                break
            flags[consts : consts + carries] = carried
        return {**eqn.params, "jaxpr": body}, [*carried, *outs[carries:]]


def _is_jaxpr(value: Any) -> bool:
    return isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr))


def _names(spec: P, axis: str) -> bool:
    return any(axis == e or (isinstance(e, tuple) and axis in e) for e in spec)


def _without(sharding: NamedSharding, axis: str) -> NamedSharding:
    entries = []
    for entry in sharding.spec:
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a != axis)
            entry = kept[0] if len(kept) == 1 else (kept or None)
        elif entry == axis:
            entry = None
        entries.append(entry)
    return NamedSharding(sharding.mesh, P(*entries), memory_kind=sharding.memory_kind)
