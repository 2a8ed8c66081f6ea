"""`ParallelStrategy`: one spec of degrees (issue 47), the axes that did not combine before.

Expert x tensor and expert x fsdp x tensor (the MoE decoder of test_moe), context x tensor
and context x fsdp x tensor (the ring-attention decoder of test_context_parallel) each
follow OneDeviceStrategy within 1e-5 through fit and the train-step factory; the step's
all-to-alls stay on the expert axis and each device holds its experts' share of the tensor
split; checkpoints move to and from other strategies; `HybridStrategy` is the preset with
no expert or context axis; bad degrees are refused naming the argument and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_context_parallel as cp
import test_moe as moe
import test_pipeline as pl
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import training
from jstrategy._src import hlo
from jstrategy._src.context_parallel import axis as context_axis
from jstrategy._src.input.placement import distribute_batch

Parallel = jstrategy.experimental.ParallelStrategy


def _megatron(strategy_axes=("replica", "fsdp", "tensor")):
    """Attention heads and the MLP's hidden units of the context decoder over "tensor"."""
    mesh = jstrategy.experimental.DeviceMesh((1, 1, 8), strategy_axes)
    layout = jstrategy.experimental.LayoutMap(mesh)
    for name in ("query", "key", "value"):
        layout[f".*{name}/kernel"] = (None, "tensor", None)
    layout[".*out/kernel"] = ("tensor", None, None)
    layout[".*Dense_0/kernel"] = (None, "tensor")
    layout[".*Dense_1/kernel"] = ("tensor", None)
    return layout


MOE = {
    "expert_2_x_tensor_2": lambda: Parallel(replicas=2, experts=2, tensor=2, min_shard_size=0),
    "fsdp_2_x_expert_2_x_tensor_2": lambda: Parallel(fsdp=2, experts=2, tensor=2, min_shard_size=0),
}
MOE_CELLS = [
    ("expert_2_x_tensor_2", moe._fit, "linen", 0.5),
    ("expert_2_x_tensor_2", moe._factory, "nnx", 0.5),
    ("fsdp_2_x_expert_2_x_tensor_2", moe._factory, "linen", 0.5),
    ("fsdp_2_x_expert_2_x_tensor_2", moe._fit, "linen", None),
]


@pytest.mark.parametrize(
    ("strategy", "path", "kind", "capacity_factor"),
    MOE_CELLS,
    ids=moe.cell_ids(MOE_CELLS),
)
def test_the_moe_decoder_follows_one_device_with_experts_and_tensor(
    strategy, path, kind, capacity_factor
):
    moe.assert_follows_one_device(MOE[strategy](), path, kind, capacity_factor)


