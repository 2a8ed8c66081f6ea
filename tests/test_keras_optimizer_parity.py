"""Keras-named optimizers follow Keras 3's numbers, recorded by
`tests/reference/record_keras_optimizers.py` (Keras 3, JAX backend) into
`tests/data/keras_optimizers_reference.json`: every optimizer `jstrategy.optimizers` names,
at a constant rate, under schedules, under a rate set between steps (as
`LearningRateScheduler` does), with EMA, gradient accumulation, clipping, weight decay and
a loss scale factor; and `Model.fit` with SGD's momentum under a per-epoch halving rate,
under a schedule with gradient accumulation (the optimizer's and the model's), and with EMA.
"""

from __future__ import annotations

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy._src.training import keras_optimizers

REFERENCE = json.loads(
    (pathlib.Path(__file__).parent / "data" / "keras_optimizers_reference.json").read_text()
)
RTOL = 1e-5


def _optimizer(class_name: str, kwargs: dict) -> jstrategy.optimizers.Optimizer:
    kwargs = dict(kwargs)
    rate = kwargs.get("learning_rate")
    if isinstance(rate, dict):
        kwargs["learning_rate"] = jstrategy.optimizers.schedules.deserialize(rate)
    return getattr(jstrategy.optimizers, class_name)(**kwargs)


def _params(arrays: list) -> dict:
    return {
        "kernel": jnp.asarray(arrays[0], jnp.float32),
        "bias": jnp.asarray(arrays[1], jnp.float32),
    }


def _close(actual: dict, expected: list, what: str) -> None:
    pairs = zip((actual["kernel"], actual["bias"]), expected, ("kernel", "bias"), strict=True)
    for got, want, name in pairs:
        want = np.asarray(want, np.float32)
        # Relative to the weights' scale: elements that pass through zero have no relative error.
        err = np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want))
        assert err <= RTOL, f"{what} {name}: {err:.2e} relative off Keras"


def _with_rate(opt_state, rate: float):
    injected = keras_optimizers.injected_state(opt_state)
    hyper = dict(injected.hyperparams)
    hyper["learning_rate"] = jnp.asarray(rate, hyper["learning_rate"].dtype)
    return injected._replace(hyperparams=hyper)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFERENCE["direct"]))
def test_each_step_follows_keras(name):
    case = REFERENCE["direct"][name]
    optimizer = _optimizer(case["class_name"], case["kwargs"])
    tx = optimizer.tx
    params = _params(REFERENCE["initial"])
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step, (grads, expected) in enumerate(zip(REFERENCE["grads"], case["weights"], strict=True)):
        if case["rates"] is not None:  # what LearningRateScheduler does before a step
            state = _with_rate(state, case["rates"][step])
        updates, state = update(_params(grads), state, params)
        params = optax.apply_updates(params, updates)
        _close(params, expected, f"{name} step {step}")
    if "ema_average" in case:
        _close(keras_optimizers.ema_average(state), case["ema_average"], f"{name} EMA")


def test_every_named_optimizer_is_recorded():
    recorded = {case["class_name"] for case in REFERENCE["direct"].values()}
    named = {
        n
        for n in jstrategy.optimizers.__all__
        if isinstance(getattr(jstrategy.optimizers, n), type)
        and issubclass(getattr(jstrategy.optimizers, n), jstrategy.optimizers.Optimizer)
        and n != "Optimizer"
    }
    assert named == recorded


def _fit_model(case: dict, optimizer, *, accumulation: int = 1) -> jstrategy.Model:
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        model = jstrategy.Model(nn.Dense(3), input_shape=(4,), seed=0)
        model.compile(optimizer, loss="mse", gradient_accumulation_steps=accumulation)
    kernel, bias = (np.asarray(w, np.float32) for w in REFERENCE["initial"])
    model.set_weights([bias, kernel])  # jstrategy lists a Dense's variables by name
    callbacks = []
    if case["halving_from"] is not None:
        start = case["halving_from"]
        callbacks.append(jstrategy.callbacks.LearningRateScheduler(lambda e: start * 0.5**e))
    model.fit(
        np.asarray(REFERENCE["fit_x"], np.float32),
        np.asarray(REFERENCE["fit_y"], np.float32),
        batch_size=REFERENCE["fit_batch_size"],
        epochs=case["epochs"],
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return model


def _fit_close(model: jstrategy.Model, case: dict, what: str) -> None:
    bias, kernel = model.get_weights()
    _close({"kernel": kernel, "bias": bias}, case["weights"], what)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFERENCE["fit"]))
def test_fit_follows_keras(name):
    case = REFERENCE["fit"][name]
    model = _fit_model(case, _optimizer(case["class_name"], case["kwargs"]))
    _fit_close(model, case, name)


def test_model_accumulation_counts_a_schedule_as_keras_does():
    # Keras's optimizer(gradient_accumulation_steps=2) and the model's own accumulation
    # (compile(gradient_accumulation_steps=2), full batches) give the same update: the
    # schedule sees Keras's count, which advances per micro-batch.
    case = REFERENCE["fit"]["fit_sgd_momentum_accumulation_exponential"]
    kwargs = dict(case["kwargs"])
    steps = kwargs.pop("gradient_accumulation_steps")
    model = _fit_model(case, _optimizer(case["class_name"], kwargs), accumulation=steps)
    _fit_close(model, case, "model accumulation")
    # The rate the next update applies: Keras's count of its last micro-batch, 12 * 3 + 1.
    schedule = jstrategy.optimizers.schedules.deserialize(kwargs["learning_rate"])
    assert model.learning_rate == pytest.approx(float(schedule(4 * 3 + 1)))


def test_both_accumulations_at_once_are_refused():
    optimizer = jstrategy.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        model = jstrategy.Model(nn.Dense(3), input_shape=(4,))
        with pytest.raises(ValueError, match="accumulate twice"):
            model.compile(optimizer, loss="mse", gradient_accumulation_steps=2)


def test_loss_scale_factor_scales_the_loss_in_fit():
    # Keras multiplies the loss by the factor and divides the gradients by it: the same
    # training. Without the loss scaled in fit, the update would be 1/128 as large.
    case = {"halving_from": None, "epochs": 1}
    plain = _fit_model(case, jstrategy.optimizers.SGD(0.1))
    scaled = _fit_model(case, jstrategy.optimizers.SGD(0.1, loss_scale_factor=128.0))
    for a, b in zip(plain.get_weights(), scaled.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert scaled.optimizer.scale_loss(2.0) == 256.0
