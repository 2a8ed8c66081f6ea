"""Context (sequence) parallelism: ring attention over a sharded strategy's "context" axis.

A small decoder whose attention is `jstrategy.experimental.dot_product_attention` (the
one of `benchmarks/context_parallel.py`) follows OneDeviceStrategy's trajectory under
``FSDPStrategy(context=k)`` and a ModelParallel mesh with a ``"context"`` axis; its
compiled train step's peak per device falls with the degree (memory_analysis) and passes
keys and values round the context axis only (collective-permutes in the HLO); bad degrees
and sequences are refused before any work. Only the arrays carrying the sequence are split
(a one-hot label stays whole), each device receiving its part of them (the compiled step's
input shardings); dropout under the ring is Flax's; `strategy.run` refuses the attention.
"""

import functools
import importlib.util
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

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
def test_the_ring_keeps_no_hops_scores_for_the_backward_pass():
    """Each hop's attention is rematerialized: the step's temporaries stay below two score
    blocks a hop (one of ``heads x (seq / k)^2`` float32 a row). Differentiated as written,
    the scan over the hops kept each hop's scores and weights: at 4096 tokens over 8 devices
    and 4 heads of a width-64 decoder, 98.3 MiB of temporaries, 25.8 MiB rematerialized."""
    degree, seq, heads = 8, 4096, 4
    model = bench.Decoder(vocab=VOCAB, width=64, heads=heads)
    compiled, _ = bench.compile_step(
        bench.context_strategy(degree), bench.template_state(model), seq
    )
    block = heads * (seq // degree) ** 2 * 4
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries < 2 * (degree - 1) * block, (temporaries, block)


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


# Issue 50, item 11: strategy.run, labels without a sequence, dropout, input bytes ----------
def test_run_refuses_the_attention_under_a_context_axis():
    """`strategy.run` does not split sequences: the ring attention there would be full
    attention on every device of a context group, so it is refused by name, before any
    work; without a context axis the same call is Flax's attention."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 8, 2, 4)), jnp.float32)

    def attend(q):
        return jstrategy.experimental.dot_product_attention(q, q, q, causal=True)

    strategy = jstrategy.experimental.FSDPStrategy(context=4)
    with pytest.raises(
        ValueError,
        match=r"inside strategy.run of a FSDPStrategy with context=4: context parallelism "
        r".*engages only in the train steps.*or build the strategy with context=1",
    ):
        strategy.run(attend, args=(q,))
    plain = jstrategy.experimental.FSDPStrategy(context=1)
    got = plain.experimental_local_results(plain.run(attend, args=(q,)))[0]
    want = nn.dot_product_attention(q, q, q, mask=nn.make_causal_mask(jnp.ones((2, 8))))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


class _Classifier(nn.Module):
    """The decoder's blocks over tokens, mean-pooled into 3 classes: its labels, one-hot
    ``(B, 3)``, have no sequence axis."""

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(3)(_decoder(causal=False)(tokens).mean(axis=1))


def _one_hot_loss(labels, logits):
    return optax.softmax_cross_entropy(logits, labels)


@pytest.mark.slow
def test_a_label_without_a_sequence_axis_stays_whole_and_follows_one_device():
    """Only the arrays whose dimension 1 is the inputs' sequence length are split along
    it: a one-hot ``(B, 3)`` label under context=4 is placed by rows only, and the
    classifier trains as on one device."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(4, 32)).astype(np.int32)
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, size=4)]
    strategy = jstrategy.experimental.FSDPStrategy(context=4)
    trajectories = []
    for s in (jstrategy.OneDeviceStrategy("cpu:0"), strategy):
        with s.scope():
            state = training.create_train_state(_Classifier(), optax.adam(0.01), x[:1], rng=0)
            step = training.make_train_step(_one_hot_loss)
        losses = []
        for _ in range(3):
            state, logs = step(state, distribute_batch(s, (x, y)))
            losses.append(float(logs["loss"]))
        trajectories.append((losses, jax.device_get(state.params)))
    (want_losses, want), (got_losses, got) = trajectories
    np.testing.assert_allclose(got_losses, want_losses, atol=1e-5, rtol=0)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
    tokens, labels = distribute_batch(strategy, (x, y))
    assert (tokens.value.sharding.spec, labels.value.sharding.spec) == (
        P("replica", "context"),
        P("replica"),
    )


def test_which_arrays_carry_the_sequence():
    """The sequence length is the longest dimension 1 of the features' arrays of two or
    more dimensions; a one-hot label, a weight and a shorter side feature stay whole, and
    the divisibility check reads the features only."""
    tokens, one_hot, weights = np.zeros((8, 64)), np.zeros((8, 3)), np.zeros((8,))
    batch = ({"tokens": tokens, "segments": np.zeros((8, 5))}, (tokens, one_hot), weights)
    assert axis_lib.carries_sequence(batch) == (
        {"segments": False, "tokens": True},
        (True, False),
        False,
    )
    axis_lib.check_sequence(batch, 4)  # the label's 3 and the side feature's 5 are no sequence
    with pytest.raises(ValueError, match=r"x\['tokens'\] has shape \(8, 30\).*\(30\) does not"):
        axis_lib.check_sequence(
            ({"tokens": tokens[:, :30], "segments": np.zeros((8, 5))}, one_hot), 4
        )


