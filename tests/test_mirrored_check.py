"""The mirrored-values check (`jstrategy.config.experimental_check_mirrored`,
run/mirrored_check.py): replicas that disagree on values that must be mirrored."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstrategy


# TF habits (issue 14), finding 2 (c): replicas that disagree on values that must be mirrored
def _regression_step(reduce_gradients):
    def step(params, x, y):
        def loss_fn(p):
            return jstrategy.compute_average_loss((x @ p - y[:, 0]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        if reduce_gradients:
            grads = jstrategy.get_replica_context().all_reduce("SUM", grads)
        return params - 0.1 * grads, loss

    return step


@pytest.fixture
def check_mirrored():
    jstrategy.config.experimental_check_mirrored(True)
    yield
    jstrategy.config.experimental_check_mirrored(False)


def test_forgetting_the_all_reduce_is_an_error_in_the_mirrored_check_mode(check_mirrored):
    strategy = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    x, y = helpers.regression_data(16)
    (batch,) = strategy.experimental_distribute_dataset([(x, y)])
    right, wrong = _regression_step(True), _regression_step(False)
    params = jnp.zeros(3)
    for _ in range(3):  # the updated parameters come back, checked, as PerReplica
        params, _ = strategy.run(right, args=(params, *batch))
    assert params.mirrored
    with pytest.raises(ValueError, match=r"replicas disagree on \['\[0\]'\].*all_reduce"):
        strategy.run(wrong, args=(jnp.zeros(3), *batch))
    with pytest.raises(ValueError, match="replicas disagree"):  # also once passed back
        strategy.run(wrong, args=(params, *batch))


def test_without_the_check_a_forgotten_all_reduce_still_drifts_silently():
    # What the debug mode is for: the types alone cannot tell a forgotten all-reduce.
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = helpers.regression_data(16)
    (batch,) = strategy.experimental_distribute_dataset([(x, y)])
    params, _ = strategy.run(_regression_step(False), args=(jnp.zeros(3), *batch))
    first, second = strategy.experimental_local_results(params)
    assert not np.allclose(first, second)
