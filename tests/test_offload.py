"""Optimizer state (and parameters) in host memory under the sharded strategies (issue 37
item 2): `OffloadPolicy`, ``offload_optimizer=True``.

Each chosen leaf keeps its layout in pinned host memory between steps; the compiled step
moves it to device memory and back. Fake CPU devices have the memory kinds, so the tests
read them from the live arrays and from the compiled step's shardings, measure the step's
peak in device memory (`hlo.device_memory_peak`: the memory analysis without what the
compiled entry layout keeps in host memory), and hold the trajectory to the step without
offloading.
"""

import inspect
import pathlib

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy import losses
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.hlo import device_memory_peak
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.names import path_names

OffloadPolicy = jstrategy.experimental.OffloadPolicy
HOST = "pinned_host"
FEATURES = 16


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(8)(nn.relu(nn.Dense(64)(x)))


def _fsdp(**kwargs):
    return jstrategy.experimental.FSDPStrategy(min_shard_size=0, **kwargs)


def _model_parallel(**kwargs):
    layout_map = jstrategy.experimental.LayoutMap(
        jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    )
    layout_map["Dense_0/kernel"] = (None, "model")
    layout_map["Dense_1/kernel"] = ("model", None)
    return jstrategy.experimental.ModelParallelStrategy(layout_map, **kwargs)


def _hybrid(**kwargs):
    return jstrategy.experimental.HybridStrategy(
        replicas=2, fsdp=2, tensor=2, min_shard_size=0, **kwargs
    )


def _leaves(tree):
    return {path_names(k): leaf for k, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _kinds(state):
    """Each array leaf's memory kind, by path."""
    return {
        path: leaf.sharding.memory_kind
        for path, leaf in _leaves(state).items()
        if isinstance(leaf, jax.Array)
    }


def _expected_kind(path, leaf, *, optimizer=True, params=False):
    chosen = (optimizer and path[0] == "opt_state") or (params and path[0] == "params")
    return HOST if chosen and leaf.ndim else "device"


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


# The policy and its checks -------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"offload_optimizer": "yes"}, ValueError, r"`offload_optimizer` must be a bool"),
        ({"offload": True}, TypeError, r"`offload` must be a jstrategy.experimental.Offload"),
        (
            {"offload_optimizer": True, "offload": OffloadPolicy()},
            ValueError,
            r"offload_optimizer=True` or `offload=OffloadPolicy.*not both",
        ),
    ],
)
@pytest.mark.parametrize("make", [_fsdp, _model_parallel], ids=["fsdp", "model_parallel"])
def test_bad_offload_arguments_are_refused_with_the_fix(make, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        make(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"optimizer": False}, ValueError, r"must offload something.*Pass optimizer=True"),
        ({"params": 1}, ValueError, r"`params` must be a bool; got 1"),
        ({"where": "kernel"}, TypeError, r"`where` must be a function of a leaf's path"),
    ],
)
def test_bad_policies_are_refused_with_the_fix(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        OffloadPolicy(**kwargs)


def test_policy_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        OffloadPolicy(True)  # type: ignore[misc]


@pytest.mark.parametrize("make", [_fsdp, _model_parallel], ids=["fsdp", "model_parallel"])
@pytest.mark.parametrize(
    ("offload", "optimizer", "params"),
    [
        ({"offload_optimizer": True}, True, False),
        ({"offload": OffloadPolicy(params=True)}, True, True),
        ({"offload": OffloadPolicy(optimizer=False, params=True)}, False, True),
        ({}, False, False),
    ],
    ids=["offload_optimizer", "optimizer_and_params", "params", "none"],
)
def test_the_policy_chooses_each_leafs_memory_kind_not_its_layout(make, offload, optimizer, params):
    strategy, plain = make(**offload), make()
    with strategy.scope():
        state = training.create_train_state(MLP(), optax.adam(1e-3), jnp.ones((1, FEATURES)))
    for path, leaf in _leaves(state).items():
        want = _expected_kind(path, leaf, optimizer=optimizer, params=params)
        assert leaf.sharding.memory_kind == want, path
        assert strategy.variable_sharding(leaf, path).memory_kind == want, path
        # The layout is the strategy's without offloading.
        layout = plain.variable_sharding(leaf, path)
        assert leaf.sharding.with_memory_kind("device") == layout.with_memory_kind("device")
    assert HOST in _kinds(state).values() or not (optimizer or params)


def test_where_restricts_the_offloaded_leaves_by_path():
    strategy = _fsdp(offload=OffloadPolicy(where=lambda path: path[-1] == "kernel"))
    with strategy.scope():
        state = training.create_train_state(MLP(), optax.adam(1e-3), jnp.ones((1, FEATURES)))
    kinds = _kinds(state)
    host = {p for p, k in kinds.items() if k == HOST}
    # Adam's mu and nu of the three kernels; the biases' moments stay in device memory.
    assert len(host) == 6
    assert all(p[0] == "opt_state" and p[-1] == "kernel" for p in host)
    biases = [p for p in kinds if p[0] == "opt_state" and p[-1] == "bias"]
    assert len(biases) == 6 and all(kinds[p] == "device" for p in biases)


# The compiled step: memory kinds and its peak in device memory ---------------------------
def _compiled_step(strategy, batch_rows=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_rows, FEATURES)).astype(np.float32)
    y = rng.integers(0, 8, size=batch_rows).astype(np.int32)
    with strategy.scope():
        state = training.create_train_state(MLP(), optax.adam(1e-3), jnp.ones((1, FEATURES)))
        step = training.make_train_step(_loss)
    compiled = step.lower(state, distribute_batch(strategy, (x, y))).compile()
    return state, compiled


