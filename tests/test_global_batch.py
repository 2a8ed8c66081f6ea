"""Dropout and BatchNorm follow OneDeviceStrategy for the same global batch, on any mesh.

Each replica runs the forward pass on its own rows; Flax's Dropout layers keep their rows
of the mask one device draws for the whole batch, and BatchNorm layers built without
``axis_name`` take statistics over the global batch (``sync_batch_norm="global"``, the
default). So a model with both trains the same under every strategy of the parity fixture
and on 8x1, 2x4 and 4x2 meshes, via `make_train_step` and `Model.fit`, linen and NNX.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import losses
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.training.state.global_batch import global_rows_bernoulli

FEATURES = 5
HIDDEN = 16
ROWS = 16
STEPS = 4
TOL = 1e-5


class Net(nn.Module):
    """Dense, BatchNorm without axis_name, dropout, Dense.

    The first Dense has no bias: BatchNorm cancels it, so its gradient is float rounding
    noise, which Adam would turn into steps of full size that differ by strategy.
    """

    rate: float = 0.3
    bn_axis: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(HIDDEN, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.bn_axis)(x)
        x = nn.Dropout(self.rate, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


NnxNet = functools.partial(
    helpers.NnxNet, features=FEATURES, hidden=HIDDEN, use_bias=False, batch_norm={}, dropout=0.3
)


def _model_parallel(batch, model):
    mesh = jstrategy.experimental.DeviceMesh((batch, model), ("batch", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["(Dense_0|dense1)/kernel"] = (None, "model")
    layout_map["(Dense_1|dense2)/kernel"] = ("model", None)
    return jstrategy.experimental.ModelParallelStrategy(layout_map)


MESHES = {"8x1": (8, 1), "2x4": (2, 4), "4x2": (4, 2)}


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = np.argmax(x[:, :3] + rng.normal(size=(rows, 3)), axis=-1).astype(np.int32)
    return x, y


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _host(tree):
    """The float leaves of `tree` on the host (NNX's random-stream keys and counts aside)."""
    leaves = jax.tree.leaves(tree)
    return [np.asarray(jax.device_get(v)) for v in leaves if jnp.issubdtype(v.dtype, jnp.floating)]


def _variables(state):
    if isinstance(state, training.NNXTrainState):
        return (state.params, state.model_state)
    return state.variables


def _new_state(kind, module_kwargs):
    tx = optax.sgd(0.1, momentum=0.9)
    if kind == "nnx":
        return training.create_nnx_train_state(NnxNet(nnx.Rngs(0)), tx)
    return training.create_train_state(
        Net(**dict(module_kwargs)), tx, jnp.ones((1, FEATURES)), rng=1
    )


def _steps(strategy, kind, module_kwargs=(), steps=STEPS, **options):
    """Losses and variables after `steps` train steps of 16 rows (the last one padded)."""
    x, y = _data(steps * ROWS)
    with strategy.scope():
        state = _new_state(kind, module_kwargs)
        step = training.make_train_step(_loss, **options)
    out = []
    for i in range(steps):
        rows = slice(i * ROWS, (i + 1) * ROWS - (3 if i == steps - 1 else 0))
        batch = distribute_batch(strategy, (x[rows], y[rows]), global_batch_size=ROWS)
        state, logs = step(state, batch)
        dispatch.track(logs)
        out.append(logs["loss"])
    return np.asarray(jax.device_get(out)), _host(_variables(state))


def _fit(strategy, kind, steps_per_execution=3, **compile_options):
    # 100 rows in batches of 16: six full steps and a padded one per epoch.
    x, y = _data(100, seed=1)
    with strategy.scope():
        if kind == "nnx":
            model = jstrategy.Model(NnxNet(nnx.Rngs(7)), seed=2)
        else:
            model = jstrategy.Model(Net(), input_shape=(FEATURES,), seed=5)
        model.compile(
            optax.adam(1e-2),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
            **compile_options,
        )
    history = model.fit(x, y, batch_size=ROWS, epochs=2, verbose=0)
    return np.asarray(history.history["loss"]), _host(model.variables)


@functools.cache
def _one_device(run, kind, **options):
    return run(jstrategy.OneDeviceStrategy("cpu:0"), kind, **options)


def _assert_follows(got, expected):
    (losses_got, variables_got), (losses_expected, variables_expected) = got, expected
    np.testing.assert_allclose(losses_got, losses_expected, rtol=TOL, atol=TOL)
    assert len(variables_got) == len(variables_expected)
    for a, b in zip(variables_got, variables_expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


# The mask --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 4, 8])
@pytest.mark.parametrize("shape", [(3, 7), (2, 4, 5), (1, 3)])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_replica_rows_are_the_global_draw(replicas, shape, impl):
    mesh = jax.make_mesh((replicas,), ("r",), devices=jax.devices()[:replicas])
    key = jax.random.fold_in(jax.random.key(3, impl=impl), 11)

    def masks(key):
        return global_rows_bernoulli(key, 0.7, shape, axis_name="r")

    got = jax.jit(jax.shard_map(masks, mesh=mesh, in_specs=P(), out_specs=P("r")))(key)
    expected = jax.random.bernoulli(key, 0.7, (replicas * shape[0], *shape[1:]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.slow
def test_a_mask_not_split_by_rows_is_the_one_device_draw():
    mesh = jax.make_mesh((4,), ("r",), devices=jax.devices()[:4])
    key = jax.random.key(5)

    def masks(key):  # a broadcast mask (1, 6) for 3 rows per replica
        return global_rows_bernoulli(key, 0.5, (1, 6), axis_name="r", rows=3)[None]

    got = jax.jit(jax.shard_map(masks, mesh=mesh, in_specs=P(), out_specs=P("r")))(key)
    expected = jax.random.bernoulli(key, 0.5, (1, 6))
    for replica in np.asarray(got):
        np.testing.assert_array_equal(replica, np.asarray(expected))


# The parity suite -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_train_step_follows_one_device(strategy, kind):
    _assert_follows(_steps(strategy, kind), _one_device(_steps, kind))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_fit_follows_one_device(strategy, kind):
    _assert_follows(_fit(strategy, kind), _one_device(_fit, kind))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_every_mesh_follows_one_device(mesh, kind):
    # The finding: the first epoch's loss was 1.0019 / 0.9966 / 0.9916 on these meshes.
    _assert_follows(_steps(_model_parallel(*MESHES[mesh]), kind), _one_device(_steps, kind))
    fit_once = functools.partial(_fit, steps_per_execution=1)
    _assert_follows(fit_once(_model_parallel(*MESHES[mesh]), kind), _one_device(fit_once, kind))


ACCUMULATING = {
    "mirrored_8": jstrategy.MirroredStrategy,
    "model_parallel_2x4": functools.partial(_model_parallel, 2, 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ACCUMULATING))
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_gradient_accumulation_follows_one_device(name, kind):
    steps = functools.partial(_steps, gradient_accumulation_steps=2)
    _assert_follows(steps(ACCUMULATING[name](), kind), _one_device(steps, kind))
    fit = functools.partial(_fit, gradient_accumulation_steps=2)
    _assert_follows(fit(ACCUMULATING[name](), kind), _one_device(fit, kind))


@pytest.mark.slow
def test_batch_norm_that_names_the_axis_is_unchanged():
    strategy = jstrategy.MirroredStrategy()
    named = _steps(strategy, "linen", (("bn_axis", jstrategy.REPLICA_AXIS),))
    _assert_follows(named, _steps(strategy, "linen"))
    # and it keeps synchronizing under the opt-out, which only concerns unnamed ones
    _assert_follows(
        _steps(
            strategy,
            "linen",
            (("bn_axis", jstrategy.REPLICA_AXIS),),
            sync_batch_norm="per_replica",
        ),
        named,
    )


# The opt-out: TF's per-replica statistics -------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_per_replica_batch_norm_normalizes_each_replicas_rows(kind):
    # The first step's loss with each replica's own statistics is the mean of one
    # device's losses on each replica's rows alone (dropout off: rate 0).
    x, y = _data(ROWS)
    replicas = 2

    def first_loss(strategy, rows, **options):
        with strategy.scope():
            if kind == "nnx":
                model = NnxNet(nnx.Rngs(0))
                model.drop.rate = 0.0
                state = training.create_nnx_train_state(model, optax.sgd(0.1))
            else:
                state = training.create_train_state(
                    Net(rate=0.0), optax.sgd(0.1), jnp.ones((1, FEATURES)), rng=1
                )
            step = training.make_train_step(_loss, **options)
        batch = distribute_batch(strategy, (x[rows], y[rows]), global_batch_size=len(x[rows]))
        return float(step(state, batch)[1]["loss"])

    mirrored = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    per_replica = first_loss(mirrored, slice(None), sync_batch_norm="per_replica")
    one_device = jstrategy.OneDeviceStrategy("cpu:0")
    half = ROWS // replicas
    own_rows = np.mean(
        [first_loss(one_device, slice(r * half, (r + 1) * half)) for r in range(replicas)]
    )
    np.testing.assert_allclose(per_replica, own_rows, rtol=TOL)
    global_stats = first_loss(mirrored, slice(None))
    np.testing.assert_allclose(global_stats, first_loss(one_device, slice(None)), rtol=TOL)
    assert abs(per_replica - global_stats) > 1e-3


@pytest.mark.slow
def test_one_replica_does_not_care():
    one_device = jstrategy.OneDeviceStrategy("cpu:0")
    _assert_follows(
        _steps(one_device, "linen", sync_batch_norm="per_replica"), _steps(one_device, "linen")
    )


@pytest.mark.parametrize("value", [True, "synchronized", None])
def test_bad_sync_batch_norm_is_refused(value):
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        with pytest.raises(ValueError, match="`sync_batch_norm` must be one of"):
            training.make_train_step(_loss, sync_batch_norm=value)
        model = jstrategy.Model(Net(), input_shape=(FEATURES,))
        match = "Keras's synchronized=True is 'global'" if value is True else "got"
        with pytest.raises(ValueError, match=match):
            model.compile("sgd", loss="mse", sync_batch_norm=value)


def test_saved_model_keeps_sync_batch_norm(tmp_path):
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        model = jstrategy.Model(Net(), input_shape=(FEATURES,))
        model.compile(
            "sgd",
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            sync_batch_norm=training.BatchNormSync.PER_REPLICA,
        )
        assert model.sync_batch_norm is training.BatchNormSync.PER_REPLICA
        model.save(tmp_path / "m")
        loaded = jstrategy.models.load_model(tmp_path / "m", module=Net())
    assert loaded.sync_batch_norm is training.BatchNormSync.PER_REPLICA
