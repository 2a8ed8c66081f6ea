"""The train-step factory: every strategy follows OneDeviceStrategy's trajectory."""

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
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.names import path_names
from jstrategy.experimental import FSDPStrategy
from jstrategy.experimental import ModelParallelStrategy

STEPS = 20
ROWS = 16  # divides among 1, 2, 4 and 8 replicas, so BatchNorm sees no padding
FEATURES = 5


def _data(steps=STEPS, rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, rows, FEATURES)).astype(np.float32)
    y = np.argmax(x[..., :3], axis=-1).astype(np.int32)  # learnable
    return x, y


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


class LinenNet(nn.Module):
    """Dense, BatchNorm synchronized over the strategy's data axis, Dense."""

    axis_name: str = jstrategy.REPLICA_AXIS

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
        return nn.Dense(3)(nn.relu(x))


def NnxNet(rngs, axis_name=jstrategy.REPLICA_AXIS):
    """The same network in NNX."""
    return helpers.NnxNet(rngs, features=FEATURES, batch_norm={"axis_name": axis_name})


def _tx():
    return optax.sgd(0.1, momentum=0.9)


def _linen_state():
    # BatchNorm synchronizes over the data axis of the strategy in scope.
    net = LinenNet(axis_name=jstrategy.get_strategy().axis_name)
    return training.create_train_state(net, _tx(), jnp.ones((1, FEATURES)), rng=0)


def _nnx_state():
    net = NnxNet(nnx.Rngs(0), axis_name=jstrategy.get_strategy().axis_name)
    return training.create_nnx_train_state(net, _tx())


def _arrays(state):
    """The state's trained and mutable float arrays, on the host."""
    if isinstance(state, training.NNXTrainState):
        tree = (state.params, state.model_state)
    else:
        tree = state.variables
    leaves = jax.tree.leaves(jax.device_get(tree))
    return [np.asarray(x) for x in leaves if np.issubdtype(np.asarray(x).dtype, np.floating)]


def _train(strategy, make_state, steps=STEPS):
    return helpers.train_steps(strategy, make_state, _loss, *_data(steps))


def _assert_where_the_strategy_keeps_it(state, strategy):
    """Every leaf after training: `variable_sharding`'s layout (sharded ones stay sharded)."""
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        want = strategy.variable_sharding(leaf, path_names(keypath))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (keypath, leaf.sharding, want)
        assert leaf.sharding.memory_kind == want.memory_kind


@functools.cache
def _oracle(kind):
    make_state = _linen_state if kind == "linen" else _nnx_state
    state, history = _train(jstrategy.OneDeviceStrategy("cpu:0"), make_state)
    return _arrays(state), history


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_every_strategy_matches_one_device_after_20_steps(strategy, kind):
    make_state = _linen_state if kind == "linen" else _nnx_state
    expected, expected_history = _oracle(kind)
    state, history = _train(strategy, make_state)
    _assert_where_the_strategy_keeps_it(state, strategy)
    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):  # really split
        assert any(not p.sharding.is_fully_replicated for p in jax.tree.leaves(state.params))
    got = _arrays(state)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # The trajectory moved (so matching is not trivial) and the metrics agree too.
    assert expected_history[-1]["loss"] < expected_history[0]["loss"]
    for m, e in zip(history, expected_history, strict=True):
        assert set(m) == {"loss", "accuracy"}
        np.testing.assert_allclose(m["loss"], e["loss"], atol=1e-5)
        np.testing.assert_allclose(m["accuracy"], e["accuracy"], atol=1e-6)


def test_step_counter_state_placement_and_donation():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    with strategy.scope():
        state = _linen_state()
        step = training.make_train_step(_loss)
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.sharding == strategy.replicated_sharding()
    x, y = _data(1)
    new_state, _ = step(state, distribute_batch(strategy, (x[0], y[0])))
    assert int(new_state.step) == 1
    assert kernel.is_deleted()  # donated: the step updates the state in place
    assert new_state.params["Dense_0"]["kernel"].sharding == strategy.replicated_sharding()


@pytest.mark.parametrize(
    "make",
    [
        lambda: jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"]),
        lambda: FSDPStrategy(min_shard_size=0, offload_optimizer=True),
        lambda: jstrategy.CentralStorageStrategy(),
    ],
    ids=["mirrored", "fsdp_offload", "central_storage"],
)
def test_a_spent_state_is_refused_and_a_copy_made_before_the_step_trains_on(make):
    # As make_train_step's docs say: the state given is donated; a copy made where each
    # array lives before the step keeps the state it was, and a step takes it again.
    strategy = make()
    with strategy.scope():
        state = _linen_state()
        step = training.make_train_step(_loss)
        evaluate = training.make_eval_step(_loss)
    x, y = _data(2)
    # `a.copy()`, not `jax.device_put(a, a.sharding, may_alias=False)`: jax 0.12.1's CPU
    # client refuses to device_put a program's output held in host memory (offload).
    kept = jax.tree.map(lambda a: a.copy(), state)
    before = _arrays(state)
    new_state, _ = step(state, (x[0], y[0]))
    spent = r"`state` holds arrays that an earlier train step deleted.*a\.copy\(\)"
    with pytest.raises(ValueError, match=spent):
        step(state, (x[1], y[1]))
    with pytest.raises(ValueError, match=spent):
        evaluate(state, (x[1], y[1]))
    for a, b in zip(_arrays(kept), before, strict=True):
        np.testing.assert_array_equal(a, b)
    again, _ = step(kept, (x[0], y[0]))
    assert int(again.step) == int(new_state.step) == 1
    for a, b in zip(_arrays(again), _arrays(new_state), strict=True):
        np.testing.assert_array_equal(a, b)


