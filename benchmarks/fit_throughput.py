"""`Model.fit` throughput against a hand-written `jax.jit` training loop.

Both train the same MLP (64-256-256-10, SGD with momentum, sparse softmax cross-entropy)
on the same data (scikit-learn's digits, repeated to make epochs long enough to time),
global batch 256 over 8 replicas, shuffled every epoch, for the same number of epochs:

* hand-written jit loop: parameters replicated, each batch gathered from a permutation on
  the host, `jax.device_put` with a row sharding, one `jax.jit` step with donated state
  (XLA partitions it and inserts the all-reduce), the in-flight steps bounded with
  `dispatch.track`, the loss read once per epoch.
* hand-written shard_map loop: the same, with the step written per replica under
  `jax.shard_map` and an explicit `psum`, as `Model` compiles it.
* ``Model.fit(x, y, batch_size=256, verbose=0)`` compiled with ``steps_per_execution`` 1
  and 8.

The runs are interleaved in one process (the order rotating); each row is the median of
the repeats, as samples per second and as ratios to the two hand-written loops.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/fit_throughput.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

import jstrategy
import jstrategy.losses
from jstrategy._src import dispatch

BATCH = 256


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


def _data(repeat: int) -> tuple[np.ndarray, np.ndarray]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    # Whole groups of 8 full batches, so every loop runs the same steps on the same rows.
    rows = len(x) * repeat // (8 * BATCH) * (8 * BATCH)
    return np.tile(x, (repeat, 1))[:rows], np.tile(y, repeat)[:rows]


def _tx() -> optax.GradientTransformation:
    return optax.sgd(0.05, momentum=0.9)


def hand_written(strategy, x, y, *, shard_map: bool):
    """Returns ``run(epochs)``: a hand-written loop, from the same initial parameters.

    With `shard_map`, the step is written per replica (as `Model` compiles it): the loss
    sum and gradients are `psum`-ed explicitly; otherwise it is a global `jax.jit` step
    that XLA partitions from the input shardings.
    """
    model, tx = MLP(), _tx()
    axis = jstrategy.REPLICA_AXIS
    replicated = NamedSharding(strategy.mesh, P())
    rows = NamedSharding(strategy.mesh, P(jstrategy.REPLICA_AXIS))
    # On the host: each run places a fresh copy (the step donates its input state).
    params = jax.device_get(model.init(jax.random.key(0), jnp.ones((1, x.shape[1])))["params"])

    def step(state, xb, yb):
        params, opt_state = state

        def loss_fn(p):
            logits = model.apply({"params": p}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def per_replica_step(state, xb, yb):
        params, opt_state = state

        def loss_fn(p):
            logits = model.apply({"params": p}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).sum() / BATCH

        local = jax.lax.pcast(params, axis, to="varying")  # no implicit psum in grad
        loss, grads = jax.lax.psum(jax.value_and_grad(loss_fn)(local), axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    if shard_map:
        step = jax.shard_map(
            per_replica_step,
            mesh=strategy.mesh,
            in_specs=(P(), P(axis), P(axis)),
            out_specs=(P(), P()),
        )
    step = jax.jit(step, donate_argnums=(0,))
    steps = len(x) // BATCH

    def run(epochs: int, seed: int = 0) -> float:
        state = jax.device_put((params, tx.init(params)), replicated)
        rng = np.random.default_rng(seed)
        loss = None
        for _ in range(epochs):
            order = rng.permutation(len(x))
            for i in range(steps):
                index = order[i * BATCH : (i + 1) * BATCH]
                xb, yb = jax.device_put((x[index], y[index]), rows)
                state, loss = step(state, xb, yb)
                dispatch.track(loss)
            float(loss)  # the loss is read once per epoch
        return float(loss)

    return run, steps


def with_fit(strategy, x, y, steps_per_execution: int, epochs: int):
    """Returns ``run()``: `epochs` epochs of ``Model.fit`` (the model keeps training)."""
    with strategy.scope():
        model = jstrategy.Model(MLP(), input_shape=(x.shape[1],))
        model.compile(
            _tx(),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )

    def run() -> float:
        history = model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
        return history.history["loss"][-1]

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat-data", type=int, default=8, help="digits copies per epoch")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per timed run")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args(argv)

    strategy = jstrategy.MirroredStrategy()
    x, y = _data(args.repeat_data)
    hand, steps = hand_written(strategy, x, y, shard_map=False)
    hand_shard_map, _ = hand_written(strategy, x, y, shard_map=True)
    runs = {
        "hand-written jit loop": lambda: hand(args.epochs),
        "hand-written shard_map loop": lambda: hand_shard_map(args.epochs),
        "Model.fit, steps_per_execution=1": with_fit(strategy, x, y, 1, args.epochs),
        "Model.fit, steps_per_execution=8": with_fit(strategy, x, y, 8, args.epochs),
    }
    for run in runs.values():  # compile everything once
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.repeats):
        # Rotate the order so that no loop always runs right after the same other one.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            runs[name]()
            samples[name].append(time.perf_counter() - start)
    rows = args.epochs * len(x)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    jit_loop = medians["hand-written jit loop"]
    shard_map_loop = medians["hand-written shard_map loop"]
    print(
        f"{len(jax.devices())} devices, {strategy.num_replicas_in_sync} replicas, global batch "
        f"{BATCH}, {len(x)} rows/epoch ({steps} steps), {args.epochs} epoch(s) per run, "
        f"median of {args.repeats} interleaved runs"
    )
    print(f"  {'':34s} {'samples/s':>10s}  {'vs jit loop':>11s}  {'vs shard_map loop':>17s}")
    for name, t in medians.items():
        print(f"  {name:34s} {rows / t:10.0f}  {jit_loop / t:10.2f}x  {shard_map_loop / t:16.2f}x")
    # Each round runs every loop back to back, so a round's speed-up is a paired
    # comparison: steadier than the ratio of medians when the machine's speed drifts.
    print(f"  paired over {args.repeats} rounds: median speed-up (range)")
    for name in names[2:]:
        for base in names[:2]:
            mid, low, high = _common.paired_ratio(samples[base], samples[name])
            print(f"    {name} vs {base}: {mid:.2f}x ({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
