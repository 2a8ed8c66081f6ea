"""Gradient accumulation: k micro-batches give the update of one k-times-larger batch."""

import functools
import itertools

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
from jstrategy.callbacks import BackupAndRestore
from jstrategy.callbacks import LambdaCallback

FEATURES = 5
MICRO = 16  # rows per micro-batch: divides among 1, 2, 4 and 8 replicas
K = 4
UPDATES = 2
PARITY = 1e-5  # the bar: float32 rounding of sums taken in another order


class Mlp(nn.Module):
    """No BatchNorm: the update depends on the batch only through its mean gradient."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))
        return nn.Dense(3)(h)


def _data(rows, seed=0):
    return helpers.classification_data(rows, FEATURES, seed)


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _tx():
    return optax.adamw(1e-2)


def _state(policy=None):
    return training.create_train_state(Mlp(), _tx(), jnp.ones((1, FEATURES)), dtype_policy=policy)


def _host(tree):
    def raw(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(jax.tree.map(raw, tree)))]


def _assert_trees(a, b, atol=0.0):
    for u, v in zip(_host(a), _host(b), strict=True):
        if atol:
            np.testing.assert_allclose(u, v, atol=atol, rtol=0)
        else:
            np.testing.assert_array_equal(u, v)


def _adam_count(state):
    """Adam's count of updates, wherever it is in the optimizer state."""
    (count,) = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
        if getattr(path[-1], "name", None) == "count"
    ]
    return int(count)


def _run(strategy, batches, k, state=None, step=None):
    """Trains on `batches` (global or distributed) with `k` micro-batches per update."""
    with strategy.scope():
        state = _state() if state is None else state
        step = step or training.make_train_step(_loss, gradient_accumulation_steps=k)
    for batch in batches:
        state, metrics = step(state, batch)
        dispatch.track(metrics)
    return state


@functools.cache
def _oracle():
    """One-device updates on batches k times larger."""
    x, y = _data(K * MICRO * UPDATES)
    big = K * MICRO
    batches = [(x[i * big : (i + 1) * big], y[i * big : (i + 1) * big]) for i in range(UPDATES)]
    return _host(_run(jstrategy.OneDeviceStrategy("cpu:0"), batches, 1).params)


@pytest.mark.slow
def test_k_micro_batches_give_the_update_of_one_larger_batch_under_every_strategy(strategy):
    x, y = _data(K * MICRO * UPDATES)
    micro = [(x[i * MICRO : (i + 1) * MICRO], y[i * MICRO : (i + 1) * MICRO]) for i in range(8)]
    with strategy.scope():
        initial = _state()
        step = training.make_train_step(_loss, gradient_accumulation_steps=K)
    before = _host(initial.params)
    # Within a cycle the parameters do not move; the sums and counts grow.
    state = _run(strategy, micro[: K - 1], K, initial, step)
    _assert_trees(state.params, before)
    acc = state.grad_accumulator
    assert (int(acc.micro_steps), float(acc.count), int(state.step)) == (K - 1, (K - 1) * MICRO, 3)
    assert _adam_count(state) == 0
    state = _run(strategy, micro[K - 1 :], K, state, step)
    for got, want in zip(_host(state.params), _oracle(), strict=True):
        np.testing.assert_allclose(got, want, atol=PARITY, rtol=0)
    # state.step counts micro-batches (Keras's optimizer.iterations); the optimizer, updates.
    assert (int(state.step), _adam_count(state)) == (K * UPDATES, UPDATES)
    assert int(state.grad_accumulator.micro_steps) == 0
    assert float(state.grad_accumulator.count) == 0.0


@pytest.mark.slow
def test_padded_micro_batches_weigh_by_their_real_rows():
    strategy = jstrategy.MirroredStrategy()
    rows = [16, 16, 16, 5]  # the last micro-batch is padded to 16 rows
    x, y = _data(sum(rows))
    cuts = np.cumsum([0, *rows])
    micro = [
        distribute_batch(strategy, (x[a:b], y[a:b]), global_batch_size=MICRO)
        for a, b in itertools.pairwise(cuts)
    ]
    state = _run(strategy, micro, K)
    oracle = _run(jstrategy.OneDeviceStrategy("cpu:0"), [(x, y)], 1)
    _assert_trees(state.params, oracle.params, atol=PARITY)
    # Averaging the k micro-batch means instead (Keras, optax.MultiSteps) over-weighs the
    # 5 rows of the last one: visibly another update.
    with strategy.scope():
        multi = training.create_train_state(
            Mlp(), optax.MultiSteps(_tx(), K).gradient_transformation(), jnp.ones((1, FEATURES))
        )
        plain = training.make_train_step(_loss)
    multi = _run(strategy, micro, 1, multi, plain)
    pairs = zip(_host(multi.params), _host(oracle.params), strict=True)
    gap = max(np.abs(a - b).max() for a, b in pairs)
    assert gap > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution", [1, 2, 4])
