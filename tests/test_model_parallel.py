"""Model parallelism on whole and 2-D meshes, and the Flax sharding guides' own models.

Issue 19, items 3 and 4 ("No silent layouts", "Flax annotations"), checked end to end:

* Full model parallelism: a `ModelParallelStrategy` on a (1, 8) mesh whose `LayoutMap`
  splits a Megatron MLP's kernels 8 ways over ``"model"`` trains as `OneDeviceStrategy`
  does, through `jstrategy.Model.fit` (several steps per execution), `evaluate`,
  `predict`, and `make_train_step`/`make_eval_step`/`make_predict_step`.
* Data and tensor parallelism composing on one 2-D mesh: on (2, 4) ``("batch", "model")``
  the kernels are split over both axes (each device holds 1/8 of each), and training
  follows OneDevice the same way. (`FSDPStrategy` lays its replicas on one axis of
  devices and takes no mesh, so this case is the FSDP-and-TP composition.)
* The two official Flax guides' models, unchanged (copied from google/flax at commit
  18f8f311c275d57f46d95e41b15aa97b454754c0, only their sizes reduced): linen's "Scale up
  Flax Modules on multiple devices" (docs/guides/parallel_training/flax_on_pjit.md: the
  `DotReluDot` stack, plain, under ``nn.scan``, and its logical-axis variant) and NNX's
  "Scale up on multiple devices" (docs_nnx/guides/flax_gspmd.md: `MultiDotReluDot`). Under
  a `ModelParallelStrategy` on the guides' ``("data", "model")`` mesh their parameters are
  laid out as annotated, and `fit` and `make_train_step` give the losses of the guides' own
  jitted loops from the same initial weights and data. Their activations are constrained
  with the data axis on the batch (``P("data", "model")``), inside the step's per-replica
  map (`replica_constraints`).
"""

import functools
from typing import Callable  # noqa: UP035  # as the linen guide imports it

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax import random
from jax.experimental import mesh_utils
from jax.lax import with_sharding_constraint
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import PartitionSpec as P

import jstrategy
import jstrategy.training
from jstrategy import losses
from jstrategy.experimental import DeviceMesh
from jstrategy.experimental import LayoutMap
from jstrategy.experimental import ModelParallelStrategy

FEATURES, HIDDEN, OUTPUTS = 8, 16, 8
BATCH = 8

# The two layouts: a Megatron MLP 8 ways over "model"; its kernels over both axes.
MESHES = {
    "model_1x8": ((1, 8), (None, "model"), ("model", None)),
    "batch_model_2x4": ((2, 4), ("batch", "model"), ("model", "batch")),
}


class _Megatron(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(HIDDEN)(x))  # Dense_0: (8, 16)
        return nn.Dense(OUTPUTS)(hidden)  # Dense_1: (16, 8)


def _layout_strategy(name):
    shape, first, second = MESHES[name]
    layout_map = LayoutMap(DeviceMesh(shape, ("batch", "model")))
    layout_map["Dense_0/kernel"] = first
    layout_map["Dense_1/kernel"] = second
    return ModelParallelStrategy(layout_map), (first, second)


def _data(rows=48):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = rng.normal(size=(rows, OUTPUTS)).astype(np.float32)
    return x, y


def _model(strategy, spe=1):
    with strategy.scope():
        model = jstrategy.Model(_Megatron(), input_shape=(FEATURES,), seed=0)
        model.compile(optax.adam(0.01), loss=losses.MeanSquaredError(), steps_per_execution=spe)
    return model


def _close(got, want, atol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=0)


def _assert_split_8_ways(params, layouts):
    for name, layout in zip(("Dense_0", "Dense_1"), layouts, strict=True):
        kernel = params[name]["kernel"]
        assert kernel.sharding.spec == P(*layout)
        shards = kernel.addressable_shards
        assert len(shards) == 8
        # Each device holds its own eighth of the kernel: no two devices the same piece.
        assert all(s.data.size * 8 == kernel.size for s in shards)
        assert len({tuple((sl.start, sl.stop) for sl in s.index) for s in shards}) == 8