def _moments_per_device(state):
    """The bytes of Adam's mu and nu on one device (the most on any device)."""
    per_device: dict[int, int] = {}
    for path, leaf in _leaves(state.opt_state).items():
        if leaf.ndim and path[-3] in ("mu", "nu"):
            for shard in leaf.addressable_shards:
                per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return max(per_device.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "make", [_fsdp, _model_parallel, _hybrid], ids=["fsdp", "model_parallel", "hybrid"]
)
def test_the_compiled_steps_device_memory_falls_by_adams_moments(make):
    plain_state, plain = _compiled_step(make())
    state, offloaded = _compiled_step(make(offload_optimizer=True))
    # The compiled program takes and returns the moments in host memory.
    flat_in = jax.tree.leaves(offloaded.input_shardings[0][0])
    flat_state = jax.tree.leaves(state)
    assert len(flat_in) == len(flat_state)
    for sharding, leaf in zip(flat_in, flat_state, strict=True):
        assert sharding.memory_kind == leaf.sharding.memory_kind
    out_kinds = [s.memory_kind for s in jax.tree.leaves(offloaded.output_shardings[0])]
    assert out_kinds.count(HOST) == list(_kinds(state).values()).count(HOST) == 12
    # XLA's own layout says host memory (S(5)) for those arguments and outputs.
    assert "S(5)" in offloaded.as_text().split("\n", 1)[0]
    assert "S(5)" not in plain.as_text().split("\n", 1)[0]

    moments = _moments_per_device(state)
    fall = device_memory_peak(plain) - device_memory_peak(offloaded)
    # The state in device memory falls by the moments' share: mu and nu, per device (the
    # scalars, a few bytes, stay; nothing else moves).
    assert moments > 0
    assert fall == moments, (fall, moments)
    # Nothing but the offloaded arguments changed: the same program otherwise.
    assert (
        plain.memory_analysis().temp_size_in_bytes == offloaded.memory_analysis().temp_size_in_bytes
    )
    assert moments == _moments_per_device(plain_state)


