"""ParameterServerStrategy and ClusterCoordinator: placement, asynchronous training, failures.

The local backend runs on the 8 fake CPU devices (parameter servers and workers on their own
devices, workers as threads); the Ray backend tests start a real local Ray instance and are
skipped when Ray is not installed. Every wait has a timeout.


"""

from __future__ import annotations

import threading
import time
import warnings

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

import jstrategy
import jstrategy.losses
from jstrategy._src.parameter_server import ray_backend
from jstrategy.cluster_resolver import SimpleClusterResolver
from jstrategy.coordinator import ClusterCoordinator
from jstrategy.coordinator import FunctionCancelledError
from jstrategy.coordinator import NoWorkersAvailableError
from jstrategy.coordinator import ParameterServerFailureError
from jstrategy.coordinator import PerWorkerValues
from jstrategy.coordinator import ShardedVariable
from jstrategy.coordinator import Variable
from jstrategy.coordinator import local_cluster_resolver
from jstrategy.experimental.partitioners import FixedShardsPartitioner
from jstrategy.experimental.partitioners import MinSizePartitioner

pytestmark = pytest.mark.timeout(120)

WAIT = 60  # seconds any single wait may take before the test fails instead of hanging


@pytest.fixture
def cluster():
    """Makes (strategy, coordinator) pairs and shuts their coordinators down afterwards."""
    made = []

    def make(num_workers=2, num_ps=1, **kwargs):
        strategy = jstrategy.ParameterServerStrategy(
            local_cluster_resolver(num_workers=num_workers, num_ps=num_ps), **kwargs
        )
        coordinator = ClusterCoordinator(strategy)
        made.append(coordinator)
        return strategy, coordinator

    yield make
    for coordinator in made:
        coordinator.shutdown()


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def _digits():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    cut = len(x) * 4 // 5
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def _loss(params, x, y):
    logits = MLP().apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


_grad_fn = jax.jit(jax.value_and_grad(_loss))


# ---------------------------------------------------------------------------------------
# Construction and placement
# ---------------------------------------------------------------------------------------
def test_cluster_needs_workers_and_parameter_servers():
    no_ps = SimpleClusterResolver({"chief": ["c:1"], "worker": ["w:1"]}, task_type="chief")
    with pytest.raises(ValueError, match="at least one worker and one ps"):
        jstrategy.ParameterServerStrategy(no_ps)
    as_worker = SimpleClusterResolver(
        {"worker": ["w:1"], "ps": ["p:1"]}, task_type="worker", task_id=0
    )
    with pytest.raises(ValueError, match="runs on the coordinator"):
        jstrategy.ParameterServerStrategy(as_worker)
    with pytest.raises(ValueError, match="`backend` must be 'local' or 'ray'"):
        jstrategy.ParameterServerStrategy(local_cluster_resolver(), backend="spark")
    with pytest.raises(TypeError, match="variable_partitioner"):
        jstrategy.ParameterServerStrategy(local_cluster_resolver(), variable_partitioner=3)
    with pytest.raises(TypeError, match="ParameterServerStrategy"):
        ClusterCoordinator(jstrategy.OneDeviceStrategy("cpu:0"))
    assert jstrategy.experimental.ParameterServerStrategy is jstrategy.ParameterServerStrategy


def test_tasks_get_distinct_devices_and_variables_go_round_robin():
    strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=3, num_ps=2))
    devices = [*strategy.parameter_devices, *strategy.worker_devices]
    assert len(set(devices)) == 5
    first = strategy.create_variables({"a": jnp.zeros(2), "b": jnp.ones(3), "c": jnp.ones(())})
    second = strategy.create_variables([jnp.zeros(4)])
    tasks = [v.ps_task for v in jax.tree.leaves(first.variables)]
    assert tasks == [0, 1, 0]
    assert second.variables[0].ps_task == 1  # the count continues across calls, as in TF
    var = first.variables["b"]
    assert isinstance(var, Variable)
    assert (var.name, var.shape, var.dtype) == ("b", (3,), np.float32)
    assert var.device == "/job:ps/replica:0/task:1/device:CPU:0"
    np.testing.assert_array_equal(var.numpy(), np.ones(3))
    assert var.read_value().devices() == {strategy.devices[0]}


def test_partitioned_variable_uses_tf_layout_and_assembles_on_demand():
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=1, num_ps=5),
        variable_partitioner=FixedShardsPartitioner(5),
    )
    value = np.arange(13 * 2, dtype=np.float32).reshape(13, 2)
    tree = strategy.create_variables({"emb": value, "scale": np.float32(2.0)})
    emb = tree.variables["emb"]
    assert isinstance(emb, ShardedVariable)
    assert [s.shape[0] for s in emb.shards] == [3, 3, 3, 2, 2]
    assert emb.variables == emb.shards
    assert [s.name for s in emb.shards][:2] == ["emb/part_0", "emb/part_1"]
    assert (emb.shape, emb.dtype) == ((13, 2), np.float32)
    assert sorted(s.ps_task for s in emb.shards) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(emb.numpy(), value)
    np.testing.assert_array_equal(emb.shards[3].numpy(), value[9:11])
    # A rank-0 variable is never partitioned.
    assert isinstance(tree.variables["scale"], Variable)
    emb.assign_add(np.ones_like(value))
    np.testing.assert_array_equal(tree.numpy()["emb"], value + 1)
    tree.assign({"emb": value * 0, "scale": 3.0})
    np.testing.assert_array_equal(np.asarray(emb), np.zeros_like(value))
    assert float(tree.numpy()["scale"]) == 3.0


