"""Precision policies, casts and dynamic loss scaling (`jstrategy.mixed_precision`)."""

import pickle
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import mixed_precision as mp

F16_MAX = float(jnp.finfo(jnp.float16).max)  # 65504


@pytest.fixture(autouse=True)
def _restore_global_policy():
    yield
    mp.set_global_policy(None)


# ---------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "variable", "compute"),
    [
        ("float32", "float32", "float32"),
        ("mixed_bfloat16", "float32", "bfloat16"),
        ("mixed_float16", "float32", "float16"),
        ("bfloat16", "bfloat16", "bfloat16"),
        ("float16", "float16", "float16"),
    ],
)
def test_policy_dtypes_are_keras(name, variable, compute):
    policy = mp.Policy(name)
    assert (policy.name, policy.variable_dtype, policy.compute_dtype) == (name, variable, compute)
    assert repr(policy) == f'<Policy "{name}">'
    assert policy == mp.Policy(name) and hash(policy) == hash(mp.Policy(name))
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_policy_rejects_unknown_names_listing_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"`name` must be one of \['bfloat16', 'float16'.*'mixed_bfloat16'.*got 'mixed_bf16'",
    ):
        mp.Policy("mixed_bf16")
    with pytest.raises(
        ValueError, match="`policy` must be a jstrategy.mixed_precision.Policy or one of"
    ):
        mp.set_global_policy("float64")
    with pytest.raises(TypeError, match=r"`policy` must be .* or None; got .*float32"):
        mp.set_global_policy(jnp.dtype("float32"))


def test_global_policy_accepts_policies_names_and_none():
    assert mp.global_policy() == mp.Policy("float32")
    mp.set_global_policy("mixed_bfloat16")
    assert mp.global_policy().compute_dtype == "bfloat16"
    mp.set_global_policy(mp.Policy("mixed_float16"))
    assert mp.global_policy().name == "mixed_float16"
    # The global policy is what the casts use when given none.
    assert mp.cast_to_compute(jnp.ones(2)).dtype == jnp.float16
    mp.set_global_policy(None)
    assert mp.global_policy().name == "float32"


def test_global_policy_is_process_wide_and_thread_safe():
    names = ["mixed_bfloat16", "mixed_float16", "bfloat16", "float32"]
    seen, errors = [], []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            barrier.wait()
            for _ in range(200):
                mp.set_global_policy(names[i % len(names)])
                seen.append(mp.global_policy().name)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and set(seen) <= set(names)
    # Set in one thread, seen in another (TF's process-wide setting, not Keras 3's per thread).
    mp.set_global_policy("mixed_bfloat16")
    other = []
    t = threading.Thread(target=lambda: other.append(mp.global_policy()))
    t.start()
    t.join()
    assert other == [mp.Policy("mixed_bfloat16")]


# ---------------------------------------------------------------------------------------
# Casts
# ---------------------------------------------------------------------------------------
def test_casts_touch_only_floating_leaves():
    key = jax.random.key(0)
    tree = {
        "w": jnp.ones((2, 2)),
        "np": np.ones(3, np.float64),
        "ids": jnp.arange(3),
        "mask": jnp.array([True, False]),
        "key": key,
        "raw_key": jax.random.PRNGKey(0),
        "scalar": 0.5,
    }
    out = mp.cast_to_compute(tree, "mixed_bfloat16")
    assert out["w"].dtype == jnp.bfloat16 and isinstance(out["w"], jax.Array)
    assert out["np"].dtype == jnp.bfloat16 and isinstance(out["np"], np.ndarray)
    for name in ("ids", "mask", "key", "raw_key", "scalar"):
        assert out[name] is tree[name], name
    back = mp.cast_to_float32(out)
    assert back["w"].dtype == jnp.float32 and back["np"].dtype == np.float32
    assert back["ids"] is tree["ids"] and back["key"] is key
    # Already in the dtype: returned as is (no copy, no op in a traced program).
    assert mp.cast_to_compute(tree, "float32")["w"] is tree["w"]
    assert mp.cast_to_variable({"w": jnp.ones(2)}, "bfloat16")["w"].dtype == jnp.bfloat16
    abstract = mp.cast_to_compute(jax.ShapeDtypeStruct((2,), jnp.float32), "mixed_float16")
    assert abstract == jax.ShapeDtypeStruct((2,), jnp.float16)


