"""Expert parallelism (`FSDPStrategy(experts=k)`): the MoE decoder of test_moe follows one
device at expert degrees 2, 4 and 8, alone, with FSDP and with data replicas; the step's
only all-to-alls are over the expert axis; each device holds and computes 1/k of the
experts; checkpoints move between degrees; bad degrees are refused with the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_moe as base
from flax import nnx

import jstrategy
from jstrategy import training
from jstrategy._src import hlo
from jstrategy._src.input.placement import distribute_batch
from jstrategy.experimental import moe_dropped_fraction

FSDP = jstrategy.experimental.FSDPStrategy
NEVER = 10**9  # min_shard_size: no variable split by FSDP, the experts by the expert axis

STRATEGIES = {
    "expert_2": lambda: FSDP(experts=2, min_shard_size=NEVER),
    "expert_4": lambda: FSDP(experts=4, min_shard_size=NEVER),
    "expert_8": lambda: FSDP(experts=8, min_shard_size=NEVER),
    "expert_2_x_fsdp_4": lambda: FSDP(experts=2, min_shard_size=0),
    "expert_4_x_fsdp_2": lambda: FSDP(experts=4, min_shard_size=0),
}
CELLS = [
    ("expert_2", base._fit, "linen", 0.5),
    ("expert_2", base._factory, "nnx", None),
    ("expert_4", base._fit, "linen", 0.5),
    ("expert_4", base._factory, "linen", 0.5),
    ("expert_8", base._fit, "linen", 0.5),
    ("expert_8", base._fit, "nnx", 0.5),
    ("expert_2_x_fsdp_4", base._fit, "linen", 0.5),
    ("expert_2_x_fsdp_4", base._factory, "nnx", 0.5),
    ("expert_4_x_fsdp_2", base._factory, "linen", None),
]


@pytest.mark.parametrize(
    ("strategy", "path", "kind", "capacity_factor"),
    CELLS,
    ids=base.cell_ids(CELLS),
)
def test_the_moe_decoder_follows_one_device_at_every_expert_degree(
    strategy, path, kind, capacity_factor
):
    base.assert_follows_one_device(STRATEGIES[strategy](), path, kind, capacity_factor)


def _state_and_step(strategy):
    x, y = base._data()
    with strategy.scope():
        state = training.create_train_state(base.Decoder(0.5), optax.adam(1e-2), x[:1], rng=0)
        step = training.make_train_step(base._loss())
    return state, step, distribute_batch(strategy, (x[:16], y[:16]))


def _compiled_text(strategy):
    state, step, batch = _state_and_step(strategy)
    return step.lower(state, batch).compile().as_text(), state


@pytest.mark.parametrize("degree", [2, 4])
def test_the_step_sends_tokens_over_the_expert_axis_only_and_holds_its_experts(degree):
    strategy = FSDP(experts=degree, min_shard_size=NEVER)
    text, state = _compiled_text(strategy)
    counts = hlo.collective_counts(text, strategy.mesh)
    all_to_all = {k: v for k, v in counts.items() if k.startswith("all-to-all")}
    # Forward: there and back; backward: their transposes.
    assert set(all_to_all) == {"all-to-all[expert]"}, counts
    assert all_to_all["all-to-all[expert]"] >= 4
    # Each device holds 1/k of each expert weight and of its Adam moments ...
    experts, hidden = base.EXPERTS, 12
    full = (experts, base.DIM, hidden)
    local = (experts // degree, base.DIM, hidden)
    moe = state.params["MoE_0"]
    adam = state.opt_state[0]
    for leaf in (moe["wi_0"], moe["wi_1"], adam.mu["MoE_0"]["wi_0"], adam.nu["MoE_0"]["wo"]):
        assert {s.data.shape[0] for s in leaf.addressable_shards} == {experts // degree}
    # ... and computes only those: no array the size of all the experts' weights exists
    # in the program, where the dense (degree 1) program has them.
    shape = lambda dims: "f32[" + ",".join(map(str, dims)) + "]"  # noqa: E731
    assert shape(local) in text and shape(full) not in text
    dense_text, _ = _compiled_text(jstrategy.MirroredStrategy())
    assert shape(full) in dense_text
    assert "all-to-all" not in dense_text


def test_degree_one_is_the_dense_program():
    one, _ = _compiled_text(FSDP(experts=1, min_shard_size=NEVER))
    assert "all-to-all" not in one
    assert FSDP(experts=1).mesh.axis_names == ("replica",)


def test_checkpoints_move_between_expert_degrees_and_to_one_device(tmp_path):
    x, y = base._data()

    def model_under(strategy):
        with strategy.scope():
            model = jstrategy.Model(base.Decoder(0.5), (base.TOKENS,), input_dtype=jnp.int32)
            model.compile(optax.adam(1e-2), loss=base._loss())
        return model

    trained = model_under(FSDP(experts=2, min_shard_size=0))
    trained.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "moe.weights.h5"
    trained.save_weights(path)
    want = np.asarray(trained.predict(x, verbose=0))
    for strategy in (FSDP(experts=4, min_shard_size=NEVER), jstrategy.OneDeviceStrategy("cpu:0")):
        model = model_under(strategy)
        model.load_weights(path)
        np.testing.assert_allclose(np.asarray(model.predict(x, verbose=0)), want, atol=1e-6)
        for a, b in zip(model.get_weights(), trained.get_weights(), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_expert_degrees_are_refused_with_the_fix():
    with pytest.raises(
        ValueError, match=r"`experts` must divide the number of devices, 8.*experts=2"
    ):
        FSDP(experts=3)
    with pytest.raises(ValueError, match=r"`experts` must be a positive int"):
        FSDP(experts=0)
    with pytest.raises(ValueError, match=r"`experts`=2 and `context`=2 cannot be combined"):
        FSDP(experts=2, context=2)
    # A degree that does not divide a layer's experts: refused when the step is traced,
    # before it runs, naming both arguments and the divisors.
    strategy = FSDP(experts=8, min_shard_size=NEVER)
    with strategy.scope():
        small = jstrategy.Model(
            jstrategy.experimental.NNXMoE(4, num_experts=4, top_k=2, hidden_dim=4, rngs=nnx.Rngs(0))
        )
        small.compile(optax.sgd(0.1), loss="mse")
    features = np.ones((16, 3, 4), np.float32)
    with pytest.raises(
        ValueError,
        match=r"expert degree \(`experts`=8\) must divide the layer's `num_experts` \(4\)",
    ):
        small.fit(features, features, batch_size=16, epochs=1, verbose=0)


def test_the_drops_at_an_expert_degree_are_one_devices():
    x, _ = base._data()
    x = x[:38]  # not a multiple of the degree: the layer pads its rows, which change nothing
    variables = base.Decoder(0.5).init(jax.random.key(0), x[:1])

    def intermediates(variables, x):
        return base.Decoder(0.5).apply(variables, x, mutable=["intermediates"])[1]

    want = moe_dropped_fraction(intermediates(variables, x))
    strategy = FSDP(experts=4, min_shard_size=NEVER)
    with strategy.mesh_context():
        got = moe_dropped_fraction(jax.jit(intermediates)(variables, x))
        y = jax.jit(base.Decoder(0.5).apply)(variables, x)
        compiled = jax.jit(base.Decoder(0.5).apply).lower(variables, x).compile().as_text()
    assert "all-to-all" in compiled  # the expert-parallel path ran
    assert 0 < got == want
    np.testing.assert_allclose(y, base.Decoder(0.5).apply(variables, x), rtol=1e-5, atol=1e-6)


def test_an_nnx_layer_made_outside_the_scope_is_split_over_the_expert_axis():
    module = base.NNXDecoder(0.5, nnx.Rngs(0))
    with FSDP(experts=4, min_shard_size=NEVER).scope():
        state = training.create_nnx_train_state(module, optax.adam(1e-2))
    for name in ("wi_0", "wi_1", "wo"):
        weight = state.params["moe"][name][...]
        assert weight.shape[0] == base.EXPERTS
        assert {s.data.shape[0] for s in weight.addressable_shards} == {base.EXPERTS // 4}
