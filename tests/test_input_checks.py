"""Bad input to fit/evaluate/predict, the numerics check, and bounded compile caches.

Issue 15 findings 7 and 8: each quiet mistake gets a clear error before any work, labels
out of range are caught on the host (arrays) and by the opt-in check inside the step
(`jstrategy.config.enable_check_numerics`), and any number of rows compiles a bounded
number of programs.
"""

import contextlib

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from conftest import STRATEGIES
from jstrategy import losses
from jstrategy import training
from jstrategy._src.training.step import check_numerics

FEATURES = 4
CLASSES = 3


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    return x, (np.arange(rows) % CLASSES).astype(np.int32)


def _model(strategy=None, *, check=False, spe=1, loss=None, metrics=("accuracy",)):
    strategy = strategy or jstrategy.OneDeviceStrategy("cpu:0")
    with _numerics(check), strategy.scope():
        model = jstrategy.Model(nn.Dense(CLASSES), input_shape=(FEATURES,))
        model.compile(
            optax.sgd(0.1),
            loss=loss or losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=list(metrics),
            steps_per_execution=spe,
        )
    return model


@contextlib.contextmanager
def _numerics(on):
    if not on:
        yield
        return
    jstrategy.config.enable_check_numerics()
    try:
        yield
    finally:
        jstrategy.config.disable_check_numerics()


@pytest.fixture(scope="module")
def model():
    return _model()


# Finding 7: empty and inconsistent arrays --------------------------------------------------
def test_empty_arrays_are_an_error_before_any_work(model):
    x, y = _data(0)
    steps = int(model.state.step)
    with pytest.raises(ValueError, match=r"`x` has no rows \(shape \(0, 4\)\).*at least one"):
        model.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match="`x` has no rows"):
        model.evaluate(x, y, verbose=0)  # was KeyError: 'loss'
    with pytest.raises(ValueError, match="`x` has no rows"):
        model.predict(x, verbose=0)
    with pytest.raises(ValueError, match=r"`validation_data\[0\]` has no rows"):
        model.fit(*_data(8), validation_data=(x, y), verbose=0)
    assert int(model.state.step) == steps


def test_row_counts_that_differ_name_the_arguments(model):
    x, y = _data(10)
    with pytest.raises(ValueError, match="`x` has 10 rows but `y` has 9: pass one label"):
        model.fit(x, y[:9], verbose=0)
    with pytest.raises(ValueError, match="`x` has 10 rows but `sample_weight` has 4"):
        model.fit(x, y, sample_weight=np.ones(4), verbose=0)
    with pytest.raises(ValueError, match=r"`validation_data\[0\]` has 10 rows but `valid"):
        model.fit(x, y, validation_data=(x, y[:3]), verbose=0)
    with pytest.raises(ValueError, match=r"`x\['a'\]` has 10.*`x\['b'\]` has 3"):
        model.predict({"a": x, "b": x[:3]}, verbose=0)


def test_arrays_that_are_not_numbers_or_have_no_rows(model):
    x, y = _data(4)
    with pytest.raises(TypeError, match=r"`x` must hold numbers; got .* dtype <U1"):
        model.predict(np.array([["a"] * FEATURES] * 4), verbose=0)
    with pytest.raises(ValueError, match="`sample_weight` must have a leading axis.*scalar"):
        model.fit(x, y, sample_weight=np.float32(2.0), verbose=0)
    with pytest.raises(TypeError, match="`sample_weight` must be one array.*got dict"):
        model.fit(x, y, sample_weight={"w": np.ones(4)}, verbose=0)


# Finding 7: arguments that a dataset would silently ignore ------------------------------------
def test_array_arguments_with_a_dataset_are_errors(model):
    x, y = _data(8)
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    with pytest.raises(ValueError, match="`y` must be None when `x` is a dataset"):
        model.fit(batches, y, verbose=0)
    with pytest.raises(ValueError, match="`sample_weight` must be None when `x` is a dataset"):
        model.fit(batches, sample_weight=np.ones(8), verbose=0)
    with pytest.raises(ValueError, match="`batch_size` must be None when `x` is a dataset"):
        model.fit(batches, batch_size=4, verbose=0)
    with pytest.raises(ValueError, match="`batch_size` must be None when `x` is a dataset"):
        model.evaluate(batches, batch_size=4, verbose=0)
    with pytest.raises(ValueError, match=r"got validation_split=0.5 with x of type list"):
        model.fit(batches, validation_split=0.5, verbose=0)
    # A list of row arrays is read as a list of batches: the error says how to pass arrays.
    with pytest.raises(ValueError, match=r"since it is a list.*np.asarray\(x\)"):
        model.fit(list(x), y, verbose=0)


