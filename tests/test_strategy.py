"""The Strategy API, run over every strategy with OneDeviceStrategy's numbers as the oracle."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy._src import dispatch


def _per_replica(strategy, fn):
    return strategy.experimental_distribute_values_from_function(fn)


def test_run_once_per_replica_with_replica_ids(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        ctx = jstrategy.get_replica_context()
        return ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync

    ids, count = strategy.run(fn)
    assert [int(i) for i in strategy.experimental_local_results(ids)] == list(range(n))
    assert int(count) == n  # a Python int is the same everywhere: a mirrored value


def test_run_splits_per_replica_and_broadcasts_the_rest(strategy):
    n = strategy.num_replicas_in_sync
    x = _per_replica(strategy, lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.float32))
    whole = np.arange(3, dtype=np.float32)

    def fn(x, whole, *, scale):
        return x * scale, whole.sum() + 0 * x[0]

    scaled, summed = strategy.run(fn, args=(x, whole), kwargs={"scale": 10.0})
    assert isinstance(scaled, jstrategy.PerReplica)
    results = strategy.experimental_local_results(scaled)
    np.testing.assert_allclose(np.stack(results), np.repeat(np.arange(n)[:, None] * 10.0, 2, 1))
    assert [float(s) for s in strategy.experimental_local_results(summed)] == [3.0] * n


def test_run_is_cached(strategy):
    traces = []

    def fn(x):
        traces.append(1)
        return jstrategy.get_replica_context().all_reduce("SUM", x)

    x = _per_replica(strategy, lambda ctx: np.ones(4, np.float32))
    strategy.run(fn, (x,))
    after_first = len(traces)
    for _ in range(3):
        strategy.run(fn, (x,))
    assert len(traces) == after_first
    # New shapes trace again; old shapes still hit the cache.
    strategy.run(fn, (_per_replica(strategy, lambda ctx: np.ones(5, np.float32)),))
    assert len(traces) > after_first


def test_static_python_arguments_are_part_of_the_key(strategy):
    def fn(x, mode):
        return x * (2.0 if mode == "double" else 3.0)

    x = jnp.ones(())
    assert float(strategy.reduce("MEAN", strategy.run(fn, (x, "double")))) == 2.0
    assert float(strategy.reduce("MEAN", strategy.run(fn, (x, "triple")))) == 3.0
    with pytest.raises(TypeError, match="must be hashable"):
        strategy.run(fn, (x, {"unhashable", "set"}))


@pytest.mark.slow
def test_reduce_sum_and_mean(strategy):
    n = strategy.num_replicas_in_sync
    v = _per_replica(
        strategy,
        lambda ctx: np.arange(6, dtype=np.float32).reshape(2, 3) + ctx.replica_id_in_sync_group,
    )
    all_values = np.stack([np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(n)])
    np.testing.assert_allclose(strategy.reduce("SUM", v, axis=None), all_values.sum(0), rtol=1e-6)
    np.testing.assert_allclose(strategy.reduce("MEAN", v, axis=None), all_values.mean(0), rtol=1e-6)
    # With an axis, MEAN divides by the element count across all replicas, as TF.
    np.testing.assert_allclose(
        strategy.reduce(jstrategy.ReduceOp.MEAN, v, axis=0), all_values.mean((0, 1)), rtol=1e-6
    )
    np.testing.assert_allclose(strategy.reduce("SUM", v, axis=1), all_values.sum((0, 2)), rtol=1e-6)


def test_reduce_pytree_and_mirrored_values(strategy):
    n = strategy.num_replicas_in_sync
    tree = {"a": _per_replica(strategy, lambda ctx: float(ctx.replica_id_in_sync_group)), "b": 2.0}
    out = strategy.reduce("SUM", tree, axis=None)
    assert float(out["a"]) == sum(range(n))
    assert float(out["b"]) == 2.0 * n  # a plain value is the same on every replica
    assert float(strategy.reduce("MEAN", tree, axis=None)["b"]) == 2.0


@pytest.mark.slow
def test_gather(strategy):
    n = strategy.num_replicas_in_sync
    v = _per_replica(strategy, lambda ctx: np.full((2, 3), ctx.replica_id_in_sync_group, np.int32))
    g0 = strategy.gather(v, axis=0)
    assert g0.shape == (2 * n, 3)
    np.testing.assert_array_equal(g0[:, 0], np.repeat(np.arange(n), 2))
    g1 = strategy.gather(v, axis=1)
    assert g1.shape == (2, 3 * n)
    np.testing.assert_array_equal(g1[0], np.repeat(np.arange(n), 3))

    def fn(x):
        return jstrategy.get_replica_context().all_gather(x, axis=0)

    in_replica = strategy.run(fn, (v,))
    np.testing.assert_array_equal(in_replica, g0)  # identical on every replica: mirrored


def test_outputs_on_a_single_device_sharding_reduce_and_gather():
    # jit gives a one-device program's outputs a SingleDeviceSharding, which names no mesh:
    # reduce raised AttributeError: 'SingleDeviceSharding' object has no attribute 'mesh'.
    strategy = jstrategy.OneDeviceStrategy("cpu:1")
    x = jax.device_put(jnp.arange(4.0), jax.devices()[1])
    out = strategy.run(lambda a: a * 2, args=(x,))
    assert not hasattr(out.value.sharding, "mesh")
    expected = np.arange(4.0) * 2
    np.testing.assert_array_equal(strategy.reduce("SUM", out, axis=None), expected)
    np.testing.assert_array_equal(strategy.reduce("MEAN", out, axis=0), expected.mean())
    np.testing.assert_array_equal(strategy.gather(out, axis=0), expected)
    # The cross-device op alone: the devices holding the value are its replicas.
    np.testing.assert_array_equal(jstrategy.NcclAllReduce().reduce("SUM", out), expected)
    # A hand-made PerReplica on one device counts as the strategy's replicas.
    mirrored = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    stacked = jstrategy.PerReplica(jax.device_put(np.array([[1.0], [2.0]]), jax.devices()[0]))
    np.testing.assert_array_equal(mirrored.reduce("SUM", stacked, axis=None), [3.0])
    np.testing.assert_array_equal(mirrored.gather(stacked, axis=0), [1.0, 2.0])


def test_all_reduce_gradients_follow_tf(strategy):
    """TF's _test_all_reduce_*_gradients: inputs c=[1, 3, ...], y = all_reduce(x) * c."""
    n = strategy.num_replicas_in_sync
    c = _per_replica(strategy, lambda ctx: float(2 * ctx.replica_id_in_sync_group + 1))
    x = _per_replica(strategy, lambda ctx: 42.0)

    def fn(c, x, op):
        ctx = jstrategy.get_replica_context()
        return ctx.all_reduce(op, x), jax.grad(lambda x: ctx.all_reduce(op, x) * c)(x)

    total, grads = strategy.run(fn, (c, x, "SUM"))
    assert float(total) == 42.0 * n
    expected = float(sum(2 * i + 1 for i in range(n)))  # [1, 3] -> 4 on two replicas
    assert [float(g) for g in strategy.experimental_local_results(grads)] == [expected] * n
    mean, grads = strategy.run(fn, (c, x, "MEAN"))
    assert float(mean) == 42.0
    assert [float(g) for g in strategy.experimental_local_results(grads)] == [expected / n] * n


