"""`jstrategy.Model`: compile, fit, evaluate, predict, callbacks and progress.

Keras 3's `compile` and `fit` arguments: what they mean here, or an error with the fix.

`compile`'s `loss_weights`, `run_eagerly`, `jit_compile` and `auto_scale_loss` exist here
only as what jstrategy always does; `fit`'s `validation_freq` and `validation_batch_size`
mean what they mean in Keras 3 (issue 21, "Differences from Keras 3").
"""

import functools
import importlib.util
import io
import logging
import pathlib

import flax.linen as nn
import helpers
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jstrategy
from jstrategy import callbacks as callbacks_lib
from jstrategy import losses
from jstrategy.callbacks import Callback

FEATURES = 6
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _data(rows=50, seed=0):
    return helpers.classification_data(rows, FEATURES, seed)


class Net(nn.Module):
    """Dense, BatchNorm (synchronized), Dropout, Dense: exercises every mutable path."""

    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=jstrategy.REPLICA_AXIS)(x)
        x = nn.Dropout(self.dropout, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


def _model(strategy, *, module=None, optimizer=None, spe=1, seed=0, metrics=("accuracy",)):
    with strategy.scope():
        model = jstrategy.Model(module or Net(), input_shape=(FEATURES,), seed=seed)
        model.compile(
            optimizer or optax.sgd(0.1, momentum=0.9),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=list(metrics),
            steps_per_execution=spe,
        )
    return model


def _close(a, b, atol=1e-5):
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0)


@pytest.mark.slow
def test_steps_per_execution_follows_the_same_trajectory():
    # 50 rows in batches of 7: 7 full steps and a partial one. With 3 steps per execution
    # that is two fused executions, one remainder step and the padded partial step.
    strategy = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    x, y = _data()
    models, histories = [], []
    for spe in (1, 3):
        model = _model(strategy, spe=spe)
        histories.append(model.fit(x, y, batch_size=7, epochs=2, verbose=0).history)
        models.append(model)
    _close(models[0].get_weights(), models[1].get_weights())
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(histories[0][name], histories[1][name], atol=1e-5)
    assert histories[0]["loss"][1] < histories[0]["loss"][0]
    # The fused program ran, and one-step programs for the remainder and the partial batch.
    assert models[1]._trainer.programs.train_keys() == [(0, True), (3, True)]


def test_fit_on_eight_replicas_matches_one_device():
    # Batches of 25 rows are padded to 32 for 8 replicas; the mask keeps the update exact.
    # (No BatchNorm here: padding rows would enter its batch statistics.)
    x, y = _data()
    mlp = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    one = _model(jstrategy.OneDeviceStrategy("cpu:0"), module=mlp)
    eight = _model(jstrategy.MirroredStrategy(), module=mlp)
    h1 = one.fit(x, y, batch_size=25, epochs=2, verbose=0).history
    h8 = eight.fit(x, y, batch_size=25, epochs=2, verbose=0).history
    _close(one.get_weights(), eight.get_weights())
    np.testing.assert_allclose(h1["loss"], h8["loss"], atol=1e-5)


@pytest.mark.slow
def test_history_validation_and_evaluate_agree():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(60)
    model = _model(strategy)
    history = model.fit(x, y, batch_size=8, epochs=3, validation_split=0.25, verbose=0)
    assert history is model.history
    assert list(history.history) == ["loss", "accuracy", "val_loss", "val_accuracy"]
    assert history.epoch == [0, 1, 2]
    assert all(len(v) == 3 for v in history.history.values())
    # The held-out part is the last 25% of the rows, unshuffled, as in Keras.
    result = model.evaluate(x[45:], y[45:], batch_size=4, verbose=0, return_dict=True)
    assert result["loss"] == pytest.approx(history.history["val_loss"][-1], abs=1e-6)
    assert result["accuracy"] == pytest.approx(history.history["val_accuracy"][-1], abs=1e-6)
    loss, accuracy = model.evaluate(x[45:], y[45:], verbose=0)
    assert (loss, accuracy) == pytest.approx((result["loss"], result["accuracy"]), abs=1e-6)


