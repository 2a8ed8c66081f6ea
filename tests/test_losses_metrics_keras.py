"""Losses and metrics against Keras 3's recorded numbers: every weight shape and reduction.

The reference is `tests/data/keras_losses_reference.json`, written by
`tests/reference/record_keras_losses.py` with Keras 3 (JAX backend); Keras is not needed here.
"""

import json
import os

import flax.linen as nn
import numpy as np
import pytest

import jstrategy
from jstrategy import losses
from jstrategy import metrics

_PATH = os.path.join(os.path.dirname(__file__), "data", "keras_losses_reference.json")
with open(_PATH) as _f:
    REF = json.load(_f)
INPUTS = {
    k: np.asarray(v, np.int32 if "sparse" in k else np.float32) for k, v in REF["inputs"].items()
}
RTOL = 1e-5


def _close(actual, expected):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected), rtol=RTOL, atol=1e-6
    )


def _id(case):
    return f"{case['name']}-{case.get('y_pred', '')}-{case['sample_weight']}-{case.get('reduction', '')}"


@pytest.mark.slow
@pytest.mark.parametrize("case", REF["losses"], ids=_id)
def test_loss_matches_keras(case):
    loss = getattr(losses, case["class"])(reduction=case["reduction"], **case["kwargs"])
    y, p = INPUTS[case["y_true"]], INPUTS[case["y_pred"]]
    w = None if case["sample_weight"] is None else INPUTS[case["sample_weight"]]
    if "error" in case:
        # Keras refuses (b,) weights on (b, t) losses (it multiplies without expanding);
        # here a (b,) weight weighs rows, exactly as (b, 1) does in Keras.
        assert case["sample_weight"] == "w_b", case["error"]
        twin = next(
            c
            for c in REF["losses"]
            if c["name"] == case["name"]
            and c["y_pred"] == case["y_pred"]
            and c["reduction"] == case["reduction"]
            and c["sample_weight"] == "w_b1"
        )
        _close(loss(y, p, sample_weight=w), twin["value"])
        return
    _close(loss(y, p, sample_weight=w), case["value"])


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in REF["metrics"] if c["class"] != "Mean"], ids=_id)
def test_metric_matches_keras(case):
    m = getattr(metrics, case["class"])(**case["kwargs"])
    y, p = INPUTS[case["y_true"]], INPUTS[case["y_pred"]]
    w = None if case["sample_weight"] is None else INPUTS[case["sample_weight"]]
    m.update_state(y, p, sample_weight=w)
    m.update_state(y[::-1], p[::-1], None if w is None else w[::-1] * 0.5)
    _close(m.result(), case["value"])


@pytest.mark.parametrize("case", [c for c in REF["metrics"] if c["class"] == "Mean"], ids=_id)
def test_mean_weights_match_keras(case):
    # (b, 1) weights once broadcast to (b, b): Mean gave another number than Keras.
    if "values" in case:
        values = np.asarray(case["values"], np.float32)
    else:
        values = INPUTS["seq_reg_pred"][..., 0]
    m = metrics.Mean()
    m.update_state(values, sample_weight=INPUTS[case["sample_weight"]])
    _close(m.result(), case["value"])


def test_reduction_none_keeps_time_steps():
    y, p = INPUTS["seq_sparse"], INPUTS["seq_logits"]
    out = losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")(
        y, p, sample_weight=INPUTS["w_bt"]
    )
    assert out.shape == y.shape


def test_weight_of_another_shape_is_an_error_naming_it():
    loss = losses.MeanSquaredError()
    with pytest.raises(ValueError, match="`sample_weight` of shape \\(4, 5\\)"):
        loss(INPUTS["seq_reg_true"], INPUTS["seq_reg_pred"], sample_weight=np.ones((4, 5)))


class _PerStep(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


def _sequence_model(strategy):
    seq = REF["sequence_model"]
    with strategy.scope():
        model = jstrategy.Model(_PerStep(), input_shape=np.shape(seq["x"])[1:])
        model.compile(
            jstrategy.optimizers.SGD(learning_rate=seq["learning_rate"]),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"],
            weighted_metrics=["sparse_categorical_accuracy"],
        )
    model.set_weights([np.asarray(seq["kernel"], np.float32), np.asarray(seq["bias"], np.float32)])
    return model


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored"])
def test_sequence_model_with_padding_mask_matches_keras(strategy_name):
    seq = REF["sequence_model"]
    if strategy_name == "one_device":
        strategy = jstrategy.OneDeviceStrategy("cpu:0")
    else:
        strategy = jstrategy.MirroredStrategy()
    x = np.asarray(seq["x"], np.float32)
    y = np.asarray(seq["y"], np.int32)
    mask = np.asarray(seq["mask"], np.float32)
    model = _sequence_model(strategy)
    logs = model.evaluate(
        x, y, sample_weight=mask, batch_size=seq["batch_size"], verbose=0, return_dict=True
    )
    for key, value in seq["evaluate"].items():
        _close(logs[key], value)
    history = model.fit(
        x,
        y,
        sample_weight=mask,
        batch_size=seq["batch_size"],
        epochs=seq["epochs"],
        shuffle=False,
        verbose=0,
    )
    for key, values in seq["fit_history"].items():
        _close(history.history[key], values)
    weights = {np.shape(w): w for w in model.get_weights()}
    _close(weights[(4, 3)], seq["kernel_after"])
    _close(weights[(3,)], seq["bias_after"])
