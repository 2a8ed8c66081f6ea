"""Keras and TensorFlow names jstrategy does not provide, and what to use instead.

A porting user types ``tf.train.Checkpoint`` or ``keras.layers.LSTM`` first; Python's
bare ``AttributeError`` would leave them guessing. Each public namespace's module-level
``__getattr__`` (called only for names the namespace lacks) raises `missing_attribute`,
whose message, for a name in this table, says what to use instead. This table is the one
place these names live.
"""

from __future__ import annotations

__all__ = ["MISSING", "missing_attribute"]

_CHECKPOINT = (
    "Save the whole model with model.save(path) (jstrategy.models.load_model reads it), its "
    "weights with model.save_weights(path), or any state with "
    "jstrategy.CheckpointManager(directory).save(step, state); restore with "
    "model.load_weights, model.restore_checkpoint or CheckpointManager.restore."
)
_PER_EPOCH = (
    "fit takes any iterable of (x, y) batches, or a function that returns a new iterator "
    "for each epoch."
)


def _layer(use: str) -> str:
    """Advice for a Keras layer that a Flax module or a function replaces."""
    return (
        "A Flax linen module or a function of one array is a layer of a jstrategy.Sequential "
        f"(or of your own Flax module): use {use}."
    )


def _combine(use: str) -> str:
    """Advice for a Keras layer that combines several inputs."""
    return (
        "Combine the branches of a functional model (jstrategy.Model(inputs, outputs)) with "
        f"jstrategy.layers.Add or Concatenate, or jstrategy.layers.Lambda({use}) on a list "
        "of them; or write the model as a Flax module whose __call__ combines them."
    )


