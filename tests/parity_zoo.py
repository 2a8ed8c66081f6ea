"""The parity matrix's zoo: models written the ways users write them, every strategy, every
way to train (plain module: `tests/test_parity_matrix.py` and `tests/parity_worker.py` import
it; ``python tests/parity_zoo.py`` prints the matrix, measured).

The rule it guards: for the same global batches, a model trains to the same numbers under
every strategy as under `OneDeviceStrategy` (within `TOLERANCE`), whether it was created
inside `strategy.scope()` or outside it, through `Model.fit` (``steps_per_execution`` 1 and
4) or the train-step factory; or the cell is refused before any work with an error naming
the layer (or model) and the fix (`REFUSED`).

The models hold every layer whose result depends on the batch or on randomness, and every
way of annotating a model for a mesh:

* ``keras``: a `jstrategy.Sequential` of Keras's layers: Embedding, Reshape, Conv2D,
  BatchNormalization, Activation, MaxPooling2D, Dropout, Flatten, Dense.
* ``keras_1d``: a `jstrategy.Sequential` of Keras's layers over sequences: Embedding,
  Conv1D (causal, then same), BatchNormalization, ReLU, MaxPooling1D, Dropout,
  AveragePooling1D, GlobalAveragePooling1D, Dense.
* ``functional``: a model of Keras's functional API (``jstrategy.Model(inputs, outputs)``):
  Dense, BatchNormalization, ReLU, Dropout, a shared Dense called on two branches,
  Concatenate and Add.
* ``linen``: a linen module with Flax's ``nn.BatchNorm`` and ``nn.Dropout``.
* ``linen_annotated``: a linen module annotated for a ``("data", "model")`` mesh:
  ``nn.with_partitioning``, ``nn.with_logical_partitioning`` and
  ``nn.with_logical_constraint``, under Flax logical axis rules that name that mesh.
* ``nnx``: an NNX module with ``nnx.BatchNorm``, ``nnx.Dropout`` and ``sharding`` metadata
  for that mesh.
* ``repeated``: `jstrategy.layers.BatchNormalization` and ``Dropout`` before a
  `jstrategy.experimental.Repeated` block (what `PipelineStrategy` splits over its stages).
* ``attention``: a linen module whose causal self-attention runs through
  `jstrategy.experimental.dot_product_attention` (a ring over a ``"context"`` axis).
* ``keras3``: a Keras 3 functional ``keras.Model`` with BatchNormalization and Dropout, as
  a `jstrategy.keras.KerasModule`.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts: the 8 fake CPU devices of the tests
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jstrategy
from jstrategy import layers as L
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.training import functional_graph as functional_graph_lib

ROWS = 64
BATCH = 16  # 4 steps an epoch: one execution of steps_per_execution=4
EPOCHS = 2
FEATURES = 6
VOCAB = 12
CLASSES = 3
TOLERANCE = 1e-5  # absolute and relative, on every loss and every final weight

#: The mesh the annotated models are written for (the Flax guides' axes).
USER_MESH_SHAPE = (2, 4)
USER_MESH_AXES = ("data", "model")
#: The logical axis rules the annotated linen model is written with.
RULES = (("batch", "data"), ("mlp", "model"), ("embed", None))


# Data ----------------------------------------------------------------------------------
def data(model: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: token ids for the Keras-layer models, float features otherwise; 3 classes."""
    rng = np.random.default_rng(0)
    if model in KERAS_LAYERS:
        x = rng.integers(0, VOCAB, size=(ROWS, FEATURES)).astype(np.int32)
        y = ((x[:, 0] + x[:, 1]) % CLASSES).astype(np.int32)
        return x, y
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return x, np.argmax(x[:, :CLASSES], axis=-1).astype(np.int32)


# Models --------------------------------------------------------------------------------
def keras_layers() -> list[Any]:
    return [
        L.Embedding(VOCAB, 4, input_shape=(FEATURES,)),
        L.Reshape((FEATURES, 4, 1)),
        L.Conv2D(4, 3, padding="same", use_bias=False),
        L.BatchNormalization(),
        L.Activation("relu"),
        L.MaxPooling2D(2),
        L.Dropout(0.25),
        L.Flatten(),
        L.Dense(CLASSES),
    ]


