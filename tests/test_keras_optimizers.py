"""Keras-named optimizers follow Keras 3's numbers, recorded by
`tests/reference/record_keras_optimizers.py` (Keras 3, JAX backend) into
`tests/data/keras_optimizers_reference.json`: every optimizer `jstrategy.optimizers` names,
at a constant rate, under schedules, under a rate set between steps (as
`LearningRateScheduler` does), with EMA, gradient accumulation, clipping, weight decay and
a loss scale factor; and `Model.fit` with SGD's momentum under a per-epoch halving rate,
under a schedule with gradient accumulation (the optimizer's and the model's), and with EMA.

Keras 3's optimizer argument rules, with Keras's messages; TF's cross-replica error for
`apply_gradients` outside `Strategy.run`.


"""

from __future__ import annotations

import json
import pathlib

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import training
from jstrategy._src.training.optimizers.base import ema_average
from jstrategy._src.training.optimizers.base import injected_state

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
    injected = injected_state(opt_state)
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
        _close(ema_average(state), case["ema_average"], f"{name} EMA")


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
    model.set_weights([kernel, bias])  # Keras's order
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
    kernel, bias = model.get_weights()
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


# Keras 3's argument rules, with Keras's messages; TF's cross-replica error for apply_gradients.


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clipnorm": 1.0, "clipvalue": 0.5},
        {"clipnorm": 1.0, "global_clipnorm": 1.0},
        {"clipvalue": 0.5, "global_clipnorm": 1.0},
    ],
)
def test_only_one_clip_option(kwargs):
    with pytest.raises(
        ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"
    ):
        jstrategy.optimizers.SGD(0.1, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gradient_accumulation_steps": 1}, "must be an integer >= 2. Received: "),
        ({"gradient_accumulation_steps": 2.5}, "must be an integer >= 2"),
        ({"use_ema": True, "ema_momentum": 1.5}, r"`ema_momentum` must be in the range \[0, 1\]"),
        ({"use_ema": True, "ema_overwrite_frequency": 0.5}, "`ema_overwrite_frequency` must be"),
        ({"loss_scale_factor": -1.0}, "`loss_scale_factor` must be a positive float"),
        ({"amsgrad_typo": True}, r"Argument\(s\) not recognized: \{'amsgrad_typo': True\}"),
    ],
)
def test_keras_base_arguments_are_checked_with_keras_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jstrategy.optimizers.Adam(0.01, **kwargs)


def test_keras_only_arguments_are_accepted_and_kept_in_the_config():
    opt = jstrategy.optimizers.Adam(
        0.01,
        use_ema=True,
        ema_momentum=0.9,
        ema_overwrite_frequency=5,
        loss_scale_factor=64.0,
        gradient_accumulation_steps=4,
    )
    config = opt.get_config()
    assert config["use_ema"] and config["ema_overwrite_frequency"] == 5
    assert config["gradient_accumulation_steps"] == 4 and config["loss_scale_factor"] == 64.0
    again = jstrategy.optimizers.get(jstrategy.optimizers.serialize(opt))
    assert again.get_config() == config


def test_optimizer_specific_rules():
    with pytest.raises(ValueError, match="Argument `weight_decay` must be a float"):
        jstrategy.optimizers.AdamW(weight_decay=None)
    with pytest.raises(ValueError, match="degenerates to SignSGD"):
        jstrategy.optimizers.Lion(beta_1=0.0)
    with pytest.warns(UserWarning, match="`decay` is no longer supported"):
        jstrategy.optimizers.SGD(0.1, decay=1e-4)


def _model(strategy):
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(3,), seed=0)
        optimizer = jstrategy.optimizers.SGD(0.1)
    return model, optimizer


def _grads(model):
    return [jnp.ones_like(v) for v in model.trainable_variables]


