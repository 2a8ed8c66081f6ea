"""Records Keras 3's layer outputs and gradients, the reference of tests/test_keras_layers.py.

Run with a Keras 3 environment on the JAX backend (Keras is not a test dependency: the JSON
it writes is committed)::

    KERAS_BACKEND=jax /work/venvs/keras/bin/python tests/reference/record_keras_layers.py

For each case of `CASES` (a layer class, its keyword arguments, the shapes of its inputs)
it builds the Keras layer, gives it fixed weights, and records in
``tests/data/keras_layers_reference.json``:

* the inputs, the weights (by Keras's name: ``kernel``, ``bias``) and a cotangent, all
  seeded NumPy normals (ReLU's inputs scaled so that they cross ``max_value``);
* the output of ``layer(inputs)``;
* the gradients of ``sum(output * cotangent)`` with respect to each input and each
  weight (``jax.grad`` of the layer's ``stateless_call``).

The arguments are Keras's names and values, so the test builds jstrategy's layer from the
same dict. The inputs are stored too, so the test needs no random generator of the same
version.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import keras
import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "data", "keras_layers_reference.json")

SEQ = (2, 9, 3)  # (batch, steps, channels)
SEQ_FIRST = (2, 3, 9)  # (batch, channels, steps)
IMG = (2, 4, 5, 3)
IMG_FIRST = (2, 3, 4, 5)

# (case name, Keras layer class, keyword arguments, input shapes, input scale)
CASES = [
    ("conv1d_valid", "Conv1D", {"filters": 4, "kernel_size": 3}, [SEQ], 1.0),
    (
        "conv1d_same_strides2",
        "Conv1D",
        {"filters": 4, "kernel_size": 3, "strides": 2, "padding": "same"},
        [SEQ],
        1.0,
    ),
    (
        "conv1d_same_even_kernel_strides3",
        "Conv1D",
        {"filters": 2, "kernel_size": 4, "strides": 3, "padding": "same"},
        [SEQ],
        1.0,
    ),
    (
        "conv1d_causal_dilation2",
        "Conv1D",
        {"filters": 4, "kernel_size": 3, "padding": "causal", "dilation_rate": 2},
        [SEQ],
        1.0,
    ),
    (
        "conv1d_causal_strides2",
        "Conv1D",
        {"filters": 4, "kernel_size": 2, "padding": "causal", "strides": 2},
        [SEQ],
        1.0,
    ),
    (
        "conv1d_same_dilation3",
        "Conv1D",
        {"filters": 3, "kernel_size": 2, "padding": "same", "dilation_rate": 3},
        [SEQ],
        1.0,
    ),
    (
        "conv1d_valid_dilation2_tanh",
        "Conv1D",
        {"filters": 3, "kernel_size": 3, "dilation_rate": 2, "activation": "tanh"},
        [SEQ],
        1.0,
    ),
    (
        "conv1d_strides3_relu_no_bias",
        "Conv1D",
        {"filters": 4, "kernel_size": 5, "strides": 3, "activation": "relu", "use_bias": False},
        [SEQ],
        1.0,
    ),
    (
        "conv1d_groups3",
        "Conv1D",
        {"filters": 6, "kernel_size": 3, "groups": 3, "padding": "same"},
        [(2, 9, 6)],
        1.0,
    ),
    (
        "conv1d_channels_first_same",
        "Conv1D",
        {"filters": 4, "kernel_size": 3, "padding": "same", "data_format": "channels_first"},
        [SEQ_FIRST],
        1.0,
    ),
    (
        "conv1d_channels_first_valid_strides2",
        "Conv1D",
        {"filters": 4, "kernel_size": 3, "strides": 2, "data_format": "channels_first"},
        [SEQ_FIRST],
        1.0,
    ),
    (
        "conv1d_channels_first_causal_dilation2",
        "Conv1D",
        {
            "filters": 2,
            "kernel_size": 3,
            "padding": "causal",
            "dilation_rate": 2,
            "data_format": "channels_first",
        },
        [SEQ_FIRST],
        1.0,
    ),
    ("max_pooling1d_default", "MaxPooling1D", {}, [SEQ], 1.0),
    (
        "max_pooling1d_3_strides2_same",
        "MaxPooling1D",
        {"pool_size": 3, "strides": 2, "padding": "same"},
        [SEQ],
        1.0,
    ),
    ("max_pooling1d_4_strides1", "MaxPooling1D", {"pool_size": 4, "strides": 1}, [SEQ], 1.0),
    (
        "max_pooling1d_channels_first_same",
        "MaxPooling1D",
        {"pool_size": 2, "padding": "same", "data_format": "channels_first"},
        [SEQ_FIRST],
        1.0,
    ),
    (
        "max_pooling1d_channels_first_3_strides2",
        "MaxPooling1D",
        {"pool_size": 3, "strides": 2, "data_format": "channels_first"},
        [SEQ_FIRST],
        1.0,
    ),
    ("average_pooling1d_2", "AveragePooling1D", {"pool_size": 2}, [SEQ], 1.0),
    (
        "average_pooling1d_3_strides2_same",
        "AveragePooling1D",
        {"pool_size": 3, "strides": 2, "padding": "same"},
        [SEQ],
        1.0,
    ),
    (
        "average_pooling1d_4_strides3_same",
        "AveragePooling1D",
        {"pool_size": 4, "strides": 3, "padding": "same"},
        [SEQ],
        1.0,
    ),
    (
        "average_pooling1d_3_strides1",
        "AveragePooling1D",
        {"pool_size": 3, "strides": 1},
        [SEQ],
        1.0,
    ),
    (
        "average_pooling1d_channels_first_same",
        "AveragePooling1D",
        {"pool_size": 4, "strides": 3, "padding": "same", "data_format": "channels_first"},
        [SEQ_FIRST],
        1.0,
    ),
    (
        "average_pooling1d_channels_first_valid",
        "AveragePooling1D",
        {"pool_size": 2, "data_format": "channels_first"},
        [SEQ_FIRST],
        1.0,
    ),
    ("global_average_pooling1d", "GlobalAveragePooling1D", {}, [SEQ], 1.0),
    ("global_average_pooling1d_keepdims", "GlobalAveragePooling1D", {"keepdims": True}, [SEQ], 1.0),
    (
        "global_average_pooling1d_channels_first",
        "GlobalAveragePooling1D",
        {"data_format": "channels_first"},
        [SEQ_FIRST],
        1.0,
    ),
    (
        "global_average_pooling1d_channels_first_keepdims",
        "GlobalAveragePooling1D",
        {"data_format": "channels_first", "keepdims": True},
        [SEQ_FIRST],
        1.0,
    ),
    ("global_max_pooling1d", "GlobalMaxPooling1D", {}, [SEQ], 1.0),
    ("global_max_pooling1d_keepdims", "GlobalMaxPooling1D", {"keepdims": True}, [SEQ], 1.0),
    (
        "global_max_pooling1d_channels_first",
        "GlobalMaxPooling1D",
        {"data_format": "channels_first"},
        [SEQ_FIRST],
        1.0,
    ),
    (
        "global_max_pooling1d_channels_first_keepdims",
        "GlobalMaxPooling1D",
        {"data_format": "channels_first", "keepdims": True},
        [SEQ_FIRST],
        1.0,
    ),
    ("global_max_pooling2d", "GlobalMaxPooling2D", {}, [IMG], 1.0),
    ("global_max_pooling2d_keepdims", "GlobalMaxPooling2D", {"keepdims": True}, [IMG], 1.0),
    (
        "global_max_pooling2d_channels_first",
        "GlobalMaxPooling2D",
        {"data_format": "channels_first"},
        [IMG_FIRST],
        1.0,
    ),
    (
        "global_max_pooling2d_channels_first_keepdims",
        "GlobalMaxPooling2D",
        {"data_format": "channels_first", "keepdims": True},
        [IMG_FIRST],
        1.0,
    ),
    ("relu_default", "ReLU", {}, [(4, 16)], 4.0),
    ("relu_max_value_6", "ReLU", {"max_value": 6.0}, [(4, 16)], 4.0),
    ("relu_max_value_2_5", "ReLU", {"max_value": 2.5}, [(4, 16)], 4.0),
    ("relu_negative_slope", "ReLU", {"negative_slope": 0.1}, [(4, 16)], 4.0),
    (
        "relu_negative_slope_max_value",
        "ReLU",
        {"negative_slope": 0.2, "max_value": 3.0},
        [(4, 16)],
        4.0,
    ),
    ("relu_threshold", "ReLU", {"threshold": 0.5}, [(4, 16)], 4.0),
    (
        "relu_threshold_negative_slope",
        "ReLU",
        {"threshold": 0.5, "negative_slope": 0.3},
        [(4, 16)],
        4.0,
    ),
    (
        "relu_threshold_slope_max_value",
        "ReLU",
        {"threshold": 1.0, "negative_slope": 0.1, "max_value": 2.0},
        [(4, 16)],
        4.0,
    ),
    ("relu_threshold_max_value_6", "ReLU", {"threshold": 1.5, "max_value": 6.0}, [(4, 16)], 4.0),
    ("relu_sequences", "ReLU", {"max_value": 1.0}, [SEQ], 2.0),
    ("add_two", "Add", {}, [(2, 5, 3), (2, 5, 3)], 1.0),
    ("add_three", "Add", {}, [(2, 5, 3), (2, 5, 3), (2, 5, 3)], 1.0),
    ("add_broadcast", "Add", {}, [(2, 5, 3), (2, 1, 3)], 1.0),
    ("add_lower_rank", "Add", {}, [(2, 3), (2, 5, 3)], 1.0),
    ("concatenate_default", "Concatenate", {}, [(2, 5, 3), (2, 5, 2)], 1.0),
    ("concatenate_axis1", "Concatenate", {"axis": 1}, [(2, 5, 3), (2, 2, 3)], 1.0),
    ("concatenate_axis_minus2", "Concatenate", {"axis": -2}, [(2, 4, 3), (2, 1, 3)], 1.0),
    ("concatenate_three", "Concatenate", {}, [(2, 4), (2, 1), (2, 3)], 1.0),
    ("concatenate_images_axis3", "Concatenate", {"axis": 3}, [IMG, (2, 4, 5, 1)], 1.0),
]


def _normal(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


def _record(index, name, cls, kwargs, shapes, scale):
    layer = getattr(keras.layers, cls)(**kwargs)
    inputs = [_normal(shape, 1000 * index + i, scale) for i, shape in enumerate(shapes)]
    many = cls in ("Add", "Concatenate")
    layer(inputs if many else inputs[0])  # builds the weights
    weights = {}
    for i, w in enumerate(layer.trainable_weights):
        value = _normal(w.shape, 1000 * index + 100 + i, 0.5)
        w.assign(value)
        weights[w.name] = value
    output = np.asarray(layer(inputs if many else inputs[0]))
    cotangent = _normal(output.shape, 1000 * index + 200)

    def loss(trainable, xs):
        out, _ = layer.stateless_call(
            trainable, layer.non_trainable_variables, xs if many else xs[0]
        )
        return jnp.sum(out * cotangent)

    values = [jnp.asarray(weights[w.name]) for w in layer.trainable_weights]
    grad_w, grad_x = jax.grad(loss, argnums=(0, 1))(values, [jnp.asarray(x) for x in inputs])
    names = [w.name for w in layer.trainable_weights]
    return {
        "name": name,
        "layer": cls,
        "kwargs": kwargs,
        "inputs": [x.tolist() for x in inputs],
        "weights": {k: v.tolist() for k, v in weights.items()},
        "cotangent": cotangent.tolist(),
        "output": output.tolist(),
        "grad_inputs": [np.asarray(g).tolist() for g in grad_x],
        "grad_weights": {k: np.asarray(g).tolist() for k, g in zip(names, grad_w, strict=True)},
    }


def main():
    assert keras.backend.backend() == "jax", "run with KERAS_BACKEND=jax"
    cases = [_record(i, *case) for i, case in enumerate(CASES)]
    record = {
        "keras_version": keras.__version__,
        "backend": keras.backend.backend(),
        "jax_version": jax.__version__,
        "cases": cases,
    }
    with open(OUT, "w") as f:
        json.dump(record, f)
    print(f"wrote {OUT}: {len(cases)} cases")


if __name__ == "__main__":
    main()