def test_bad_counts_and_validation_tuples(model):
    x, y = _data(8)
    with pytest.raises(ValueError, match="`steps_per_epoch` must be a positive int; got 0"):
        model.fit(x, y, steps_per_epoch=0, verbose=0)
    with pytest.raises(ValueError, match="`steps` must be a positive int; got -1"):
        model.evaluate(x, y, steps=-1, verbose=0)
    with pytest.raises(ValueError, match="`steps` must be a positive int; got 0"):
        model.predict(x, steps=0, verbose=0)
    with pytest.raises(
        ValueError, match=r"`batch_size` must be a positive int; got an array of shape \(8,\)"
    ):
        model.predict(x, y, verbose=0)  # predict's second argument is batch_size
    with pytest.raises(ValueError, match="`initial_epoch` must be a non-negative int; got -1"):
        model.fit(x, y, initial_epoch=-1, verbose=0)
    with pytest.raises(ValueError, match=r"`validation_data` must be \(x_val, y_val\).*tuple of 1"):
        model.fit(x, y, validation_data=(x,), verbose=0)


def test_steps_with_arrays_take_the_first_batches_as_keras(model):
    # `steps` was ignored for arrays: evaluate(x, y, steps=2) evaluated every row.
    x, y = _data(20)
    first = model.evaluate(x[:8], y[:8], batch_size=4, verbose=0, return_dict=True)
    assert model.evaluate(x, y, batch_size=4, steps=2, verbose=0, return_dict=True) == first
    assert model.predict(x, batch_size=4, steps=2, verbose=0).shape == (8, CLASSES)


def test_datasets_without_batches_are_errors(model):
    with pytest.raises(ValueError, match="yielded no batches.*not empty or already consumed"):
        model.fit(iter([]), verbose=0)
    with pytest.raises(ValueError, match="yielded no batches"):
        model.evaluate(iter([]), verbose=0)
    # A one-shot validation iterator has nothing for the second epoch: that was silent
    # (no val_ logs, so EarlyStopping on val_loss never stopped).
    x, y = _data(8)
    with pytest.raises(ValueError, match="`validation_data` gave no batches to evaluate"):
        model.fit(x, y, validation_data=iter([(x, y)]), epochs=2, verbose=0)


# Finding 7: class labels on the host -----------------------------------------------------------
def test_labels_out_of_range_are_caught_on_the_host_before_training():
    model = _model()
    x, y = _data(12)
    bad = y.copy()
    bad[5] = CLASSES  # TF raises for this; JAX gathered NaN and trained on
    weights = model.get_weights()
    with pytest.raises(
        ValueError,
        match=r"`y` holds class labels outside \[0, 3\).*SparseCategoricalCrossentropy, "
        r"SparseCategoricalAccuracy: 1 of 12 labels, the first 3 at flat index 5",
    ):
        model.fit(x, bad, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], weights[0])  # nothing trained
    with pytest.raises(ValueError, match=r"`validation_data\[1\]` holds class labels.*-1"):
        model.fit(x, y, validation_data=(x, -np.ones_like(y)), verbose=0)
    with pytest.raises(ValueError, match=r"`y` holds class labels outside \[0, 3\)"):
        model.evaluate(x, bad, verbose=0)
    with pytest.raises(ValueError, match=r"`y` must hold integer class labels.*got 0.5"):
        model.fit(x, np.full(12, 0.5, np.float32), verbose=0)
    # A sparse metric alone is checked too; categorical (one-hot) labels are not class indices.
    metric_only = _model(loss="mse", metrics=["sparse_categorical_accuracy"])
    with pytest.raises(ValueError, match="for SparseCategoricalAccuracy: 1 of 12"):
        metric_only.evaluate(x, bad, verbose=0)
    one_hot = _model(loss=losses.CategoricalCrossentropy(from_logits=True), metrics=[])
    one_hot.evaluate(x, np.eye(CLASSES, dtype=np.float32)[y] * 5, verbose=0)


# Finding 7: the opt-in numerics check inside the step -----------------------------------------
@pytest.mark.parametrize("name", ["one_device", "mirrored_8", "central_storage_8"])
def test_check_numerics_names_the_step_of_labels_out_of_range_in_a_dataset(name):
    # Datasets are not checked on the host: the step counts the bad rows (real rows only).
    strategy = STRATEGIES[name]()
    model = _model(strategy, check=True)
    n = strategy.num_replicas_in_sync
    x, y = _data(4 * n)
    bad = y.copy()
    bad[2 * n] = CLASSES + 4  # in batch 2
    batches = [
        (x[i * n : (i + 1) * n], (bad if i == 2 else y)[i * n : (i + 1) * n]) for i in range(4)
    ]
    history = model.fit(batches[:2], verbose=0)  # clean batches pass; logs hold no counts
    assert sorted(history.history) == ["accuracy", "loss"]
    with pytest.raises(
        ValueError, match=r"class labels outside \[0, num_classes\) at training step 2 of epoch 0"
    ):
        model.fit(batches, verbose=0)


