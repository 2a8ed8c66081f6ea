"""Keras 3's habits a porting user brings (issue 34, items 6-17; issue 36, item 6).

Where a name says Keras, the numbers are Keras's (`tests/data/keras_parity_reference.json`,
recorded from Keras 3.15 by `tests/reference/record_keras_parity.py`), or the difference is
an error with the fix: the first names a Keras user types, the layer arguments Keras takes,
`fit`'s validation split, saving and loading without the layers' code.
"""

from __future__ import annotations

import json
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import layers as L
from jstrategy._src.cluster.join import PeerFailureError
from jstrategy._src.cluster.rendezvous import ClusterStartupError

REFERENCE = json.loads(
    (pathlib.Path(__file__).parent / "data" / "keras_parity_reference.json").read_text()
)


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
        (jstrategy, "distribute", r"jstrategy is tf.distribute"),
        (jstrategy, "train", r"CheckpointManager"),
        (jstrategy, "Checkpoint", r"model.save\(path\)"),
        (jstrategy, "GradientTape", r"jax.grad"),
        (jstrategy.layers, "LSTM", r"flax.linen.RNN\(flax.linen.OptimizedLSTMCell"),
        (jstrategy.layers, "Conv3D", r"flax.linen.Conv\(filters, kernel_size=\(k, k, k\)\)"),
        (jstrategy.layers, "Softmax", r"Activation\('softmax'\)"),
        (jstrategy.layers, "Multiply", r"jstrategy.layers.Lambda\(lambda t: t\[0\] \* t\[1\]\)"),
        (jstrategy.utils, "plot_model", r"model.summary\(\)"),
        (jstrategy.optimizers, "LossScaleOptimizer", r"mixed_float16"),
        (jstrategy.models, "Sequential", r"jstrategy.Sequential"),
    ],
)
def test_missing_keras_and_tf_names_say_what_to_use(namespace, name, advice):
    with pytest.raises(AttributeError, match=rf"has no attribute '{name}'\. .*{advice}"):
        getattr(namespace, name)
    assert not hasattr(namespace, name)
    # A name that is no Keras or TF name keeps Python's plain message.
    with pytest.raises(AttributeError, match=r"^module '[a-z.]+' has no attribute 'nope'$"):
        namespace.nope  # noqa: B018


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


def test_a_model_of_flaxs_own_sequential_loads_with_its_module(tmp_path):
    """Flax's ``nn.Sequential`` is a module, not a jstrategy.Sequential's list of layers
    (it was taken for one: "load_model got a list of layers")."""
    x, _ = _data(8)
    model = jstrategy.Model(nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)]), (3,))
    model.compile("sgd", "mse")
    model.save(tmp_path / "m")
    loaded = jstrategy.models.load_model(
        tmp_path / "m", nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    )
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


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


# Keras's weight order --------------------------------------------------------------------
KERAS_MODELS = {
    "dense_bn_dense": lambda: [L.Input((3,)), L.Dense(4), L.BatchNormalization(), L.Dense(2)],
    "twelve_dense": lambda: [L.Input((3,)), *[L.Dense(3, activation="tanh") for _ in range(12)]],
    "conv": lambda: [L.Input((6, 6, 2)), L.Conv2D(3, 3), L.MaxPooling2D(), L.Flatten(), L.Dense(2)],
    "embedding": lambda: [
        L.Input((5,), dtype="int32"),
        L.Embedding(10, 4),
        L.LayerNormalization(),
        L.Flatten(),
        L.Dense(1),
    ],
}


def _unnumbered(name):
    # Keras numbers layer names across a session (dense_14); each jstrategy model its own.
    return re.sub(r"_\d+/", "/", name)


@pytest.mark.parametrize("name", sorted(KERAS_MODELS))
def test_set_weights_takes_kerass_get_weights_list(name):
    case = REFERENCE["models"][name]
    model = jstrategy.Sequential(KERAS_MODELS[name]())
    assert [list(w.shape) for w in model.get_weights()] == case["shapes"]
    ours = [_unnumbered(n) for n in model.state.weight_names()]
    assert ours == [_unnumbered(n) for n in case["names"]]
    model.set_weights([np.asarray(w, np.float32) for w in case["values"]])
    x = np.asarray(case["x"], np.int32 if name == "embedding" else np.float32)
    np.testing.assert_allclose(model.predict(x, verbose=0), case["predict"], rtol=1e-5, atol=1e-6)
    for got, want in zip(model.get_weights(), case["values"], strict=True):
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def test_twelve_layers_are_in_layer_order_not_string_order():
    model = jstrategy.Sequential(KERAS_MODELS["twelve_dense"]())
    names = model.state.weight_names()
    assert names[18:22] == ["dense_9/kernel", "dense_9/bias", "dense_10/kernel", "dense_10/bias"]


