"""`jstrategy.callbacks.TensorBoard`: Keras's layout and tags, read back with TensorBoard's
own event reader, and `jax.profiler` traces for `profile_batch`.


"""

from __future__ import annotations

import glob
import os

import flax.linen as nn
import helpers
import jax
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy.callbacks import LambdaCallback
from jstrategy.callbacks import TensorBoard

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

EPOCHS, STEPS = 3, 4  # 64 rows at batch 16


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] - x[:, 1] > 0).astype(np.int32)
    return x, y


def _model():
    model = jstrategy.Model(nn.Dense(2), input_shape=(4,), seed=0)
    # A rate the model can read (`model.learning_rate`), logged as epoch_learning_rate.
    model.compile(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.05),
        loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _read(path):
    reader = event_accumulator.EventAccumulator(
        path, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0}
    )
    reader.Reload()
    return reader


def _scalars(reader, tag):
    events = reader.Scalars(tag)
    return [e.step for e in events], [e.value for e in events]


def test_epoch_scalars_histograms_and_summary_match_the_history(tmp_path):
    x, y = _data()
    model = _model()
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=EPOCHS,
        validation_data=(x[:32], y[:32]),
        verbose=0,
        callbacks=[TensorBoard(tmp_path, histogram_freq=2)],
    )
    assert sorted(os.listdir(tmp_path)) == ["train", "validation"]
    train = _read(str(tmp_path / "train"))
    assert {"epoch_loss", "epoch_accuracy", "epoch_learning_rate"} <= set(train.Tags()["scalars"])
    assert not any(tag.startswith("batch_") for tag in train.Tags()["scalars"])
    for name in ("loss", "accuracy"):
        steps, values = _scalars(train, f"epoch_{name}")
        assert steps == list(range(EPOCHS))
        np.testing.assert_allclose(values, history.history[name], rtol=1e-6)
    steps, rates = _scalars(train, "epoch_learning_rate")
    assert steps == list(range(EPOCHS))
    np.testing.assert_allclose(rates, [0.05] * EPOCHS, rtol=1e-6)  # float32 in the events
    # Histograms every 2 epochs, of every variable, by path.
    assert set(train.Tags()["histograms"]) == {
        "params/kernel/histogram",
        "params/bias/histogram",
    }
    kernel = train.Histograms("params/kernel/histogram")
    assert [h.step for h in kernel] == [0, 2]
    final = np.asarray(model.variables["params"]["kernel"])
    assert kernel[-1].histogram_value.num == final.size
    np.testing.assert_allclose(kernel[-1].histogram_value.sum, final.sum(), rtol=1e-5)
    assert "keras/text_summary" in train.Tags()["tensors"]  # write_graph: the summary table

    validation = _read(str(tmp_path / "validation"))
    for name in ("loss", "accuracy"):
        steps, values = _scalars(validation, f"epoch_{name}")
        assert steps == list(range(EPOCHS))
        np.testing.assert_allclose(values, history.history[f"val_{name}"], rtol=1e-6)
        # Each evaluation, at the training step it followed.
        steps, values = _scalars(validation, f"evaluation_{name}_vs_iterations")
        assert steps == [STEPS * (e + 1) for e in range(EPOCHS)]
        np.testing.assert_allclose(values, history.history[f"val_{name}"], rtol=1e-6)


def test_histograms_cover_variables_split_over_the_replicas(tmp_path):
    # Under FSDP a kernel is split over the 8 devices; its histogram is of the whole kernel.
    x, y = _data()
    strategy = jstrategy.experimental.FSDPStrategy(min_shard_size=1)
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(8), input_shape=(4,), seed=0)
        model.compile("sgd", loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert not model.variables["params"]["kernel"].sharding.is_fully_replicated
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[TensorBoard(tmp_path, histogram_freq=1)],
    )
    kernel = _read(str(tmp_path / "train")).Histograms("params/kernel/histogram")[-1]
    final = np.asarray(model.variables["params"]["kernel"])
    assert kernel.histogram_value.num == final.size == 32
    np.testing.assert_allclose(kernel.histogram_value.sum, final.sum(), rtol=1e-5)


