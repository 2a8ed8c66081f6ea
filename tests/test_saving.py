"""Issue 21, finding 7: saved models that came back as something else.

`load_model` never compared the saved module's class with the one given; a lambda loss
and a lambda metric were saved under one name, so the loaded metric computed the loss; a
config's ``class_name`` reached any attribute of the losses and metrics modules; a
damaged ``jstrategy_model.json`` failed with errors that named neither the file nor the
field.


"""

import json
import re

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy._src import registry

CONFIG = "jstrategy_model.json"


class ReluNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))


class TanhNet(nn.Module):  # the same variables as ReluNet, another function
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))


def _xy(rows=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3)).astype(np.float32) * 3
    return x, x.sum(-1, keepdims=True)


def _model(module=None, loss="mse", metrics=("mae",)):
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        model = jstrategy.Model(module or ReluNet(), input_shape=(3,), seed=1)
        model.compile(jstrategy.optimizers.SGD(0.01), loss=loss, metrics=list(metrics))
    return model


def _load(path, module=None, **kwargs):
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        return jstrategy.models.load_model(path, module or ReluNet(), **kwargs)


def _saved(tmp_path, **kwargs):
    path = tmp_path / "model"
    _model(**kwargs).save(path)
    return path


def _edit(path, change):
    file = path / CONFIG
    config = json.loads(file.read_text())
    change(config)
    file.write_text(json.dumps(config))


def _file(path):
    return re.escape(str(path / CONFIG))


# The module's class -----------------------------------------------------------------------
def test_load_model_refuses_a_module_of_another_class(tmp_path):
    x, _ = _xy()
    relu = _model()
    relu.save(tmp_path / "relu")
    with pytest.raises(
        ValueError,
        match=rf"{_file(tmp_path / 'relu')}: `module` says the model was saved from a "
        r"ReluNet, but load_model got a TanhNet\..*Pass a ReluNet.*allow_other_module=True",
    ):
        _load(tmp_path / "relu", TanhNet())
    # The same class loads as before; another one only when asked for.
    np.testing.assert_array_equal(
        _load(tmp_path / "relu").predict(x, verbose=0), relu.predict(x, verbose=0)
    )
    tanh = _load(tmp_path / "relu", TanhNet(), allow_other_module=True)
    for a, b in zip(tanh.get_weights(), relu.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # the ReLU weights, as asked
    assert np.abs(tanh.predict(x, verbose=0) - relu.predict(x, verbose=0)).max() > 0.1
    with pytest.raises(TypeError, match=r"`allow_other_module` must be True or False; got 'yes'"):
        _load(tmp_path / "relu", allow_other_module="yes")


# Custom functions under one name ----------------------------------------------------------
def test_save_refuses_a_lambda_loss_and_a_lambda_metric_under_one_name(tmp_path):
    path = tmp_path / "model"
    model = _model(loss=lambda y, p: (y - p) ** 2, metrics=[lambda y, p: jnp.abs(y - p) * 100])
    with pytest.raises(
        ValueError,
        match=r"cannot keep the loss \(compile\.loss\) and the metric compile\.metrics\[0\] "
        r"apart: .*<lambda> \(test_saving\.py:\d+\) and .*<lambda> "
        r"\(test_saving\.py:\d+\), saved by one name, 'lambda'.*define them with "
        r"`def` under different names.*MeanMetricWrapper\(fn, name='\.\.\.'\)",
    ):
        model.save(path)
    assert not path.exists()  # refused before anything was written


def _named_fn(scale):
    def fn(y, p):
        return jnp.abs(y - p) * scale

    return fn


def test_two_functions_named_fn_are_refused_and_kept_apart_once_named(tmp_path):
    x, y = _xy()
    loss_fn, metric_fn = _named_fn(1.0), _named_fn(100.0)
    with pytest.raises(ValueError, match=r"metric compile\.metrics\[0\].*saved by one name, 'fn'"):
        _model(loss=loss_fn, metrics=[metric_fn]).save(tmp_path / "refused")
    # Named apart, they come back apart: the metric is not the loss.
    named = jstrategy.metrics.MeanMetricWrapper(metric_fn, name="error_x100")
    model = _model(loss=loss_fn, metrics=[named])
    model.save(tmp_path / "model")
    before = model.evaluate(x, y, verbose=0, return_dict=True)
    with pytest.raises(ValueError, match=r"`compile\.metrics\[0\]` is the metric 'error_x100'"):
        _load(tmp_path / "model", custom_objects={"fn": loss_fn})
    loaded = _load(tmp_path / "model", custom_objects={"fn": loss_fn, "error_x100": metric_fn})
    assert loaded.metrics_names == model.metrics_names == ["loss", "error_x100"]
    after = loaded.evaluate(x, y, verbose=0, return_dict=True)
    assert after["error_x100"] == pytest.approx(100 * after["loss"], rel=1e-5)
    for name in before:
        assert after[name] == pytest.approx(before[name], rel=1e-6)


def test_one_function_as_the_loss_and_a_metric_is_one_name(tmp_path):
    x, y = _xy()

    def absolute(y, p):
        return jnp.abs(y - p)

    model = _model(loss=absolute, metrics=[absolute])
    model.save(tmp_path / "model")
    loaded = _load(tmp_path / "model", custom_objects={"absolute": absolute})
    assert loaded.evaluate(x, y, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0))