def test_min_size_partitioner_decides_per_variable():
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=1, num_ps=3),
        variable_partitioner=MinSizePartitioner(min_shard_bytes=64, max_shards=3),
    )
    tree = strategy.create_variables({"big": np.zeros((6, 8), np.float32), "small": np.zeros(4)})
    assert [s.shape for s in tree.variables["big"].shards] == [(2, 8)] * 3
    assert isinstance(tree.variables["small"], Variable)  # 32 bytes: one shard


def test_bad_partitioner_result_is_explained():
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=1, num_ps=2),
        variable_partitioner=lambda shape, dtype: [1, 2],
    )
    with pytest.raises(ValueError, match="only the first axis is split"):
        strategy.create_variables({"w": np.zeros((4, 4))})


def test_gradients_need_an_optimizer_and_the_right_structure():
    strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver())
    tree = strategy.create_variables({"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match="needs an optimizer"):
        tree.apply_gradients({"w": jnp.ones(3)})
    with pytest.raises(TypeError, match="optax"):
        strategy.create_variables({"w": jnp.zeros(3)}, optimizer="sgd")
    trained = strategy.create_variables({"w": jnp.zeros(3)}, optimizer=optax.sgd(1.0))
    with pytest.raises(ValueError, match="structure of the variables"):
        trained.apply_gradients([jnp.ones(3)])
    with pytest.raises(ValueError, match=r"must have shape \(3,\)"):
        trained.apply_gradients({"w": jnp.ones(4)})
    trained.apply_gradients({"w": jnp.ones(3)})
    np.testing.assert_allclose(trained.numpy()["w"], -np.ones(3))


# ---------------------------------------------------------------------------------------
# Scheduling
# ---------------------------------------------------------------------------------------
def test_schedule_returns_at_once_and_join_waits(cluster):
    strategy, coordinator = cluster()
    assert ClusterCoordinator(strategy) is coordinator  # one coordinator per strategy
    release = threading.Event()
    blocked = coordinator.schedule(lambda: release.wait(WAIT) and jnp.float32(7.0))
    assert not blocked.done()
    assert not coordinator.done()
    with pytest.raises(TimeoutError, match="join"):
        coordinator.join(timeout=0.05)
    with pytest.raises(TimeoutError, match="did not finish"):
        blocked.fetch(timeout=0.01)
    release.set()
    coordinator.join(timeout=WAIT)
    assert coordinator.done()
    assert blocked.fetch() == 7.0 and isinstance(blocked.fetch(), np.ndarray)
    assert isinstance(blocked.get(), jax.Array)
    squares = [coordinator.schedule(lambda x: x * x, args=(i,)) for i in range(4)]
    out = coordinator.fetch({"squares": squares, "other": "kept"}, timeout=WAIT)
    assert out == {"squares": [0, 1, 4, 9], "other": "kept"}
    with pytest.raises(TypeError, match="`args` must be a tuple"):
        coordinator.schedule(lambda x: x, args=3)
    with pytest.raises(TypeError, match="callable"):
        coordinator.schedule(3)


def test_arguments_resolve_per_worker_and_remote_values(cluster):
    strategy, coordinator = cluster()
    per_worker = PerWorkerValues(["w0", "w1"])
    first = coordinator.schedule(lambda: 5)

    def fn(tag, previous):
        worker = jstrategy.get_strategy()
        return tag, previous, worker is strategy

    results = [coordinator.schedule(fn, args=(per_worker,), kwargs={"previous": first})]
    results += [coordinator.schedule(fn, args=(per_worker, first)) for _ in range(5)]
    coordinator.join(timeout=WAIT)
    for rv in results:
        tag, previous, same = rv.fetch()
        assert tag == f"w{rv._worker_index}"
        assert previous == 5 and same


def test_per_worker_dataset_gives_each_worker_its_own_iterator(cluster):
    strategy, coordinator = cluster(num_workers=2)
    built = []

    def dataset_fn(ctx):
        built.append(ctx.input_pipeline_id)
        worker = ctx.input_pipeline_id
        return [
            (np.full((2,), worker, np.int32), np.full((2,), seq, np.int32)) for seq in range(50)
        ]

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    with pytest.raises(TypeError, match="advanced on the workers"):
        next(iterator)

    def fn(it):
        worker, seq = next(it)
        return worker[0], seq[0], next(iter(worker.devices()))

    results = [coordinator.schedule(fn, args=(iterator,)) for _ in range(20)]
    coordinator.join(timeout=WAIT)
    assert sorted(built) == [0, 1]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for rv in results:
        worker, seq, device = rv.get()
        assert int(worker) == rv._worker_index
        assert device == strategy.worker_devices[rv._worker_index]
        seen[int(worker)].append(int(seq))
    for seqs in seen.values():
        assert seqs == list(range(len(seqs)))  # each worker walks its own dataset in order


def test_strategy_run_inside_a_scheduled_function_uses_the_worker_device(cluster):
    strategy, coordinator = cluster(num_workers=2)

    def fn():
        out = strategy.run(lambda x: x + 1, args=(jnp.zeros(3),))
        (local,) = strategy.experimental_local_results(out)
        return local, strategy.num_replicas_in_sync

    results = [coordinator.schedule(fn) for _ in range(4)]
    coordinator.join(timeout=WAIT)
    for rv in results:
        out, replicas = rv.get()
        assert replicas == 1
        np.testing.assert_array_equal(np.asarray(out), np.ones(3))
        assert out.devices() == {strategy.worker_devices[rv._worker_index]}


def test_updates_are_applied_without_a_barrier_between_workers(cluster):
    strategy, coordinator = cluster(num_workers=2)
    counter = strategy.create_variables({"n": jnp.zeros((), jnp.float32)})
    release = threading.Event()

    def slow():
        # Holds its worker until the other worker's updates have all been applied.
        assert release.wait(WAIT)
        return counter.read()["n"]

    def increment():
        counter.assign_add({"n": 1.0})
        return counter.read()["n"]

    seen_by_slow = coordinator.schedule(slow)
    increments = [coordinator.schedule(increment) for _ in range(10)]
    for rv in increments:
        rv.fetch(timeout=WAIT)  # all done while the other worker is still busy
    assert not seen_by_slow.done()
    release.set()
    assert float(seen_by_slow.fetch(timeout=WAIT)) == 10.0
    assert sorted(float(rv.fetch()) for rv in increments) == list(range(1, 11))


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_one_worker_follows_the_one_device_trajectory(cluster, one_device):
    (x, y), _ = _digits()
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 32 * 15, 32)]
    tx = optax.adam(1e-2)
    params0 = MLP().init(jax.random.key(0), x[:1])["params"]

    # Synchronous reference: OneDeviceStrategy, the same data in the same order.
    @jax.jit
    def reference_step(params, opt_state, bx, by):
        loss, grads = _grad_fn(params, bx, by)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with one_device.scope():
        params = jax.device_put(params0, one_device.devices[0])
        opt_state = tx.init(params)
        ref_losses = []
        for bx, by in batches:
            params, opt_state, loss = reference_step(params, opt_state, bx, by)
            ref_losses.append(float(loss))  # blocks: one step in flight

    strategy, coordinator = cluster(
        num_workers=1, num_ps=2, variable_partitioner=FixedShardsPartitioner(2)
    )
    variables = strategy.create_variables(params0, optimizer=tx)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: batches))

    def step(it):
        bx, by = next(it)
        loss, grads = _grad_fn(variables.read(), bx, by)
        variables.apply_gradients(grads)
        return loss

    losses = [coordinator.schedule(step, args=(iterator,)) for _ in batches]
    coordinator.join(timeout=WAIT)
    np.testing.assert_allclose([float(rv.fetch()) for rv in losses], ref_losses, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, np.asarray(b), atol=1e-5),
        variables.numpy(),
        params,
    )
    # The optimizer state lives beside each variable (per shard for sharded ones).
    kernel_state = variables.opt_state()["Dense_0"]["kernel"]
    assert len(kernel_state) == 2 and int(kernel_state[0][0].count) == len(batches)


