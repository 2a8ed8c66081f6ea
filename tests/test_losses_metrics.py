"""Losses and metrics: Keras's formulas, per-example shapes, resolution by name."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import losses
from jstrategy import metrics

B = 6
EPS = 1e-7


def _rng(seed=0):
    return np.random.default_rng(seed)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# NumPy references written from Keras's definitions (float64).


def _np_bce(y, p, smoothing=0.0):
    y = y * (1 - smoothing) + 0.5 * smoothing
    p = np.clip(p, EPS, 1 - EPS)
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def _np_cce(y, p, smoothing=0.0):
    y = y * (1 - smoothing) + smoothing / y.shape[-1]
    p = np.clip(p / p.sum(axis=-1, keepdims=True), EPS, 1 - EPS)
    return -(y * np.log(p)).sum(axis=-1)


def _np_huber(err, delta):
    a = np.abs(err)
    return np.where(a <= delta, 0.5 * a**2, delta * (a - 0.5 * delta))


def _close(actual, expected, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- losses


@pytest.mark.slow
@pytest.mark.parametrize("label_shape", [(B,), (B, 1)])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_binary_crossentropy_matches_keras_for_probabilities_and_logits(label_shape, smoothing):
    rng = _rng()
    logits = rng.normal(size=(B, 1)) * 3
    y = rng.integers(0, 2, size=label_shape).astype(np.float32)
    expected = _np_bce(y.reshape(B, 1), _sigmoid(logits), smoothing)[:, 0]

    probs_loss = losses.BinaryCrossentropy(label_smoothing=smoothing, reduction="none")
    logit_loss = losses.BinaryCrossentropy(
        from_logits=True, label_smoothing=smoothing, reduction="none"
    )
    out = probs_loss(y, _sigmoid(logits).astype(np.float32))
    assert out.shape == (B,)
    _close(out, expected, rtol=1e-4)
    _close(logit_loss(y, logits.astype(np.float32)), expected, rtol=1e-4)


def test_binary_crossentropy_from_logits_is_stable_for_large_logits():
    loss = losses.BinaryCrossentropy(from_logits=True, reduction="none")
    out = loss(np.array([0.0, 1.0, 1.0]), np.array([[100.0], [100.0], [-100.0]]))
    _close(out, [100.0, 0.0, 100.0], atol=1e-4)
    grad = jax.grad(lambda z: loss(jnp.array([0.0]), z).sum())(jnp.array([[100.0]]))
    assert np.isfinite(np.asarray(grad)).all()


def test_binary_crossentropy_multilabel_averages_labels_and_rank1_stays_per_example():
    rng = _rng(1)
    p = rng.uniform(0.05, 0.95, size=(B, 4))
    y = rng.integers(0, 2, size=(B, 4)).astype(np.float64)
    _close(losses.BinaryCrossentropy(reduction="none")(y, p), _np_bce(y, p).mean(axis=1))
    p1, y1 = p[:, 0], y[:, 0]
    _close(losses.BinaryCrossentropy(reduction="none")(y1, p1), _np_bce(y1, p1))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_categorical_crossentropy_matches_keras(smoothing):
    rng = _rng(2)
    logits = rng.normal(size=(B, 5))
    y = np.eye(5)[rng.integers(0, 5, size=B)]
    expected = _np_cce(y, _softmax(logits), smoothing)
    _close(
        losses.CategoricalCrossentropy(label_smoothing=smoothing, reduction="none")(
            y, _softmax(logits)
        ),
        expected,
        rtol=1e-4,
    )
    _close(
        losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=smoothing, reduction="none"
        )(y, logits),
        expected,
        rtol=1e-4,
    )


def test_categorical_crossentropy_renormalizes_and_keeps_zero_rows_finite():
    y = np.eye(3)[[0, 1]]
    p = np.array([[2.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    out = np.asarray(losses.CategoricalCrossentropy(reduction="none")(y, p))
    _close(out[0], -np.log(0.5))
    assert np.isfinite(out[1])


@pytest.mark.slow
def test_sparse_categorical_crossentropy_labels_with_or_without_trailing_axis():
    rng = _rng(3)
    logits = rng.normal(size=(B, 4)).astype(np.float32)
    labels = rng.integers(0, 4, size=B)
    expected = -np.log(_softmax(logits.astype(np.float64))[np.arange(B), labels])
    for from_logits, pred in ((True, logits), (False, _softmax(logits))):
        loss = losses.SparseCategoricalCrossentropy(from_logits=from_logits, reduction="none")
        _close(loss(labels, pred), expected, rtol=1e-4)
        _close(loss(labels[:, None], pred), expected, rtol=1e-4)
        _close(loss(labels.astype(np.float32), pred), expected, rtol=1e-4)


@pytest.mark.slow
def test_sparse_categorical_crossentropy_keeps_sequence_axes():
    # Keras reduces only the class axis: one loss per time step, (b, t).
    rng = _rng(4)
    logits = rng.normal(size=(B, 3, 7))
    labels = rng.integers(0, 7, size=(B, 3))
    per_token = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), labels)
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    out = loss(labels, logits)
    assert out.shape == (B, 3)
    _close(out, np.asarray(per_token), rtol=1e-5)
    _close(loss.per_example(labels, logits), np.asarray(per_token).mean(axis=1), rtol=1e-5)


@pytest.mark.parametrize("y_shape,p_shape", [((B,), (B, 1)), ((B, 1), (B,)), ((B, 3), (B, 3))])
def test_regression_losses_match_keras_and_reconcile_trailing_axis(y_shape, p_shape):
    rng = _rng(5)
    y = rng.normal(size=y_shape)
    p = rng.normal(size=p_shape) * 2
    err = p.reshape(B, -1) - y.reshape(B, -1)
    _close(losses.MeanSquaredError(reduction="none")(y, p), (err**2).mean(axis=1))
    _close(losses.MeanAbsoluteError(reduction="none")(y, p), np.abs(err).mean(axis=1))
    _close(losses.Huber(delta=0.7, reduction="none")(y, p), _np_huber(err, 0.7).mean(axis=1))


def test_losses_average_the_last_axis_only():
    # Keras: (b, t, f) outputs give one loss per time step; per_example averages those.
    rng = _rng(6)
    y, p = rng.normal(size=(B, 2, 3)), rng.normal(size=(B, 2, 3))
    mse = losses.MeanSquaredError(reduction="none")
    _close(mse(y, p), ((p - y) ** 2).mean(axis=-1))
    _close(mse.per_example(y, p), ((p - y) ** 2).reshape(B, -1).mean(axis=1))


def test_bfloat16_predictions_are_computed_in_float32():
    y = np.zeros((B,), np.float32)
    p = jnp.full((B, 1), 3.0, jnp.bfloat16)
    out = losses.MeanSquaredError(reduction="none")(y, p)
    assert out.dtype == jnp.float32
    _close(out, np.full(B, 9.0))


@pytest.mark.slow
def test_losses_are_jittable_and_differentiable():
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    labels = jnp.array([0, 2])
    logits = jnp.array([[1.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
    _close(jax.jit(loss)(labels, logits), np.asarray(loss(labels, logits)))
    grad = jax.grad(lambda z: loss(labels, z).sum())(logits)
    expected = np.asarray(jax.nn.softmax(logits)) - np.eye(3)[[0, 2]]
    _close(grad, expected, rtol=1e-5)


@pytest.mark.parametrize(
    "loss,y,p,match",
    [
        (
            losses.MeanSquaredError(reduction="none"),
            np.zeros((B, 3)),
            np.zeros((B, 2)),
            "same shape",
        ),
        (
            losses.MeanSquaredError(reduction="none"),
            np.zeros((B,)),
            np.zeros((B + 1,)),
            "same batch size",
        ),
        (
            losses.MeanSquaredError(reduction="none"),
            np.float32(0),
            np.float32(1),
            "leading batch axis",
        ),
        (
            losses.CategoricalCrossentropy(reduction="none"),
            np.zeros(B),
            np.ones((B, 3)),
            "SparseCategorical",
        ),
        (
            losses.SparseCategoricalCrossentropy(reduction="none"),
            np.zeros((B, 2)),
            np.ones((B, 3)),
            "integer",
        ),
        (
            losses.SparseCategoricalCrossentropy(reduction="none"),
            np.zeros(B),
            np.ones(B),
            "class axis",
        ),
    ],
)
def test_losses_reject_mismatched_shapes(loss, y, p, match):
    with pytest.raises(ValueError, match=match):
        loss(y, p)


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: losses.BinaryCrossentropy(label_smoothing=1.5, reduction="none"),
            "label_smoothing",
        ),
        (
            lambda: losses.CategoricalCrossentropy(from_logits="yes", reduction="none"),
            "from_logits",
        ),
        (lambda: losses.Huber(delta=0.0, reduction="none"), "delta"),
        (lambda: losses.MeanSquaredError(name="", reduction="none"), "name"),
    ],
)
def test_loss_constructors_validate(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "name,cls",
    [
        ("binary_crossentropy", losses.BinaryCrossentropy),
        ("categorical_crossentropy", losses.CategoricalCrossentropy),
        ("sparse_categorical_crossentropy", losses.SparseCategoricalCrossentropy),
        ("mse", losses.MeanSquaredError),
        ("mean_squared_error", losses.MeanSquaredError),
        ("mae", losses.MeanAbsoluteError),
        ("mean_absolute_error", losses.MeanAbsoluteError),
        ("huber", losses.Huber),
        ("BinaryCrossentropy", losses.BinaryCrossentropy),
    ],
)
def test_get_resolves_names_to_keras_named_losses(name, cls):
    loss = losses.get(name)
    assert type(loss) is cls
    assert (
        loss.name
        == {
            losses.BinaryCrossentropy: "binary_crossentropy",
            losses.CategoricalCrossentropy: "categorical_crossentropy",
            losses.SparseCategoricalCrossentropy: "sparse_categorical_crossentropy",
            losses.MeanSquaredError: "mean_squared_error",
            losses.MeanAbsoluteError: "mean_absolute_error",
            losses.Huber: "huber_loss",
        }[cls]
    )


def test_get_returns_instances_instantiates_classes_and_wraps_functions():
    bce = losses.BinaryCrossentropy(from_logits=True, reduction="none")
    assert losses.get(bce) is bce
    assert type(losses.get(losses.Huber)) is losses.Huber

    def squared_log_error(y_true, y_pred):
        return (jnp.log1p(y_pred) - jnp.log1p(y_true)) ** 2

    wrapped = losses.get(squared_log_error)
    assert isinstance(wrapped, losses.Loss)
    assert wrapped.name == "squared_log_error"
    y, p = np.array([[0.0, 1.0], [2.0, 3.0]]), np.array([[1.0, 1.0], [1.0, 1.0]])
    _close(wrapped.per_example(y, p), ((np.log1p(p) - np.log1p(y)) ** 2).mean(axis=1))
    assert losses.get(lambda y, p: p - y).name == "lambda"


def test_wrapped_function_must_return_per_example_values():
    wrapped = losses.get(lambda y, p: jnp.mean(p - y))
    with pytest.raises(ValueError, match="one value per example"):
        wrapped(np.zeros(B), np.ones(B))


def test_get_rejects_unknown_names_listing_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown loss 'cross_entropy'.*'mse'"):
        losses.get("cross_entropy")
    with pytest.raises(ValueError, match="must be a jstrategy.losses.Loss"):
        losses.get(3)


def test_subclassing_loss_implements_call():
    class AbsCube(losses.Loss):
        def call(self, y_true, y_pred):
            return jnp.abs(y_pred - y_true) ** 3

    assert AbsCube().name == "abs_cube" and AbsCube(name="cube").name == "cube"
    _close(AbsCube().per_example(np.zeros((2, 2)), np.array([[1.0, 2.0], [0.0, 1.0]])), [4.5, 0.5])
    with pytest.raises(NotImplementedError, match="must implement"):
        losses.Loss(name="base")(np.zeros(2), np.zeros(2))


# --------------------------------------------------------------------------- metrics


def test_accuracy_is_exact_equality():
    out = metrics.Accuracy().per_example(
        np.array([1, 2, 3, 4]), np.array([[1.0], [2.0], [0.0], [4.0]])
    )
    _close(out, [1, 1, 0, 1])


@pytest.mark.parametrize("label_shape", [(B,), (B, 1)])
def test_binary_accuracy_thresholds_probabilities_and_logits_alike(label_shape):
    rng = _rng(7)
    logits = rng.normal(size=(B, 1)) * 4
    y = rng.integers(0, 2, size=label_shape)
    for threshold in (0.5, 0.8):
        expected = ((_sigmoid(logits[:, 0]) > threshold) == y.reshape(B)).astype(float)
        _close(metrics.BinaryAccuracy(threshold).per_example(y, _sigmoid(logits)), expected)
        _close(metrics.BinaryAccuracy(threshold, from_logits=True).per_example(y, logits), expected)


def test_binary_accuracy_from_logits_is_exact_where_sigmoid_saturates():
    # sigmoid(20) and sigmoid(40) both round to 1.0 in float32, so thresholding the sigmoid
    # cannot tell them apart; the cut at logit(threshold) ~ 27.6 can.
    m = metrics.BinaryAccuracy(threshold=1 - 1e-12, from_logits=True)
    _close(m(np.array([0.0, 1.0]), np.array([[20.0], [40.0]], np.float32)), [1.0, 1.0])
    with pytest.raises(ValueError, match=r"probability in \(0, 1\)"):
        metrics.BinaryAccuracy(threshold=1.0, from_logits=True)


def test_categorical_and_sparse_accuracy_use_argmax():
    rng = _rng(8)
    logits = rng.normal(size=(B, 4))
    labels = rng.integers(0, 4, size=B)
    expected = (logits.argmax(-1) == labels).astype(float)
    _close(metrics.CategoricalAccuracy().per_example(np.eye(4)[labels], logits), expected)
    _close(metrics.SparseCategoricalAccuracy().per_example(labels, logits), expected)
    _close(
        metrics.SparseCategoricalAccuracy().per_example(labels[:, None].astype(float), logits),
        expected,
    )


def test_error_metrics_equal_losses():
    rng = _rng(9)
    y, p = rng.normal(size=(B, 3)), rng.normal(size=(B, 3))
    _close(
        metrics.MeanSquaredError().per_example(y, p),
        np.asarray(losses.MeanSquaredError(reduction="none")(y, p)),
    )
    _close(metrics.MeanAbsoluteError().per_example(y, p), np.abs(p - y).mean(axis=1))


@pytest.mark.parametrize(
    "loss,cls,from_logits",
    [
        (losses.BinaryCrossentropy(reduction="none"), metrics.BinaryAccuracy, False),
        (
            losses.BinaryCrossentropy(from_logits=True, reduction="none"),
            metrics.BinaryAccuracy,
            True,
        ),
        ("binary_crossentropy", metrics.BinaryAccuracy, False),
        (
            losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
            metrics.SparseCategoricalAccuracy,
            None,
        ),
        ("categorical_crossentropy", metrics.CategoricalAccuracy, None),
    ],
)
@pytest.mark.parametrize("name", ["accuracy", "acc"])
def test_accuracy_resolves_from_the_loss_and_keeps_its_name(loss, cls, from_logits, name):
    m = metrics.get(name, loss=loss)
    assert type(m) is cls
    assert m.name == name
    if from_logits is not None:
        assert m.from_logits is from_logits


def test_accuracy_for_binary_logits_loss_thresholds_logits_at_zero():
    m = metrics.get("accuracy", loss=losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    # A 0.5 threshold on raw logits would call the logit 0.3 negative; sigmoid(0.3) > 0.5.
    _close(m.per_example(np.array([0, 1, 1]), np.array([[-0.3], [0.3], [0.7]])), [1, 1, 1])


@pytest.mark.parametrize(
    "y,p,expected",
    [
        (np.array([1, 0]), np.array([[0.9], [0.7]]), [1, 0]),  # binary
        (np.array([1, 0]), np.array([[0.1, 0.9], [0.2, 0.8]]), [1, 0]),  # sparse
        (np.array([[0, 1], [1, 0]]), np.array([[0.1, 0.9], [0.2, 0.8]]), [1, 0]),  # categorical
    ],
)
def test_accuracy_without_a_known_loss_decides_from_shapes(y, p, expected):
    for loss in (None, losses.MeanSquaredError(reduction="none"), lambda a, b: b - a):
        m = metrics.get("accuracy", loss=loss)
        assert m.name == "accuracy"
        _close(m.per_example(y, p), expected)


@pytest.mark.parametrize(
    "name,cls",
    [
        ("mae", metrics.MeanAbsoluteError),
        ("mean_absolute_error", metrics.MeanAbsoluteError),
        ("mse", metrics.MeanSquaredError),
        ("binary_accuracy", metrics.BinaryAccuracy),
        ("categorical_accuracy", metrics.CategoricalAccuracy),
        ("sparse_categorical_accuracy", metrics.SparseCategoricalAccuracy),
    ],
)
def test_get_resolves_names_keeping_the_given_name(name, cls):
    m = metrics.get(name)
    assert type(m) is cls
    assert m.name == name


def test_get_metric_objects_classes_functions_and_losses():
    acc = metrics.SparseCategoricalAccuracy()
    assert metrics.get(acc) is acc
    assert type(metrics.get(metrics.Accuracy)) is metrics.Accuracy
    assert type(metrics.get("CategoricalAccuracy")) is metrics.CategoricalAccuracy

    def max_error(y_true, y_pred):
        return jnp.max(jnp.abs(y_pred - y_true), axis=-1)

    wrapped = metrics.get(max_error)
    assert wrapped.name == "max_error" and wrapped.direction is None
    _close(wrapped.per_example(np.zeros((2, 2)), np.array([[1.0, -3.0], [0.5, 0.0]])), [3.0, 0.5])

    as_metric = metrics.get(losses.Huber())  # tracked by its per-example values
    assert as_metric.name == "huber_loss" and as_metric.direction == "down"
    _close(as_metric.per_example(np.zeros(2), np.array([0.5, 2.0])), [0.125, 1.5])


def test_metric_values_are_float_per_example_and_jittable():
    m = metrics.get("accuracy", loss="sparse_categorical_crossentropy")
    out = jax.jit(m.per_example)(
        jnp.array([0, 1, 1]), jnp.array([[2.0, 1.0], [0.0, 1.0], [3.0, 1.0]])
    )
    assert out.shape == (3,) and jnp.issubdtype(out.dtype, jnp.floating)
    _close(out, [1, 1, 0])


def test_get_metric_rejects_unknown_names_listing_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown metric 'precision'.*'accuracy'"):
        metrics.get("precision")
    with pytest.raises(ValueError, match="must be a jstrategy.metrics.Metric"):
        metrics.get(None)
    with pytest.raises(ValueError, match="threshold"):
        metrics.BinaryAccuracy(threshold="high")


def test_masked_replica_aggregation_equals_the_mean_over_real_rows():
    """The contract with the train step: sum(value * mask) and sum(mask) across replicas."""
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    rng = _rng(10)
    real = 13  # padded to 16 rows: the last replica holds 3 padding rows
    logits = np.zeros((16, 3), np.float32)
    logits[:real] = rng.normal(size=(real, 3))
    labels = np.zeros(16, np.int32)
    labels[:real] = rng.integers(0, 3, size=real)
    mask = np.arange(16) < real
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    acc = metrics.get("accuracy", loss=loss)

    def body(y, z, m):
        w = m.astype(jnp.float32)
        sums = [jnp.sum(jnp.where(m, f.per_example(y, z), 0.0)) for f in (loss, acc)]
        total = jax.lax.psum(jnp.stack([*sums, jnp.sum(w)]), strategy.axis_name)
        return total[:2] / total[2]

    spec = P(strategy.axis_name)
    fn = jax.jit(jax.shard_map(body, mesh=strategy.mesh, in_specs=spec, out_specs=P()))
    put = lambda a: jax.device_put(a, strategy.batch_sharding())  # noqa: E731
    got = np.asarray(fn(put(labels), put(logits), put(mask)))

    ref_loss = -np.log(_softmax(logits[:real].astype(np.float64))[np.arange(real), labels[:real]])
    ref_acc = (logits[:real].argmax(-1) == labels[:real]).mean()
    _close(got, [ref_loss.mean(), ref_acc], rtol=1e-5)


# TF habits (issue 14), finding 7: reduction= on losses
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
    x, y = helpers.regression_data(10)  # padded to 12 rows: 3 per replica, 2 of them padding
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
        helpers.dense_regression_model(
            jstrategy.OneDeviceStrategy("cpu:0"),
            loss=jstrategy.losses.MeanSquaredError(reduction="sum"),
        )


# TF habits (issue 14), finding 2 (a): stateful metrics that count real rows of every replica
def test_stateful_metrics_inside_run_count_the_real_rows_of_every_replica():
    strategy = jstrategy.MirroredStrategy()
    logits, labels = helpers.logits_and_labels(100)  # batches of 32: the last has 4 real rows of 32
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
    logits, labels = helpers.logits_and_labels(20, seed=1)
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
