"""Keras 3 models (JAX backend) under jstrategy's strategies (`jstrategy.keras`, issue 49).

Two routes: Keras's own ``fit`` inside ``strategy.scope()`` (a ``keras.distribution``
backed by the strategy), and jstrategy's own training of a `KerasModule`. Both follow one
device: Keras's own ``fit`` on one device, and `OneDeviceStrategy`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import keras
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch
from jstrategy.keras import KerasModule
from jstrategy.keras import write_back

TOL = 1e-5


# keras-io's timeseries classification program -------------------------------------------
def make_model(input_shape, num_classes=2):
    """keras-io's ``make_model``, unchanged."""
    input_layer = keras.layers.Input(input_shape)

    conv1 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(input_layer)
    conv1 = keras.layers.BatchNormalization()(conv1)
    conv1 = keras.layers.ReLU()(conv1)

    conv2 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.BatchNormalization()(conv2)
    conv2 = keras.layers.ReLU()(conv2)

    conv3 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.BatchNormalization()(conv3)
    conv3 = keras.layers.ReLU()(conv3)

    gap = keras.layers.GlobalAveragePooling1D()(conv3)

    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)

    return keras.models.Model(inputs=input_layer, outputs=output_layer)


def _timeseries_fit(model, path, epochs=3):
    """The program's callbacks, compile and fit (``shuffle=False`` for a comparison)."""
    rng = np.random.default_rng(0)
    x_train = rng.normal(size=(160, 500, 1)).astype("float32")  # FordA: (n, 500, 1)
    y_train = rng.integers(0, 2, size=160)
    callbacks = [
        keras.callbacks.ModelCheckpoint(path, save_best_only=True, monitor="val_loss"),
        keras.callbacks.ReduceLROnPlateau(
            monitor="val_loss", factor=0.5, patience=20, min_lr=0.0001
        ),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=1),
    ]
    history = model.fit(
        x_train,
        y_train,
        batch_size=32,
        epochs=epochs,
        callbacks=callbacks,
        validation_split=0.2,
        verbose=0,
        shuffle=False,
    )
    return history.history, x_train, y_train


def _compile(model):
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )


def test_keras_io_timeseries_program_under_mirrored_follows_keras_on_one_device(tmp_path):
    keras.utils.set_random_seed(0)  # the same initial weights at every run: a fixed margin
    strategy = jstrategy.MirroredStrategy()  # the strategy lines: this one and the scope
    with strategy.scope():
        model = make_model(input_shape=(500, 1))
        _compile(model)
    kernel = model.layers[1].kernel.value
    assert kernel.sharding == strategy.replicated_sharding()
    weights = model.get_weights()
    got, x, y = _timeseries_fit(model, str(tmp_path / "best_model.keras"))  # outside the scope

    reference = make_model(input_shape=(500, 1))  # Keras alone, one device
    reference.set_weights(weights)
    _compile(reference)
    want, _, _ = _timeseries_fit(reference, str(tmp_path / "reference.keras"))

    for key in ("loss", "sparse_categorical_accuracy", "val_loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=TOL, atol=TOL, err_msg=key)
    assert got["loss"][-1] < got["loss"][0]
    # The best model the callback saved loads and evaluates as Keras's program does.
    best = keras.models.load_model(tmp_path / "best_model.keras")
    loss, _ = best.evaluate(x, y, verbose=0)
    assert np.isfinite(loss)


# A functional model with BatchNormalization and Dropout ----------------------------------
def bn_dropout_model():
    """Seeded initializers and dropout: every call builds the same model."""
    init = keras.initializers.GlorotUniform
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, use_bias=False, kernel_initializer=init(1), name="dense1")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Dropout(0.25, seed=2, name="drop")(h)
    outputs = keras.layers.Dense(3, kernel_initializer=init(3), name="out")(h)
    return keras.Model(inputs, outputs)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    return x, np.argmax(x[:, :3], axis=-1).astype(np.int32)


def _layout_map():
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("data", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["dense1/kernel"] = (None, "model")  # Keras's variable paths
    layout_map["out/kernel"] = ("model", None)
    return jstrategy.experimental.ModelParallelStrategy(layout_map, batch_dim_name="data")


STRATEGIES = {
    "mirrored": jstrategy.MirroredStrategy,
    "central_storage": jstrategy.CentralStorageStrategy,
    "fsdp": lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=0),
    "layout_map": _layout_map,
}


