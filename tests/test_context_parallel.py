"""Context (sequence) parallelism: ring attention over a sharded strategy's "context" axis.

A small decoder whose attention is `jstrategy.experimental.dot_product_attention` (the
one of `benchmarks/context_parallel.py`) follows OneDeviceStrategy's trajectory under
``FSDPStrategy(context=k)`` and a ModelParallel mesh with a ``"context"`` axis; its
compiled train step's peak per device falls with the degree (memory_analysis) and passes
keys and values round the context axis only (collective-permutes in the HLO); bad degrees
and sequences are refused before any work.
"""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import training
from jstrategy._src import hlo
from jstrategy._src.context_parallel import axis as axis_lib
from jstrategy._src.input.placement import distribute_batch

ROOT = Path(__file__).resolve().parents[1]


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "context_parallel_bench", ROOT / "benchmarks/context_parallel.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _benchmark()
VOCAB = 16


def _decoder(causal=True):
    return bench.Decoder(vocab=VOCAB, width=16, heads=2, causal=causal)


def _data(rows, seq, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(rows, seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _trajectory(strategy, module, x, y, steps=3):
    with strategy.scope():
        state = training.create_train_state(module, optax.adam(0.01), x[:1], rng=0)
        step = training.make_train_step(bench.token_loss)
    losses = []
    for _ in range(steps):
        state, logs = step(state, distribute_batch(strategy, (x, y)))
        losses.append(float(logs["loss"]))  # reading it bounds the steps in flight
    return losses, jax.device_get(state.params)


_REFERENCES = {}


def _reference(causal, x, y):
    """OneDeviceStrategy's trajectory, computed once per case for the whole module."""
    key = (causal, x.shape)
    if key not in _REFERENCES:
        _REFERENCES[key] = _trajectory(jstrategy.OneDeviceStrategy("cpu:0"), _decoder(causal), x, y)
    return _REFERENCES[key]


def _assert_follows(strategy, causal, x, y):
    want_losses, want = _reference(causal, x, y)
    got_losses, got = _trajectory(strategy, _decoder(causal), x, y)
    np.testing.assert_allclose(got_losses, want_losses, atol=1e-5, rtol=0)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("context", [2, 4, 8])
def test_decoder_follows_one_device(context, causal):
    """Ring attention over `context` shards (and the rest of the model split over the
    sequence) trains as one device does: the loss, then every parameter, within 1e-5."""
    x, y = _data(4, 32)
    strategy = jstrategy.experimental.FSDPStrategy(context=context, min_shard_size=0)
    assert (strategy.context_parallelism, strategy.num_replicas_in_sync) == (context, 8 // context)
    _assert_follows(strategy, causal, x, y)


@pytest.mark.slow
def test_model_parallel_context_axis_follows_one_device():
    """A DeviceMesh axis named "context" is honoured by ModelParallelStrategy."""
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "context"))
    strategy = jstrategy.experimental.ModelParallelStrategy(jstrategy.experimental.LayoutMap(mesh))
    assert strategy.context_parallelism == 4
    x, y = _data(4, 32)
    _assert_follows(strategy, True, x, y)


@pytest.mark.slow
def test_peak_falls_with_the_context_degree():
    """The compiled step's peak per device at a long sequence falls at least 3x from one
    device to eight (the scores' blocks shrink with the square of the shard); the
    benchmark prints the 8k figures."""
    template = bench.template_state(_decoder())
    peaks = {
        degree: bench.peak_bytes(
            bench.compile_step(bench.context_strategy(degree), template, 2048)[0]
        )
        for degree in (1, 8)
    }
    assert peaks[1] >= 3 * peaks[8], peaks


@pytest.mark.slow
def test_keys_and_values_pass_round_the_context_axis_only():
    """The compiled step's collective-permutes (the ring's ppermutes, forward and
    backward) move blocks between neighbours of one replica's context group, never across
    replicas; nothing is all-gathered over the context axis."""
    strategy = jstrategy.experimental.FSDPStrategy(context=4, min_shard_size=0)
    template = bench.template_state(_decoder())
    compiled, _ = bench.compile_step(strategy, template, 64, rows=2)
    text = compiled.as_text()
    permutes = hlo.permute_pairs(text)
    assert permutes, "no collective-permute: the attention did not run as a ring"
    ids = np.arange(8).reshape(2, 4)  # the mesh (replica, context), in device-id order
    for pairs in permutes:
        for source, target in pairs:
            (r1, c1), (r2, c2) = np.argwhere(ids == source)[0], np.argwhere(ids == target)[0]
            assert r1 == r2, (source, target)  # within one replica's context group
            assert (c2 - c1) % 4 in (1, 3), (source, target)  # to a ring neighbour
    gathers = hlo.collective_counts(text, strategy.mesh)
    assert not any(
        k.startswith("all-gather[") and "context]" in k and "replica" not in k for k in gathers
    ), gathers


def test_context_must_divide_the_devices():
    with pytest.raises(
        ValueError, match=r"`context` must divide the number of devices, 8.*context=3.*context=2"
    ):
        jstrategy.experimental.FSDPStrategy(context=3)
    with pytest.raises(ValueError, match=r"`context` must be a positive int"):
        jstrategy.experimental.FSDPStrategy(context=0)


def test_model_parallel_refuses_context_as_the_batch_axis():
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("model", "context"))
    with pytest.raises(ValueError, match=r"`batch_dim_name` must not be 'context'"):
        jstrategy.experimental.ModelParallelStrategy(
            jstrategy.experimental.LayoutMap(mesh), batch_dim_name="context"
        )


