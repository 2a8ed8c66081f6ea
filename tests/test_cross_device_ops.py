"""Cross-device ops: the same numbers, different communication patterns in the program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy._src import dispatch
from jstrategy.experimental import DeviceMesh
from jstrategy.experimental import LayoutMap
from jstrategy.experimental import ModelParallelStrategy

OPS = {
    "nccl": lambda: jstrategy.NcclAllReduce(),
    "nccl_packs_2": lambda: jstrategy.NcclAllReduce(num_packs=2),
    "nccl_unpacked": lambda: jstrategy.NcclAllReduce(num_packs=0),
    "hierarchical": lambda: jstrategy.HierarchicalCopyAllReduce(),
    "hierarchical_unpacked": lambda: jstrategy.HierarchicalCopyAllReduce(num_packs=0),
    "one_device": lambda: jstrategy.ReductionToOneDevice(),
    "one_device_cpu3": lambda: jstrategy.ReductionToOneDevice(reduce_to_device="/cpu:3"),
}


def _tree(strategy):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4) * (ctx.replica_id_in_sync_group + 1),
            "b": np.full((5,), ctx.replica_id_in_sync_group, np.float32),
            "s": np.float32(ctx.replica_id_in_sync_group) / 3,
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("op_name", sorted(OPS))
def test_all_ops_agree(op_name, n):
    if op_name == "one_device_cpu3" and n < 4:
        pytest.skip("cpu:3 is not a replica")
    strategy = jstrategy.MirroredStrategy(
        devices=[f"cpu:{i}" for i in range(n)], cross_device_ops=OPS[op_name]()
    )
    _check_ops_agree(strategy)


@pytest.mark.slow
@pytest.mark.parametrize("op_name", sorted(OPS))
def test_all_ops_agree_over_the_data_axis_of_a_2d_mesh(op_name):
    """On a (4, 2) mesh the replicas are the 4 entries of the data axis, not the 8 devices."""
    layout_map = LayoutMap(DeviceMesh((4, 2), ("batch", "model")))
    strategy = ModelParallelStrategy(layout_map, cross_device_ops=OPS[op_name]())
    assert strategy.num_replicas_in_sync == 4
    _check_ops_agree(strategy)


def _check_ops_agree(strategy):
    n = strategy.num_replicas_in_sync
    tree = _tree(strategy)
    expected_sum = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4) * sum(range(1, n + 1)),
        "b": np.full((5,), sum(range(n)), np.float32),
        "s": np.float32(sum(range(n)) / 3),
    }

    def fn(t):
        ctx = jstrategy.get_replica_context()
        return ctx.all_reduce("SUM", t), ctx.all_reduce("MEAN", t)

    total, mean = strategy.run(fn, (tree,))
    for k in expected_sum:
        np.testing.assert_allclose(total[k], expected_sum[k], rtol=1e-6)
        np.testing.assert_allclose(mean[k], expected_sum[k] / n, rtol=1e-6)
    # Cross-replica reduce and batch_reduce go through the same algorithm.
    reduced = strategy.cross_device_ops.reduce("SUM", tree)
    np.testing.assert_allclose(reduced["w"], expected_sum["w"], rtol=1e-6)
    a, b = strategy.cross_device_ops.batch_reduce("MEAN", [(tree["b"], None), (tree["s"], "cpu:0")])
    np.testing.assert_allclose(a, expected_sum["b"] / n, rtol=1e-6)
    assert b.devices() == {jax.devices()[0]}


def _lowered(ops, n=8, leaves=3):
    strategy = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
    shapes = [(16,), (4, 4), (8,)][:leaves]

    def body(*xs):
        return ops.all_reduce("SUM", list(xs), mesh=strategy.mesh)

    program = jax.jit(
        jax.shard_map(
            body,
            mesh=strategy.mesh,
            in_specs=tuple(P(jstrategy.REPLICA_AXIS) for _ in shapes),
            out_specs=[P() for _ in shapes],
        )
    )
    args = [jnp.ones((n * s[0], *s[1:])) for s in shapes]
    return program.lower(*args).as_text()


def _count(text, op):
    return len(re.findall(rf"stablehlo\.{op}\b|\"stablehlo\.{op}\"", text))


@pytest.mark.parametrize("num_packs", [1, 2, 3])
def test_nccl_one_all_reduce_per_pack(num_packs):
    text = _lowered(jstrategy.NcclAllReduce(num_packs=num_packs))
    assert _count(text, "all_reduce") == num_packs
    assert _count(text, "collective_permute") == 0


def test_nccl_unpacked_one_all_reduce_per_tensor():
    assert _count(_lowered(jstrategy.NcclAllReduce(num_packs=0)), "all_reduce") == 3


def test_hierarchical_is_a_tree_within_halves_then_across():
    text = _lowered(jstrategy.HierarchicalCopyAllReduce())
    # 8 replicas: halves of 4 reduce in log2(4) = 2 rounds of copies, then the leaders combine.
    assert _count(text, "collective_permute") == 2
    assert _count(text, "all_reduce") == 1
    assert jstrategy.HierarchicalCopyAllReduce.groups(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_reduction_to_one_device_copies_everything_to_one_device():
    accumulated = []

    def accumulate(values):
        accumulated.append(len(values))
        return sum(values[1:], values[0])

    text = _lowered(jstrategy.ReductionToOneDevice(accumulation_fn=accumulate), leaves=2)
    assert accumulated == [8, 8]  # one accumulation of 8 replicas' values per tensor
    assert _count(text, "collective_permute") == 2 * 7
    pairs = re.findall(r"source_target_pairs = dense<\[\[(\d+), (\d+)\]\]>", text)
    assert pairs and {int(t) for _, t in pairs} == {0}


def test_programs_differ_between_ops():
    texts = {name: _lowered(make()) for name, make in OPS.items() if name != "one_device_cpu3"}
    assert len(set(texts.values())) == len(texts)


def test_invalid_settings():
    with pytest.raises(ValueError, match="`num_packs` must be a non-negative int; got -1"):
        jstrategy.NcclAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="`num_packs` must be a non-negative int"):
        jstrategy.HierarchicalCopyAllReduce(num_packs=1.5)
    with pytest.raises(TypeError, match="`accumulation_fn` must be callable"):
        jstrategy.ReductionToOneDevice(accumulation_fn=3)
    strategy = jstrategy.MirroredStrategy(
        devices=["cpu:0", "cpu:1"],
        cross_device_ops=jstrategy.ReductionToOneDevice(reduce_to_device="cpu:5"),
    )
    with pytest.raises(
        ValueError, match=r"`reduce_to_device` must be one of the strategy's devices"
    ):
        strategy.run(lambda: jstrategy.get_replica_context().all_reduce("SUM", 1.0))
    with pytest.raises(TypeError, match="leaves must be PerReplica values"):
        jstrategy.NcclAllReduce().reduce("SUM", {"a": jnp.ones(2)})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stress_5000_run_steps_on_8_devices_do_not_hang():
    strategy = jstrategy.MirroredStrategy()
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((4,), ctx.replica_id_in_sync_group, np.float32)
    )

    def step(acc, x):
        ctx = jstrategy.get_replica_context()
        return acc + ctx.all_reduce("MEAN", x)

    acc = jnp.zeros(4)
    for _ in range(5000):
        acc = strategy.run(step, (acc, x))
        assert dispatch.get_limiter().in_flight <= dispatch.get_limiter().max_in_flight
    for replica in strategy.experimental_local_results(acc):
        np.testing.assert_allclose(replica, np.full(4, 5000 * 3.5), rtol=1e-6)


def test_limiter_validates():
    with pytest.raises(ValueError, match="`max_in_flight` must be a positive int; got 0"):
        dispatch.InFlightLimiter(max_in_flight=0)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "call, times",
    [
        (lambda s, v: s.reduce("SUM", v, axis=None), 250),
        (lambda s, v: s.reduce("MEAN", v, axis=0), 250),
        (lambda s, v: s.cross_device_ops.reduce("SUM", v), 250),
        (lambda s, v: s.cross_device_ops.batch_reduce("SUM", [(v, None), (v, None)]), 250),
        (lambda s, v: s.gather(v, axis=0), 2500),
    ],
    ids=["reduce", "reduce_axis", "cross_device_ops_reduce", "batch_reduce", "gather"],
)
def test_back_to_back_reduce_and_gather_on_8_devices_do_not_abort(call, times):
    # Unbounded, 100 reduces or a few thousand gathers queued on 8 fake CPU devices abort
    # the process in XLA's collective rendezvous.
    strategy = jstrategy.MirroredStrategy()
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((4,), ctx.replica_id_in_sync_group, np.float32)
    )
    limiter = dispatch.get_limiter()
    expected = jax.device_get(call(strategy, value))
    limiter.wait_all()
    call(strategy, value)
    assert limiter.in_flight >= 1, "the collective was not tracked by the in-flight limiter"
    for _ in range(times):
        out = call(strategy, value)
        assert limiter.in_flight <= limiter.max_in_flight
    jax.tree.map(np.testing.assert_allclose, jax.device_get(out), expected)
