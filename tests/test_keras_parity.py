"""Keras 3's habits a porting user brings (issue 34, items 6-17; issue 36, item 6).

Where a name says Keras, the numbers are Keras's (`tests/data/keras_parity_reference.json`,
recorded from Keras 3.15 by `tests/reference/record_keras_parity.py`), or the difference is
an error with the fix: the first names a Keras user types, the layer arguments Keras takes,
`fit`'s validation split, saving and loading without the layers' code.
"""

from __future__ import annotations

import json

import flax.linen as nn
import numpy as np
import pytest

import jstrategy
from jstrategy import layers as L
from jstrategy._src.cluster import PeerFailureError
from jstrategy._src.rendezvous import ClusterStartupError


def _data(rows=10, features=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = rng.normal(size=(rows, 2)).astype(np.float32)
    return x, y


def _regression(seed=None, **compile_kwargs):
    model = jstrategy.Sequential([L.Dense(4, input_shape=(3,)), L.Dense(2)], seed=seed)
    model.compile(compile_kwargs.pop("optimizer", "sgd"), loss="mse", **compile_kwargs)
    return model


# fit ---------------------------------------------------------------------------------------
def test_validation_split_keeps_the_first_floor_rows_for_training_as_keras():
    x, y = _data(10)
    model = _regression(optimizer=jstrategy.optimizers.SGD(0.0))  # the weights stay
    history = model.fit(x, y, batch_size=10, validation_split=0.25, verbose=0).history
    # Keras 3 trains on the first floor(10 * 0.75) = 7 rows and validates on the last 3.
    train = model.evaluate(x[:7], y[:7], verbose=0)
    held_out = model.evaluate(x[7:], y[7:], verbose=0)
    assert history["loss"][0] == pytest.approx(train, rel=1e-6)
    assert history["val_loss"][0] == pytest.approx(held_out, rel=1e-6)
    assert history["val_loss"][0] != pytest.approx(model.evaluate(x[8:], y[8:], verbose=0))


def test_labels_given_as_lists_are_arrays():
    x, y = _data(8)
    labels = (y[:, 0] > 0).astype(np.int32)
    losses = []
    for given in (labels, labels.tolist()):
        model = jstrategy.Sequential([L.Dense(2, input_shape=(3,))], seed=1)
        model.compile("sgd", jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses.append(model.fit(x, given, batch_size=4, epochs=2, verbose=0).history["loss"])
        validation = model.evaluate(x.tolist(), labels.tolist(), verbose=0)
        assert validation == pytest.approx(model.evaluate(x, labels, verbose=0), rel=1e-6)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    model.fit(x, labels.tolist(), validation_data=(x[:2].tolist(), [0, 1]), verbose=0)


def test_float64_data_trains_without_a_truncation_warning():
    # NumPy's default float64 (np.random.rand) is float32 on the devices; checking the
    # labels against the model's outputs must not warn that it is truncated.
    rng = np.random.default_rng(0)
    model = jstrategy.Sequential([L.Dense(3)])
    model.compile("sgd", jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(rng.random((8, 4)), rng.integers(0, 3, 8), verbose=0)
    assert model.get_config()["input_dtype"] == "float32"


# The first names a Keras user types ------------------------------------------------------
def test_cluster_errors_the_readme_names_are_public():
    assert jstrategy.ClusterStartupError is ClusterStartupError
    assert jstrategy.PeerFailureError is PeerFailureError
    assert {"ClusterStartupError", "PeerFailureError"} <= set(jstrategy.__all__)


def test_input_is_top_level_and_input_layer_takes_keras_shapes():
    assert jstrategy.Input is L.Input
    first = jstrategy.Sequential([jstrategy.Input(shape=(3,)), L.Dense(2)])
    assert first.count_params() == 8 and [layer.name for layer in first.layers] == ["dense"]
    for entry in (
        L.InputLayer(shape=(3,)),
        L.InputLayer(input_shape=(3,)),
        L.InputLayer(batch_shape=(None, 3)),
        L.Input(batch_shape=(None, 3)),
    ):
        assert jstrategy.Sequential([entry, L.Dense(2)]).count_params() == 8
    assert L.InputLayer(shape=(5,), dtype="int32").dtype == "int32"
    with pytest.raises(ValueError, match=r"InputLayer needs `shape`"):
        L.InputLayer()
    with pytest.raises(ValueError, match=r"Pass `shape` or `batch_shape`"):
        L.Input(shape=(3,), batch_shape=(None, 3))


def test_to_categorical_is_keras():
    out = jstrategy.utils.to_categorical([0, 2, 1, 2], num_classes=4)
    np.testing.assert_array_equal(out, [[1, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 1, 0]])
    assert out.dtype == np.float64  # Keras 3's
    column = jstrategy.utils.to_categorical(np.array([[1], [0], [3]]))  # (n, 1): squeezed
    assert column.shape == (3, 4) and column[2, 3] == 1
    assert jstrategy.utils.to_categorical([[0, 1], [1, 0]]).shape == (2, 2, 2)
    assert jstrategy.utils.to_categorical([1], 2, dtype="float32").dtype == np.float32
    with pytest.raises(ValueError, match=r"label 3, outside \[0, num_classes\) = \[0, 3\)"):
        jstrategy.utils.to_categorical([0, 3], num_classes=3)
    with pytest.raises(ValueError, match=r"label -1"):
        jstrategy.utils.to_categorical([0, -1], num_classes=3)
    with pytest.raises(ValueError, match=r"whole numbers.*with fractions"):
        jstrategy.utils.to_categorical([0.5, 1.0])


def test_set_random_seed_seeds_models_made_without_a_seed():
    try:
        jstrategy.utils.set_random_seed(5)
        unseeded = _regression().get_weights()
        first_draw = np.random.rand()
        jstrategy.utils.set_random_seed(5)
        assert np.random.rand() == first_draw
    finally:
        jstrategy.utils.set_random_seed(0)
    for a, b in zip(unseeded, _regression(seed=5).get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    other = _regression(seed=0).get_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(unseeded, other, strict=True))
    with pytest.raises(ValueError, match=r"`seed` must be a non-negative int; got 'a'"):
        jstrategy.utils.set_random_seed("a")


@pytest.mark.parametrize(
    ("namespace", "name", "advice"),
    [
        (jstrategy, "keras", r"jstrategy is the Keras API here: jstrategy.Sequential"),
        (jstrategy, "train", r"CheckpointManager"),
        (jstrategy, "Checkpoint", r"model.save\(path\)"),
        (jstrategy, "GradientTape", r"jax.grad"),
        (jstrategy.layers, "LSTM", r"flax.linen.RNN\(flax.linen.OptimizedLSTMCell"),
        (jstrategy.layers, "Conv1D", r"flax.linen.Conv\(filters, kernel_size=\(k,\)\)"),
        (jstrategy.layers, "ReLU", r"Activation\('relu'\)"),
        (jstrategy.utils, "plot_model", r"model.summary\(\)"),
        (jstrategy.optimizers, "LossScaleOptimizer", r"mixed_float16"),
        (jstrategy.models, "Sequential", r"jstrategy.Sequential"),
    ],
)
def test_missing_keras_and_tf_names_say_what_to_use(namespace, name, advice):
    with pytest.raises(AttributeError, match=rf"has no attribute '{name}'\. .*{advice}"):
        getattr(namespace, name)
    assert not hasattr(namespace, name)


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=r"^module 'jstrategy' has no attribute 'nope'$"):
        jstrategy.nope  # noqa: B018


# Layer arguments -------------------------------------------------------------------------
def test_numpy_sizes_are_python_ints_so_the_model_saves(tmp_path):
    labels = np.array([0, 2, 1, 2])
    model = jstrategy.Sequential(
        [L.Dense(np.int64(4), input_shape=(np.int32(3),)), L.Dense(labels.max() + 1)]
    )
    assert type(model.layers[1].units) is int and model.layers[0].input_shape == (3,)
    model.compile("adam", "mse")
    model.save(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "jstrategy_model.json").read_text())
    assert config["layers"][1]["config"]["units"] == 3
    loaded = jstrategy.models.load_model(tmp_path / "m")
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.parametrize(
    ("make", "shape", "message"),
    [
        (lambda: L.Conv2D(2, 5), (3, 3, 1), r"Conv2D 'conv2d': its window \(5, 5\) is larger"),
        (
            lambda: L.Conv2D(2, 3, dilation_rate=2),
            (4, 8, 1),
            r"window \(5, 5\) is larger than the \(4, 8\) image",
        ),
        (lambda: L.MaxPooling2D(5), (3, 3, 1), r"MaxPooling2D 'max_pooling2d': its window"),
        (lambda: L.AveragePooling2D((1, 4)), (3, 3, 2), r"AveragePooling2D"),
    ],
)
def test_a_window_larger_than_its_input_is_refused_before_any_work(make, shape, message):
    with pytest.raises(ValueError, match=message + r".*Computed output size would be zero"):
        jstrategy.Sequential([L.Input(shape), make(), L.Flatten(), L.Dense(1)]).count_params()
    # padding="same" keeps every position: no error.
    same = jstrategy.Sequential([L.Input(shape), make().clone(padding="same"), L.Flatten()])
    assert same.count_params() >= 0


@pytest.mark.parametrize("make", [lambda: L.Conv2D(2, 3), L.MaxPooling2D, L.GlobalAveragePooling2D])
def test_images_without_a_channel_axis_name_the_fix(make):
    with pytest.raises(
        ValueError,
        match=r"takes inputs of rank 4, \(batch, height, width, channels\); got inputs of "
        r"shape \(1, 8, 8\)\. Add a channel axis: x\[\.\.\., None\] \(then "
        r"input_shape=\(8, 8, 1\)\), or start the model with Reshape\(\(8, 8, 1\)\)",
    ):
        jstrategy.Sequential([L.Input((8, 8)), make()]).count_params()


# Saving and loading ----------------------------------------------------------------------
def test_a_sequential_holding_a_flax_layer_loads_by_the_route_its_error_gives(tmp_path):
    x, y = _data(8)
    model = jstrategy.Sequential([L.Dense(4, input_shape=(3,)), nn.Dense(2)])
    model.compile("adam", "mse")
    model.fit(x, y, verbose=0)
    model.save(tmp_path / "m")
    with pytest.raises(
        ValueError,
        match=r"config was not saved \(flax.linen.linear.Dense is not a jstrategy.layers "
        r"layer\).*Pass them: load_model\(path, \[layer, \.\.\.\]\), new layers of the saved "
        r"classes in the saved order \(jstrategy.layers.Dense, Dense\)",
    ):
        jstrategy.models.load_model(tmp_path / "m")
    loaded = jstrategy.models.load_model(tmp_path / "m", [L.Dense(4), nn.Dense(2)])
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert int(loaded.state.step) == int(model.state.step) == 1
    with pytest.raises(ValueError, match=r"`layer_classes` says the Sequential was saved with"):
        jstrategy.models.load_model(tmp_path / "m", [L.Dense(4), L.Dense(2)])


def test_a_layer_given_a_function_is_named_in_the_load_error(tmp_path):
    model = jstrategy.Sequential([L.Dense(2, input_shape=(3,), activation=lambda v: v)])
    model.save(tmp_path / "m")
    with pytest.raises(ValueError, match=r"Dense.activation is function .*give it by name"):
        jstrategy.models.load_model(tmp_path / "m")
    loaded = jstrategy.models.load_model(tmp_path / "m", [L.Dense(2, activation=lambda v: v)])
    np.testing.assert_array_equal(loaded.get_weights()[0], model.get_weights()[0])


def test_a_compiled_model_saved_before_training_loads_and_trains(tmp_path):
    x, y = _data(8)
    model = _regression(optimizer="adam")
    model.save(tmp_path / "m")
    loaded = jstrategy.models.load_model(tmp_path / "m")
    assert type(loaded.optimizer).__name__ == "Adam"
    np.testing.assert_array_equal(loaded.get_weights()[0], model.get_weights()[0])
    h1 = loaded.fit(x, y, epochs=2, verbose=0).history["loss"]
    h2 = model.fit(x, y, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(h1, h2, rtol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"input_shape": [1000000, 1000000]},
            r"`input_shape` must be the shape of one row of at most 2\*\*30 numbers.*"
            r"1,000,000,000,000 numbers",
        ),
        (
            {"input_dtype": "object"},
            r"`input_dtype` must be a NumPy dtype name; got 'object', not a dtype of numbers",
        ),
        ({"layers": [3]}, r"`layers\[0\]` must be a JSON object describing a layer"),
        (
            {"layers": [{"class_name": "Dense", "config": {"units": -1}}]},
            r"`layers\[0\]`: does not build a jstrategy layer: `units` must be a positive int",
        ),
    ],
)
def test_a_tampered_sample_row_or_layer_names_the_file_and_field(tmp_path, change, message):
    model = _regression()
    model.save(tmp_path / "m")
    file = tmp_path / "m" / "jstrategy_model.json"
    config = json.loads(file.read_text())
    config.update(change)
    file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"jstrategy_model.json: {message}"):
        jstrategy.models.load_model(tmp_path / "m")
