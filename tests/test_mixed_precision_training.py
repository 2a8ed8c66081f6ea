"""Precision policies and dynamic loss scaling through the train step, `Model` and strategies."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jstrategy
from jstrategy import mixed_precision as mp
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch
from jstrategy.coordinator import local_cluster_resolver

STEPS = 8
ROWS = 16  # divides among 1, 2, 4 and 8 replicas
FEATURES = 5
# What bfloat16's 8-bit mantissa moves after STEPS steps of this model (measured: 0.004
# between float32 and mixed_bfloat16, 0.0013 between two strategies under mixed_bfloat16,
# where each replica rounds its partial weight gradient to bfloat16 before the all-reduce).
BF16_VS_F32 = 1e-2
BF16_ACROSS_STRATEGIES = 2.5e-3


@pytest.fixture(autouse=True)
def _restore_global_policy():
    yield
    mp.set_global_policy(None)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(8)(x))  # Dense_0 then Dense_1, as the model-parallel layout
        return nn.Dense(3)(h)


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.dense1 = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.dense2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense2(nnx.relu(self.dense1(x)))


def _data(steps=STEPS, rows=ROWS):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, rows, FEATURES)).astype(np.float32)
    return x, np.argmax(x[..., :3], axis=-1).astype(np.int32)


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _tx():
    return optax.sgd(0.1, momentum=0.9)


def _linen_state(policy):
    return training.create_train_state(Mlp(), _tx(), jnp.ones((1, FEATURES)), dtype_policy=policy)


def _nnx_state(policy):
    return training.create_nnx_train_state(NnxMlp(nnx.Rngs(0)), _tx(), dtype_policy=policy)


def _float_dtypes(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def _dot_dtypes(hlo):
    """The result dtypes of the program's matrix multiplications."""
    return set(re.findall(r"stablehlo\.dot_general.*-> tensor<[0-9x]*x(\w+)>", hlo))


def _train(strategy, policy, make_state=_linen_state, steps=STEPS):
    x, y = _data(steps)
    with strategy.scope():
        state = make_state(policy)
        step = training.make_train_step(_loss, metrics=["accuracy"], dtype_policy=policy)
    hlo = step.lower(state, distribute_batch(strategy, (x[0], y[0]))).as_text()
    losses = []
    for i in range(steps):
        state, metrics = step(state, distribute_batch(strategy, (x[i], y[i])))
        dispatch.track(metrics)
        losses.append(metrics["loss"])
    return state, [float(v) for v in jax.device_get(losses)], hlo


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@functools.cache
def _oracle(policy):
    state, losses, hlo = _train(jstrategy.OneDeviceStrategy("cpu:0"), policy)
    return _host(state.params), losses, hlo