@pytest.mark.slow
def test_evaluate_and_predict_count_every_row_once():
    strategy = jstrategy.MirroredStrategy()
    x, y = _data(37)
    model = _model(strategy, metrics=())
    pred = model.predict(x, batch_size=16, verbose=0)
    assert pred.shape == (37, 3)
    variables = jax.device_get(model.variables)
    expected = Net().apply(variables, x, train=False)
    np.testing.assert_allclose(pred, expected, rtol=1e-5, atol=1e-6)
    loss = model.evaluate(x, y, batch_size=16, verbose=0)
    per_row = losses.SparseCategoricalCrossentropy(from_logits=True)(y, expected)
    assert loss == pytest.approx(float(np.mean(per_row)), rel=1e-5)


@pytest.mark.slow
def test_shuffling_and_dropout_are_seeded():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data()

    def trained(seed):
        model = _model(strategy, module=Net(dropout=0.3), seed=seed)
        model.fit(x, y, batch_size=10, epochs=2, verbose=0)
        return model.get_weights()

    first = trained(1)
    _close(first, trained(1), atol=0)
    assert not all(np.array_equal(a, b) for a, b in zip(first, trained(2), strict=True))


@pytest.mark.slow
def test_unshuffled_fit_matches_fit_on_datasets():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(40)
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 40, 10)]
    on_arrays = _model(strategy)
    on_arrays.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    on_list = _model(strategy, spe=3)
    on_list.fit(batches, epochs=2, verbose=0)
    on_dist = _model(strategy)
    on_dist.fit(strategy.experimental_distribute_dataset(batches), epochs=2, verbose=0)
    _close(on_arrays.get_weights(), on_list.get_weights())
    _close(on_arrays.get_weights(), on_dist.get_weights())
    assert on_list.predict(batches, verbose=0).shape == (40, 3)


@pytest.mark.slow
def test_a_one_shot_dataset_that_runs_out_stops_training_with_a_warning():
    x, y = _data(20)
    model = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    batches = iter([(x[:10], y[:10]), (x[10:], y[10:])])
    with pytest.warns(RuntimeWarning, match="training data ran out"):
        history = model.fit(batches, epochs=3, verbose=0)
    assert history.epoch == [0] and model.stop_training


class Recorder(callbacks_lib.Callback):
    """Records every hook call with its arguments (logs aside)."""

    def __init__(self):
        super().__init__()
        self.calls = []


def _recording(name):
    def hook(self, *args):
        self.calls.append((name, *args[:-1]))

    return hook


for _hook in (
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
):
    setattr(Recorder, _hook, _recording(_hook))


@pytest.mark.slow
def test_callback_hooks_are_called_in_keras_order():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(20)
    recorder = Recorder()
    model = _model(strategy, spe=2)
    model.fit(x, y, batch_size=5, validation_data=(x[:5], y[:5]), callbacks=[recorder], verbose=0)
    assert recorder.calls == [
        ("on_train_begin",),
        ("on_epoch_begin", 0),
        # Two fused executions of two steps each: hooks per execution, as in Keras.
        ("on_train_batch_begin", 0),
        ("on_train_batch_end", 1),
        ("on_train_batch_begin", 2),
        ("on_train_batch_end", 3),
        ("on_test_begin",),
        ("on_test_batch_begin", 0),
        ("on_test_batch_end", 0),
        ("on_test_end",),
        ("on_epoch_end", 0),
        ("on_train_end",),
    ]


def test_early_stopping_stops_and_restores_the_best_weights():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(20)
    model = _model(strategy)
    seen = []
    record = callbacks_lib.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(model.get_weights())
    )
    # The loss goes down, so in "max" mode the first epoch stays the best.
    stopper = callbacks_lib.EarlyStopping(
        monitor="loss", mode="max", patience=1, restore_best_weights=True
    )
    history = model.fit(x, y, batch_size=5, epochs=10, callbacks=[record, stopper], verbose=0)
    assert history.epoch == [0, 1]
    assert model.stop_training
    _close(model.get_weights(), seen[0], atol=0)
    assert not all(np.array_equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))


