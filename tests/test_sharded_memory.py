"""FSDP's compiled train step holds about its shard of the state plus a layer (issue 19).

Measured with the compiled program's own memory analysis (deterministic: no timing):
arguments + temporaries + outputs - aliased bytes, per device, against the same step
hand-written as a global-view ``jax.jit`` over the strategy's `NamedSharding`s.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import training
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.placement import variable_shardings

WIDTH, BLOCKS, ROWS = 128, 4, 64


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        h = nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))
        return x + nn.Dense(WIDTH)(nn.gelu(h)), None


class _Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(BLOCKS):
            x, _ = _Block(name=f"block_{i}")(x)
        return nn.Dense(8)(x)


class Block(nn.Module):
    """Issue 37's block: no biases. Named by Flax (``Block_0``...), the blocks' variables
    sort before the head's (``Dense_1``), so the program meets them in another order."""

    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * self.width, use_bias=False)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width, use_bias=False)(nn.gelu(h))


class _FlaxNamed(nn.Module):
    # Wider than the others: at d 128 and 4 blocks the old step's excess (every gradient
    # shard kept to the end) was within 3% of the hand-written step; at d 256 and 8
    # blocks it was 8.3% (the d 512, 16 blocks: 17%).
    width: int = 256
    blocks: int = 8

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width, use_bias=False)(x)  # an input projection
        for _ in range(self.blocks):
            x = Block(self.width)(x)
        return nn.Dense(8, use_bias=False)(x)


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            _Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=BLOCKS
        )
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(8)(x)


# The scanned step's bound on the oldest supported stack. jax 0.10.2's XLA keeps one more
# stacked per-iteration residual (an f32[4, 64, 64] loop carry of the forward scan, and its
# copy: 65,544 more temporary bytes) in the hand-written global-view step and in
# jstrategy's alike: measured per device, jstrategy 1,722,212 bytes (0.814 of one
# parameter copy, 2,115,616) and the hand-written step 1,696,936 (0.802), where jax 0.12
# gives 1,656,668 (0.783) and 1,631,392 (0.771); arguments, outputs and aliases are the
# same on both, and jstrategy/hand-written is 1.015 on both. XLA's buffer assignment, not
# jstrategy: the bound against the hand-written step below holds on every version.
SCANNED_BOUND = 0.8 if jax.__version_info__ >= (0, 12) else 0.82


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _peaks(module):
    """``(jstrategy's step peak, the hand-written step's peak, one parameter copy)``."""
    strategy = jstrategy.experimental.FSDPStrategy()
    tx = optax.adamw(1e-3)
    width = getattr(module, "width", WIDTH)
    x = np.ones((ROWS, width), np.float32)
    y = np.zeros((ROWS,), np.int32)
    with strategy.scope():
        state = training.create_train_state(module, tx, jnp.ones((1, width)))
        step = training.make_train_step(_loss)
    one_copy = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
    compiled = step.lower(state, distribute_batch(strategy, (x, y))).compile()

    shardings = variable_shardings((state.params, state.opt_state), strategy)
    rows = NamedSharding(strategy.mesh, P(strategy.axis_name))

    def hand_written(params, opt_state, x, y):
        def mean_loss(p):
            return _loss(y, module.apply({"params": p}, x)).mean()

        loss, grads = jax.value_and_grad(mean_loss)(params)
        grads = jax.lax.with_sharding_constraint(grads, shardings[0])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    reference = jax.jit(
        hand_written,
        in_shardings=(*shardings, rows, rows),
        out_shardings=(*shardings, None),
        donate_argnums=(0, 1),
    )
    x, y = jax.device_put((x, y), rows)
    reference = reference.lower(state.params, state.opt_state, x, y).compile()
    return _peak(compiled), _peak(reference), one_copy, compiled.as_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "module",
    [_Unrolled(), _FlaxNamed(), _Scanned()],
    ids=["unrolled", "unrolled-flax-names", "scanned"],
)
def test_fsdp_step_peak_is_the_hand_written_global_view_steps(module):
    peak, reference, one_copy, hlo = _peaks(module)
    # Before: the whole model gathered at the step's start, whole gradients to its end
    # (above one parameter copy per device, 2.5x to 5x the hand-written step's peak).
    # Flax's names: the gradients divided by the row count after the backward pass kept
    # every gradient shard alive until the last (issue 37: 1.17x the hand-written step).
    assert peak <= 1.05 * reference, (peak / one_copy, reference / one_copy)
    assert peak < (SCANNED_BOUND if isinstance(module, _Scanned) else 0.8) * one_copy
    # Per-layer gathers: one all-gather per kernel where it is read (unrolled), or one
    # inside the scan's loop per iteration (the loop body's, counted once).
    gathers = hlo.count(" all-gather(") + hlo.count(" all-gather-start(")
    assert gathers >= (2 if isinstance(module, _Scanned) else 2 * getattr(module, "blocks", BLOCKS))


