"""The TF program jstrategy is modeled on, with only its ``tf.`` names changed.

TensorFlow's original (``tf.distribute.MirroredStrategy``, ``tf.keras.Sequential``, ...)
reads line for line as below; the data is generated here: the label says whether a noisy
linear function of 10 features is positive.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/seed_program.py
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import jstrategy


def make_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 10)).astype(np.float32)
    w = rng.normal(size=(10, 1)).astype(np.float32)
    noise = 0.1 * rng.normal(size=(rows, 1)).astype(np.float32)
    return x, (x @ w + noise > 0).astype(np.float32)


def build(strategy: jstrategy.Strategy) -> jstrategy.Sequential:
    """The seed's model, built and compiled under `strategy` (nothing placed yet: a
    strategy over a TPU topology's compile-only devices plans it, tests/test_tpu_compile.py)."""
    with strategy.scope():
        model = jstrategy.Sequential()
        model.add(jstrategy.layers.Dense(16, activation="relu", input_shape=(10,)))
        model.add(jstrategy.layers.Dense(1))
        optimizer = jstrategy.optimizers.SGD(0.2)
        model.compile(
            loss=jstrategy.losses.BinaryCrossentropy(from_logits=True), optimizer=optimizer
        )
    return model


def main(strategy: jstrategy.Strategy | None = None, epochs: int = 5, verbose: int = 2) -> Any:
    """Builds, summarizes and trains the seed's model; returns the `History`."""
    model = build(strategy or jstrategy.MirroredStrategy())
    model.summary()
    x, y = make_data(1024)
    return model.fit(x, y, batch_size=64, epochs=epochs, verbose=verbose)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    main(epochs=parser.parse_args().epochs)
