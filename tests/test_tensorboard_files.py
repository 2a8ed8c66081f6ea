"""`jstrategy.callbacks.TensorBoard` never replaces an event file, and refuses a `log_dir`
it cannot write to before any training step (issue 21, finding 5)."""

from __future__ import annotations

import os

import flax.linen as nn
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy.callbacks import LambdaCallback
from jstrategy.callbacks import TensorBoard

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    return x, (x[:, :1] - x[:, 1:2]).astype(np.float32)


def _model():
    model = jstrategy.Model(nn.Dense(1), input_shape=(4,), seed=0)
    model.compile(optax.sgd(0.05), loss="mse")
    return model


def _epoch_losses(path):
    reader = event_accumulator.EventAccumulator(
        str(path), size_guidance={event_accumulator.SCALARS: 0}
    )
    reader.Reload()
    events = reader.Scalars("epoch_loss")
    return [e.step for e in events], [e.value for e in events]


def test_one_fit_per_epoch_keeps_every_epoch(tmp_path):
    # The common TF loop: one `fit` per epoch with the same callback. Its writers open
    # within the same second; each gets a file of its own.
    x, y = _data()
    model = _model()
    tb = TensorBoard(tmp_path)
    losses = []
    for epoch in range(10):
        history = model.fit(
            x, y, batch_size=8, epochs=epoch + 1, initial_epoch=epoch, verbose=0, callbacks=[tb]
        )
        losses += history.history["loss"]
    files = os.listdir(tmp_path / "train")
    assert len(files) == 10 and len(set(files)) == 10
    steps, values = _epoch_losses(tmp_path / "train")
    assert steps == list(range(10))
    np.testing.assert_allclose(values, losses, rtol=1e-6)


def test_short_fits_of_a_sweep_do_not_overwrite_each_other(tmp_path):
    # Two models, two callbacks, one log_dir, the same second: both runs stay readable.
    x, y = _data()
    histories = []
    for _ in range(2):
        histories.append(
            _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[TensorBoard(tmp_path)])
        )
    assert len(os.listdir(tmp_path / "train")) == 2
    steps, values = _epoch_losses(tmp_path / "train")
    assert steps == [0, 0]
    np.testing.assert_allclose(values, [h.history["loss"][0] for h in histories], rtol=1e-6)


def _unusable_log_dirs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    train_file = tmp_path / "has_train_file"
    train_file.mkdir()
    (train_file / "train").write_text("not a directory")
    cases = [
        (a_file, "is a file"),
        (a_file / "logs", "cannot be created"),
        (train_file, "train.*is a file"),
    ]
    if os.geteuid() != 0:  # root writes into read-only directories
        read_only = tmp_path / "read_only"
        read_only.mkdir()
        read_only.chmod(0o500)
        cases.append((read_only, "cannot be written"))
    return cases


def test_an_unusable_log_dir_fails_before_the_first_step(tmp_path):
    x, y = _data()
    for log_dir, why in _unusable_log_dirs(tmp_path):
        model = _model()
        before = model.get_weights()
        steps = []
        counter = LambdaCallback(
            on_train_batch_end=lambda batch, logs, steps=steps: steps.append(batch)
        )
        with pytest.raises(ValueError, match=rf"`log_dir`.*{why}.*Pass a directory"):
            model.fit(
                x, y, batch_size=8, epochs=1, verbose=0, callbacks=[TensorBoard(log_dir), counter]
            )
        assert steps == []
        for a, b in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(a, b)


def test_an_unusable_log_dir_fails_before_evaluate_runs(tmp_path):
    x, y = _data()
    log_dir = tmp_path / "a_file"
    log_dir.write_text("not a directory")
    batches = []
    counter = LambdaCallback(on_test_batch_end=lambda batch, logs: batches.append(batch))
    with pytest.raises(ValueError, match=r"`log_dir`.*a_file.*is a file"):
        _model().evaluate(x, y, verbose=0, callbacks=[TensorBoard(log_dir), counter])
    assert batches == []
