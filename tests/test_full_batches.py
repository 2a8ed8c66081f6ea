"""Full batches run the program without a row mask: the same numbers as the masked program,
and no more than a step written by hand for full batches (no mask argument, no count of
real rows to all-reduce)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.input.placement import full_mask
from jstrategy._src.input.placement import is_full_mask
from jstrategy._src.training.data_adapters import ArrayAdapter


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="hidden")(x))
        return nn.Dense(4, name="head")(x)


def _data(rows=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=(rows,)).astype(np.int32)
    return x, y


_LOSS = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)


def _copy(state):
    """A copy of a train state (a step donates the state it is given)."""
    return jax.tree.map(lambda v: v.copy(), state)


def _all_reduce_operands(hlo: str) -> list[int]:
    """The operand count of each all-reduce in a compiled module's text."""
    counts = []
    for line in hlo.splitlines():
        match = re.search(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(", line)
        if match:
            shape = match.group(1)
            counts.append(shape.count("[") if shape.startswith("(") else 1)
    return counts


_STRATEGIES = {
    "mirrored": lambda: jstrategy.MirroredStrategy(),
    "fsdp": lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=1),
    "hybrid": lambda: jstrategy.experimental.HybridStrategy(replicas=2, fsdp=2, tensor=2),
}


@pytest.mark.parametrize("name", sorted(_STRATEGIES))
def test_full_and_masked_programs_follow_the_same_trajectory(name):
    strategy = _STRATEGIES[name]()
    x, y = _data()
    with strategy.scope():
        state0 = training.create_train_state(_MLP(), optax.adam(1e-2), x[:1], rng=0)
        step = training.make_train_step(_LOSS)
    sharding = strategy.batch_sharding()
    placed = jax.device_put((x, y), sharding)
    # An all-true mask made by the caller (not `full_mask`'s): the masked program runs.
    ones = jax.device_put(np.ones(len(x), bool), sharding)
    masked_batch = tuple(jstrategy.PerReplica(v, stacked=False, mask=ones) for v in placed)
    assert not is_full_mask(ones)
    full, masked = _copy(state0), _copy(state0)
    for _ in range(3):
        full, full_logs = step(full, placed)
        masked, masked_logs = step(masked, masked_batch)
    np.testing.assert_allclose(float(full_logs["loss"]), float(masked_logs["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(masked.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert int(full.step) == int(masked.step) == 3


def _mirrored_step(learning_rate):
    """The MLP's train state and step under an 8-replica MirroredStrategy, and the data."""
    strategy = jstrategy.MirroredStrategy()
    x, y = _data()
    with strategy.scope():
        state = training.create_train_state(_MLP(), optax.sgd(learning_rate), x[:1], rng=0)
        step = training.make_train_step(_LOSS)
    return strategy, x, y, state, step


def test_a_full_batch_program_reads_no_mask_and_reduces_no_count():
    strategy, x, y, state, step = _mirrored_step(0.1)
    full = step.lower(state, distribute_batch(strategy, (x, y))).compile().as_text()
    padded = distribute_batch(strategy, (x[:30], y[:30]), global_batch_size=32)
    masked = step.lower(state, padded).compile().as_text()
    # One all-reduce of the four gradients and the loss sum; a padded batch first reduces
    # its count of real rows alone (the mean it differentiates divides by it).
    assert _all_reduce_operands(full) == [5]
    assert _all_reduce_operands(masked) == [1, 5]
    assert "pred[" not in full.split("ENTRY", 1)[1].split("\n}", 1)[0]
    assert "pred[" in masked.split("ENTRY", 1)[1].split("\n}", 1)[0]


def test_a_padded_batch_still_counts_only_its_real_rows():
    strategy, x, y, state, step = _mirrored_step(0.0)
    logits = _MLP().apply({"params": jax.device_get(state.params)}, x)
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    padded_batch = distribute_batch(strategy, (x[:20], y[:20]), global_batch_size=32)
    _, padded = step(_copy(state), padded_batch)
    _, full = step(_copy(state), (x, y))
    np.testing.assert_allclose(float(padded["loss"]), float(per_row[:20].mean()), rtol=1e-5)
    np.testing.assert_allclose(float(full["loss"]), float(per_row.mean()), rtol=1e-5)


def test_fit_epochs_of_full_batches_pass_no_mask_and_others_one_for_every_batch():
    strategy = jstrategy.MirroredStrategy()
    x, y = _data(64)
    full = ArrayAdapter(strategy, x, y, None, batch_size=16, shuffle=True, seed=0)
    assert [e.mask for e in full.train_executions((0, 0), 1, None)] == [None] * 4
    stacked = list(full.train_executions((0, 0), 2, None))
    assert [(e.key, e.mask) for e in stacked] == [((2, True), None)] * 2
    # 60 rows: the last batch is padded, so every batch of the epoch carries its mask and
    # all of them share the masked program.
    part = ArrayAdapter(strategy, x[:60], y[:60], None, batch_size=16, shuffle=True, seed=0)
    masks = [e.mask for e in part.train_executions((0, 0), 1, None)]
    assert len(masks) == 4 and all(m is not None for m in masks)
    assert [int(np.asarray(m).sum()) for m in masks] == [16, 16, 16, 12]
    # A batch size that does not divide among the replicas pads every batch.
    odd = ArrayAdapter(strategy, x, y, None, batch_size=12, shuffle=False, seed=0)
    masks = [e.mask for e in odd.train_executions((0, 0), 1, None)]
    assert all(m is not None and m.shape == (16,) for m in masks)


def test_fit_with_padded_batches_follows_one_device_without_padding():
    # Batches of 12 rows: one device runs them full (the program without a mask); eight
    # replicas pad each to 16 rows (the masked program). Same trajectory.
    x, y = _data(48)
    losses, weights = {}, {}
    for name, strategy in (
        ("one", jstrategy.OneDeviceStrategy("cpu:0")),
        ("eight", jstrategy.MirroredStrategy()),
    ):
        with strategy.scope():
            model = jstrategy.Model(_MLP(), input_shape=(8,), seed=0)
            model.compile(optax.sgd(0.1), loss=_LOSS)
        history = model.fit(x, y, batch_size=12, epochs=2, verbose=0)
        losses[name] = history.history["loss"]
        weights[name] = model.get_weights()
        dispatch.get_limiter().wait_all()
    np.testing.assert_allclose(losses["one"], losses["eight"], rtol=1e-5)
    for a, b in zip(weights["one"], weights["eight"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_cached_full_mask_is_recognized_and_other_masks_are_not():
    strategy = jstrategy.MirroredStrategy()
    sharding = strategy.batch_sharding()
    mask = full_mask(sharding, (16,))
    assert is_full_mask(mask)
    assert not is_full_mask(jax.device_put(np.ones(16, bool), sharding))
    assert not is_full_mask(jnp.ones(16, bool))


@pytest.mark.parametrize(
    "ops",
    [
        jstrategy.NcclAllReduce(num_packs=0),
        jstrategy.HierarchicalCopyAllReduce(num_packs=0),
        jstrategy.HierarchicalCopyAllReduce(num_packs=1),
        jstrategy.ReductionToOneDevice(),
    ],
    ids=["nccl_unpacked", "hierarchical_unpacked", "hierarchical_packed", "to_one_device"],
)
def test_every_all_reduce_sums_a_full_batchs_constant_leaves(ops):
    # Without a mask, the weight sum of a weighted metric and the numerics checks' zeros are
    # the same on every replica (constants): each algorithm must still sum them right.
    x, y = _data(64)
    logs = {}
    jstrategy.config.enable_check_numerics()
    try:
        for name, strategy in (
            ("one", jstrategy.OneDeviceStrategy("cpu:0")),
            ("mirrored", jstrategy.MirroredStrategy(cross_device_ops=ops)),
        ):
            with strategy.scope():
                model = jstrategy.Model(_MLP(), input_shape=(8,), seed=0)
                model.compile(
                    optax.sgd(0.1), loss=_LOSS, weighted_metrics=["sparse_categorical_accuracy"]
                )
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            logs[name] = {k: v[-1] for k, v in history.history.items()}
            dispatch.get_limiter().wait_all()
    finally:
        jstrategy.config.disable_check_numerics()
    assert logs["one"].keys() == logs["mirrored"].keys()
    for key, value in logs["one"].items():
        np.testing.assert_allclose(logs["mirrored"][key], value, rtol=1e-5, err_msg=key)