def _assert_close(got, expected, atol):
    for a, b in zip(_host(got), expected, strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_mixed_bfloat16_under_every_strategy(strategy):
    state, losses, hlo = _train(strategy, "mixed_bfloat16")
    # Variables and optimizer state stay float32; the matrix multiplications run in bfloat16.
    assert _float_dtypes((state.params, state.opt_state)) == {"float32"}
    assert _dot_dtypes(hlo) == {"bf16"}
    assert losses[-1] < losses[0]
    expected, expected_losses, _ = _oracle("mixed_bfloat16")
    _assert_close(state.params, expected, BF16_ACROSS_STRATEGIES)
    np.testing.assert_allclose(losses, expected_losses, atol=BF16_ACROSS_STRATEGIES)
    float32, float32_losses, float32_hlo = _oracle("float32")
    _assert_close(state.params, float32, BF16_VS_F32)
    np.testing.assert_allclose(losses, float32_losses, atol=BF16_VS_F32)
    assert _dot_dtypes(float32_hlo) == {"f32"}
    # Not vacuous: bfloat16 moved the trajectory.
    assert max(np.abs(a - b).max() for a, b in zip(expected, float32, strict=True)) > 1e-4


def test_global_policy_is_the_default_and_a_step_argument_overrides_it():
    mp.set_global_policy("mixed_bfloat16")
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(1)
    with strategy.scope():
        state = training.create_train_state(Mlp(), _tx(), jnp.ones((1, FEATURES)))
        implicit = training.make_train_step(_loss)
        explicit = training.make_train_step(_loss, dtype_policy="float32")
    assert _dot_dtypes(implicit.lower(state, (x[0], y[0])).as_text()) == {"bf16"}
    assert _dot_dtypes(explicit.lower(state, (x[0], y[0])).as_text()) == {"f32"}
    with pytest.raises(ValueError, match=r"`dtype_policy` must be .*; got 'mixed_bf16'"):
        training.make_train_step(_loss, dtype_policy="mixed_bf16", strategy=strategy)


@pytest.mark.slow
def test_nnx_state_under_mixed_bfloat16():
    strategy = jstrategy.MirroredStrategy()
    state, losses, hlo = _train(strategy, "mixed_bfloat16", make_state=_nnx_state)
    assert _float_dtypes((state.params, state.opt_state)) == {"float32"}
    assert _dot_dtypes(hlo) == {"bf16"}
    float32, _, _ = _train(jstrategy.OneDeviceStrategy("cpu:0"), "float32", _nnx_state)
    _assert_close(state.params, _host(float32.params), BF16_VS_F32)
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("make_state", [_linen_state, _nnx_state], ids=["linen", "nnx"])
def test_bfloat16_policy_keeps_variables_and_optimizer_state_in_bfloat16(make_state):
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    module_before = NnxMlp(nnx.Rngs(0))
    with strategy.scope():
        state = make_state("bfloat16")
        if make_state is _nnx_state:  # the module given is not changed
            nnx_state = training.create_nnx_train_state(
                module_before, nnx.Optimizer(module_before, _tx(), wrt=nnx.Param),
                dtype_policy="bfloat16",
            )  # fmt: skip
            assert module_before.dense1.kernel[...].dtype == jnp.float32
            assert _float_dtypes(nnx_state.params) == {"bfloat16"}
    assert _float_dtypes((state.params, state.opt_state)) == {"bfloat16"}
    state, losses, hlo = _train(strategy, "bfloat16", make_state=make_state, steps=3)
    assert _float_dtypes((state.params, state.opt_state)) == {"bfloat16"}
    assert _dot_dtypes(hlo) == {"bf16"} and np.isfinite(losses).all()


@pytest.mark.slow
def test_eval_and_predict_run_in_the_compute_dtype_and_return_float32():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(1)
    with strategy.scope():
        state = _linen_state("mixed_bfloat16")
        evaluate = {p: training.make_eval_step(_loss, dtype_policy=p) for p in ("float32", "mixed_bfloat16")}  # fmt: skip
        predict = {p: training.make_predict_step(dtype_policy=p) for p in ("float32", "mixed_bfloat16")}  # fmt: skip
    out = {p: np.asarray(predict[p](state, x[0]).value) for p in predict}
    assert out["mixed_bfloat16"].dtype == np.float32
    # Computed in bfloat16 (visibly rounded), close to float32 within its precision.
    assert 0 < np.abs(out["mixed_bfloat16"] - out["float32"]).max() < 0.05
    loss = {p: float(evaluate[p](state, (x[0], y[0]))["loss"]) for p in evaluate}
    assert loss["mixed_bfloat16"] != loss["float32"]
    np.testing.assert_allclose(loss["mixed_bfloat16"], loss["float32"], rtol=1e-2)


# ---------------------------------------------------------------------------------------
# Dynamic loss scaling (mixed_float16)
# ---------------------------------------------------------------------------------------
def _overflow_batch():
    """A batch whose replica 3 (rows 6-7 of 16 over 8 replicas) overflows float16 at a loss
    scale of 2**15 and 2**14 but not 2**13; the other replicas' rows do not overflow."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    x[6:8] *= 8.0
    return x, np.zeros((ROWS, 2), np.float32)


def _replica_copies(tree):
    """Each leaf's copies on the devices, as host arrays."""
    return [[np.asarray(s.data) for s in leaf.addressable_shards] for leaf in jax.tree.leaves(tree)]


def _assert_replicas_agree(state):
    for copies in _replica_copies((state.params, state.opt_state, state.loss_scale)):
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])


@pytest.mark.parametrize("name", ["mirrored_8", "central_storage_8", "fsdp_8"])
def _overflow_trace(strategy, x, y):
    """``(loss scale, step, changed)`` after each of 6 steps from a fresh float16 state."""
    with strategy.scope():
        state = training.create_train_state(
            nn.Dense(2), optax.sgd(1e-3, momentum=0.9), jnp.ones((1, 4)),
            dtype_policy="mixed_float16",
        )  # fmt: skip
        step = training.make_train_step("mse", dtype_policy="mixed_float16")
    assert float(state.loss_scale.loss_scale) == 2.0**15  # Keras's LossScaleOptimizer
    # Double after 2 finite steps instead of 2000, to see it in a short run.
    state = state.replace(
        loss_scale=training.place_state(
            mp.DynamicLossScale.create(dynamic_growth_steps=2), strategy
        )
    )
    assert _dot_dtypes(step.lower(state, (x, y)).as_text()) == {"f16"}
    trace = []
    for _ in range(6):
        before = _host((state.params, state.opt_state))
        state, _ = step(state, (x, y))
        _assert_replicas_agree(state)
        after = _host((state.params, state.opt_state))
        changed = any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))
        trace.append((float(state.loss_scale.loss_scale), int(state.step), changed))
    return state, step, trace


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mirrored_8", "central_storage_8", "fsdp_8"])
def test_float16_overflow_skips_the_step_on_every_replica_and_halves_the_scale(name):
    from conftest import STRATEGIES

    strategy = STRATEGIES[name]()
    x, y = _overflow_batch()
    state, step, trace = _overflow_trace(strategy, x, y)
    if name == "fsdp_8":
        # FSDP's step is in the global view: the kernel's gradient is one float16
        # contraction over the whole batch, as on one device (where the sum of every
        # replica's rows overflows at 2**13 too), not per-replica float16 sums added in
        # float32. It follows OneDevice, skip for skip.
        one_device = jstrategy.OneDeviceStrategy("cpu:0")
        assert trace == _overflow_trace(one_device, x, y)[2]
        assert [changed for _, _, changed in trace][:2] == [False, False]
        assert trace[-1][1] >= 1  # it does update once the scale is low enough
    else:
        # Skip (halve), skip (halve), update, update (2 finite steps: double), skip, update.
        assert trace == [
            (2.0**14, 0, False),
            (2.0**13, 0, False),
            (2.0**13, 1, True),
            (2.0**14, 2, True),
            (2.0**13, 2, False),
            (2.0**13, 3, True),
        ]
    assert _float_dtypes((state.params, state.opt_state)) == {"float32"}
    # One replica's rows caused it: without them, the first step at 2**15 is finite.
    tame = x.copy()
    tame[6:8] /= 8.0
    with strategy.scope():
        fresh = training.create_train_state(
            nn.Dense(2), optax.sgd(1e-3), jnp.ones((1, 4)), dtype_policy="mixed_float16"
        )
    fresh, _ = step(fresh, (tame, y))
    assert (int(fresh.step), float(fresh.loss_scale.loss_scale)) == (1, 2.0**15)


