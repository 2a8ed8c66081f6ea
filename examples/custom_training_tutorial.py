"""TF's "Custom training with tf.distribute.Strategy" tutorial, ported to jstrategy line for line.

TensorFlow's tutorial (tutorials/distribute/custom_training) trains a small CNN on Fashion
MNIST with `MirroredStrategy` and a custom loop: stateful metrics, a loss with
``reduction=NONE`` averaged by ``compute_average_loss``, ``optimizer.apply_gradients``
inside ``strategy.run``, and ``strategy.reduce`` of the per-replica losses. Here the data
are synthetic images of the same shapes (28 x 28 x 1, 10 classes; a class is a bright
patch at its own place, plus noise): nothing is downloaded.

What differs, and why (each line below keeps TF's name and place):

* The model is a Flax module inside a `jstrategy.Model`; layers add no ``model.losses``,
  so the tutorial's L2 kernel regularizers are a penalty written in `compute_loss`.
* JAX differentiates functions, not a tape: ``with tf.GradientTape() as tape`` becomes a
  function of the trainable variables, ``jax.value_and_grad(fn)(model.trainable_variables)``,
  and the model computes with them (``model(images, training=True,
  trainable_variables=variables)``).
* ``strategy.run`` compiles its function itself, so ``@tf.function`` is dropped.
* The datasets are Python generator functions, shuffled by a seeded NumPy generator.
* ``tf.train.Checkpoint`` becomes ``model.save_weights`` / ``load_weights`` (the model's
  variables; the tutorial restores only the model too).

    python examples/custom_training_tutorial.py            # MirroredStrategy over every device
"""

from __future__ import annotations

import argparse
import os
import tempfile

# Eight fake CPU devices when there is no accelerator; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jstrategy

NUM_CLASSES = 10


def make_data(num_train: int = 1024, num_test: int = 256, seed: int = 0):
    """Fashion-MNIST-shaped images: class k is a bright 6 x 6 patch at its own place."""
    rng = np.random.default_rng(seed)

    def images_of(labels):
        images = rng.normal(0.0, 0.3, size=(len(labels), 28, 28, 1)).astype(np.float32)
        for i, label in enumerate(labels):
            row, col = 4 + 7 * (label // 4), 2 + 6 * (label % 4)
            images[i, row : row + 6, col : col + 6, 0] += 1.0
        return images

    train_labels = rng.integers(0, NUM_CLASSES, size=num_train).astype(np.int32)
    test_labels = rng.integers(0, NUM_CLASSES, size=num_test).astype(np.int32)
    return (images_of(train_labels), train_labels), (images_of(test_labels), test_labels)


class CNN(nn.Module):
    """The tutorial's model: Conv2D(32, 3), MaxPool, Conv2D(64, 3), MaxPool, Dense(64), Dense(10)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3), padding="VALID")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(64, (3, 3), padding="VALID")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(NUM_CLASSES)(x)


def main(
    strategy=None,
    *,
    epochs: int = 10,
    batch_size_per_replica: int = 64,
    num_train: int = 1024,
    num_test: int = 256,
    checkpoint_dir: str | None = None,
    verbose: bool = True,
) -> dict:
    """Runs the tutorial; returns each epoch's train loss and accuracies, test loss and
    accuracies, and the restored model's accuracy."""
    (train_images, train_labels), (test_images, test_labels) = make_data(num_train, num_test)

    # If the list of devices is not specified, all the devices are used.
    strategy = strategy or jstrategy.MirroredStrategy()
    if verbose:
        print(f"Number of devices: {strategy.num_replicas_in_sync}")

    # Setup input pipeline.
    BUFFER_SIZE = len(train_images)  # (the tutorial's names)
    BATCH_SIZE_PER_REPLICA = batch_size_per_replica
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = epochs
    shuffle = np.random.default_rng(1)

    def train_dataset():  # .shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE)
        order = shuffle.permutation(BUFFER_SIZE)
        for start in range(0, BUFFER_SIZE, GLOBAL_BATCH_SIZE):
            index = order[start : start + GLOBAL_BATCH_SIZE]
            yield train_images[index], train_labels[index]

    def test_dataset():  # .batch(GLOBAL_BATCH_SIZE)
        for start in range(0, len(test_images), GLOBAL_BATCH_SIZE):
            end = start + GLOBAL_BATCH_SIZE
            yield test_images[start:end], test_labels[start:end]

    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    # Create the model.
    def create_model():
        return jstrategy.Model(CNN(), input_shape=(28, 28, 1), seed=0)

    checkpoint_dir = checkpoint_dir or tempfile.mkdtemp(prefix="training_checkpoints_")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

    # Define the loss function.
    with strategy.scope():
        # Set reduction to `NONE` so you can do the reduction yourself.
        loss_object = jstrategy.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=jstrategy.losses.Reduction.NONE
        )

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = jstrategy.compute_average_loss(per_example_loss)
            if model_losses:
                loss += jstrategy.scale_regularization_loss(sum(model_losses))
            return loss

    # Define the metrics to track loss and accuracy.
    with strategy.scope():
        test_loss = jstrategy.metrics.Mean(name="test_loss")
        train_accuracy = jstrategy.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = jstrategy.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    # A model and an optimizer must be created under `strategy.scope`.
    with strategy.scope():
        model = create_model()
        optimizer = jstrategy.optimizers.Adam(learning_rate=0.001)

    def kernel_regularization(variables):  # kernel_regularizer=tf.keras.regularizers.L2(1e-5)
        return [1e-5 * jnp.sum(v**2) for v in variables if v.ndim > 1]

    def train_step(inputs):
        images, labels = inputs

        def forward(variables):  # with tf.GradientTape() as tape:
            predictions = model(images, training=True, trainable_variables=variables)
            loss = compute_loss(labels, predictions, kernel_regularization(variables))
            return loss, predictions

        (loss, predictions), gradients = jax.value_and_grad(forward, has_aux=True)(
            model.trainable_variables
        )
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))

        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs

        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)

        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    # `run` replicates the provided computation and runs it with the distributed input.
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(jstrategy.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    history: dict[str, list[float]] = {
        "loss": [],
        "accuracy": [],
        "test_loss": [],
        "test_accuracy": [],
    }
    for epoch in range(EPOCHS):
        # TRAIN LOOP
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches

        # TEST LOOP
        for x in test_dist_dataset:
            distributed_test_step(x)

        if epoch % 2 == 0:
            model.save_weights(checkpoint_prefix)

        template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
        if verbose:
            print(
                template.format(
                    epoch + 1,
                    train_loss,
                    train_accuracy.result() * 100,
                    test_loss.result(),
                    test_accuracy.result() * 100,
                )
            )
        history["loss"].append(float(train_loss))
        history["accuracy"].append(float(train_accuracy.result()))
        history["test_loss"].append(float(test_loss.result()))
        history["test_accuracy"].append(float(test_accuracy.result()))

        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    # Restore the latest checkpoint and test, without a strategy.
    eval_accuracy = jstrategy.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
    new_model = create_model()
    new_model.load_weights(checkpoint_prefix)

    def eval_step(images, labels):
        predictions = new_model(images, training=False)
        eval_accuracy(labels, predictions)

    for images, labels in test_dataset():
        eval_step(images, labels)
    restored = float(eval_accuracy.result())
    if verbose:
        print(f"Accuracy after restoring the saved model without strategy: {restored * 100}")
    return {**history, "restored_accuracy": restored}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    print(f"JAX devices: {jax.devices()}")
    main(epochs=args.epochs)