def keras_1d_layers() -> list[Any]:
    return [
        L.Embedding(VOCAB, 4, input_shape=(FEATURES,)),
        L.Conv1D(8, 3, padding="causal", use_bias=False),
        L.BatchNormalization(),
        L.ReLU(negative_slope=0.1),
        L.MaxPooling1D(2),
        L.Dropout(0.25),
        L.Conv1D(8, 2, padding="same"),
        L.AveragePooling1D(2, padding="same"),
        L.GlobalAveragePooling1D(),
        L.Dense(CLASSES),
    ]


#: The models that are a `jstrategy.Sequential` of Keras's layers, and their layers.
KERAS_LAYERS: dict[str, Callable[[], list[Any]]] = {
    "keras": keras_layers,
    "keras_1d": keras_1d_layers,
}


def functional_graph() -> tuple[Any, Any]:
    """The ``functional`` model's inputs and outputs (Keras's functional API)."""
    x = jstrategy.Input((FEATURES,))
    h = L.Dropout(0.25)(L.ReLU()(L.BatchNormalization()(L.Dense(16, use_bias=False)(x))))
    shared = L.Dense(8, activation="tanh")
    h = L.Concatenate()([shared(h), shared(L.Dense(16)(x))])
    return x, L.Dense(CLASSES)(L.Add()([h, L.Dense(16)(x)]))


#: The models written in Keras's functional API, and their graphs.
FUNCTIONAL: dict[str, Callable[[], tuple[Any, Any]]] = {"functional": functional_graph}


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(16, use_bias=False)(x)
        h = nn.BatchNorm(use_running_average=not train)(h)
        h = nn.Dropout(0.25, deterministic=not train)(nn.relu(h))
        return nn.Dense(CLASSES)(h)


_INIT = nn.initializers.lecun_normal()


class AnnotatedNet(nn.Module):
    """Annotated for a ``("data", "model")`` mesh, as Flax's sharding guide writes it."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, kernel_init=nn.with_partitioning(_INIT, (None, "model")))(x)
        h = nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp"))
        w = self.param("out", nn.with_logical_partitioning(_INIT, ("mlp", "embed")), (16, 8))
        h = jnp.tanh(h @ w)  # type: ignore[operator]  # unboxed by Flax on read
        return nn.Dense(CLASSES)(h)


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(
            FEATURES,
            16,
            use_bias=False,
            kernel_init=nnx.with_partitioning(_INIT, (None, "model")),
            rngs=rngs,
        )
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.dense2 = nnx.Linear(
            16, CLASSES, kernel_init=nnx.with_partitioning(_INIT, ("model", None)), rngs=rngs
        )

    def __call__(self, x):
        return self.dense2(self.drop(nnx.relu(self.norm(self.dense1(x)))))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.LayerNorm()(x)))


class RepeatedNet(nn.Module):
    @nn.compact
    def __call__(self, x, training: bool = False):
        h = L.Dense(8, use_bias=False)(x)
        h = L.BatchNormalization()(h, training=training)
        h = L.Dropout(0.25)(h, training=training)
        h = jstrategy.experimental.Repeated(Block(), num_layers=4)(h)
        return nn.Dense(CLASSES)(h)


class KerasLayersNet(nn.Module):
    """Keras's layers in a linen module of one's own: how the train-step factory takes them."""

    model: str = "keras"

    @nn.compact
    def __call__(self, x, training: bool = False):
        for layer in KERAS_LAYERS[self.model]():
            x = layer(x, training=training)
        return x


def keras3_net() -> nn.Module:
    """A Keras 3 functional model, seeded (every call builds the same), as a linen module."""
    import keras

    from jstrategy.keras import KerasModule

    init = keras.initializers.GlorotUniform
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(16, use_bias=False, kernel_initializer=init(1), name="dense1")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Dropout(0.25, seed=2, name="drop")(keras.layers.ReLU()(h))
    outputs = keras.layers.Dense(CLASSES, kernel_initializer=init(3), name="out")(h)
    return KerasModule(keras.Model(inputs, outputs))


class MoENet(nn.Module):
    """A row's features as 3 tokens of 2, a residual expert block that drops tokens
    (`jstrategy.experimental.MoE`, its aux losses added to the loss), pooled to classes."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x.reshape(x.shape[0], 3, FEATURES // 3))
        moe = jstrategy.experimental.MoE(
            num_experts=4, top_k=2, hidden_dim=8, capacity_factor=0.5, load_balance_weight=0.1
        )
        return nn.Dense(CLASSES)(jnp.mean(h + moe(nn.LayerNorm()(h)), axis=1))