def test_distribute_values_from_function_validates(strategy):
    if strategy.num_replicas_in_sync == 1:
        pytest.skip("needs two replicas to disagree")
    with pytest.raises(ValueError, match="same shape and dtype for every replica"):
        _per_replica(strategy, lambda ctx: np.zeros(ctx.replica_id_in_sync_group + 1))
    with pytest.raises(ValueError, match="same structure for every replica"):
        _per_replica(strategy, lambda ctx: (1.0,) * (ctx.replica_id_in_sync_group + 1))


def test_local_results_of_plain_values():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    assert strategy.experimental_local_results(3.0) == (3.0,)
    mirrored = strategy.run(lambda: jnp.ones(2))
    assert len(strategy.experimental_local_results(mirrored)) == 2


def test_run_argument_errors():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    with pytest.raises(TypeError, match="`fn` must be callable"):
        strategy.run(3)
    with pytest.raises(TypeError, match="`args` must be a tuple or list"):
        strategy.run(lambda x: x, args=jnp.ones(2))
    with pytest.raises(
        TypeError,
        match=r"`kwargs` must be a dict of keyword arguments for `fn`; got list \[1, 2\]\. "
        r"Pass kwargs=\{'name': value\}",
    ):
        strategy.run(lambda *a: a, kwargs=[1, 2])
    two = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="has 2 replicas but this strategy has 1"):
        strategy.run(
            lambda x: x,
            (two.run(lambda: jstrategy.get_replica_context().replica_id_in_sync_group),),
        )
    with pytest.raises(TypeError, match="`cross_device_ops` must be a jstrategy.CrossDeviceOps"):
        jstrategy.MirroredStrategy(cross_device_ops="nccl")


