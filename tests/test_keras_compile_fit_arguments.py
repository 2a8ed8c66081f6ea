"""Keras 3's `compile` and `fit` arguments: what they mean here, or an error with the fix.

`compile`'s `loss_weights`, `run_eagerly`, `jit_compile` and `auto_scale_loss` exist here
only as what jstrategy always does; `fit`'s `validation_freq` and `validation_batch_size`
mean what they mean in Keras 3 (issue 21, "Differences from Keras 3").
"""

import flax.linen as nn
import numpy as np
import pytest

import jstrategy
from jstrategy import losses
from jstrategy.callbacks import Callback


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"loss_weights": [1.0]},
            r"`loss_weights` weighs the losses of a multi-output.*got \[1.0\]",
        ),
        ({"run_eagerly": True}, r"`run_eagerly` must be False.*jax.debug.print"),
        ({"jit_compile": False}, r"`jit_compile` must be 'auto' or True.*got False"),
        ({"auto_scale_loss": "yes"}, r"`auto_scale_loss` must be True or False; got 'yes'"),
    ],
)
def test_keras_compile_options_that_would_mean_something_else_are_errors(kwargs, match):
    model = jstrategy.Model(nn.Dense(3), input_shape=(5,))
    with pytest.raises(ValueError, match=match):
        model.compile("adam", loss="mse", **kwargs)


def test_keras_compile_options_that_mean_what_jstrategy_does_are_accepted():
    model = jstrategy.Model(nn.Dense(3), input_shape=(5,))
    model.compile("adam", loss="mse", run_eagerly=False, jit_compile=True, auto_scale_loss=False)
    assert model.compiled
    half = jstrategy.Model(nn.Dense(3), input_shape=(5,), dtype_policy="mixed_float16")
    half.compile("adam", loss="mse", auto_scale_loss=True)
    with pytest.raises(ValueError, match=r"auto_scale_loss=False` under the 'mixed_float16'"):
        half.compile("adam", loss="mse", auto_scale_loss=False)


class _Validations(Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []
        self.test_batches = 0

    def on_test_batch_end(self, batch, logs=None):
        self.test_batches += 1

    def on_epoch_end(self, epoch, logs=None):
        if "val_loss" in (logs or {}):
            self.epochs.append(epoch)


def _fit(**kwargs):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = jstrategy.Model(nn.Dense(2), input_shape=(5,), seed=0)
    model.compile("sgd", loss=losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = _Validations()
    history = model.fit(x, y, batch_size=8, epochs=6, verbose=0, callbacks=[seen], **kwargs)
    return seen, history.history


@pytest.mark.parametrize(
    ("freq", "epochs"), [(1, [0, 1, 2, 3, 4, 5]), (2, [1, 3, 5]), ([1, 4, 6], [0, 3, 5])]
)
def test_validation_freq_validates_after_the_epochs_keras_does(freq, epochs):
    rng = np.random.default_rng(1)
    vx = rng.normal(size=(12, 5)).astype(np.float32)
    vy = (vx[:, 0] > 0).astype(np.int32)
    seen, history = _fit(validation_data=(vx, vy), validation_freq=freq)
    assert seen.epochs == epochs
    assert len(history["val_loss"]) == len(epochs)


def test_validation_batch_size_batches_array_validation_data_only():
    rng = np.random.default_rng(1)
    vx = rng.normal(size=(12, 5)).astype(np.float32)
    vy = (vx[:, 0] > 0).astype(np.int32)
    batches, small = _fit(validation_data=(vx, vy), validation_batch_size=3)
    default, large = _fit(validation_data=(vx, vy))
    assert (batches.test_batches, default.test_batches) == (6 * 4, 6 * 2)  # 12 rows: 3, 8
    np.testing.assert_allclose(small["val_loss"], large["val_loss"], rtol=1e-6)
    dataset = [(vx[:6], vy[:6]), (vx[6:], vy[6:])]
    with pytest.raises(ValueError, match=r"`validation_batch_size` \(3\) is for array"):
        _fit(validation_data=dataset, validation_batch_size=3)


@pytest.mark.parametrize("freq", [0, -1, 1.5, [0, 2], "2"])
def test_a_bad_validation_freq_is_an_error_before_any_work(freq):
    with pytest.raises(ValueError, match=r"`validation_freq` must be a positive int"):
        _fit(validation_freq=freq)
