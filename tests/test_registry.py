"""The one registry of saveable classes: every kind a saved file names, in one place."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import jstrategy
from jstrategy._src import registry
from jstrategy._src.layers import serialization

# Each kind, its public namespace, and the classes of it that are bases or wrappers (their
# configs hold functions, or they are not meant to be built from a file).
_KINDS = [
    ("layer", jstrategy.layers, {"Layer"}),
    ("regularizer", jstrategy.regularizers, {"Regularizer"}),
    ("constraint", jstrategy.constraints, {"Constraint"}),
    ("loss", jstrategy.losses, {"Loss", "LossFunctionWrapper", "Reduction"}),
    ("metric", jstrategy.metrics, {"Metric", "Mean", "MeanMetricWrapper"}),
    ("optimizer", jstrategy.optimizers, {"Optimizer"}),
    ("schedule", jstrategy.optimizers.schedules, {"LearningRateSchedule"}),
]


@pytest.mark.parametrize(("kind", "namespace", "bases"), _KINDS, ids=[k[0] for k in _KINDS])
def test_every_public_class_of_a_kind_is_registered_once_by_its_name(kind, namespace, bases):
    public = {
        name: getattr(namespace, name)
        for name in namespace.__all__
        if inspect.isclass(getattr(namespace, name))
        and not issubclass(getattr(namespace, name), Warning)
        and name not in bases
    }
    # Other tests register their own classes (under dotted names) in the same process.
    classes = registry.saveable_classes(kind)
    ours = {n: c for n, c in classes.items() if c.__module__.startswith("jstrategy.")}
    assert ours == public


def test_models_are_a_kind_of_the_same_registry():
    x = jstrategy.Input((2,))
    assert registry.saveable_classes("model") == {
        "Model": jstrategy.Model,
        "Sequential": jstrategy.Sequential,
        # What jstrategy.Model(inputs, outputs) makes, as keras.Model does.
        "Functional": type(jstrategy.Model(x, jstrategy.layers.Dense(1)(x))),
    }


def test_a_class_of_another_kind_or_a_taken_name_is_refused():
    with pytest.raises(TypeError, match=r"`cls` must be a subclass of Layer to register as a"):
        registry.register_saveable(jstrategy.regularizers.L2, kind="layer")
    with pytest.raises(ValueError, match=r"'Dense' is already registered for .*core\.Dense"):
        registry.register_saveable(jstrategy.layers.Flatten, kind="layer", name="Dense")


class Doubled(jstrategy.layers.Layer):
    """A user's layer: registered, it is saved in a Sequential's config like Keras's own."""

    factor: float = 2.0

    def __call__(self, inputs, training=None):
        return self.factor * inputs


def test_a_registered_layer_is_saved_and_rebuilt_by_its_config_alone(tmp_path):
    registry.register_saveable(Doubled, kind="layer", name="tests.Doubled")
    model = jstrategy.Sequential(
        [jstrategy.Input(shape=(3,)), Doubled(factor=3.0), jstrategy.layers.Dense(2)]
    )
    model.compile("sgd", loss="mse")
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    expected = model.predict(x, verbose=0)
    assert serialization.serialize(model.layers[0])["class_name"] == "tests.Doubled"
    model.save(tmp_path / "model")
    loaded = jstrategy.models.load_model(tmp_path / "model")  # no layers, no custom objects
    assert type(loaded.layers[0]) is Doubled and loaded.layers[0].factor == 3.0
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