def test_expert_x_tensor_splits_each_expert_and_sends_tokens_over_the_expert_axis_only():
    strategy = Parallel(replicas=2, experts=2, tensor=2, min_shard_size=0)
    x, y = moe._data()
    with strategy.scope():
        state = training.create_train_state(moe.Decoder(0.5), optax.adam(1e-2), x[:1], rng=0)
        step = training.make_train_step(moe._loss())
    text = step.lower(state, distribute_batch(strategy, (x[:16], y[:16]))).compile().as_text()
    counts = hlo.collective_counts(text, strategy.mesh)
    assert {k for k in counts if k.startswith("all-to-all")} == {"all-to-all[expert]"}, counts
    # Each device holds its experts, and of each its half of the hidden units, for the
    # weights and their Adam moments alike.
    params, adam = state.params["MoE_0"], state.opt_state[0]
    local = (moe.EXPERTS // 2, moe.DIM, 12 // 2)
    for leaf in (params["wi_0"], adam.mu["MoE_0"]["wi_1"]):
        assert leaf.sharding.spec == P("expert", None, "tensor")
        assert {s.data.shape for s in leaf.addressable_shards} == {local}
    assert params["wo"].sharding.spec == P("expert", "tensor", None)


CONTEXT = {
    "context_2_x_tensor_2": lambda: Parallel(
        replicas=2, context=2, tensor=2, layout_map=_megatron(), min_shard_size=0
    ),
    "fsdp_2_x_context_2_x_tensor_2": lambda: Parallel(
        fsdp=2, context=2, tensor=2, layout_map=_megatron(), min_shard_size=0
    ),
}


@pytest.mark.parametrize("name", list(CONTEXT))
def test_ring_attention_follows_one_device_with_tensor_and_fsdp(name):
    strategy = CONTEXT[name]()
    assert strategy.context_parallelism == 2
    x, y = cp._data(4, 32)
    cp._assert_follows(strategy, True, x, y)


def test_context_x_tensor_fit_and_evaluate_follow_one_device():
    x, y = cp._data(8, 32)
    want_fit, want_eval = cp._fit(jstrategy.OneDeviceStrategy("cpu:0"), x, y)
    got_fit, got_eval = cp._fit(CONTEXT["context_2_x_tensor_2"](), x, y)
    np.testing.assert_allclose(got_fit, want_fit, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_eval, want_eval, atol=1e-5, rtol=0)


def test_context_x_tensor_places_sequences_and_heads_and_passes_keys_round_the_ring():
    strategy = CONTEXT["fsdp_2_x_context_2_x_tensor_2"]()
    x, y = cp._data(4, 32)
    with strategy.scope():
        state = training.create_train_state(cp._decoder(), optax.adam(0.01), x[:1], rng=0)
        step = training.make_train_step(cp.bench.token_loss)
    batch = distribute_batch(strategy, (x, y))
    placed = [s.spec for s in context_axis.batch_shardings(strategy, (x, y))]
    assert placed == [P(("replica", "fsdp"), "context")] * 2
    query = state.params["Block_0"]["query"]["kernel"]
    assert query.sharding.spec[1] == "tensor"
    permutes = hlo.permute_pairs(step.lower(state, batch).compile().as_text())
    assert permutes, "no collective-permute: the attention did not run as a ring"
    ids = np.vectorize(lambda d: d.id)(strategy.mesh.devices)
    where = {int(i): np.argwhere(ids == i)[0] for i in ids.flat}
    context = strategy.mesh.axis_names.index("context")

    def along_context(pairs):
        moved = {tuple(np.nonzero(where[s] != where[t])[0]) for s, t in pairs if s != t}
        return moved == {(context,)}

    # The ring's ppermutes: each block to its neighbour on the context axis, the same
    # replica, FSDP shard and tensor shard (XLA's own resharding may add other permutes).
    assert sum(map(along_context, permutes)) >= 2, permutes


def test_checkpoints_move_between_the_spec_and_other_strategies(tmp_path):
    x, y = moe._data()

    def model_under(strategy):
        with strategy.scope():
            model = jstrategy.Model(moe.Decoder(0.5), (moe.TOKENS,), input_dtype=jnp.int32)
            model.compile(optax.adam(1e-2), loss=moe._loss())
        return model

    trained = model_under(MOE["fsdp_2_x_expert_2_x_tensor_2"]())
    trained.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "moe.weights.h5"
    trained.save_weights(path)
    want = np.asarray(trained.predict(x, verbose=0))
    others = (
        jstrategy.OneDeviceStrategy("cpu:0"),
        jstrategy.experimental.FSDPStrategy(experts=4, min_shard_size=0),
        MOE["expert_2_x_tensor_2"](),
    )
    for strategy in others:
        model = model_under(strategy)
        model.load_weights(path)
        np.testing.assert_allclose(np.asarray(model.predict(x, verbose=0)), want, atol=1e-6)


def test_hybrid_is_the_preset_without_expert_or_context_axes():
    hybrid = jstrategy.experimental.HybridStrategy(fsdp=2, tensor=2)
    spec = Parallel(fsdp=2, tensor=2)
    assert isinstance(hybrid, Parallel)
    assert hybrid.mesh.axis_names == spec.mesh.axis_names == ("replica", "fsdp", "tensor")
    assert hybrid.degrees == spec.degrees == {"replicas": 2, "fsdp": 2, "tensor": 2}
    assert repr(hybrid) == (
        "HybridStrategy(replicas=2, fsdp=2, tensor=2, dcn_replicas=1, dcn_fsdp=1, "
        "dcn_tensor=1, min_shard_size=1024)"
    )
    full = Parallel(experts=2, context=2, tensor=2)
    assert full.mesh.axis_names == ("replica", "fsdp", "expert", "context", "tensor")
    assert repr(full) == (
        "ParallelStrategy(replicas=1, fsdp=1, tensor=2, experts=2, context=2, "
        "dcn_replicas=1, dcn_fsdp=1, dcn_tensor=1, dcn_experts=1, dcn_context=1, "
        "min_shard_size=1024)"
    )


def test_mirrored_and_model_parallel_are_presets_with_their_own_step_and_reading():
    """Mirrored: replicas alone, placed whole by the fold, its step still per replica with
    its cross-device algorithm; ModelParallel: Keras's mesh, degrees read off it."""
    mirrored = jstrategy.MirroredStrategy(
        [f"cpu:{i}" for i in range(8)], cross_device_ops=jstrategy.HierarchicalCopyAllReduce()
    )
    assert isinstance(mirrored, Parallel) and mirrored.degrees == {"replicas": 8}
    assert repr(mirrored) == "MirroredStrategy(devices=[cpu:0, cpu:1, ..., cpu:7])"
    kernel = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    placed = mirrored.variable_sharding(kernel, ("params", "Dense_0", "kernel"))
    assert placed.spec == P() and mirrored.annotation_axis("replica") is None
    x, y = np.ones((16, 4), np.float32), np.ones((16, 1), np.float32)
    with mirrored.scope():
        state = training.create_train_state(pl.nn.Dense(1), optax.sgd(0.1), jnp.ones((1, 4)))
        step = training.make_train_step("mse")
    text = step.lower(state, distribute_batch(mirrored, (x, y))).as_text()
    # HierarchicalCopyAllReduce's tree (copies within halves) is what combines the gradients.
    assert "collective_permute" in text

    mesh = jstrategy.experimental.DeviceMesh((2, 2, 2), ("batch", "context", "model"))
    layout = jstrategy.experimental.LayoutMap(mesh)
    layout["Dense_1/kernel"] = ("model", None)
    keras_like = jstrategy.experimental.ModelParallelStrategy(layout)
    assert isinstance(keras_like, Parallel) and keras_like.axis_name == "batch"
    assert keras_like.degrees == {"replicas": 2, "tensor": 2, "context": 2}
    assert keras_like.batch_sharding().spec == P("batch")
    path = ("opt_state", "0", "mu", "Dense_1", "kernel")
    assert keras_like.variable_sharding(kernel, path).spec == P("model", None)
    assert keras_like.annotation_axis("data") == "batch"


def test_a_layout_map_naming_an_axis_at_degree_one_keeps_that_dimension_whole():
    """A layout map written for an expert mesh, used where experts=1 (no "expert" axis)."""
    mesh = jstrategy.experimental.DeviceMesh((2, 2, 2), ("replica", "expert", "tensor"))
    layout = jstrategy.experimental.LayoutMap(mesh)
    layout["moe/w"] = ("expert", None, "tensor")
    w = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    path = ("params", "moe", "w")
    without = Parallel(fsdp=4, tensor=2, layout_map=layout, min_shard_size=0)
    assert without.variable_sharding(w, path).spec == P(None, "fsdp", "tensor")
    with_experts = Parallel(experts=4, tensor=2, layout_map=layout, min_shard_size=0)
    assert with_experts.variable_sharding(w, path).spec == P("expert", None, "tensor")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"experts": 0}, r"`experts` must be a positive int.*got 0.*experts=2"),
        ({"context": -1}, r"`context` must be a positive int.*got -1"),
        ({"experts": 3}, r"`replicas` x `fsdp` x `experts` x `tensor` must be the number of"),
        (
            {"replicas": -1, "context": 2, "dcn_context": 3},
            r"`dcn_context` .* must divide `context`, 2",
        ),
        ({"tensor": 2, "experts": 2, "fsdp": -1, "replicas": -1}, r"At most one of"),
    ],
)
def test_bad_degrees_are_refused_naming_the_argument_and_the_fix(kwargs, pattern):
    kwargs = {"replicas": 1, **kwargs} if "replicas" not in kwargs else kwargs
    with pytest.raises(ValueError, match=pattern):
        Parallel(**kwargs)


