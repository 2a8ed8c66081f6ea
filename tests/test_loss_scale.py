"""float16 that never trains: steps skipped with the loss scale at its floor warn, and raise
under `enable_check_numerics` (issue 21, finding 6)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import mixed_precision as mp
from jstrategy import training

ROWS, BATCH = 160, 8  # 20 steps an epoch


@pytest.fixture(autouse=True)
def _check_numerics_off():
    yield
    jstrategy.config.disable_check_numerics()


def _overflowing_data():
    """Gradients of about 3e6 per kernel entry: above float16's 65504 even at scale 1,
    while the loss itself (about 9e8, computed in float32) is finite."""
    x = np.full((ROWS, 4), 300.0, np.float32)
    return x, np.full((ROWS, 1), 3e4, np.float32)


def _model(strategy):
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(4,), seed=0, dtype_policy="mixed_float16")
        model.compile(optax.sgd(1e-3), loss="mse")
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_device", "mirrored_4", "central_storage_8", "fsdp_8"])
def test_every_step_skipped_at_the_floor_warns_once(name):
    from conftest import STRATEGIES

    model = _model(STRATEGIES[name]())
    before = model.get_weights()
    x, y = _overflowing_data()
    # 2**15 halves to the floor (1) in 15 skipped steps; steps 15 to 19 of epoch 0 are
    # skipped at the floor, then every step of epochs 1 and 2: 60 of 60 skipped in all.
    with pytest.warns(
        mp.LossScaleFloorWarning,
        match=r"5 of the 20 training steps of epoch 0 were skipped.*loss scale at its "
        r"floor \(min_loss_scale=1\.0\).*mixed_bfloat16.*do not overflow float16",
    ) as record:
        history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False)
    assert len([w for w in record if w.category is mp.LossScaleFloorWarning]) == 1
    assert record[0].filename == __file__  # it points at the fit call
    assert issubclass(mp.LossScaleFloorWarning, RuntimeWarning)
    assert int(model.state.step) == 0 and model.loss_scale == 1.0
    assert len(set(history.history["loss"])) == 1  # the same finite loss every epoch
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_check_numerics_raises_at_the_first_step_skipped_at_the_floor():
    jstrategy.config.enable_check_numerics()
    model = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    x, y = _overflowing_data()
    with pytest.raises(
        FloatingPointError,
        match=r"Check numerics: the gradients overflow float16 even at the loss scale's "
        r"floor.*training step 15 of epoch 0.*mixed_bfloat16",
    ):
        model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False)


@pytest.mark.slow
def test_check_numerics_raises_in_a_custom_loop_too():
    jstrategy.config.enable_check_numerics()
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _overflowing_data()
    with strategy.scope():
        state = training.create_train_state(
            nn.Dense(1), optax.sgd(1e-3), jnp.ones((1, 4)), dtype_policy="mixed_float16"
        )
        step = training.make_train_step("mse", dtype_policy="mixed_float16")
    state = state.replace(
        loss_scale=training.place_state(mp.DynamicLossScale.create(initial_scale=2.0), strategy)
    )
    state, logs = step(state, (x[:4], y[:4]))  # at 2: skipped, halved to the floor
    assert sorted(logs) == ["loss"]
    with pytest.raises(FloatingPointError, match=r"floor.*call number 2 of this train step"):
        for _ in range(4):  # the error comes once the step's outputs are ready
            state, logs = step(state, (x[:4], y[:4]))
            jax.block_until_ready(logs)


@pytest.mark.slow
def test_a_scale_that_recovers_does_not_warn():
    # Overflows at 2**15 and 2**14, not below: the scale never reaches its floor.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    x[6:8] *= 8.0
    y = np.zeros((16, 2), np.float32)
    with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = jstrategy.Model(nn.Dense(2), input_shape=(4,), dtype_policy="mixed_float16")
        model.compile(optax.sgd(1e-3), loss="mse")
    model.fit(x, y, batch_size=16, epochs=4, verbose=0)  # filterwarnings=error
    assert model.loss_scale == 2.0**13 and int(model.state.step) == 2