def _hlo(cross_device_ops):
    strategy = jstrategy.MirroredStrategy(cross_device_ops=cross_device_ops)
    with strategy.scope():
        state = training.create_train_state(nn.Dense(3), _tx(), jnp.ones((1, FEATURES)))
        step = training.make_train_step(_loss)
    x, y = _data(1)
    return step.lower(state, distribute_batch(strategy, (x[0], y[0]))).as_text()


def test_cross_device_op_changes_the_program():
    nccl = _hlo(jstrategy.NcclAllReduce())
    hierarchical = _hlo(jstrategy.HierarchicalCopyAllReduce())
    assert "all_reduce" in nccl and "collective_permute" not in nccl
    assert "collective_permute" in hierarchical
    # One packed all-reduce carries gradients, loss and count together.
    assert nccl.count("stablehlo.all_reduce") == 1


class Linear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


def test_padding_never_skews_the_loss_or_the_update():
    # 13 real rows: 8 replicas pad them to 16; the oracle sees exactly the 13 rows.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(13, FEATURES)).astype(np.float32)
    y = rng.integers(0, 3, size=13).astype(np.int32)
    results = []
    for strategy in (jstrategy.OneDeviceStrategy("cpu:0"), jstrategy.MirroredStrategy()):
        with strategy.scope():
            state = training.create_train_state(Linear(), _tx(), jnp.ones((1, FEATURES)))
            step = training.make_train_step(_loss)
        batch = distribute_batch(strategy, (x, y))
        assert batch[0].value.shape[0] == (13 if strategy.num_replicas_in_sync == 1 else 16)
        before = jax.device_get(state.params)
        state, metrics = step(state, batch)
        results.append((_arrays(state), float(metrics["loss"]), before))
    (one, loss_one, before), (mirrored, loss_mirrored, _) = results
    logits = x @ before["Dense_0"]["kernel"] + before["Dense_0"]["bias"]
    expected = np.mean(np.asarray(_loss(y, logits)))
    np.testing.assert_allclose(loss_one, expected, rtol=1e-5)
    np.testing.assert_allclose(loss_mirrored, expected, rtol=1e-5)
    for a, b in zip(one, mirrored, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


class UnsyncedNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)


@pytest.mark.slow
def test_per_replica_batch_stats_are_averaged_across_replicas():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, FEATURES)).astype(np.float32) * np.arange(1, 9)[:, None]
    y = np.zeros(8, np.float32)

    def stats(strategy, rows, **options):
        with strategy.scope():
            state = training.create_train_state(UnsyncedNorm(), _tx(), jnp.ones((1, FEATURES)))
            step = training.make_train_step(lambda t, p: jnp.sum(p, axis=-1) * 0 + t, **options)
        state, _ = step(state, distribute_batch(strategy, (x[rows], y[rows])))
        return jax.device_get(state.batch_stats["BatchNorm_0"])

    one = jstrategy.OneDeviceStrategy("cpu:0")
    two = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    halves = [stats(one, slice(0, 4)), stats(one, slice(4, 8))]
    per_replica = stats(two, slice(0, 8), sync_batch_norm="per_replica")
    for name in ("mean", "var"):
        expected = (halves[0][name] + halves[1][name]) / 2
        np.testing.assert_allclose(per_replica[name], expected, rtol=1e-5)
    # The variance of the halves' average is not the variance of all rows, which the
    # default (statistics over the global batch) computes, as one device.
    whole = stats(one, slice(0, 8))
    assert not np.allclose(per_replica["var"], whole["var"])
    synchronized = stats(two, slice(0, 8))
    for name in ("mean", "var"):
        np.testing.assert_allclose(synchronized[name], whole[name], rtol=1e-5)


