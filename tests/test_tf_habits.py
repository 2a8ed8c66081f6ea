"""TensorFlow's distributed-training tutorials, ported as a TF user would: each habit
either means the same here or raises an error that shows the fix (issue 14)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy.coordinator import local_cluster_resolver


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
        jstrategy.losses.MeanSquaredError(reduction="average")


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


# Finding 1: the rate set, read and logged is the rate applied --------------------------
def _fit(model, epochs=2, callbacks=()):
    x, y = _xy(24)
    return model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks)
    )


def test_a_plain_optax_optimizer_refuses_rate_control_and_shows_the_fix():
    # Before: the scheduler's 0.1 multiplied optax.sgd(0.1)'s own rate: 0.01 applied.
    model = _dense_model(jstrategy.OneDeviceStrategy("cpu:0"), optax.sgd(0.1))
    scheduler = jstrategy.callbacks.LearningRateScheduler(lambda epoch: 0.1)
    fix = r"jstrategy\.optimizers\.SGD\(learning_rate=0\.1\).*inject_hyperparams"
    with pytest.raises(TypeError, match=fix):
        _fit(model, callbacks=[scheduler])
    with pytest.raises(TypeError, match=fix):
        model.learning_rate  # noqa: B018
    with pytest.raises(TypeError, match=fix):
        model.learning_rate = 0.1
    with pytest.raises(TypeError, match=fix):
        _fit(model, callbacks=[jstrategy.callbacks.ReduceLROnPlateau(monitor="loss")])


def test_the_scheduled_rate_is_the_rate_applied_and_logged():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    rates = [0.1, 0.02, 0.05]
    scheduled = _dense_model(strategy, jstrategy.optimizers.SGD(learning_rate=0.3))
    history = _fit(
        scheduled,
        epochs=3,
        callbacks=[jstrategy.callbacks.LearningRateScheduler(lambda epoch: rates[epoch])],
    )
    assert history.history["learning_rate"] == pytest.approx(rates)
    assert scheduled.learning_rate == pytest.approx(0.05)
    # The same three epochs, each with optax's own SGD at that rate.
    for a, b in zip(scheduled.get_weights(), _sgd_epochs(strategy, rates), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_names_are_keras_optimizers_with_keras_defaults():
    model = _dense_model(jstrategy.OneDeviceStrategy("cpu:0"), "adam")
    assert isinstance(model.optimizer, jstrategy.optimizers.Adam)
    assert model.optimizer.get_config()["epsilon"] == 1e-7
    assert model.learning_rate == pytest.approx(1e-3) == model.optimizer.learning_rate
    model.optimizer.learning_rate = 0.01  # Keras: model.optimizer.learning_rate = ...
    assert model.learning_rate == pytest.approx(0.01)
    with pytest.raises(ValueError, match="Unknown optimizer 'adamm'.*'adam'"):
        _dense_model(jstrategy.OneDeviceStrategy("cpu:0"), "adamm")


@pytest.mark.slow
@pytest.mark.parametrize(
    "keras, reference",
    [
        (
            jstrategy.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
            optax.sgd(0.1, momentum=0.9, nesterov=True),
        ),
        (jstrategy.optimizers.Adam(0.01), optax.adam(0.01, eps=1e-7)),
        (jstrategy.optimizers.RMSprop(0.01), optax.rmsprop(0.01, decay=0.9, eps=1e-7)),
        (jstrategy.optimizers.Adagrad(0.1), optax.adagrad(0.1, eps=1e-7)),
        (jstrategy.optimizers.Adadelta(1.0), optax.adadelta(1.0, rho=0.95, eps=1e-7)),
        (jstrategy.optimizers.Adamax(0.01), optax.adamax(0.01, eps=1e-7)),
        (jstrategy.optimizers.Lion(0.01), optax.lion(0.01, weight_decay=0.0)),
        (
            jstrategy.optimizers.AdamW(0.01),
            optax.adamw(0.01, eps=1e-7, weight_decay=0.004),
        ),
        (
            jstrategy.optimizers.SGD(0.1, global_clipnorm=0.5),
            optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)),
        ),
        (
            jstrategy.optimizers.SGD(0.1, clipvalue=0.05),
            optax.chain(optax.clip(0.05), optax.sgd(0.1)),
        ),
    ],
    ids=lambda v: type(v).__name__,
)
def test_keras_optimizers_at_a_constant_rate_agree_with_optax(keras, reference):
    # The optimizers follow Keras's formulas (tests/test_keras_optimizer_parity.py); at a
    # constant rate these equal optax's to float tolerance (Nadam does not: Keras's has
    # Dozat's momentum schedule).
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    ours, theirs = _dense_model(strategy, keras), _dense_model(strategy, reference)
    _fit(ours), _fit(theirs)
    for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_clipnorm_clips_each_gradient_on_its_own():
    tx = jstrategy.optimizers.SGD(1.0, clipnorm=1.0).tx
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.3, 0.4])}
    params = jax.tree.map(jnp.zeros_like, grads)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["a"], [-0.6, -0.8], rtol=1e-6)  # norm 5 -> 1
    np.testing.assert_allclose(updates["b"], [-0.3, -0.4], rtol=1e-6)  # norm 0.5 kept


def test_a_schedule_sets_the_rate_from_the_step_and_cannot_be_set():
    schedule = jstrategy.optimizers.schedules.PiecewiseConstantDecay([3], [0.1, 0.01])
    model = _dense_model(jstrategy.OneDeviceStrategy("cpu:0"), jstrategy.optimizers.SGD(schedule))
    assert model.learning_rate == pytest.approx(0.1)
    _fit(model, epochs=2)  # 6 steps
    assert model.learning_rate == pytest.approx(0.01)
    with pytest.raises(TypeError, match="schedule"):
        model.learning_rate = 0.5
    with pytest.raises(TypeError, match="schedule"):
        _fit(model, callbacks=[jstrategy.callbacks.LearningRateScheduler(lambda e: 0.1)])
    # An optax schedule injected by the user is refused too, not silently overwritten.
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.constant_schedule(0.1))
    with pytest.raises(TypeError, match="schedule"):
        _dense_model(jstrategy.OneDeviceStrategy("cpu:0"), injected).learning_rate = 0.5


def _sgd_epochs(strategy, rates):
    """The weights after one epoch of optax's SGD at each rate in turn."""
    weights = None
    for rate in rates:
        reference = _dense_model(strategy, optax.sgd(rate))
        if weights is not None:
            reference.set_weights(weights)
        _fit(reference, epochs=1)
        weights = reference.get_weights()
    return weights


