"""Mixture-of-experts layers (`jstrategy.experimental.MoE`, `NNXMoE`): routing, capacity and
auxiliary losses against a NumPy reference written here, drops counted, bad settings
refused, and a MoE decoder trained under data-parallel strategies following one device."""

from __future__ import annotations

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
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.moe.routing import route
from jstrategy.experimental import MoE
from jstrategy.experimental import NNXMoE
from jstrategy.experimental import RouterSoftmax
from jstrategy.experimental import expert_capacity
from jstrategy.experimental import moe_dropped_fraction


# A NumPy reference, token by token ------------------------------------------------------
def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_routing(logits: np.ndarray, top_k: int, capacity_factor, after: bool):
    """Per row: each token's kept (expert, weight) pairs, the drops, the two losses."""
    rows, tokens, experts = logits.shape
    if capacity_factor is None:
        capacity = tokens
    else:
        capacity = int(max(math.ceil(tokens * top_k / experts) * capacity_factor, capacity_factor))
    kept, dropped, balance, z = [], [], [], []
    for r in range(rows):
        probs = _softmax(logits[r].astype(np.float64))
        load = np.zeros(experts)
        row_kept, row_dropped = [], 0
        picked = np.zeros(experts)
        for t in range(tokens):
            order = np.argsort(-logits[r, t], kind="stable")[:top_k]
            weights = _softmax(logits[r, t, order]) if after else probs[t, order]
            token_kept = []
            for rank, e in enumerate(order):  # token-major, then rank
                picked[e] += 1
                if load[e] < capacity:
                    load[e] += 1
                    token_kept.append((int(e), float(weights[rank])))
                else:
                    row_dropped += 1
            row_kept.append(token_kept)
        kept.append(row_kept)
        dropped.append(row_dropped)
        balance.append(experts * np.sum(picked / tokens * probs.mean(0)))
        lse = np.log(np.exp(logits[r].astype(np.float64)).sum(-1))
        z.append(np.mean(lse**2))
    return kept, np.array(dropped), np.array(balance), np.array(z)


def reference_layer(x: np.ndarray, params: dict, top_k: int, capacity_factor, after: bool):
    x64 = x.astype(np.float64)
    logits = x64 @ params["router"]
    kept, dropped, balance, z = reference_routing(logits, top_k, capacity_factor, after)
    y = np.zeros_like(x64)
    for r in range(x.shape[0]):
        for t in range(x.shape[1]):
            for e, w in kept[r][t]:
                gate = x64[r, t] @ params["wi_0"][e]
                up = x64[r, t] @ params["wi_1"][e]
                hidden = gate / (1 + np.exp(-gate)) * up
                y[r, t] += w * (hidden @ params["wo"][e])
    return y, dropped, balance, z


@pytest.mark.parametrize("softmax", ["before_top_k", "after_top_k"])
@pytest.mark.parametrize(("top_k", "capacity_factor"), [(1, 1.0), (2, 0.5), (2, 1.25), (3, None)])
def test_routing_matches_the_reference(softmax, top_k, capacity_factor):
    logits = np.random.default_rng(top_k).normal(size=(3, 10, 4)).astype(np.float32)
    got = route(
        jnp.asarray(logits),
        top_k=top_k,
        capacity_factor=capacity_factor,
        softmax=RouterSoftmax(softmax),
    )
    kept, dropped, balance, z = reference_routing(
        logits, top_k, capacity_factor, softmax == "after_top_k"
    )
    np.testing.assert_array_equal(np.asarray(got.dropped), dropped)
    np.testing.assert_allclose(np.asarray(got.load_balance), balance, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.z_loss), z, rtol=1e-5)
    combine = np.asarray(got.combine).sum(-1)  # [rows, tokens, experts]: each kept weight
    want = np.zeros_like(combine)
    for r, row in enumerate(kept):
        for t, pairs in enumerate(row):
            for e, w in pairs:
                want[r, t, e] = w
    np.testing.assert_allclose(combine, want, rtol=1e-5, atol=1e-7)
    # Every slot holds at most one token, and no expert has more than its capacity.
    capacity = got.dispatch.shape[-1]
    assert capacity == expert_capacity(10, 4, top_k, capacity_factor)
    assert np.asarray(got.dispatch).sum(1).max() <= 1


def test_a_balanced_router_scores_top_k_and_capacity_is_maxtexts():
    # Uniform logits: every probability 1/E; ties go to the lowest experts, each token the
    # same ones, but P_e = 1/E everywhere makes the loss top_k whatever f is.
    r = route(jnp.zeros((1, 8, 4)), top_k=2, capacity_factor=None)
    np.testing.assert_allclose(np.asarray(r.load_balance), [2.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r.z_loss), [math.log(4) ** 2], rtol=1e-6)
    assert [expert_capacity(16, 8, 2, f) for f in (1.0, 1.25, 0.01)] == [4, 5, 1]