@pytest.mark.slow
def test_apply_gradients_outside_run_under_mirrored_is_tfs_error():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    model, optimizer = _model(strategy)
    message = r"`apply_gradients\(\) cannot be called in cross-replica context. Use `tf.distribute"
    with pytest.raises(RuntimeError, match=message):  # outside the scope: replicated variables
        optimizer.apply_gradients(zip(_grads(model), model.trainable_variables, strict=True))
    with strategy.scope(), pytest.raises(RuntimeError, match=message):
        optimizer.apply(_grads(model), model.trainable_variables)
    # Inside run it trains, as in TF.

    def step():
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(_grads(model), variables, strict=True))

    before = model.get_weights()
    strategy.run(step)
    assert optimizer.iterations == 1
    assert not np.array_equal(model.get_weights()[1], before[1])


@pytest.mark.slow
def test_apply_gradients_on_one_device_outside_any_scope_still_works():
    # TF: outside every scope the default replica context applies them.
    model, optimizer = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    optimizer.apply_gradients(zip(_grads(model), model.trainable_variables, strict=True))
    assert optimizer.iterations == 1
    assert [w.shape for w in model.get_weights()] == [(3, 1), (1,)]  # kernel, bias


@pytest.mark.slow
def test_ema_in_a_custom_loop_finalizes_to_the_average():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(3,), seed=0)
    optimizer = jstrategy.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
    first = None
    for i in range(3):
        grads = [jnp.full_like(v, i + 1.0) for v in model.trainable_variables]
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first is None:
            first = model.get_weights()
    last = model.get_weights()
    optimizer.finalize_variable_values(model.trainable_variables)
    final = model.get_weights()
    assert not np.allclose(final[1], last[1])
    # average after 3 steps: 0.25 * w1 + 0.25 * w2 + 0.5 * w3, with w_k = w0 - 0.1 * k(k+1)/2.
    w0 = first[1] + 0.1
    expected = 0.25 * (w0 - 0.1) + 0.25 * (w0 - 0.3) + 0.5 * (w0 - 0.6)
    np.testing.assert_allclose(final[1], expected, rtol=1e-6)


# TF habits (issue 14), finding 1: the rate set, read and logged is the rate applied
def test_a_plain_optax_optimizer_refuses_rate_control_and_shows_the_fix():
    # Before: the scheduler's 0.1 multiplied optax.sgd(0.1)'s own rate: 0.01 applied.
    model = helpers.dense_regression_model(jstrategy.OneDeviceStrategy("cpu:0"), optax.sgd(0.1))
    scheduler = jstrategy.callbacks.LearningRateScheduler(lambda epoch: 0.1)
    fix = r"jstrategy\.optimizers\.SGD\(learning_rate=0\.1\).*inject_hyperparams"
    with pytest.raises(TypeError, match=fix):
        helpers.fit_regression(model, callbacks=[scheduler])
    with pytest.raises(TypeError, match=fix):
        model.learning_rate  # noqa: B018
    with pytest.raises(TypeError, match=fix):
        model.learning_rate = 0.1
    with pytest.raises(TypeError, match=fix):
        helpers.fit_regression(
            model, callbacks=[jstrategy.callbacks.ReduceLROnPlateau(monitor="loss")]
        )


