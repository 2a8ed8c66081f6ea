"""Sharded from birth (issue 19): under FSDP and ModelParallel a new state is created where
it lives, never whole on one device.

Modules here record whether their parameters are tracers when created: an eager init sees
concrete arrays, the jitted creation (and `jax.eval_shape`) sees tracers. Every array of
the new state must have the layout `variable_sharding` gives it, each device holding only
its slices of a split variable.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jstrategy
from jstrategy import training
from jstrategy._src.names import path_names
from jstrategy._src.placement import abstract

FEATURES, HIDDEN, OUT = 16, 64, 16

# Whether each parameter created since the last reset was a tracer.
_SEEN: list[bool] = []


class _Dense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.normal(), (self.features,))
        _SEEN.append(isinstance(kernel, jax.core.Tracer))
        return x @ kernel + bias


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = _Dense(HIDDEN, name="Dense_0")(x)
        return _Dense(OUT, name="Dense_1")(nn.relu(x))


class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.dense1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.dense2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)
        _SEEN.append(isinstance(self.dense1.kernel[...], jax.core.Tracer))

    def __call__(self, x):
        return self.dense2(nnx.relu(self.dense1(x)))


def _fsdp():
    return jstrategy.experimental.FSDPStrategy(min_shard_size=0)


def _model_parallel():
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["(Dense_0|dense1)/kernel"] = (None, "model")
    layout_map["(Dense_1|dense2)/kernel"] = ("model", None)
    return jstrategy.experimental.ModelParallelStrategy(layout_map)


SHARDED = {"fsdp": _fsdp, "model_parallel": _model_parallel}


@pytest.fixture(params=sorted(SHARDED))
def sharded(request):
    _SEEN.clear()
    return SHARDED[request.param]()


def _data(leaf):
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


# Same key, same values: bit for bit on the newest stack; older XLA (jax 0.10) may round a
# scaled normal initializer fused into the jitted init differently in the last bit.
_EXACT = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


def _assert_same_values(state, eager):
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(eager), strict=True):
        if _EXACT:
            np.testing.assert_array_equal(_data(a), _data(b))
        else:
            np.testing.assert_allclose(_data(a), _data(b), rtol=1e-6, atol=0)


def _assert_born_sharded(state, strategy):
    """Every array where `variable_sharding` says; whole on a device only if replicated."""
    split = 0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        path = path_names(keypath)
        want = strategy.variable_sharding(abstract(leaf), path)
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (path, leaf.sharding, want)
        shapes = {shard.data.shape for shard in leaf.addressable_shards}
        if want.is_fully_replicated:
            assert shapes == {leaf.shape}, path
        else:
            assert leaf.ndim and not leaf.is_fully_replicated, path
            assert all(math.prod(s) < math.prod(leaf.shape) for s in shapes), (path, shapes)
            split += 1
    return split


def _assert_kernels_split(state, strategy):
    """The kernels and their Adam moments are split (else the test would prove nothing)."""
    kernels = [
        leaf
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
        if "kernel" in path_names(keypath)
    ]
    assert len(kernels) == 6  # two kernels, two first and two second moments
    for leaf in kernels:
        assert not leaf.is_fully_replicated
        assert {s.data.size for s in leaf.addressable_shards} == {
            leaf.size // (8 if isinstance(strategy, jstrategy.experimental.FSDPStrategy) else 4)
        }


@pytest.mark.slow
def test_linen_state_is_created_sharded_with_the_eager_values(sharded):
    x = jnp.ones((1, FEATURES))
    state = training.create_train_state(_Net(), optax.adamw(1e-3), x, rng=7, strategy=sharded)
    assert _SEEN and all(_SEEN)  # traced (eval_shape, then the jitted init): never eager
    _assert_born_sharded(state, sharded)
    _assert_kernels_split(state, sharded)
    _SEEN.clear()
    eager = training.create_train_state(
        _Net(), optax.adamw(1e-3), x, rng=7, strategy=jstrategy.OneDeviceStrategy("cpu:0")
    )
    assert _SEEN[-2:] == [False, False]  # the control: OneDevice initializes eagerly
    _assert_same_values(state, eager)


@pytest.mark.slow
def test_nnx_state_is_created_sharded_from_a_factory_with_the_eager_values(sharded):
    state = training.create_nnx_train_state(
        lambda: _NNXNet(nnx.Rngs(3)), optax.adamw(1e-3), strategy=sharded
    )
    assert _SEEN and all(_SEEN)
    _assert_born_sharded(state, sharded)
    _assert_kernels_split(state, sharded)
    _SEEN.clear()
    module = _NNXNet(nnx.Rngs(3))
    assert _SEEN == [False]
    eager = training.create_nnx_train_state(
        module, optax.adamw(1e-3), strategy=jstrategy.OneDeviceStrategy("cpu:0")
    )
    _assert_same_values(state, eager)


def test_nnx_state_of_an_existing_module_gets_its_optimizer_state_sharded(sharded):
    module = _NNXNet(nnx.Rngs(3))
    state = training.create_nnx_train_state(module, optax.adamw(1e-3), strategy=sharded)
    _assert_born_sharded(state, sharded)
    _assert_kernels_split(state, sharded)
    np.testing.assert_array_equal(state.params["dense1"]["kernel"][...], module.dense1.kernel[...])


def test_nnx_factory_errors_name_the_fix():
    with pytest.raises(TypeError, match="must create an nnx.Module; it returned int"):
        training.create_nnx_train_state(lambda: 3, optax.sgd(0.1), strategy=_fsdp())
    module = _NNXNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(TypeError, match="pass its transformation"):
        training.create_nnx_train_state(lambda: _NNXNet(nnx.Rngs(0)), optimizer)
    with pytest.raises(TypeError, match="For linen modules use create_train_state"):
        training.create_nnx_train_state(nn.Dense(3), optax.sgd(0.1))


@pytest.mark.slow
def test_model_is_built_and_compiled_sharded(sharded):
    with sharded.scope():
        model = jstrategy.Model(_Net(), input_shape=(FEATURES,), seed=1)
        model.compile(optax.adamw(1e-3), loss="mse", gradient_accumulation_steps=2)
    assert _SEEN and all(_SEEN)
    assert model.state.grad_accumulator is not None
    split = _assert_born_sharded(model.state, sharded)
    _assert_kernels_split((model.state.params, model.state.opt_state), sharded)
    assert split > 6  # the accumulator's sums are split like their parameters too
    x = np.ones((16, FEATURES), np.float32)
    history = model.fit(x, np.zeros((16, OUT), np.float32), batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.slow
def test_nnx_model_gets_its_optimizer_state_sharded_at_compile(sharded):
    with sharded.scope():
        model = jstrategy.Model(_NNXNet(nnx.Rngs(0)))
        model.compile(optax.adamw(1e-3), loss="mse")
    _assert_born_sharded(model.state, sharded)
    _assert_kernels_split((model.state.params, model.state.opt_state), sharded)


@pytest.mark.slow
def test_load_model_under_fsdp_restores_into_a_state_created_sharded(tmp_path):
    x = np.random.default_rng(0).normal(size=(16, FEATURES)).astype(np.float32)
    y = np.zeros((16, OUT), np.float32)
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        model = jstrategy.Model(_Net(), input_shape=(FEATURES,), seed=2)
        model.compile(jstrategy.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    path = str(tmp_path / "model")
    model.save(path)
    fsdp = _fsdp()
    _SEEN.clear()
    with fsdp.scope():
        loaded = jstrategy.models.load_model(path, _Net())
    assert _SEEN and all(_SEEN)
    _assert_born_sharded(loaded.state, fsdp)
    _assert_kernels_split((loaded.state.params, loaded.state.opt_state), fsdp)
    assert int(loaded.state.step) == 2
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    with fsdp.scope():
        weights_only = jstrategy.models.load_model(path, _Net(), compile=False)
    _assert_born_sharded(weights_only.state, fsdp)
    for a, b in zip(weights_only.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class _Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = _Block()(x)
        return x


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


@pytest.mark.slow
def test_creation_peak_per_device_is_below_one_whole_copy():
    width = 128
    module, tx, x = _Residual(), optax.adamw(1e-3), jnp.ones((1, width))
    strategy = jstrategy.experimental.FSDPStrategy()
    program = training.compile_train_state_creation(module, tx, x, strategy=strategy)
    params = jax.eval_shape(lambda: module.init(jax.random.key(0), x))["params"]
    one_param_copy = sum(math.prod(p.shape) * p.dtype.itemsize for p in jax.tree.leaves(params))
    whole_state = 3 * one_param_copy  # parameters and AdamW's two moments
    # The eager path holds the whole state on one device; here each device holds about an
    # eighth of it, plus the replicated norms and biases and the init's temporaries.
    assert _peak(program) < whole_state / 2
    assert program.memory_analysis().output_size_in_bytes < whole_state / 4
