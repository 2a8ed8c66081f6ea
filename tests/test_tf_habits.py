"""TensorFlow's distributed-training tutorials, ported as a TF user would: each habit
either means the same here or raises an error that shows the fix (issue 14)."""

import numpy as np
import optax
import flax.linen as nn
import pytest

import jstrategy


def _xy(rows=24, features=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]
    return x, y


def _dense_model(strategy, optimizer=None, **compile_kwargs):
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(3,))
        model.compile(optimizer if optimizer is not None else optax.sgd(0.1), loss="mse",
                      **compile_kwargs)
    return model


# Finding 6: one rule for what fit and experimental_distribute_dataset take ------------
def test_fit_takes_a_generator_function_as_experimental_distribute_dataset_does():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _xy()

    def batches():
        for i in range(0, 24, 8):
            yield x[i : i + 8], y[i : i + 8]

    from_function = _dense_model(strategy)
    history = from_function.fit(batches, epochs=2, verbose=0)
    from_list = _dense_model(strategy)
    from_list.fit(list(batches()), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2  # a generator function is iterated each epoch
    for a, b in zip(from_function.get_weights(), from_list.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
