"""A loss that expects probabilities warns once when it gets logits (issue 21, item 11).

``loss="sparse_categorical_crossentropy"`` keeps Keras's meaning (probabilities); on a model
that outputs logits it trains badly and Keras says nothing. jstrategy counts the rows that
are not probabilities inside the step, reads the first step's count when it is ready
(no host callback, no wait) and warns once, naming ``from_logits=True``.
"""

import warnings

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import losses
from jstrategy.losses import NotProbabilitiesWarning


def _data(rows=64, classes=3, seed=0):
    return helpers.classification_data(rows, 5, seed, classes)


class Softmax(nn.Module):
    units: int = 3

    @nn.compact
    def __call__(self, x):
        return nn.softmax(nn.Dense(self.units)(x))


class Sigmoid(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.sigmoid(nn.Dense(1)(x))


def _fit(module, loss, *, y=None, strategy=None, epochs=3, spe=1):
    x, labels = _data()
    y = labels if y is None else y
    with (strategy or jstrategy.OneDeviceStrategy("cpu:0")).scope():
        model = jstrategy.Model(module, input_shape=(5,), seed=0)
        model.compile("adam", loss=loss, steps_per_execution=spe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=epochs, verbose=0)
        model.evaluate(x, y, verbose=0)
    return [w for w in caught if issubclass(w.category, NotProbabilitiesWarning)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [None, jstrategy.MirroredStrategy()], ids=["one", "mirrored"])
@pytest.mark.parametrize("spe", [1, 2])
def test_logits_under_a_probability_loss_warn_once_per_model(strategy, spe):
    caught = _fit(nn.Dense(3), "sparse_categorical_crossentropy", strategy=strategy, spe=spe)
    assert len(caught) == 1  # 3 epochs and an evaluation: one warning
    message = str(caught[0].message)
    assert "SparseCategoricalCrossentropy(from_logits=True)" in message
    assert "100% of the real rows" in message
    assert "training step 0 of epoch 0" in message or "training steps 0 to 1 of epoch 0" in message
    assert caught[0].filename == __file__  # points at the user's fit


@pytest.mark.slow
def test_probabilities_and_from_logits_do_not_warn():
    assert _fit(Softmax(), "sparse_categorical_crossentropy") == []
    assert _fit(nn.Dense(3), losses.SparseCategoricalCrossentropy(from_logits=True)) == []
    assert _fit(nn.Dense(3), "mse", y=np.zeros((64, 3), np.float32)) == []
    onehot = np.eye(3, dtype=np.float32)[_data()[1]]
    assert _fit(Softmax(), "categorical_crossentropy", y=onehot) == []
    binary = (_data()[1] == 0).astype(np.float32)[:, None]
    assert _fit(Sigmoid(), "binary_crossentropy", y=binary) == []


@pytest.mark.slow
def test_each_cross_entropy_names_its_own_fix():
    onehot = np.eye(3, dtype=np.float32)[_data()[1]]
    (cce,) = _fit(nn.Dense(3), "categorical_crossentropy", y=onehot)
    assert "CategoricalCrossentropy(from_logits=True)" in str(cce.message)
    binary = (_data()[1] == 0).astype(np.float32)[:, None]
    (bce,) = _fit(nn.Dense(1), "binary_crossentropy", y=binary)
    assert "BinaryCrossentropy(from_logits=True)" in str(bce.message)
    assert "values in [0, 1])" in str(bce.message)


@pytest.mark.slow
def test_rows_that_do_not_sum_to_one_warn_for_categorical_losses():
    class Halves(nn.Module):  # in [0, 1], but each row sums to 1.5
        @nn.compact
        def __call__(self, x):
            return 0.5 * nn.sigmoid(nn.Dense(3)(x)) + 0.5 * nn.softmax(nn.Dense(3)(x))

    (caught,) = _fit(Halves(), "sparse_categorical_crossentropy")
    assert "summing to 1" in str(caught.message)


@pytest.mark.slow
def test_a_new_compile_checks_again_and_warnings_as_errors_stop_fit():
    x, y = _data()
    model = jstrategy.Model(nn.Dense(3), input_shape=(5,), seed=0)
    model.compile("adam", loss="sparse_categorical_crossentropy")
    with pytest.raises(NotProbabilitiesWarning, match=r"from_logits=True"):
        model.fit(x, y, batch_size=16, verbose=0)  # filterwarnings = error
    model.compile("adam", loss="sparse_categorical_crossentropy")
    with pytest.warns(NotProbabilitiesWarning, match="training step 0 of epoch 0"):
        model.fit(x, y, batch_size=16, verbose=0)


def test_the_train_step_factory_warns_once_and_the_program_has_no_host_callback():
    model = nn.Dense(3)
    x, y = _data()
    state = jstrategy.training.create_train_state(model, optax.adam(1e-2), jnp.asarray(x[:1]))
    step = jstrategy.training.make_train_step("sparse_categorical_crossentropy")
    batch = (jnp.asarray(x[:16]), jnp.asarray(y[:16]))
    text = step.lower(state, batch).as_text()
    assert "callback" not in text  # the count is a reduction in the step, read later
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The first call's count is read by a later call once the device has it, never
        # waited for: how many calls that takes depends on the machine's load, so the
        # calls go on (each finished before the next) until it has been read, then more.
        for _ in range(5):
            state, logs = step(state, batch)
            jax.block_until_ready(logs)
        for _ in range(200):
            if any(issubclass(w.category, NotProbabilitiesWarning) for w in caught):
                break
            state, logs = step(state, batch)
            jax.block_until_ready(logs)
        for _ in range(3):
            state, logs = step(state, batch)
        jax.block_until_ready(logs)
    got = [w for w in caught if issubclass(w.category, NotProbabilitiesWarning)]
    assert len(got) == 1 and "call number 1 of this train step" in str(got[0].message)
    assert set(logs) == {"loss"}  # the count is not a metric


def test_the_probability_count_is_exact_over_real_rows():
    from jstrategy._src.training.step import probability_check
    from jstrategy._src.training.step.body import make_spec

    spec = make_spec("sparse_categorical_crossentropy", None, jstrategy.OneDeviceStrategy("cpu:0"))
    y_pred = jnp.array([[0.2, 0.8], [2.0, -1.0], [0.5, 0.4], [3.0, 0.0]])
    mask = jnp.array([1.0, 1.0, 1.0, 0.0])  # the last row is padding
    got = probability_check.count(spec, y_pred, mask)[probability_check.KEY]
    assert float(got) == 2.0  # row 1 outside [0, 1]; row 2 sums to 0.9
    logits_spec = make_spec(
        losses.SparseCategoricalCrossentropy(from_logits=True), None, spec.strategy
    )
    assert probability_check.count(logits_spec, y_pred, mask) == {}