def test_a_flax_modules_weights_are_in_call_order_parameters_first():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Dense(4, name="z_first")(x)
            x = nn.BatchNorm(use_running_average=not train, name="norm")(x)
            return nn.Dense(2, name="a_last")(x)

    model = jstrategy.Model(Block(), input_shape=(3,))
    assert model.state.weight_names() == [
        "z_first/kernel",
        "z_first/bias",
        "norm/scale",
        "norm/bias",
        "norm/mean",
        "norm/var",
        "a_last/kernel",
        "a_last/bias",
    ]


def test_an_nnx_modules_weights_are_in_definition_order():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.z_first = nnx.Linear(3, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)
            self.a_last = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.a_last(self.norm(self.z_first(x)))

    model = jstrategy.Model(Net(nnx.Rngs(0)))
    names = model.state.weight_names()
    assert names[:2] == ["z_first/kernel", "z_first/bias"]
    assert names[2:4] == ["norm/scale", "norm/bias"] and names[-2:] == [
        "a_last/kernel",
        "a_last/bias",
    ]
    weights = model.get_weights()
    model.set_weights([w + 1 for w in weights])
    np.testing.assert_array_equal(model.get_weights()[0], weights[0] + 1)


def test_a_misplaced_weight_is_an_error_naming_the_index_and_the_weight():
    case = REFERENCE["models"]["dense_bn_dense"]
    model = jstrategy.Sequential(KERAS_MODELS["dense_bn_dense"]())
    sorted_by_name = [case["values"][i] for i in (1, 0, 2, 3, 4, 5, 6, 7)]  # bias first
    with pytest.raises(
        ValueError,
        match=r"`weights\[0\]` is dense/kernel, of shape \(3, 4\); got an array of "
        r"shape \(4,\)\. Pass the arrays in get_weights\(\)'s order",
    ):
        model.set_weights(sorted_by_name)
    with pytest.raises(ValueError, match=r"must hold 8 arrays.*dense/kernel \(3, 4\), dense/bias"):
        model.set_weights(case["values"][:3])


