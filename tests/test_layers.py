"""`jstrategy.layers` and `jstrategy.Sequential`: Keras's defaults, names, losses, errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

import jstrategy
from jstrategy import layers

L = layers


def _data(rows=64, features=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = (x[:, :1] > 0).astype(np.float32)
    return x, y


def _mlp(**dense_kwargs):
    return jstrategy.Sequential(
        [L.Dense(8, activation="relu", input_shape=(10,), **dense_kwargs), L.Dense(1)]
    )


# Keras's defaults ------------------------------------------------------------------------
def test_dense_defaults_are_keras_glorot_uniform_and_zeros():
    model = jstrategy.Sequential([L.Dense(300, input_shape=(200,))])
    kernel = np.asarray(model.variables["params"]["dense"]["kernel"])
    limit = np.sqrt(6.0 / (200 + 300))  # Keras's glorot_uniform bound
    assert kernel.min() >= -limit and kernel.max() <= limit
    assert kernel.max() > 0.95 * limit and np.std(kernel) == pytest.approx(
        limit / np.sqrt(3), rel=0.02
    )
    assert not np.asarray(model.variables["params"]["dense"]["bias"]).any()


@pytest.mark.slow
def test_conv_and_embedding_defaults():
    conv = jstrategy.Sequential([L.Conv2D(64, 3, input_shape=(8, 8, 32))])
    kernel = np.asarray(conv.variables["params"]["conv2d"]["kernel"])
    limit = np.sqrt(6.0 / (9 * 32 + 9 * 64))  # fans include the receptive field
    assert kernel.shape == (3, 3, 32, 64) and np.abs(kernel).max() <= limit
    assert np.abs(kernel).max() > 0.95 * limit
    emb = jstrategy.Sequential([L.Embedding(1000, 16, input_shape=(5,))])
    emb.compile("sgd", loss="mse")
    table = np.asarray(emb.variables["params"]["embedding"]["embeddings"])
    assert table.min() >= -0.05 and table.max() < 0.05 and table.max() > 0.049
    assert emb.predict(np.array([[1, 2, 3, 4, 5]]), verbose=0).shape == (1, 5, 16)


def test_normalization_defaults_and_keras_weight_names():
    bn, ln = L.BatchNormalization(), L.LayerNormalization()
    assert (bn.momentum, bn.epsilon, bn.synchronized) == (0.99, 1e-3, False)
    assert ln.epsilon == 1e-3
    model = jstrategy.Sequential([L.Input((4,)), bn, L.Dense(2)])
    assert sorted(model.variables["params"]["batch_normalization"]) == ["beta", "gamma"]
    assert sorted(model.variables["batch_stats"]["batch_normalization"]) == [
        "moving_mean",
        "moving_variance",
    ]
    lines = []
    model.summary(print_fn=lines.append)
    # Keras's totals for this model: 16 BatchNorm weights (8 trainable) + 10.
    assert "Total params: 26" in lines[0] and "Trainable params: 18" in lines[0]
    assert "Non-trainable params: 8" in lines[0]


def test_batchnorm_sees_the_train_flag():
    x, y = _data()
    model = jstrategy.Sequential([L.BatchNormalization(input_shape=(10,)), L.Dense(1)])
    model.compile(jstrategy.optimizers.SGD(0.0), loss="mse")
    before = model.predict(x, verbose=0)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    stats = model.variables["batch_stats"]["batch_normalization"]
    np.testing.assert_allclose(stats["moving_mean"], 0.01 * x.mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["moving_variance"], 0.99 + 0.01 * x.var(0), rtol=1e-5)
    # Inference uses the moving statistics (changed by fit), not the batch's.
    assert not np.allclose(model.predict(x, verbose=0), before)


@pytest.mark.slow
def test_dropout_sees_the_train_flag():
    x, y = _data()
    with_dropout = jstrategy.Sequential(
        [L.Dense(8, input_shape=(10,)), L.Dropout(0.5), L.Dense(1)], seed=3
    )
    plain = jstrategy.Sequential([L.Dense(8, input_shape=(10,)), L.Dense(1)], seed=3)
    for model in (with_dropout, plain):
        model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
    np.testing.assert_allclose(  # inference: the identity
        with_dropout.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=1e-6
    )
    a = with_dropout.fit(x, y, batch_size=64, verbose=0).history["loss"][0]
    b = plain.fit(x, y, batch_size=64, verbose=0).history["loss"][0]
    assert a != pytest.approx(b, rel=1e-3)  # training: units dropped


def test_layers_shapes():
    x = np.ones((2, 8, 8, 3), np.float32)
    model = jstrategy.Sequential(
        [
            L.Conv2D(4, 3, padding="same", input_shape=(8, 8, 3)),
            L.AveragePooling2D(2),
            L.Activation("relu"),
            L.GlobalAveragePooling2D(),
            L.Reshape((2, 2)),
            L.LayerNormalization(),
            L.Flatten(),
        ]
    )
    model.compile("sgd", loss="mse")
    assert model.predict(x, verbose=0).shape == (2, 4)
    assert [layer.name for layer in model.layers][:3] == [
        "conv2d",
        "average_pooling2d",
        "activation",
    ]


# Names and paths ------------------------------------------------------------------------
def test_variable_paths_are_keras_names_and_layout_maps_match():
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense_1/kernel"] = ("model", None)
    with jstrategy.experimental.ModelParallelStrategy(layout_map).scope():
        model = jstrategy.Sequential([L.Dense(16, input_shape=(10,)), L.Dense(8)])
    params = model.variables["params"]
    assert params["dense"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert params["dense_1"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("model", None)


def test_names_get_layer_and_flax_modules_mix():
    model = jstrategy.Sequential()
    model.add(L.Dense(4, input_shape=(3,), name="first"))
    model.add(nn.Dense(4))  # a Flax layer, named as Keras would
    model.add(L.Dense(2))
    assert [layer.name for layer in model.layers] == ["first", "dense", "dense_1"]
    assert model.get_layer("dense_1").units == 2 and model.get_layer(index=0).name == "first"
    with pytest.raises(ValueError, match="unique names"):
        model.add(L.Dense(2, name="first"))
    assert model.count_params() == 16 + 20 + 10
    with pytest.raises(ValueError, match="No such layer: 'nope'"):
        model.get_layer("nope")


def test_model_layers_and_count_params_for_a_flax_module():
    model = jstrategy.Model(nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)]), input_shape=(3,))
    assert [type(layer).__name__ for layer in model.layers] == ["Dense", "Dense"]
    assert model.count_params() == 16 + 5


# Regularization ---------------------------------------------------------------------------
def test_kernel_regularizer_adds_to_loss_as_keras():
    x, y = _data()
    lr = 0.1
    reg = jstrategy.Sequential(
        [L.Dense(1, input_shape=(10,), kernel_regularizer=jstrategy.regularizers.L2(0.01))]
    )
    plain = jstrategy.Sequential([L.Dense(1, input_shape=(10,))])
    for model in (reg, plain):
        model.compile(jstrategy.optimizers.SGD(lr), loss="mse")
    k0 = np.asarray(reg.variables["params"]["dense"]["kernel"])
    data_loss = plain.evaluate(x, y, verbose=0)
    # Keras: the reported loss is the data loss plus the penalty of the current weights.
    assert reg.evaluate(x, y, verbose=0) == pytest.approx(
        data_loss + 0.01 * np.sum(k0**2), rel=1e-5
    )
    reg.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    # One SGD step: the penalty's gradient 2 * 0.01 * k0 joins the data gradient once.
    np.testing.assert_allclose(
        reg.variables["params"]["dense"]["kernel"],
        np.asarray(plain.variables["params"]["dense"]["kernel"]) - lr * 2 * 0.01 * k0,
        rtol=1e-5,
        atol=1e-7,
    )


def test_regularized_trajectory_is_the_same_under_mirrored():
    x, y = _data(rows=60)

    def run(strategy):
        with strategy.scope():
            model = _mlp(kernel_regularizer="l2")
            model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]

    np.testing.assert_allclose(
        run(jstrategy.MirroredStrategy()), run(jstrategy.OneDeviceStrategy("cpu:0")), rtol=1e-5
    )


# fit's Keras arguments ----------------------------------------------------------------------
def test_class_weight_is_keras_sample_weight():
    x, y = _data()
    weighted, reference = _mlp(), _mlp()
    for model in (weighted, reference):
        model.compile(
            jstrategy.optimizers.SGD(0.1),
            loss=jstrategy.losses.BinaryCrossentropy(from_logits=True),  # _mlp gives logits
        )
    a = weighted.fit(x, y, batch_size=16, epochs=2, class_weight={1: 3.0}, verbose=0)
    w = np.where(y[:, 0] == 1, 3.0, 1.0).astype(np.float32)
    b = reference.fit(x, y, batch_size=16, epochs=2, sample_weight=w, verbose=0)
    np.testing.assert_allclose(a.history["loss"], b.history["loss"], rtol=1e-6)
    with pytest.raises(ValueError, match="`class_weight` and `sample_weight`"):
        weighted.fit(x, y, class_weight={1: 3.0}, sample_weight=w, verbose=0)
    with pytest.raises(ValueError, match="`class_weight` must be a dict from class index"):
        weighted.fit(x, y, class_weight={"a": 3.0}, verbose=0)


def test_validation_steps_limits_validation_batches():
    x, y = _data(rows=64)
    vx, vy = _data(rows=48, seed=1)
    model = _mlp()
    model.compile(jstrategy.optimizers.SGD(0.0), loss="mse")
    history = model.fit(
        x, y, batch_size=16, validation_data=(vx, vy), validation_steps=1, verbose=0
    )
    assert history.history["val_loss"][0] == pytest.approx(
        model.evaluate(vx[:16], vy[:16], verbose=0), rel=1e-6
    )
    assert history.history["val_loss"][0] != pytest.approx(model.evaluate(vx, vy, verbose=0))


# Errors before any work ---------------------------------------------------------------------
def test_input_shape_with_batch_dimension_is_refused():
    with pytest.raises(ValueError, match=r"Drop the batch dimension: input_shape=\(10,\)"):
        L.Dense(16, input_shape=(None, 10))
    with pytest.raises(ValueError, match=r"`input_shape` must be the shape of one row"):
        jstrategy.Model(nn.Dense(1), input_shape=(None, 10))


def test_wrong_feature_count_is_refused_before_any_work():
    model = _mlp()
    model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match=r"`x` must have rows of shape \(10,\).*\(12,\)"):
        model.fit(np.ones((8, 12), np.float32), np.ones((8, 1), np.float32), verbose=0)
    with pytest.raises(ValueError, match=r"`validation_data\[0\]` must have rows of shape"):
        model.fit(*_data(), validation_data=(np.ones((8, 3)), np.ones((8, 1))), verbose=0)
    assert int(model.state.step) == 0  # nothing ran
    with pytest.raises(ValueError, match=r"`x` must have rows of shape"):
        model.predict(np.ones((8, 12), np.float32), verbose=0)


def test_bad_layer_arguments_name_the_argument():
    with pytest.raises(ValueError, match="`units` must be a positive int"):
        L.Dense(0)
    with pytest.raises(ValueError, match="`activation` must be a Keras activation name"):
        L.Dense(3, activation="relu7")
    with pytest.raises(ValueError, match="`rate` must be in"):
        L.Dropout(1.5)
    with pytest.raises(ValueError, match="`padding` must be 'valid' or 'same'"):
        L.Conv2D(3, 3, padding="full")
    with pytest.raises(ValueError, match="`kernel_regularizer` must be a regularizer name"):
        L.Dense(3, kernel_regularizer="l3")
    with pytest.raises(ValueError, match="Layers cannot be added once the model has variables"):
        model = _mlp()
        model.summary(print_fn=lambda _: None)
        model.add(L.Dense(1))


# Saving ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sequential_save_and_load_model_without_code(tmp_path):
    x, y = _data()
    model = jstrategy.Sequential(
        [
            L.Dense(8, activation="relu", input_shape=(10,), kernel_regularizer="l2"),
            L.Dropout(0.25),
            L.Dense(1),
        ],
        seed=4,
    )
    model.compile(jstrategy.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "model"
    model.save(path)
    loaded = jstrategy.models.load_model(path)
    assert isinstance(loaded, jstrategy.Sequential)
    assert [layer.name for layer in loaded.layers] == ["dense", "dropout", "dense_1"]
    assert loaded.get_layer("dense").kernel_regularizer == jstrategy.regularizers.L2(0.01)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert int(loaded.state.step) == int(model.state.step)
    np.testing.assert_allclose(
        # (shuffle=False: the shuffling order counts epochs run, which save does not keep)
        loaded.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"],
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"],
        rtol=1e-6,
    )


def test_two_models_of_the_same_layers_share_weights_by_path(tmp_path):
    first, second = (
        _mlp(),
        jstrategy.Sequential(
            [L.Dense(8, activation="relu", input_shape=(10,)), L.Dense(1)], seed=9
        ),
    )
    first.save_weights(tmp_path / "w")
    second.load_weights(tmp_path / "w")  # same paths: dense/..., dense_1/...
    for a, b in zip(first.get_weights(), second.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sequential_under_a_precision_policy():
    x, y = _data()
    model = jstrategy.Sequential(
        [L.Dense(8, activation="relu", input_shape=(10,)), L.BatchNormalization(), L.Dense(1)],
        dtype_policy="mixed_bfloat16",
    )
    model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
    losses = model.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert losses[-1] < losses[0]
    assert model.variables["params"]["dense"]["kernel"].dtype == np.float32
    assert model.predict(x, verbose=0).dtype == np.float32


# First use inside strategy.run ------------------------------------------------------------
@pytest.mark.slow
def test_sequential_first_used_inside_run_is_built_from_concrete_values():
    """TF's custom loop reads `model.trainable_variables` first inside `strategy.run`; the
    Sequential is built there, with concrete variables the optimizer can build slots for,
    and trains as one built before the loop does."""
    strategy = jstrategy.MirroredStrategy()
    x, y = _data(rows=32)
    models = []
    for build_first in (False, True):
        with strategy.scope():
            model = _mlp()
            optimizer = jstrategy.optimizers.SGD(0.1)
        if build_first:
            assert model.built
        models.append(model)

        def train_step(inputs, model=model, optimizer=optimizer):
            features, labels = inputs

            def forward(variables):
                logits = model(features, training=True, trainable_variables=variables)
                return jstrategy.compute_average_loss(((logits - labels) ** 2)[:, 0])

            loss, grads = jax.value_and_grad(forward)(model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        for batch in strategy.experimental_distribute_dataset([(x, y), (x, y)]):
            strategy.run(train_step, args=(batch,))
    lazy, eager = (m.variables["params"] for m in models)
    assert isinstance(lazy["dense"]["kernel"], jax.Array)
    jax.tree.map(np.testing.assert_allclose, lazy, eager)