def test_the_scheduled_rate_is_the_rate_applied_and_logged():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    rates = [0.1, 0.02, 0.05]
    scheduled = helpers.dense_regression_model(
        strategy, jstrategy.optimizers.SGD(learning_rate=0.3)
    )
    history = helpers.fit_regression(
        scheduled,
        epochs=3,
        callbacks=[jstrategy.callbacks.LearningRateScheduler(lambda epoch: rates[epoch])],
    )
    assert history.history["learning_rate"] == pytest.approx(rates)
    assert scheduled.learning_rate == pytest.approx(0.05)
    # The same three epochs, each with optax's own SGD at that rate.
    for a, b in zip(scheduled.get_weights(), helpers.sgd_epochs(strategy, rates), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_names_are_keras_optimizers_with_keras_defaults():
    model = helpers.dense_regression_model(jstrategy.OneDeviceStrategy("cpu:0"), "adam")
    assert isinstance(model.optimizer, jstrategy.optimizers.Adam)
    assert model.optimizer.get_config()["epsilon"] == 1e-7
    assert model.learning_rate == pytest.approx(1e-3) == model.optimizer.learning_rate
    model.optimizer.learning_rate = 0.01  # Keras: model.optimizer.learning_rate = ...
    assert model.learning_rate == pytest.approx(0.01)
    with pytest.raises(ValueError, match="Unknown optimizer 'adamm'.*'adam'"):
        helpers.dense_regression_model(jstrategy.OneDeviceStrategy("cpu:0"), "adamm")


@pytest.mark.slow
@pytest.mark.parametrize(
    "keras, reference",
    [
        (
            jstrategy.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
            optax.sgd(0.1, momentum=0.9, nesterov=True),
        ),
        (jstrategy.optimizers.Adam(0.01), optax.adam(0.01, eps=1e-7)),
        (jstrategy.optimizers.RMSprop(0.01), optax.rmsprop(0.01, decay=0.9, eps=1e-7)),
        (jstrategy.optimizers.Adagrad(0.1), optax.adagrad(0.1, eps=1e-7)),
        (jstrategy.optimizers.Adadelta(1.0), optax.adadelta(1.0, rho=0.95, eps=1e-7)),
        (jstrategy.optimizers.Adamax(0.01), optax.adamax(0.01, eps=1e-7)),
        (jstrategy.optimizers.Lion(0.01), optax.lion(0.01, weight_decay=0.0)),
        (
            jstrategy.optimizers.AdamW(0.01),
            optax.adamw(0.01, eps=1e-7, weight_decay=0.004),
        ),
        (
            jstrategy.optimizers.SGD(0.1, global_clipnorm=0.5),
            optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)),
        ),
        (
            jstrategy.optimizers.SGD(0.1, clipvalue=0.05),
            optax.chain(optax.clip(0.05), optax.sgd(0.1)),
        ),
    ],
    ids=lambda v: type(v).__name__,
)
def test_keras_optimizers_at_a_constant_rate_agree_with_optax(keras, reference):
    # The optimizers follow Keras's formulas (tests/test_keras_optimizers.py); at a
    # constant rate these equal optax's to float tolerance (Nadam does not: Keras's has
    # Dozat's momentum schedule).
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    ours, theirs = (
        helpers.dense_regression_model(strategy, keras),
        helpers.dense_regression_model(strategy, reference),
    )
    helpers.fit_regression(ours), helpers.fit_regression(theirs)
    for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_clipnorm_clips_each_gradient_on_its_own():
    tx = jstrategy.optimizers.SGD(1.0, clipnorm=1.0).tx
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.3, 0.4])}
    params = jax.tree.map(jnp.zeros_like, grads)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["a"], [-0.6, -0.8], rtol=1e-6)  # norm 5 -> 1
    np.testing.assert_allclose(updates["b"], [-0.3, -0.4], rtol=1e-6)  # norm 0.5 kept


def test_a_schedule_sets_the_rate_from_the_step_and_cannot_be_set():
    schedule = jstrategy.optimizers.schedules.PiecewiseConstantDecay([3], [0.1, 0.01])
    model = helpers.dense_regression_model(
        jstrategy.OneDeviceStrategy("cpu:0"), jstrategy.optimizers.SGD(schedule)
    )
    assert model.learning_rate == pytest.approx(0.1)
    helpers.fit_regression(model, epochs=2)  # 6 steps
    assert model.learning_rate == pytest.approx(0.01)
    with pytest.raises(TypeError, match="schedule"):
        model.learning_rate = 0.5
    with pytest.raises(TypeError, match="schedule"):
        helpers.fit_regression(
            model, callbacks=[jstrategy.callbacks.LearningRateScheduler(lambda e: 0.1)]
        )
    # An optax schedule injected by the user is refused too, not silently overwritten.
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.constant_schedule(0.1))
    with pytest.raises(TypeError, match="schedule"):
        helpers.dense_regression_model(
            jstrategy.OneDeviceStrategy("cpu:0"), injected
        ).learning_rate = 0.5


