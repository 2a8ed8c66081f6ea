"""`batch_region`: Keras's BatchNormalization and Dropout (`jstrategy.layers`) compute as one
device over the global batch, under every strategy, and per replica exactly when asked.

The parity matrix (`test_parity_matrix.py`) holds every model to one device's trajectory;
this file pins what each layer computes: the statistics with ``sync_batch_norm`` global and
per replica (also under the sharded strategies, whose step maps the replicas with ``vmap``),
``synchronized=True`` on any mesh, the layers inside `Strategy.run`, and the masks by global
row.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import layers as L
from jstrategy import training
from jstrategy._src import batch_region
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch

FEATURES = 5
ROWS = 16
TOL = 1e-5


class KerasNet(nn.Module):
    """jstrategy's (Keras's) BatchNormalization and Dropout between two Dense layers."""

    synchronized: bool = False
    rate: float = 0.3

    @nn.compact
    def __call__(self, x, training: bool = False):
        x = L.Dense(16, use_bias=False)(x)
        x = L.BatchNormalization(synchronized=self.synchronized)(x, training=training)
        x = L.Dropout(self.rate)(L.Activation("relu")(x), training=training)
        return L.Dense(3)(x)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(3)(nn.relu(x))


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.dense1 = nnx.Linear(FEATURES, 16, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dense2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense2(nnx.relu(self.norm(self.dense1(x))))


def _data(rows=ROWS * 3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    return x, np.argmax(x[:, :3], axis=-1).astype(np.int32)


def _model_parallel():
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    return jstrategy.experimental.ModelParallelStrategy(jstrategy.experimental.LayoutMap(mesh))


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _train(strategy, kind, **options):
    """Three train steps of 16 rows: each loss, then every float variable."""
    x, y = _data()
    with strategy.scope():
        if kind == "nnx":
            state = training.create_nnx_train_state(NnxNet(nnx.Rngs(0)), optax.sgd(0.1))
        else:
            module = {"keras": KerasNet(), "keras_sync": KerasNet(True), "linen": LinenNet()}
            state = training.create_train_state(
                module[kind], optax.sgd(0.1), jnp.ones((1, FEATURES)), rng=1
            )
        step = training.make_train_step(_loss, **options)
    losses = []
    for i in range(0, len(x), ROWS):
        state, logs = step(state, distribute_batch(strategy, (x[i : i + ROWS], y[i : i + ROWS])))
        dispatch.track(logs)
        losses.append(logs["loss"])
    variables = state.variables if kind != "nnx" else (state.params, state.model_state)
    leaves = [v for v in jax.tree.leaves(variables) if jnp.issubdtype(v.dtype, jnp.floating)]
    return np.asarray(jax.device_get(losses)), [np.asarray(v) for v in jax.device_get(leaves)]


def _assert_close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=TOL, atol=TOL)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


def _differ(got, want):
    return not np.allclose(got[0], want[0], rtol=1e-3, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["keras", "linen", "nnx"])
def test_per_replica_statistics_are_the_same_under_a_sharded_strategy(kind):
    """FSDP maps its 8 replicas with vmap, Mirrored with shard_map: each replica's own
    statistics (``sync_batch_norm="per_replica"``) are the same numbers either way (FSDP
    stopped at "Differentiation rule for 'pmax' not implemented"), and not one device's."""
    mirrored = _train(jstrategy.MirroredStrategy(), kind, sync_batch_norm="per_replica")
    fsdp = jstrategy.experimental.FSDPStrategy(min_shard_size=0)
    _assert_close(_train(fsdp, kind, sync_batch_norm="per_replica"), mirrored)
    assert _differ(mirrored, _train(jstrategy.OneDeviceStrategy("cpu:0"), kind))