def test_replicated_arguments_are_per_replica_copies_as_in_tf(strategy):
    """The gradient w.r.t. a replicated argument is the replica's own; all_reduce sums them."""
    n = strategy.num_replicas_in_sync
    x = _per_replica(strategy, lambda ctx: float(ctx.replica_id_in_sync_group + 1))

    def fn(w, x):
        ctx = jstrategy.get_replica_context()
        local = jax.grad(lambda w: w * x)(w)
        return local, ctx.all_reduce("SUM", local), w * 1.0

    local, total, same = strategy.run(fn, (jnp.float32(2.0), x))
    assert [float(g) for g in strategy.experimental_local_results(local)] == [
        float(i + 1) for i in range(n)
    ]
    assert float(total) == n * (n + 1) / 2
    # Not combined by a collective: one copy per replica, all equal.
    assert isinstance(same, jstrategy.PerReplica)
    assert [float(v) for v in strategy.experimental_local_results(same)] == [2.0] * n


@pytest.mark.slow
def test_run_of_a_step_that_returns_nothing_is_bounded_in_flight():
    # TF's custom-loop step often returns nothing: it only applies gradients and updates
    # metrics. Those calls must count against the in-flight bound too; unbounded, a few
    # thousand of them abort in XLA's CPU collective rendezvous.
    strategy = jstrategy.MirroredStrategy()
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(4,))
        optimizer = jstrategy.optimizers.SGD(0.01)
        accuracy = jstrategy.metrics.Mean()
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((2, 4), ctx.replica_id_in_sync_group, np.float32)
    )

    def step(x):
        variables = model.trainable_variables
        grads = jax.grad(lambda v: jnp.mean(model(x, trainable_variables=v) ** 2))(variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        accuracy.update_state(jnp.sum(x, axis=1))

    limiter = dispatch.get_limiter()
    strategy.run(step, args=(x,))
    limiter.wait_all()
    for calls in range(1, 4):
        strategy.run(step, args=(x,))
        assert limiter.in_flight == calls
    for _ in range(2000):
        strategy.run(step, args=(x,))
        assert limiter.in_flight <= limiter.max_in_flight
    assert int(model.state.step) == 2004


def test_a_cached_run_still_refuses_per_replica_values_of_another_strategy():
    # The second call of a pattern takes `run`'s fast path, which skips the per-leaf
    # checks; values from a strategy with other replicas must still get the clear error.
    eight = jstrategy.MirroredStrategy()
    four = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])

    def rows(strategy):
        value = jax.device_put(np.ones((8, 2), np.float32), strategy.batch_sharding())
        return jstrategy.PerReplica(value, stacked=False)

    def fn(x):
        return jstrategy.get_replica_context().all_reduce("SUM", x)

    for _ in range(2):  # the second call is served from the cache
        np.testing.assert_allclose(np.asarray(eight.run(fn, (rows(eight),))), 8.0)
    with pytest.raises(ValueError, match="has 4 replicas but this strategy has 8"):
        eight.run(fn, (rows(four),))