class AttentionBlock(nn.Module):
    """Pre-norm causal self-attention through `jstrategy.experimental.dot_product_attention`
    (ring attention over a context axis), with its residual."""

    @nn.compact
    def __call__(self, h):
        attend = functools.partial(jstrategy.experimental.dot_product_attention, causal=True)
        attention = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=attend)
        return h + attention(nn.LayerNorm()(h), deterministic=True)


class AttentionNet(nn.Module):
    """A row's features as a sequence of 6 tokens through an `AttentionBlock` marked with
    `jstrategy.training.remat`: under a sharded strategy the step places the block's input
    (its rows, and with ``tensor_activations="sequence"`` its sequence over the tensor
    axis; `jstrategy._src.activation_rows`)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x[..., None])  # (B, 6, 8): the sequence along dimension 1
        h = training.remat(AttentionBlock)()(h)
        return nn.Dense(CLASSES)(jnp.mean(h, axis=1))


def _linen(model: str) -> nn.Module:
    if model in KERAS_LAYERS:
        return KerasLayersNet(model)
    if model in FUNCTIONAL:  # the module jstrategy.Model(inputs, outputs) trains
        return functional_graph_lib.trace(*FUNCTIONAL[model]()).module
    return {
        "linen": LinenNet,
        "linen_annotated": AnnotatedNet,
        "repeated": RepeatedNet,
        "keras3": keras3_net,
        "moe": MoENet,
        "attention": AttentionNet,
    }[model]()


def make_nnx(outside: bool) -> nnx.Module:
    """The NNX model; made outside a scope it is made as its authors would, on their mesh."""
    if not outside:
        return NnxNet(nnx.Rngs(0))
    with jax.set_mesh(jax.make_mesh(USER_MESH_SHAPE, USER_MESH_AXES)):
        return NnxNet(nnx.Rngs(0))


MODELS = (
    "keras",
    "keras_1d",
    "functional",
    "linen",
    "linen_annotated",
    "nnx",
    "repeated",
    "keras3",
    "moe",
    "attention",
)


# Strategies ----------------------------------------------------------------------------
def _model_parallel() -> jstrategy.Strategy:
    mesh = jstrategy.experimental.DeviceMesh(USER_MESH_SHAPE, USER_MESH_AXES)
    return jstrategy.experimental.ModelParallelStrategy(
        jstrategy.experimental.LayoutMap(mesh), batch_dim_name="data"
    )


STRATEGIES: dict[str, Callable[[], jstrategy.Strategy]] = {
    "one_device": lambda: jstrategy.OneDeviceStrategy("cpu:0"),
    "mirrored_8": lambda: jstrategy.MirroredStrategy(),
    "mirrored_2": lambda: jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage_8": lambda: jstrategy.CentralStorageStrategy(),
    "fsdp_8": lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=0),
    # Parameters and optimizer state in host memory between steps (issue 37 item 2).
    "fsdp_8_offload": lambda: jstrategy.experimental.FSDPStrategy(
        min_shard_size=0, offload=jstrategy.experimental.OffloadPolicy(params=True)
    ),
    "model_parallel_2x4": _model_parallel,
    # Two "hosts" of four devices (one replica each): FSDP and tensor within a host.
    "hybrid_2x2x2": lambda: jstrategy.experimental.HybridStrategy(
        replicas=2, fsdp=2, tensor=2, dcn_replicas=2, min_shard_size=0
    ),
    "pipeline_2": lambda: jstrategy.experimental.PipelineStrategy(num_stages=2, num_microbatches=2),
    # One spec of degrees (issue 47): replicas x experts x tensor, the expert axis splitting
    # rows and FSDP's variables for the models without experts, the experts for "moe".
    "parallel_2x2x2_experts": lambda: jstrategy.experimental.ParallelStrategy(
        replicas=2, experts=2, tensor=2, min_shard_size=0
    ),
    # Pipeline x tensor (x replicas) in the same spec: the Repeated model's stages.
    "parallel_2x2x2_stages": lambda: jstrategy.experimental.ParallelStrategy(
        replicas=2, stages=2, tensor=2, num_microbatches=2, min_shard_size=0
    ),
    # Pipeline x FSDP x tensor: the stages' layers split over "fsdp" and "tensor" too.
    "parallel_2x2x2_stages_fsdp": lambda: jstrategy.experimental.ParallelStrategy(
        replicas=1, stages=2, fsdp=2, tensor=2, num_microbatches=2, min_shard_size=0
    ),
    # Context x tensor (x replicas), and context x FSDP x tensor: each sequence (the
    # features' dimension 1) split over "context", attention a ring over it.
    "parallel_2x2x2_context": lambda: jstrategy.experimental.ParallelStrategy(
        replicas=2, context=2, tensor=2, min_shard_size=0
    ),
    "parallel_2x2x2_context_fsdp": lambda: jstrategy.experimental.ParallelStrategy(
        replicas=1, fsdp=2, context=2, tensor=2, min_shard_size=0
    ),
    # The activations between blocks split along the sequence over "tensor" (an option).
    "hybrid_2x2x2_sequence": lambda: jstrategy.experimental.HybridStrategy(
        replicas=2, fsdp=2, tensor=2, min_shard_size=0, tensor_activations="sequence"
    ),
}

#: How a cell trains: (where the model is created, the path).
WAYS = (
    ("inside", "fit_1"),
    ("outside", "fit_4"),
    ("inside", "factory"),
    ("outside", "factory"),
)

#: The spec's combinations (issue 47) and the model they brought: their cells run in
#: `test_parity_matrix_spec.py` (CI's lane C, beside the pipelines and long sequences), two
#: ways each, the two that cross where the model is made with how it trains.
COMBINATIONS = (
    "parallel_2x2x2_stages_fsdp",
    "parallel_2x2x2_context",
    "parallel_2x2x2_context_fsdp",
)
COMBINATION_MODELS = ("attention",)
COMBINATION_WAYS = (("inside", "fit_1"), ("outside", "factory"))
#: The strategies whose cells run in a test file of their own, two ways each
#: (`COMBINATION_WAYS`): the spec's combinations (with the attention model under every
#: strategy; test_parity_matrix_spec.py) and the sequence-split activations
#: (test_parity_matrix_sequence.py). The others run in test_parity_matrix.py.
GROUPS = {"combinations": COMBINATIONS, "sequence": ("hybrid_2x2x2_sequence",)}


def cells(group: str | None) -> list[tuple[str, str, str, str]]:
    """The matrix's ``(model, strategy, where, path)`` cells that train (the refused are
    checked once, whatever the way) of `group` (a key of `GROUPS`, or None: the rest)."""
    found = []
    for model in MODELS:
        for strategy in STRATEGIES:
            own = next((g for g, members in GROUPS.items() if strategy in members), None)
            if own is None and model in COMBINATION_MODELS:
                own = "combinations"
            if strategy == "one_device" or own != group or refusal(model, strategy):
                continue
            ways = WAYS if own is None else COMBINATION_WAYS
            found += [(model, strategy, where, path) for where, path in ways]
    return found


#: The cells refused before any work, with a pattern of their error and why.
REFUSED: dict[tuple[str, str], tuple[str, str]] = {
    **{
        (model, stages): (
            r"has none: no variable is stacked by jstrategy.experimental.Repeated",
            "a pipeline splits a Repeated block over its stages; this model has none",
        )
        for model in MODELS
        if model != "repeated"
        for stages in ("pipeline_2", "parallel_2x2x2_stages", "parallel_2x2x2_stages_fsdp")
    },
}


def refusal(model: str, strategy: str) -> tuple[str, str] | None:
    """``(error pattern, reason)`` when the cell is refused, else None."""
    return REFUSED.get((model, strategy))


# Training ------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    """A cell's trajectory: each loss as it was logged, and every final variable."""

    losses: list[float]
    weights: list[np.ndarray]


