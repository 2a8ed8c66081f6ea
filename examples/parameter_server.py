"""Asynchronous training of a digits classifier with ParameterServerStrategy.

Two parameter servers hold the MLP's parameters (the first layer's kernel split in two
shards by a partitioner) and their Adam state; four workers each read their own shard of
the training set, pull the current parameters, compute a gradient on their own device and
push it, all at their own pace. Prints the held-out accuracy (about 0.95) and the time.

    python examples/parameter_server.py                 # devices and threads of this process
    python examples/parameter_server.py --backend ray   # Ray actors (pip install 'jstrategy[ray]')
"""

from __future__ import annotations

import argparse
import os
import time

# One fake CPU device per task; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits

import jstrategy
from jstrategy.coordinator import ClusterCoordinator
from jstrategy.coordinator import local_cluster_resolver
from jstrategy.experimental.partitioners import MinSizePartitioner

BATCH = 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def load(seed: int = 0):
    """The digits, pixels scaled to [0, 1], split 80/20 into train and test at random."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = len(x) * 4 // 5
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def loss_fn(params, x, y):
    logits = MLP().apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# Compiled once per worker device; runs where its inputs are.
grad_fn = jax.jit(jax.value_and_grad(loss_fn))


class WorkerShard:
    """One worker's shard of the training set, reshuffled on every pass."""

    def __init__(self, x, y, worker: int, num_workers: int):
        self.x, self.y = x[worker::num_workers], y[worker::num_workers]
        self.rng = np.random.default_rng(worker)

    def __iter__(self):
        while True:
            order = self.rng.permutation(len(self.x))
            for i in range(0, len(order) - BATCH + 1, BATCH):
                rows = order[i : i + BATCH]
                yield self.x[rows], self.y[rows]


def main(steps: int = 600, backend: str = "local") -> float:
    (x_train, y_train), (x_test, y_test) = load()
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=4, num_ps=2),
        variable_partitioner=MinSizePartitioner(min_shard_bytes=8 << 10, max_shards=2),
        backend=backend,
    )
    params = MLP().init(jax.random.key(0), x_train[:1])["params"]
    variables = strategy.create_variables(params, optimizer=optax.adam(3e-3))
    for name, var in zip(
        ["Dense_0/bias", "Dense_0/kernel", "Dense_1/bias", "Dense_1/kernel"],
        jax.tree.leaves(variables.variables, is_leaf=lambda v: hasattr(v, "shape")),
        strict=True,
    ):
        print(f"{name:15s} {var}")

    coordinator = ClusterCoordinator(strategy)
    dataset = coordinator.create_per_worker_dataset(
        lambda ctx: WorkerShard(x_train, y_train, ctx.input_pipeline_id, ctx.num_input_pipelines)
    )
    iterator = iter(dataset)

    def train_step(iterator):
        x, y = next(iterator)  # this worker's batch, on its device
        loss, grads = grad_fn(variables.read(), x, y)  # pull, then compute
        variables.apply_gradients(grads)  # push; applied at once on the parameter servers
        return loss

    start = time.perf_counter()
    losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    seconds = time.perf_counter() - start
    last = np.mean([rv.fetch() for rv in losses[-50:]])

    logits = MLP().apply({"params": variables.read()}, x_test)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))
    print(
        f"{steps} asynchronous steps on 4 workers in {seconds:.1f} s "
        f"({steps / seconds:.0f} steps/s); last losses {last:.3f}; "
        f"held-out accuracy {accuracy:.3f}"
    )
    coordinator.shutdown()
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    args = parser.parse_args()
    main(args.steps, args.backend)
