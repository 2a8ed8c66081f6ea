"""Test models and data shared by several test files (plain module: `from helpers import ...`).

pytest puts tests/ on sys.path (it has no __init__.py), so every test file imports this
module by name. Each builder takes the few arguments the files differ in; called with a
file's arguments it builds exactly the model and data that file built itself, parameters,
random streams and rows alike, so trajectories and golden files do not move. The
regression data, Dense model and fit of the TF-habits tests (issue 14), now in the module
files they test, are here too.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx

import jstrategy


def classification_data(rows, features, seed=0, classes=3):
    """Normal float32 features; the label is the largest of the first `classes` features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    return x, np.argmax(x[:, :classes], axis=-1).astype(np.int32)


class NnxNet(nnx.Module):
    """Dense, [BatchNorm], activation, [dropout], Dense to 3 logits, in NNX.

    `batch_norm` (keyword arguments of `nnx.BatchNorm`, or None for no normalization) and
    `dropout` (a rate, or None for no dropout layer) pick the variant; the layers are made
    in this order whatever the variant, so `nnx.Rngs` hands out the same streams.
    """

    def __init__(
        self,
        rngs,
        *,
        features,
        hidden=8,
        use_bias=True,
        batch_norm=None,
        dropout=None,
        activation="relu",
    ):
        self.dense1 = nnx.Linear(features, hidden, use_bias=use_bias, rngs=rngs)
        if batch_norm is not None:
            self.norm = nnx.BatchNorm(hidden, **batch_norm, rngs=rngs)
        if dropout is not None:
            self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.dense2 = nnx.Linear(hidden, 3, rngs=rngs)
        self.activation = activation  # a name: a static attribute any graph definition keeps

    def __call__(self, x):
        x = self.dense1(x)
        if hasattr(self, "norm"):
            x = self.norm(x)
        x = getattr(nnx, self.activation)(x)
        if hasattr(self, "drop"):
            x = self.drop(x)
        return self.dense2(x)


def regression_data(rows=24, features=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]
    return x, y


def dense_regression_model(strategy, optimizer=None, loss="mse", **compile_kwargs):
    with strategy.scope():
        model = jstrategy.Model(nn.Dense(1), input_shape=(3,))
        optimizer = optimizer if optimizer is not None else optax.sgd(0.1)
        model.compile(optimizer, loss=loss, **compile_kwargs)
    return model


def logits_and_labels(rows, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, 10)).astype(np.float32)
    labels = rng.integers(0, 10, size=rows).astype(np.int32)
    return logits, labels


def fit_regression(model, epochs=2, callbacks=()):
    x, y = regression_data(24)
    return model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks)
    )


def sgd_epochs(strategy, rates):
    """The weights after one epoch of optax's SGD at each rate in turn."""
    weights = None
    for rate in rates:
        reference = dense_regression_model(strategy, optax.sgd(rate))
        if weights is not None:
            reference.set_weights(weights)
        fit_regression(reference, epochs=1)
        weights = reference.get_weights()
    return weights


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=jstrategy.REPLICA_AXIS)(x)
        return nn.Dense(10)(nn.relu(x))


@contextlib.contextmanager
def count_compiles():
    """The XLA compilations while the block runs (JAX's compile events)."""
    events = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def checkpoint_leaves(state):
    """A state's leaves by path, on the host (PRNG keys, which have no NumPy form, left out)."""
    from jstrategy._src.names import path_names

    return {
        path_names(k): np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(state)[0]
        if not jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
    }


def restore_across(directory, state, targets):
    """Saves `state` under `directory` and restores it as each ``(target state,
    strategy)`` of `targets` in turn, each restored state saved again for the next.

    Returns the restored states, each asserted equal to `state`, leaf by leaf."""
    saved = checkpoint_leaves(state)
    restored = []
    for i, (target, strategy) in enumerate(targets):
        with jstrategy.CheckpointManager(directory / str(i), async_save=False) as manager:
            assert manager.save(1, state)
        with jstrategy.CheckpointManager(directory / str(i)) as manager:
            state = manager.restore(target=target, strategy=strategy)
        got = checkpoint_leaves(state)
        assert sorted(got) == sorted(saved)
        for path, value in got.items():
            np.testing.assert_array_equal(value, saved[path], err_msg=str(path))
        restored.append(state)
    return restored


def train_steps(strategy, make_state, loss, x, y, metrics=("accuracy",)):
    """`make_train_step` over the batches ``(x[i], y[i])`` from `make_state()` in the
    strategy's scope: the final state and each step's metrics, on the host."""
    from jstrategy import training
    from jstrategy._src import dispatch
    from jstrategy._src.input.placement import distribute_batch

    with strategy.scope():
        state = make_state()
        step = training.make_train_step(loss, metrics=list(metrics))
    history = []
    for i in range(len(x)):
        state, logs = step(state, distribute_batch(strategy, (x[i], y[i])))
        dispatch.track(logs)
        history.append(logs)
    return state, [jax.device_get(m) for m in history]
