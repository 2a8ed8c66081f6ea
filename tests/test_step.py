"""One step body behind every path, the strategy hooks it plugs into, and bounded dispatch."""

import dataclasses
import functools

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jstrategy
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.training.fit_runner import FitRunner
from jstrategy.coordinator import local_cluster_resolver

FEATURES = 5
ROWS = 16


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def _batch(seed=0, rows=ROWS):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    return x, np.argmax(x[:, :3], axis=-1).astype(np.int32)


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _params(tree):
    return jax.device_get(tree)


def _delta(before, after):
    # SGD with rate 1 and no momentum: the update is minus the gradient.
    return jax.tree.map(lambda b, a: np.asarray(b) - np.asarray(a), before, after)


def _assert_trees(a, b, **tolerance):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if tolerance:
            np.testing.assert_allclose(u, v, **tolerance)
        else:
            np.testing.assert_array_equal(u, v)


def _factory_gradient(strategy, x, y):
    with strategy.scope():
        state = training.create_train_state(Mlp(), optax.sgd(1.0), jnp.ones((1, FEATURES)), rng=0)
        step = training.make_train_step(_loss)
        evaluate = training.make_eval_step(_loss)
    before = _params(state.params)
    eval_loss = float(evaluate(state, (x, y))["loss"])
    state, logs = step(state, distribute_batch(strategy, (x, y)))
    return _delta(before, _params(state.params)), float(logs["loss"]), eval_loss


def _model(strategy, spe=1):
    with strategy.scope():
        model = jstrategy.Model(Mlp(), input_shape=(FEATURES,), seed=0)
        model.compile(optax.sgd(1.0), loss=_loss, steps_per_execution=spe)
    return model


def _fit_gradient(model, *fit_args, **fit_kwargs):
    before = _params(model.variables["params"])
    model.fit(*fit_args, epochs=1, verbose=0, **fit_kwargs)
    return _delta(before, _params(model.variables["params"]))


@pytest.mark.slow
def test_one_batch_gives_one_gradient_through_every_path(shut_down_coordinators):
    x, y = _batch()
    # The oracle: the gradient of the mean loss, by hand.
    init = Mlp().init(jax.random.split(jax.random.key(0))[0], jnp.ones((1, FEATURES)))

    def mean_loss(params):
        return jnp.mean(_loss(y, Mlp().apply({"params": params}, x)))

    oracle_loss, oracle = jax.value_and_grad(mean_loss)(init["params"])

    mirrored = jstrategy.MirroredStrategy()
    grads = {
        "make_train_step, OneDevice": _factory_gradient(jstrategy.OneDeviceStrategy("cpu:0"), x, y),
        "make_train_step, Mirrored": _factory_gradient(mirrored, x, y),
        "make_train_step, CentralStorage (host update)": _factory_gradient(
            jstrategy.CentralStorageStrategy(), x, y
        ),
    }
    for name, (grad, train_loss, eval_loss) in grads.items():
        _assert_trees(grad, oracle, atol=2e-6, rtol=0, err_msg=name)
        # Evaluation computes the same loss as the step, before its update.
        np.testing.assert_allclose(train_loss, oracle_loss, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(eval_loss, train_loss, rtol=1e-6, err_msg=name)

    # Model.fit under the same strategy: bit for bit the factory's gradient, one step per
    # program or inside the scan of several (the second batch is all padding: no update).
    factory_grad = grads["make_train_step, Mirrored"][0]
    fit_1 = _fit_gradient(_model(mirrored), x, y, batch_size=ROWS, shuffle=False)
    _assert_trees(fit_1, factory_grad)
    padded = mirrored.experimental_distribute_dataset([(x, y), (x[:0], y[:0])])
    scan = _model(mirrored, spe=2)
    fit_2 = _fit_gradient(scan, padded)
    assert scan._trainer.programs.train_keys() == [(2, False)]
    _assert_trees(fit_2, factory_grad)

    # ParameterServer fit: the same body on a worker, the update on the parameter servers.
    ps = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1, num_ps=2))
    shut_down_coordinators(ps)
    ps_grad = _fit_gradient(_model(ps), x, y, batch_size=ROWS, steps_per_epoch=1, shuffle=False)
    _assert_trees(ps_grad, oracle, atol=2e-6, rtol=0)


class _Recording(jstrategy.MirroredStrategy):
    """Mirrored, recording which hooks the training layer calls."""

    def __init__(self):
        super().__init__(devices=["cpu:0", "cpu:1"])
        self.calls = []

    def stage_train_step(self, fns, *, steps=0, stacked=True):
        self.calls.append(("stage_train_step", steps, stacked))
        return super().stage_train_step(fns, steps=steps, stacked=stacked)

    def read_on_replicas(self, tree):
        self.calls.append(("read_on_replicas",))
        return super().read_on_replicas(tree)