def test_fit_with_accumulation_matches_fit_on_larger_batches(steps_per_execution):
    # 88 rows: batches of 16 are 5 full and one of 8; cycles of 3 hold 48 and 40 rows, as
    # batches of 48 do. Shuffled: the epoch's order is the same in both runs.
    x, y = _data(88, seed=2)
    strategy = jstrategy.MirroredStrategy()

    def fit(batch_size, k, spe):
        with strategy.scope():
            model = jstrategy.Model(Mlp(), input_shape=(FEATURES,), seed=5)
            model.compile(_tx(), loss=_loss, steps_per_execution=spe, gradient_accumulation_steps=k)
        history = model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0)
        return model, history.history["loss"]

    model, losses = fit(16, 3, steps_per_execution)
    reference, reference_losses = fit(48, 1, 1)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=PARITY, rtol=0)
    # The parameters do not move within a cycle, so the epoch's loss is the same too.
    np.testing.assert_allclose(losses, reference_losses, atol=PARITY)
    assert model.gradient_accumulation_steps == 3
    assert (int(model.state.step), _adam_count(model.state)) == (12, 4)


class _Stop(Exception):
    """Raised by a callback to interrupt `fit` at a chosen step."""


@pytest.mark.slow
def test_backup_and_restore_resumes_in_the_middle_of_a_cycle_exactly(tmp_path):
    x, y = _data(96, seed=3)  # 6 batches of 16 an epoch, cycles of 4 cross the epochs
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    ref = [None]

    def fit(callbacks):
        with strategy.scope():
            model = jstrategy.Model(Mlp(), input_shape=(FEATURES,), seed=5)
            model.compile(_tx(), loss=_loss, metrics=["accuracy"], gradient_accumulation_steps=4)
        ref[0] = model
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
        return model, history.history

    def stop(batch, logs):
        progress = ref[0].fit_state
        if progress.epoch == 1 and batch + 1 >= 4:
            raise _Stop

    expected, expected_history = fit([])
    backup_dir = tmp_path / "backup"
    with pytest.raises(_Stop):
        fit([BackupAndRestore(backup_dir, save_freq=2), LambdaCallback(on_train_batch_end=stop)])
    with jstrategy.CheckpointManager(backup_dir) as manager:
        saved = manager.restore_metadata()
    # Backed up after batch 4 of epoch 1, the run's 10th: 2 batches into its third cycle
    # (and the second cycle spanned the end of epoch 0, after 6 batches).
    assert (saved["epoch"], saved["step"]) == (1, 4)
    resumed, history = fit([BackupAndRestore(backup_dir, save_freq=2)])
    for a, b in zip(resumed.get_weights(), expected.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    _assert_trees(resumed.state, expected.state)
    for key, values in history.items():
        assert values == expected_history[key][-len(values) :]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_checkpoint_manager_restores_a_cycle_in_progress(tmp_path, policy):
    """The factory: accumulators (and the loss scale) are in the state a checkpoint saves."""
    strategy = jstrategy.MirroredStrategy()
    x, y = _data(12 * MICRO, seed=4)
    micro = [(x[i * MICRO : (i + 1) * MICRO], y[i * MICRO : (i + 1) * MICRO]) for i in range(12)]
    with strategy.scope():
        step = training.make_train_step(_loss, dtype_policy=policy, gradient_accumulation_steps=K)
        first, second = _state(policy), _state(policy)
    expected = _run(strategy, micro, K, step=step, state=first)
    state = _run(strategy, micro[:6], K, step=step, state=second)
    assert int(state.grad_accumulator.micro_steps) == 2  # in the middle of a cycle
    # Checkpoints hold plain arrays: the dropout key as its raw data.
    raw, typed = jax.random.key_data, jax.random.wrap_key_data
    with jstrategy.CheckpointManager(tmp_path) as manager:
        manager.save(6, state.replace(rng=raw(state.rng)))
        manager.wait_until_finished()
        # A new run: a fresh state, given the step's fields, is the target.
        with strategy.scope():
            target = step.prepare_state(_state(policy))
        restored = manager.restore(target=target.replace(rng=raw(target.rng)), strategy=strategy)
    restored = restored.replace(rng=typed(restored.rng))
    _assert_trees(restored.grad_accumulator, state.grad_accumulator)
    if policy == "mixed_float16":
        _assert_trees(restored.loss_scale, state.loss_scale)
    resumed = _run(strategy, micro[6:], K, step=step, state=restored)
    _assert_trees(resumed.params, expected.params)
    _assert_trees(resumed.opt_state, expected.opt_state)


@pytest.mark.slow
def test_loss_scaling_and_accumulation_compose():
    """An overflowing micro-batch is dropped whole: the cycle waits for one more."""
    strategy = jstrategy.MirroredStrategy()
    x, y = _data(3 * MICRO, seed=5)
    big = x[MICRO : 2 * MICRO] * 1e5  # beyond float16 (65504): inf, then NaN gradients
    micro = [(x[:MICRO], y[:MICRO]), (big, y[MICRO : 2 * MICRO]), (x[2 * MICRO :], y[2 * MICRO :])]
    with strategy.scope():
        step = training.make_train_step(
            _loss, dtype_policy="mixed_float16", gradient_accumulation_steps=2
        )
        state, other = _state("mixed_float16"), _state("mixed_float16")
    state = _run(strategy, micro[:1], 2, step=step, state=state)
    before = _host((state.params, state.opt_state, state.grad_accumulator, state.step))
    state = _run(strategy, micro[1:2], 2, step=step, state=state)
    _assert_trees((state.params, state.opt_state, state.grad_accumulator, state.step), before)
    assert float(state.loss_scale.loss_scale) == 2.0**14
    state = _run(strategy, micro[2:], 2, step=step, state=state)
    assert (int(state.step), _adam_count(state)) == (2, 1)
    # The same as accumulating the two finite micro-batches alone: scaling by a power of
    # two is exact in float16, so the other scale leaves no trace.
    alone = _run(strategy, [micro[0], micro[2]], 2, step=step, state=other)
    _assert_trees(state.params, alone.params)
    assert {str(a.dtype) for a in jax.tree.leaves(state.grad_accumulator.grad_sums)} == {"float32"}


def test_bad_accumulation_arguments_and_a_state_from_another_step():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        with pytest.raises(ValueError, match="`gradient_accumulation_steps` must be a positive"):
            training.make_train_step(_loss, gradient_accumulation_steps=0)
        model = jstrategy.Model(Mlp(), input_shape=(FEATURES,))
        with pytest.raises(ValueError, match="`gradient_accumulation_steps` must be a positive"):
            model.compile("adam", loss=_loss, gradient_accumulation_steps=2.5)
        assert model.gradient_accumulation_steps == 1
        accumulating = training.make_train_step(_loss, gradient_accumulation_steps=2)
        plain = training.make_train_step(_loss)
        state = accumulating.prepare_state(_state())
    with pytest.raises(ValueError, match=r"state.replace\(grad_accumulator=None\)"):
        plain(state, _data(MICRO))
    state, _ = plain(state.replace(grad_accumulator=None), _data(MICRO))
    assert int(state.step) == 1
    # Compiling again starts a fresh cycle with the fresh optimizer state.
    model.compile("adam", loss=_loss, gradient_accumulation_steps=3)
    model.fit(*_data(32), batch_size=16, epochs=1, verbose=0)
    assert int(model.state.grad_accumulator.micro_steps) == 2
    model.compile("adam", loss=_loss, gradient_accumulation_steps=3)
    assert int(model.state.grad_accumulator.micro_steps) == 0


NnxNet = functools.partial(helpers.NnxNet, features=FEATURES, dropout=0.0, activation="tanh")


@pytest.mark.slow
def test_nnx_accumulation_parity_and_a_float16_skip_with_random_streams():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _data(4 * MICRO, seed=6)
    micro = [(x[i * MICRO : (i + 1) * MICRO], y[i * MICRO : (i + 1) * MICRO]) for i in range(4)]
    with strategy.scope():
        state = training.create_nnx_train_state(NnxNet(nnx.Rngs(0)), _tx())
    state = _run(strategy, micro, 2, state=state)
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        oracle = training.create_nnx_train_state(NnxNet(nnx.Rngs(0)), _tx())
    big = [(x[: 2 * MICRO], y[: 2 * MICRO]), (x[2 * MICRO :], y[2 * MICRO :])]
    oracle = _run(jstrategy.OneDeviceStrategy("cpu:0"), big, 1, state=oracle)
    _assert_trees(state.params, oracle.params, atol=PARITY)
    assert int(state.step) == 4
    # Dropout's random streams live in the model state: an overflowing micro-batch under
    # float16 keeps them (and everything else) as they were.
    with strategy.scope():
        state = training.create_nnx_train_state(
            NnxNet(nnx.Rngs(0), dropout=0.5), _tx(), dtype_policy="mixed_float16"
        )
        step = training.make_train_step(
            _loss, dtype_policy="mixed_float16", gradient_accumulation_steps=2
        )
    state = _run(strategy, micro[:1], 2, state=state, step=step)
    before = _host((state.params, state.model_state, state.grad_accumulator))
    state = _run(strategy, [(micro[1][0] * 1e5, micro[1][1])], 2, state=state, step=step)
    _assert_trees((state.params, state.model_state, state.grad_accumulator), before)
    assert float(state.loss_scale.loss_scale) == 2.0**14
    state = _run(strategy, micro[2:3], 2, state=state, step=step)
    assert int(state.step) == 2 and int(state.grad_accumulator.micro_steps) == 0
