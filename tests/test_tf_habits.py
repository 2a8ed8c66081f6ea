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


def _dense_model(strategy, optimizer=None, loss="mse", **compile_kwargs):
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(3,))
        optimizer = optimizer if optimizer is not None else optax.sgd(0.1)
        model.compile(optimizer, loss=loss, **compile_kwargs)
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


# Finding 7: reduction= on losses --------------------------------------------------------
def test_a_loss_called_directly_reduces_as_keras_says():
    y, logits = np.array([0, 1]), np.array([[2.0, 0.0], [0.0, 1.0]], np.float32)
    per_example = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True).per_example(
        y, logits
    )
    for reduction, expected in (
        ("none", per_example),
        (jstrategy.losses.Reduction.NONE, per_example),
        ("sum", per_example.sum()),
        ("sum_over_batch_size", per_example.mean()),
        ("auto", per_example.mean()),
    ):
        loss = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        np.testing.assert_allclose(loss(y, logits), expected, rtol=1e-6)
    default = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
    assert np.ndim(default(y, logits)) == 0  # Keras's default: the mean over the batch
    weighted = jstrategy.losses.MeanSquaredError(reduction="sum")
    assert float(weighted(np.zeros(2), np.ones(2), sample_weight=np.array([1.0, 3.0]))) == 4.0
    with pytest.raises(ValueError, match="`reduction` must be one of"):
        jstrategy.losses.MeanSquaredError(reduction="mean")


def test_inside_run_the_tutorials_reduction_none_pattern_counts_real_rows_only():
    strategy = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    x, y = _xy(10)  # padded to 12 rows: 3 per replica, 2 of them padding
    loss_object = jstrategy.losses.MeanSquaredError(reduction="none")

    def step(x, y):
        per_example_loss = loss_object(y, x[:, :1])
        return jstrategy.compute_average_loss(per_example_loss), per_example_loss

    (batch,) = strategy.experimental_distribute_dataset([(x, y)])
    loss, per_example = strategy.run(step, args=batch)
    expected = np.mean((x[:, 0] - y[:, 0]) ** 2)
    np.testing.assert_allclose(strategy.reduce("SUM", loss, axis=None), expected, rtol=1e-5)
    padded = np.concatenate(strategy.experimental_local_results(per_example))
    assert padded.shape == (12,) and not padded[10:].any()  # padding rows' losses are 0

    def keras_default(x, y):
        return jstrategy.losses.MeanSquaredError()(y, x[:, :1])

    with pytest.raises(ValueError, match=r"reduction='none'.*compute_average_loss"):
        strategy.run(keras_default, args=batch)


def test_compile_refuses_a_sum_reduction_it_would_not_honour():
    with pytest.raises(ValueError, match="reduction='sum'"):
        _dense_model(
            jstrategy.OneDeviceStrategy("cpu:0"),
            loss=jstrategy.losses.MeanSquaredError(reduction="sum"),
        )


# Finding 2 (a): stateful metrics that count real rows of every replica -----------------
def _classification(rows, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, 10)).astype(np.float32)
    labels = rng.integers(0, 10, size=rows).astype(np.int32)
    return logits, labels


def test_stateful_metrics_inside_run_count_the_real_rows_of_every_replica():
    strategy = jstrategy.MirroredStrategy()
    logits, labels = _classification(100)  # batches of 32: the last has 4 real rows of 32
    batches = [(logits[i : i + 32], labels[i : i + 32]) for i in range(0, 100, 32)]
    with strategy.scope():
        accuracy = jstrategy.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_loss = jstrategy.metrics.Mean(name="test_loss")
    loss_object = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def test_step(inputs):
        predictions, labels = inputs
        accuracy.update_state(labels, predictions)
        test_loss.update_state(loss_object(labels, predictions))

    for _epoch in range(2):
        for inputs in strategy.experimental_distribute_dataset(batches):
            strategy.run(test_step, args=(inputs,))
        _, count = accuracy.variables
        assert float(count) == 100.0  # not 128: padding rows do not count
        expected = np.mean(np.argmax(logits, -1) == labels)
        np.testing.assert_allclose(accuracy.result(), expected, rtol=1e-6)
        per_example = loss_object.per_example(labels, logits)
        np.testing.assert_allclose(test_loss.result(), np.mean(per_example), rtol=1e-5)
        accuracy.reset_state()
        test_loss.reset_state()
    assert float(accuracy.result()) == 0.0


def test_stateful_metrics_outside_run_and_keras_call():
    logits, labels = _classification(20, seed=1)
    accuracy = jstrategy.metrics.SparseCategoricalAccuracy()
    running = accuracy(labels[:10], logits[:10])  # Keras: update_state, then result
    accuracy.update_state(labels[10:], logits[10:], sample_weight=np.full(10, 3.0))
    hits = (np.argmax(logits, -1) == labels).astype(np.float64)
    np.testing.assert_allclose(running, hits[:10].mean(), rtol=1e-6)
    weights = np.r_[np.ones(10), np.full(10, 3.0)]
    np.testing.assert_allclose(accuracy.result(), (hits * weights).sum() / 40, rtol=1e-6)
    mean = jstrategy.metrics.Mean()
    mean(np.float32(2.0))
    assert float(mean(np.array([4.0, 6.0]))) == 4.0
