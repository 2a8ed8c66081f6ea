"""TensorFlow's distributed-training tutorials, ported as a TF user would: each habit
either means the same here or raises an error that shows the fix (issue 14)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy


def _xy(rows=24, features=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]
    return x, y


def _dense_model(strategy, optimizer=None, **compile_kwargs):
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(3,))
        model.compile(
            optimizer if optimizer is not None else optax.sgd(0.1), loss="mse", **compile_kwargs
        )
    return model


# Finding 6: one rule for what fit and experimental_distribute_dataset take ------------
def test_fit_takes_a_generator_function_as_experimental_distribute_dataset_does():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    x, y = _xy()

    def batches():
        for i in range(0, 24, 8):
            yield x[i : i + 8], y[i : i + 8]

    from_function = _dense_model(strategy)
    history = from_function.fit(batches, epochs=2, verbose=0)
    from_list = _dense_model(strategy)
    from_list.fit(list(batches()), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2  # a generator function is iterated each epoch
    for a, b in zip(from_function.get_weights(), from_list.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


# Finding 2 (c): replicas that disagree on values that must be mirrored ----------------
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
    x, y = _xy(16)
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
    x, y = _xy(16)
    (batch,) = strategy.experimental_distribute_dataset([(x, y)])
    params, _ = strategy.run(_regression_step(False), args=(jnp.zeros(3), *batch))
    first, second = strategy.experimental_local_results(params)
    assert not np.allclose(first, second)