def _rules(model: str) -> contextlib.AbstractContextManager[Any]:
    return nn.logical_axis_rules(RULES) if model == "linen_annotated" else contextlib.nullcontext()


def _arrays(tree: Any) -> list[np.ndarray]:
    leaves = [
        x
        for x in jax.tree.leaves(tree)
        if not (isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key))
    ]
    leaves = jax.device_get(leaves)
    return [np.asarray(x) for x in leaves if np.issubdtype(np.asarray(x).dtype, np.floating)]


def _loss() -> Any:
    return jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compiled_model(model: str, strategy: jstrategy.Strategy, outside: bool, spe: int) -> Any:
    """A compiled `jstrategy.Model` of `model` under `strategy`: the module (or layers, or
    NNX module) made outside the scope when `outside`, the `Model` inside it always (a
    `Model` runs under the strategy it was created in)."""
    made: Any = None
    if outside:
        made = (
            KERAS_LAYERS[model]()
            if model in KERAS_LAYERS
            else FUNCTIONAL[model]()
            if model in FUNCTIONAL
            else make_nnx(True)
            if model == "nnx"
            else _linen(model)
        )
    with strategy.scope():
        if model in KERAS_LAYERS:
            m = jstrategy.Sequential(made if made is not None else KERAS_LAYERS[model]())
        elif model in FUNCTIONAL:
            m = jstrategy.Model(*(made if made is not None else FUNCTIONAL[model]()))
        elif model == "nnx":
            m = jstrategy.Model(made if made is not None else make_nnx(False))
        else:
            m = jstrategy.Model(made if made is not None else _linen(model), (FEATURES,))
        m.compile(optax.sgd(0.1), loss=_loss(), steps_per_execution=spe)
    return m


