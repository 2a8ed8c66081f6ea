"""The layers of issue 49 against Keras 3's recorded numbers: outputs and gradients.

The reference is `tests/data/keras_layers_reference.json`, written by
`tests/reference/record_keras_layers.py` with Keras 3.15 (JAX backend); Keras is not needed
here. Each case builds jstrategy's layer from the same keyword arguments as Keras's, loads
the same weights, and compares the output and the gradients of ``sum(output *
cotangent)`` with respect to every input and every weight within `TOLERANCE`. Then: each
layer's refusals of bad arguments and inputs, saving, and one training step under
`MirroredStrategy` that follows `OneDeviceStrategy`.
"""

from __future__ import annotations

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstrategy
from jstrategy import layers as L
from jstrategy._src.layers import serialization

REFERENCE = json.loads(
    (pathlib.Path(__file__).parent / "data" / "keras_layers_reference.json").read_text()
)
CASES = REFERENCE["cases"]
TOLERANCE = 1e-6  # absolute and relative
MERGING = ("Add", "Concatenate")
NEW_LAYERS = {
    "Conv1D",
    "MaxPooling1D",
    "AveragePooling1D",
    "GlobalAveragePooling1D",
    "GlobalMaxPooling1D",
    "GlobalMaxPooling2D",
    "ReLU",
    "Add",
    "Concatenate",
}


def _close(got, want):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=TOLERANCE, atol=TOLERANCE
    )


def test_the_reference_is_kerass_and_covers_every_new_layer():
    assert REFERENCE["keras_version"] == "3.15.1" and REFERENCE["backend"] == "jax"
    assert {case["layer"] for case in CASES} == NEW_LAYERS
    assert set(L.__all__) >= NEW_LAYERS


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_outputs_and_gradients_are_kerass(case):
    layer = getattr(L, case["layer"])(**case["kwargs"])
    inputs = [jnp.asarray(x, jnp.float32) for x in case["inputs"]]
    many = case["layer"] in MERGING
    params = {k: jnp.asarray(v, jnp.float32) for k, v in case["weights"].items()}
    made = layer.init(jax.random.key(0), inputs if many else inputs[0]).get("params", {})
    # Keras's weights, by name and shape, are the layer's own.
    assert jax.tree.map(jnp.shape, made) == jax.tree.map(jnp.shape, params)

    def forward(params, xs):
        return layer.apply({"params": params} if params else {}, xs if many else xs[0])

    output, pullback = jax.vjp(forward, params, inputs)
    _close(output, case["output"])
    grad_params, grad_inputs = pullback(jnp.asarray(case["cotangent"], jnp.float32))
    assert len(grad_inputs) == len(case["grad_inputs"])
    for got, want in zip(grad_inputs, case["grad_inputs"], strict=True):
        _close(got, want)
    assert sorted(grad_params) == sorted(case["grad_weights"])
    for name, want in case["grad_weights"].items():
        _close(grad_params[name], want)


# Refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: L.Conv1D(0, 3), r"`filters` must be a positive int; got 0\. E\.g\. Conv1D"),
        (lambda: L.Conv1D(4, 0), r"`kernel_size` must be a positive int; got 0"),
        (lambda: L.Conv1D(4, (3, 3)), r"`kernel_size` must be an int or a tuple of 1 int"),
        (lambda: L.Conv1D(4, 3, padding="full"), r"`padding` must be 'valid', 'same' or 'causal'"),
        (
            lambda: L.Conv1D(4, 3, strides=2, dilation_rate=2),
            r"`strides` > 1 and `dilation_rate` > 1 cannot be combined",
        ),
        (lambda: L.Conv1D(4, 3, groups=3), r"`filters` \(4\) must be a multiple of `groups`"),
        (lambda: L.Conv1D(4, 3, data_format="NWC"), r"`data_format` must be 'channels_last'"),
        (lambda: L.Conv1D(4, 3, activation="relu7"), r"`activation` must be a Keras activation"),
        (lambda: L.Conv2D(4, 3, padding="causal"), r"`padding` must be 'valid' or 'same'; got"),
        (lambda: L.MaxPooling1D(0), r"`pool_size` must be a positive int; got 0"),
        (lambda: L.MaxPooling1D(2, strides=(1, 1)), r"`strides` must be an int or a tuple of 1"),
        (lambda: L.AveragePooling1D(2, padding="causal"), r"`padding` must be 'valid' or 'same'"),
        (
            lambda: L.GlobalAveragePooling1D(data_format="first"),
            r"`data_format` must be 'channels_last', 'channels_first' or None",
        ),
        (lambda: L.GlobalMaxPooling1D(keepdims="yes"), r"`keepdims` must be a bool; got 'yes'"),
        (lambda: L.GlobalMaxPooling2D(keepdims=1), r"`keepdims` must be a bool; got 1"),
        (
            lambda: L.ReLU(max_value=-1.0),
            r"`max_value` must be a non-negative float; got -1\.0\. Or None: unbounded",
        ),
        (
            lambda: L.ReLU(negative_slope=None),
            r"`negative_slope` must be a non-negative float; got None",
        ),
        (lambda: L.ReLU(threshold=-0.5), r"`threshold` must be a non-negative float; got -0\.5"),
        (lambda: L.Concatenate(axis=1.5), r"`axis` must be an int, e\.g\. -1 or 1; got 1\.5"),
    ],
)
def test_bad_arguments_are_refused_when_the_layer_is_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("layer", "inputs", "message"),
    [
        (
            L.Conv1D(4, 3),
            [(2, 10)],
            r"Conv1D takes inputs of rank 3, \(batch, steps, channels\); got inputs of shape "
            r"\(2, 10\)\. Add a channel axis: x\[\.\.\., None\] \(then input_shape=\(10, 1\)\)",
        ),
        (
            L.MaxPooling1D(data_format="channels_first"),
            [(2, 3, 4, 5)],
            r"MaxPooling1D takes inputs of rank 3, \(batch, channels, steps\)",
        ),
        (
            L.GlobalMaxPooling2D(),
            [(2, 5, 3)],
            r"GlobalMaxPooling2D takes inputs of rank 4, \(batch, height, width, channels\)",
        ),
        (
            L.Conv1D(4, 5, dilation_rate=2),
            [(2, 8, 1)],
            r"Conv1D: its window \(9,\) is larger than the \(8,\) sequence .*Computed output "
            r"size would be zero or negative: \(0,\)\. .*longer sequences",
        ),
        (L.AveragePooling1D(4), [(2, 3, 1)], r"AveragePooling1D: its window \(4,\) is larger"),
        (
            L.Conv1D(6, 3, groups=2),
            [(2, 8, 3)],
            r"The inputs' 3 channels must be a multiple of `groups` \(2\)",
        ),
        (L.Add(), [(2, 3), (2, 4)], r"Add's inputs must have one shape .*\[\(2, 3\), \(2, 4\)\]"),
        (L.Add(), [(2, 3), (3, 3)], r"Add cannot merge inputs of different batch sizes"),
        (
            L.Concatenate(),
            [(2, 3, 4), (2, 5, 4)],
            r"Concatenate's inputs must have the same shape except along `axis` \(-1\); got "
            r"shapes \[\(2, 3, 4\), \(2, 5, 4\)\]",
        ),
        (L.Concatenate(), [(2, 3, 4), (2, 4)], r"same shape except along `axis`"),
        (L.Concatenate(axis=3), [(2, 3), (2, 4)], r"`axis` \(3\) is outside its inputs' 2 axes"),
        (L.Concatenate(), [], r"Concatenate takes a list of at least one input; got an empty"),
    ],
)
def test_bad_inputs_are_refused_with_the_fix(layer, inputs, message):
    arrays = [jnp.ones(shape) for shape in inputs]
    merging = isinstance(layer, (L.Add, L.Concatenate))
    with pytest.raises(ValueError, match=message):
        layer.init(jax.random.key(0), arrays if merging else arrays[0])


@pytest.mark.parametrize("merge", [L.Add(), L.Concatenate()])
def test_a_merge_layer_in_a_sequential_names_the_flax_module_route(merge):
    name = type(merge).__name__
    model = jstrategy.Sequential([L.Input((4,)), L.Dense(4), merge])
    with pytest.raises(
        ValueError,
        match=rf"{name} takes a list of inputs, as Keras's merge layers do: {name}\(.*\)\(\[a, "
        r"b\]\); got .* of shape \(1, 4\)\. A jstrategy.Sequential is one chain of one-input "
        r"layers: write the model as a Flax module .*jstrategy.Model\(module, input_shape=",
    ):
        model.count_params()