# validation_split, from Keras's numbers --------------------------------------------------
def test_validation_split_losses_are_kerass():
    case = REFERENCE["validation_split"]
    model = jstrategy.Sequential([L.Input((3,)), L.Dense(2)])
    model.set_weights([np.asarray(w, np.float32) for w in case["initial"]])
    model.compile(jstrategy.optimizers.SGD(0.1), "mse")
    history = model.fit(
        np.asarray(case["x"], np.float32),
        np.asarray(case["y"], np.float32),
        batch_size=4,
        epochs=2,
        validation_split=0.25,
        shuffle=False,
        verbose=0,
    ).history
    np.testing.assert_allclose(history["loss"], case["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["val_loss"], case["val_loss"], rtol=1e-5)


# trainable=False and constraints, from Keras's numbers ----------------------------------
def _trained_from(case, layers):
    model = jstrategy.Sequential(layers)
    model.set_weights([np.asarray(w, np.float32) for w in case["initial"]])
    model.compile(jstrategy.optimizers.SGD(0.1), "mse")
    x, y = np.asarray(case["x"], np.float32), np.asarray(case["y"], np.float32)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model


def _assert_weights(model, expected):
    for got, want in zip(model.get_weights(), expected, strict=True):
        np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("when", ["made", "set"])
def test_frozen_layers_train_as_kerass(when):
    case = REFERENCE["frozen"]
    frozen = {"trainable": False} if when == "made" else {}
    layers = [L.Input((3,)), L.Dense(4, **frozen), L.BatchNormalization(**frozen), L.Dense(2)]
    if when == "set":  # Keras's transfer-learning freeze, then compile
        model = jstrategy.Sequential(layers)
        model.layers[0].trainable = False
        model.layers[1].trainable = False
        layers = [L.Input((3,)), *model.layers]
    model = _trained_from(case, layers)
    _assert_weights(model, case["final"])
    initial = case["initial"]
    for i in range(6):  # the frozen Dense and BatchNormalization (inference mode): as they were
        np.testing.assert_array_equal(model.get_weights()[i], np.asarray(initial[i], np.float32))
    assert not np.allclose(model.get_weights()[6], initial[6])


def test_constraints_train_as_kerass():
    case = REFERENCE["constrained"]
    C = jstrategy.constraints
    model = _trained_from(
        case,
        [
            L.Input((3,)),
            L.Dense(4, kernel_constraint=C.MaxNorm(0.5), bias_constraint="non_neg"),
            L.Dense(3, kernel_constraint=C.UnitNorm(axis=0)),
            L.Dense(2, kernel_constraint=C.MinMaxNorm(0.2, 0.6, rate=0.5)),
        ],
    )
    _assert_weights(model, case["final"])


def test_freezing_after_training_needs_compile_again_as_in_keras():
    x, y = _data(8)
    model = _regression()
    model.fit(x, y, verbose=0)
    model.layers[0].trainable = False
    with pytest.raises(
        ValueError,
        match=r"changed after the model was compiled and trained.*"
        r"model.compile\(\.\.\.\)",
    ):
        model.fit(x, y, verbose=0)
    model.compile("sgd", "mse")
    before = model.get_weights()
    model.fit(x, y, verbose=0)
    after = model.get_weights()
    np.testing.assert_array_equal(after[0], before[0])  # the frozen kernel
    assert not np.array_equal(after[2], before[2])
    # Set after compile but before any training: the optimizer state is fresh, so it holds.
    fresh = _regression()
    fresh.layers[1].trainable = False
    kernel = fresh.get_weights()[2]
    fresh.fit(x, y, verbose=0)
    np.testing.assert_array_equal(fresh.get_weights()[2], kernel)


def test_model_trainable_false_freezes_everything_and_counts_in_the_summary():
    x, y = _data(8)
    model = jstrategy.Sequential(
        [L.Input((3,)), L.Dense(4), L.BatchNormalization(), L.Dense(2)], trainable=False
    )
    assert all(layer.trainable is False for layer in model.layers)
    model.compile("adam", "mse")
    before = model.get_weights()
    model.fit(x, y, epochs=2, verbose=0)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    lines = []
    model.summary(print_fn=lines.append)
    assert "Trainable params: 0 (0.00 B)" in lines[0]
    assert "Non-trainable params: 42 (168.00 B)" in lines[0]
    model.trainable = True
    assert all(layer.trainable for layer in model.layers)
    model.compile("adam", "mse")
    model.fit(x, y, verbose=0)
    assert not np.array_equal(model.get_weights()[0], before[0])


def test_a_frozen_layer_in_a_flax_module_is_frozen_and_saved(tmp_path):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, training: bool = False):
            x = L.Dense(4, trainable=False, kernel_constraint="non_neg")(x)
            return L.Dense(2)(x)

    x, y = _data(8)
    model = jstrategy.Model(Net(), input_shape=(3,))
    model.compile("sgd", "mse")
    before = model.get_weights()
    model.fit(x, y, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], before[0])
    model.save(tmp_path / "m")
    loaded = jstrategy.models.load_model(tmp_path / "m", Net())
    loaded.fit(x, y, verbose=0)
    np.testing.assert_array_equal(loaded.get_weights()[0], before[0])


def test_layer_arguments_round_trip_through_save(tmp_path):
    model = jstrategy.Sequential(
        [
            L.Dense(4, input_dim=3, trainable=False, kernel_constraint="max_norm"),
            L.Activation("softmax", dtype="float32"),
        ]
    )
    model.compile("sgd", "mse")
    model.save(tmp_path / "m")
    loaded = jstrategy.models.load_model(tmp_path / "m")
    first, second = loaded.layers
    assert first.trainable is False and first.kernel_constraint == jstrategy.constraints.MaxNorm()
    assert second.dtype == "float32" and loaded.get_config()["input_shape"] == [3]


