"""Checkpoints reshard across mesh shapes and device counts (issue 19 item 6).

A train state (parameters, Adam's moments, the step) saved under one sharded strategy is
restored under another, with another mesh or fewer devices: every leaf comes back in the
target strategy's layout (`variable_sharding`; the moments laid out like their parameter),
with the saved values, through the checkpoint API (`CheckpointManager`), `Model.save` with
`jstrategy.models.load_model`, and `Model.save_weights` with `Model.load_weights`. Training
on after the restore continues the saved run.

Each process reading only what it holds is checked with two processes in
tests/test_multi_worker.py; here the one process checks where each restored leaf lives.
"""

import functools

import flax.linen as nn
import helpers
import jax
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import losses
from jstrategy._src.names import path_names

FEATURES = 6


def _fsdp_8():
    return jstrategy.experimental.FSDPStrategy(min_shard_size=0)


def _fsdp_4():
    # Fewer devices: half of the job's, each slice twice as large.
    return jstrategy.experimental.FSDPStrategy(
        devices=[f"cpu:{i}" for i in range(4)], min_shard_size=0
    )


def _model_parallel(shape):
    mesh = jstrategy.experimental.DeviceMesh(shape, ("batch", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["Dense_0/kernel"] = (None, "model")  # Megatron: columns, then rows
    layout_map["Dense_0/bias"] = ("model",)
    layout_map["Dense_1/kernel"] = ("model", None)
    return jstrategy.experimental.ModelParallelStrategy(layout_map)


STRATEGIES = {
    "fsdp_8": _fsdp_8,
    "fsdp_4": _fsdp_4,
    "model_parallel_2x4": functools.partial(_model_parallel, (2, 4)),
    "model_parallel_4x2": functools.partial(_model_parallel, (4, 2)),
}

PAIRS = [
    ("fsdp_8", "fsdp_4"),
    ("model_parallel_2x4", "model_parallel_4x2"),
    ("model_parallel_2x4", "fsdp_8"),
    ("fsdp_8", "model_parallel_2x4"),
]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        hidden = nn.relu(nn.Dense(16)(x))  # Dense_0
        return nn.Dense(3)(hidden)


def _data(rows=48):
    return helpers.classification_data(rows, FEATURES)


def _model(strategy, seed=0):
    with strategy.scope():
        model = jstrategy.Model(MLP(), input_shape=(FEATURES,), seed=seed)
        model.compile(optax.adam(0.01), loss=losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(name)`: a model trained one epoch under STRATEGIES[name] (no moment at its
    initial zero), written once each way; and its weights after one more epoch."""
    runs = {}

    def run(name):
        if name not in runs:
            directory = tmp_path_factory.mktemp(name)
            model = _model(STRATEGIES[name]())
            model.fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
            with jstrategy.CheckpointManager(directory / "ckpt", async_save=False) as manager:
                assert manager.save(1, model.state)
            model.save(directory / "model")
            model.save_weights(directory / "weights")
            values = {path: _value(leaf) for path, leaf in _leaves(model.state).items()}
            runs[name] = _Saved(directory, values, _continue(model))
        return runs[name]

    return run


class _Saved:
    def __init__(self, directory, values, continued):
        self.directory = directory
        self.values = values  # the saved state's leaves by path, as NumPy
        self.continued = continued  # the weights after one more epoch


def _leaves(state):
    """The state's leaves by path (``("opt_state", "0", "mu", "Dense_0", "kernel")``)."""
    return {path_names(k): leaf for k, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def _value(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def _assert_restored(restored, saved, strategy):
    """`restored` holds `saved`'s values, each leaf where `strategy` keeps it."""
    restored = _leaves(restored)
    assert sorted(restored) == sorted(saved)
    for path, leaf in restored.items():
        np.testing.assert_array_equal(_value(leaf), saved[path], err_msg=str(path))
        want = strategy.variable_sharding(leaf, path)
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (path, leaf.sharding, want)
        assert leaf.sharding.device_set == set(strategy.mesh.devices.flat), path
    # Adam's moments follow their parameter's new layout, which really splits the kernels.
    moments = [p for p in restored if p[0] == "opt_state" and p[-1] == "kernel"]
    assert len(moments) == 4, moments  # mu and nu of the two kernels
    for path in moments:
        param = restored[("params", *path[-2:])]
        assert not param.sharding.is_fully_replicated, path
        assert restored[path].sharding.is_equivalent_to(param.sharding, param.ndim), path


def _continue(model):
    """One more epoch's final weights."""
    model.fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.slow
@pytest.mark.parametrize(("saved_under", "restored_under"), PAIRS)
def test_train_state_reshards_through_checkpoint_manager(saved, saved_under, restored_under):
    source = saved(saved_under)
    target_strategy = STRATEGIES[restored_under]()
    target = _model(target_strategy, seed=1)  # same structure, other values and layout
    # Without shardings in the target, the layout is the strategy's `variable_sharding`.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target.state)
    with jstrategy.CheckpointManager(source.directory / "ckpt") as manager:
        for like in (target.state, abstract):
            restored = manager.restore(target=like, strategy=target_strategy)
            assert type(restored) is type(target.state)
            _assert_restored(restored, source.values, target_strategy)


@pytest.mark.slow
@pytest.mark.parametrize(("saved_under", "restored_under"), PAIRS)
def test_saved_model_loads_under_another_mesh_and_trains_on(saved, saved_under, restored_under):
    source = saved(saved_under)
    target_strategy = STRATEGIES[restored_under]()
    with target_strategy.scope():
        loaded = jstrategy.models.load_model(
            source.directory / "model", MLP(), custom_objects={"optimizer": optax.adam(0.01)}
        )
    assert loaded.strategy is target_strategy
    _assert_restored(loaded.state, source.values, target_strategy)
    # One more epoch from the restored moments and step is the saved run's next epoch.
    for a, b in zip(_continue(loaded), source.continued, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("saved_under", "restored_under"), PAIRS[1:3])
def test_weights_load_under_another_mesh(saved, saved_under, restored_under):
    source = saved(saved_under)
    target_strategy = STRATEGIES[restored_under]()
    target = _model(target_strategy, seed=1)
    before = {path: _value(leaf) for path, leaf in _leaves(target.state).items()}
    target.load_weights(source.directory / "weights")
    for path, leaf in _leaves(target.state).items():
        if path[0] == "params":  # the variables: the saved ones, in the target's layout
            np.testing.assert_array_equal(_value(leaf), source.values[path], err_msg=str(path))
        elif path[0] == "opt_state":  # the optimizer state is left as it was
            np.testing.assert_array_equal(_value(leaf), before[path], err_msg=str(path))
        want = target_strategy.variable_sharding(leaf, path)
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (path, leaf.sharding, want)
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(target.state))