@functools.cache
def _one_device():
    """OneDevice's fit (weights, losses, evaluation, predictions): the oracle, run once."""
    x, y = _data()
    model = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0)
    predictions = model.predict(x, batch_size=16, verbose=0)
    return model.get_weights(), history["loss"], evaluation, predictions


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_fit_evaluate_predict_follow_one_device_with_kernels_split_8_ways(name):
    strategy, layouts = _layout_strategy(name)
    weights, history, evaluation, predictions = _one_device()
    x, y = _data()
    # 6 steps an epoch, 3 per execution: two scans of 3 steps.
    model = _model(strategy, spe=3)
    got = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    _assert_split_8_ways(model.state.params, layouts)
    _close(model.get_weights(), weights)
    np.testing.assert_allclose(got["loss"], history, atol=1e-5, rtol=0)
    assert history[1] < history[0]
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=16, verbose=0), evaluation, atol=1e-5, rtol=0
    )
    np.testing.assert_allclose(
        model.predict(x, batch_size=16, verbose=0), predictions, atol=1e-5, rtol=0
    )
    _assert_split_8_ways(model.state.params, layouts)  # evaluation and prediction only read


def _steps(strategy):
    with strategy.scope():
        state = jstrategy.training.create_train_state(
            _Megatron(), optax.adam(0.01), jnp.ones((1, FEATURES))
        )
        train = jstrategy.training.make_train_step(losses.MeanSquaredError())
        evaluate = jstrategy.training.make_eval_step(losses.MeanSquaredError())
        predict = jstrategy.training.make_predict_step()
    return state, train, evaluate, predict


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_make_train_eval_predict_steps_follow_one_device(name):
    strategy, layouts = _layout_strategy(name)
    x, y = _data()
    state, train, evaluate, predict = _steps(strategy)
    one_state, one_train, one_evaluate, one_predict = _steps(jstrategy.OneDeviceStrategy("cpu:0"))
    _assert_split_8_ways(state.params, layouts)
    for i in range(len(x) // BATCH):
        batch = (x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
        state, logs = train(state, batch)
        one_state, one_logs = one_train(one_state, batch)
        np.testing.assert_allclose(logs["loss"], one_logs["loss"], atol=1e-5, rtol=0)
    jax.block_until_ready(state)
    _assert_split_8_ways(state.params, layouts)
    _close(jax.tree.leaves(state.params), jax.tree.leaves(one_state.params))
    _close(jax.tree.leaves(state.opt_state), jax.tree.leaves(one_state.opt_state))
    np.testing.assert_allclose(
        evaluate(state, (x[:16], y[:16]))["loss"],
        one_evaluate(one_state, (x[:16], y[:16]))["loss"],
        atol=1e-5,
        rtol=0,
    )
    np.testing.assert_allclose(
        predict(state, x[:16]).value, one_predict(one_state, x[:16]).value, atol=1e-5, rtol=0
    )


# ---------------------------------------------------------------------------------------
# The linen guide, "Scale up Flax Modules on multiple devices" (flax_on_pjit), verbatim
# from google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0 except the sizes (DEPTH 1024 to
# 32, LAYERS 4 to 2) and that the fake loss is also read (`apply_fn(...).sum()`).
# ---------------------------------------------------------------------------------------
# Create a mesh and annotate each axis with a name.
device_mesh = mesh_utils.create_device_mesh((2, 4))
mesh = Mesh(devices=device_mesh, axis_names=("data", "model"))


def mesh_sharding(pspec: PartitionSpec) -> NamedSharding:
    return NamedSharding(mesh, pspec)


class DotReluDot(nn.Module):
    depth: int
    dense_init: Callable = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(
            self.depth,
            kernel_init=nn.with_partitioning(self.dense_init, (None, "model")),
            use_bias=False,  # or overwrite with `bias_init`
        )(x)

        y = jax.nn.relu(y)
        # Force a local sharding annotation.
        y = with_sharding_constraint(y, mesh_sharding(PartitionSpec("data", "model")))

        W2 = self.param(
            "W2", nn.with_partitioning(self.dense_init, ("model", None)), (self.depth, x.shape[-1])
        )

        z = jnp.dot(y, W2)
        # Force a local sharding annotation.
        z = with_sharding_constraint(z, mesh_sharding(PartitionSpec("data", None)))

        # Return a tuple to conform with the API `flax.linen.scan` as shown in the cell below.
        return z, None


class MLP(nn.Module):
    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x):
        if self.use_scan:
            x, _ = nn.scan(
                DotReluDot,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={nn.PARTITION_NAME: None},
            )(self.depth)(x)
        else:
            for i in range(self.num_layers):  # noqa: B007  # the guide's
                x, _ = DotReluDot(self.depth)(x)
        return x


class LogicalDotReluDot(nn.Module):
    depth: int
    dense_init: Callable = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(
            self.depth,
            kernel_init=nn.with_logical_partitioning(self.dense_init, ("embed", "hidden")),
            use_bias=False,  # or overwrite with `bias_init`
        )(x)

        y = jax.nn.relu(y)
        # Force a local sharding annotation.
        y = with_sharding_constraint(y, mesh_sharding(PartitionSpec("data", "model")))

        W2 = self.param(
            "W2",
            nn.with_logical_partitioning(self.dense_init, ("hidden", "embed")),
            (self.depth, x.shape[-1]),
        )

        z = jnp.dot(y, W2)
        # Force a local sharding annotation.
        z = nn.with_logical_constraint(z, ("batch", "embed"))
        return z, None


class LogicalMLP(nn.Module):
    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x):
        if self.use_scan:
            x, _ = nn.scan(
                LogicalDotReluDot,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={nn.PARTITION_NAME: "layer"},
            )(self.depth)(x)
        else:
            for i in range(self.num_layers):  # noqa: B007  # the guide's
                x, _ = LogicalDotReluDot(self.depth)(x)
        return x