#: For each public namespace, the Keras/TF names it lacks and what to use instead.
MISSING: dict[str, dict[str, str]] = {
    "jstrategy": {
        "distribute": (
            "jstrategy is tf.distribute: tf.distribute.MirroredStrategy is "
            "jstrategy.MirroredStrategy, and so for every strategy (the experimental ones "
            "are in jstrategy.experimental)."
        ),
        "train": "tf.train's checkpoints: " + _CHECKPOINT,
        "Checkpoint": _CHECKPOINT,
        "saved_model": (
            "Use model.save(path), then jstrategy.models.load_model(path) (a directory, not "
            "a TF SavedModel)."
        ),
        "function": (
            "tf.function is not needed: strategy.run(fn, args=...) compiles fn into one "
            "program over the replicas; compile other functions with jax.jit."
        ),
        "GradientTape": (
            "Take gradients with jax.grad or jax.value_and_grad of a loss function of the "
            "variables: jax.grad(loss_fn)(model.trainable_variables), where loss_fn(v) "
            "calls model(x, training=True, trainable_variables=v)."
        ),
        "Variable": (
            "Variables are a Flax module's (jstrategy.Model(module)) or plain JAX arrays; a "
            "model's are model.trainable_variables and model.variables."
        ),
        "data": (
            "tf.data is not needed: fit takes NumPy arrays, any iterable of (x, y) batches "
            "(a tf.data.Dataset is one), or strategy.experimental_distribute_dataset(ds)."
        ),
        "random": "Use jax.random, with explicit keys (jax.random.key(seed)).",
        "constant": "Use jax.numpy.asarray(value), or a NumPy array.",
        "convert_to_tensor": "Use jax.numpy.asarray(value), or a NumPy array.",
        "cast": "Use x.astype(dtype).",
        "reduce_sum": "Use jax.numpy.sum.",
        "reduce_mean": "Use jax.numpy.mean.",
        "ops": "keras.ops is jax.numpy here (and jax.nn, jax.lax).",
        "backend": "The backend is JAX: use jax and jax.numpy.",
        "math": "Use jax.numpy.",
        "nn": "Use jax.nn.",
        "activations": (
            "Layers take Keras's activation names (activation='relu') or any function, such "
            "as jax.nn.relu."
        ),
        "initializers": (
            "Layers take Keras's initializer names (kernel_initializer='he_normal') or a "
            "flax.linen.initializers function."
        ),
        "applications": (
            "Not provided: build the network from jstrategy.layers, or train a Flax "
            "implementation with jstrategy.Model(module, input_shape=...)."
        ),
        "datasets": (
            "Not provided: load the data as NumPy arrays (keras.datasets itself returns "
            "NumPy arrays, as do sklearn.datasets and tensorflow_datasets' as_numpy) and "
            "pass them to fit."
        ),
        "preprocessing": "Not provided: preprocess with NumPy before fit, or in a Flax module.",
        "Functional": "Use jstrategy.Model(inputs, outputs): Keras's functional API.",
        "clear_session": (
            "Nothing to clear: each jstrategy.Sequential names its layers dense, dense_1, "
            "... on its own."
        ),
        "set_random_seed": "Use jstrategy.utils.set_random_seed(seed).",
        "to_categorical": "Use jstrategy.utils.to_categorical(y, num_classes).",
        "InputLayer": "Use jstrategy.Input(shape=...) (or jstrategy.layers.InputLayer).",
    },
    "jstrategy.layers": {
        "Conv3D": _layer("flax.linen.Conv(filters, kernel_size=(k, k, k)) (channels last)"),
        "Conv2DTranspose": _layer("flax.linen.ConvTranspose(filters, (k, k))"),
        "Conv1DTranspose": _layer("flax.linen.ConvTranspose(filters, (k,))"),
        "DepthwiseConv2D": _layer(
            "flax.linen.Conv(channels, (k, k), feature_group_count=channels)"
        ),
        "SeparableConv2D": _layer(
            "a depthwise flax.linen.Conv (feature_group_count=channels), then a (1, 1) one"
        ),
        "MaxPooling3D": _layer("lambda x: flax.linen.max_pool(x, (2, 2, 2), strides=(2, 2, 2))"),
        "AveragePooling3D": _layer(
            "lambda x: flax.linen.avg_pool(x, (2, 2, 2), strides=(2, 2, 2))"
        ),
        "GlobalAveragePooling3D": _layer("lambda x: x.mean(axis=(1, 2, 3))"),
        "LSTM": _layer("flax.linen.RNN(flax.linen.OptimizedLSTMCell(units))"),
        "GRU": _layer("flax.linen.RNN(flax.linen.GRUCell(units))"),
        "SimpleRNN": _layer("flax.linen.RNN(flax.linen.SimpleCell(units))"),
        "Bidirectional": _layer(
            "flax.linen.Bidirectional(flax.linen.RNN(...), flax.linen.RNN(...))"
        ),
        "MultiHeadAttention": _layer(
            "flax.linen.MultiHeadDotProductAttention(num_heads, qkv_features=...)"
        ),
        "Softmax": "Use Activation('softmax').",
        "ELU": "Use Activation('elu').",
        "LeakyReLU": (
            "Use Activation(lambda x: jax.nn.leaky_relu(x, 0.3)): the LeakyReLU layer's "
            "default slope is 0.3 (Activation('leaky_relu') is Keras's 0.2)."
        ),
        "Rescaling": _layer("lambda x: x * scale + offset"),
        "Permute": _layer("lambda x: x.transpose(0, *dims)"),
        "RepeatVector": _layer("lambda x: jax.numpy.repeat(x[:, None], n, axis=1)"),
        "UpSampling2D": _layer(
            "lambda x: jax.numpy.repeat(jax.numpy.repeat(x, 2, axis=1), 2, axis=2)"
        ),
        "ZeroPadding2D": _layer("lambda x: jax.numpy.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))"),
        "GroupNormalization": _layer("flax.linen.GroupNorm(num_groups)"),
        "Multiply": _combine("lambda t: t[0] * t[1]"),
        "Average": _combine("lambda t: (t[0] + t[1]) / 2"),
        "Dot": _combine("lambda t: jax.numpy.einsum(..., *t)"),
        "Masking": (
            "Masks are not propagated between layers: weight padded positions with "
            "sample_weight (e.g. a (batch, time) mask) instead."
        ),
        "TimeDistributed": (
            "Dense acts on the last axis of inputs of any rank already; for other layers "
            "use flax.linen.vmap, or reshape the time axis into the batch."
        ),
    },
    "jstrategy.utils": {
        "plot_model": "Not provided: model.summary() prints the layers.",
        "model_to_dot": "Not provided: model.summary() prints the layers.",
        "get_file": "Not provided: download with urllib.request.urlretrieve.",
        "image_dataset_from_directory": (
            "Not provided: load the images as NumPy arrays (e.g. with PIL) and pass them, or "
            "any iterable of (x, y) batches, to fit."
        ),
        "text_dataset_from_directory": (
            "Not provided: encode the texts as NumPy arrays of token ids and pass them to fit."
        ),
        "Sequence": _PER_EPOCH,
        "PyDataset": _PER_EPOCH,
        "register_keras_serializable": (
            "model.save saves custom functions by name; give them back with "
            "jstrategy.models.load_model(path, custom_objects={...})."
        ),
        "custom_object_scope": (
            "Pass custom objects to jstrategy.models.load_model(path, custom_objects={...})."
        ),
        "Progbar": "Use jstrategy.callbacks.Progbar.",
    },
    "jstrategy.optimizers": {
        "LossScaleOptimizer": (
            "float16 training scales the loss itself: give the model "
            "dtype_policy='mixed_float16' (model.loss_scale reads the scale)."
        ),
        "legacy": "The jstrategy.optimizers classes are Keras 3's (SGD, Adam, ...).",
    },
    "jstrategy.models": {
        "Sequential": "Use jstrategy.Sequential.",
        "Model": "Use jstrategy.Model.",
        "save_model": "Use model.save(path).",
        "clone_model": (
            "Build the model again from the same layers (jstrategy.Sequential([...])), then "
            "model.set_weights(other.get_weights())."
        ),
        "model_from_json": (
            "jstrategy.models.load_model(path) reads the directory model.save wrote."
        ),
    },
}


def missing_attribute(namespace: str, name: str) -> AttributeError:
    """The `AttributeError` for `name` in the public namespace `namespace`: Python's
    message, plus what to use instead when `name` is a Keras/TF name in `MISSING`.

    Example:

    >>> print(missing_attribute("jstrategy.layers", "Softmax"))
    module 'jstrategy.layers' has no attribute 'Softmax'. Use Activation('softmax').
    """
    message = f"module {namespace!r} has no attribute {name!r}"
    advice = MISSING.get(namespace, {}).get(name)
    return AttributeError(message if advice is None else f"{message}. {advice}")
