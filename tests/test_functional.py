"""Keras's functional API: `jstrategy.Input`, layer calls, `jstrategy.Model(inputs, outputs)`.

A functional model is a `Model` of a linen module that replays the recorded layer calls,
so it trains, saves and follows one device under every strategy as any module does
(its cells of the parity matrix: `parity_zoo`'s ``functional``); here, what is Keras's:
the same numbers as the `Sequential` of the same layers, several inputs (a list or a dict
by name), several outputs with a loss each, shared layers, Keras's order of layers and
weights, summary's "Connected to", saving the graph, and the errors that name the fix.
"""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

import jstrategy
from jstrategy import layers as L
from jstrategy import losses

ROWS = 48


def _data(seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(ROWS, 6)).astype(np.float32)
    b = rng.normal(size=(ROWS, 3)).astype(np.float32)
    label = ((a[:, 0] + b[:, 1]) > 0).astype(np.int32)
    target = (a[:, :1] - 2 * b[:, 2:]).astype(np.float32)
    return a, b, label, target


def _scce():
    return losses.SparseCategoricalCrossentropy(from_logits=True)


def _two_in_two_out():
    """Two inputs merged by Concatenate and Add, a shared layer, two outputs."""
    a = jstrategy.Input((6,), name="a")
    b = jstrategy.Input((3,), name="b")
    shared = L.Dense(4, activation="tanh")
    h = L.Concatenate()([shared(L.Dense(4)(a)), shared(L.Dense(4)(b))])
    h = L.Add()([L.BatchNormalization()(h), L.Dense(8)(b)])
    h = L.Dropout(0.2)(h)
    return [a, b], [L.Dense(2, name="cls")(h), L.Dense(1, name="reg")(h)]