@pytest.mark.slow
def test_module_computes_in_compute_dtype_and_gradients_stay_float32():
    """The policy's recipe on an unmodified Flax module: bf16 compute, f32 gradients."""
    model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.relu, nn.Dense(3)])
    x = jnp.linspace(-1, 1, 20).reshape(5, 4)
    params = model.init(jax.random.key(0), x)["params"]
    policy = mp.Policy("mixed_bfloat16")
    seen = {}

    def loss(p):
        logits = model.apply(
            {"params": mp.cast_to_compute(p, policy)}, mp.cast_to_compute(x, policy)
        )
        seen["logits"] = logits.dtype
        logits = mp.cast_to_float32(logits)
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(5) % 3).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert seen["logits"] == jnp.bfloat16 and value.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    exact = jax.grad(
        lambda p: optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": p}, x), jnp.arange(5) % 3
        ).mean()
    )(params)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(exact), strict=True):
        np.testing.assert_allclose(g, e, atol=3e-2, rtol=3e-2)  # bfloat16's 8 bits


# ---------------------------------------------------------------------------------------
# Dynamic loss scale
# ---------------------------------------------------------------------------------------
def test_loss_scale_defaults_are_keras():
    ls = mp.DynamicLossScale.create()
    assert float(ls.loss_scale) == 2.0**15 and int(ls.counter) == 0
    assert ls.dynamic_growth_steps == 2000 and ls.min_loss_scale == 1.0
    assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32


def test_default_growth_doubles_after_exactly_2000_finite_steps():
    adjust = jax.jit(
        lambda ls, n: jax.lax.fori_loop(0, n, lambda _, s: s.adjust(jnp.bool_(True)), ls)
    )
    ls = mp.DynamicLossScale.create()
    before = adjust(ls, 1999)
    assert float(before.loss_scale) == 2.0**15 and int(before.counter) == 1999
    after = adjust(ls, 2000)
    assert float(after.loss_scale) == 2.0**16 and int(after.counter) == 0


def test_growth_interval_is_configurable_and_overflow_resets_the_count():
    ls = mp.DynamicLossScale.create(initial_scale=8.0, dynamic_growth_steps=3)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    trace = []
    for finite in [True, True, False, True, True, True, True]:
        ls = adjust(ls, jnp.bool_(finite))
        trace.append((float(ls.loss_scale), int(ls.counter)))
    assert trace == [(8, 1), (8, 2), (4, 0), (4, 1), (4, 2), (8, 0), (8, 1)]


def test_scale_has_a_floor_and_never_grows_to_inf():
    ls = mp.DynamicLossScale.create(initial_scale=4.0, min_loss_scale=2.0)
    for _ in range(3):
        ls = ls.adjust(jnp.bool_(False))
    assert float(ls.loss_scale) == 2.0
    big = mp.DynamicLossScale.create(initial_scale=2.0**127, dynamic_growth_steps=1)
    assert float(big.adjust(jnp.bool_(True)).loss_scale) == 2.0**127


def test_scale_unscale_and_all_finite():
    ls = mp.DynamicLossScale.create(initial_scale=4.0)
    assert ls.scale(jnp.float32(1.5)) == 6.0
    assert ls.scale(jnp.ones(2, jnp.float16)).dtype == jnp.float16
    grads = {"w": jnp.full(2, 8.0, jnp.float16), "step": jnp.int32(3)}
    out = ls.unscale(grads)
    assert out["w"].dtype == jnp.float16 and out["w"].tolist() == [2.0, 2.0]
    assert out["step"] is grads["step"]
    assert bool(ls.all_finite(grads)) and bool(mp.all_finite({}))
    assert not bool(mp.all_finite({"a": jnp.ones(2), "b": jnp.array([0.0, jnp.nan])}))
    assert not bool(mp.all_finite([jnp.array([-jnp.inf], jnp.bfloat16)]))


def test_loss_scale_is_a_pytree_that_keeps_its_settings_and_checkpoints(tmp_path):
    ls = mp.DynamicLossScale.create(initial_scale=64.0, dynamic_growth_steps=7, min_loss_scale=4.0)
    assert len(jax.tree.leaves(ls)) == 2  # the settings are static
    through = jax.jit(lambda s: s)(ls)
    assert (through.dynamic_growth_steps, through.min_loss_scale) == (7, 4.0)
    state = {"loss_scale": ls.adjust(jnp.bool_(True))}
    jstrategy.save_weights(tmp_path / "w", state)
    target = {"loss_scale": mp.DynamicLossScale.create(dynamic_growth_steps=7, min_loss_scale=4.0)}
    restored = jstrategy.load_weights(tmp_path / "w", target=target)["loss_scale"]
    assert isinstance(restored, mp.DynamicLossScale)
    assert (float(restored.loss_scale), int(restored.counter)) == (64.0, 1)
    assert restored.dynamic_growth_steps == 7


def test_loss_scale_settings_are_validated():
    with pytest.raises(ValueError, match="`initial_scale` must be a positive finite number; got 0"):
        mp.DynamicLossScale.create(initial_scale=0)
    with pytest.raises(ValueError, match="`dynamic_growth_steps` must be a positive int; got 0"):
        mp.DynamicLossScale.create(dynamic_growth_steps=0)
    with pytest.raises(ValueError, match="`min_loss_scale` must be a positive number; got -1"):
        mp.DynamicLossScale.create(min_loss_scale=-1)


