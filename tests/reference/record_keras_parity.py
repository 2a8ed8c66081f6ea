"""Records Keras 3's numbers for the habits of issue 34, the reference of tests/test_keras_parity.py.

Run with a Keras 3 environment on the JAX backend (Keras is not a test dependency: the JSON
it writes is committed)::

    KERAS_BACKEND=jax /tmp/kerasenv/bin/python tests/reference/record_keras_parity.py

For fixed seeded inputs it records, in ``tests/data/keras_parity_reference.json``:

* ``get_weights`` of Sequential models (names, shapes, values) and their predictions:
  Dense-BatchNorm-Dense after two epochs (so the moving statistics are not their initial
  values), twelve Dense layers (``dense_10`` after ``dense_9``), Conv2D-pooling-Dense and
  Embedding-LayerNormalization-Dense;
* ``fit(validation_split=0.25)`` on 10 rows from given weights: the losses per epoch;
* training with frozen layers (a Dense and a BatchNormalization, ``trainable=False``, the
  BatchNormalization then in inference mode) from given weights: the final weights;
* training with weight constraints (MaxNorm, NonNeg, UnitNorm, MinMaxNorm): the final
  weights;
* a ``mixed_bfloat16`` model whose last ``Activation("softmax", dtype="float32")`` computes
  in float32 (Keras's mixed-precision guide): its predictions;
* ``keras.utils.to_categorical`` of a few label arrays.

The inputs are stored too, so the test needs no random generator of the same version.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "data", "keras_parity_reference.json")
L = keras.layers


def _rng(seed):
    return np.random.default_rng(seed)


def _floats(shape, seed):
    return _rng(seed).normal(size=shape).astype(np.float32)


def _listed(arrays):
    return [np.asarray(a).tolist() for a in arrays]


def _weights(model):
    return {
        "names": [w.path.split("/", 1)[1] for w in model.weights],
        "shapes": [list(w.shape) for w in model.weights],
        "values": _listed(model.get_weights()),
    }


def _models():
    keras.utils.set_random_seed(1)
    x, y = _floats((16, 3), 2), _floats((16, 2), 3)
    x_test = _floats((4, 3), 4)
    bn = keras.Sequential([keras.Input((3,)), L.Dense(4), L.BatchNormalization(), L.Dense(2)])
    bn.compile(keras.optimizers.SGD(0.1), "mse")
    bn.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    twelve = keras.Sequential(
        [keras.Input((3,)), *[L.Dense(3, activation="tanh") for _ in range(12)]]
    )
    images = _floats((2, 6, 6, 2), 5)
    conv = keras.Sequential(
        [keras.Input((6, 6, 2)), L.Conv2D(3, 3), L.MaxPooling2D(), L.Flatten(), L.Dense(2)]
    )
    tokens = _rng(6).integers(0, 10, (3, 5))
    embed = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            L.Embedding(10, 4),
            L.LayerNormalization(),
            L.Flatten(),
            L.Dense(1),
        ]
    )
    return {
        "dense_bn_dense": {
            "x": x_test.tolist(),
            **_weights(bn),
            "predict": bn.predict(x_test, verbose=0).tolist(),
        },
        "twelve_dense": {
            "x": x_test.tolist(),
            **_weights(twelve),
            "predict": twelve.predict(x_test, verbose=0).tolist(),
        },
        "conv": {
            "x": images.tolist(),
            **_weights(conv),
            "predict": conv.predict(images, verbose=0).tolist(),
        },
        "embedding": {
            "x": tokens.tolist(),
            **_weights(embed),
            "predict": embed.predict(tokens, verbose=0).tolist(),
        },
    }


def _validation_split():
    x, y = _floats((10, 3), 7), _floats((10, 2), 8)
    initial = [_floats((3, 2), 9), _floats((2,), 10)]
    model = keras.Sequential([keras.Input((3,)), L.Dense(2)])
    model.set_weights(initial)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(
        x, y, batch_size=4, epochs=2, validation_split=0.25, shuffle=False, verbose=0
    ).history
    return {
        "x": x.tolist(),
        "y": y.tolist(),
        "initial": _listed(initial),
        "loss": history["loss"],
        "val_loss": history["val_loss"],
    }


def _trained(model, initial, x, y):
    model.set_weights(initial)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return _listed(model.get_weights())


def _frozen():
    x, y = _floats((16, 3), 11), _floats((16, 2), 12)
    model = keras.Sequential([keras.Input((3,)), L.Dense(4), L.BatchNormalization(), L.Dense(2)])
    initial = [_floats(w.shape, 20 + i) for i, w in enumerate(model.weights)]
    initial[5] = np.abs(initial[5]) + 0.5  # a moving variance
    model.layers[0].trainable = False
    model.layers[1].trainable = False
    return {
        "x": x.tolist(),
        "y": y.tolist(),
        "initial": _listed(initial),
        "final": _trained(model, initial, x, y),
    }


def _constrained():
    x, y = _floats((16, 3), 13), _floats((16, 2), 14)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            L.Dense(
                4,
                kernel_constraint=keras.constraints.MaxNorm(0.5),
                bias_constraint=keras.constraints.NonNeg(),
            ),
            L.Dense(3, kernel_constraint=keras.constraints.UnitNorm(axis=0)),
            L.Dense(2, kernel_constraint=keras.constraints.MinMaxNorm(0.2, 0.6, rate=0.5)),
        ]
    )
    initial = [_floats(w.shape, 30 + i) for i, w in enumerate(model.weights)]
    return {
        "x": x.tolist(),
        "y": y.tolist(),
        "initial": _listed(initial),
        "final": _trained(model, initial, x, y),
    }


def _mixed_softmax():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = keras.Sequential(
            [keras.Input((3,)), L.Dense(4), L.Activation("softmax", dtype="float32")]
        )
        initial = [_floats((3, 4), 40), _floats((4,), 41)]
        model.set_weights(initial)
        x = _floats((5, 3), 42)
        out = model.predict(x, verbose=0)
        return {
            "x": x.tolist(),
            "initial": _listed(initial),
            "predict": out.tolist(),
            "dtype": str(out.dtype),
        }
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _categorical():
    cases = [([0, 2, 1, 2], None), ([[1], [0], [3]], None), ([[0, 1], [1, 0]], 3), ([4], 6)]
    return [
        {"x": x, "num_classes": n, "out": keras.utils.to_categorical(x, n).tolist()}
        for x, n in cases
    ]


def main():
    record = {
        "keras_version": keras.__version__,
        "backend": keras.backend.backend(),
        "models": _models(),
        "validation_split": _validation_split(),
        "frozen": _frozen(),
        "constrained": _constrained(),
        "mixed_softmax": _mixed_softmax(),
        "to_categorical": _categorical(),
    }
    with open(OUT, "w") as f:
        json.dump(record, f)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