def _factory_state(model: str, strategy: jstrategy.Strategy, outside: bool) -> Any:
    """A train state for `make_train_step`, created inside the scope or, `outside`, from
    outside it (the strategy passed)."""
    tx = optax.sgd(0.1)
    sample = jnp.zeros((1, FEATURES), jnp.int32 if model in KERAS_LAYERS else jnp.float32)
    scope = contextlib.nullcontext() if outside else strategy.scope()
    with scope:
        if model == "nnx":
            return training.create_nnx_train_state(make_nnx(outside), tx, strategy=strategy)
        return training.create_train_state(_linen(model), tx, sample, rng=0, strategy=strategy)


def train(model: str, strategy: jstrategy.Strategy, where: str, path: str) -> Result:
    """One cell: `model` trained under `strategy`, created `where`, along `path`."""
    x, y = data(model)
    outside = where == "outside"
    with _rules(model):
        if path.startswith("fit"):
            m = _compiled_model(model, strategy, outside, int(path.split("_")[1]))
            history = m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
            # get_weights: every variable, gathered from every process.
            return Result(history.history["loss"], _arrays(m.get_weights()))
        state = _factory_state(model, strategy, outside)
        step = training.make_train_step(_loss(), strategy=strategy)
        losses = []
        for _ in range(EPOCHS):
            for i in range(0, ROWS, BATCH):
                batch = distribute_batch(strategy, (x[i : i + BATCH], y[i : i + BATCH]))
                state, logs = step(state, batch)
                dispatch.track(logs)
                losses.append(logs["loss"])
        return Result([float(v) for v in jax.device_get(losses)], _arrays(state.variables))


def deviation(got: Result, want: Result) -> float:
    """The largest difference, relative to ``1 + |want|``, over losses and weights."""
    pairs = [(np.asarray(got.losses), np.asarray(want.losses))]
    pairs += list(zip(got.weights, want.weights, strict=True))
    return max(float(np.max(np.abs(a - b) / (1 + np.abs(b)))) for a, b in pairs)


def main() -> None:
    """Prints the matrix: each cell's largest deviation from one device, or its refusal."""
    import re

    oracles = {
        (model, path): train(model, STRATEGIES["one_device"](), "inside", path)
        for model in MODELS
        for path in ("fit_1", "fit_4", "factory")
    }
    names = [s for s in STRATEGIES if s != "one_device"]
    print("model x strategy: the largest deviation from OneDeviceStrategy over", WAYS)
    print(f"{'':16}" + "".join(f"{n:>20}" for n in names))
    for model in MODELS:
        row = []
        for name in names:
            refused = refusal(model, name)
            worst = 0.0
            for where, path in WAYS:
                try:
                    got = train(model, STRATEGIES[name](), where, path)
                except Exception as e:  # a refusal: it must be the declared one
                    if refused is None or not re.search(refused[0], str(e)):
                        raise
                    worst = -1.0
                    break
                worst = max(worst, deviation(got, oracles[model, path]))
            row.append("refused" if worst < 0 else f"ok {worst:.1e}")
        print(f"{model:16}" + "".join(f"{c:>20}" for c in row))


if __name__ == "__main__":
    sys.exit(main())