@pytest.mark.slow
def test_sequence_must_divide_the_degree_before_any_work():
    """A sequence that does not split into the shards is refused when the step is traced,
    naming the array and the fix; the state is left as it was."""
    strategy = jstrategy.experimental.FSDPStrategy(context=4, min_shard_size=0)
    x, y = _data(2, 30)
    with strategy.scope():
        state = training.create_train_state(_decoder(), optax.adam(0.01), x[:1], rng=0)
        step = training.make_train_step(bench.token_loss)
    with pytest.raises(
        ValueError, match=r"dimension 1 \(30\) does not divide by 4.*Pad the sequences"
    ):
        step(state, distribute_batch(strategy, (x, y)))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_attention_refuses_a_mask_under_a_context_axis():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "context"))
    q = jnp.ones((1, 8, 2, 4))
    with axis_lib.applying(axis_lib.of_mesh(mesh, "replica")):
        with pytest.raises(ValueError, match=r"`mask` is not supported under context parallelism"):
            jstrategy.experimental.dot_product_attention(q, q, q, mask=jnp.ones((1, 1, 8, 8), bool))
        with pytest.raises(ValueError, match=r"lengths must divide by 4.*query length 6"):
            jstrategy.experimental.dot_product_attention(q[:, :6], q[:, :6], q[:, :6])


def test_attention_without_a_context_axis_is_flax():
    """Outside a context-parallel step it is `nn.dot_product_attention`, causal mask and
    all; `causal=True` between different lengths is refused."""
    import flax.linen as nn

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 2, 4)), jnp.float32) for _ in range(3))
    mask = nn.make_causal_mask(jnp.ones((2, 8)))
    want = nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(
        jstrategy.experimental.dot_product_attention(q, k, v, causal=True), want
    )
    with pytest.raises(ValueError, match=r"query's length must equal the key's; got 8 and 4"):
        jstrategy.experimental.dot_product_attention(q, k[:, :4], v[:, :4], causal=True)


def _fit(strategy, x, y):
    with strategy.scope():
        model = jstrategy.Model(
            _decoder(), input_shape=(x.shape[1],), input_dtype=jnp.int32, seed=0
        )
        model.compile(optax.adam(0.01), loss=bench.token_loss)
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"], model.evaluate(x, y, verbose=0)


@pytest.mark.slow
def test_model_fit_and_evaluate_follow_one_device():
    """`Model.fit` trains through the same step (evaluation runs Flax's attention on whole
    sequences): both follow one device."""
    x, y = _data(8, 32)
    want_fit, want_eval = _fit(jstrategy.OneDeviceStrategy("cpu:0"), x, y)
    got_fit, got_eval = _fit(jstrategy.experimental.FSDPStrategy(context=4), x, y)
    np.testing.assert_allclose(got_fit, want_fit, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_eval, want_eval, atol=1e-5, rtol=0)