@pytest.mark.slow
def test_several_workers_learn_digits(cluster):
    (x, y), (x_test, y_test) = _digits()
    strategy, coordinator = cluster(
        num_workers=4, num_ps=2, variable_partitioner=MinSizePartitioner(1024, max_shards=2)
    )
    params0 = MLP().init(jax.random.key(1), x[:1])["params"]
    variables = strategy.create_variables(params0, optimizer=optax.adam(3e-3))
    assert any(isinstance(v, ShardedVariable) for v in jax.tree.leaves(variables.variables))

    def dataset_fn(ctx):
        # Each worker shuffles its own shard of the training set, for several epochs.
        rows = np.arange(ctx.input_pipeline_id, len(x), ctx.num_input_pipelines)
        rng = np.random.default_rng(ctx.input_pipeline_id)

        def batches():
            for _ in range(20):
                order = rng.permutation(rows)
                for i in range(0, len(order) - 31, 32):
                    yield x[order[i : i + 32]], y[order[i : i + 32]]

        return _Repeatable(batches)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it):
        bx, by = next(it)
        loss, grads = _grad_fn(variables.read(), bx, by)
        variables.apply_gradients(grads)
        return loss

    for _ in range(300):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join(timeout=WAIT)
    logits = MLP().apply({"params": variables.read()}, x_test)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))
    assert accuracy >= 0.9, accuracy


class _Repeatable:
    """An iterable that calls a generator function each time it is iterated."""

    def __init__(self, make):
        self._make = make

    def __iter__(self):
        return self._make()