def test_reduce_lr_on_plateau_reduces_the_applied_rate():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    model = _dense_model(strategy, jstrategy.optimizers.SGD(0.2))
    # No epoch after the first improves by 1e9: the rate halves after each.
    reduce = jstrategy.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=1, min_delta=1e9, min_lr=0.06
    )
    history = _fit(model, epochs=4, callbacks=[reduce])
    assert history.history["learning_rate"] == pytest.approx([0.2, 0.2, 0.1, 0.06])
    for a, b in zip(model.get_weights(), _sgd_epochs(strategy, [0.2, 0.2, 0.1, 0.06]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"`factor` must be in \(0, 1\)"):
        jstrategy.callbacks.ReduceLROnPlateau(factor=1.0)


def test_keras_optimizers_in_create_train_state():
    with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        state = training.create_train_state(
            nn.Dense(1), jstrategy.optimizers.SGD(0.1, momentum=0.9), jnp.ones((1, 3))
        )
        step = training.make_train_step("mse")
    x, y = _xy(8)
    state, logs = step(state, (x, y))
    assert int(state.step) == 1 and "loss" in logs


# Finding 2 (b): optimizer.apply_gradients inside run aggregates as TF's ---------------
def _custom_loop(strategy, *, all_reduce_first=False, steps=3):
    """TF's custom-loop train step on a Dense model; returns per-step losses and weights."""
    x, y = _classification(40, seed=3)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 40, 16)]  # 16, 16, 8 rows
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(10), input_shape=(10,), seed=0)
        optimizer = jstrategy.optimizers.SGD(0.5, momentum=0.9)
        loss_object = jstrategy.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )

    def train_step(inputs):
        features, labels = inputs

        def loss_fn(variables):
            predictions = model(features, training=True, trainable_variables=variables)
            return jstrategy.compute_average_loss(loss_object(labels, predictions))

        loss, gradients = jax.value_and_grad(loss_fn)(model.trainable_variables)
        if all_reduce_first:  # already combined: apply_gradients must not sum them again
            gradients = jstrategy.get_replica_context().all_reduce("SUM", gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    losses = []
    for _ in range(steps):
        for inputs in strategy.experimental_distribute_dataset(batches):
            per_replica = strategy.run(train_step, args=(inputs,))
            losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
    return np.array(losses), model.get_weights(), optimizer


@pytest.mark.slow
def test_apply_gradients_in_run_follows_one_device_and_counts_each_gradient_once():
    one_losses, one_weights, _ = _custom_loop(jstrategy.OneDeviceStrategy("cpu:0"))
    for strategy in (
        jstrategy.MirroredStrategy(),
        jstrategy.CentralStorageStrategy(compute_devices=[f"cpu:{i}" for i in range(4)]),
    ):
        for all_reduce_first in (False, True):
            losses, weights, optimizer = _custom_loop(strategy, all_reduce_first=all_reduce_first)
            np.testing.assert_allclose(losses, one_losses, rtol=1e-5, atol=1e-6)
            for a, b in zip(weights, one_weights, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            assert optimizer.iterations == 9 and optimizer.learning_rate == 0.5


def test_apply_gradients_errors_show_the_fix():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(3,))
        model.compile(jstrategy.optimizers.SGD(0.1), loss="mse")
    grads = {"kernel": jnp.zeros((3, 1)), "bias": jnp.zeros(1)}
    optimizer = jstrategy.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="a zip of two dicts pairs their keys"):
        optimizer.apply_gradients(zip(grads, model.state.params, strict=True))
    with pytest.raises(ValueError, match="must be a model's trainable_variables"):
        optimizer.apply_gradients(zip(jax.tree.leaves(grads), jax.tree.leaves(grads), strict=True))
    with pytest.raises(ValueError, match="compiled into a model"):
        model.optimizer.apply_gradients(
            zip(jax.tree.leaves(grads), model.trainable_variables, strict=True)
        )
    optimizer.apply_gradients(zip(jax.tree.leaves(grads), model.trainable_variables, strict=True))
    assert optimizer.iterations == 1

    def step(x):
        return model(x)

    with pytest.raises(RuntimeError, match="TF's @tf.function is not needed"):
        jax.jit(lambda x: strategy.run(step, args=(x,)))(np.ones((2, 3), np.float32))