@pytest.mark.parametrize("name", ["fsdp", "model_parallel"])
def test_a_host_batch_is_split_by_rows_as_a_distributed_one(name):
    # A NumPy batch handed to the factory's step is placed by rows over the replicas:
    # the global-view program took it whole on every device before (its peak up to a
    # quarter higher than with the same batch distributed).
    if name == "fsdp":
        strategy = jstrategy.experimental.FSDPStrategy()
    else:
        layout_map = jstrategy.experimental.LayoutMap(
            jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
        )
        layout_map["Dense_0/kernel"] = (None, "model")
        strategy = jstrategy.experimental.ModelParallelStrategy(layout_map)
    x = np.ones((ROWS, WIDTH), np.float32)
    y = np.zeros((ROWS,), np.int32)
    with strategy.scope():
        state = training.create_train_state(_Unrolled(), optax.adamw(1e-3), x[:1])
        step = training.make_train_step(_loss)
    host = step.lower(state, (x, y)).compile()
    placed = step.lower(state, distribute_batch(strategy, (x, y))).compile()
    assert _peak(host) == _peak(placed)
    assert host.input_shardings[0][2][0].spec == P(strategy.axis_name)


def _trajectory(strategy, steps=5):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    y = rng.integers(0, 8, size=16).astype(np.int32)
    with strategy.scope():
        state = training.create_train_state(_MLP(), optax.adam(0.05), x[:1])
        step = training.make_train_step(_loss)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, distribute_batch(strategy, (x, y)))
        losses.append(float(metrics["loss"]))
    return state, losses


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(jnp.tanh(nn.Dense(32)(x)))


def _layout(shape, layouts):
    layout_map = jstrategy.experimental.LayoutMap(
        jstrategy.experimental.DeviceMesh(shape, ("batch", "model"))
    )
    for key, layout in layouts.items():
        layout_map[key] = layout
    return jstrategy.experimental.ModelParallelStrategy(layout_map)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, layouts",
    [
        # The Keras distribution guide's full model parallelism: a batch axis of 1 (this
        # crashed XLA: a cross-partition all-reduce outside a manual region).
        ((1, 8), {"Dense_0/kernel": (None, "model"), "Dense_1/kernel": ("model", None)}),
        # FSDP and tensor parallelism on one 2-D mesh: kernels split over both axes.
        ((2, 4), {"Dense_0/kernel": ("batch", "model"), "Dense_1/kernel": ("model", "batch")}),
    ],
    ids=["full_model_parallel_1x8", "fsdp_and_tensor_parallel_2x4"],
)
def test_model_parallel_meshes_train_like_one_device(shape, layouts):
    expected, expected_losses = _trajectory(jstrategy.OneDeviceStrategy("cpu:0"))
    got, losses = _trajectory(_layout(shape, layouts))
    specs = jax.tree.map(lambda a: a.sharding.spec, got.params)
    assert specs["Dense_0"]["kernel"] == P(*layouts["Dense_0/kernel"])
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