# class_name only through the registry ------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "class_name"),
    [("loss", "get"), ("loss", "LossFunctionWrapper"), ("loss", "EPSILON"), ("metrics", "Mean")],
)
def test_a_class_name_resolves_only_through_the_registry(tmp_path, field, class_name):
    path = _saved(tmp_path)

    def change(config):
        entry = config["compile"]["loss"] if field == "loss" else config["compile"]["metrics"][0]
        entry["class_name"] = class_name

    _edit(path, change)
    where = "compile.loss" if field == "loss" else r"compile.metrics\[0\]"
    with pytest.raises(
        ValueError,
        match=rf"{_file(path)}: `{where}\.class_name` must name a (loss|metric) class "
        rf"jstrategy saves, one of \[.*'MeanSquaredError'.*\], or be 'custom'.*got "
        rf"'{class_name}'",
    ):
        _load(path)


def test_a_config_its_class_does_not_take_names_the_file_and_field(tmp_path):
    path = _saved(tmp_path)
    _edit(path, lambda config: config["compile"]["loss"]["config"].update(bogus=1))
    with pytest.raises(
        ValueError,
        match=rf"{_file(path)}: `compile\.loss\.config` does not build a MeanSquaredError",
    ):
        _load(path)
    path = _saved(tmp_path / "optimizer")
    _edit(path, lambda config: config["compile"]["optimizer"].update(class_name="Adamm"))
    with pytest.raises(
        ValueError, match=rf"{_file(path)}: `compile\.optimizer`: Unknown optimizer 'Adamm'"
    ):
        _load(path)


class _Scaled(jstrategy.losses.Loss):
    def __init__(self, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def call(self, y_true, y_pred):
        return self.scale * (y_true - y_pred) ** 2

    def get_config(self):
        return {"scale": self.scale, **super().get_config()}


def test_a_registered_class_is_saved_by_config_and_needs_no_custom_objects(tmp_path):
    with pytest.raises(
        TypeError, match=r"`cls` must be a subclass of Loss to register as a 'loss'"
    ):
        registry.register_saveable(ReluNet, kind="loss")
    with pytest.raises(ValueError, match=r"'MeanSquaredError' is already registered for .*losses"):
        registry.register_saveable(_Scaled, kind="loss", name="MeanSquaredError")
    assert registry.register_saveable(kind="loss", name="tests._Scaled")(_Scaled) is _Scaled
    x, y = _xy()
    model = _model(loss=_Scaled(3.0))
    model.save(tmp_path / "model")
    loaded = _load(tmp_path / "model")
    assert isinstance(loaded.loss, _Scaled) and loaded.loss.scale == 3.0
    assert loaded.evaluate(x, y, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0))