@pytest.mark.skipif(
    jax.__version_info__ < (0, 12),
    reason="XLA's CPU compiler in jaxlib 0.10 drops the optimization barrier before it "
    "fuses: the stacked outputs still cost it the temporary (checked with jaxlib 0.10.2)",
)
def test_a_run_training_step_needs_no_more_memory_than_the_hand_written_one():
    """`run`'s program against the same step hand-written as jit(shard_map) with replicated
    outputs: per device, arguments + temporaries + outputs - aliased must not exceed it.
    (Its per-replica outputs leave stacked; XLA once kept the all-reduced gradients alive
    around that reshape, a temporary the size of the largest variable.)"""
    strategy = jstrategy.MirroredStrategy()
    axis = strategy.axis_name
    tx = optax.sgd(0.01, momentum=0.9)
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(16, 256)).astype(np.float32),
        "w2": rng.normal(size=(256, 256)).astype(np.float32),
        "w3": rng.normal(size=(256, 4)).astype(np.float32),
    }
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = rng.normal(size=(64, 4)).astype(np.float32)

    def loss_sum(p, xb, yb):
        h = jnp.tanh(jnp.tanh(xb @ p["w1"]) @ p["w2"])
        return jnp.sum((h @ p["w3"] - yb) ** 2)

    def replica_step(p, s, xb, yb):
        ctx = jstrategy.get_replica_context()
        loss, grads = jax.value_and_grad(lambda q: loss_sum(q, xb, yb) / 64)(p)
        grads, loss = ctx.all_reduce("SUM", (grads, loss))
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    def hand_body(p, s, xb, yb):
        local = jax.lax.pcast(p, axis, to="varying")
        loss, grads = jax.value_and_grad(lambda q: loss_sum(q, xb, yb) / 64)(local)
        grads, loss = jax.lax.psum((grads, loss), axis)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    rows = strategy.batch_sharding()
    replicated = strategy.replicated_sharding()
    p0, s0 = jax.device_put((params, tx.init(params)), replicated)
    xd, yd = jax.device_put((x, y), rows)
    hand = jax.jit(
        jax.shard_map(
            hand_body, mesh=strategy.mesh, in_specs=(P(), P(), P(axis), P(axis)), out_specs=P()
        )
    )
    xr, yr = jstrategy.PerReplica(xd, stacked=False), jstrategy.PerReplica(yd, stacked=False)
    p1, s1, _ = strategy.run(replica_step, (p0, s0, xr, yr))
    # The steady state: the per-replica parameters and optimizer state passed back.
    p2, _, loss = strategy.run(replica_step, (p1, s1, xr, yr))
    p3, _, hand_loss = hand(*hand(p0, s0, xd, yd)[:2], xd, yd)
    np.testing.assert_allclose(float(loss), float(hand_loss), rtol=1e-4)  # the same steps
    for a, b in zip(jax.tree.leaves(p3), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b[0]), rtol=1e-4, atol=1e-6)
    leaves = jax.tree.leaves(((p1, s1, xr, yr), {}))
    entry = list(strategy._run_programs._fast.values())[-1]  # the second call's pattern
    compiled_run = entry.program.compiled.lower(*entry.inputs(leaves), [], []).compile()
    compiled_hand = hand.lower(p0, s0, xd, yd).compile()

    def per_device(compiled):
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
        return total - m.alias_size_in_bytes, m.temp_size_in_bytes

    run_total, run_temp = per_device(compiled_run)
    hand_total, hand_temp = per_device(compiled_hand)
    assert run_temp <= hand_temp, (run_temp, hand_temp)
    # The run program also returns the scalar flag `run` waits on (dispatch.py): 9 bytes.
    assert run_total <= hand_total + 16, (run_total, hand_total)


def test_run_updates_the_state_it_threads_in_place():
    """TF's custom-loop step: the model's and optimizer's arrays that `run` threads
    through its program are donated and come back in the same buffers. (With
    `fn`'s outputs first, its scalar loss took a counter's buffer and every later holder
    was copied.)"""
    strategy = jstrategy.MirroredStrategy()
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(4), input_shape=(8,), seed=0)
        optimizer = jstrategy.optimizers.SGD(0.01, momentum=0.9)
        accuracy = jstrategy.metrics.SparseCategoricalAccuracy()
        loss_object = jstrategy.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )
    rng = np.random.default_rng(0)
    ((batch),) = strategy.experimental_distribute_dataset(
        [(rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32))]
    )

    def train_step(images, labels):
        def loss_fn(variables):
            logits = model(images, training=True, trainable_variables=variables)
            return jstrategy.compute_average_loss(loss_object(labels, logits))

        loss, grads = jax.value_and_grad(loss_fn)(model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        accuracy.update_state(labels, model(images))
        return loss

    def buffers():  # (the metric's variables are read, summed over the replicas)
        arrays = [*model.trainable_variables, *optimizer.variables]
        return [a.addressable_shards[0].data.unsafe_buffer_pointer() for a in arrays]

    strategy.run(train_step, batch)  # builds the program
    before = buffers()
    for _ in range(2):
        loss = strategy.run(train_step, batch)
    jax.block_until_ready(loss)
    assert buffers() == before
    assert int(optimizer.iterations) == 3