# Finding 7: BackupAndRestore under ParameterServerStrategy -----------------------------
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
    x, y = _xy(32)
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
    x, y = _xy(32)
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


# Finding 7: model.save / jstrategy.models.load_model -------------------------------------
class _Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=jstrategy.REPLICA_AXIS)(x)
        return nn.Dense(10)(nn.relu(x))


@pytest.mark.slow
def test_save_and_load_model_keep_weights_optimizer_state_and_compile_config(tmp_path):
    x, y = _classification(64, seed=5)
    mirrored = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    with mirrored.scope():
        model = jstrategy.Model(_Classifier(), input_shape=(10,), seed=3)
        model.compile(
            jstrategy.optimizers.Adam(
                jstrategy.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5)
            ),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[
                "accuracy",
                "sparse_categorical_accuracy",
                jstrategy.metrics.MeanMetricWrapper(
                    jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True), name="xent"
                ),
            ],
            steps_per_execution=2,
        )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    saved = model.get_weights()
    path = str(tmp_path / "model")
    model.save(path)
    with jstrategy.OneDeviceStrategy("cpu:0").scope():  # any strategy loads it
        elsewhere = jstrategy.models.load_model(path, _Classifier())
    for a, b in zip(elsewhere.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(a, b)
    with mirrored.scope():
        loaded = jstrategy.models.load_model(path, _Classifier())
    assert loaded.metrics_names == model.metrics_names
    assert loaded.steps_per_execution == 2 and int(loaded.state.step) == 4
    assert isinstance(loaded.optimizer.schedule, jstrategy.optimizers.schedules.ExponentialDecay)
    assert loaded.learning_rate == pytest.approx(model.learning_rate)
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # parameters and BatchNorm statistics
    # The optimizer state came back: one more epoch from both lands on the same weights.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    weights_only = jstrategy.models.load_model(path, _Classifier(), compile=False)
    assert not weights_only.compiled
    for a, b in zip(weights_only.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(a, b)


def test_load_model_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No saved model at .*missing.*model\.save"):
        jstrategy.models.load_model(tmp_path / "missing", nn.Dense(1))
    model = _dense_model(jstrategy.OneDeviceStrategy("cpu:0"), loss=lambda y, p: (y - p) ** 2)
    model.save_weights(tmp_path / "weights")
    with pytest.raises(ValueError, match=r"weights.*not a directory written by model\.save"):
        jstrategy.models.load_model(tmp_path / "weights", nn.Dense(1))
    model.save(tmp_path / "custom")
    with pytest.raises(ValueError, match=r"loss 'lambda'.*custom_objects=\{'lambda': \.\.\.\}"):
        jstrategy.models.load_model(tmp_path / "custom", nn.Dense(1))
    with pytest.raises(ValueError, match=r"custom_objects=\{'optimizer': \.\.\.\}"):
        jstrategy.models.load_model(
            tmp_path / "custom", nn.Dense(1), custom_objects={"lambda": lambda y, p: y - p}
        )
    loaded = jstrategy.models.load_model(
        tmp_path / "custom",
        nn.Dense(1),
        custom_objects={"optimizer": optax.sgd(0.1), "lambda": lambda y, p: (y - p) ** 2},
    )
    assert loaded.compiled
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a directory written by model.save"):
        model.save(tmp_path / "other")


def test_tensorboard_logs_the_rate_applied_and_none_it_cannot_know(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    rates = [0.1, 0.02]
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    keras = _dense_model(strategy, jstrategy.optimizers.SGD(0.3))
    _fit(
        keras,
        callbacks=[
            jstrategy.callbacks.LearningRateScheduler(lambda epoch: rates[epoch]),
            jstrategy.callbacks.TensorBoard(tmp_path / "keras"),
        ],
    )
    plain = _dense_model(strategy, optax.sgd(0.1))
    _fit(plain, callbacks=[jstrategy.callbacks.TensorBoard(tmp_path / "plain")])
    logged = {}
    for name in ("keras", "plain"):
        reader = accumulator.EventAccumulator(str(tmp_path / name / "train"))
        reader.Reload()
        logged[name] = reader
    keras_rates = [e.value for e in logged["keras"].Scalars("epoch_learning_rate")]
    np.testing.assert_allclose(keras_rates, rates, rtol=1e-6)
    for a, b in zip(keras.get_weights(), _sgd_epochs(strategy, rates), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # optax.sgd(0.1) keeps its rate inside its code: nothing is logged rather than a guess.
    assert "epoch_learning_rate" not in logged["plain"].Tags()["scalars"]
    assert "epoch_loss" in logged["plain"].Tags()["scalars"]


@pytest.mark.slow
def test_save_and_load_model_keep_the_dtype_policy_and_a_cycle_in_progress(tmp_path):
    # The compile options of issue 13 travel with the model: the dtype policy, and
    # gradient accumulation, whose pending sums are part of the saved state.
    x, y = _classification(48, seed=7)
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        model = jstrategy.Model(_Classifier(), input_shape=(10,), dtype_policy="mixed_bfloat16")
        model.compile(
            "sgd",
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            gradient_accumulation_steps=2,
        )
        model.fit(x[:24], y[:24], batch_size=8, epochs=1, verbose=0, shuffle=False)  # 3 batches
        path = str(tmp_path / "model")
        model.save(path)
        loaded = jstrategy.models.load_model(path, _Classifier())
    assert loaded.dtype_policy.name == "mixed_bfloat16"
    assert loaded.gradient_accumulation_steps == 2
    # One micro-batch of the second cycle is pending in both; the next finishes it alike.
    model.fit(x[24:32], y[24:32], batch_size=8, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x[24:32], y[24:32], batch_size=8, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_restore_checkpoint_reads_the_whole_state_of_a_saved_model(tmp_path):
    # A `save` directory is also a checkpoint: a model built and compiled by hand takes its
    # variables, optimizer state and step, and trains on exactly as the saved one.
    x, y = _classification(48, seed=9)
    loss = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
    with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = jstrategy.Model(_Classifier(), input_shape=(10,), seed=4)
        model.compile(jstrategy.optimizers.Adam(0.01), loss=loss)
        other = jstrategy.Model(_Classifier(), input_shape=(10,), seed=5)
        other.compile(jstrategy.optimizers.Adam(0.01), loss=loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    path = str(tmp_path / "model")
    model.save(path)
    assert other.get_config() == {**model.get_config(), "seed": 5}
    other.restore_checkpoint(path)
    assert int(other.state.step) == 3
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    other.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(other.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


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


@pytest.mark.parametrize("method", ["compile", "fit", "evaluate", "predict"])
def test_a_model_used_inside_another_strategys_scope_is_an_error(method):
    # Keras raises when a model made outside a strategy's scope is compiled inside it; here
    # it would train silently under the strategy it was created in.
    x, y = _classification(16)
    model = jstrategy.Model(_Classifier(), input_shape=(10,))
    if method != "compile":
        model.compile("sgd", loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True))
    calls = {
        "compile": lambda: model.compile("sgd", loss="mse"),
        "fit": lambda: model.fit(x, y, verbose=0),
        "evaluate": lambda: model.evaluate(x, y, verbose=0),
        "predict": lambda: model.predict(x, verbose=0),
    }
    with (
        jstrategy.MirroredStrategy().scope(),
        pytest.raises(ValueError, match=rf"created under .*but `{method}` is called inside"),
    ):
        calls[method]()
    calls[method]()  # outside any scope it runs, under its own strategy


def test_metrics_made_in_a_scope_update_outside_run_with_the_strategys_arrays():
    # Keras's custom-loop habit: update a metric with a step's outputs after every step,
    # outside `run` and outside the scope. The metric's parts live on the replicas of the
    # strategy it was created under (they were created lazily on the default device, and
    # outputs laid over the strategy's devices raised "incompatible devices").
    strategy = jstrategy.MirroredStrategy()
    with strategy.scope():
        mean = jstrategy.metrics.Mean()
        accuracy = jstrategy.metrics.SparseCategoricalAccuracy()
    values = jax.device_put(jnp.arange(8.0), strategy.replicated_sharding())
    labels = jax.device_put(jnp.array([0, 1, 1, 0]), strategy.replicated_sharding())
    logits = jnp.array([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [2.0, 0.0]])
    for _ in range(100):
        mean.update_state(values)
        accuracy.update_state(labels, logits)
    assert float(mean.result()) == pytest.approx(3.5)
    assert float(accuracy.result()) == pytest.approx(0.75)
    mean.reset_state()
    mean.update_state(np.array([1.0, 3.0]))
    assert float(mean.result()) == pytest.approx(2.0)