# The trajectory: the same numbers as without offloading ----------------------------------
def _fit(strategy, *, steps_per_execution=1, epochs=2, dtype_policy=None, **compile_kwargs):
    with strategy.scope():
        model = jstrategy.Model(MLP(), input_shape=(FEATURES,), seed=0, dtype_policy=dtype_policy)
        model.compile(
            optax.adam(0.01),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
            **compile_kwargs,
        )
    x, y = helpers.classification_data(64, FEATURES)
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


def _assert_same(a, b, tol=1e-6):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "offload", "steps_per_execution"),
    [
        (_fsdp, {"offload_optimizer": True}, 1),
        # A scan of 4 steps: the state goes back to host memory after each.
        (_fsdp, {"offload": OffloadPolicy(params=True)}, 4),
        (_model_parallel, {"offload_optimizer": True}, 1),
        (_hybrid, {"offload_optimizer": True}, 1),
    ],
    ids=[
        "fsdp-optimizer",
        "fsdp-optimizer-and-params-spe4",
        "model_parallel-optimizer",
        "hybrid-optimizer",
    ],
)
def test_fit_follows_the_step_without_offloading(make, offload, steps_per_execution):
    reference, reference_losses = _fit(make(), steps_per_execution=steps_per_execution)
    model, got_losses = _fit(make(**offload), steps_per_execution=steps_per_execution)
    _assert_same(got_losses, reference_losses)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        _assert_same(a, b)
    # Between steps the chosen leaves are in host memory, the others in device memory.
    policy = model.strategy.offload
    for path, leaf in _leaves(model.state).items():
        if isinstance(leaf, jax.Array):
            want = _expected_kind(path, leaf, optimizer=policy.optimizer, params=policy.params)
            assert leaf.sharding.memory_kind == want, path
    # Evaluation and prediction read the parameters wherever they live.
    x, y = helpers.classification_data(40, FEATURES, seed=1)
    _assert_same(model.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0))
    _assert_same(model.predict(x, verbose=0), reference.predict(x, verbose=0))


@pytest.mark.slow
def test_accumulation_and_loss_scaling_follow_the_step_without_offloading():
    # The step's own fields (gradient sums, the loss scale) stay in device memory; the
    # update they gate moves the offloaded leaves in and out all the same.
    options = {"dtype_policy": "mixed_float16", "gradient_accumulation_steps": 2}
    reference, reference_losses = _fit(_fsdp(), **options)
    model, got_losses = _fit(_fsdp(offload=OffloadPolicy(params=True)), **options)
    _assert_same(got_losses, reference_losses)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        _assert_same(a, b)
    kinds = _kinds(model.state)
    assert {kinds[p] for p in kinds if p[0] in ("grad_accumulator", "loss_scale")} == {"device"}
    assert {kinds[p] for p in kinds if p[0] == "params"} == {HOST}


@pytest.mark.slow
def test_the_train_step_factory_follows_the_step_without_offloading():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, FEATURES)).astype(np.float32)
    y = rng.integers(0, 8, size=32).astype(np.int32)
    results = []
    for strategy in (_fsdp(), _fsdp(offload=OffloadPolicy(params=True))):
        with strategy.scope():
            state = training.create_train_state(MLP(), optax.adamw(0.01), jnp.ones((1, FEATURES)))
            step = training.make_train_step(_loss)
        batch = distribute_batch(strategy, (x, y))
        losses_ = []
        for _ in range(3):
            state, metrics = step(state, batch)
            dispatch.track(metrics)
            losses_.append(float(metrics["loss"]))
        results.append((state, losses_))
    (plain, plain_losses), (offloaded, offloaded_losses) = results
    _assert_same(offloaded_losses, plain_losses)
    for (path, a), b in zip(_leaves(offloaded).items(), _leaves(plain).values(), strict=True):
        if isinstance(a, jax.Array) and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            _assert_same(np.asarray(a), np.asarray(b))
            assert a.sharding.memory_kind == _expected_kind(path, a, params=True), path