def test_select_if_finite_checks_its_arguments():
    with pytest.raises(ValueError, match="same pytree structure"):
        mp.select_if_finite(jnp.bool_(True), {"a": jnp.ones(1)}, {"b": jnp.ones(1)})
    with pytest.raises(ValueError, match="`finite` must be a boolean scalar"):
        mp.select_if_finite(jnp.ones(2, bool), {"a": jnp.ones(1)}, {"a": jnp.ones(1)})


def _float16_step(tx):
    """One mixed_float16 step: loss scaled, update applied only when finite, scale adjusted."""
    policy = mp.Policy("mixed_float16")

    @jax.jit
    def step(params, opt_state, ls, x):
        def loss_fn(p):
            p16, x16 = mp.cast_to_compute((p, x), policy)
            return ls.scale(mp.cast_to_float32(jnp.sum(p16["w"] * x16)))

        grads = ls.unscale(jax.grad(loss_fn)(params))
        finite = ls.all_finite(grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt)
        params, opt_state = mp.select_if_finite(finite, new, (params, opt_state))
        return params, opt_state, ls.adjust(finite), finite

    return step


def test_float16_overflow_skips_the_update_and_halves_the_scale():
    # d(scale * sum(w * x))/dw = scale * x in float16: 4 * 2**15 and 4 * 2**14 overflow
    # (> 65504), 4 * 2**13 does not.
    tx = optax.sgd(0.5, momentum=0.9)  # momentum: a skipped step must leave it untouched
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    ls = mp.DynamicLossScale.create()
    x = jnp.full(3, 4.0)
    step = _float16_step(tx)
    history = []
    for _ in range(3):
        params, opt_state, ls, finite = step(params, opt_state, ls, x)
        history.append((bool(finite), float(ls.loss_scale), params["w"].tolist()))
    assert history[0] == (False, 2.0**14, [1.0, 1.0, 1.0])
    assert history[1] == (False, 2.0**13, [1.0, 1.0, 1.0])
    # The first finite step: the true gradient (x, unscaled), as if the skips never happened.
    assert history[2] == (True, 2.0**13, [1.0 - 0.5 * 4.0] * 3)
    assert int(ls.counter) == 1
    assert jax.tree.leaves(opt_state)[0].tolist() == [4.0, 4.0, 4.0]  # momentum: one step


def test_every_replica_takes_the_same_decision():
    """One replica's local overflow makes all 8 replicas skip and halve, in one step."""
    devices = jax.devices()[:8]
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    ls = mp.DynamicLossScale.create()
    policy = mp.Policy("mixed_float16")
    # Replica 3's data overflows float16 at the initial scale; the others' does not.
    x = np.ones((8, 3), np.float32)
    x[3] = 4.0

    def replica(params, ls, x):
        def loss_fn(p):
            p16, x16 = mp.cast_to_compute((p, x), policy)
            return ls.scale(mp.cast_to_float32(jnp.sum(p16["w"] * x16)))

        p = jax.tree.map(lambda v: jax.lax.pcast(v, "replica", to="varying"), params)
        local = ls.unscale(jax.grad(loss_fn)(p))
        summed = jax.lax.psum(local, "replica")  # what the step body all-reduces
        finite = ls.all_finite(summed)
        new = jax.tree.map(lambda w, g: w - 0.1 * g, params, summed)
        params = mp.select_if_finite(finite, new, params)
        flags = jnp.stack([finite, ls.all_finite(local), ls.all_finite(local, axis_name="replica")])
        return params["w"][None], ls.adjust(finite).loss_scale[None], flags[None]

    run = jax.jit(
        jax.shard_map(
            replica,
            mesh=mesh,
            in_specs=(P(), P(), P("replica")),
            out_specs=(P("replica"), P("replica"), P("replica")),
        )
    )
    w, scales, flags = run({"w": jnp.ones(3)}, ls, x)
    flags = np.asarray(flags)
    assert flags[:, 0].tolist() == [False] * 8  # the decision on all-reduced gradients
    assert flags[:, 2].tolist() == [False] * 8  # local gradients, flags combined over replicas
    # Local flags alone would disagree: the property is not vacuous.
    assert flags[:, 1].tolist() == [True, True, True, False, True, True, True, True]
    assert np.asarray(scales).tolist() == [2.0**14] * 8
    np.testing.assert_array_equal(np.asarray(w), np.ones((8, 3)))
    # With replica 3's data tamed, every replica applies the same update.
    w, scales, flags = run({"w": jnp.ones(3)}, ls, np.ones((8, 3), np.float32))
    assert np.asarray(flags)[:, 0].all() and np.asarray(scales).tolist() == [2.0**15] * 8
    np.testing.assert_allclose(np.asarray(w), np.full((8, 3), 1.0 - 0.1 * 8))