@pytest.mark.parametrize("softmax", ["before_top_k", "after_top_k"])
@pytest.mark.parametrize("capacity_factor", [0.5, None])
def test_the_linen_and_nnx_layers_match_the_reference(softmax, capacity_factor):
    x = np.random.default_rng(0).normal(size=(3, 8, 5)).astype(np.float32)
    layer = MoE(
        num_experts=4, top_k=2, hidden_dim=6, capacity_factor=capacity_factor, softmax=softmax
    )
    variables = layer.init(jax.random.key(0), x)
    y, state = layer.apply(variables, x, mutable=["intermediates"])
    params = {k: np.asarray(v, np.float64) for k, v in nn.unbox(variables["params"]).items()}
    want, dropped, _, _ = reference_layer(x, params, 2, capacity_factor, softmax == "after_top_k")
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    assert moe_dropped_fraction(state["intermediates"]) == dropped.sum() / (3 * 8 * 2)
    assert (dropped.sum() > 0) == (capacity_factor is not None)

    module = NNXMoE(
        5,
        num_experts=4,
        top_k=2,
        hidden_dim=6,
        capacity_factor=capacity_factor,
        softmax=softmax,
        rngs=nnx.Rngs(0),
    )
    nnx_params = {k: np.asarray(getattr(module, k)[...], np.float64) for k in params}
    want, dropped, _, _ = reference_layer(
        x, nnx_params, 2, capacity_factor, softmax == "after_top_k"
    )
    np.testing.assert_allclose(np.asarray(module(x)), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(module.routing(x).dropped), dropped)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"num_experts": 4, "top_k": 5},
            r"`top_k` must be at most `num_experts` \(4\).*top_k <= 4",
        ),
        ({"num_experts": 0}, r"`num_experts` must be a positive int; got 0\. E\.g\."),
        ({"capacity_factor": 0}, r"`capacity_factor` must be a positive number.*got 0.*None"),
        ({"capacity_factor": -1.0}, r"`capacity_factor` must be a positive number"),
        ({"softmax": "sigmoid"}, r"`softmax` must be one of \['before_top_k', 'after_top_k'\]"),
        ({"z_loss_weight": -1}, r"`z_loss_weight` must be a non-negative"),
        ({"hidden_dim": 0}, r"`hidden_dim` must be a positive int"),
    ],
)
def test_bad_settings_are_refused_when_the_layer_is_made(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MoE(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        NNXMoE(4, **kwargs, rngs=nnx.Rngs(0))


# Training -----------------------------------------------------------------------------------
VOCAB, TOKENS, DIM, ROWS, BATCH = 11, 6, 8, 40, 16  # 40 rows: a padded last batch
EXPERTS = 8  # every expert degree of 8 devices divides it


class Decoder(nn.Module):
    """Embedding, one residual expert block, logits over the vocabulary at each position."""

    capacity_factor: float | None = 0.5

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(VOCAB, DIM)(tokens)
        h = h + MoE(
            num_experts=EXPERTS,
            top_k=2,
            hidden_dim=12,
            capacity_factor=self.capacity_factor,
            load_balance_weight=0.1,
            z_loss_weight=0.01,
        )(nn.LayerNorm()(h))
        return nn.Dense(VOCAB)(h)


class NNXDecoder(nnx.Module):
    def __init__(self, capacity_factor, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.moe = NNXMoE(
            DIM,
            num_experts=EXPERTS,
            top_k=2,
            hidden_dim=12,
            capacity_factor=capacity_factor,
            load_balance_weight=0.1,
            z_loss_weight=0.01,
            rngs=rngs,
        )
        self.out = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        return self.out(h + self.moe(self.norm(h)))


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(ROWS, TOKENS)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)  # predict the next token (cyclically)


def _loss():
    return jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)


def _arrays(tree):
    return [np.asarray(v) for v in jax.device_get(jax.tree.leaves(tree))]


def _fit(strategy, kind: str, capacity_factor):
    x, y = _data()
    with strategy.scope():
        if kind == "nnx":
            model = jstrategy.Model(NNXDecoder(capacity_factor, nnx.Rngs(0)))
        else:
            model = jstrategy.Model(
                Decoder(capacity_factor), (TOKENS,), input_dtype=jnp.int32, seed=0
            )
        model.compile(optax.adam(1e-2), loss=_loss())
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"], _arrays(model.get_weights())


def _factory(strategy, kind: str, capacity_factor):
    x, y = _data()
    with strategy.scope():
        if kind == "nnx":
            state = training.create_nnx_train_state(
                NNXDecoder(capacity_factor, nnx.Rngs(0)), optax.adam(1e-2)
            )
        else:
            state = training.create_train_state(
                Decoder(capacity_factor), optax.adam(1e-2), x[:1], rng=0
            )
        step = training.make_train_step(_loss())
    losses = []
    for i in range(0, ROWS, BATCH):
        state, logs = step(state, distribute_batch(strategy, (x[i : i + BATCH], y[i : i + BATCH])))
        dispatch.track(logs)
        losses.append(logs["loss"])
    return [float(v) for v in jax.device_get(losses)], _arrays(state.variables)


STRATEGIES = {
    "mirrored_8": lambda: jstrategy.MirroredStrategy(),
    "mirrored_2": lambda: jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]),
    "fsdp_8": lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=0),
}
_ORACLES: dict = {}


