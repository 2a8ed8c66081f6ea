"""Scopes, the default strategy and replica contexts, as in tf.distribute."""

import jax.numpy as jnp
import pytest

import jstrategy


def test_default_strategy_outside_any_scope():
    assert not jstrategy.has_strategy()
    default = jstrategy.get_strategy()
    assert default.num_replicas_in_sync == 1
    assert jstrategy.get_strategy() is default
    assert not jstrategy.in_cross_replica_context()
    ctx = jstrategy.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    assert ctx.all_reduce("SUM", 3.0) == 3.0


def test_scope_is_cross_replica_and_run_is_replica():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    seen = {}
    with strategy.scope() as s:
        assert s is strategy
        assert jstrategy.has_strategy()
        assert jstrategy.get_strategy() is strategy
        assert jstrategy.in_cross_replica_context()
        assert jstrategy.get_replica_context() is None

        def fn():
            ctx = jstrategy.get_replica_context()
            seen["ctx"] = ctx
            seen["cross"] = jstrategy.in_cross_replica_context()
            seen["strategy"] = jstrategy.get_strategy()
            return jnp.zeros(())

        strategy.run(fn)
    assert seen["ctx"].strategy is strategy and seen["ctx"].num_replicas_in_sync == 2
    assert seen["cross"] is False and seen["strategy"] is strategy
    assert not jstrategy.has_strategy()


def test_reentering_same_scope_is_fine_and_mixing_raises():
    a = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    b = jstrategy.OneDeviceStrategy("cpu:0")
    with a.scope(), a.scope():
        assert jstrategy.get_strategy() is a
    with a.scope(), pytest.raises(ValueError, match="Mixing different strategies"), b.scope():
        pass
    assert not jstrategy.has_strategy()


def test_experimental_set_strategy():
    strategy = jstrategy.OneDeviceStrategy("cpu:1")
    other = jstrategy.OneDeviceStrategy("cpu:2")
    try:
        jstrategy.experimental_set_strategy(strategy)
        assert jstrategy.get_strategy() is strategy
        assert jstrategy.in_cross_replica_context()
        jstrategy.experimental_set_strategy(other)  # replaces, as in TF
        assert jstrategy.get_strategy() is other
        with other.scope(), pytest.raises(RuntimeError, match="must not be called inside"):
            jstrategy.experimental_set_strategy(strategy)
    finally:
        jstrategy.experimental_set_strategy(None)
    assert not jstrategy.has_strategy()


def test_reduce_op_strings():
    assert jstrategy.ReduceOp.from_value("sum") is jstrategy.ReduceOp.SUM
    with pytest.raises(ValueError, match="`reduce_op` must be .* got 'MAX'"):
        jstrategy.ReduceOp.from_value("MAX")