def test_training_plugs_into_the_strategy_hooks():
    strategy = _Recording()
    x, y = _batch(rows=14)
    model = _model(strategy, spe=3)
    # Each epoch runs through the fit runner the model's trainer owns (the default one).
    runner = model._trainer.fit_runner
    assert type(runner) is FitRunner
    run_epoch = runner.run_epoch

    def recording_run_epoch(epoch):
        strategy.calls.append(("run_fit_epoch", epoch.trainer.epochs_run))
        return run_epoch(epoch)

    runner.run_epoch = recording_run_epoch
    model.fit(np.tile(x, (4, 1)), np.tile(y, 4), batch_size=8, epochs=2, verbose=0)
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    calls = strategy.calls
    # 56 rows in batches of 8: two fused executions of 3 steps and one single step.
    assert ("stage_train_step", 3, True) in calls and ("stage_train_step", 0, True) in calls
    assert [c for c in calls if c[0] == "run_fit_epoch"] == [
        ("run_fit_epoch", 0),
        ("run_fit_epoch", 1),
    ]
    assert ("read_on_replicas",) in calls
    strategy.calls.clear()
    with strategy.scope():
        training.make_train_step(_loss)
    assert strategy.calls == [("stage_train_step", 0, True)]


def test_each_epoch_takes_the_state_by_value_and_returns_the_new_state_and_sums():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _batch(rows=16)
    model = _model(strategy)
    runner = model._trainer.fit_runner
    run_epoch = runner.run_epoch
    epochs = []

    def recording_run_epoch(epoch):
        result = run_epoch(epoch)
        epochs.append((epoch, result))
        return result

    runner.run_epoch = recording_run_epoch
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    (first, first_result), (second, second_result) = epochs
    # An epoch is a value: it cannot be changed once handed to the runner.
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.state = None
    # Each epoch starts from the state the previous one returned, and the model ends
    # with the last one's.
    assert second.state is first_result.state
    assert model.state is second_result.state
    # The returned sums are the epoch's: their mean loss is the epoch's logged loss.
    for result, loss in zip((first_result, second_result), history.history["loss"], strict=True):
        sums = jax.device_get(result.sums)
        assert result.logs["loss"] == pytest.approx(loss)
        assert float(sums["loss"]) / float(sums["count"]) == pytest.approx(loss, rel=1e-6)


def test_steps_bound_their_own_dispatches():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _batch()
    with strategy.scope():
        state = training.create_train_state(Mlp(), optax.sgd(0.1), jnp.ones((1, FEATURES)))
        steps = {
            "train": training.make_train_step(_loss),
            "eval": training.make_eval_step(_loss),
            "predict": training.make_predict_step(),
        }
    limiter = dispatch.get_limiter()
    for name, step in steps.items():
        limiter.wait_all()
        for _ in range(3):
            if name == "train":
                state, _ = step(state, (x, y))
            elif name == "eval":
                step(state, (x, y))
            else:
                step(state, x)
        assert limiter.in_flight == 3, name
    # A long plain loop stays bounded.
    for _ in range(3 * dispatch.DEFAULT_MAX_IN_FLIGHT):
        state, _ = steps["train"](state, (x, y))
    assert limiter.in_flight <= dispatch.DEFAULT_MAX_IN_FLIGHT


# Dense, BatchNorm, dropout, Dense: statistics and random streams in the model state.
NnxNet = functools.partial(helpers.NnxNet, features=FEATURES, batch_norm={}, dropout=0.2)


def _nnx_fit(strategy, x, y, **fit_kwargs):
    module = NnxNet(nnx.Rngs(3))
    with strategy.scope():
        model = jstrategy.Model(module, seed=1)
        # SGD: Adam would blow the rounding noise of the bias before BatchNorm (gradient
        # about 0) up to full steps.
        model.compile(optax.sgd(0.1, momentum=0.9), loss=_loss)
    history = model.fit(x, y, batch_size=ROWS, epochs=3, verbose=0, **fit_kwargs)
    return model, module, history.history["loss"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_nnx_model_trains_under_parameter_server_fit(shut_down_coordinators):
    x, y = _batch(seed=1, rows=4 * ROWS)
    # One worker runs the scheduled steps in order: the one-device trajectory.
    ps = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1, num_ps=2))
    shut_down_coordinators(ps)
    model, module, losses = _nnx_fit(ps, x, y, steps_per_epoch=4)
    oracle, _, oracle_losses = _nnx_fit(jstrategy.OneDeviceStrategy("cpu:0"), x, y)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, oracle_losses, rtol=1e-5)
    _assert_trees(model.get_weights(), oracle.get_weights(), atol=1e-5, rtol=0)
    assert int(model.state.step) == 12
    # The statistics and random streams (keys and counts) advanced on the workers as they
    # do in one process, and fit wrote the trained variables back into the module.
    for got, want in zip(
        jax.tree.leaves(model.state.model_state),
        jax.tree.leaves(oracle.state.model_state),
        strict=True,
    ):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(
        np.asarray(module.dense1.kernel[...]),
        np.asarray(model.state.params["dense1"]["kernel"][...]),
    )


def test_backup_and_restore_asks_the_strategy_whether_fit_resumes_exactly(tmp_path):
    ps = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=1, num_ps=1))
    assert ps.should_use_with_coordinator
    assert not jstrategy.MirroredStrategy().should_use_with_coordinator
    assert not _model(ps)._trainer.fit_runner.resumes_exactly
    assert _model(jstrategy.MirroredStrategy())._trainer.fit_runner.resumes_exactly
    x, y = _batch()
    backup = jstrategy.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    with pytest.raises(ValueError, match="save_freq='epoch'"):
        _model(ps).fit(x, y, steps_per_epoch=1, verbose=0, callbacks=[backup])
