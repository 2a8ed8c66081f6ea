"""The seed's TF program and TF's Keras distribute tutorial, run with only `tf.` names
changed, under several strategies, each following OneDeviceStrategy's trajectory."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import numpy as np
import pytest

import jstrategy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SEED_STRATEGIES = {
    "mirrored": lambda: jstrategy.MirroredStrategy(),
    "one_device": lambda: jstrategy.OneDeviceStrategy("cpu:0"),
    "fsdp": lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=0),
}


@pytest.fixture(scope="module")
def seed_reference():
    """OneDeviceStrategy's losses for the seed program: the oracle."""
    return _example("seed_program").main(SEED_STRATEGIES["one_device"](), epochs=3, verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SEED_STRATEGIES))
def test_seed_program_runs_and_follows_one_device(name, seed_reference, capsys):
    history = _example("seed_program").main(SEED_STRATEGIES[name](), epochs=3, verbose=0)
    out = capsys.readouterr().out
    # Keras's totals for Dense(16, input_shape=(10,)) + Dense(1): 176 + 17.
    assert "Total params: 193 (772.00 B)" in out
    assert "Trainable params: 193 (772.00 B)" in out
    assert "Non-trainable params: 0 (0.00 B)" in out
    assert " dense (Dense)" in out and " dense_1 (Dense)" in out
    losses = history.history["loss"]
    assert losses[-1] < 0.6 * losses[0]  # it trains
    np.testing.assert_allclose(losses, seed_reference.history["loss"], rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mirrored", "fsdp"])
def test_keras_distribute_tutorial_follows_one_device(name):
    tutorial = _example("keras_distribute_tutorial")
    kwargs = dict(epochs=2, rows=256, batch_size=64, verbose=0)
    ref_history, ref_eval = tutorial.main(jstrategy.OneDeviceStrategy("cpu:0"), **kwargs)
    history, evaluation = tutorial.main(SEED_STRATEGIES[name](), **kwargs)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-4)
    np.testing.assert_allclose(evaluation, ref_eval, rtol=1e-4)
    assert history.history["loss"][-1] < history.history["loss"][0]


@pytest.mark.slow
def test_keras_distribute_tutorial_model_is_keras_shaped():
    model = _example("keras_distribute_tutorial").build_and_compile(
        jstrategy.OneDeviceStrategy("cpu:0")
    )
    assert [layer.name for layer in model.layers] == [
        "conv2d",
        "max_pooling2d",
        "flatten",
        "dense",
        "dense_1",
    ]
    # Keras's count for this model: 320 + 0 + 0 + 346,176 + 650.
    assert model.count_params() == 347_146
    assert sorted(model.variables["params"]) == ["conv2d", "dense", "dense_1"]
    assert model.variables["params"]["conv2d"]["kernel"].shape == (3, 3, 1, 32)
    assert model.variables["params"]["dense"]["kernel"].shape == (5408, 64)


GUIDE_STRATEGIES = {
    "data_parallel": lambda guide: guide.data_parallel(),
    "model_parallel": lambda guide: guide.model_parallel(),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GUIDE_STRATEGIES))
def test_keras_distribution_guide_follows_one_device(name):
    """Keras 3's distribution guide, data and model parallel, against OneDevice. Without
    dropout the trajectories agree; with the guide's Dropout(0.4) each replica draws its own
    masks, so that run is checked to train."""
    guide = _example("keras_distribution_guide")
    ref_history, ref_eval = guide.main(
        jstrategy.OneDeviceStrategy("cpu:0"), epochs=2, dropout=0.0, verbose=0
    )
    history, evaluation = guide.main(
        GUIDE_STRATEGIES[name](guide), epochs=2, dropout=0.0, verbose=0
    )
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-4)
    np.testing.assert_allclose(evaluation, ref_eval, rtol=1e-4)
    history, _ = guide.main(GUIDE_STRATEGIES[name](guide), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_keras_distribution_guide_splits_d1_over_the_model_axis():
    guide = _example("keras_distribution_guide")
    model = guide.build_and_compile(guide.model_parallel())
    assert [layer.name for layer in model.layers] == ["flatten", "d1", "dropout", "d2"]
    assert model.count_params() == 784 * 200 + 200 * 10 + 10
    kernel = model.variables["params"]["d1"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    # Each device holds a quarter of d1's 200 units.
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(784, 50)}
    assert model.variables["params"]["d2"]["kernel"].sharding.is_fully_replicated