@pytest.mark.slow
def test_model_fit_trains_on_the_workers(cluster):
    (x, y), (x_test, y_test) = _digits()
    strategy, coordinator = cluster(num_workers=2, num_ps=2)
    with strategy.scope():
        model = jstrategy.Model(MLP(), input_shape=(64,), seed=0)
        model.compile(
            optax.adam(3e-3),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    with pytest.raises(ValueError, match="needs `steps_per_epoch`"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    history = model.fit(x, y, batch_size=32, epochs=5, steps_per_epoch=40, verbose=0)
    assert len(history.history["loss"]) == 5
    assert history.history["loss"][-1] < history.history["loss"][0]
    # The parameters live on the parameter servers; fit copies them back into the model.
    session = model._trainer.fit_runner._session
    assert session.coordinator is coordinator
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)),
        session.params.numpy(),
        model.variables["params"],
    )
    assert int(model.state.step) == 200
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert accuracy >= 0.9, accuracy


@pytest.mark.slow
def test_model_checkpoints_and_weights_restore_onto_the_same_parameter_server_variables(
    cluster, tmp_path
):
    # load_weights and restore_checkpoint read a ParameterServer model's files into its own
    # variables on the servers (no second set), with the servers' optimizer states; a
    # mid-epoch ModelCheckpoint, which could only save stale values, is refused.
    (x, y), _ = _digits()
    x, y = x[:256], y[:256]
    strategy, _ = cluster(num_workers=1, num_ps=2)
    with strategy.scope():
        model = jstrategy.Model(MLP(), input_shape=(64,), seed=0)
        model.compile(
            optax.adam(3e-3), loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    fit = dict(batch_size=32, steps_per_epoch=8, verbose=0, shuffle=False)
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(save_freq=4\) cannot save"):
        model.fit(
            x,
            y,
            epochs=1,
            callbacks=[jstrategy.callbacks.ModelCheckpoint(str(tmp_path / "m"), save_freq=4)],
            **fit,
        )
    checkpoints = str(tmp_path / "checkpoints")
    model.fit(x, y, epochs=1, callbacks=[jstrategy.callbacks.ModelCheckpoint(checkpoints)], **fit)
    after_one = model.get_weights()
    model.save_weights(str(tmp_path / "weights"))
    params = model._trainer.fit_runner._session.params
    model.fit(x, y, epochs=1, **fit)
    after_two = model.get_weights()

    model.load_weights(str(tmp_path / "weights"))
    for a, b in zip(model.get_weights(), after_one, strict=True):
        np.testing.assert_array_equal(a, b)
    model.restore_checkpoint(checkpoints)
    assert int(model.state.step) == 8
    model.fit(x, y, epochs=1, **fit)
    assert model._trainer.fit_runner._session.params is params
    for a, b in zip(model.get_weights(), after_two, strict=True):
        np.testing.assert_array_equal(a, b)  # Adam's state on the servers came back too


@pytest.mark.slow
def test_model_fit_waits_on_the_workers_at_most_timeout_seconds(cluster):
    # A worker that stops answering ends fit with a clear error, not a wait without end:
    # here the loss sleeps while the workers trace it, longer than the bound.
    (x, y), _ = _digits()
    strategy, _ = cluster(num_workers=1, num_ps=1, timeout_seconds=0.5)
    assert strategy.timeout_seconds == 0.5

    def slow_loss(y_true, y_pred):
        time.sleep(6.0)  # once, while the gradient program is traced on the worker
        return jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)(y_true, y_pred)

    with strategy.scope():
        model = jstrategy.Model(MLP(), input_shape=(64,), seed=0)
        model.compile("sgd", loss=slow_loss)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no step of the epoch finished within 0.5 s"):
        model.fit(x[:64], y[:64], batch_size=32, steps_per_epoch=2, verbose=0)
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("value", [0, -1.0, "10", True])
def test_timeout_seconds_must_be_positive_or_none(value):
    with pytest.raises(ValueError, match="`timeout_seconds` must be a positive number"):
        jstrategy.ParameterServerStrategy(
            local_cluster_resolver(num_workers=1, num_ps=1), timeout_seconds=value
        )


# ---------------------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------------------
def _counting_setup(strategy, coordinator, *, wait_for_worker_1=False):
    counter = strategy.create_variables({"n": jnp.zeros((), jnp.float32)})
    built = []
    worker_1_started = threading.Event()

    def dataset_fn(ctx):
        built.append(ctx.input_pipeline_id)
        worker = ctx.input_pipeline_id
        return [(np.int32(worker), np.int32(seq)) for seq in range(1000)]

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it):
        worker, seq = next(it)
        if wait_for_worker_1:
            # Worker 0 waits until worker 1 has started a function, so worker 1 surely runs
            # (and dies in) one.
            if int(worker) == 1:
                worker_1_started.set()
            else:
                assert worker_1_started.wait(WAIT)
        counter.assign_add({"n": 1.0})
        return worker, seq

    return counter, built, iterator, step


def test_dead_worker_functions_run_on_another_worker(cluster):
    strategy, coordinator = cluster(num_workers=2)
    counter, built, iterator, step = _counting_setup(strategy, coordinator, wait_for_worker_1=True)
    coordinator._simulate_worker_failure(1, restart=False)
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(20)]
    coordinator.join(timeout=WAIT)
    assert 1 in built  # worker 1 started a function (and died in it)
    # Every function ran exactly once: the dead worker's attempt never pushed its update,
    # and it ran again on worker 0.
    assert float(counter.numpy()["n"]) == len(results)
    assert {rv._worker_index for rv in results} == {0}
    assert all(int(rv.fetch()[0]) == 0 for rv in results)


