"""Issue 21, finding 10: a serving loop's request sizes share a bounded number of programs.

`predict(x, batch_size=len(x))` for request sizes 1..600 compiled one program per batch
size (+90 MB over 400 sizes): row counts under a fixed `batch_size` were bucketed, batch
sizes were not. `evaluate` and `predict` now pad each batch to a bucket of sizes
(`numerics.bucket`: powers of two and three times them, per replica) and mask the padding.
"""

import flax.linen as nn
import helpers
import jax
import numpy as np
import optax
import pytest

import jstrategy
from conftest import STRATEGIES
from jstrategy import losses

FEATURES, CLASSES, MAX_ROWS = 6, 3, 600


def _model(strategy):
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(CLASSES), input_shape=(FEATURES,), seed=2)
        model.compile(
            optax.sgd(0.1),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _bound(replicas: int) -> int:
    """Programs for any request sizes up to MAX_ROWS: 2 * log2(per-replica rows) + 1."""
    return int(2 * np.log2(-(-MAX_ROWS // replicas))) + 1


# The sizes a serving loop sees: every one of many, the buckets' edges and around them.
SIZES = sorted({*range(1, MAX_ROWS + 1, 7), 2, 3, 4, 5, 383, 384, 385, 511, 512, 513, MAX_ROWS})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_device", "mirrored_4"])
def test_predict_with_batch_size_len_x_compiles_a_bounded_number_of_programs(name):
    strategy = STRATEGIES[name]()
    model = _model(strategy)
    x = np.random.default_rng(0).normal(size=(MAX_ROWS, FEATURES)).astype(np.float32)
    # Unbucketed: the module applied to all the rows at once, by hand.
    expected = np.asarray(jax.jit(model.module.apply)(jax.device_get(model.variables), x))
    model.predict(x[:1], batch_size=1, verbose=0)  # the first program is no one's extra
    with helpers.count_compiles() as compiles:
        for rows in SIZES:
            out = model.predict(x[:rows], batch_size=rows, verbose=0)
            assert out.shape == (rows, CLASSES)
            np.testing.assert_allclose(out, expected[:rows], rtol=1e-6, atol=1e-6)
    # Before: one program per request size (95 on one device).
    assert len(compiles) <= _bound(strategy.num_replicas_in_sync), len(compiles)
    assert len(SIZES) > 4 * _bound(strategy.num_replicas_in_sync)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_device", "mirrored_4"])
def test_evaluate_with_many_batch_sizes_compiles_a_bounded_number_of_programs(name):
    strategy = STRATEGIES[name]()
    model = _model(strategy)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(MAX_ROWS, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, MAX_ROWS).astype(np.int32)
    logits = np.asarray(jax.jit(model.module.apply)(jax.device_get(model.variables), x))
    log_probs = logits.astype(np.float64)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    model.evaluate(x[:1], y[:1], batch_size=1, verbose=0)
    sizes = SIZES[::2]
    with helpers.count_compiles() as compiles:
        for rows in sizes:
            # Requests of `rows` rows in batches of `rows`, and all the rows in batches of
            # `rows` (full batches, then a partial last one): every row counts once.
            for n in (rows, MAX_ROWS):
                logs = model.evaluate(x[:n], y[:n], batch_size=rows, verbose=0, return_dict=True)
                loss = -log_probs[np.arange(n), y[:n]].mean()
                accuracy = (logits[:n].argmax(-1) == y[:n]).mean()
                np.testing.assert_allclose(logs["loss"], loss, rtol=1e-5)
                np.testing.assert_allclose(logs["accuracy"], accuracy, rtol=1e-6)
    assert len(compiles) <= _bound(strategy.num_replicas_in_sync), len(compiles)
    assert len(sizes) > 2 * _bound(strategy.num_replicas_in_sync)