def _oracle(path, kind, capacity_factor):
    key = (path, kind, capacity_factor)
    if key not in _ORACLES:
        _ORACLES[key] = path(jstrategy.OneDeviceStrategy("cpu:0"), kind, capacity_factor)
    return _ORACLES[key]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize(
    ("path", "kind", "capacity_factor"),
    [
        (_fit, "linen", 0.5),
        (_fit, "linen", None),
        (_fit, "nnx", 0.5),
        (_factory, "linen", 0.5),
        (_factory, "nnx", None),
    ],
    ids=[
        "fit-linen-drops",
        "fit-linen-dropless",
        "fit-nnx-drops",
        "factory-linen-drops",
        "factory-nnx-dropless",
    ],
)
def test_a_moe_decoder_follows_one_device(strategy, path, kind, capacity_factor):
    assert_follows_one_device(STRATEGIES[strategy](), path, kind, capacity_factor)


def assert_follows_one_device(strategy, path, kind, capacity_factor):
    """`path`'s losses and final weights under `strategy` are one device's (1e-5)."""
    want_losses, want_weights = _oracle(path, kind, capacity_factor)
    losses, weights = path(strategy, kind, capacity_factor)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    assert len(weights) == len(want_weights)
    for a, b in zip(weights, want_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def cell_ids(cells):
    """Test ids of ``(strategy, path, kind, capacity_factor)`` cells."""
    return [f"{s}-{p.__name__[1:]}-{k}-{'drops' if c else 'dropless'}" for s, p, k, c in cells]


@pytest.mark.parametrize("kind", ["linen", "nnx"])
@pytest.mark.parametrize("strategy", ["one_device", "mirrored_8"])
def test_the_aux_losses_are_added_over_the_real_rows(kind, strategy):
    """One padded step (12 real rows of 16): fit's loss with the weights minus without
    them is the weighted mean, over the real rows, of the reference's per-row losses."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 5, 4)).astype(np.float32)
    y = rng.normal(size=(12, 5, 4)).astype(np.float32)
    make = {
        "one_device": lambda: jstrategy.OneDeviceStrategy("cpu:0"),
        "mirrored_8": jstrategy.MirroredStrategy,
    }[strategy]

    def first_loss(balance: float, z: float) -> tuple[float, dict]:
        settings = dict(num_experts=4, top_k=2, hidden_dim=6, capacity_factor=0.5)
        with make().scope():
            if kind == "nnx":
                module = NNXMoE(
                    4, **settings, load_balance_weight=balance, z_loss_weight=z, rngs=nnx.Rngs(0)
                )
                model = jstrategy.Model(module)
            else:
                module = MoE(**settings, load_balance_weight=balance, z_loss_weight=z)
                model = jstrategy.Model(module, (5, 4), seed=0)
            model.compile(optax.sgd(0.0), loss="mse")
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        weights = dict(zip(["router", "wi_0", "wi_1", "wo"], model.get_weights(), strict=True))
        return history.history["loss"][0], weights

    plain, params = first_loss(0.0, 0.0)
    weighted, _ = first_loss(0.3, 0.02)
    logits = x.astype(np.float64) @ np.asarray(params["router"], np.float64)
    _, dropped, balance, z = reference_routing(logits, 2, 0.5, after=False)
    assert dropped.sum() > 0
    np.testing.assert_allclose(
        weighted - plain, 0.3 * balance.mean() + 0.02 * z.mean(), rtol=1e-5, atol=1e-6
    )


def test_the_decoder_drops_tokens_and_one_device_reports_the_fraction():
    x, _ = _data()
    variables = Decoder(0.5).init(jax.random.key(0), x[:1])
    _, state = Decoder(0.5).apply(variables, x, mutable=["intermediates"])
    fraction = moe_dropped_fraction(state["intermediates"])
    assert 0 < fraction < 1
    _, state = Decoder(None).apply(variables, x, mutable=["intermediates"])
    assert moe_dropped_fraction(state["intermediates"]) == 0.0