# Unspecified rule means unsharded by default, so no need to specify `('embed', None)` and `('layer', None)`.
rules = (("batch", "data"), ("hidden", "model"))

# MLP hyperparameters.
LAYERS, DEPTH = 2, 32  # BATCH = 8, as above
GUIDE_STEPS = 3


def init_fn(k, x, model, optimizer):
    variables = model.init(k, x)  # Initialize the model.
    state = train_state.TrainState.create(  # Create a `TrainState`.
        apply_fn=model.apply, params=variables["params"], tx=optimizer
    )
    return state


def _linen_guide_loop(model, logical):
    """The guide's own loop (its cells in order): the initial params and each step's loss."""
    x = jnp.ones((BATCH, DEPTH))
    k = random.key(0)
    optimizer = optax.adam(learning_rate=0.001)
    x_sharding = mesh_sharding(PartitionSpec("data", None))  # dimensions: (batch, length)
    x = jax.device_put(x, x_sharding)
    abstract_variables = jax.eval_shape(
        functools.partial(init_fn, model=model, optimizer=optimizer), k, x
    )
    if logical:
        logical_state_spec = nn.get_partition_spec(abstract_variables)
        state_sharding = nn.logical_to_mesh_sharding(logical_state_spec, mesh, rules)
    else:
        state_sharding = nn.get_sharding(abstract_variables, mesh)
    jit_init_fn = jax.jit(
        init_fn,
        static_argnums=(2, 3),
        in_shardings=(mesh_sharding(PartitionSpec()), x_sharding),  # PRNG key and x
        out_shardings=state_sharding,
    )
    initialized_state = jit_init_fn(k, x, model, optimizer)

    @functools.partial(
        jax.jit, in_shardings=(state_sharding, x_sharding), out_shardings=state_sharding
    )
    def train_step(state, x):
        # A fake loss function.
        def loss_unrolled(params):
            y = model.apply({"params": params}, x)
            return y.sum()

        grad_fn = jax.grad(loss_unrolled)
        grads = grad_fn(state.params)
        state = state.apply_gradients(grads=grads)
        return state

    @functools.partial(jax.jit, in_shardings=(state_sharding, x_sharding), out_shardings=x_sharding)
    def apply_fn(state, x):
        return state.apply_fn({"params": state.params}, x)

    state, step_losses = initialized_state, []
    with jax.set_mesh(mesh):
        for _ in range(GUIDE_STEPS):
            step_losses.append(float(apply_fn(state, x).sum()))
            state = train_step(state, x)
    return nn.meta.unbox(initialized_state.params), step_losses, nn.meta.unbox(state.params)


def _guide_strategy(**kwargs):
    # The guide's mesh: the same devices in the same order, axes ("data", "model").
    layout_map = LayoutMap(DeviceMesh((2, 4), ("data", "model"), devices=device_mesh))
    strategy = ModelParallelStrategy(layout_map, batch_dim_name="data", **kwargs)
    assert strategy.device_mesh.jax_mesh == mesh
    return strategy