# Layer arguments Keras takes -------------------------------------------------------------
def test_dtype_float32_on_the_last_activation_computes_in_float32_as_kerass_guide():
    case = REFERENCE["mixed_softmax"]
    model = jstrategy.Sequential(
        [L.Input((3,)), L.Dense(4), L.Activation("softmax", dtype="float32")],
        dtype_policy="mixed_bfloat16",
    )
    model.set_weights([np.asarray(w, np.float32) for w in case["initial"]])
    out = model.predict(np.asarray(case["x"], np.float32), verbose=0)
    assert str(out.dtype) == case["dtype"]
    np.testing.assert_allclose(out, case["predict"], rtol=1e-5, atol=1e-6)
    # Without it the softmax computes in bfloat16: Keras's guide's reason for the argument.
    plain = jstrategy.Sequential(
        [L.Input((3,)), L.Dense(4), L.Activation("softmax")], dtype_policy="mixed_bfloat16"
    )
    plain.set_weights([np.asarray(w, np.float32) for w in case["initial"]])
    rounded = plain.predict(np.asarray(case["x"], np.float32), verbose=0)
    assert np.abs(rounded - np.asarray(case["predict"])).max() > 1e-4


def test_a_layer_dtype_casts_inputs_and_weights():
    x = np.ones((2, 3), np.float32)
    layer = L.Dense(2, dtype="mixed_bfloat16")
    variables = layer.init(jax.random.key(0), x)
    assert layer.apply(variables, x).dtype == jnp.bfloat16
    assert variables["params"]["kernel"].dtype == jnp.float32
    assert (
        L.Activation("relu", dtype="float32").apply({}, x.astype(jnp.bfloat16)).dtype == jnp.float32
    )
    with pytest.raises(
        ValueError,
        match=r"`dtype`='bfloat16' would keep this layer's weights in "
        r"bfloat16.*dtype='mixed_bfloat16'",
    ):
        L.Dense(2, dtype="bfloat16")
    assert L.Activation("relu", dtype="bfloat16").dtype == "bfloat16"  # no weights to keep
    with pytest.raises(ValueError, match=r"`dtype` must be a jstrategy.mixed_precision.Policy or"):
        L.Dense(2, dtype="float99")


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: L.Dense(2, input_dim=5), (5,)),
        (lambda: L.Dense(2, batch_input_shape=(None, 4)), (4,)),
        (lambda: L.Embedding(10, 3, input_length=7), (7,)),
        (lambda: L.Conv2D(2, 3, batch_shape=(None, 8, 8, 1)), (8, 8, 1)),
    ],
)
def test_kerass_row_shape_arguments_give_input_shape(make, shape):
    layer = make()
    assert layer.input_shape == shape
    assert jstrategy.Sequential([layer]).built


ALL_LAYERS = [
    lambda **kw: L.Dense(2, **kw),
    lambda **kw: L.Embedding(10, 2, **kw),
    lambda **kw: L.Activation("relu", **kw),
    lambda **kw: L.Dropout(0.5, **kw),
    lambda **kw: L.Conv1D(2, 3, **kw),
    lambda **kw: L.Conv2D(2, 3, **kw),
    lambda **kw: L.MaxPooling1D(**kw),
    lambda **kw: L.AveragePooling1D(2, **kw),
    lambda **kw: L.MaxPooling2D(**kw),
    lambda **kw: L.AveragePooling2D(2, **kw),
    lambda **kw: L.GlobalAveragePooling1D(**kw),
    lambda **kw: L.GlobalMaxPooling1D(**kw),
    lambda **kw: L.GlobalAveragePooling2D(**kw),
    lambda **kw: L.GlobalMaxPooling2D(**kw),
    lambda **kw: L.ReLU(**kw),
    lambda **kw: L.Add(**kw),
    lambda **kw: L.Concatenate(**kw),
    lambda **kw: L.BatchNormalization(**kw),
    lambda **kw: L.LayerNormalization(**kw),
    lambda **kw: L.Flatten(**kw),
    lambda **kw: L.Reshape((4,), **kw),
    lambda **kw: L.InputLayer(shape=(4,), **kw),
]


@pytest.mark.parametrize("make", ALL_LAYERS)
def test_every_layer_refuses_an_unknown_argument_naming_layer_argument_and_fix(make):
    name = type(make()).__name__
    with pytest.raises(
        TypeError,
        match=rf"^{name} got an unexpected keyword argument `nope`\. "
        r"Its arguments are .*name",
    ):
        make(nope=1)
    with pytest.raises(
        ValueError,
        match=rf"^{name} does not take `activity_regularizer`.*"
        r"kernel_regularizer",
    ):
        make(activity_regularizer="l2")
    with pytest.raises(ValueError, match=rf"^{name} does not take `lora_rank`"):
        make(lora_rank=4)
    made = make(trainable=False, autocast=True, name="x")
    assert made.trainable is False and made.name == "x"


