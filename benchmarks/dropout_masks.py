"""What a dropout mask of the global rows costs a train step, against a per-replica mask.

One `jax.shard_map` train step per replica (as `Model` compiles it) of an MLP
64-W-W-10 with dropout 0.5 after each hidden layer, global batch B over the replicas; the
three candidates differ only in how each replica draws its masks:

* ``per-replica key``: ``bernoulli(fold_in(key, replica), p, local shape)``, what the
  step did before issue 21 (the mask depends on the number of replicas);
* ``global draw, sliced``: ``bernoulli(key, p, global shape)`` on every replica, then its
  rows (exact, ``n`` times the random-number work);
* ``global rows``: `global_rows_bernoulli`, what the step does now: only this replica's
  threefry counters (exact, the same work as a per-replica mask).

Interleaved in one process; medians as ms/step and as ratios to the first.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/dropout_masks.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

import jstrategy
from jstrategy._src.training.state.global_batch import global_rows_bernoulli

AXIS = jstrategy.REPLICA_AXIS
RATE = 0.5


def per_replica_key(key, shape):
    return jax.random.bernoulli(jax.random.fold_in(key, jax.lax.axis_index(AXIS)), 1 - RATE, shape)


def global_sliced(key, shape):
    n = jax.lax.axis_size(AXIS)
    whole = jax.random.bernoulli(key, 1 - RATE, (n * shape[0], *shape[1:]))
    return jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index(AXIS) * shape[0], shape[0])


def global_rows(key, shape):
    return global_rows_bernoulli(key, 1 - RATE, shape, axis_name=AXIS)


def make_step(mask_fn, mesh, width, batch):
    sizes = [64, width, width, 10]
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    params = [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]
    tx = optax.sgd(0.01, momentum=0.9)

    def per_replica(state, key, x, y):
        params, opt_state = state

        def loss_fn(p):
            h = x
            for i, (w, b) in enumerate(p):
                h = h @ w + b
                if i < len(p) - 1:
                    h = jax.nn.relu(h)
                    mask = mask_fn(jax.random.fold_in(key, i), h.shape)
                    h = jnp.where(mask, h / (1 - RATE), 0.0)
            return optax.softmax_cross_entropy_with_integer_labels(h, y).sum() / batch

        local = jax.lax.pcast(params, AXIS, to="varying")
        loss, grads = jax.lax.psum(jax.value_and_grad(loss_fn)(local), AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    step = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P(), P(AXIS), P(AXIS)),
            out_specs=(P(), P()),
        ),
        donate_argnums=(0,),
    )
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(batch, 64)).astype(np.float32), rows)
    y = jax.device_put(rng.integers(0, 10, batch).astype(np.int32), rows)
    holder = {"state": jax.device_put((params, tx.init(params)), replicated)}
    base = jax.random.key(1)

    def run(i):
        holder["state"], loss = step(holder["state"], jax.random.fold_in(base, i), x, y)
        return loss

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    candidates = {
        "per-replica key": make_step(per_replica_key, mesh, args.width, args.batch),
        "global draw, sliced": make_step(global_sliced, mesh, args.width, args.batch),
        "global rows": make_step(global_rows, mesh, args.width, args.batch),
    }
    medians = _common.compare(candidates, steps=args.steps, repeats=args.repeats)
    print("dropout 0.5 after each hidden layer")
    _common.print_step_table(medians, args, mesh.size)


if __name__ == "__main__":
    main()