@pytest.mark.slow
def test_learning_rate_scheduler_changes_the_rate_without_recompiling(caplog):
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(20)
    model = _model(strategy, module=nn.Dense(3), optimizer="sgd")
    assert model.learning_rate == pytest.approx(0.01)
    rates = callbacks_lib.LearningRateScheduler(lambda epoch, lr: lr * 10 if epoch else 0.0)
    weights = []
    record = callbacks_lib.LambdaCallback(
        on_epoch_end=lambda epoch, logs: weights.append(model.get_weights())
    )
    before = model.get_weights()
    history = model.fit(x, y, batch_size=5, epochs=3, callbacks=[rates, record], verbose=0)
    assert history.history["learning_rate"] == pytest.approx([0.0, 0.0, 0.0])
    _close(weights[-1], before, atol=0)  # a zero rate leaves the weights alone
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        model.learning_rate = 0.05
        model.fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert model.learning_rate == pytest.approx(0.05)
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
    assert not all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


@pytest.mark.slow
def test_progress_output(capsys):
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(20)
    model = _model(strategy)
    model.fit(x, y, batch_size=5, epochs=2, verbose=0)
    model.evaluate(x, y, verbose=0)
    assert capsys.readouterr().out == ""
    model.fit(x, y, batch_size=5, epochs=2, verbose=1, validation_data=(x, y))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2" and len(lines) == 4
    assert lines[1].startswith("4/4 [====") and "\r" not in lines[1]
    assert "- loss: " in lines[1] and "- val_accuracy: " in lines[1]
    model.fit(x, y, batch_size=5, epochs=1, verbose=2)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("4/4 - ") and "loss: " in line and "[" not in line


def test_summary_prints_the_table():
    model = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    out = io.StringIO()
    model.summary(print_fn=lambda text: out.write(text))
    table = out.getvalue()
    assert table.startswith('Model: "net"')
    assert "BatchNorm_0 (BatchNorm)" in table and "(batch, 3)" in table
    assert "Total params: 115" in table  # 56 + 32 + 27 (BatchNorm: 16 trainable, 16 not)
    assert "Non-trainable params: 16" in table


def test_weights_round_trip_and_variables_are_placed():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    model = _model(strategy)
    kernel = model.variables["params"]["Dense_0"]["kernel"]
    assert kernel.sharding == strategy.replicated_sharding()
    weights = model.get_weights()
    assert len(weights) == 8  # Keras's order: Dense, BatchNorm (gamma, beta, mean, var), Dense
    model.set_weights([w + 1 for w in weights])
    _close(model.get_weights(), [w + 1 for w in weights], atol=0)
    with pytest.raises(ValueError, match="must hold 8 arrays"):
        model.set_weights(weights[:3])
    with pytest.raises(ValueError, match=r"`weights\[0\]` is Dense_0/kernel, of shape"):
        model.set_weights([np.ones(1)] * 8)


NnxNet = functools.partial(
    helpers.NnxNet, features=FEATURES, batch_norm={"axis_name": jstrategy.REPLICA_AXIS}, dropout=0.1
)


@pytest.mark.slow
def test_nnx_module_trains_evaluates_and_predicts():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(40)
    module = NnxNet(nnx.Rngs(0))
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.02)
    model = _model(strategy, module=module, optimizer=adam)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    pred = model.predict(x, verbose=0)
    module.eval()  # fit copied the trained variables back into the module
    np.testing.assert_allclose(pred, np.asarray(module(x)), rtol=1e-5, atol=1e-6)
    assert model.learning_rate == pytest.approx(0.02)
    weights = model.get_weights()
    assert len(weights) == 8  # no random-stream keys or counts
    model.set_weights(weights)
    np.testing.assert_allclose(model.predict(x, verbose=0), pred, rtol=1e-6)


@pytest.mark.slow
def test_builds_from_the_first_data_without_input_shape():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(20)
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(3))
    assert not model.built
    model.compile("adam", loss="mse")
    model.fit(x, jax.nn.one_hot(y, 3), batch_size=10, verbose=0)
    assert model.built and model.variables["params"]["kernel"].shape == (FEATURES, 3)
    with strategy.scope():
        from_dataset = jstrategy.Model(nn.Dense(3))
        from_dataset.compile("sgd", loss="mse")
    from_dataset.fit([(x, np.asarray(jax.nn.one_hot(y, 3)))], verbose=0)
    assert from_dataset.built