def test_a_misspelled_argument_gets_the_close_name():
    with pytest.raises(
        TypeError,
        match=r"unexpected keyword argument `activaton`\. Did you mean "
        r"`activation`\?",
    ):
        L.Dense(2, activaton="relu")
    with pytest.raises(ValueError, match=r"`input_dim`=4 and `input_shape`=\(5,\) disagree"):
        L.Dense(2, input_dim=4, input_shape=(5,))
    with pytest.raises(ValueError, match=r"`trainable` must be a bool; got 'no'"):
        L.Dense(2, trainable="no")
    with pytest.raises(ValueError, match=r"Dense does not take `weights`.*initializers.constant"):
        L.Dense(2, weights=[np.ones((3, 2))])
    with pytest.raises(ValueError, match=r"Dense does not take `autocast` \(autocast=False\)"):
        L.Dense(2, autocast=False)
    with pytest.raises(ValueError, match=r"`kernel_constraint` must be a constraint name"):
        L.Dense(2, kernel_constraint="nope")


def test_to_categorical_numbers_are_kerass():
    for case in REFERENCE["to_categorical"]:
        out = jstrategy.utils.to_categorical(case["x"], case["num_classes"])
        np.testing.assert_array_equal(out, case["out"])


# NNX: the Flax tutorial's call-time rngs -------------------------------------------------
def test_an_nnx_model_taking_rngs_at_call_time_is_refused_with_the_fix():
    from flax import nnx

    class Tutorial(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 2, rngs=rngs)
            self.dropout = nnx.Dropout(0.5)

        def __call__(self, x, rngs):
            return self.dropout(self.linear(x), rngs=rngs)

    with pytest.raises(
        ValueError, match=r"Tutorial.__call__ requires `rngs`.*nnx.Dropout\(rate, rngs=rngs\)"
    ):
        jstrategy.Model(Tutorial(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"Tutorial.__call__ requires `rngs`"):
        jstrategy.training.create_nnx_train_state(lambda: Tutorial(nnx.Rngs(0)), optax.sgd(0.1))


def test_an_nnx_dropout_without_streams_is_refused_before_training():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs, dropout_rngs=None):
            self.linear = nnx.Linear(3, 2, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=dropout_rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    x, y = _data(8)
    model = jstrategy.Model(Net(nnx.Rngs(0)))
    model.compile(optax.sgd(0.1), "mse")
    assert model.predict(x, verbose=0).shape == (8, 2)  # inference needs no stream
    with pytest.raises(ValueError, match=r"nnx.Dropout at 'dropout' was made without `rngs`"):
        model.fit(x, y, verbose=0)
    fixed = jstrategy.Model(Net(nnx.Rngs(0), dropout_rngs=nnx.Rngs(1)))
    fixed.compile(optax.sgd(0.1), "mse")
    assert np.isfinite(fixed.fit(x, y, verbose=0).history["loss"][0])


def test_a_module_given_for_a_saved_sequential_is_sent_to_the_layer_list(tmp_path):
    model = _regression()
    model.save(tmp_path / "m")
    with pytest.raises(
        ValueError,
        match=r"says the model is a jstrategy.Sequential, but load_model "
        r"got a Dense\. Pass its layers: load_model\(path, \[layer, \.\.\.\]\)",
    ):
        jstrategy.models.load_model(tmp_path / "m", nn.Dense(2))
    loaded = jstrategy.models.load_model(tmp_path / "m", [L.Dense(4), L.Dense(2)])
    np.testing.assert_array_equal(loaded.get_weights()[0], model.get_weights()[0])


def test_model_trainable_false_freezes_a_flax_module():
    x, y = _data(8)
    model = jstrategy.Model(nn.Sequential([nn.Dense(4), nn.Dense(2)]), input_shape=(3,))
    model.trainable = False
    model.compile("adam", "mse")
    before = model.get_weights()
    model.fit(x, y, verbose=0)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"`trainable` must be a bool"):
        model.trainable = 0


