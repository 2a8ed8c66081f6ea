"""TF's "Distributed training with Keras" tutorial, with only its ``tf.`` names changed.

The tutorial's MNIST CNN (Conv2D, MaxPooling2D, Flatten, Dense) built and compiled inside
a MirroredStrategy's scope, trained with ``fit``, evaluated with ``evaluate``. MNIST is
not downloaded here: the images are random 28x28 digits-like arrays whose label is the
quadrant holding the brightest pixel block, so the script runs offline.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/keras_distribute_tutorial.py
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import jstrategy


def make_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Images ``(rows, 28, 28, 1)`` in [0, 1] and labels in [0, 10)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=rows)
    images = 0.1 * rng.random((rows, 28, 28, 1), dtype=np.float32)
    for i, label in enumerate(labels):  # a bright 6x6 block at a label-dependent place
        r, c = divmod(int(label), 5)
        images[i, 4 + 12 * r : 10 + 12 * r, 1 + 5 * c : 7 + 5 * c, 0] += 0.9
    return images, labels.astype(np.int64)


def build_and_compile(strategy: jstrategy.Strategy) -> jstrategy.Sequential:
    """The tutorial's model, created and compiled inside ``strategy.scope()``."""
    with strategy.scope():
        model = jstrategy.Sequential(
            [
                jstrategy.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
                jstrategy.layers.MaxPooling2D(),
                jstrategy.layers.Flatten(),
                jstrategy.layers.Dense(64, activation="relu"),
                jstrategy.layers.Dense(10),
            ]
        )
        model.compile(
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=jstrategy.optimizers.Adam(),
            metrics=["accuracy"],
        )
    return model


def main(
    strategy: jstrategy.Strategy | None = None,
    epochs: int = 2,
    rows: int = 512,
    batch_size: int | None = None,
    verbose: int = 2,
) -> tuple[Any, Any]:
    """Trains and evaluates; returns ``(history, [eval_loss, eval_accuracy])``.

    `batch_size` None scales the global batch with the replicas, as the tutorial does
    (8 rows per replica).
    """
    strategy = strategy or jstrategy.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    batch_size = batch_size or 8 * strategy.num_replicas_in_sync
    model = build_and_compile(strategy)
    x, y = make_data(rows)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose)
    x_test, y_test = make_data(rows // 4, seed=1)
    return history, model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    main(epochs=parser.parse_args().epochs)