def test_restarted_worker_rebuilds_its_dataset(cluster):
    strategy, coordinator = cluster(num_workers=1)
    counter, built, iterator, step = _counting_setup(strategy, coordinator)
    coordinator._simulate_worker_failure(0, restart=True)
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(4)]
    coordinator.join(timeout=WAIT)
    assert float(counter.numpy()["n"]) == len(results)
    assert built == [0, 0]  # the worker built its dataset again after restarting
    # The function that died ran again on the rebuilt dataset, whose iterator started over.
    assert [int(rv.fetch()[1]) for rv in results] == [0, 1, 2, 3]


def test_all_workers_dead_raises_instead_of_hanging(cluster):
    strategy, coordinator = cluster(num_workers=2)
    _, _, iterator, step = _counting_setup(strategy, coordinator)
    coordinator._simulate_worker_failure(0, restart=False)
    coordinator._simulate_worker_failure(1, restart=False)
    results = []
    with pytest.raises(NoWorkersAvailableError, match="Every worker has failed"):
        # Once the coordinator has seen both failures `schedule` raises it too (as TF's
        # ClusterCoordinator does); before that, `join` does. Either way, nothing hangs.
        for _ in range(4):
            results.append(coordinator.schedule(step, args=(iterator,)))
        coordinator.join(timeout=WAIT)
    if results:
        with pytest.raises(FunctionCancelledError):
            results[-1].fetch(timeout=WAIT)


def test_parameter_server_failure_is_fatal(cluster):
    strategy, coordinator = cluster(num_workers=2, num_ps=2)
    variables = strategy.create_variables({"a": jnp.zeros(2), "b": jnp.zeros(2)})
    ok = coordinator.schedule(lambda: variables.read())
    coordinator.join(timeout=WAIT)
    assert set(ok.fetch()) == {"a", "b"}
    coordinator._simulate_parameter_server_failure(1)
    failed = coordinator.schedule(lambda: variables.read())
    with pytest.raises(ParameterServerFailureError, match="ps:1 is unavailable"):
        coordinator.join(timeout=WAIT)
    with pytest.raises(ParameterServerFailureError):
        failed.fetch(timeout=WAIT)
    with pytest.raises(ParameterServerFailureError):
        coordinator.schedule(lambda: 1)
    with pytest.raises(ParameterServerFailureError):
        coordinator.done()
    with pytest.raises(ParameterServerFailureError):
        variables.numpy()


def test_function_error_is_raised_once_and_cancels_pending(cluster):
    _, coordinator = cluster(num_workers=1)
    release = threading.Event()

    def fails():
        raise ValueError("bad batch")

    def blocked():
        return release.wait(WAIT)

    holders = [coordinator.schedule(blocked)]
    error = coordinator.schedule(fails)
    pending = [coordinator.schedule(lambda: 1) for _ in range(5)]
    release.set()
    with pytest.raises(ValueError, match="bad batch"):
        coordinator.join(timeout=WAIT)
    assert all(rv.fetch(timeout=WAIT) for rv in holders)
    with pytest.raises(ValueError, match="bad batch"):
        error.fetch(timeout=WAIT)
    for rv in pending:
        with pytest.raises(FunctionCancelledError, match="Schedule it again"):
            rv.fetch(timeout=WAIT)
    # Raised once: the coordinator is usable again.
    assert coordinator.done()
    assert coordinator.schedule(lambda: 3).fetch(timeout=WAIT) == 3


def test_shutdown_says_when_a_function_outlives_its_timeout(cluster):
    # A worker still running a function when shutdown returns would dispatch its programs
    # among what the program runs next: shutdown waits for it, and says so when it cannot.
    _, coordinator = cluster(num_workers=1)
    started, release = threading.Event(), threading.Event()

    def blocked():
        started.set()
        return release.wait(WAIT)

    running = coordinator.schedule(blocked)
    queued = coordinator.schedule(lambda: 1)
    assert started.wait(WAIT)
    with pytest.raises(TimeoutError, match=r"jstrategy-ps-worker-0 still ran a function"):
        coordinator.shutdown(timeout=0.2)
    release.set()
    assert running.fetch(timeout=WAIT)
    with pytest.raises(FunctionCancelledError):
        queued.fetch(timeout=WAIT)
    (thread,) = coordinator._threads
    thread.join(WAIT)
    assert not thread.is_alive()


# ---------------------------------------------------------------------------------------
# Reads and updates inside strategy.run (TF's step_fn); the stores cannot be corrupted
# ---------------------------------------------------------------------------------------
def _linear_loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _linear_batches(worker, n=64):
    rng = np.random.default_rng(worker)
    x = rng.normal(size=(n, 8, 3)).astype(np.float32)
    return [(xi, xi @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3) for xi in x]


def _tf_step_fn(strategy, variables):
    """TF's step_fn: pull, gradient and push inside run's replica function, then reduce."""

    def step_fn(iterator):
        def replica_fn(x, y):
            loss, grads = jax.value_and_grad(_linear_loss)(variables.read(), x, y)
            variables.apply_gradients(grads)
            return loss

        x, y = next(iterator)
        losses = strategy.run(replica_fn, args=(x, y))
        return strategy.reduce("SUM", losses, axis=None)

    return step_fn