def test_channels_first_and_last_agree():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 9, 3)).astype(np.float32)
    kernel = {"params": {"kernel": rng.normal(size=(3, 3, 4)).astype(np.float32)}}
    for make in (
        lambda **kw: L.Conv1D(4, 3, padding="causal", use_bias=False, **kw),
        lambda **kw: L.MaxPooling1D(3, strides=2, padding="same", **kw),
        lambda **kw: L.AveragePooling1D(3, strides=2, padding="same", **kw),
        lambda **kw: L.GlobalAveragePooling1D(keepdims=True, **kw),
        lambda **kw: L.GlobalMaxPooling1D(keepdims=True, **kw),
    ):
        variables = kernel if isinstance(make(), L.Conv1D) else {}
        last = make().apply(variables, x)
        first = make(data_format="channels_first").apply(variables, x.transpose(0, 2, 1))
        np.testing.assert_allclose(first.transpose(0, 2, 1), last, rtol=1e-6, atol=1e-6)


# Saving ---------------------------------------------------------------------------------
def _sequence_layers():
    return [
        L.Input((12, 3)),
        L.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="relu"),
        L.ReLU(max_value=6.0, negative_slope=0.1, threshold=0.2),
        L.MaxPooling1D(2),
        L.Conv1D(4, 3, strides=2, padding="same", data_format="channels_first"),
        L.AveragePooling1D(2, padding="same", data_format="channels_first"),
        L.Reshape((2, 2, 1)),
        L.GlobalMaxPooling2D(data_format="channels_first", keepdims=True),
        L.Reshape((2, 1)),
        L.GlobalAveragePooling1D(data_format="channels_first", keepdims=True),
        L.GlobalMaxPooling1D(data_format="channels_first"),
        L.Dense(3),
    ]


def test_the_new_layers_save_and_load_without_code(tmp_path):
    x = np.random.default_rng(1).normal(size=(4, 12, 3)).astype(np.float32)
    model = jstrategy.Sequential(_sequence_layers(), seed=2)
    model.compile("sgd", "mse")
    model.save(tmp_path / "m")
    loaded = jstrategy.models.load_model(tmp_path / "m")
    assert [type(a) for a in loaded.layers] == [type(b) for b in model.layers]
    relu = loaded.get_layer("re_lu")
    assert (relu.max_value, relu.negative_slope, relu.threshold) == (6.0, 0.1, 0.2)
    assert loaded.get_layer("conv1d").padding == "causal"
    assert loaded.get_layer("conv1d").dilation_rate == (2,)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # The merge layers, which no Sequential holds, are saveable inside one's own module's.
    for layer in (L.Add(name="add"), L.Concatenate(axis=1, name="concatenate")):
        assert serialization.deserialize(serialization.serialize(layer)) == layer


# Under strategies ----------------------------------------------------------------------------
class Branches(nn.Module):
    """Every new layer in a model of one's own: two pooled branches added, three global
    poolings concatenated."""

    @nn.compact
    def __call__(self, x, training: bool = False):
        h = L.Conv1D(8, 3, padding="same")(x)
        h = L.ReLU(negative_slope=0.1)(h)
        h = L.Add()([L.MaxPooling1D(2)(h), L.AveragePooling1D(2)(h)])
        h = L.Conv1D(8, 2, padding="causal", dilation_rate=2, activation="tanh")(h)
        pooled = L.Concatenate()(
            [
                L.GlobalAveragePooling1D()(h),
                L.GlobalMaxPooling1D()(h),
                L.GlobalMaxPooling2D()(h.reshape(h.shape[0], 2, 4, 8)),
            ]
        )
        return L.Dense(3)(pooled)


def _one_step(strategy, make):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 16, 3)).astype(np.float32)
    y = rng.integers(0, 3, size=16)
    with strategy.scope():
        model = make()
        model.compile(
            jstrategy.optimizers.SGD(0.1),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    loss = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"]
    return loss, model.get_weights()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: jstrategy.Sequential(
                [
                    L.Input((16, 3)),
                    L.Conv1D(8, 3, padding="causal", dilation_rate=2),
                    L.ReLU(max_value=6.0),
                    L.MaxPooling1D(2),
                    L.Conv1D(8, 3, strides=2, padding="same"),
                    L.AveragePooling1D(2, padding="same"),
                    L.GlobalAveragePooling1D(),
                    L.Dense(3),
                ],
                seed=0,
            ),
            id="sequential",
        ),
        pytest.param(lambda: jstrategy.Model(Branches(), input_shape=(16, 3)), id="flax_module"),
    ],
)
def test_one_step_under_mirrored_follows_one_device(make):
    got_loss, got = _one_step(jstrategy.MirroredStrategy(), make)
    want_loss, want = _one_step(jstrategy.OneDeviceStrategy("cpu:0"), make)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # The step moved the weights: the comparison is of trained weights.
    initial = make().get_weights()
    assert any(not np.allclose(a, b) for a, b in zip(got, initial, strict=True))