@pytest.mark.parametrize("update_freq", ["batch", 5])
def test_batch_scalars_at_the_training_step(tmp_path, update_freq):
    x, y = _data()
    model = _model()
    seen = {}
    record = LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.__setitem__(len(seen) + 1, float(logs["loss"]))
    )
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[record, TensorBoard(tmp_path, update_freq=update_freq, write_graph=False)],
    )
    train = _read(str(tmp_path / "train"))
    steps, values = _scalars(train, "batch_loss")
    every = 1 if update_freq == "batch" else update_freq
    assert steps == list(range(every, EPOCHS * STEPS + 1, every))
    # The batch logs: the epoch's running mean, which at its last batch is the epoch's loss.
    np.testing.assert_allclose(values, [seen[s] for s in steps], rtol=1e-6)
    if every == 1:
        np.testing.assert_allclose(values[STEPS - 1 :: STEPS], history.history["loss"], rtol=1e-6)
    assert "batch_accuracy" in train.Tags()["scalars"]


def test_profile_batch_writes_a_jax_profiler_trace(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[TensorBoard(tmp_path, profile_batch=(2, 3), write_graph=False)],
    )
    traces = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
    # The profiler was released: another trace can start.
    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()


def test_a_failed_fit_releases_the_profiler(tmp_path):
    x, y = _data()

    def fail(batch, logs):
        if batch == 1:
            raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        _model().fit(
            x,
            y,
            batch_size=16,
            verbose=0,
            callbacks=[
                TensorBoard(tmp_path, profile_batch=(1, 4), write_graph=False),
                LambdaCallback(on_train_batch_end=fail),
            ],
        )
    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()


def test_evaluate_alone_logs_the_evaluation_at_the_training_step(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    result = model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[TensorBoard(tmp_path)])
    validation = _read(str(tmp_path / "validation"))
    steps, values = _scalars(validation, "evaluation_loss_vs_iterations")
    assert steps == [STEPS]
    np.testing.assert_allclose(values, [result[0] if isinstance(result, list) else result])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"update_freq": 0}, "`update_freq` must be 'epoch', 'batch' or a positive int"),
        ({"update_freq": "sometimes"}, "`update_freq` must be"),
        ({"histogram_freq": -1}, "`histogram_freq` must be a non-negative int"),
        ({"profile_batch": (3, 2)}, "`profile_batch` must be"),
        ({"profile_batch": (0, 2)}, "`profile_batch` must be"),
        ({"profile_batch": "a,b"}, "`profile_batch` must be"),
        ({"profile_batch": -1}, "`profile_batch` must be"),
        ({"write_images": True}, "`write_images` is not supported"),
        ({"embeddings_freq": 1}, "`embeddings_freq` is not supported"),
        ({"log_dir": ""}, "`log_dir` must be a directory path"),
    ],
)
def test_bad_arguments_are_explained(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorBoard(**kwargs)


def test_profile_batch_forms():
    assert TensorBoard(profile_batch="2,4")._stop_batch == 4
    assert (TensorBoard(profile_batch=3)._start_batch, TensorBoard()._should_trace) == (3, False)


def test_tensorboard_logs_the_rate_applied_and_none_it_cannot_know(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    rates = [0.1, 0.02]
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    keras = helpers.dense_regression_model(strategy, jstrategy.optimizers.SGD(0.3))
    helpers.fit_regression(
        keras,
        callbacks=[
            jstrategy.callbacks.LearningRateScheduler(lambda epoch: rates[epoch]),
            jstrategy.callbacks.TensorBoard(tmp_path / "keras"),
        ],
    )
    plain = helpers.dense_regression_model(strategy, optax.sgd(0.1))
    helpers.fit_regression(plain, callbacks=[jstrategy.callbacks.TensorBoard(tmp_path / "plain")])
    logged = {}
    for name in ("keras", "plain"):
        reader = accumulator.EventAccumulator(str(tmp_path / name / "train"))
        reader.Reload()
        logged[name] = reader
    keras_rates = [e.value for e in logged["keras"].Scalars("epoch_learning_rate")]
    np.testing.assert_allclose(keras_rates, rates, rtol=1e-6)
    for a, b in zip(keras.get_weights(), helpers.sgd_epochs(strategy, rates), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # optax.sgd(0.1) keeps its rate inside its code: nothing is logged rather than a guess.
    assert "epoch_learning_rate" not in logged["plain"].Tags()["scalars"]
    assert "epoch_loss" in logged["plain"].Tags()["scalars"]