def _fit_two_outputs(strategy):
    a, b, label, target = _data()
    with strategy.scope():
        model = jstrategy.Model(*_two_in_two_out(), seed=3)
        model.compile(
            jstrategy.optimizers.SGD(0.05, momentum=0.9),
            loss={"cls": _scce(), "reg": "mse"},
            loss_weights={"cls": 1.0, "reg": 0.5},
            metrics={"cls": ["accuracy"]},
        )
    history = model.fit([a, b], [label, target], batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history


def test_single_input_and_output_trains_as_the_sequential_of_the_same_layers():
    a, _, label, _ = _data()

    def layers():
        return [L.Dense(8, activation="relu"), L.Dropout(0.25), L.Dense(2)]

    results = []
    for functional in (False, True):
        with jstrategy.OneDeviceStrategy("cpu:0").scope():
            if functional:
                x = y = jstrategy.Input((6,))
                for layer in layers():
                    y = layer(y)
                model = jstrategy.Model(inputs=x, outputs=y, seed=1)
            else:
                model = jstrategy.Sequential([jstrategy.Input((6,)), *layers()], seed=1)
            model.compile("adam", loss=_scce(), metrics=["accuracy"])
        history = model.fit(a, label, batch_size=16, epochs=2, verbose=0)
        results.append((history.history, model.get_weights(), model.predict(a, verbose=0)))
    (h1, w1, p1), (h2, w2, p2) = results
    assert type(model).__name__ == "Functional" and isinstance(model, jstrategy.Model)
    assert h1 == h2
    assert len(w1) == len(w2) == 4
    for u, v in zip([*w1, p1], [*w2, p2], strict=True):
        np.testing.assert_array_equal(u, v)


def test_several_inputs_as_a_list_or_a_dict_by_name():
    a, b, label, _ = _data()
    x = jstrategy.Input((6,), name="left")
    z = jstrategy.Input((3,), name="right")
    y = L.Dense(2)(L.Concatenate()([L.Dense(4)(x), z]))
    model = jstrategy.Model([x, z], y, name="merge")
    model.compile("sgd", loss=_scce())
    model.fit([a, b], label, batch_size=16, verbose=0)
    by_list = model.predict([a, b], verbose=0)
    np.testing.assert_array_equal(model.predict({"right": b, "left": a}, verbose=0), by_list)
    np.testing.assert_array_equal(model.predict((a, b), verbose=0), by_list)
    assert model.input_names == ["left", "right"]
    # Named as made (the outer Dense first), listed as Keras 3 lists them.
    names = ["left", "dense_1", "right", "concatenate", "dense"]
    assert [layer.name for layer in model.layers] == names
    lines = []
    model.summary(print_fn=lines.append)
    table = lines[0]
    assert "Connected to" in table
    assert "concatenate (Concatenate)" in table and "dense_1[0][0], right[0][0]" in table
    assert f"Total params: {model.count_params()}" in table
    # A dict input model takes the dict's keys.
    model = jstrategy.Model({"p": x, "q": z}, y)
    np.testing.assert_array_equal(model.predict({"p": a, "q": b}, verbose=0).shape, (ROWS, 2))


def test_several_outputs_have_a_loss_each_weighted_and_logged_by_output_name():
    model, history = _fit_two_outputs(jstrategy.OneDeviceStrategy("cpu:0"))
    assert model.output_names == ["cls", "reg"]
    assert model.metrics_names == ["loss", "cls_loss", "reg_loss", "cls_accuracy"]
    assert set(history.history) == set(model.metrics_names)
    a, b, label, target = _data()
    logs = model.evaluate([a, b], {"cls": label, "reg": target}, return_dict=True, verbose=0)
    logits, predicted = model.predict({"a": a, "b": b}, verbose=0)
    # The per-output losses, from the predictions (Keras's definitions).
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    cls_loss = -log_probs[np.arange(ROWS), label].mean()
    reg_loss = ((predicted - target) ** 2).mean()
    np.testing.assert_allclose(logs["cls_loss"], cls_loss, rtol=1e-5)
    np.testing.assert_allclose(logs["reg_loss"], reg_loss, rtol=1e-5)
    np.testing.assert_allclose(logs["loss"], cls_loss + 0.5 * reg_loss, rtol=1e-5)
    np.testing.assert_allclose(logs["cls_accuracy"], (logits.argmax(1) == label).mean())
    # One loss for every output, and a list of them, as Keras takes them.
    model.compile("sgd", loss="mse", metrics=[None, ["mae"]])
    assert model.metrics_names == ["loss", "cls_loss", "reg_loss", "reg_mae"]
    model.compile("sgd", loss=[None, "mse"])
    assert model.metrics_names == ["loss", "reg_loss"]
    logs = model.evaluate([a, b], [label, target], return_dict=True, verbose=0)
    np.testing.assert_allclose(logs["loss"], logs["reg_loss"], rtol=1e-6)


def test_a_layer_called_twice_shares_its_weights():
    x = jstrategy.Input((5,))
    shared = L.Dense(3, use_bias=False)
    twice = L.Concatenate()([shared(x), shared(x)])
    model = jstrategy.Model(x, L.Dense(1)(twice))
    assert model.count_params() == 5 * 3 + 6 + 1
    assert list(model.variables["params"]) == ["dense", "concatenate", "dense_1"][::2]
    model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(32, 5)), rng.normal(size=(32, 1)), batch_size=8, verbose=0)
    halves = jstrategy.Model(x, twice).predict(np.ones((2, 5)), verbose=0)
    np.testing.assert_array_equal(halves[:, :3], halves[:, 3:])
    # The layer object is the model's: freezing it freezes both calls at the next compile.
    shared.trainable = False
    model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
    before = model.get_weights()
    model.fit(rng.normal(size=(32, 5)), rng.normal(size=(32, 1)), batch_size=8, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], before[0])
    assert not np.array_equal(model.get_weights()[1], before[1])