@pytest.mark.slow
def test_keras_batch_norm_is_global_by_default_and_synchronized_on_any_mesh():
    """The default normalizes the global batch under Mirrored (it normalized each replica's
    rows); ``synchronized=True`` keeps the global batch even with
    ``sync_batch_norm="per_replica"``, also on ModelParallel's mesh, whose data axis is not
    `jstrategy.REPLICA_AXIS` (it stopped at "unbound axis name: replica")."""
    one = _train(jstrategy.OneDeviceStrategy("cpu:0"), "keras")
    _assert_close(_train(jstrategy.MirroredStrategy(), "keras"), one)
    _assert_close(_train(_model_parallel(), "keras"), one)
    for strategy in (jstrategy.MirroredStrategy(), _model_parallel()):
        got = _train(strategy, "keras_sync", sync_batch_norm="per_replica")
        _assert_close(got, _train(jstrategy.OneDeviceStrategy("cpu:0"), "keras_sync"))
    per_replica = _train(jstrategy.MirroredStrategy(), "keras", sync_batch_norm="per_replica")
    assert _differ(per_replica, one)


@pytest.mark.parametrize("synchronized", [False, True])
def test_keras_batch_norm_inside_run_is_tfs_unless_synchronized(synchronized):
    """In `Strategy.run` (a TF-style custom loop) each replica normalizes its own rows, as
    TF's BatchNormalization; ``synchronized=True`` uses the global batch, over the
    strategy's data axis (ModelParallel's is ``"batch"``)."""
    layer = L.BatchNormalization(synchronized=synchronized)
    rows = np.arange(1, 9, dtype=np.float32)[:, None]  # each half with other statistics
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32) * rows
    variables = layer.init(jax.random.key(0), x[:1])
    strategy = _model_parallel()

    def fn(rows):
        y, _ = layer.apply(variables, rows, training=True, mutable=["batch_stats"])
        return y

    got = strategy.gather(strategy.run(fn, (distribute_batch(strategy, x),)), axis=0)
    if synchronized:
        want = layer.apply(variables, x, training=True, mutable=["batch_stats"])[0]
    else:
        halves = [layer.apply(variables, x[i : i + 4], training=True, mutable=["batch_stats"])[0]
                  for i in (0, 4)]  # fmt: skip
        want = np.concatenate(halves)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_moments_over_replicas_are_the_global_batchs():
    x = np.random.default_rng(1).normal(size=(16, 3, 2)).astype(np.float32) * 10 + 100
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("r",))
    mean, var = jax.jit(
        jax.shard_map(
            lambda rows: batch_region.moments(rows, (0, 1), "r"),
            mesh=mesh,
            in_specs=P("r"),
            out_specs=P(),
        )
    )(x)
    np.testing.assert_allclose(mean, x.mean(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_allclose(var, x.var(axis=(0, 1)), rtol=1e-4)


@pytest.mark.parametrize("noise_shape", [None, (None, 1), (1, None)])
def test_keras_dropout_masks_rows_as_one_device_does(noise_shape):
    """Inside a region of 4 replicas, each replica's rows of the output are one device's
    rows (the mask was drawn per replica shape, the same for every replica)."""
    layer = L.Dropout(0.5, noise_shape=noise_shape, seed=3)
    x = np.ones((16, 6), np.float32)
    key = jax.random.key(7)
    want = layer.apply({}, x, training=True, rngs={"dropout": key})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("r",))

    def replica(rows):
        with batch_region.entered(batch_region.Region("r", rows.shape[0])):
            return layer.apply({}, rows, training=True, rngs={"dropout": key})

    got = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=P("r"), out_specs=P("r")))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_keras_batch_norm_leaves_padding_rows_out_of_its_statistics():
    """A batch padded to a static size trains as the same rows unpadded (Keras's smaller
    last batch), on one device and on 8 replicas, whose 20-row batches are padded to 24."""
    x, y = _data(20)
    one = jstrategy.OneDeviceStrategy("cpu:0")

    def first_step(strategy, global_batch_size):
        with strategy.scope():
            state = training.create_train_state(
                KerasNet(rate=0.0), optax.sgd(0.1), jnp.ones((1, FEATURES)), rng=1
            )
            step = training.make_train_step(_loss)
        batch = distribute_batch(strategy, (x, y), global_batch_size=global_batch_size)
        state, logs = step(state, batch)
        return float(logs["loss"]), [np.asarray(v) for v in jax.tree.leaves(state.variables)]

    want = first_step(one, 20)
    for strategy, size in ((one, 32), (jstrategy.MirroredStrategy(), 24)):
        got = first_step(strategy, size)
        np.testing.assert_allclose(got[0], want[0], rtol=TOL)
        for a, b in zip(got[1], want[1], strict=True):
            np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
