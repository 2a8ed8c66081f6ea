"""Keras-style training: `jstrategy.Model` with `compile`, `summary` and `fit`.

The port of Keras's distributed-training quick start: a model built inside a
MirroredStrategy's scope replicates its variables over every device, and `fit` splits each
global batch among the replicas and all-reduces the gradients. The data is generated here:
the label says whether a noisy linear function of 10 features is positive.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/keras_style.py
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import numpy as np
import optax

import jstrategy
import jstrategy.losses


def make_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 10)).astype(np.float32)
    w = rng.normal(size=(10, 1)).astype(np.float32)
    noise = 0.1 * rng.normal(size=(rows, 1)).astype(np.float32)
    return x, (x @ w + noise > 0).astype(np.float32)


def main(epochs: int = 5, verbose: int | str = "auto") -> dict[str, float]:
    """Trains the model and returns its final ``{"loss": ..., "accuracy": ...}``."""
    strategy = jstrategy.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    with strategy.scope():
        model = jstrategy.Model(
            nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(1)]), input_shape=(10,)
        )
        model.compile(
            optimizer=optax.sgd(0.2),
            loss=jstrategy.losses.BinaryCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.summary()
    x, y = make_data(4096)
    history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=verbose)
    final = {name: values[-1] for name, values in history.history.items()}
    print(f"final loss: {final['loss']:.4f}, accuracy: {final['accuracy']:.4f}")
    return final


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    main(parser.parse_args().epochs)