def test_the_summary_counts_a_layer_frozen_since_compile_as_keras():
    model = _regression()
    model.layers[0].trainable = False
    lines = []
    model.summary(print_fn=lines.append)
    assert "Trainable params: 10 (40.00 B)" in lines[0]
    assert "Non-trainable params: 16 (64.00 B)" in lines[0]


def test_freezing_model_layers_works_for_flax_modules_too():
    x, y = _data(8)

    class Net(nn.Module):
        def setup(self):
            self.first = L.Dense(4)
            self.second = nn.Dense(2)

        def __call__(self, x, training: bool = False):
            return self.second(self.first(x))

    for model in (
        jstrategy.Sequential([L.Input((3,)), nn.Dense(4), L.Dense(2)]),
        jstrategy.Model(Net(), input_shape=(3,)),
    ):
        model.layers[0].trainable = False  # a Flax nn.Dense, or a layer inside a module
        assert model.layers[0].trainable is False
        model.compile("sgd", "mse")
        before = model.get_weights()
        model.fit(x, y, verbose=0)
        after = model.get_weights()
        np.testing.assert_array_equal(after[0], before[0])
        np.testing.assert_array_equal(after[1], before[1])
        assert not np.array_equal(after[2], before[2])


def test_an_nnx_submodule_flag_is_refused_with_the_wrt_fix():
    from flax import nnx

    model = jstrategy.Model(nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0))))
    model.layers[0].trainable = False
    with pytest.raises(
        ValueError,
        match=r"trainable = False: an NNX model trains what its "
        r"optimizer's `wrt` filter selects.*create_nnx_train_state",
    ):
        model.compile(optax.sgd(0.1), "mse")


def test_a_layer_the_user_holds_is_the_models_as_in_keras():
    x, y = _data(8)
    base = L.Dense(4)
    flax_head = nn.Dense(2)
    model = jstrategy.Sequential([L.Input((3,)), base, flax_head])
    assert model.layers[0] is base and model.layers[1] is flax_head
    assert base.name == "dense"
    base.trainable = False  # Keras's freeze through the user's own reference
    model.compile("sgd", "mse")
    kernel = model.get_weights()[0]
    model.fit(x, y, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], kernel)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]),
        lambda: jstrategy.CentralStorageStrategy(),
        lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=0),
    ],
    ids=["mirrored_2", "central_storage_8", "fsdp_8"],
)
def test_frozen_layers_and_constraints_follow_one_device(make):
    x, y = _data(16)

    def train(strategy, ema=False, **compile_kwargs):
        with strategy.scope():
            model = jstrategy.Sequential(
                [
                    L.Input((3,)),
                    L.Dense(8, trainable=False),
                    L.BatchNormalization(synchronized=True),  # one device's statistics
                    L.Dense(2, kernel_constraint=jstrategy.constraints.MaxNorm(0.3)),
                ],
                seed=3,
            )
            optimizer = jstrategy.optimizers.Adam(0.01, use_ema=ema)
            model.compile(optimizer, "mse", **compile_kwargs)
        before = model.get_weights()
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_array_equal(model.get_weights()[0], before[0])  # frozen
        if not ema:  # (an average starts from the unconstrained initial kernel, in Keras too)
            assert np.linalg.norm(model.get_weights()[6], axis=0).max() <= 0.3 + 1e-6
        return model.get_weights()

    oracle = train(jstrategy.OneDeviceStrategy("cpu:0"))
    for got, want in zip(train(make()), oracle, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    accumulated = train(jstrategy.OneDeviceStrategy("cpu:0"), gradient_accumulation_steps=2)
    assert not np.allclose(accumulated[6], oracle[6])  # one update per 2 batches
    averaged = train(make(), ema=True)  # the average covers the trained parameters only
    assert not np.allclose(averaged[6], oracle[6])


def test_a_frozen_layer_under_parameter_servers_is_refused_before_any_work(shut_down_coordinators):
    from jstrategy.coordinator import local_cluster_resolver

    strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1, num_ps=1))
    shut_down_coordinators(strategy)
    with strategy.scope():
        model = jstrategy.Sequential([L.Input((3,)), L.Dense(4, trainable=False), L.Dense(2)])
        model.compile("sgd", "mse")
    with pytest.raises(
        ValueError,
        match=r"ParameterServerStrategy's fit applies each "
        r"variable's gradients on the parameter servers, so frozen layers",
    ):
        model.fit(*_data(8), verbose=0)
