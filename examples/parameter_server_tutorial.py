"""TF's parameter-server tutorial, custom training loop, ported to jstrategy line for line.

TensorFlow's tutorial (tutorials/distribute/parameter_server_training, "Training with a
custom training loop") trains an embedding lookup and a sigmoid unit on 200 synthetic
examples: three of seven "features" each, label "yes" when "avenger" is among them. Three
workers and two parameter servers; the embedding (8 x 16384 floats, 512 KiB) is split in two
shards by `MinSizePartitioner`. Its ``step_fn`` pulls the variables, computes the gradients
and applies them inside ``strategy.run``'s replica function, updates an accuracy metric
there, and returns ``strategy.reduce("SUM", losses, axis=None)``.

What differs, and why:

* The model is a Flax module and its variables are a `VariableTree` created on the
  parameter servers: ``variables.read()`` is TF's implicit read of ``model``'s variables,
  ``variables.apply_gradients(grads)`` is ``optimizer.apply_gradients(zip(grads, vars))``
  (the optimizer is given to `create_variables`, and its state lives beside each variable).
* ``strategy.run`` compiles ``replica_fn`` (as ``tf.function`` traces it): the reads become
  the compiled program's inputs, pulled at every call, and the updates its outputs, pushed
  after it. ``replica_fn`` is defined inside ``step_fn`` as in TF, and compiles once.
* ``jstrategy.metrics.Accuracy`` created in ``strategy.scope()`` keeps its two counters on
  the parameter servers, as TF's metric variables; it counts only the real rows of a
  padded partial batch.
* The string lookups are dictionaries; the ``tf.data`` pipeline is a Python iterable.

    python examples/parameter_server_tutorial.py                 # threads of this process
    python examples/parameter_server_tutorial.py --backend ray   # Ray actors
"""

from __future__ import annotations

import argparse
import os
import random

# One fake CPU device per task; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jstrategy
from jstrategy.coordinator import ClusterCoordinator
from jstrategy.coordinator import local_cluster_resolver
from jstrategy.experimental.partitioners import MinSizePartitioner

NUM_WORKERS = 3
NUM_PS = 2

# --- The tutorial's data: 200 examples of three features out of seven ----------------------
feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]


def feature_and_label_gen(num_examples=200, seed=0):
    rng = random.Random(seed)
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = rng.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


examples = feature_and_label_gen()
# StringLookup(vocabulary=feature_vocab, mask_token=None): 0 is out of vocabulary.
feature_ids = {word: i + 1 for i, word in enumerate(feature_vocab)}
# StringLookup(vocabulary=label_vocab, num_oov_indices=0, mask_token=None).
label_ids = {word: i for i, word in enumerate(label_vocab)}
FEATURES = np.array([[feature_ids[w] for w in row] for row in examples["features"]], np.int32)
LABELS = np.array([[label_ids[w] for w in row] for row in examples["label"]], np.int32)


class TutorialDataset:
    """``from_tensor_slices(examples).map(lookup).shuffle(200).batch(32).repeat()``."""

    def __init__(self, seed):
        self.seed = seed

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        while True:
            order = rng.permutation(len(FEATURES))
            for i in range(0, len(order), 32):  # the last batch has 8 rows, as in TF
                rows = order[i : i + 32]
                yield {"features": FEATURES[rows]}, LABELS[rows]


def dataset_fn(input_context):
    return TutorialDataset(seed=input_context.input_pipeline_id)


# --- The tutorial's model: Embedding(8, 16384) -> mean -> Dense(1, sigmoid, L2(1e-4)) ------
class Model(nn.Module):
    @nn.compact
    def __call__(self, inputs):
        emb_layer = nn.Embed(
            num_embeddings=len(feature_vocab) + 1, features=16384, embedding_init=_uniform
        )
        emb_output = jnp.mean(emb_layer(inputs["features"]), axis=1)
        # Dense(units=1, activation="sigmoid"): the logits, the sigmoid is applied below.
        return nn.Dense(1, kernel_init=nn.initializers.glorot_uniform())(emb_output)


def _uniform(key, shape, dtype=jnp.float32):
    """Keras's Embedding initializer: uniform in [-0.05, 0.05)."""
    return jax.random.uniform(key, shape, dtype, -0.05, 0.05)


model = Model()


def binary_crossentropy(labels, logits):
    """Keras's BinaryCrossentropy(reduction=NONE) of a sigmoid layer's output.

    Keras computes it from the sigmoid's logits (the layer's output keeps them), so its
    gradient does not vanish where the sigmoid saturates.
    """
    per_unit = optax.sigmoid_binary_cross_entropy(logits, labels.astype(logits.dtype))
    return jnp.mean(per_unit, axis=-1)


def model_loss(params, batch_data, labels):
    logits = model.apply({"params": params}, batch_data)
    pred = jax.nn.sigmoid(logits)
    per_example_loss = binary_crossentropy(labels, logits)
    loss = jstrategy.compute_average_loss(per_example_loss)
    # kernel_regularizer=tf.keras.regularizers.L2(1e-4), scaled by 1 / replicas.
    loss += 1e-4 * jnp.sum(params["Dense_0"]["kernel"] ** 2)
    return loss, pred


def main(
    num_epochs: int = 4, steps_per_epoch: int = 5, backend: str = "local", verbose: bool = True
) -> dict:
    """Runs the tutorial's custom loop; returns the epochs' accuracies and the final loss."""
    variable_partitioner = MinSizePartitioner(min_shard_bytes=(256 << 10), max_shards=NUM_PS)
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=NUM_WORKERS, num_ps=NUM_PS),
        variable_partitioner=variable_partitioner,
        backend=backend,
    )

    with strategy.scope():
        # Create the model. Keras's RMSprop(learning_rate=0.1): decay 0.9, epsilon 1e-7.
        params = model.init(jax.random.key(0), {"features": FEATURES[:1]})["params"]
        optimizer = optax.rmsprop(learning_rate=0.1, decay=0.9, eps=1e-7)
        variables = strategy.create_variables(params, optimizer=optimizer)
        accuracy = jstrategy.metrics.Accuracy()

    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            (loss, pred), gradients = jax.value_and_grad(model_loss, has_aux=True)(
                variables.read(), batch_data, labels
            )
            variables.apply_gradients(gradients)

            actual_pred = (pred > 0.5).astype(jnp.int32)
            accuracy.update_state(labels, actual_pred)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce("SUM", losses, axis=None)

    coordinator = ClusterCoordinator(strategy)

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    accuracies = []
    for i in range(num_epochs):
        accuracy.reset_state()
        for _ in range(steps_per_epoch):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        # Wait at epoch boundaries.
        coordinator.join()
        accuracies.append(float(accuracy.result()))
        if verbose:
            print(f"Finished epoch {i}, accuracy is {accuracies[-1]:f}.")

    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    final_loss = float(loss.fetch())
    if verbose:
        print(f"Final loss is {final_loss:f}")
    coordinator.shutdown()
    return {"accuracies": accuracies, "final_loss": final_loss, "variables": variables}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    main(backend=parser.parse_args().backend)