@pytest.mark.slow
def test_attention_dropout_is_flax_s_under_a_context_axis():
    """Dropout on the attention weights under a context axis draws Flax's mask and drops
    what Flax drops: the ring's result is `nn.dot_product_attention`'s with the same key,
    causal with one mask for every row and head (Flax's default), full with a mask each
    (and differs from the result without dropout)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "context"))
    context = axis_lib.of_mesh(mesh, "replica")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, 4)), jnp.float32) for _ in range(3))
    key = jax.random.key(3)
    cases = ((True, True), (False, False))  # (causal, broadcast_dropout)

    @jax.jit
    def ring(q, k, v, key):
        with axis_lib.applying(context):
            return [
                jstrategy.experimental.dot_product_attention(
                    q, k, v, causal=causal, dropout_rng=key, dropout_rate=0.5,
                    broadcast_dropout=broadcast,
                )
                for causal, broadcast in cases
            ]  # fmt: skip

    for got, (causal, broadcast) in zip(ring(q, k, v, key), cases, strict=True):
        mask = nn.make_causal_mask(jnp.ones((2, 16))) if causal else None
        want = nn.dot_product_attention(
            q, k, v, mask=mask, dropout_rng=key, dropout_rate=0.5, broadcast_dropout=broadcast
        )
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        assert not np.allclose(got, nn.dot_product_attention(q, k, v, mask=mask), atol=0.1)


def test_attention_refuses_what_the_ring_cannot_do_by_name():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "context"))
    q = jnp.ones((1, 8, 2, 4))
    with axis_lib.applying(axis_lib.of_mesh(mesh, "replica")):
        with pytest.raises(ValueError, match=r"`dropout_rng` is needed for `dropout_rate=0.1`"):
            jstrategy.experimental.dot_product_attention(q, q, q, dropout_rate=0.1)
        with pytest.raises(ValueError, match=r"`module` \(Flax's sow_weights=True\) is not supp"):
            jstrategy.experimental.dot_product_attention(q, q, q, module=nn.Dense(1))
        with pytest.raises(ValueError, match=r"`qk_attn_weights_einsum` is not supported"):
            jstrategy.experimental.dot_product_attention(q, q, q, qk_attn_weights_einsum=jnp.einsum)


class _DropoutLM(nn.Module):
    """Flax's multi-head attention with dropout 0.5 on its weights, its `attention_fn`
    ours (`ring`) or Flax's own, with a causal mask either way."""

    ring: bool

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        h = nn.Embed(VOCAB, 16)(tokens) + nn.Embed(64, 16)(jnp.arange(tokens.shape[1]))
        mask = None
        attention_fn = functools.partial(jstrategy.experimental.dot_product_attention, causal=True)
        if not self.ring:
            attention_fn = nn.dot_product_attention
            mask = nn.make_causal_mask(tokens)
        attention = nn.MultiHeadDotProductAttention(
            num_heads=2, dropout_rate=0.5, attention_fn=attention_fn, deterministic=not train
        )
        return nn.Dense(VOCAB)(h + attention(nn.LayerNorm()(h), mask=mask))


@pytest.mark.slow
def test_multi_head_attention_dropout_follows_one_device():
    """`nn.MultiHeadDotProductAttention(dropout_rate=0.5, attention_fn=<ours>)` under
    context=4 trains as Flax's own attention with its dropout does on one device (before,
    the rate was dropped without a word: training was dropout-free)."""
    x, y = _data(4, 32)
    trajectories = []
    for strategy, ring in (
        (jstrategy.OneDeviceStrategy("cpu:0"), False),
        (jstrategy.experimental.FSDPStrategy(context=4, min_shard_size=0), True),
    ):
        with strategy.scope():
            state = training.create_train_state(_DropoutLM(ring), optax.adam(0.01), x[:1], rng=0)
            step = training.make_train_step(bench.token_loss)
        losses = []
        for _ in range(3):
            state, logs = step(state, distribute_batch(strategy, (x, y)))
            losses.append(float(logs["loss"]))
        trajectories.append(losses)
    np.testing.assert_allclose(trajectories[1], trajectories[0], atol=1e-5, rtol=0)


def _batch_bytes_per_device(strategy, x, y):
    """Bytes of the batch arguments of the compiled train step on one device, as the
    compiled program's input shardings lay them out."""
    with strategy.scope():
        state = training.create_train_state(_decoder(), optax.adam(0.01), x[:1], rng=0)
        step = training.make_train_step(bench.token_loss)
    compiled = step.lower(state, distribute_batch(strategy, (x, y))).compile()
    batch = compiled.input_shardings[0][2]
    return sum(
        int(np.prod(sharding.shard_shape(a.shape))) * a.dtype.itemsize
        for sharding, a in zip(jax.tree.leaves(batch), (x, y), strict=True)
    )


@pytest.mark.slow
def test_each_context_device_receives_its_part_of_the_sequence():
    """The compiled step's batch arguments are split along the sequence over the context
    axis: one replica over 4 devices holds a quarter of the batch on each (one device
    holds it whole), and context=4 over 8 devices an eighth, as context=1 does (before,
    each context device received its replica's rows whole: four times as many bytes)."""
    x, y = _data(8, 64)
    whole = x.nbytes + y.nbytes
    one_replica = jstrategy.experimental.FSDPStrategy(devices=jax.devices()[:4], context=4)
    eight = jstrategy.experimental.FSDPStrategy(context=4)
    got = [_batch_bytes_per_device(s, x, y) for s in (one_replica, eight)]
    assert got == [whole // 4, whole // 8], (whole, got)
