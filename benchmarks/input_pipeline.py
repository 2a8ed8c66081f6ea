"""Steps per second of a small MLP fed three ways: distributed dataset with and without
prefetch, and a hand-written `jax.device_put` loop.

Run with 8 fake CPU devices (about 30 s on 2 cores):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/input_pipeline.py

Every mode trains the same model on the same batches with `MirroredStrategy` over all
devices; the modes are interleaved in each repeat, and the median of the repeats is
reported. In-flight steps stay bounded: `Strategy.run` waits through `dispatch.track`, and
each timed epoch ends by blocking on its last output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jstrategy
from jstrategy._src import dispatch

_TX = optax.sgd(0.01)


def _init(features: int, hidden: int, classes: int):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (features, hidden)) / np.sqrt(features),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, classes)) / np.sqrt(hidden),
    }


def _step(params, opt_state, batch):
    ctx = jstrategy.get_replica_context()

    def loss_fn(p):
        logits = jax.nn.relu(batch["x"] @ p["w1"] + p["b1"]) @ p["w2"]
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jstrategy.compute_average_loss(per_example)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = ctx.all_reduce("SUM", grads)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("SUM", loss)


def _make_batches(count: int, batch: int, features: int, classes: int):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(batch, features)).astype(np.float32),
            "y": rng.integers(0, classes, size=batch).astype(np.int32),
        }
        for _ in range(count)
    ]


def _source(batches):
    # A light input pipeline: the host work a real one does per batch (a normalization).
    def gen():
        for b in batches:
            yield {"x": (b["x"] - 0.5) * 2.0, "y": b["y"]}

    return gen


def _epoch_dataset(strategy, dist, state):
    params, opt_state = state
    loss = None
    for element in dist:
        params, opt_state, loss = strategy.run(_step, (params, opt_state, element))
    jax.block_until_ready(loss)
    return params, opt_state


def _epoch_manual(strategy, batches, state, *, mask):
    params, opt_state = state
    sharding = strategy.batch_sharding()
    # The same all-true mask as the dataset's full batches: the same compiled step.
    rows = jax.device_put(np.ones(len(batches[0]["y"]), bool), sharding) if mask else None
    loss = None
    for batch in _source(batches)():
        placed = jax.device_put(batch, sharding)
        element = jax.tree.map(lambda v: jstrategy.PerReplica(v, stacked=False, mask=rows), placed)
        params, opt_state, loss = strategy.run(_step, (params, opt_state, element))
    jax.block_until_ready(loss)
    return params, opt_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="batches per timed epoch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=512, help="global batch size")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()

    strategy = jstrategy.MirroredStrategy()
    classes = 10
    batches = _make_batches(args.steps, args.batch, args.features, classes)
    params = _init(args.features, args.hidden, classes)
    state = (params, _TX.init(params))

    def dataset(buffer_size):
        options = jstrategy.InputOptions(experimental_per_replica_buffer_size=buffer_size)
        return strategy.experimental_distribute_dataset(_source(batches), options)

    modes = {
        "dataset, prefetch 2": lambda s: _epoch_dataset(strategy, dataset(2), s),
        "dataset, prefetch 1": lambda s: _epoch_dataset(strategy, dataset(1), s),
        "dataset, no prefetch": lambda s: _epoch_dataset(strategy, dataset(0), s),
        "hand-written device_put": lambda s: _epoch_manual(strategy, batches, s, mask=True),
        # No mask: compute_average_loss skips the all-reduce of the real-row count.
        "hand-written, no mask": lambda s: _epoch_manual(strategy, batches, s, mask=False),
    }
    for run in modes.values():  # compile every program before timing
        run(state)
    rates: dict[str, list[float]] = {name: [] for name in modes}
    start = time.perf_counter()
    for _ in range(args.repeats):
        for name, run in modes.items():
            t0 = time.perf_counter()
            run(state)
            rates[name].append(args.steps / (time.perf_counter() - t0))
    dispatch.get_limiter().wait_all()

    print(
        f"{strategy.num_replicas_in_sync} x {jax.devices()[0].platform} replicas, global batch "
        f"{args.batch}, MLP {args.features}-{args.hidden}-{classes}, {args.steps} steps x "
        f"{args.repeats} repeats ({time.perf_counter() - start:.1f} s timed)"
    )
    baseline = statistics.median(rates["hand-written device_put"])
    print(f"{'mode':<26}{'steps/s (median)':>18}{'min':>9}{'max':>9}{'vs hand-written':>17}")
    for name, values in rates.items():
        median = statistics.median(values)
        print(
            f"{name:<26}{median:>18.1f}{min(values):>9.1f}{max(values):>9.1f}"
            f"{median / baseline:>16.2f}x"
        )


if __name__ == "__main__":
    main()