def test_evaluate_and_predict_an_embedding_under_fsdp_rows_follow_one_device():
    # An embedding lookup whose table FSDP splits, in a program manual over the replicas
    # with the rows also split over "fsdp", aborted XLA's partitioner (HybridStrategy's
    # predict and evaluate before); they now run in the global view, as the train step.
    x, y = moe._data()

    def run(strategy):
        with strategy.scope():
            model = jstrategy.Model(moe.Decoder(0.5), (moe.TOKENS,), input_dtype=jnp.int32)
            model.compile(optax.adam(1e-2), loss=moe._loss())
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return np.asarray(model.predict(x, verbose=0)), model.evaluate(x, y, verbose=0)

    want_y, want_loss = run(jstrategy.OneDeviceStrategy("cpu:0"))
    for strategy in (
        jstrategy.experimental.HybridStrategy(replicas=2, fsdp=2, tensor=2, min_shard_size=0),
        MOE["expert_2_x_tensor_2"](),
    ):
        got_y, got_loss = run(strategy)
        np.testing.assert_allclose(got_y, want_y, atol=1e-5)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)


@pytest.mark.parametrize(
    "name", ["expert_2_x_tensor_2", "context_2_x_tensor_2", "stages_2_x_fsdp_2_x_tensor_2"]
)
def test_plan_compiles_the_combined_step_and_reads_each_share(name):
    if name in MOE:
        strategy, model = MOE[name](), moe.Decoder(0.5)
        x, y = moe._data()
        loss = moe._loss()
    elif name in PIPELINES:
        strategy = Parallel(**PIPELINES[name], layout_map=_block_layout())
        model = pl.Net(axis_name=strategy.axis_name)
        x, y = (a[0] for a in pl._data(steps=1))
        loss = pl._loss
    else:
        strategy, model = CONTEXT[name](), cp._decoder()
        x, y = cp._data(8, 32)
        loss = cp.bench.token_loss
    shapes = tuple(jax.ShapeDtypeStruct((16, *a.shape[1:]), a.dtype) for a in (x, y))
    planned = jstrategy.experimental.plan(
        model,
        strategy,
        shapes,
        optimizer=optax.adam(1e-2),
        loss=loss,
        device_memory=1 << 30,
        find_largest_batch=False,
    )
    assert planned.fits and planned.devices == 8
    with strategy.scope():
        state = training.create_train_state(model, optax.adam(1e-2), x[:1], rng=0)
    held = sum(
        max(s.data.nbytes for s in leaf.addressable_shards)
        for leaf in jax.tree.leaves(state.params)
    )
    assert planned.parameters == held