def test_errors_name_the_problem_and_the_fix():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(20)
    with strategy.scope():
        model = jstrategy.Model(Net(), input_shape=(FEATURES,))
    with pytest.raises(RuntimeError, match="must be compiled"):
        model.fit(x, y, verbose=0)
    with pytest.raises(RuntimeError, match="Call model.compile"):
        _ = model.learning_rate
    with pytest.raises(ValueError, match="Unknown optimizer 'adamm'"):
        model.compile("adamm", loss="mse")
    with pytest.raises(ValueError, match="`steps_per_execution` must be a positive int"):
        model.compile("sgd", loss="mse", steps_per_execution=0)
    model.compile("sgd", loss="mse")
    with pytest.raises(ValueError, match=r"`y` is required .*; pass fit\(x, y, \.\.\.\)"):
        model.fit(x, verbose=0)
    with pytest.raises(ValueError, match=r"`y` is required .*; pass evaluate\(x, y\)"):
        model.evaluate(x, verbose=0)
    with pytest.raises(ValueError, match="`y` must be None when `x` is a dataset"):
        model.fit([(x, y)], y, verbose=0)
    with pytest.raises(ValueError, match="validation_split"):
        model.fit(x, y, validation_split=1.5, verbose=0)
    with pytest.raises(ValueError, match="input_shape"):
        jstrategy.Model(nn.Dense(1)).summary()


def _run_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_keras_style_example_learns(capsys):
    final = _run_example("keras_style").main(epochs=3, verbose=0)
    assert final["accuracy"] >= 0.9
    out = capsys.readouterr().out
    assert "Total params: 193" in out and "final loss" in out


@pytest.mark.slow
def test_digits_example_reaches_95_percent(capsys):
    accuracy = _run_example("digits").main(verbose=2)
    assert accuracy >= 0.95
    out = capsys.readouterr().out
    assert 'Model: "digits_mlp"' in out and "val_accuracy" in out
    # Says why a machine without accelerators shows 8 replicas (issue 36, item 6).
    assert "8 replicas on 8 cpu devices: no accelerator here, so these are 8 fake CPU" in out
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in out


# TF habits (issue 14), finding 6: one rule for what fit and experimental_distribute_dataset take
def test_fit_takes_a_generator_function_as_experimental_distribute_dataset_does():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = helpers.regression_data()

    def batches():
        for i in range(0, 24, 8):
            yield x[i : i + 8], y[i : i + 8]

    from_function = helpers.dense_regression_model(strategy)
    history = from_function.fit(batches, epochs=2, verbose=0)
    from_list = helpers.dense_regression_model(strategy)
    from_list.fit(list(batches()), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2  # a generator function is iterated each epoch
    for a, b in zip(from_function.get_weights(), from_list.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("method", ["compile", "fit", "evaluate", "predict"])
def test_a_model_used_inside_another_strategys_scope_is_an_error(method):
    # Keras raises when a model made outside a strategy's scope is compiled inside it; here
    # it would train silently under the strategy it was created in.
    x, y = helpers.logits_and_labels(16)
    model = jstrategy.Model(helpers.Classifier(), input_shape=(10,))
    if method != "compile":
        model.compile("sgd", loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True))
    calls = {
        "compile": lambda: model.compile("sgd", loss="mse"),
        "fit": lambda: model.fit(x, y, verbose=0),
        "evaluate": lambda: model.evaluate(x, y, verbose=0),
        "predict": lambda: model.predict(x, verbose=0),
    }
    with (
        jstrategy.MirroredStrategy().scope(),
        pytest.raises(ValueError, match=rf"created under .*but `{method}` is called inside"),
    ):
        calls[method]()
    calls[method]()  # outside any scope it runs, under its own strategy


# Keras 3's compile and fit arguments: what they mean here, or an error with the fix.


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
