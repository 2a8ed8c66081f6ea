"""Bad input to fit/evaluate/predict, the numerics check, and bounded compile caches.

Issue 15 findings 7 and 8: each quiet mistake gets a clear error before any work, labels
out of range are caught on the host (arrays) and by the opt-in check inside the step
(`jstrategy.config.enable_check_numerics`), and any number of rows compiles a bounded
number of programs.
"""

import contextlib

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jstrategy
from conftest import STRATEGIES
from jstrategy import losses

FEATURES = 4
CLASSES = 3


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    return x, (np.arange(rows) % CLASSES).astype(np.int32)


def _model(strategy=None, *, spe=1, loss=None, metrics=("accuracy",)):
    strategy = strategy or jstrategy.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(CLASSES), input_shape=(FEATURES,))
        model.compile(
            optax.sgd(0.1),
            loss=loss or losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=list(metrics),
            steps_per_execution=spe,
        )
    return model


# Finding 8: a bounded number of compiled programs ---------------------------------------------
@contextlib.contextmanager
def _count_compiles():
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("name", ["one_device", "mirrored_4"])
def test_any_number_of_rows_compiles_a_bounded_number_of_programs(name):
    # predict on 400 row counts compiled 400 programs (91 MB); fewer rows than a batch
    # now pad to a power of two per replica: log2(batch_size / replicas) + 1 shapes.
    strategy = STRATEGIES[name]()
    model = _model(strategy)
    x, y = _data(200)
    reference = model.predict(x, batch_size=64, verbose=0)
    row_counts = [*range(1, 65, 3), 64, 100, 131, 200]
    with _count_compiles() as compiles:
        for rows in row_counts:
            out = model.predict(x[:rows], batch_size=64, verbose=0)
            assert out.shape == (rows, CLASSES)  # one row out per row in
            np.testing.assert_allclose(out, reference[:rows], rtol=1e-6, atol=1e-6)
    bound = int(np.log2(64 / strategy.num_replicas_in_sync)) + 1
    assert len(compiles) <= bound, len(compiles)
    with _count_compiles() as compiles:
        for rows in row_counts:
            logs = model.evaluate(x[:rows], y[:rows], batch_size=64, verbose=0, return_dict=True)
            logits = reference[:rows].astype(np.float64)
            log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            expected = -log_probs[np.arange(rows), y[:rows]].mean()
            np.testing.assert_allclose(logs["loss"], expected, rtol=1e-5)  # masks: exact
    assert len(compiles) <= bound, len(compiles)
    with _count_compiles() as compiles:
        for rows in row_counts[::2]:
            model.fit(x[:rows], y[:rows], batch_size=64, verbose=0)
    assert len(compiles) <= bound + 1, len(compiles)  # + the first fit's zero sums