def test_layers_and_weights_are_in_keras_order():
    """Keras 3 orders a functional model's layers (and weights) by depth from the inputs,
    ties by when the walk back from the outputs met them: these are the names and order
    Keras 3.x gives for this graph (its shared layer's first call is not its first
    appearance, and the inputs come in the walk's order)."""
    a = jstrategy.Input((6,), name="a")
    b = jstrategy.Input((3,), name="b")
    shared, first, second = L.Dense(4, activation="tanh"), L.Dense(4), L.Dense(4)
    x1 = shared(first(a))
    x2 = shared(second(L.Concatenate()([b, b])))
    h = L.LayerNormalization()(L.Concatenate()([x1, L.Dense(4)(x2)]))
    outputs = [L.Dense(2, name="cls")(h), L.Dense(1)(L.Add()([h, L.Dense(8)(b)]))]
    model = jstrategy.Model([a, b], outputs)
    assert [layer.name for layer in model.layers] == [
        *["b", "a", "concatenate", "dense_1", "dense_2", "dense", "dense_3"],
        *["concatenate_1", "layer_normalization", "dense_5", "add", "cls", "dense_4"],
    ]
    shapes = [w.shape for w in model.get_weights()]
    assert shapes == [
        *[(6, 4), (4,), (6, 4), (4,), (4, 4), (4,), (4, 4), (4,)],
        *[(8,), (8,), (3, 8), (8,), (8, 2), (2,), (8, 1), (1,)],
    ]
    assert model.output_names == ["cls", "dense_4"]
    assert model.get_layer("cls") is outputs[0].node.layer
    assert model.get_layer(index=0).name == "b"


def test_save_and_load_rebuild_the_graph(tmp_path):
    model, _ = _fit_two_outputs(jstrategy.OneDeviceStrategy("cpu:0"))
    a, b, _, _ = _data()
    model.save(tmp_path / "model")
    loaded = jstrategy.models.load_model(tmp_path / "model", compile=False)
    assert type(loaded).__name__ == "Functional"
    assert [layer.name for layer in loaded.layers] == [layer.name for layer in model.layers]
    got, want = loaded.predict([a, b], verbose=0), model.predict([a, b], verbose=0)
    for u, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(u, v)
    # Compiled: each output's loss, weight and metrics come back by output name.
    compiled = jstrategy.models.load_model(tmp_path / "model")
    assert compiled.metrics_names == model.metrics_names
    saved, again = model.output_compile, compiled.output_compile
    assert again.loss_weights == saved.loss_weights == {"cls": 1.0, "reg": 0.5}
    assert {k: repr(v) for k, v in again.losses.items()} == {
        k: repr(v) for k, v in saved.losses.items()
    }
    labels = list(_data()[2:])
    logs = model.evaluate([a, b], labels, return_dict=True, verbose=0)
    assert compiled.evaluate([a, b], labels, return_dict=True, verbose=0) == logs
    # A damaged file names the field.
    file = tmp_path / "model" / "jstrategy_model.json"
    config = json.loads(file.read_text())
    config["compile"]["outputs"]["loss_weights"] = {"cls": "heavy"}
    file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"`compile.outputs.loss_weights` must be an object"):
        jstrategy.models.load_model(tmp_path / "model")
    # A single-output model, compiled, comes back compiled.
    x = jstrategy.Input((6,))
    single = jstrategy.Model(x, L.Dense(2)(L.Dense(4, activation="relu")(x)))
    single.compile("adam", loss=_scce(), metrics=["accuracy"])
    single.save(tmp_path / "single")
    again = jstrategy.models.load_model(tmp_path / "single")
    assert again.metrics_names == ["loss", "accuracy"]
    np.testing.assert_array_equal(again.predict(a, verbose=0), single.predict(a, verbose=0))


def test_a_lambda_layer_applies_a_function_and_is_given_back_to_load_model(tmp_path):
    x = jstrategy.Input((4,))
    total = L.Lambda(lambda t: jax.numpy.sum(t, axis=-1, keepdims=True))
    model = jstrategy.Model(x, L.Dense(1)(L.Concatenate()([x, total(x)])))
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert jstrategy.Model(x, total(x)).predict(rows, verbose=0).tolist() == [[6.0], [22.0]]
    model.save(tmp_path / "m")
    with pytest.raises(ValueError, match=r"Pass them: load_model\(path, \[layer, \.\.\.\]\)"):
        jstrategy.models.load_model(tmp_path / "m")
    layers = [layer.clone() for layer in model.layers]
    loaded = jstrategy.models.load_model(tmp_path / "m", layers)
    np.testing.assert_array_equal(loaded.predict(rows, verbose=0), model.predict(rows, verbose=0))