def _jstrategy_fit(strategy):
    x, y = _data()
    with strategy.scope():
        model = jstrategy.Model(KerasModule(bn_dropout_model()), input_shape=(6,))
        model.compile(
            optax.sgd(0.1), loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history.history["loss"]


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(tree))]


def _assert_trees_close(got, want):
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_keras_module_trains_through_jstrategy_fit_as_on_one_device(name):
    one, want = _jstrategy_fit(jstrategy.OneDeviceStrategy("cpu:0"))
    model, got = _jstrategy_fit(STRATEGIES[name]())
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    _assert_trees_close(model.state.variables, one.state.variables)
    assert want[-1] < want[0]


def test_the_keras_module_keys_variables_by_keras_paths_and_places_them_by_the_layout_map():
    model, _ = _jstrategy_fit(_layout_map())
    params = model.state.params
    assert params["dense1"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert set(model.state.batch_stats) == {"bn", "drop"}  # moving statistics, seed state


def test_dropout_and_batch_statistics_are_at_work():
    """Training mode changes the numbers, and the seed state advances each step."""
    model, _ = _jstrategy_fit(jstrategy.OneDeviceStrategy("cpu:0"))
    net = bn_dropout_model()
    x, _ = _data()
    seed0 = np.asarray(net.get_layer("drop").seed_generator.state.value)
    seed = jax.tree.leaves(jax.device_get(model.state.batch_stats["drop"]))[0]
    assert not np.array_equal(seed, seed0)
    assert not np.allclose(net(x, training=True), net(x, training=False))


def _keras_fit(strategy, x, y):
    scope = strategy.scope() if strategy is not None else jstrategy.OneDeviceStrategy("cpu:0")
    with scope if strategy is not None else _nullscope():
        model = bn_dropout_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"],
        )
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history.history


class _nullscope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ["mirrored", "fsdp", "layout_map"])
def test_keras_own_fit_under_a_strategy_follows_keras_on_one_device(name):
    x, y = _data()
    strategy = STRATEGIES[name]()
    model, got = _keras_fit(strategy, x, y)
    reference, want = _keras_fit(None, x, y)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=TOL, atol=TOL, err_msg=key)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
    kernel = model.get_layer("dense1").kernel.value
    assert kernel.sharding == strategy.variable_sharding(kernel, ("params", "dense1", "kernel"))
    np.testing.assert_allclose(
        model.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0), rtol=TOL, atol=TOL
    )
    np.testing.assert_allclose(
        model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=TOL, atol=TOL
    )


def test_keras_own_fit_is_refused_under_central_storage_with_the_route_that_runs():
    x, y = _data()
    with jstrategy.CentralStorageStrategy().scope():
        model = bn_dropout_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"CentralStorageStrategy.*host memory.*KerasModule"):
        model.fit(x, y, verbose=0)


def test_a_model_compiled_under_one_strategy_refuses_to_fit_in_another_scope():
    x, y = _data()
    with jstrategy.MirroredStrategy().scope():
        model = bn_dropout_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with (
        pytest.raises(ValueError, match=r"compiled under MirroredStrategy.*cannot fit"),
        jstrategy.OneDeviceStrategy("cpu:0").scope(),
    ):
        model.fit(x, y, verbose=0)


def test_the_train_step_factory_and_run_take_a_keras_module():
    x, y = _data()
    loss = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = []
    for strategy in (jstrategy.OneDeviceStrategy("cpu:0"), jstrategy.MirroredStrategy()):
        with strategy.scope():
            state = training.create_train_state(
                KerasModule(bn_dropout_model()), optax.sgd(0.1), x[:1], rng=0
            )
            step = training.make_train_step(loss)
        losses = []
        for i in range(0, 64, 16):
            state, logs = step(state, distribute_batch(strategy, (x[i : i + 16], y[i : i + 16])))
            dispatch.track(logs)
            losses.append(logs["loss"])
        net = bn_dropout_model()
        params = state.params

        def forward(xs, net=net, params=params):
            t = [
                params[v.path.split("/")[0]][v.path.split("/")[1]] for v in net.trainable_variables
            ]
            nt = [v.value for v in net.non_trainable_variables]
            return net.stateless_call(t, nt, xs)[0]

        outputs = strategy.run(forward, (distribute_batch(strategy, x[:16]),))
        results.append((jax.device_get(losses), strategy.gather(outputs, axis=0), state))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=TOL, atol=TOL)
    _assert_trees_close(results[1][2].variables, results[0][2].variables)


