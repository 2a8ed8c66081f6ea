"""Rematerialization per layer (issue 19, item 5): the train step's ``remat`` option.

The compiled step's temporaries are read from its memory analysis (deterministic).
"""

import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import training
from jstrategy._src.input.placement import distribute_batch

ROOT = Path(__file__).resolve().parents[1]
WIDTH, BLOCKS, ROWS = 64, 4, 32


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        h = nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))
        return x + nn.Dense(WIDTH)(nn.gelu(h)), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = training.remat(_Block, prevent_cse=False)
        blocks = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=BLOCKS
        )
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(8)(x)


class _Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = training.remat(_Block)
        for i in range(BLOCKS):
            x, _ = block(name=f"block_{i}")(x)
        return nn.Dense(8)(x)


class _UnrolledUnnamed(nn.Module):
    """Blocks Flax names after their class (``_Block_0``...), with or without the step's
    remat (whose ``nn.remat`` class would otherwise name them ``Checkpoint_Block_0``)."""

    @nn.compact
    def __call__(self, x):
        block = training.remat(_Block)
        for _ in range(BLOCKS):
            x, _ = block()(x)
        return nn.Dense(8)(x)


class _Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(x)


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, WIDTH)).astype(np.float32)
    return x, rng.integers(0, 8, size=ROWS).astype(np.int32)


def _step(strategy, module, remat, tx=None):
    with strategy.scope():
        state = training.create_train_state(module, tx or optax.sgd(1.0), jnp.ones((1, WIDTH)))
        step = training.make_train_step(_loss, remat=remat)
    return state, step


def _temporaries(strategy, remat):
    state, step = _step(strategy, _Scanned(), remat, optax.adamw(1e-3))
    compiled = step.lower(state, distribute_batch(strategy, _batch())).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [lambda: jstrategy.OneDeviceStrategy("cpu:0"), jstrategy.experimental.FSDPStrategy],
    ids=["one_device", "fsdp"],
)
def test_remat_cuts_the_scanned_steps_temporaries(strategy):
    without = _temporaries(strategy(), None)
    full = _temporaries(strategy(), True)
    dots = _temporaries(strategy(), jax.checkpoint_policies.dots_saveable)
    # Per layer, only each block's input is kept for the backward pass.
    assert full < 0.85 * without, (full, without)
    assert dots < without, (dots, without)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        lambda: jstrategy.OneDeviceStrategy("cpu:0"),
        jstrategy.MirroredStrategy,
        jstrategy.experimental.FSDPStrategy,
    ],
    ids=["one_device", "mirrored", "fsdp"],
)
@pytest.mark.parametrize(
    "module", [_Scanned, _Unrolled, _UnrolledUnnamed], ids=["scanned", "unrolled", "unnamed"]
)
def test_rematerialized_loss_and_gradients_are_the_same(strategy, module):
    batch = _batch()
    results = []
    for remat in (None, True, "dots_with_no_batch_dims_saveable"):
        s = strategy()
        state, step = _step(s, module(), remat)
        before = jax.tree.map(np.asarray, state.params)
        state, logs = step(state, distribute_batch(s, batch))
        # SGD with learning rate 1: the parameters moved by minus the gradients.
        grads = jax.tree.map(lambda a, b: a - np.asarray(b), before, state.params)
        results.append((float(logs["loss"]), grads))
    (loss, grads), *others = results
    for other_loss, other_grads in others:
        assert other_loss == pytest.approx(loss, abs=1e-6)
        for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4


@pytest.mark.slow
def test_model_compile_takes_remat_and_fits_the_same():
    x, y = _batch()
    histories = []
    for remat in (None, "dots_saveable"):
        with jstrategy.OneDeviceStrategy("cpu:0").scope():
            model = jstrategy.Model(_Scanned(), input_shape=(WIDTH,), seed=0)
            loss = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)  # logits
            model.compile(optax.sgd(0.1), loss=loss, remat=remat)
            histories.append(model.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"])
    np.testing.assert_allclose(histories[1], histories[0], atol=1e-6)


def test_outside_a_remat_step_the_block_is_itself():
    assert training.remat(_Block) is _Block
    params = _Scanned().init(jax.random.key(0), jnp.ones((1, WIDTH)))["params"]
    assert params["blocks"]["Dense_0"]["kernel"].shape == (BLOCKS, WIDTH, 4 * WIDTH)


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("full", ValueError, r"`remat` must name a checkpoint policy.*'dots_saveable'.*got 'full'"),
        (3, TypeError, r"`remat` must be None, a bool.*got 3 of type int.*Pass None or False"),
        (0.5, TypeError, r"`remat` must be None, a bool.*got 0.5"),
        (
            jax.checkpoint_policies.save_only_these_names,
            ValueError,
            r"save_only_these_names itself, which makes a policy.*call it",
        ),
    ],
)
def test_bad_remat_values_raise_before_any_work(value, error, match):
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        with pytest.raises(error, match=match):
            training.make_train_step(_loss, remat=value)
        model = jstrategy.Model(_Plain(), input_shape=(WIDTH,))
        with pytest.raises(error, match=match):
            model.compile("sgd", loss="mse", remat=value)
        assert not model.compiled


def test_remat_on_a_model_without_remat_blocks_raises():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    state, step = _step(strategy, _Plain(), True)
    with pytest.raises(ValueError, match=r"never called jstrategy.training.remat.*remat=None"):
        step(state, _batch())


def test_remat_takes_a_module_class():
    with pytest.raises(TypeError, match=r"`block` must be a flax.linen Module class.*_Block\("):
        training.remat(_Block())


@pytest.mark.multiprocess
def test_largest_model_benchmark_runs():
    """A tiny configuration of benchmarks/largest_model.py, end to end."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "largest_model.py"),
            "--tiny",
            "--devices",
            "4",
            "--remat",
            "on",
            "--policies",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for what in ("Mirrored", "FSDP", "ModelParallel", "hand-written", "creation peak"):
        assert what in out.stdout, out.stdout
    assert "n/a" not in out.stdout, out.stdout  # every figure measured, creation included
    assert "largest transformer" in out.stdout
