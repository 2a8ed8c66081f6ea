"""Test models and data shared by several test files (plain module: `from helpers import ...`).

pytest puts tests/ on sys.path (it has no __init__.py), so every test file imports this
module by name. Each builder takes the few arguments the files differ in; called with a
file's arguments it builds exactly the model and data that file built itself, parameters,
random streams and rows alike, so trajectories and golden files do not move.
"""

from __future__ import annotations

import numpy as np
from flax import nnx


def classification_data(rows, features, seed=0, classes=3):
    """Normal float32 features; the label is the largest of the first `classes` features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    return x, np.argmax(x[:, :classes], axis=-1).astype(np.int32)


class NnxNet(nnx.Module):
    """Dense, [BatchNorm], activation, [dropout], Dense to 3 logits, in NNX.

    `batch_norm` (keyword arguments of `nnx.BatchNorm`, or None for no normalization) and
    `dropout` (a rate, or None for no dropout layer) pick the variant; the layers are made
    in this order whatever the variant, so `nnx.Rngs` hands out the same streams.
    """

    def __init__(
        self,
        rngs,
        *,
        features,
        hidden=8,
        use_bias=True,
        batch_norm=None,
        dropout=None,
        activation="relu",
    ):
        self.dense1 = nnx.Linear(features, hidden, use_bias=use_bias, rngs=rngs)
        if batch_norm is not None:
            self.norm = nnx.BatchNorm(hidden, **batch_norm, rngs=rngs)
        if dropout is not None:
            self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.dense2 = nnx.Linear(hidden, 3, rngs=rngs)
        self.activation = activation  # a name: a static attribute any graph definition keeps

    def __call__(self, x):
        x = self.dense1(x)
        if hasattr(self, "norm"):
            x = self.norm(x)
        x = getattr(nnx, self.activation)(x)
        if hasattr(self, "drop"):
            x = self.drop(x)
        return self.dense2(x)