class DropoutProbe(nn.Module):
    """y = dropout(x) @ w: the gradient of w shows each replica's dropout mask."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(1, use_bias=False, kernel_init=nn.initializers.zeros)(x)


class NnxDropoutProbe(nnx.Module):
    def __init__(self, rngs):
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.dense = nnx.Linear(
            64, 1, use_bias=False, kernel_init=nnx.initializers.zeros, rngs=rngs
        )

    def __call__(self, x):
        return self.dense(self.dropout(x))


@functools.cache
def _dropout_step():
    # One step object for every seed and kind: states of one structure reuse its program.
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    return strategy, training.make_train_step(lambda t, p: p[:, 0], strategy=strategy)


def _dropout_update(kind, seed, steps=2):
    strategy, step = _dropout_step()
    with strategy.scope():
        if kind == "linen":
            state = training.create_train_state(
                DropoutProbe(), optax.sgd(1.0), jnp.ones((1, 64)), rng=seed
            )
        else:
            model = NnxDropoutProbe(nnx.Rngs(params=0, dropout=seed))
            state = training.create_nnx_train_state(model, optax.sgd(1.0))
    x = np.ones((2, 64), np.float32)  # the same row on both replicas
    kernels = []
    for _ in range(steps):
        state, _ = step(state, (x, np.zeros(2, np.float32)))
        kernels.append(
            np.asarray(
                jax.device_get(
                    state.params["Dense_0"]["kernel"]
                    if kind == "linen"
                    else state.params["dense"]["kernel"][...]
                )
            )
        )
    return np.stack(kernels)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_dropout_differs_per_replica_and_is_reproducible(kind):
    kernels = _dropout_update(kind, seed=3)
    first = -kernels[0][:, 0]  # mean over the two rows of dropout(x) (kept: 2, dropped: 0)
    assert set(np.unique(first)) <= {0.0, 1.0, 2.0}
    # Identical masks on both replicas would give only 0 or 2; 1 means they differ.
    assert np.any(first == 1.0)
    assert not np.array_equal(kernels[1] - kernels[0], kernels[0])  # new masks each step
    np.testing.assert_array_equal(kernels, _dropout_update(kind, seed=3))
    assert not np.array_equal(kernels, _dropout_update(kind, seed=4))


def test_eval_and_predict_steps_count_real_rows_only():
    strategy = jstrategy.MirroredStrategy()
    rng = np.random.default_rng(4)
    x = rng.normal(size=(11, FEATURES)).astype(np.float32)
    y = rng.integers(0, 3, size=11).astype(np.int32)
    with strategy.scope():
        state = training.create_train_state(Linear(), _tx(), jnp.ones((1, FEATURES)))
        evaluate = training.make_eval_step(_loss, metrics=["accuracy"])
        predict = training.make_predict_step()
    out = predict(state, distribute_batch(strategy, x))
    assert out.value.shape == (16, 3)
    logits = np.asarray(out.value)[np.asarray(out.mask)]
    params = jax.device_get(state.params)["Dense_0"]
    np.testing.assert_allclose(logits, x @ params["kernel"] + params["bias"], rtol=1e-5)
    metrics = evaluate(state, distribute_batch(strategy, (x, y)))
    np.testing.assert_allclose(metrics["loss"], np.mean(_loss(y, logits)), rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], np.mean(logits.argmax(-1) == y), rtol=1e-6)


def test_nnx_eval_uses_running_statistics():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        state = _nnx_state()
        step = training.make_train_step(_loss)
        predict = training.make_predict_step()
    x, y = _data(1)
    state, _ = step(state, distribute_batch(strategy, (x[0], y[0])))
    model = state.model
    model.eval()
    out = predict(state, distribute_batch(strategy, x[0]))
    np.testing.assert_allclose(np.asarray(out.value), np.asarray(model(x[0])), rtol=1e-5)
    assert int(state.step) == 1


def test_create_train_state_uses_the_scope_strategy():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:2", "cpu:3"])
    with strategy.scope():
        state = _linen_state()
    assert state.params["Dense_0"]["kernel"].sharding.device_set == set(strategy.devices)
    assert state.train_arg == "train"
    assert state.batch_stats is not None and state.rng is not None


def test_errors_name_the_problem_and_the_fix():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    other = jstrategy.OneDeviceStrategy("cpu:5")
    with other.scope():
        foreign = training.create_train_state(Linear(), _tx(), jnp.ones((1, FEATURES)))
    with strategy.scope():
        state = training.create_train_state(Linear(), _tx(), jnp.ones((1, FEATURES)))
        step = training.make_train_step(_loss)
        mean_loss = training.make_train_step(lambda t, p: jnp.mean(p))
    x, y = _data(1)
    batch = distribute_batch(strategy, (x[0], y[0]))
    with pytest.raises(ValueError, match="not placed on the step's strategy"):
        step(foreign, batch)
    with pytest.raises(ValueError, match="one value per example"):
        mean_loss(state, batch)
    with pytest.raises(ValueError, match="must be .x, y. or .x, y, sample_weight"):
        step(state, (batch[0],))
    with pytest.raises(ValueError, match="does not divide among 2 replicas"):
        step(state, (x[0][:3], y[0][:3]))
    with pytest.raises(TypeError, match="must be an optax.GradientTransformation"):
        training.create_train_state(Linear(), "sgd", jnp.ones((1, FEATURES)))
    with pytest.raises(TypeError, match="must be an nnx.Module"):
        training.create_nnx_train_state(Linear(), _tx())
