"""Throughput of asynchronous ParameterServerStrategy training with 1, 2 and 4 workers.

Every configuration trains the same MLP (64 -> 256 -> 256 -> 10, Adam) on batches of 64
digit-sized rows, with two parameter servers, on devices and threads of this process (the
local backend), and reports steps per second, side by side in one run. A synchronous
OneDeviceStrategy loop over the same step is the reference. Each worker count runs two
spellings of the step: the explicit one (pull, a jitted gradient, push) and TF's tutorial
``step_fn`` (pull, gradient and push inside ``strategy.run``, then ``strategy.reduce``);
their ratio is the cost of the latter.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/parameter_server.py

On a machine with few cores the workers share them, so extra workers help only as far as
one worker leaves the cores idle (waiting on its pulls and pushes).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import numpy as np
import optax

import jstrategy
from jstrategy._src import dispatch
from jstrategy.coordinator import ClusterCoordinator
from jstrategy.coordinator import local_cluster_resolver

BATCH = 64


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


def loss_fn(params, x, y):
    logits = MLP().apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


class Batches:
    """Endless random batches, different per worker."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.x = rng.random((16, BATCH, 64), dtype=np.float32)
        self.y = rng.integers(0, 10, (16, BATCH)).astype(np.int32)

    def __iter__(self):
        i = 0
        while True:
            yield self.x[i % 16], self.y[i % 16]
            i += 1


def parameter_server(num_workers: int, steps: int, tf_style: bool = False) -> float:
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=num_workers, num_ps=2)
    )
    params = MLP().init(jax.random.key(0), np.zeros((1, 64), np.float32))["params"]
    variables = strategy.create_variables(params, optimizer=optax.adam(1e-3))
    coordinator = ClusterCoordinator(strategy)
    iterator = iter(
        coordinator.create_per_worker_dataset(lambda ctx: Batches(ctx.input_pipeline_id))
    )

    def explicit_step(it):
        x, y = next(it)
        loss, grads = grad_fn(variables.read(), x, y)
        variables.apply_gradients(grads)
        return loss

    def tf_step_fn(it):
        def replica_fn(x, y):
            loss, grads = jax.value_and_grad(loss_fn)(variables.read(), x, y)
            variables.apply_gradients(grads)
            return loss

        x, y = next(it)
        losses = strategy.run(replica_fn, args=(x, y))
        return strategy.reduce("SUM", losses, axis=None)

    step = tf_step_fn if tf_style else explicit_step

    # Warm up: every worker compiles its programs.
    for _ in range(8 * num_workers):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    seconds = time.perf_counter() - start
    coordinator.shutdown()
    return steps / seconds


def synchronous(steps: int) -> float:
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    tx = optax.adam(1e-3)
    with strategy.scope():
        params = MLP().init(jax.random.key(0), np.zeros((1, 64), np.float32))["params"]
        opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batches = iter(Batches(0))
    for _ in range(8):
        params, opt_state, loss = train_step(params, opt_state, *next(batches))
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = train_step(params, opt_state, *next(batches))
        dispatch.track(loss)
    jax.block_until_ready(loss)
    return steps / (time.perf_counter() - start)


def main(steps: int = 400) -> None:
    print(f"{jax.device_count()} devices, {os.cpu_count()} cores; batch {BATCH}, {steps} steps")
    results = {"OneDeviceStrategy (synchronous)": synchronous(steps)}
    for workers in (1, 2, 4):
        explicit = parameter_server(workers, steps)
        tf_style = parameter_server(workers, steps, tf_style=True)
        results[f"ParameterServerStrategy, {workers} worker(s), 2 ps"] = explicit
        results[f"  TF step_fn (update inside run), {workers} worker(s)"] = tf_style
        results[f"  ratio TF step_fn / explicit, {workers} worker(s)"] = tf_style / explicit
    for name, rate in results.items():
        unit = "" if name.strip().startswith("ratio") else " steps/s"
        print(f"{name:55s} {rate:8.2f}{unit}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    main(parser.parse_args().steps)