def test_a_keras_module_checkpoint_moves_between_strategies(tmp_path):
    fsdp, _ = _jstrategy_fit(STRATEGIES["fsdp"]())
    fsdp.save_weights(tmp_path / "ckpt")
    x, _ = _data()
    for name in ("mirrored", "central_storage", "layout_map"):
        strategy = STRATEGIES[name]()
        with strategy.scope():
            model = jstrategy.Model(KerasModule(bn_dropout_model()), input_shape=(6,))
            model.compile(optax.sgd(0.1), loss="sparse_categorical_crossentropy")
        model.load_weights(tmp_path / "ckpt")
        _assert_trees_close(model.state.variables, fsdp.state.variables)
        np.testing.assert_allclose(
            model.predict(x, verbose=0), fsdp.predict(x, verbose=0), rtol=TOL, atol=TOL
        )
    # And back into Keras: the Keras model predicts what jstrategy trained.
    net = bn_dropout_model()
    write_back(net, fsdp.state.variables)
    np.testing.assert_allclose(net.predict(x, verbose=0), fsdp.predict(x, verbose=0), atol=TOL)


def test_keras_random_ops_other_than_dropout_are_refused_in_a_replicated_step():
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(keras.layers.GaussianNoise(0.1, seed=1)(inputs))
    x, y = _data()
    with jstrategy.MirroredStrategy().scope():
        model = jstrategy.Model(KerasModule(keras.Model(inputs, outputs)), input_shape=(6,))
        model.compile(optax.sgd(0.1), loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"keras.random.normal .*supports Dropout"):
        model.fit(x, y, batch_size=16, verbose=0)


def test_an_unbuilt_keras_model_is_refused_with_the_fix():
    net = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"needs a built keras.Model.*model.build"):
        jstrategy.Model(KerasModule(net), input_shape=(6,))


def test_jstrategy_keras_is_the_namespace_loaded_when_asked_for():
    assert jstrategy.keras.KerasModule is KerasModule
    assert "StrategyDistribution" in jstrategy.keras.__all__


def test_importing_jstrategy_does_not_import_keras():
    code = "import sys, jstrategy; assert 'keras' not in sys.modules, 'keras imported'"
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_jstrategy_keras_runs_keras_on_jax_where_no_backend_was_chosen():
    # Keras's default backend is TensorFlow, which is not installed here (`make docs`
    # imports jstrategy.keras with no KERAS_BACKEND set).
    code = "import jstrategy.keras, keras; print(keras.backend.backend())"
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "jax"


def test_a_non_jax_keras_backend_is_refused_with_the_fix():
    code = "import jstrategy.keras"
    env = {**os.environ, "KERAS_BACKEND": "numpy"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "KERAS_BACKEND=jax" in done.stderr


# Sequential and subclassed models; Keras's own weights across strategies ------------------
class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        init = keras.initializers.GlorotUniform
        self.dense1 = keras.layers.Dense(16, kernel_initializer=init(1), name="dense1")
        self.bn = keras.layers.BatchNormalization(name="bn")
        self.drop = keras.layers.Dropout(0.25, seed=2, name="drop")
        self.out = keras.layers.Dense(3, kernel_initializer=init(3), name="out")

    def call(self, x, training=False):
        h = self.drop(keras.ops.relu(self.bn(self.dense1(x), training=training)), training=training)
        return self.out(h)


def sequential():
    init = keras.initializers.GlorotUniform
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, kernel_initializer=init(1), name="dense1"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(),
            keras.layers.Dropout(0.25, seed=2, name="drop"),
            keras.layers.Dense(3, kernel_initializer=init(3), name="out"),
        ]
    )


def subclassed():
    net = Subclassed()
    net(np.zeros((1, 6), np.float32))  # built by a first call, as Keras's guides build one
    return net