@pytest.mark.slow
def test_updates_inside_run_apply_each_call_and_reduce_works(cluster):
    strategy, coordinator = cluster(num_workers=1, num_ps=2)
    init = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    variables = strategy.create_variables(init, optimizer=optax.sgd(0.1))
    batches = _linear_batches(0, n=6)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: batches))
    losses = [coordinator.schedule(_tf_step_fn(strategy, variables), args=(iterator,))]
    losses += [coordinator.schedule(_tf_step_fn(strategy, variables), args=(iterator,))]

    # Pulled outside run and passed in (the finding's second form): reduce and gather.
    def pulled_outside(it):
        x, y = next(it)
        loss, grads = strategy.run(jax.value_and_grad(_linear_loss), args=(variables.read(), x, y))
        variables.apply_gradients(grads)
        (local,) = strategy.experimental_local_results(loss)
        np.testing.assert_array_equal(strategy.gather(grads["w"], axis=0), local_grad(grads))
        return strategy.reduce("SUM", loss, axis=None), strategy.reduce("MEAN", loss), local

    def local_grad(grads):
        (local,) = strategy.experimental_local_results(grads["w"])
        return local

    rest = [coordinator.schedule(pulled_outside, args=(iterator,)) for _ in range(4)]
    coordinator.join(timeout=WAIT)

    params, expected = init, []
    for x, y in batches:
        loss, grads = jax.value_and_grad(_linear_loss)(params, x, y)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        expected.append(float(loss))
    got = [float(rv.fetch()) for rv in losses] + [float(rv.fetch()[0]) for rv in rest]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert all(float(a) == float(b) == float(c) for a, b, c in (rv.fetch() for rv in rest))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5),
        variables.numpy(),
        params,
    )


def test_updates_inside_run_work_on_the_coordinator_too():
    strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver())
    counter = strategy.create_variables({"n": jnp.zeros((), jnp.int32)})

    def count(k):
        total = counter.read()["n"] + k  # the value at this call, not at tracing
        counter.assign_add({"n": k})
        return total

    totals = [strategy.run(count, args=(jnp.int32(k),)) for k in (1, 2, 3)]
    assert [int(strategy.reduce("SUM", t, axis=None)) for t in totals] == [1, 3, 6]
    assert int(counter.numpy()["n"]) == 6


def test_a_function_recompiled_at_every_call_is_named():
    strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver())
    counter = strategy.create_variables({"n": jnp.zeros(())})

    def step(k):
        x = jnp.float32(k)

        def replica_fn():  # closes over a new array at every call
            counter.assign_add({"n": x})

        strategy.run(replica_fn)

    with pytest.warns(RuntimeWarning, match=r"compiled .*replica_fn 8 times.*\['x'\]"):
        for k in range(8):
            step(k)
    assert float(counter.numpy()["n"]) == sum(range(8))


def _assert_unchanged(variables, before):
    jax.tree.map(np.testing.assert_array_equal, variables.numpy(), before)


