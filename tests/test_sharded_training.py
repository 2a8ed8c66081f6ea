"""Sharded strategies through the whole training layer: `jstrategy.Model` under FSDP and a
ModelParallel layout map follows OneDeviceStrategy (issue 12 item 4), checkpoints hand a
train state over between every kind of strategy (item 5).

The step-level parity suite (`make_train_step`, linen and NNX, BatchNorm) runs these
strategies in tests/test_train_step.py; the compiled collectives are checked in
tests/test_sharded.py.
"""

import functools

import flax.linen as nn
import helpers
import jax
import numpy as np
import optax
import pytest

import jstrategy
from conftest import STRATEGIES
from jstrategy import losses
from jstrategy._src.names import path_names
from jstrategy.callbacks import ModelCheckpoint

FEATURES = 6
SHARDED = ["fsdp_8", "model_parallel_2x4"]


def _data(rows=50, seed=0):
    return helpers.classification_data(rows, FEATURES, seed)


class MLP(nn.Module):
    """Two dense layers whose kernels every sharded strategy here splits."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        hidden = nn.relu(nn.Dense(16)(x))  # Dense_0
        return nn.Dense(3)(hidden)


class Net(nn.Module):
    """Dense, BatchNorm over the strategy's data axis, Dropout, Dense."""

    axis_name: str
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16, use_bias=False)(x)  # a bias before BatchNorm only adds noise
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
        x = nn.Dropout(self.dropout, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


def _model(strategy, *, module=None, optimizer=None, spe=1):
    with strategy.scope():
        model = jstrategy.Model(module or MLP(), input_shape=(FEATURES,), seed=0)
        model.compile(
            optimizer or optax.adam(0.01),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=spe,
        )
    return model


def _close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0)


def _assert_kept(state, strategy):
    """Every leaf where `strategy.variable_sharding` keeps it, and some really split."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    for keypath, leaf in flat:
        want = strategy.variable_sharding(leaf, path_names(keypath))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (keypath, leaf.sharding, want)
    assert any(not leaf.sharding.is_fully_replicated for _, leaf in flat)


@functools.cache
def _one_device_run():
    """OneDevice's weights, history, evaluation and predictions: the oracle, run once."""
    x, y = _data()
    model = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    history = model.fit(x, y, batch_size=7, epochs=2, verbose=0).history
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0)
    return model.get_weights(), history, evaluation, model.predict(x, batch_size=16, verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDED)
def test_model_fit_evaluate_predict_follow_one_device(name):
    # 50 rows in batches of 7: 7 full steps (padded to 8 rows for 8 replicas) and a
    # partial one; 3 steps per execution fuse them into scans, with one-step remainders.
    strategy = STRATEGIES[name]()
    weights, history, evaluation, predictions = _one_device_run()
    x, y = _data()
    model = _model(strategy, spe=3)
    got = model.fit(x, y, batch_size=7, epochs=2, verbose=0).history
    _assert_kept(model.state, strategy)
    assert model._trainer.programs.train_keys() == [(0, True), (3, True)]
    _close(model.get_weights(), weights)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], history[key], atol=1e-5)
    assert history["loss"][1] < history["loss"][0]
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=16, verbose=0), evaluation, atol=1e-5
    )
    np.testing.assert_allclose(model.predict(x, batch_size=16, verbose=0), predictions, atol=1e-5)
    _assert_kept(model.state, strategy)  # evaluation and prediction only read the state


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDED)
def test_fit_on_a_distributed_dataset_with_a_padded_partial_batch(name):
    strategy = STRATEGIES[name]()
    x, y = _data(35)
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 35, 10)]  # 10, 10, 10, 5
    one = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    one.fit(batches, epochs=2, verbose=0)
    model = _model(strategy)
    model.fit(strategy.experimental_distribute_dataset(batches), epochs=2, verbose=0)
    _close(model.get_weights(), one.get_weights())


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDED)
def test_batch_norm_and_dropout_train_as_mirrored_with_as_many_replicas(name):
    # BatchNorm + Adam is compared like with like: against OneDevice, Adam turns the float
    # noise of BatchNorm's (scale-invariant) kernel directions into O(lr) steps for every
    # multi-replica strategy, Mirrored too. With as many replicas, each replica sees the
    # same rows, the same dropout key (the step's key folded with its replica id) and
    # synchronizes BatchNorm over the data axis; only where sums land differs.
    strategy = STRATEGIES[name]()
    n = strategy.num_replicas_in_sync
    mirrored = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
    x, y = _data(48)
    runs = []
    for s in (mirrored, strategy):
        model = _model(s, module=Net(s.axis_name, dropout=0.3))
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0).history
        runs.append((model.get_weights(), history["loss"]))
    (expected, expected_loss), (got, loss) = runs
    _close(got, expected, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-6)
    assert loss[-1] < loss[0]


def test_summary_shows_each_variables_layout():
    strategy = STRATEGIES["model_parallel_2x4"]()
    model = _model(strategy)
    lines: list[str] = []
    model.summary(print_fn=lines.append)
    (table,) = lines
    assert "Variable layouts over mesh {'batch': 2, 'model': 4}:" in table
    rows = {line.split()[0]: line.split(maxsplit=1)[1] for line in table.splitlines()[-6:-1]}
    assert rows["params/Dense_0/kernel"].split() == [
        "(6,",
        "16)",
        "P(None,",
        "'model')",
        "(6,",
        "4)",
    ]
    assert rows["params/Dense_1/kernel"].split()[2:4] == ["P('model',", "None)"]
    assert rows["params/Dense_0/bias"].split() == ["(16,)", "replicated", "(16,)"]
    # Replicated strategies' summaries are Keras's table only.
    replicated: list[str] = []
    _model(jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])).summary(replicated.append)
    assert "Variable layouts" not in replicated[0]
    assert table.startswith(replicated[0].rsplit("\n", 1)[0])


# Checkpoints across strategies -----------------------------------------------------------
def _strategies_in_turn():
    return [
        ("mirrored", jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])),
        ("fsdp", STRATEGIES["fsdp_8"]()),
        ("model_parallel", STRATEGIES["model_parallel_2x4"]()),
        ("one_device", jstrategy.OneDeviceStrategy("cpu:0")),
    ]


def _train_state_values(model):
    state = jax.device_get((model.state.params, model.state.opt_state, model.state.step))
    return [np.asarray(v) for v in jax.tree.leaves(state)]


@pytest.mark.slow
def test_a_train_state_hands_over_between_every_kind_of_strategy(tmp_path):
    # One epoch under each strategy in turn, each restoring the previous one's checkpoint
    # (parameters, Adam's moments and step count): the same run as one OneDevice fit.
    x, y = _data(40)
    expected = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    expected.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    previous = None
    for i, (name, strategy) in enumerate(_strategies_in_turn()):
        model = _model(strategy)
        if previous is not None:
            model.restore_checkpoint(tmp_path / previous[0])
            # Restored straight into this strategy's layout, equal to what was saved.
            _assert_placed(model.state, strategy)
            _close(_train_state_values(model), previous[1], atol=0)
        if i == 3:
            break
        model.fit(
            x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
            callbacks=[ModelCheckpoint(str(tmp_path / name), save_weights_only=False)],
        )  # fmt: skip
        previous = (name, _train_state_values(model))
    _close(model.get_weights(), expected.get_weights())


def _assert_placed(state, strategy):
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        want = strategy.variable_sharding(leaf, path_names(keypath))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (keypath, leaf.sharding, want)
