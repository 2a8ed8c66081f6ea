"""Overhead of `strategy.run` against the same step hand-written with `jax.jit`.

Both compute one data-parallel training step of the same MLP with the same layout:
parameters and optimizer state replicated over the devices, the global batch split by rows.
The hand-written step is `jax.jit` with `NamedSharding`s (XLA inserts the all-reduce); the
jstrategy step is a per-replica function given to `MirroredStrategy.run`, which all-reduces
gradients through the replica context. Timings are interleaved medians from one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/overhead.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

import jstrategy


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.width)(x))
        x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def main(argv: list[str] | None = None) -> None:
    args = _common.mlp_step_arguments(__doc__.splitlines()[0], argv)

    strategy = jstrategy.MirroredStrategy()  # the default: NcclAllReduce, XLA packs
    packed = jstrategy.MirroredStrategy(cross_device_ops=jstrategy.NcclAllReduce(num_packs=1))
    mesh = strategy.mesh
    model, tx = MLP(args.width), optax.sgd(0.01, momentum=0.9)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=(args.batch,)).astype(np.int32)

    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P(jstrategy.REPLICA_AXIS))
    params = jax.device_put(model.init(jax.random.key(0), x[:1])["params"], replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    x_dev, y_dev = jax.device_put(x, rows), jax.device_put(y, rows)

    def loss_sum(p, xb, yb):
        logits = model.apply({"params": p}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).sum()

    # Hand-written: global-view jit; XLA partitions it and inserts the gradient all-reduce.
    @jax.jit
    def jit_step(p, s, xb, yb):
        loss, grads = jax.value_and_grad(lambda p: loss_sum(p, xb, yb) / args.batch)(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    # jstrategy: per-replica function, gradients all-reduced through the replica context.
    def replica_step(p, s, xb, yb):
        ctx = jstrategy.get_replica_context()
        loss, grads = jax.value_and_grad(lambda p: loss_sum(p, xb, yb) / args.batch)(p)
        grads, loss = ctx.all_reduce("SUM", (grads, loss))
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    # Hand-written jit(shard_map): the same per-replica program run compiles, without
    # jstrategy's Python around it, so the ratio to it is the library's own overhead.
    axis = jstrategy.REPLICA_AXIS

    def manual_body(p, s, xb, yb):
        p_local = jax.tree.map(lambda v: jax.lax.pcast(v, axis, to="varying"), p)
        loss, grads = jax.value_and_grad(lambda q: loss_sum(q, xb, yb) / args.batch)(p_local)
        grads, loss = jax.lax.psum((grads, loss), axis)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    manual_step = jax.jit(
        jax.shard_map(manual_body, mesh=mesh, in_specs=(P(), P(), P(axis), P(axis)), out_specs=P())
    )

    def run_manual(_):
        p, s, loss = manual_step(*state["manual"], x_dev, y_dev)
        state["manual"] = (p, s)
        return loss

    x_pr = jstrategy.PerReplica(x_dev, stacked=False)
    y_pr = jstrategy.PerReplica(y_dev, stacked=False)
    state = {k: (params, opt_state) for k in ("jit", "manual", "run", "packed")}

    def run_jit(_):
        p, s, loss = jit_step(*state["jit"], x_dev, y_dev)
        state["jit"] = (p, s)
        return loss

    def run_strategy(_):
        p, s, loss = strategy.run(replica_step, (*state["run"], x_pr, y_pr))
        state["run"] = (p, s)
        return loss

    def run_packed(_):
        p, s, loss = packed.run(replica_step, (*state["packed"], x_pr, y_pr))
        state["packed"] = (p, s)
        return loss

    # Same numbers first: the comparison is only meaningful between equal programs. Twenty
    # steps from the same state; over hundreds of steps float reduction order drifts.
    for i in range(20):
        la, lb, lc, ld = (float(f(i)) for f in (run_jit, run_strategy, run_packed, run_manual))
        for other in (lb, lc, ld):
            assert abs(la - other) <= 1e-5 * max(1.0, abs(la)), (i, la, other)
    for name in ("run", "packed"):
        params_run = strategy.experimental_local_results(state[name][0])[0]
        for a, b in zip(jax.tree.leaves(state["jit"][0]), jax.tree.leaves(params_run), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)

    samples = _common.interleaved_samples(
        {
            "hand-written jax.jit": run_jit,
            "hand-written shard_map": run_manual,
            "strategy.run": run_strategy,
            "run, num_packs=1": run_packed,
        },
        steps=args.steps,
        repeats=args.repeats,
    )
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians["hand-written jax.jit"]
    _common.print_step_table(medians, args, strategy.num_replicas_in_sync)
    print(
        f"overhead ratio strategy.run / jax.jit: {medians['strategy.run'] / base:.3f} "
        "(target <= 1.05); strategy.run / hand-written shard_map: "
        f"{medians['strategy.run'] / medians['hand-written shard_map']:.3f}"
    )
    # Rounds time every candidate back to back, so a round's ratio is a paired comparison,
    # steadier than the ratio of medians on a machine whose speed drifts.
    paired, low, high = _common.paired_ratio(
        samples["strategy.run"], samples["hand-written shard_map"]
    )
    print(
        f"paired over {args.repeats} rounds, strategy.run / hand-written shard_map: "
        f"median {paired:.3f} (range {low:.3f}-{high:.3f}; target <= 1.02)"
    )


if __name__ == "__main__":
    main()