# Checkpoints: saved from host memory, restored into either ----------------------------------
@pytest.mark.slow
def test_checkpoints_round_trip_between_offloaded_and_plain_strategies(tmp_path):
    model, _ = _fit(_fsdp(offload_optimizer=True), epochs=1)
    saved = {
        path: np.asarray(leaf)
        for path, leaf in _leaves(model.state).items()
        if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    }
    with jstrategy.CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        assert manager.save(1, model.state)
    for target in (
        _fsdp(offload=OffloadPolicy(params=True)),
        _fsdp(),
        _model_parallel(offload_optimizer=True),
    ):
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.state)
        with jstrategy.CheckpointManager(tmp_path / "ckpt") as manager:
            restored = manager.restore(target=like, strategy=target)
        for path, leaf in _leaves(restored).items():
            if path in saved:
                np.testing.assert_array_equal(np.asarray(leaf), saved[path], err_msg=str(path))
            want = target.variable_sharding(leaf, path)
            assert leaf.sharding.memory_kind == want.memory_kind, path
            assert leaf.sharding.with_memory_kind("device") == want.with_memory_kind("device")
        assert (HOST in _kinds(restored).values()) == (target.offload is not None)
    # A saved model loads into an offloaded strategy and trains on as the saved run does.
    model.save(tmp_path / "model")
    continued = _fit_on(model)
    strategy = _fsdp(offload_optimizer=True)
    with strategy.scope():
        loaded = jstrategy.models.load_model(
            tmp_path / "model", MLP(), custom_objects={"optimizer": optax.adam(0.01)}
        )
    assert {k for k in _kinds(loaded.state).values()} == {"device", HOST}
    for a, b in zip(_fit_on(loaded), continued, strict=True):
        _assert_same(a, b)


def _fit_on(model):
    x, y = helpers.classification_data(64, FEATURES)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def test_offloading_is_shown_by_the_strategy():
    assert _fsdp().offload is None and "offload" not in repr(_fsdp())
    assert _fsdp(offload_optimizer=True).offload == OffloadPolicy()
    assert repr(_fsdp(offload_optimizer=True)).endswith(
        "offload=OffloadPolicy(optimizer=True, params=False, where=None), min_shard_size=0)"
    )
    policy = OffloadPolicy(params=True)
    assert _model_parallel(offload=policy).offload is policy
    assert repr(_model_parallel(offload=policy)).endswith(f"offload={policy!r})")


def test_every_strategy_that_offloads_is_named_where_offloading_is_documented():
    # Issue 50 item 7: the policy's docstring and the guide's section named FSDP and
    # ModelParallel only, though HybridStrategy takes `offload=` too.
    offloading = {
        name
        for name in jstrategy.experimental.__all__
        if isinstance(cls := getattr(jstrategy.experimental, name), type)
        and issubclass(cls, jstrategy.Strategy)
        and "offload" in inspect.signature(cls).parameters
    }
    assert {"FSDPStrategy", "ModelParallelStrategy", "HybridStrategy"} <= offloading
    guide = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "large-models.md"
    section = guide.read_text(encoding="utf-8").split("## Optimizer state in host memory")[1]
    section = section.split("\n## ")[0]
    for name in sorted(offloading):
        assert name in OffloadPolicy.__doc__, name
        assert name in section, name


def test_a_device_without_the_memory_kind_is_refused_with_the_fix():
    from jstrategy._src.placement import check_memory_kind

    device = jax.devices()[0]
    check_memory_kind(device, HOST, keeper="OffloadPolicy()", fix="")  # CPU devices have it
    with pytest.raises(
        ValueError,
        match=r"OffloadPolicy\(\) keeps variables in 'hbm' memory, but cpu:0 has only \[.*'pinned_host'.*\]\. Train",
    ):
        check_memory_kind(device, "hbm", keeper="OffloadPolicy()", fix="Train without it.")