def test_reduce_lr_on_plateau_reduces_the_applied_rate():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    model = helpers.dense_regression_model(strategy, jstrategy.optimizers.SGD(0.2))
    # No epoch after the first improves by 1e9: the rate halves after each.
    reduce = jstrategy.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=1, min_delta=1e9, min_lr=0.06
    )
    history = helpers.fit_regression(model, epochs=4, callbacks=[reduce])
    assert history.history["learning_rate"] == pytest.approx([0.2, 0.2, 0.1, 0.06])
    for a, b in zip(
        model.get_weights(), helpers.sgd_epochs(strategy, [0.2, 0.2, 0.1, 0.06]), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"`factor` must be in \(0, 1\)"):
        jstrategy.callbacks.ReduceLROnPlateau(factor=1.0)


def test_keras_optimizers_in_create_train_state():
    with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        state = training.create_train_state(
            nn.Dense(1), jstrategy.optimizers.SGD(0.1, momentum=0.9), jnp.ones((1, 3))
        )
        step = training.make_train_step("mse")
    x, y = helpers.regression_data(8)
    state, logs = step(state, (x, y))
    assert int(state.step) == 1 and "loss" in logs


# TF habits (issue 14), finding 2 (b): optimizer.apply_gradients inside run aggregates as TF's
def _custom_loop(strategy, *, all_reduce_first=False, steps=3):
    """TF's custom-loop train step on a Dense model; returns per-step losses and weights."""
    x, y = helpers.logits_and_labels(40, seed=3)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 40, 16)]  # 16, 16, 8 rows
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(10), input_shape=(10,), seed=0)
        optimizer = jstrategy.optimizers.SGD(0.5, momentum=0.9)
        loss_object = jstrategy.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )

    def train_step(inputs):
        features, labels = inputs

        def loss_fn(variables):
            predictions = model(features, training=True, trainable_variables=variables)
            return jstrategy.compute_average_loss(loss_object(labels, predictions))

        loss, gradients = jax.value_and_grad(loss_fn)(model.trainable_variables)
        if all_reduce_first:  # already combined: apply_gradients must not sum them again
            gradients = jstrategy.get_replica_context().all_reduce("SUM", gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    losses = []
    for _ in range(steps):
        for inputs in strategy.experimental_distribute_dataset(batches):
            per_replica = strategy.run(train_step, args=(inputs,))
            losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
    return np.array(losses), model.get_weights(), optimizer


@pytest.mark.slow
def test_apply_gradients_in_run_follows_one_device_and_counts_each_gradient_once():
    one_losses, one_weights, _ = _custom_loop(jstrategy.OneDeviceStrategy("cpu:0"))
    for strategy in (
        jstrategy.MirroredStrategy(),
        jstrategy.CentralStorageStrategy(compute_devices=[f"cpu:{i}" for i in range(4)]),
    ):
        for all_reduce_first in (False, True):
            losses, weights, optimizer = _custom_loop(strategy, all_reduce_first=all_reduce_first)
            np.testing.assert_allclose(losses, one_losses, rtol=1e-5, atol=1e-6)
            for a, b in zip(weights, one_weights, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            assert optimizer.iterations == 9 and optimizer.learning_rate == 0.5


def test_apply_gradients_errors_show_the_fix():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(3,))
        model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
    grads = {"kernel": jnp.zeros((3, 1)), "bias": jnp.zeros(1)}
    optimizer = jstrategy.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="a zip of two dicts pairs their keys"):
        optimizer.apply_gradients(zip(grads, model.state.params, strict=True))
    with pytest.raises(ValueError, match="must be a model's trainable_variables"):
        optimizer.apply_gradients(zip(jax.tree.leaves(grads), jax.tree.leaves(grads), strict=True))
    with pytest.raises(ValueError, match="compiled into a model"):
        model.optimizer.apply_gradients(
            zip(jax.tree.leaves(grads), model.trainable_variables, strict=True)
        )
    optimizer.apply_gradients(zip(jax.tree.leaves(grads), model.trainable_variables, strict=True))
    assert optimizer.iterations == 1

    def step(x):
        return model(x)

    with pytest.raises(RuntimeError, match="TF's @tf.function is not needed"):
        jax.jit(lambda x: strategy.run(step, args=(x,)))(np.ones((2, 3), np.float32))
