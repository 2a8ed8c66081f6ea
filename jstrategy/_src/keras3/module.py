"""A ``keras.Model`` as a Flax module: jstrategy's own fit, factory, ``run`` and checkpoints.

`KerasModule` holds a built Keras model and calls it through ``stateless_call``: Keras's
trainable variables become the module's ``params``, its non-trainable ones (BatchNorm's
moving statistics, Dropout's seed state) its ``batch_stats``, each under its Keras path
(``conv1d/kernel`` is ``("params", "conv1d", "kernel")``), so FSDP's rules and a
LayoutMap's keys read Keras's names, and jstrategy's checkpoints hold them.

Inside a per-replica training step (`batch_region`), Keras's batch statistics and dropout
masks are made the global batch's, as jstrategy does for Flax's own layers: while the
model is traced, Keras's JAX ``moments`` over the batch axis take the mean over the data
axis, and ``dropout`` draws this replica's rows of the mask one device draws. Keras's other
random ops (GaussianNoise, the random augmentation layers, ``keras.random.*`` in a call)
would draw per replica there: they raise, naming the op.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src import batch_region
from jstrategy._src.keras3.backend import require_keras
from jstrategy._src.layers.regularizers import LOSSES

keras = require_keras("jstrategy.keras.KerasModule")

from keras.src.backend.jax import nn as keras_jax_nn  # noqa: E402  (after the check)
from keras.src.backend.jax import random as keras_jax_random  # noqa: E402

__all__ = ["KerasModule", "write_back"]

#: Keras's JAX random ops that would draw per replica inside a per-replica step.
_PER_REPLICA_RANDOM = (
    "normal",
    "uniform",
    "categorical",
    "randint",
    "truncated_normal",
    "shuffle",
    "gamma",
    "binomial",
    "beta",
)


def _split(path: str) -> tuple[str, ...]:
    return tuple(str(path).split("/"))


def _nest(paths: list[tuple[str, ...]], values: list[Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in zip(paths, values, strict=True):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _read(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _stable_names(model: Any) -> dict[int, tuple[str, ...]]:
    """Each seed generator's state keyed by its layer (``drop/seed_generator_state``):
    Keras names it ``seed_generator_<n>`` after a process-wide counter, which differs
    between two builds of one model and so between a checkpoint and its target."""
    names: dict[int, tuple[str, ...]] = {}
    for layer in model._flatten_layers(include_self=False):
        generators = getattr(layer, "_seed_generators", [])
        for i, generator in enumerate(generators):
            leaf = "seed_generator_state" if len(generators) == 1 else f"seed_generator_state_{i}"
            names[id(generator.state)] = (layer.name, leaf)
    return names


def _paths(model: Any, variables: Any, what: str) -> list[tuple[str, ...]]:
    stable = _stable_names(model)
    paths = [stable.get(id(v), _split(v.path)) for v in variables]
    seen: set[tuple[str, ...]] = set()
    for p in paths:
        if p in seen or any(p[: i + 1] in seen for i in range(len(p) - 1)):
            raise ValueError(
                f"The keras.Model's {what} variables share the path {'/'.join(p)!r}: "
                "KerasModule keys each variable by its Keras path. Give the layers unique "
                "names (name=...)."
            )
        seen.add(p)
    return paths


# Keras's ops inside a per-replica step ------------------------------------------------------
_PATCH_LOCK = threading.RLock()


def _global_moments(original: Any, region: batch_region.Region) -> Any:
    def moments(x: Any, axes: Any, keepdims: bool = False, synchronized: bool = False) -> Any:
        axes_t = tuple(
            int(a) % x.ndim for a in (axes if isinstance(axes, (list, tuple)) else [axes])
        )
        if 0 not in axes_t or not region.sync_batch_norm:
            return original(x, axes, keepdims=keepdims, synchronized=synchronized)
        dtype = x.dtype
        if dtype in (jnp.float16, jnp.bfloat16):  # Keras takes statistics in float32
            x = x.astype(jnp.float32)
        mean, var = batch_region.moments(x, axes_t, region.axis_name, region.row_mask)
        if keepdims:
            kept = tuple(1 if a in axes_t else d for a, d in enumerate(x.shape))
            mean, var = mean.reshape(kept), var.reshape(kept)
        return mean.astype(dtype), var.astype(dtype)

    return moments


def _global_dropout(inputs: Any, rate: Any, noise_shape: Any = None, seed: Any = None) -> Any:
    if rate == 1.0:
        return jnp.zeros_like(inputs)
    if rate == 0.0:
        return inputs
    key = keras_jax_random.jax_draw_seed(seed)
    shape = keras_jax_random._get_concrete_noise_shape(inputs, noise_shape)
    return batch_region.dropout(inputs, key, float(rate), tuple(shape))


def _refused_random(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"keras.random.{name} (a Keras layer's or call's random op other than Dropout) "
            "inside a jstrategy training step would draw each replica's rows alike, not "
            "one device's: KerasModule supports Dropout's masks only. Train such a model "
            "with Keras's own fit in strategy.scope(), or draw with "
            "jstrategy._src.batch_region.global_rows_bernoulli in a Flax layer."
        )

    return refused


@contextlib.contextmanager
def _keras_sees_global_batch() -> Iterator[None]:
    """Within, inside a per-replica region: Keras's batch moments and dropout masks are
    the global batch's; its other random ops raise. Outside a region: nothing changes."""
    region = batch_region.current()
    if region is None:
        yield
        return
    swaps = [(keras_jax_nn, "moments", _global_moments(keras_jax_nn.moments, region))]
    swaps.append((keras_jax_random, "dropout", _global_dropout))
    swaps += [(keras_jax_random, n, _refused_random(n)) for n in _PER_REPLICA_RANDOM]
    with _PATCH_LOCK:
        saved = [(m, n, getattr(m, n)) for m, n, _ in swaps]
        try:
            for m, n, f in swaps:
                setattr(m, n, f)
            yield
        finally:
            for m, n, f in saved:
                setattr(m, n, f)