@pytest.mark.slow
def test_user_errors_never_corrupt_the_stores(cluster):
    strategy, coordinator = cluster(
        num_workers=1, num_ps=2, variable_partitioner=FixedShardsPartitioner(2)
    )
    variables = strategy.create_variables(
        {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}, optimizer=optax.sgd(1.0)
    )
    before = variables.numpy()
    grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}

    # A push of traced values escaping from jax.grad.
    with pytest.raises(TypeError, match="traced value"):
        jax.grad(lambda g: (variables.assign(g), jnp.sum(g["b"]))[1])(grads)
    # An update or a read that would happen once, while jax.jit traces.
    with pytest.raises(RuntimeError, match="once, when the function is traced"):
        jax.jit(lambda g: variables.apply_gradients(g))(grads)
    with pytest.raises(RuntimeError, match="once, when the function is traced"):
        jax.jit(lambda: variables.assign_add({"w": 1.0, "b": 1.0}))()
    with pytest.raises(RuntimeError, match="once, when the function is traced"):
        jax.jit(lambda: variables.read()["b"])()
    # Wrong shapes and types, for trees, variables and sharded variables.
    w, b = variables.variables["w"], variables.variables["b"]
    with pytest.raises(ValueError, match=r"must have shape \(3, 2\)"):
        variables.apply_gradients({"w": jnp.ones((2, 3)), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"'b' must have its shape \(2,\)"):
        b.assign(jnp.ones(3))
    with pytest.raises(ValueError, match=r"'w' must have its shape \(3, 2\)"):
        w.assign_add(np.ones((3, 3)))
    with pytest.raises(TypeError, match="must be a real numeric array; got dtype <U1"):
        variables.assign({"w": "a", "b": 1.0})
    with pytest.raises(TypeError, match="numeric array"):
        b.assign_sub(jax.random.key(0))
    # The store itself refuses what the clients would never send.
    ps0 = strategy._backend.store(0).store
    var_id = w.shards[0]._id
    with pytest.raises(ValueError, match="must be a numeric array of that shape"):
        ps0.apply([var_id], "assign", [np.ones(5, np.float32)])
    with pytest.raises(TypeError, match="traced value"):
        jax.jit(lambda x: ps0.apply([var_id], "assign", [x]))(jnp.ones((2, 2)))
    _assert_unchanged(variables, before)

    # Inside run: an update then a read of the same variables; an error after an update;
    # a host copy inside the traced function. None of them pushes anything.
    def read_after_update():
        variables.apply_gradients(grads)
        return variables.read()["b"]

    def fails_after_update():
        variables.apply_gradients(grads)
        raise ValueError("bad batch")

    with pytest.raises(
        ValueError, match=r"reads \['b/part_0', 'b/part_1', 'w/part_0', 'w/part_1'\] after"
    ):
        coordinator.schedule(lambda: strategy.run(read_after_update))
        coordinator.join(timeout=WAIT)
    with pytest.raises(ValueError, match="bad batch"):
        coordinator.schedule(lambda: strategy.run(fails_after_update))
        coordinator.join(timeout=WAIT)
    with pytest.raises(RuntimeError, match="no value is on the host yet"):
        strategy.run(lambda: variables.numpy())
    _assert_unchanged(variables, before)

    # The stores are intact: training goes on from the same values.
    batches = _linear_batches(0, n=2)
    trained = strategy.create_variables(
        {"w": jnp.zeros(3), "b": jnp.zeros(())}, optimizer=optax.sgd(0.1)
    )
    iterator = iter(coordinator.create_per_worker_dataset(lambda: batches))
    coordinator.schedule(_tf_step_fn(strategy, trained), args=(iterator,))
    coordinator.schedule(lambda: variables.apply_gradients(grads))
    coordinator.join(timeout=WAIT)
    np.testing.assert_array_equal(variables.numpy()["b"], before["b"] - 1)
    assert np.isfinite(trained.numpy()["w"]).all() and trained.numpy()["w"].any()


# ---------------------------------------------------------------------------------------
# Ray backend: a real local Ray instance; workers and parameter servers are actors
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    import sys

    # Scheduled functions defined here travel to the worker processes by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = not ray.is_initialized()
    if started:
        with warnings.catch_warnings():
            # Ray starts its daemons with fork+exec; JAX warns about any fork.
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
            # Loopback only, as the library's own local Ray (nothing listens on the world).
            with ray_backend._loopback_node_address():
                ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _wait_for_file(path, timeout=WAIT):
    import os
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


@pytest.mark.multiprocess
def test_ray_workers_train_and_survive_a_killed_worker(ray_instance, tmp_path, monkeypatch):
    import json
    import os

    tf_config = {
        "cluster": {
            "chief": ["localhost:30000"],
            "worker": ["localhost:30001", "localhost:30002"],
            "ps": ["localhost:30003"],
        },
        "task": {"type": "chief", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    strategy = jstrategy.ParameterServerStrategy(backend="ray")
    assert (strategy.num_workers, strategy.num_ps) == (2, 1)
    coordinator = ClusterCoordinator(strategy)
    try:
        counter = strategy.create_variables({"n": jnp.zeros((), jnp.float32)})
        weights = strategy.create_variables({"w": jnp.zeros(3)}, optimizer=optax.sgd(0.5))

        def dataset_fn(ctx):
            worker = ctx.input_pipeline_id
            return [(np.int32(worker), np.int32(seq)) for seq in range(1000)]

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        died = str(tmp_path / "worker_1_died")
        back = str(tmp_path / "worker_1_back")

        def step(it, phase):
            worker, seq = next(it)
            if int(worker) == 1 and phase == 0 and not os.path.exists(died):
                open(died, "w").close()
                os._exit(1)  # the worker's process dies mid-function, before its push
            if int(worker) == 1 and phase == 1:
                open(back, "w").close()
            if int(worker) == 0:
                # Worker 0 waits until worker 1 has run in this phase, so both phases
                # surely exercise worker 1.
                _wait_for_file(died if phase == 0 else back)
            counter.assign_add({"n": 1.0})
            weights.apply_gradients({"w": jnp.ones(3)})
            return worker, seq, weights.read()["w"].sum()

        first = [coordinator.schedule(step, args=(iterator, 0)) for _ in range(6)]
        coordinator.join(timeout=WAIT)
        assert os.path.exists(died)
        second = [coordinator.schedule(step, args=(iterator, 1)) for _ in range(6)]
        coordinator.join(timeout=WAIT)
        assert float(counter.numpy()["n"]) == len(first) + len(second)  # each ran once
        np.testing.assert_allclose(weights.numpy()["w"], -0.5 * 12 * np.ones(3))
        # Worker 1 consumed its batch 0 and died; the restarted worker rebuilt its dataset,
        # so its results (in schedule order) start over at batch 0.
        seqs = [int(rv.fetch()[1]) for rv in first + second if int(rv.fetch()[0]) == 1]
        assert seqs and seqs == list(range(len(seqs)))
    finally:
        coordinator.shutdown()
        strategy._backend.shutdown()


@pytest.mark.multiprocess
def test_ray_parameter_server_death_is_fatal(ray_instance):
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=1, num_ps=2), backend="ray"
    )
    coordinator = ClusterCoordinator(strategy)
    try:
        variables = strategy.create_variables({"a": jnp.ones(2), "b": jnp.ones(2)})
        total = coordinator.schedule(lambda: sum(v.sum() for v in variables.read().values()))
        assert float(total.fetch(timeout=WAIT)) == 4.0
        coordinator._simulate_parameter_server_failure(1)
        coordinator.schedule(lambda: variables.read())
        with pytest.raises(ParameterServerFailureError, match="ps:1 is unavailable"):
            coordinator.join(timeout=WAIT)
        with pytest.raises(ParameterServerFailureError):
            coordinator.schedule(lambda: 1)
    finally:
        coordinator.shutdown()
        strategy._backend.shutdown()


@pytest.mark.multiprocess
def test_ray_calls_that_hang_end_within_timeout_seconds(ray_instance):
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=1, num_ps=1), backend="ray", timeout_seconds=1.0
    )
    coordinator = ClusterCoordinator(strategy)
    try:
        stuck = coordinator.schedule(lambda: time.sleep(4.0))
        with pytest.raises(TimeoutError, match=r"worker:0 did not answer within 1 s"):
            stuck.fetch(timeout=WAIT)
    finally:
        coordinator.shutdown()
        strategy._backend.shutdown()


