"""A custom training loop with `strategy.run`, as in tf.distribute's custom-loop tutorial.

A Flax MLP learns a noisy linear-plus-sine function from data generated here. Each replica
computes gradients on its slice of the global batch; the replica context all-reduces them;
optax applies the update, identically on every replica. The same loop runs under
OneDeviceStrategy and MirroredStrategy over every device, and the losses agree step by step.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/custom_training_loop.py
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jstrategy

GLOBAL_BATCH = 64


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(1)(x)


def make_data(num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 8)).astype(np.float32)
    w = rng.normal(size=(8, 1)).astype(np.float32)
    y = x @ w + np.sin(3 * x[:, :1]) + 0.1 * rng.normal(size=(num_samples, 1)).astype(np.float32)
    return x, y.astype(np.float32)


def train(strategy: jstrategy.Strategy, steps: int, seed: int = 0) -> tuple[list[float], dict]:
    """Trains the MLP for `steps` steps under `strategy`.

    Each process builds only its own replicas' rows of every global batch (replica i gets the
    i-th contiguous slice), so the same function trains under multi-worker strategies.

    Returns:
      The loss of every step, and the final parameters as NumPy arrays.
    """
    model = MLP()
    tx = optax.sgd(0.02, momentum=0.9)  # not scale-invariant: a wrong gradient sum shows
    x_all, y_all = make_data(GLOBAL_BATCH * steps, seed)
    n = strategy.num_replicas_in_sync
    per_replica = GLOBAL_BATCH // n

    with strategy.scope():
        params = model.init(jax.random.key(seed), x_all[:1])["params"]
        opt_state = tx.init(params)

        def step(params, opt_state, x, y):
            ctx = jstrategy.get_replica_context()

            def loss_fn(p):
                # Mean over the global batch: each replica's share of it.
                return jnp.sum((model.apply({"params": p}, x) - y) ** 2) / GLOBAL_BATCH

            loss, grads = jax.value_and_grad(loss_fn)(params)
            grads = ctx.all_reduce("SUM", grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("SUM", loss)

        losses = []
        for i in range(steps):
            lo = i * GLOBAL_BATCH

            def rows(ctx, data, lo=lo):
                start = lo + ctx.replica_id_in_sync_group * per_replica
                return data[start : start + per_replica]

            x = strategy.experimental_distribute_values_from_function(lambda c: rows(c, x_all))
            y = strategy.experimental_distribute_values_from_function(lambda c: rows(c, y_all))
            params, opt_state, loss = strategy.run(step, args=(params, opt_state, x, y))
            losses.append(loss)
        # One host sync, after the loop.
        # Every replica holds the same parameters; take this process's first copy.
        first = strategy.experimental_local_results(params)[0]
        return [float(v) for v in losses], jax.tree.map(np.asarray, first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)

    mirrored = jstrategy.MirroredStrategy()
    one = jstrategy.OneDeviceStrategy(jax.devices()[0])
    print(f"jax {jax.__version__} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
    results = {}
    for name, strategy in [("OneDeviceStrategy", one), ("MirroredStrategy", mirrored)]:
        start = time.perf_counter()
        results[name], _ = train(strategy, args.steps)
        print(
            f"{name:>18} ({strategy.num_replicas_in_sync} replica(s)): loss "
            f"{results[name][0]:.4f} -> {results[name][-1]:.4f} in {args.steps} steps "
            f"({time.perf_counter() - start:.1f}s)"
        )
    a, b = np.array(results["OneDeviceStrategy"]), np.array(results["MirroredStrategy"])
    diff = float(np.max(np.abs(a - b) / np.maximum(1.0, np.abs(a))))
    print(f"largest relative difference in per-step loss: {diff:.2e}")
    for i in range(0, args.steps, max(1, args.steps // 5)):
        print(f"  step {i:4d}: one device {a[i]:.6f}   mirrored {b[i]:.6f}")
    if diff > 1e-5:
        print("MISMATCH: the strategies diverged")
        return 1
    print("OK: MirroredStrategy follows OneDeviceStrategy's trajectory.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
