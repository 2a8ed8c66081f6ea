"""Keras 3's "Distributed training with the JAX backend" guide (``keras.distribution``),
with its names changed to jstrategy's.

The guide trains one small model twice: data parallel over a 1-D mesh of every device
(``keras.distribution.DataParallel``), then model parallel over a ``(2, 4)`` mesh whose
``"model"` axis splits ``d1``'s kernel (``keras.distribution.ModelParallel`` with a
``LayoutMap``). Here ``keras.distribution.set_distribution(d)`` becomes ``with
strategy.scope():``, ``DataParallel`` is `jstrategy.MirroredStrategy` over the mesh's
devices, and ``ModelParallel`` is `jstrategy.experimental.ModelParallelStrategy`. The
guide's functional model (``Input`` -> ``Flatten`` -> ``Dense`` ...) is the same layers in
a `jstrategy.Sequential`. Two lines have no counterpart and are left out: the guide's
``layout_map["d1/bias"]`` (``d1`` is built with ``use_bias=False``, so it matches no
variable) and ``layout_map["d2/output"]`` (a layout for a layer's output: here XLA lays
out activations itself). The data are the guide's: random normal images and labels.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/keras_distribution_guide.py
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import numpy as np

import jstrategy
from jstrategy import layers
from jstrategy.experimental import DeviceMesh
from jstrategy.experimental import LayoutMap
from jstrategy.experimental import ModelParallelStrategy


def make_data(rows: int = 128, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The guide's data: ``np.random.normal`` images ``(rows, 28, 28, 1)``, labels ``(rows, 10)``."""
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(rows, 28, 28, 1)).astype(np.float32)
    labels = rng.normal(size=(rows, 10)).astype(np.float32)
    return inputs, labels


def data_parallel() -> jstrategy.Strategy:
    """``DataParallel(device_mesh=DeviceMesh(shape=(8,), axis_names=["data"]))``."""
    return jstrategy.MirroredStrategy(jax.devices())


def model_parallel(model_axis: int = 4) -> jstrategy.Strategy:
    """``ModelParallel(layout_map, batch_dim_name="data")`` on a ``(n/4, 4)`` mesh."""
    data_axis = len(jax.devices()) // model_axis
    mesh_2d = DeviceMesh((data_axis, model_axis), ("data", "model"))
    layout_map = LayoutMap(mesh_2d)
    # As in the guide: any weight matching d1/kernel is split over the "model" axis; all
    # other weights are replicated.
    layout_map["d1/kernel"] = (None, "model")
    return ModelParallelStrategy(layout_map, batch_dim_name="data")


def build_and_compile(strategy: jstrategy.Strategy, dropout: float = 0.4) -> Any:
    """The guide's model, created and compiled under `strategy` (its ``set_distribution``)."""
    with strategy.scope():
        model = jstrategy.Sequential(
            [
                layers.Input(shape=(28, 28, 1)),
                layers.Flatten(),
                layers.Dense(units=200, use_bias=False, activation="relu", name="d1"),
                layers.Dropout(dropout),
                layers.Dense(units=10, activation="softmax", name="d2"),
            ]
        )
        model.compile(loss="mse")  # the guide's: Keras's default optimizer, rmsprop
    return model


def main(
    strategy: jstrategy.Strategy | None = None,
    epochs: int = 3,
    dropout: float = 0.4,
    verbose: int = 2,
) -> tuple[Any, Any]:
    """Trains and evaluates as the guide does; returns ``(history, eval_loss)``."""
    strategy = strategy or data_parallel()
    inputs, labels = make_data()
    model = build_and_compile(strategy, dropout)
    # The guide's tf.data pipeline: the same arrays in batches of 16.
    history = model.fit(inputs, labels, batch_size=16, epochs=epochs, verbose=verbose)
    return history, model.evaluate(inputs, labels, batch_size=16, verbose=verbose)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    epochs = parser.parse_args().epochs
    print("DataParallel (MirroredStrategy):")
    main(data_parallel(), epochs=epochs)
    print("ModelParallel (ModelParallelStrategy, mesh (2, 4)):")
    main(model_parallel(), epochs=epochs)