# Pipeline x tensor (x fsdp): test_pipeline's Net, its Repeated block's MLP Megatron-split --
def _block_layout():
    mesh = jstrategy.experimental.DeviceMesh((1, 1, 8), ("replica", "fsdp", "tensor"))
    layout = jstrategy.experimental.LayoutMap(mesh)
    layout["stacked_layers/Dense_0/kernel"] = (None, "tensor")
    layout["stacked_layers/Dense_1/kernel"] = ("tensor", None)
    return layout


PIPELINES = {
    "stages_2_x_tensor_2": dict(replicas=2, stages=2, tensor=2, num_microbatches=4),
    "stages_2_x_fsdp_2_x_tensor_2": dict(
        replicas=1, stages=2, fsdp=2, tensor=2, num_microbatches=2, min_shard_size=0
    ),
    "stages_2_x_tensor_2_circular": dict(
        replicas=2, stages=2, tensor=2, num_microbatches=4, num_repeats=2
    ),
}
PIPELINE_CELLS = [
    ("stages_2_x_tensor_2", "gpipe"),
    ("stages_2_x_tensor_2", "1f1b"),
    ("stages_2_x_fsdp_2_x_tensor_2", "gpipe"),
    ("stages_2_x_tensor_2_circular", "1f1b"),
]