# A damaged file -----------------------------------------------------------------------------
def test_a_truncated_file_names_the_file(tmp_path):
    path = _saved(tmp_path)
    text = (path / CONFIG).read_text()
    (path / CONFIG).write_text(text[: len(text) // 2])
    with pytest.raises(
        ValueError,
        match=rf"{_file(path)} is not valid JSON \(.*line \d+, column \d+\); it was cut short",
    ):
        _load(path)


def test_a_file_holding_a_list_names_the_file(tmp_path):
    path = _saved(tmp_path)
    (path / CONFIG).write_text("[1, 2]")
    with pytest.raises(
        ValueError, match=rf"{_file(path)} must hold a JSON object .*got a list: \[1, 2\]"
    ):
        _load(path)


DAMAGED = [
    (
        lambda c: c.pop("compile"),
        "compile",
        r"a JSON object or null \(not compiled\); got nothing \(the field is missing\)",
    ),
    (
        lambda c: c["compile"].pop("optimizer"),
        "compile.optimizer",
        "a JSON object; got nothing",
    ),
    (lambda c: c["compile"].update(metrics={}), "compile.metrics", r"a list; got \{\}"),
    (
        lambda c: c["compile"]["metrics"].append(3),
        r"compile.metrics\[1\]",
        "a JSON object describing the metric; got 3",
    ),
    (
        lambda c: c["compile"]["loss"].pop("config"),
        "compile.loss.config",
        "a JSON object; got nothing",
    ),
    (
        lambda c: c["compile"].update(steps_per_execution=0),
        "compile.steps_per_execution",
        "a positive int; got 0",
    ),
    (lambda c: c.update(seed="1"), "seed", "an int; got '1'"),
    (lambda c: c.update(input_shape=[3, "x"]), "input_shape", "a list of sizes or null"),
    (
        lambda c: c.update(input_dtype="float99"),
        "input_dtype",
        "a NumPy dtype name; got 'float99'",
    ),
    (lambda c: c.pop("module"), "module", "a string; got nothing"),
    (
        lambda c: c["compile"].update(remat="dots"),
        "compile.remat",
        "null, 'custom' or a checkpoint policy's name; got 'dots'",
    ),
    (
        lambda c: c["compile"].update(weighted_metrics=[3]),
        r"compile.weighted_metrics\[0\]",
        "a JSON object describing the metric; got 3",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "field", "expected"), DAMAGED, ids=[field for _, field, _ in DAMAGED]
)
def test_every_damaged_field_is_named_with_the_file(tmp_path, change, field, expected):
    path = _saved(tmp_path)
    _edit(path, change)
    with pytest.raises(
        ValueError, match=rf"{_file(path)}: `{field}` must be {expected}.*model\.save\(path\)"
    ):
        _load(path)


def test_weighted_metrics_and_remat_are_saved_with_the_compile_config(tmp_path):

    policies = {
        "none": None,
        "named": "dots_saveable",
        "custom": jax.checkpoint_policies.save_only_these_names("h"),
    }
    for name, remat in policies.items():
        model = jstrategy.Model(nn.Dense(3), input_shape=(4,))
        loss = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile("adam", loss=loss, metrics=["accuracy"], weighted_metrics=["accuracy"],
                      remat=remat)  # fmt: skip
        path = str(tmp_path / name)
        model.save(path)
        if name == "custom":
            with pytest.raises(ValueError, match=r"`compile.remat` was a checkpoint policy of"):
                jstrategy.models.load_model(path, nn.Dense(3))
            loaded = jstrategy.models.load_model(path, nn.Dense(3), custom_objects={"remat": remat})
            assert loaded.remat is remat
        else:
            loaded = jstrategy.models.load_model(path, nn.Dense(3))
            assert loaded.remat is model.remat
        assert (
            loaded.metrics_names == model.metrics_names == ["loss", "accuracy", "weighted_accuracy"]
        )
        assert [type(m) for m in loaded.weighted_metrics] == [
            type(m) for m in model.weighted_metrics
        ]


# TF habits (issue 14), finding 7: model.save / jstrategy.models.load_model
@pytest.mark.slow
def test_save_and_load_model_keep_weights_optimizer_state_and_compile_config(tmp_path):
    x, y = helpers.logits_and_labels(64, seed=5)
    mirrored = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    with mirrored.scope():
        model = jstrategy.Model(helpers.Classifier(), input_shape=(10,), seed=3)
        model.compile(
            jstrategy.optimizers.Adam(
                jstrategy.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5)
            ),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[
                "accuracy",
                "sparse_categorical_accuracy",
                jstrategy.metrics.MeanMetricWrapper(
                    jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True), name="xent"
                ),
            ],
            steps_per_execution=2,
        )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    saved = model.get_weights()
    path = str(tmp_path / "model")
    model.save(path)
    with jstrategy.OneDeviceStrategy("cpu:0").scope():  # any strategy loads it
        elsewhere = jstrategy.models.load_model(path, helpers.Classifier())
    for a, b in zip(elsewhere.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(a, b)
    with mirrored.scope():
        loaded = jstrategy.models.load_model(path, helpers.Classifier())
    assert loaded.metrics_names == model.metrics_names
    assert loaded.steps_per_execution == 2 and int(loaded.state.step) == 4
    assert isinstance(loaded.optimizer.schedule, jstrategy.optimizers.schedules.ExponentialDecay)
    assert loaded.learning_rate == pytest.approx(model.learning_rate)
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # parameters and BatchNorm statistics
    # The optimizer state came back: one more epoch from both lands on the same weights.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    weights_only = jstrategy.models.load_model(path, helpers.Classifier(), compile=False)
    assert not weights_only.compiled
    for a, b in zip(weights_only.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(a, b)


def test_load_model_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No saved model at .*missing.*model\.save"):
        jstrategy.models.load_model(tmp_path / "missing", nn.Dense(1))
    model = helpers.dense_regression_model(
        jstrategy.OneDeviceStrategy("cpu:0"), loss=lambda y, p: (y - p) ** 2
    )
    model.save_weights(tmp_path / "weights")
    with pytest.raises(ValueError, match=r"weights.*not a directory written by model\.save"):
        jstrategy.models.load_model(tmp_path / "weights", nn.Dense(1))
    model.save(tmp_path / "custom")
    with pytest.raises(ValueError, match=r"loss 'lambda'.*custom_objects=\{'lambda': \.\.\.\}"):
        jstrategy.models.load_model(tmp_path / "custom", nn.Dense(1))
    with pytest.raises(ValueError, match=r"custom_objects=\{'optimizer': \.\.\.\}"):
        jstrategy.models.load_model(
            tmp_path / "custom", nn.Dense(1), custom_objects={"lambda": lambda y, p: y - p}
        )
    loaded = jstrategy.models.load_model(
        tmp_path / "custom",
        nn.Dense(1),
        custom_objects={"optimizer": optax.sgd(0.1), "lambda": lambda y, p: (y - p) ** 2},
    )
    assert loaded.compiled
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a directory written by model.save"):
        model.save(tmp_path / "other")


@pytest.mark.slow
def test_save_and_load_model_keep_the_dtype_policy_and_a_cycle_in_progress(tmp_path):
    # The compile options of issue 13 travel with the model: the dtype policy, and
    # gradient accumulation, whose pending sums are part of the saved state.
    x, y = helpers.logits_and_labels(48, seed=7)
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        model = jstrategy.Model(
            helpers.Classifier(), input_shape=(10,), dtype_policy="mixed_bfloat16"
        )
        model.compile(
            "sgd",
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            gradient_accumulation_steps=2,
        )
        model.fit(x[:24], y[:24], batch_size=8, epochs=1, verbose=0, shuffle=False)  # 3 batches
        path = str(tmp_path / "model")
        model.save(path)
        loaded = jstrategy.models.load_model(path, helpers.Classifier())
    assert loaded.dtype_policy.name == "mixed_bfloat16"
    assert loaded.gradient_accumulation_steps == 2
    # One micro-batch of the second cycle is pending in both; the next finishes it alike.
    model.fit(x[24:32], y[24:32], batch_size=8, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x[24:32], y[24:32], batch_size=8, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_restore_checkpoint_reads_the_whole_state_of_a_saved_model(tmp_path):
    # A `save` directory is also a checkpoint: a model built and compiled by hand takes its
    # variables, optimizer state and step, and trains on exactly as the saved one.
    x, y = helpers.logits_and_labels(48, seed=9)
    loss = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
    with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = jstrategy.Model(helpers.Classifier(), input_shape=(10,), seed=4)
        model.compile(jstrategy.optimizers.Adam(0.01), loss=loss)
        other = jstrategy.Model(helpers.Classifier(), input_shape=(10,), seed=5)
        other.compile(jstrategy.optimizers.Adam(0.01), loss=loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    path = str(tmp_path / "model")
    model.save(path)
    assert other.get_config() == {**model.get_config(), "seed": 5}
    other.restore_checkpoint(path)
    assert int(other.state.step) == 3
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    other.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(other.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
