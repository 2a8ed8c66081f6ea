"""Handwritten digits with `jstrategy.Model` over every device (MirroredStrategy).

Trains an MLP on scikit-learn's bundled 8x8 digits (1,797 images, no download), holding
out a fifth of them, and prints the summary, a progress bar per epoch and the held-out
accuracy (about 0.97).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/digits.py
"""

from __future__ import annotations

import argparse
import os
import re

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits

import jstrategy
import jstrategy.losses


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


def load(seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The digits, pixels scaled to [0, 1], split 80/20 into train and test at random."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = len(x) * 4 // 5
    train, test = order[:cut], order[cut:]
    return (x[train], y[train]), (x[test], y[test])


def devices_line(strategy: jstrategy.Strategy) -> str:
    """Which devices the replicas run on, and why there are that many.

    A newcomer without an accelerator sees 8 replicas and may wonder where they come from:
    `make demo` sets XLA_FLAGS=--xla_force_host_platform_device_count=8, which makes XLA
    split the CPU into 8 devices (they share its cores, so they show parallelism, not
    speed).
    """
    devices = jax.devices()
    line = (
        f"{strategy.num_replicas_in_sync} replicas on {len(devices)} {devices[0].platform} devices"
    )
    forced = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    if devices[0].platform == "cpu" and forced and len(devices) > 1:
        line += (
            f": no accelerator here, so these are {forced.group(1)} fake CPU devices that"
            f" XLA_FLAGS={forced.group(0)} asks XLA for (the Makefile sets it; they share the"
            " CPU's cores, so they show the distribution, not a speed-up)"
        )
    return line


def main(epochs: int = 20, verbose: int | str = 1) -> float:
    """Trains the MLP and returns the held-out accuracy."""
    (x_train, y_train), (x_test, y_test) = load()
    strategy = jstrategy.MirroredStrategy()
    print(devices_line(strategy))
    print(f"{len(x_train)} train and {len(x_test)} test images")
    with strategy.scope():
        model = jstrategy.Model(MLP(), input_shape=(64,), name="digits_mlp")
        model.compile(
            optimizer=optax.adam(3e-3),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=4,
        )
    model.summary()
    model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=epochs,
        validation_data=(x_test, y_test),
        verbose=verbose,
    )
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(f"held-out loss: {loss:.4f}, accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    main(parser.parse_args().epochs)