@pytest.mark.slow
def test_check_numerics_names_non_finite_losses_and_gradients():
    x, y = _data(16)
    x[9, 0] = np.nan
    model = _model(check=True, spe=2)
    with pytest.raises(
        FloatingPointError,
        match=r"the loss is NaN or infinite at training steps 2 to 3 of epoch 0 \(one execution\)",
    ):
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    with pytest.raises(
        FloatingPointError, match="the loss is NaN or infinite at evaluation batch 2"
    ):
        _model(check=True).evaluate(x, y, batch_size=4, verbose=0)
    # Without the check, the same run trains on NaN without a word, as before.
    history = _model().fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert np.isnan(history.history["loss"][0])

    # A finite loss whose gradient is NaN (sqrt at 0), through the step factory.
    def flat_loss(y_true, y_pred):
        return jnp.sqrt(jnp.abs(y_pred[:, 0] - y_pred[:, 0]))

    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with _numerics(True), strategy.scope():
        state = training.create_train_state(nn.Dense(2), optax.sgd(0.1), jnp.ones((1, 3)))
        clean = training.make_train_step("mse")
        step = training.make_train_step(flat_loss)
    batch = (np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32))
    state, metrics = clean(state, batch)
    assert sorted(metrics) == ["loss"]  # the counts are the check's, not the user's
    # Read when ready, without waiting: at the faulty call or at one of the next few.
    with pytest.raises(
        FloatingPointError, match="gradients are NaN or infinite at call number 1 of this train"
    ):
        for _ in range(10):
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_check_numerics_names_non_finite_gradients_of_the_global_view_step(kind):
    # FSDP and ModelParallel take their gradients outside the replicas' map (the global
    # view), so the check counts them there; a finite loss with a NaN gradient is named.
    def flat_loss(y_true, y_pred):
        return jnp.sqrt(jnp.abs(y_pred[:, 0] - y_pred[:, 0]))

    if kind == "fsdp":
        strategy = jstrategy.experimental.FSDPStrategy(min_shard_size=0)
    else:
        mesh = jstrategy.experimental.DeviceMesh((4, 2), ("batch", "model"))
        layout_map = jstrategy.experimental.LayoutMap(mesh)
        layout_map["kernel"] = (None, "model")
        strategy = jstrategy.experimental.ModelParallelStrategy(layout_map)
    with _numerics(True), strategy.scope():
        state = training.create_train_state(nn.Dense(2), optax.sgd(0.1), jnp.ones((1, 3)))
        clean = training.make_train_step("mse")
        step = training.make_train_step(flat_loss)
    batch = (np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32))
    state, metrics = clean(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    with pytest.raises(
        FloatingPointError, match="gradients are NaN or infinite at call number 1 of this train"
    ):
        for _ in range(10):
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)


def test_check_numerics_is_off_by_default_and_per_compile():
    assert not jstrategy.config.check_numerics_enabled()
    assert not _model()._trainer.compiled_spec.check_numerics
    spec = _model(check=True)._trainer.compiled_spec
    assert spec.check_numerics and set(check_numerics.KEYS) <= set(spec.zero_sums())
    assert not jstrategy.config.check_numerics_enabled()


# Finding 8: a bounded number of compiled programs ---------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_device", "mirrored_4"])
def test_any_number_of_rows_compiles_a_bounded_number_of_programs(name):
    # predict on 400 row counts compiled 400 programs (91 MB); fewer rows than a batch
    # now pad to a power of two per replica: log2(batch_size / replicas) + 1 shapes.
    strategy = STRATEGIES[name]()
    model = _model(strategy)
    x, y = _data(200)
    reference = model.predict(x, batch_size=64, verbose=0)
    row_counts = [*range(1, 65, 3), 64, 100, 131, 200]
    with helpers.count_compiles() as compiles:
        for rows in row_counts:
            out = model.predict(x[:rows], batch_size=64, verbose=0)
            assert out.shape == (rows, CLASSES)  # one row out per row in
            np.testing.assert_allclose(out, reference[:rows], rtol=1e-6, atol=1e-6)
    bound = int(np.log2(64 / strategy.num_replicas_in_sync)) + 1
    assert len(compiles) <= bound, len(compiles)
    with helpers.count_compiles() as compiles:
        for rows in row_counts:
            logs = model.evaluate(x[:rows], y[:rows], batch_size=64, verbose=0, return_dict=True)
            logits = reference[:rows].astype(np.float64)
            log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            expected = -log_probs[np.arange(rows), y[:rows]].mean()
            np.testing.assert_allclose(logs["loss"], expected, rtol=1e-5)  # masks: exact
    assert len(compiles) <= bound, len(compiles)
    with helpers.count_compiles() as compiles:
        for rows in row_counts[::2]:
            model.fit(x[:rows], y[:rows], batch_size=64, verbose=0)
    assert len(compiles) <= bound + 1, len(compiles)  # + the first fit's zero sums