@pytest.mark.multiprocess
def test_ray_tf_step_fn_updates_inside_run_and_bad_updates_are_refused(ray_instance):
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=2, num_ps=1), backend="ray"
    )
    coordinator = ClusterCoordinator(strategy)
    try:
        variables = strategy.create_variables(
            {"w": jnp.zeros(3), "b": jnp.zeros(())}, optimizer=optax.sgd(0.05)
        )
        iterator = iter(
            coordinator.create_per_worker_dataset(
                lambda ctx: _linear_batches(ctx.input_pipeline_id)
            )
        )
        step_fn = _tf_step_fn(strategy, variables)
        losses = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(40)]
        coordinator.join(timeout=WAIT)
        losses = [float(rv.fetch()) for rv in losses]
        assert np.mean(losses[-5:]) < np.mean(losses[:5]) / 4, losses

        before = variables.numpy()
        coordinator.schedule(
            lambda: strategy.run(lambda: variables.assign({"w": jnp.ones(4), "b": 0.0}))
        )
        with pytest.raises(ValueError, match=r"must have shape \(3,\)"):
            coordinator.join(timeout=WAIT)
        total = coordinator.schedule(lambda: variables.read()["w"].sum())
        np.testing.assert_allclose(float(total.fetch(timeout=WAIT)), before["w"].sum(), rtol=1e-6)
        jax.tree.map(np.testing.assert_array_equal, variables.numpy(), before)
    finally:
        coordinator.shutdown()
        strategy._backend.shutdown()


# TF habits (issue 14), finding 7: BackupAndRestore under ParameterServerStrategy
class _Crash(Exception):
    pass


def _ps_model(stop, num_workers=1):
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=num_workers, num_ps=2),
        variable_partitioner=jstrategy.experimental.partitioners.FixedShardsPartitioner(2),
    )
    stop(strategy)
    with strategy.scope():
        model = jstrategy.Model(nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)]), (3,))
        model.compile(jstrategy.optimizers.Adam(0.05), loss="mse")
    return model


@pytest.mark.slow
def test_backup_and_restore_under_parameter_servers_resumes_the_epoch_exactly(
    tmp_path, shut_down_coordinators
):
    x, y = helpers.regression_data(32)
    fit = dict(batch_size=8, epochs=4, steps_per_epoch=4, verbose=0)
    uninterrupted = _ps_model(shut_down_coordinators)
    uninterrupted.fit(x, y, **fit)

    backup_dir = str(tmp_path / "backup")

    def crash(epoch, logs):
        if epoch == 1:
            raise _Crash()

    interrupted = _ps_model(shut_down_coordinators)
    with pytest.raises(_Crash):
        interrupted.fit(
            x,
            y,
            callbacks=[
                jstrategy.callbacks.BackupAndRestore(backup_dir),
                jstrategy.callbacks.LambdaCallback(on_epoch_end=crash),
            ],
            **fit,
        )
    resumed = _ps_model(shut_down_coordinators)  # a new process would build the same model
    history = resumed.fit(x, y, callbacks=[jstrategy.callbacks.BackupAndRestore(backup_dir)], **fit)
    assert history.epoch == [2, 3]  # epochs 0 and 1 were backed up
    # One worker applies its updates in order: the optimizer state (Adam's moments on the
    # parameter servers) came back too, so the run ends where the uninterrupted one did.
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_learning_rate_schedule_reaches_the_parameter_servers(shut_down_coordinators):
    # Before, the rate was set in the coordinator's copy of the optimizer state only.
    x, y = helpers.regression_data(32)
    fit = dict(batch_size=8, steps_per_epoch=4, verbose=0)
    scheduled, untrained = _ps_model(shut_down_coordinators), _ps_model(shut_down_coordinators)
    scheduled.fit(
        x,
        y,
        epochs=2,
        callbacks=[jstrategy.callbacks.LearningRateScheduler(lambda epoch: 0.0)],
        **fit,
    )
    before = untrained.get_weights()
    assert all(
        np.array_equal(a, b) for a, b in zip(scheduled.get_weights(), before, strict=True)
    )  # a zero rate applied: nothing moved