def test_a_functional_model_follows_one_device_under_mirrored_8():
    one, h1 = _fit_two_outputs(jstrategy.OneDeviceStrategy("cpu:0"))
    eight, h8 = _fit_two_outputs(jstrategy.MirroredStrategy())
    for key in h1.history:
        np.testing.assert_allclose(h8.history[key], h1.history[key], rtol=1e-5, atol=1e-5)
    for got, want in zip(eight.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_what_cannot_be_called_on_symbolic_tensors_names_the_fix():
    x = jstrategy.Input((4,))
    with pytest.raises(TypeError, match=r"Flax module Dense, not a jstrategy layer.*Lambda"):
        nn.Dense(2)(x)
    with pytest.raises(TypeError, match=r"operator .* was applied .*jstrategy.layers.Lambda"):
        x * 2
    with pytest.raises(TypeError, match=r"NumPy function was called .*Lambda"):
        np.tanh(x)
    with pytest.raises(TypeError, match=r"records layer\(inputs\) or layer\(inputs, training="):
        L.Dense(2)(x, mask=None)
    with pytest.raises(TypeError, match=r"mixed with ndarray"):
        L.Add()([x, np.ones((1, 4))])
    with pytest.raises(ValueError, match=r"Add cannot be called on inputs of shape"):
        L.Add()([x, jstrategy.Input((3,))])
    with pytest.raises(TypeError, match=r"got a symbolic tensor, the output of Dense"):
        jstrategy.Sequential([jstrategy.Input((4,)), L.Dense(2)(x)])


def test_model_arguments_are_checked_with_the_fix():
    x, z = jstrategy.Input((4,)), jstrategy.Input((2,))
    y = L.Dense(1)(L.Concatenate()([x, z]))
    with pytest.raises(ValueError, match=r"depend on an Input of shape \(None, 2\).*not in"):
        jstrategy.Model(x, y)
    with pytest.raises(TypeError, match=r"`outputs` must be a symbolic tensor.*got ndarray"):
        jstrategy.Model(x, np.ones(3))
    with pytest.raises(TypeError, match=r"`inputs` must be tensors made by jstrategy.Input"):
        jstrategy.Model(L.Dense(2)(x), y)
    with pytest.raises(ValueError, match=r"unique names; 'same' names two"):
        jstrategy.Model(x, L.Dense(1, name="same")(L.Dense(2, name="same")(x)))
    model = jstrategy.Model([x, z], [y, L.Dense(3)(x)])
    with pytest.raises(ValueError, match=r"as a list must have one entry per output"):
        model.compile("sgd", loss=["mse"])
    with pytest.raises(ValueError, match=r"names outputs \['nope'\] the model does not have"):
        model.compile("sgd", loss={"nope": "mse"})
    with pytest.raises(ValueError, match=r"`metrics` must be a list of one entry per output"):
        model.compile("sgd", loss="mse", metrics="mae")
    model.compile("sgd", loss="mse")
    xs, ys = [np.ones((8, 4)), np.ones((8, 2))], [np.ones((8, 1)), np.ones((8, 3))]
    with pytest.raises(ValueError, match=r"The input 'input_layer' takes rows of shape \(4,\)"):
        model.predict([np.ones((8, 5)), np.ones((8, 2))], verbose=0)
    with pytest.raises(ValueError, match=r"has 2 input\(s\).*x is a tuple of 3 arrays"):
        model.predict([*xs, xs[0]], verbose=0)
    with pytest.raises(ValueError, match=r"has 2 outputs .*y is one array"):
        model.fit(xs, ys[0], verbose=0)


def test_a_model_is_not_called_as_a_layer_of_another():
    x = jstrategy.Input((4,))
    inner = jstrategy.Model(x, L.Dense(2)(x))
    with pytest.raises(TypeError, match=r"not called as a layer of a functional model"):
        inner(jstrategy.Input((4,)))