def _fake_loss(y_true, y_pred):
    """The guide's ``y.sum()`` as a per-example loss: its mean over the batch is the sum."""
    del y_true
    return BATCH * jnp.sum(y_pred, axis=-1)


def _trimmed(spec):
    """`spec` without trailing Nones (the same layout)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _rel_close(got, want, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=1e-6)


LINEN_GUIDE = {
    "MLP": (lambda: MLP(LAYERS, DEPTH, False), False),
    "MLP_scan": (lambda: MLP(LAYERS, DEPTH, True), False),
    "LogicalMLP_scan": (lambda: LogicalMLP(LAYERS, DEPTH, True), True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LINEN_GUIDE))
def test_the_linen_guides_models_train_as_annotated_matching_the_guides_loop(name):
    make, logical = LINEN_GUIDE[name]
    initial, want_losses, want_final = _linen_guide_loop(make(), logical)
    strategy = _guide_strategy(logical_axis_rules=rules if logical else None)
    x, y = np.ones((BATCH, DEPTH), np.float32), np.zeros((BATCH, DEPTH), np.float32)
    # Model.fit: one batch per epoch, so each epoch's loss is one step's.
    with strategy.scope():
        model = jstrategy.Model(make(), input_shape=(DEPTH,), seed=0)
        model.compile(optax.adam(learning_rate=0.001), loss=_fake_loss, steps_per_execution=2)
    # get_weights' order is Keras's (call order), not the params dict's sorted keys.
    flat = flax.traverse_util.flatten_dict(initial, sep="/")
    model.set_weights([flat[name] for name in model.state.weight_names()])
    history = model.fit(x, y, batch_size=BATCH, epochs=GUIDE_STEPS, shuffle=False, verbose=0)
    _rel_close(history.history["loss"], want_losses)
    _close(jax.tree.leaves(model.state.params), jax.tree.leaves(want_final))
    # The annotations, each laid out as written (a scanned stack's layer axis whole).
    specs = jax.tree.map(lambda a: _trimmed(a.sharding.spec), model.state.params)
    if name == "MLP":
        for i in range(LAYERS):
            layer = specs[f"DotReluDot_{i}"]
            assert layer == {"Dense_0": {"kernel": P(None, "model")}, "W2": P("model")}
    else:
        (stack,) = specs.values()
        assert stack == {"Dense_0": {"kernel": P(None, None, "model")}, "W2": P(None, "model")}
    # make_train_step from the same weights.
    with strategy.scope():
        state = jstrategy.training.create_train_state(
            make(), optax.adam(learning_rate=0.001), jnp.ones((1, DEPTH))
        )
        step = jstrategy.training.make_train_step(_fake_loss)
    state = jstrategy.training.place_state(
        state.with_weight_list([flat[name] for name in state.weight_names()]), strategy
    )
    got = []
    for _ in range(GUIDE_STEPS):
        state, logs = step(state, (x, y))
        got.append(float(logs["loss"]))
    _rel_close(got, want_losses)
    _close(jax.tree.leaves(state.params), jax.tree.leaves(want_final))
    assert jax.tree.map(lambda a: _trimmed(a.sharding.spec), state.params) == specs


# ---------------------------------------------------------------------------------------
# The NNX guide, "Scale up on multiple devices" (flax_gspmd), verbatim from
# google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0 except the sizes (depth 1024 to 32)
# and two lines its loop needs on jax 0.12: the mesh is made with Auto axes, as the guide
# says it is ("an auto-mode mesh"; jax.make_mesh now defaults to Explicit), and the train
# step is an `nnx.jit` (a `jax.jit` of the guide's step drops the optimizer's updated state,
# so Adam would restart every step).
# ---------------------------------------------------------------------------------------
auto_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


class NnxDotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
            use_bias=False,  # or use `bias_init` to give it annotation too
            rngs=rngs,
        )
        self.w2 = nnx.Param(
            init_fn(rngs.params(), (depth, depth)),  # RNG key and shape for W2 creation
            sharding=("model", None),
        )

    def __call__(self, x: jax.Array):
        y = self.dot1(x)
        y = jax.nn.relu(y)
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        z = jnp.dot(y, self.w2[...])
        return z


class MultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        # Annotate the additional axis with sharding=None, meaning it will be
        # replicated across all devices.
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r):
            return NnxDotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        def scan_over_layers(x, layer):
            return layer(x), None

        x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
        return x


@nnx.jit
def nnx_train_step(model, optimizer, x, y):
    def loss_fn(model: NnxDotReluDot):
        y_pred = model(x)
        return jnp.mean((y_pred - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, loss


NNX_DEPTH = 32


@functools.cache
def _nnx_guide_loop():
    rngs = nnx.Rngs(0)
    with jax.set_mesh(auto_mesh):
        # Training data
        input = jax.device_put(rngs.normal((8, NNX_DEPTH)), P("data", None))
        label = jax.device_put(rngs.normal((8, NNX_DEPTH)), P("data", None))
        # Model and optimizer
        model = MultiDotReluDot(NNX_DEPTH, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

        # The loop
        step_losses = []
        for i in range(5):  # noqa: B007  # the guide's
            model, loss = nnx_train_step(model, optimizer, input, label)
            step_losses.append(float(loss))
    return np.asarray(input), np.asarray(label), step_losses, jax.tree.leaves(nnx.state(model))


def _assert_nnx_layouts(params, strategy):
    def equivalent(array, *spec):
        return array.sharding.is_equivalent_to(NamedSharding(strategy.mesh, P(*spec)), 3)

    assert equivalent(params["layers"]["dot1"]["kernel"][...], None, None, "model")
    assert equivalent(params["layers"]["w2"][...], None, "model", None)
    assert not params["layers"]["w2"][...].sharding.is_fully_replicated


# The guide's own code uses Flax names this Flax release deprecates.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'sharding' is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The 'split' argument of 'fork' is deprecated")
@pytest.mark.parametrize("path", ["fit", "make_train_step"])
def test_the_nnx_guides_model_trains_as_annotated_matching_the_guides_loop(path):
    x, y, want_losses, want_final = _nnx_guide_loop()
    strategy = _guide_strategy()
    with strategy.scope():  # the module is created whole; its state placed as annotated
        module = MultiDotReluDot(NNX_DEPTH, 2, rngs=nnx.Rngs(0))
        if path == "fit":
            model = jstrategy.Model(module)
            model.compile(optax.adam(1e-3), loss="mse", steps_per_execution=2)
            state = model.state
        else:
            state = jstrategy.training.create_nnx_train_state(module, optax.adam(1e-3))
            step = jstrategy.training.make_train_step("mse")
    _assert_nnx_layouts(state.params, strategy)
    if path == "fit":
        history = model.fit(x, y, batch_size=8, epochs=5, shuffle=False, verbose=0)
        got, state = history.history["loss"], model.state
    else:
        got = []
        for _ in range(5):
            state, logs = step(state, (x, y))
            got.append(float(logs["loss"]))
    _rel_close(got, want_losses)
    _assert_nnx_layouts(state.params, strategy)
    _close(jax.tree.leaves(state.params), want_final)


class _Constrained(nn.Module):
    """A batch constraint naming the data axis, and one on a parameter that names it too."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (FEATURES, HIDDEN))
        kernel = with_sharding_constraint(kernel, P(None, "data"))
        y = with_sharding_constraint(jnp.tanh(x @ kernel), P("data", "model"))
        return jnp.sum(y, axis=-1, keepdims=True)


@pytest.mark.slow
def test_the_steps_map_keeps_a_constraints_data_axis_on_the_replicas_not_on_parameters():
    strategy = _guide_strategy()
    with strategy.scope():
        # A sample batch the constraint's "data" divides (its model is created op by op).
        state = jstrategy.training.create_train_state(
            _Constrained(), optax.sgd(0.1), jnp.ones((BATCH, FEATURES))
        )
        step = jstrategy.training.make_train_step("mse")
    x, y = _data(BATCH)
    batch = (x, y[:, :1])
    text = step.lower(state, batch).as_text()
    # The batch's constraint: (replicas, rows per replica, HIDDEN), replicas over "data".
    assert '[{"data"}, {}, {"model"}]> : tensor<2x4x16xf32>' in text
    # The parameter's (not computed from the batch) as written.
    assert '[{}, {"data"}]> : tensor<8x16xf32>' in text

    @jax.jit
    def global_loss(params):  # the model under a global jit, as it was written for
        return jnp.mean((_Constrained().apply({"params": params}, x) - batch[1]) ** 2)

    with jax.set_mesh(mesh):
        want = global_loss(state.params)
    _, logs = step(state, batch)
    _rel_close(logs["loss"], want)
