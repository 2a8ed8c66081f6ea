"""CentralStorageStrategy: one copy in host memory, compute replicated, update applied once.

The parameterized suite (`strategy` fixture, tests/conftest.py) already runs `run`,
`reduce`, datasets and the 20-step trajectory test under CentralStorage with 1 and 8
compute devices; this file checks what is particular to it.
"""

import functools
import gc
import importlib.util
import sys
from pathlib import Path

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import make_single_device_sharding

import jstrategy
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch

ROOT = Path(__file__).resolve().parents[1]
FEATURES = 5
# Shapes no other array in the process has, to find stray copies of this kernel.
HIDDEN = 37


def _memory_benchmark():
    spec = importlib.util.spec_from_file_location("memory_bench", ROOT / "benchmarks/memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


class Net(nn.Module):
    """Dense, synchronized BatchNorm, Dropout, Dense."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(HIDDEN)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=jstrategy.REPLICA_AXIS)(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _data(rows=64, seed=0):
    return helpers.classification_data(rows, FEATURES, seed)


def _memory_kinds(tree):
    return {
        s.data.sharding.memory_kind for x in jax.tree.leaves(tree) for s in x.addressable_shards
    }


def _assert_central(tree, device):
    for x in jax.tree.leaves(tree):
        assert [s.device for s in x.addressable_shards] == [device]  # exactly one copy
        assert x.sharding == make_single_device_sharding(device, memory_kind="pinned_host")


# Construction ---------------------------------------------------------------------------------
def test_defaults_compute_on_every_device_and_store_in_host_memory():
    strategy = jstrategy.experimental.CentralStorageStrategy()
    assert jstrategy.experimental.CentralStorageStrategy is jstrategy.CentralStorageStrategy
    assert strategy.num_replicas_in_sync == 8
    assert strategy.compute_devices == tuple(jax.devices())
    assert strategy.parameter_device == jax.devices()[0]
    leaf = jax.ShapeDtypeStruct((3,), jnp.float32)
    assert strategy.variable_sharding(leaf) == make_single_device_sharding(
        jax.devices()[0], memory_kind="pinned_host"
    )
    assert strategy.batch_sharding() == jstrategy.MirroredStrategy().batch_sharding()


def test_one_compute_device_keeps_variables_in_its_device_memory():
    strategy = jstrategy.CentralStorageStrategy(compute_devices=["/cpu:3"])
    placed = training.place_state({"w": jnp.ones(4)}, strategy)
    assert placed["w"].sharding == strategy.replicated_sharding()
    assert _memory_kinds(placed) == {"device"}
    assert [s.device for s in placed["w"].addressable_shards] == [jax.devices()[3]]


@pytest.mark.slow
def test_parameter_device_chooses_whose_host_memory():
    strategy = jstrategy.CentralStorageStrategy(
        compute_devices=["cpu:2", "cpu:3"], parameter_device="cpu:3"
    )
    _assert_central(training.place_state({"w": jnp.ones(4)}, strategy), jax.devices()[3])
    with strategy.scope():
        state = training.create_train_state(Net(), optax.sgd(0.1), jnp.ones((1, FEATURES)))
        step = training.make_train_step(_loss)
    state, _ = step(state, distribute_batch(strategy, _data(8)))
    _assert_central(state, jax.devices()[3])  # updated on cpu:3, written back there
    # Naming a single compute device's own host memory is allowed too.
    alone = jstrategy.CentralStorageStrategy(compute_devices=["cpu:1"], parameter_device="cpu:1")
    assert alone.variable_sharding(jax.ShapeDtypeStruct((), jnp.float32)).memory_kind in (
        None,
        "device",
    )


def test_invalid_devices_are_explained():
    with pytest.raises(ValueError, match=r"`compute_devices` must be non-empty; got \[\]"):
        jstrategy.CentralStorageStrategy(compute_devices=[])
    with pytest.raises(ValueError, match="`parameter_device` must be one of the compute devices"):
        jstrategy.CentralStorageStrategy(
            compute_devices=["cpu:0", "cpu:1"], parameter_device="cpu:5"
        )
    with pytest.raises(ValueError, match="does not exist|not found|no device"):
        jstrategy.CentralStorageStrategy(compute_devices=["cpu:0"], parameter_device="cpu:99")


# Memory, measured ------------------------------------------------------------------------------
@pytest.mark.slow
def test_memory_benchmark_figures():
    bench = _memory_benchmark()
    figures = {
        name: bench.measure(name, make, steps=2, hidden=16)
        for name, make in bench.STRATEGIES.items()
    }
    one, mirrored, central = (
        figures["OneDevice"],
        figures["Mirrored (8)"],
        figures["CentralStorage (8)"],
    )
    size = one.one_copy
    assert size > 0 and mirrored.one_copy == central.one_copy == size
    assert (one.device, one.host) == (size, 0)
    assert (mirrored.device, mirrored.host) == (8 * size, 0)
    assert (central.device, central.host) == (0, size)
    # Nothing parameter-sized lingers in device memory between CentralStorage steps.
    assert central.other_device < size
    # Per device: a full copy under Mirrored, a fraction where variables are split.
    assert one.per_device == mirrored.per_device == 1.0 and central.per_device == 0.0
    assert figures["FSDP (8)"].per_device < 0.5 and figures["ModelParallel (2x4)"].per_device < 0.5


@pytest.mark.slow
def test_no_copy_of_the_parameters_stays_on_the_devices_between_steps():
    strategy = jstrategy.CentralStorageStrategy()
    x, y = _data()
    with strategy.scope():
        state = training.create_train_state(Net(), optax.adam(1e-2), jnp.ones((1, FEATURES)))
        step = training.make_train_step(_loss)
    _assert_central(
        (state.params, state.opt_state, state.batch_stats, state.step), strategy.devices[0]
    )
    kernel = state.params["Dense_0"]["kernel"]
    batch = distribute_batch(strategy, (x, y))
    for _ in range(3):
        state, metrics = step(state, batch)
        dispatch.track(metrics)
    jax.block_until_ready(state)
    assert kernel.is_deleted()  # the update overwrote the central copy in place (donation)
    _assert_central(state, strategy.devices[0])
    gc.collect()
    stray = [
        a
        for a in jax.live_arrays()
        if not a.is_deleted()
        and a.shape == (FEATURES, HIDDEN)
        and any(s.data.sharding.memory_kind == "device" for s in a.addressable_shards)
    ]
    assert stray == []


def test_update_is_applied_once_on_the_parameter_device():
    strategy = jstrategy.CentralStorageStrategy(compute_devices=[f"cpu:{i}" for i in range(4)])
    x, y = _data(16)
    with strategy.scope():
        state = training.create_train_state(Net(), optax.sgd(0.1), jnp.ones((1, FEATURES)))
        step = training.make_train_step(_loss)
    hlo = step.lower(state, distribute_batch(strategy, (x, y))).as_text()
    # The replicas' program all-reduces gradients and never sees the optimizer state.
    assert "all-reduce" in hlo or "all_reduce" in hlo
    new_state, _ = step(state, distribute_batch(strategy, (x, y)))
    assert int(new_state.step) == 1
    _assert_central(new_state, strategy.devices[0])


# Model, run and checkpoints -------------------------------------------------------------------
def _model(strategy, spe=1):
    with strategy.scope():
        model = jstrategy.Model(Net(), input_shape=(FEATURES,), seed=0)
        model.compile(
            optax.sgd(0.1, momentum=0.9), _loss, metrics=["accuracy"], steps_per_execution=spe
        )
    return model


@pytest.mark.slow
@pytest.mark.parametrize("spe", [1, 3])
def test_model_fit_evaluate_predict_match_mirrored(spe):
    x, y = _data(80)  # 5 batches of 16: with spe=3 one execution of 3 steps, one of 2
    central = _model(jstrategy.CentralStorageStrategy(), spe=spe)
    # Same replicas, so the same dropout masks: only where the state lives differs.
    oracle = _model(jstrategy.MirroredStrategy(), spe=spe)
    histories = [
        m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        for m in (central, oracle)
    ]
    np.testing.assert_allclose(histories[0]["loss"], histories[1]["loss"], atol=1e-5)
    for a, b in zip(central.get_weights(), oracle.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    _assert_central(central.variables, jax.devices()[0])
    _assert_central(central.state.opt_state, jax.devices()[0])
    np.testing.assert_allclose(
        central.evaluate(x, y, batch_size=16, verbose=0),
        oracle.evaluate(x, y, batch_size=16, verbose=0),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        central.predict(x[:7], verbose=0), oracle.predict(x[:7], verbose=0), atol=1e-5
    )


@pytest.mark.slow
def test_fit_on_a_list_of_batches_and_weights_stay_central():
    x, y = _data(48)
    strategy = jstrategy.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    model = _model(strategy, spe=2)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)]
    history = model.fit(batches, epochs=2, verbose=0).history
    assert history["loss"][1] < history["loss"][0]
    model.set_weights([w * 0 for w in model.get_weights()])
    _assert_central(model.variables, jax.devices()[0])
    assert all(not np.any(w) for w in model.get_weights())
    table = []
    model.summary(print_fn=table.append)
    assert "Total params" in table[0]


NnxNet = functools.partial(helpers.NnxNet, features=FEATURES, hidden=HIDDEN)


@pytest.mark.slow
def test_nnx_model_fits_with_central_storage():
    x, y = _data(32)
    models = []
    for strategy in (jstrategy.CentralStorageStrategy(), jstrategy.MirroredStrategy()):
        with strategy.scope():
            model = jstrategy.Model(NnxNet(nnx.Rngs(0)), input_shape=(FEATURES,))
            model.compile(optax.adam(1e-2), _loss)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    central, mirrored = models
    _assert_central((central.state.params, central.state.opt_state), jax.devices()[0])
    for a, b in zip(central.get_weights(), mirrored.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_state_placed_by_another_strategy_is_rejected():
    mirrored = jstrategy.MirroredStrategy()
    with mirrored.scope():
        state = training.create_train_state(Net(), optax.sgd(0.1), jnp.ones((1, FEATURES)))
    step = training.make_train_step(_loss, strategy=jstrategy.CentralStorageStrategy())
    with pytest.raises(ValueError, match="not placed on the step's strategy"):
        step(state, _data(16))


def test_run_reads_centrally_stored_arrays():
    strategy = jstrategy.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    w = training.place_state(jnp.arange(3.0), strategy)
    assert _memory_kinds(w) == {"pinned_host"}

    def fn(w):
        ctx = jstrategy.get_replica_context()
        return ctx.all_reduce("SUM", w * (ctx.replica_id_in_sync_group + 1))

    out = strategy.run(fn, args=(w,))
    np.testing.assert_allclose(np.asarray(out), [0.0, 3.0, 6.0])


def test_checkpoint_restores_into_central_storage(tmp_path):
    mirrored = jstrategy.MirroredStrategy()
    with mirrored.scope():
        state = training.create_train_state(Net(), optax.adam(0.1), jnp.ones((1, FEATURES)))
    state = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
    central = jstrategy.CentralStorageStrategy()
    with jstrategy.CheckpointManager(tmp_path) as manager:
        manager.save(1, state)
        manager.wait_until_finished()
        restored = manager.restore(target=state, strategy=central)
    _assert_central(restored, central.devices[0])
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