def test_float16_step_adds_a_loss_scale_to_a_state_without_one():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _overflow_batch()
    with strategy.scope():
        state = training.create_train_state(nn.Dense(2), optax.sgd(1e-3), jnp.ones((1, 4)))
        step = training.make_train_step("mse", dtype_policy="mixed_float16")
    assert state.loss_scale is None
    assert float(step.prepare_state(state).loss_scale.loss_scale) == 2.0**15
    state, metrics = step(state, (x[:4], y[:4]))
    assert float(state.loss_scale.loss_scale) == 2.0**15 and int(state.loss_scale.counter) == 1
    assert np.isfinite(float(metrics["loss"]))


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------
def _model_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, FEATURES)).astype(np.float32)
    return x, np.argmax(x[:, :3], axis=-1).astype(np.int32)


def _fit_model(strategy, policy, **fit):
    with strategy.scope():
        model = jstrategy.Model(Mlp(), input_shape=(FEATURES,), seed=3, dtype_policy=policy)
        model.compile(_tx(), loss=_loss, metrics=["accuracy"])
    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, **fit}
    history = model.fit(*_model_data(), verbose=0, **fit)
    return model, history.history["loss"]


def test_model_dtype_policy_and_loss_scale():
    strategy = jstrategy.MirroredStrategy()
    x, _ = _model_data()
    model, losses = _fit_model(strategy, "mixed_float16")
    assert model.dtype_policy == mp.Policy("mixed_float16")
    assert model.loss_scale == 2.0**15  # no overflow on this data
    assert int(model.state.loss_scale.counter) == int(model.state.step) == 6
    assert {w.dtype for w in model.get_weights()} == {np.dtype("float32")}
    assert model.predict(x, verbose=0).dtype == np.float32
    reference, reference_losses = _fit_model(jstrategy.OneDeviceStrategy("cpu:0"), "float32")
    assert reference.dtype_policy.name == "float32" and reference.loss_scale is None
    # float16 has 11 bits of mantissa: closer to float32 than bfloat16.
    np.testing.assert_allclose(losses, reference_losses, atol=2e-3)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3)
    # The global policy is read when the model is created.
    mp.set_global_policy("mixed_bfloat16")
    with strategy.scope():
        assert jstrategy.Model(Mlp(), input_shape=(FEATURES,)).dtype_policy.name == "mixed_bfloat16"


@pytest.mark.slow
def test_parameter_server_fit_under_mixed_bfloat16_and_what_it_refuses(shut_down_coordinators):
    ps = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1, num_ps=2))
    shut_down_coordinators(ps)
    model, losses = _fit_model(ps, "mixed_bfloat16", steps_per_epoch=3)
    # One worker runs the steps in order: OneDevice's mixed_bfloat16 trajectory.
    oracle, oracle_losses = _fit_model(jstrategy.OneDeviceStrategy("cpu:0"), "mixed_bfloat16")
    np.testing.assert_allclose(losses, oracle_losses, rtol=1e-5)
    for a, b in zip(model.get_weights(), oracle.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert {w.dtype for w in model.get_weights()} == {np.dtype("float32")}
    with pytest.raises(ValueError, match="ParameterServerStrategy has no dynamic loss scaling"):
        _fit_model(ps, "mixed_float16", steps_per_epoch=3)
    with ps.scope():
        model = jstrategy.Model(Mlp(), input_shape=(FEATURES,))
        model.compile(_tx(), loss="mse", gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="takes gradient_accumulation_steps=1; got 2"):
        model.fit(*_model_data(), batch_size=16, steps_per_epoch=2, verbose=0)