@pytest.mark.parametrize("build", [sequential, subclassed], ids=["sequential", "subclassed"])
def test_sequential_and_subclassed_models_take_both_routes(build):
    x, y = _data()
    histories = []
    for strategy in (None, jstrategy.MirroredStrategy()):
        with strategy.scope() if strategy is not None else _nullscope():
            net = build()
            net.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        histories.append(net.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0))
    np.testing.assert_allclose(
        histories[1].history["loss"], histories[0].history["loss"], rtol=TOL, atol=TOL
    )
    losses = []
    for strategy in (jstrategy.OneDeviceStrategy("cpu:0"), jstrategy.MirroredStrategy()):
        with strategy.scope():
            model = jstrategy.Model(KerasModule(build()), input_shape=(6,))
            model.compile(
                optax.sgd(0.1),
                loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        losses.append(model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0))
    np.testing.assert_allclose(
        losses[1].history["loss"], losses[0].history["loss"], rtol=TOL, atol=TOL
    )
    # Both routes are one computation: Keras's own fit on one device, jstrategy's.
    np.testing.assert_allclose(
        losses[0].history["loss"], histories[0].history["loss"], rtol=1e-4, atol=1e-4
    )


def test_keras_own_weights_move_between_strategies(tmp_path):
    x, y = _data()
    with jstrategy.experimental.FSDPStrategy(min_shard_size=0).scope():
        trained = bn_dropout_model()
        trained.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    trained.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    trained.save_weights(tmp_path / "model.weights.h5")
    for name in ("mirrored", "layout_map"):
        strategy = STRATEGIES[name]()
        with strategy.scope():
            model = bn_dropout_model()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.load_weights(tmp_path / "model.weights.h5")
        kernel = model.get_layer("dense1").kernel.value
        assert kernel.sharding == strategy.variable_sharding(kernel, ("params", "dense1", "kernel"))
        np.testing.assert_allclose(
            model.predict(x, verbose=0), trained.predict(x, verbose=0), rtol=TOL, atol=TOL
        )


# Keras's losses and optimizers through jstrategy's compile --------------------------------
def _keras_objects():
    return (
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


@pytest.mark.parametrize("name", ["mirrored", "fsdp"])
def test_keras_losses_and_optimizers_train_through_jstrategy_as_keras_does(name):
    x, y = _data()
    reference = bn_dropout_model()
    reference.compile(*_keras_objects())
    want = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    tx, loss = _keras_objects()
    with STRATEGIES[name]().scope():
        model = jstrategy.Model(KerasModule(bn_dropout_model()), input_shape=(6,))
        model.compile(jstrategy.keras.optimizer(tx), loss=jstrategy.keras.loss(loss))
    got = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=TOL, atol=TOL)
    net = bn_dropout_model()
    write_back(net, model.state.variables)
    for a, b in zip(net.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


def test_keras_objects_given_to_jstrategy_compile_are_refused_with_the_adapter():
    tx, loss = _keras_objects()
    with jstrategy.MirroredStrategy().scope():
        model = jstrategy.Model(KerasModule(bn_dropout_model()), input_shape=(6,))
        with pytest.raises(
            ValueError, match=r"Adam is a Keras 3 object.*jstrategy.keras.optimizer"
        ):
            model.compile(tx, loss="sparse_categorical_crossentropy")
        with pytest.raises(
            ValueError, match=r"SparseCategoricalCrossentropy is a Keras 3 object.*keras.loss"
        ):
            model.compile(optax.sgd(0.1), loss=loss)
        with pytest.raises(ValueError, match=r"SparseCategoricalAccuracy is a Keras 3 object"):
            model.compile(
                optax.sgd(0.1),
                loss="sparse_categorical_crossentropy",
                metrics=[keras.metrics.SparseCategoricalAccuracy()],
            )


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_keras_own_fit_under_two_worker_processes_follows_keras_on_one_device(tmp_path):
    """MultiWorkerMirroredStrategy over two processes of four devices: Keras's own fit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", KERAS_BACKEND="jax", PYTHONPATH=root)
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "4", "--timeout", "300",
        os.path.join(root, "tests", "keras3_worker.py"), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    x, y = _data()
    reference, want = _keras_fit(None, x, y)
    for worker in range(2):
        saved = json.loads((tmp_path / f"worker-{worker}.json").read_text())
        np.testing.assert_allclose(saved["losses"], want["loss"], rtol=TOL, atol=TOL)
        for a, b in zip(saved["weights"], reference.weights, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b.value), rtol=TOL, atol=TOL)