# The module ---------------------------------------------------------------------------------
class KerasModule(nn.Module):
    """A built ``keras.Model`` (JAX backend) as a linen module, for jstrategy's training.

    Its variables start as the Keras model's values. ``training=True`` runs Keras's
    training mode (BatchNormalization's batch statistics, Dropout), and the updated
    non-trainable variables are written to ``batch_stats``. Keras's layer losses
    (``kernel_regularizer=``, ``add_loss``) join the step's loss.

    Attributes:
      model: a built ``keras.Model`` (call it once or ``model.build(shape)`` first).

    Example:

    >>> import keras, numpy as np, optax, jstrategy
    >>> from jstrategy.keras import KerasModule
    >>> inputs = keras.Input((4,))
    >>> net = keras.Model(inputs, keras.layers.Dense(2, name="out")(inputs))
    >>> strategy = jstrategy.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     model = jstrategy.Model(KerasModule(net), input_shape=(4,))
    ...     model.compile(optax.sgd(0.1), loss="mse")
    >>> history = model.fit(np.ones((8, 4), "float32"), np.zeros((8, 2), "float32"),
    ...                     batch_size=4, verbose=0)
    >>> sorted(model.state.params["out"])
    ['bias', 'kernel']
    """

    model: Any

    def _check(self) -> None:
        if not isinstance(self.model, keras.Model):
            raise TypeError(
                f"KerasModule(model) takes a keras.Model; got {type(self.model).__name__}."
            )
        if not self.model.built or not self.model.variables:
            raise ValueError(
                f"KerasModule needs a built keras.Model; {self.model.name!r} has no "
                "variables yet. Build it first: call it on a batch, or model.build(shape)."
            )

    @nn.compact
    def __call__(self, x: Any, training: bool = False) -> Any:
        self._check()
        km = self.model
        trainable, frozen = km.trainable_variables, km.non_trainable_variables
        t_paths = _paths(km, trainable, "trainable")
        f_paths = _paths(km, frozen, "non-trainable")
        params = {
            name: self.param(name, lambda rng, sub=sub: sub)
            for name, sub in _nest(t_paths, [np.asarray(v.value) for v in trainable]).items()
        }
        stats = {
            name: self.variable("batch_stats", name, lambda sub=sub: sub)
            for name, sub in _nest(f_paths, [np.asarray(v.value) for v in frozen]).items()
        }
        t_values = [_read(params, p) for p in t_paths]
        f_values = [_read({k: v.value for k, v in stats.items()}, p) for p in f_paths]
        with _keras_sees_global_batch():
            y, new_frozen, losses = km.stateless_call(
                t_values, f_values, x, training=training, return_losses=True
            )
        if training and not self.is_initializing() and self.is_mutable_collection("batch_stats"):
            updated = _nest(f_paths, list(new_frozen))
            for name, var in stats.items():
                var.value = updated[name]
        if losses and not self.is_initializing() and self.is_mutable_collection(LOSSES):
            self.sow(LOSSES, "keras_losses", sum(jnp.asarray(v, jnp.float32) for v in losses))
        return y


def write_back(model: Any, variables: Any) -> None:
    """Writes a KerasModule's trained variables into its ``keras.Model``.

    So the Keras model saves (``model.save``), evaluates or predicts with what jstrategy
    trained.

    Args:
      model: the ``keras.Model`` the `KerasModule` holds.
      variables: the trained variables: ``{"params": ..., "batch_stats": ...}``
        (``jstrategy.Model.state.variables`` or a train state's ``variables``).

    Example:

    >>> import keras, numpy as np
    >>> from jstrategy.keras import write_back
    >>> inputs = keras.Input((2,))
    >>> net = keras.Model(inputs, keras.layers.Dense(1, name="out")(inputs))
    >>> write_back(net, {"params": {"out": {"kernel": np.ones((2, 1)), "bias": np.zeros(1)}}})
    >>> net.predict(np.ones((1, 2)), verbose=0).tolist()
    [[2.0]]
    """
    variables = jax.device_get(variables)
    stats = variables.get("batch_stats") or {}
    trainable, frozen = model.trainable_variables, model.non_trainable_variables
    for v, path in zip(trainable, _paths(model, trainable, "trainable"), strict=True):
        v.assign(_read(variables["params"], path))
    for v, path in zip(frozen, _paths(model, frozen, "non-trainable"), strict=True):
        v.assign(_read(stats, path))
