"""Records Keras 3's loss and metric values, the reference of tests/test_losses_metrics_keras.py.

Run with a Keras 3 environment on the JAX backend (Keras is not a test dependency: the JSON
it writes is committed)::

    KERAS_BACKEND=jax /work/keras-venv/bin/python tests/reference/record_keras_losses.py

For fixed seeded inputs it records, in ``tests/data/keras_losses_reference.json``:

* every loss jstrategy names, on flat outputs ``(b, k)`` and sequence outputs ``(b, t, k)``,
  with no sample weight and each weight shape Keras accepts (``(b,)``, ``(b, 1)``,
  ``(b, t)``, ``(b, t, 1)``), for each reduction; a combination Keras refuses is recorded
  with its error;
* every metric, through ``update_state`` twice (two batches) and ``result``, with the same
  weight shapes; ``Mean`` with ``(b,)`` values and ``(b, 1)`` weights;
* a sequence model (a Dense layer per time step) evaluated and trained with a ``(b, t)``
  padding mask as ``sample_weight``: evaluate's loss and weighted metric, and the kernel
  after one epoch of SGD, from given initial weights.

The inputs are stored too, so the test needs no random generator of the same version.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np

B, T, K = 4, 3, 3
OUT = os.path.join(os.path.dirname(__file__), "..", "data", "keras_losses_reference.json")
REDUCTIONS = ["sum_over_batch_size", "sum", "none", "mean", "mean_with_sample_weight"]


def _rng(seed):
    return np.random.default_rng(seed)


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _inputs():
    """Named arrays: labels and predictions for each kind of loss, flat and per time step."""
    rng = _rng(21)
    arrays = {}
    for prefix, lead in (("flat", (B,)), ("seq", (B, T))):
        logits = rng.normal(size=(*lead, K)).astype(np.float32) * 2
        arrays[f"{prefix}_logits"] = logits
        arrays[f"{prefix}_probs"] = _softmax(logits).astype(np.float32)
        labels = rng.integers(0, K, size=lead)
        arrays[f"{prefix}_sparse_pred"] = logits.argmax(-1).astype(np.int32)
        arrays[f"{prefix}_sparse"] = labels.astype(np.int32)
        arrays[f"{prefix}_onehot"] = np.eye(K, dtype=np.float32)[labels]
        arrays[f"{prefix}_bin_true"] = rng.integers(0, 2, size=(*lead, 1)).astype(np.float32)
        bin_logits = rng.normal(size=(*lead, 1)).astype(np.float32) * 2
        arrays[f"{prefix}_bin_logits"] = bin_logits
        arrays[f"{prefix}_bin_probs"] = (1 / (1 + np.exp(-bin_logits))).astype(np.float32)
        arrays[f"{prefix}_reg_true"] = rng.normal(size=(*lead, 2)).astype(np.float32)
        arrays[f"{prefix}_reg_pred"] = rng.normal(size=(*lead, 2)).astype(np.float32) * 1.5
    arrays["w_b"] = rng.uniform(0.1, 2.0, size=(B,)).astype(np.float32)
    arrays["w_b1"] = arrays["w_b"][:, None]
    w_bt = rng.uniform(0.1, 2.0, size=(B, T)).astype(np.float32)
    w_bt[1, 2] = 0.0  # a padded time step
    w_bt[3, 1:] = 0.0
    arrays["w_bt"] = w_bt
    arrays["w_bt1"] = w_bt[..., None]
    return arrays


# (case name, Keras class, jstrategy arguments, y_true key stem, y_pred key stem)
LOSSES = [
    ("binary_crossentropy", "BinaryCrossentropy", {}, "bin_true", "bin_probs"),
    (
        "binary_crossentropy_logits",
        "BinaryCrossentropy",
        {"from_logits": True},
        "bin_true",
        "bin_logits",
    ),
    (
        "binary_crossentropy_smoothing",
        "BinaryCrossentropy",
        {"from_logits": True, "label_smoothing": 0.2},
        "bin_true",
        "bin_logits",
    ),
    ("categorical_crossentropy", "CategoricalCrossentropy", {}, "onehot", "probs"),
    (
        "categorical_crossentropy_logits",
        "CategoricalCrossentropy",
        {"from_logits": True},
        "onehot",
        "logits",
    ),
    (
        "categorical_crossentropy_smoothing",
        "CategoricalCrossentropy",
        {"from_logits": True, "label_smoothing": 0.1},
        "onehot",
        "logits",
    ),
    ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy", {}, "sparse", "probs"),
    (
        "sparse_categorical_crossentropy_logits",
        "SparseCategoricalCrossentropy",
        {"from_logits": True},
        "sparse",
        "logits",
    ),
    ("mean_squared_error", "MeanSquaredError", {}, "reg_true", "reg_pred"),
    ("mean_absolute_error", "MeanAbsoluteError", {}, "reg_true", "reg_pred"),
    ("huber", "Huber", {"delta": 0.7}, "reg_true", "reg_pred"),
]

METRICS = [
    ("accuracy", "Accuracy", {}, "sparse", "sparse_pred"),
    ("binary_accuracy", "BinaryAccuracy", {}, "bin_true", "bin_probs"),
    ("binary_accuracy_threshold", "BinaryAccuracy", {"threshold": 0.3}, "bin_true", "bin_probs"),
    ("categorical_accuracy", "CategoricalAccuracy", {}, "onehot", "probs"),
    ("sparse_categorical_accuracy", "SparseCategoricalAccuracy", {}, "sparse", "probs"),
    ("mean_squared_error", "MeanSquaredError", {}, "reg_true", "reg_pred"),
    ("mean_absolute_error", "MeanAbsoluteError", {}, "reg_true", "reg_pred"),
]

WEIGHTS = {"flat": [None, "w_b", "w_b1"], "seq": [None, "w_b", "w_b1", "w_bt", "w_bt1"]}


def _value(fn):
    try:
        return {"value": np.asarray(fn(), np.float64).tolist()}
    except Exception as e:  # Keras refuses the combination: record why
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def _record_losses(arrays):
    out = []
    for name, cls, kwargs, y_key, p_key in LOSSES:
        for prefix in ("flat", "seq"):
            y, p = arrays[f"{prefix}_{y_key}"], arrays[f"{prefix}_{p_key}"]
            for w_key in WEIGHTS[prefix]:
                w = None if w_key is None else arrays[w_key]
                for reduction in REDUCTIONS:
                    loss = getattr(keras.losses, cls)(reduction=reduction, **kwargs)
                    case = {
                        "name": name,
                        "class": cls,
                        "kwargs": kwargs,
                        "y_true": f"{prefix}_{y_key}",
                        "y_pred": f"{prefix}_{p_key}",
                        "sample_weight": w_key,
                        "reduction": reduction,
                    }
                    case.update(
                        _value(lambda loss=loss, y=y, p=p, w=w: loss(y, p, sample_weight=w))
                    )
                    out.append(case)
    return out


def _record_metrics(arrays):
    out = []
    for name, cls, kwargs, y_key, p_key in METRICS:
        for prefix in ("flat", "seq"):
            y = arrays[f"{prefix}_{y_key}"]
            p = arrays[f"{prefix}_{p_key}"]
            for w_key in WEIGHTS[prefix]:
                w = None if w_key is None else arrays[w_key]

                def run(cls=cls, kwargs=kwargs, y=y, p=p, w=w):
                    m = getattr(keras.metrics, cls)(**kwargs)
                    m.update_state(y, p, sample_weight=w)
                    # A second batch: the first rows reversed, halved weights.
                    m.update_state(y[::-1], p[::-1], None if w is None else w[::-1] * 0.5)
                    return m.result()

                case = {
                    "name": name,
                    "class": cls,
                    "kwargs": kwargs,
                    "y_true": f"{prefix}_{y_key}",
                    "y_pred": f"{prefix}_{p_key}",
                    "sample_weight": w_key,
                }
                case.update(_value(run))
                out.append(case)
    values = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    for w_key in ("w_b", "w_b1"):
        m = keras.metrics.Mean()
        m.update_state(values, sample_weight=arrays[w_key])
        out.append(
            {
                "name": "mean",
                "class": "Mean",
                "values": values.tolist(),
                "sample_weight": w_key,
                "value": float(m.result()),
            }
        )
    m = keras.metrics.Mean()
    m.update_state(arrays["seq_reg_pred"][..., 0], sample_weight=arrays["w_bt"])
    out.append(
        {
            "name": "mean",
            "class": "Mean",
            "values_key": "seq_reg_pred_0",
            "sample_weight": "w_bt",
            "value": float(m.result()),
        }
    )
    return out


def _record_sequence_model():
    """A Dense layer per time step, SCCE from logits, a (b, t) padding mask as weight."""
    rng = _rng(7)
    n, t, f, k = 10, 5, 4, 3
    x = rng.normal(size=(n, t, f)).astype(np.float32)
    y = rng.integers(0, k, size=(n, t)).astype(np.int32)
    lengths = rng.integers(1, t + 1, size=(n,))
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    kernel = rng.normal(size=(f, k)).astype(np.float32) * 0.5
    bias = rng.normal(size=(k,)).astype(np.float32) * 0.1

    def model():
        m = keras.Sequential([keras.Input((t, f)), keras.layers.Dense(k)])
        m.layers[0].set_weights([kernel, bias])
        m.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"],
            weighted_metrics=["sparse_categorical_accuracy"],
        )
        return m

    m = model()
    evaluated = m.evaluate(x, y, sample_weight=mask, batch_size=4, verbose=0, return_dict=True)
    unweighted = m.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    m = model()
    history = m.fit(x, y, sample_weight=mask, batch_size=4, epochs=2, shuffle=False, verbose=0)
    new_kernel, new_bias = m.layers[0].get_weights()
    return {
        "x": x.tolist(),
        "y": y.tolist(),
        "mask": mask.tolist(),
        "kernel": kernel.tolist(),
        "bias": bias.tolist(),
        "learning_rate": 0.5,
        "batch_size": 4,
        "epochs": 2,
        "evaluate": {k_: float(v) for k_, v in evaluated.items()},
        "evaluate_unweighted": {k_: float(v) for k_, v in unweighted.items()},
        "fit_history": {k_: [float(v) for v in vs] for k_, vs in history.history.items()},
        "kernel_after": new_kernel.tolist(),
        "bias_after": new_bias.tolist(),
    }


def main():
    if keras.backend.backend() != "jax":
        sys.exit("Run with KERAS_BACKEND=jax.")
    arrays = _inputs()
    record = {
        "keras_version": keras.__version__,
        "backend": keras.backend.backend(),
        "inputs": {k: v.tolist() for k, v in arrays.items()},
        "losses": _record_losses(arrays),
        "metrics": _record_metrics(arrays),
        "sequence_model": _record_sequence_model(),
    }
    with open(OUT, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {len(record['losses'])} loss and {len(record['metrics'])} metric cases to {OUT}")


if __name__ == "__main__":
    main()
