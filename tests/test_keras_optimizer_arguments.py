"""Keras 3's optimizer argument rules, with Keras's messages; TF's cross-replica error for
`apply_gradients` outside `Strategy.run`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstrategy


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
    assert jax.tree.leaves(model.get_weights())[0].shape == (1,)


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