@pytest.mark.parametrize(("name", "schedule"), PIPELINE_CELLS)
def test_a_pipeline_with_tensor_and_fsdp_follows_one_device(name, schedule):
    strategy = Parallel(**PIPELINES[name], schedule=schedule, layout_map=_block_layout())
    assert (
        strategy.pipeline is not None
        and strategy.pipeline.num_replicas == strategy.degrees["replicas"]
    )
    state, history = pl._train(strategy, steps=6)
    stacked = state.params["Repeated_0"]["stacked_layers"]
    up, down = (stacked[name]["kernel"].sharding.spec for name in ("Dense_0", "Dense_1"))
    assert (up[0], up[2], down[0], down[1]) == ("stage", "tensor", "stage", "tensor")
    want_state, want_history = _pipeline_oracle()
    for m, e in zip(history, want_history, strict=True):
        np.testing.assert_allclose(m["loss"], e["loss"], atol=1e-5)
    for a, b in zip(pl._arrays(state), pl._arrays(want_state), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


_PIPELINE_ORACLE: list = []


def _pipeline_oracle():
    if not _PIPELINE_ORACLE:
        _PIPELINE_ORACLE.append(pl._train(jstrategy.OneDeviceStrategy("cpu:0"), steps=6))
    return _PIPELINE_ORACLE[0]


def test_pipeline_settings_are_refused_before_any_work():
    with pytest.raises(ValueError, match=r"`num_microbatches` must be given; got None"):
        Parallel(stages=2)
    with pytest.raises(ValueError, match=r"needs stages > 1; got stages=1, num_microbatches=4"):
        Parallel(num_microbatches=4)
    with pytest.raises(ValueError, match=r"stages=2 cannot be combined with experts=2"):
        Parallel(stages=2, experts=2, num_microbatches=4)
    with pytest.raises(ValueError, match=r"`num_microbatches` must be a multiple of"):
        Parallel(stages=2, num_microbatches=3, num_repeats=2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jstrategy.experimental.HybridStrategy(
            replicas=2, fsdp=2, tensor=2, min_shard_size=0
        ),
        MOE["expert_2_x_tensor_2"],
    ],
    ids=["hybrid_2x2x2", "expert_2_x_tensor_2"],
)
def test_run_computes_each_replicas_rows_with_the_variables_split(make):
    # Before, an embedding lookup inside `run`'s map (manual over the replicas, the rows
    # split over "fsdp"/"expert" too) aborted XLA's partitioner.
    strategy, module = make(), moe.Decoder(0.5)
    x, _ = moe._data()
    with strategy.scope():
        state = training.create_train_state(module, optax.adam(1e-2), x[:1], rng=0)
    (batch,) = list(strategy.experimental_distribute_dataset([x[:8]]))

    def replica_fn(params, rows):
        out = module.apply({"params": params}, rows)
        return jstrategy.get_replica_context().all_reduce("sum", jnp.sum(out)), rows.shape[0]

    total, rows = strategy.run(replica_fn, args=(state.params, batch))
    whole = float(jnp.sum(module.apply({"params": jax.device_get(state.params)}, x[:8])))
    assert strategy.experimental_local_results(rows) == (4, 4)
    for value in strategy.experimental_local_results(total):
        assert float(value) == pytest.approx(whole, rel=1e-5)
