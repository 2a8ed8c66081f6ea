"""Sharded variables on multi-axis meshes: DeviceMesh, LayoutMap, FSDP and ModelParallel.

The Strategy API itself (run, reduce, gather, replica context, datasets) runs over these
strategies in the parameterized suites (conftest's "fsdp_8" and "model_parallel_2x4").
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jstrategy
import jstrategy.training
from jstrategy._src.hlo import collective_counts
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.training.step import body as step_lib
from jstrategy.experimental import DeviceMesh
from jstrategy.experimental import FSDPStrategy
from jstrategy.experimental import LayoutMap
from jstrategy.experimental import ModelParallelStrategy


def _megatron(shape=(2, 4), batch="batch"):
    layout_map = LayoutMap(DeviceMesh(shape, (batch, "model")))
    layout_map["Dense_0/kernel"] = (None, "model")
    layout_map["Dense_1/kernel"] = ("model", None)
    return ModelParallelStrategy(layout_map, batch_dim_name=batch)


def _specs(tree):
    return jax.tree.map(lambda x: x.sharding.spec, tree)


class _MLP(nn.Module):
    hidden: int = 16
    out: int = 2

    @nn.compact
    def __call__(self, x):
        hidden = jnp.tanh(nn.Dense(self.hidden)(x))
        return nn.Dense(self.out)(hidden)


# DeviceMesh ---------------------------------------------------------------------------
def test_device_mesh_is_keras_device_mesh_on_jax_make_mesh():
    mesh = DeviceMesh((2, 4), ("batch", "model"))
    assert mesh.shape == (2, 4) and mesh.axis_names == ("batch", "model")
    assert mesh.devices.shape == (2, 4)
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    # The axes are Auto (shardings are annotations), unlike jax.make_mesh's default.
    assert mesh.jax_mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert dict(mesh.jax_mesh.shape) == {"batch": 2, "model": 4}
    few = DeviceMesh((2,), ("batch",), devices=["cpu:2", "cpu:5"])
    assert [d.id for d in few.devices.flat] == [2, 5]
    assert few == DeviceMesh([2], ["batch"], devices=np.array(jax.devices())[[2, 5]])


def test_device_mesh_errors():
    with pytest.raises(
        ValueError, match=r"`shape` \(2, 3\) multiplies to 6 devices, but there are 8"
    ):
        DeviceMesh((2, 3), ("batch", "model"))
    with pytest.raises(ValueError, match=r"multiplies to 8 devices, but there are 2 devices"):
        DeviceMesh((2, 4), ("batch", "model"), devices=["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match=r"`axis_names` must name each of the 2 axes"):
        DeviceMesh((2, 4), ("batch",))
    with pytest.raises(ValueError, match="`axis_names` must be distinct"):
        DeviceMesh((2, 4), ("x", "x"))
    with pytest.raises(ValueError, match="`shape` must be a non-empty sequence of positive ints"):
        DeviceMesh((2, 0), ("batch", "model"))


# The core on an N-D mesh ---------------------------------------------------------------
def test_core_accepts_a_mesh_whose_data_axis_it_names():
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes by default
    strategy = jstrategy.Strategy(mesh, data_axis="data")
    assert strategy.num_replicas_in_sync == 4 and strategy.axis_name == "data"
    assert strategy.mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert strategy.batch_sharding().spec == P("data")
    assert len(strategy.devices) == 8
    with pytest.raises(
        ValueError,
        match=r"data axis 'batch' is not an axis of the mesh, whose axes are \('data', 'model'\)",
    ):
        jstrategy.Strategy(mesh, data_axis="batch")


def test_collectives_run_over_the_data_axis_only():
    strategy = _megatron((4, 2))
    assert strategy.num_replicas_in_sync == 4

    def fn():
        ctx = jstrategy.get_replica_context()
        one = jnp.ones((), jnp.int32)
        ids = ctx.all_gather(ctx.replica_id_in_sync_group[None], axis=0)
        return ctx.all_reduce("SUM", one), ctx.all_reduce("MEAN", one * 4.0), ids

    replicas, mean, ids = strategy.run(fn)
    assert int(replicas) == 4  # not 8: the "model" axis holds no replicas
    assert float(mean) == 4.0
    assert ids.tolist() == [0, 1, 2, 3]


def test_batch_norm_synchronizes_over_the_data_axis():
    strategy = _megatron()
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32) * [1, 2, 3]
    bn = nn.BatchNorm(use_running_average=False, axis_name=strategy.axis_name, momentum=0.0)
    variables = bn.init(jax.random.key(0), x)

    def fn(batch):
        _, updates = bn.apply(variables, batch, mutable=["batch_stats"])
        return updates["batch_stats"]

    stats = strategy.run(fn, (distribute_batch(strategy, x),))
    np.testing.assert_allclose(stats["mean"], x.mean(0), rtol=1e-5)  # the global batch's
    np.testing.assert_allclose(stats["var"], x.var(0), rtol=1e-4)


def test_run_keeps_model_split_arguments_split_and_dropout_differs_per_replica():
    strategy = _megatron()
    kernel = jstrategy.training.place_state(
        {"params": {"Dense_0": {"kernel": jnp.ones((3, 8))}}}, strategy
    )["params"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P(None, "model")
    x = distribute_batch(strategy, np.ones((4, 3), np.float32))

    def fn(kernel, x):
        ctx = jstrategy.get_replica_context()
        key = jax.random.fold_in(jax.random.key(0), ctx.replica_id_in_sync_group)
        keep = jax.random.bernoulli(key, 0.5, (2, 8))
        return jnp.where(keep, x @ kernel, 0.0)

    out = strategy.experimental_local_results(strategy.run(fn, (kernel, x)))
    assert len(out) == 2 and out[0].shape == (2, 8)
    assert not np.array_equal(out[0], out[1])  # each replica its own dropout mask
    assert set(np.unique(np.concatenate(out))) <= {0.0, 3.0}


# FSDP ---------------------------------------------------------------------------------
def test_fsdp_shards_the_largest_dimension_that_divides():
    strategy = FSDPStrategy(min_shard_size=100)
    assert strategy.num_replicas_in_sync == 8 and strategy.axis_name == jstrategy.REPLICA_AXIS

    def spec(shape):
        return strategy.variable_sharding(jax.ShapeDtypeStruct(shape, jnp.float32)).spec

    assert spec((16, 64)) == P(None, "replica")  # largest
    assert spec((64, 64)) == P("replica", None)  # ties: the first
    assert spec((12, 40)) == P(None, "replica")  # 12 does not divide by 8
    assert spec((9, 15)) == P()  # nothing divides
    assert spec((8, 8)) == P()  # below min_shard_size
    assert spec((3, 5, 16)) == P(None, None, "replica")
    assert FSDPStrategy(min_shard_size=0).variable_sharding(
        jax.ShapeDtypeStruct((8,), jnp.float32)
    ).spec == P("replica")
    with pytest.raises(ValueError, match=r"`min_shard_size` must be a non-negative int .* got -1"):
        FSDPStrategy(min_shard_size=-1)
    assert FSDPStrategy(devices=["cpu:0", "cpu:1"]).num_replicas_in_sync == 2


def test_fsdp_joins_the_tf_config_job_or_runs_locally(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    local = FSDPStrategy()  # no TF_CONFIG: one process over the local devices
    assert (local.num_workers, local.is_chief, local.num_replicas_in_sync) == (1, True, 8)
    assert isinstance(local.cluster_resolver, jstrategy.cluster_resolver.TFConfigClusterResolver)
    assert FSDPStrategy(devices=["cpu:0", "cpu:1"]).cluster_resolver is None
    # An evaluator stays out of the training job (it would block joining it otherwise).
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}})
    )
    assert FSDPStrategy().num_workers == 1


def _bytes_on(device, tree):
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def test_fsdp_keeps_one_eighth_of_parameters_and_adam_state_per_device():
    module = _MLP(hidden=256, out=256)
    sample = jnp.ones((2, 256))
    sizes = {}
    for name, strategy in [("one", jstrategy.OneDeviceStrategy("cpu:0")), ("fsdp", FSDPStrategy())]:
        with strategy.scope():
            state = jstrategy.training.create_train_state(module, optax.adam(1e-3), sample)
        sizes[name] = max(_bytes_on(d, (state.params, state.opt_state)) for d in strategy.devices)
    assert sizes["fsdp"] / sizes["one"] <= 0.13


# LayoutMap ----------------------------------------------------------------------------
def test_layout_map_keras_semantics():
    layout_map = LayoutMap(DeviceMesh((2, 4), ("batch", "model")))
    layout_map["dense/kernel"] = (None, "model")
    layout_map[".*bias"] = ("model",)
    layout_map["conv.*kernel"] = P(None, None, None, ("batch", "model"))
    assert layout_map["dense/kernel"] == P(None, "model")  # exact key
    assert layout_map["block/dense/kernel"] == P(None, "model")  # re.search, not match
    assert layout_map["dense/bias"] == P("model")
    assert layout_map["conv_1/kernel"] == P(None, None, None, ("batch", "model"))
    assert layout_map["embedding"] is None  # unmatched: replicated
    assert len(layout_map) == 3 and "dense/kernel" in layout_map and "x" not in layout_map
    layout_map["dense"] = ("model", None)
    # Exact keys win (as in Keras); otherwise two matches are an error naming both.
    assert layout_map["dense"] == P("model", None)
    with pytest.raises(
        ValueError, match=r"matches several LayoutMap keys: \['dense/kernel', 'dense'\]"
    ):
        layout_map["block/dense/kernel"]
    del layout_map["dense"]
    assert list(layout_map) == ["dense/kernel", ".*bias", "conv.*kernel"]


def test_layout_map_errors_before_any_work():
    layout_map = LayoutMap(DeviceMesh((2, 4), ("batch", "model")))
    with pytest.raises(
        ValueError,
        match=r"names mesh axis 'modle', which the mesh lacks; its axes are \('batch', 'model'\)",
    ):
        layout_map["dense/kernel"] = (None, "modle")
    with pytest.raises(ValueError, match="names mesh axis 'tp', which the mesh lacks"):
        layout_map["dense/kernel"] = P(("batch", "tp"))
    with pytest.raises(ValueError, match="uses mesh axis 'model' twice"):
        layout_map["dense/kernel"] = ("model", "model")
    with pytest.raises(TypeError, match="must be a tuple with one entry per dimension"):
        layout_map["dense/kernel"] = "model"
    with pytest.raises(ValueError, match="not a valid regex"):
        layout_map["dense/(kernel"] = (None, "model")
    layout_map["dense/kernel"] = (None, "model")
    with pytest.raises(ValueError, match="already in the LayoutMap"):
        layout_map["dense/kernel"] = ("model", None)
    with pytest.raises(
        TypeError, match="`device_mesh` must be a jstrategy.experimental.DeviceMesh"
    ):
        LayoutMap(jax.make_mesh((8,), ("x",)))


# ModelParallel ------------------------------------------------------------------------
def test_model_parallel_errors_before_any_work():
    layout_map = LayoutMap(DeviceMesh((2, 4), ("data", "model")))
    with pytest.raises(
        ValueError,
        match=r"`batch_dim_name` must be an axis of the layout map's mesh, whose axes are "
        r"\('data', 'model'\); got 'batch'",
    ):
        ModelParallelStrategy(layout_map)
    with pytest.raises(TypeError, match="`layout_map` must be a jstrategy.experimental.LayoutMap"):
        ModelParallelStrategy({"dense/kernel": (None, "model")})
    strategy = _megatron()
    with (
        strategy.scope(),
        pytest.raises(
            ValueError,
            match=r"Variable 'Dense_0/kernel' of shape \(3, 6\) does not fit the layout "
            r"\(None, 'model'\) of LayoutMap key 'Dense_0/kernel': dimension 1 \(6\) does not "
            r"divide by 4, the size of mesh axis 'model'",
        ),
    ):
        jstrategy.training.create_train_state(_MLP(hidden=6), optax.sgd(0.1), jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="the layout has 2 entries but the variable 1 dimensions"):
        strategy.variable_sharding(
            jax.ShapeDtypeStruct((8,), jnp.float32), ("params", "Dense_0", "kernel")
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "tx",
    [
        optax.adam(1e-3),
        optax.sgd(0.1, momentum=0.9),
        optax.chain(optax.clip(1.0), optax.adamw(1e-3)),
    ],
    ids=["adam", "sgd_momentum", "chain_adamw"],
)
def test_optimizer_state_follows_its_parameter_layout(tx):
    strategy = _megatron()
    with strategy.scope():
        state = jstrategy.training.create_train_state(_MLP(), tx, jnp.ones((1, 3)))
    params = _specs(state.params)
    assert params["Dense_0"]["kernel"] == P(None, "model")
    assert params["Dense_1"]["kernel"] == P("model", None)
    assert params["Dense_0"]["bias"] == P()  # unmatched: replicated
    moments = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(_specs(state.opt_state))
        if jax.tree_util.keystr(path).endswith("['Dense_1']['kernel']")
    ]
    assert moments and all(spec == P("model", None) for spec in moments)
    counts = [s for s in jax.tree.leaves(_specs(state.opt_state)) if s == P()]
    assert counts  # step counts and biases' moments are replicated


def test_optimizer_leaves_that_do_not_fit_are_replicated():
    strategy = _megatron()
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    with strategy.scope():
        state = jstrategy.training.create_train_state(_MLP(), tx, jnp.ones((1, 8)))
    flat = {
        jax.tree_util.keystr(path): spec
        for path, spec in jax.tree_util.tree_leaves_with_path(_specs(state.opt_state))
    }
    factored = [k for k in flat if "v_row" in k and "'Dense_0']['kernel']" in k]
    assert factored and all(flat[k] == P() for k in factored)  # rank 1, layout rank 2


# Custom training loops: the same trajectory as OneDeviceStrategy -----------------------
_TX = optax.adam(0.01)


def _init_params():
    key1, key2 = jax.random.split(jax.random.key(0))
    return {
        "Dense_0": {"kernel": jax.random.normal(key1, (4, 16)) * 0.5, "bias": jnp.zeros(16)},
        "Dense_1": {"kernel": jax.random.normal(key2, (16, 2)) * 0.5, "bias": jnp.zeros(2)},
    }


def _step(params, opt_state, batch):
    ctx = jstrategy.get_replica_context()

    def loss_fn(p):
        hidden = jnp.tanh(batch["x"] @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
        out = hidden @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
        return jstrategy.compute_average_loss(jnp.sum((out - batch["y"]) ** 2, -1))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = ctx.all_reduce("SUM", grads)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _train(strategy, steps=20):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.normal(size=(16, 2)).astype(np.float32)
    params = _init_params()
    state = jstrategy.training.place_state(
        {"params": params, "opt_state": _TX.init(params)}, strategy
    )
    params, opt_state = state["params"], state["opt_state"]
    dist = strategy.experimental_distribute_dataset([{"x": x, "y": y}])
    for _ in range(steps):
        for element in dist:
            params, opt_state, loss = strategy.run(_step, (params, opt_state, element))
    jax.block_until_ready(loss)
    first = strategy.experimental_local_results(params)[0]
    return jax.tree.map(np.asarray, first), float(strategy.reduce("SUM", loss))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp_8", "model_parallel_2x4"])
def test_custom_loop_follows_one_device(name, one_device):
    from conftest import STRATEGIES

    strategy = STRATEGIES[name]()
    placed = jstrategy.training.place_state({"params": _init_params()}, strategy)["params"]
    assert any(spec != P() for spec in jax.tree.leaves(_specs(placed)))  # really sharded
    expected, expected_loss = _train(one_device)
    params, loss = _train(strategy)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_layouts_over_the_data_axis_too_follow_one_device(one_device):
    # 2-D sharding: a kernel split over "batch" (reduce-scattered like FSDP's) and over
    # "model"; another split over both axes on one dimension (all-reduced, then sliced).
    layout_map = LayoutMap(DeviceMesh((2, 4), ("batch", "model")))
    layout_map["Dense_0/kernel"] = ("batch", "model")
    layout_map["Dense_1/kernel"] = (("batch", "model"), None)
    hybrid = ModelParallelStrategy(layout_map)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = rng.normal(size=(8, 2)).astype(np.float32)
    results = []
    for strategy in (one_device, hybrid):
        with strategy.scope():
            state = jstrategy.training.create_train_state(_MLP(), optax.adam(0.05), x[:1])
            step = jstrategy.training.make_train_step("mse")
        for _ in range(10):
            state, metrics = step(state, distribute_batch(strategy, (x, y)))
        results.append((state, float(metrics["loss"])))
    (expected, expected_loss), (got, loss) = results
    assert _specs(got.params)["Dense_0"]["kernel"] == P("batch", "model")
    assert _specs(got.params)["Dense_1"]["kernel"] == P(("batch", "model"), None)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


# The compiled train step: what XLA communicates ------------------------------------------
class _Deep(nn.Module):
    """Three dense layers: kernels of 1024, 4096 and 512 elements, small biases."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(8)(x)


def _compiled_collectives(strategy, steps_per_execution=0, *, padded=False):
    """The collectives of the compiled train step, by kind and mesh axes; the state's specs.

    With `steps_per_execution`, of the program `Model.fit` runs: a scan of that many steps
    (with a row mask). `padded`: the step's batch has 60 real rows of 64 (a row mask).
    64 rows: the sharded step is in the global view, where XLA's partitioner chooses the
    cheaper communication; with fewer rows than a kernel's inputs it would move the
    activations instead of the kernels (also correct, but not what this test pins).
    """
    x = np.ones((64, 16), np.float32)
    y = np.zeros((64, 8), np.float32)
    with strategy.scope():
        state = jstrategy.training.create_train_state(_Deep(), optax.adam(1e-3), jnp.ones((1, 16)))
    spec = step_lib.make_spec("mse", None, strategy)
    if steps_per_execution:
        program = step_lib.build_train_program(spec, steps=steps_per_execution)
        acc = jax.device_put(spec.zero_sums(), strategy.replicated_sharding())
        stacked = NamedSharding(strategy.mesh, P(None, strategy.axis_name))
        n = steps_per_execution
        batch, mask = jax.device_put(
            ((np.stack([x] * n), np.stack([y] * n)), np.ones((n, 64), bool)), stacked
        )
        lowered = program.lower(state, acc, batch, mask)
    else:
        rows = 60 if padded else 64
        batch = distribute_batch(strategy, (x[:rows], y[:rows]), global_batch_size=64)
        lowered = jstrategy.training.make_train_step("mse", strategy=strategy).lower(state, batch)
    return collective_counts(lowered.compile().as_text(), strategy.mesh), _specs(state.params)


@pytest.mark.slow
def test_fsdp_step_gathers_parameters_and_reduce_scatters_gradients():
    # The three kernels are split over the replicas (the biases are below min_shard_size):
    # each is all-gathered once per step where it is read (three gathers, not one of the
    # whole model). The step is in the global view, so XLA's partitioner reduces each
    # gradient where backpropagation produces it; XLA:CPU writes a reduce-scatter as an
    # all-reduce sliced to the replica's part (GPUs' ReduceScatterCreator turns it back
    # into a reduce-scatter) and its all-reduce combiner merges the small ones with the
    # biases' and the loss into one. A full batch divides by its static size; a padded one's
    # count of real rows is reduced on its own, before the backward pass that it scales (so
    # no update waits for the step's last all-reduce).
    fsdp = FSDPStrategy(min_shard_size=256)
    counts, specs = _compiled_collectives(fsdp)
    assert [specs[f"Dense_{i}"]["kernel"] for i in range(3)] == [
        P(None, "replica"),
        P("replica", None),
        P("replica", None),
    ]
    assert counts == {"all-gather[replica]": 3, "all-reduce[replica]": 1}
    masked = {"all-gather[replica]": 3, "all-reduce[replica]": 2}
    assert _compiled_collectives(fsdp, padded=True)[0] == masked
    # Several steps per execution (masked here): the same per step, inside the scan's body.
    assert _compiled_collectives(fsdp, steps_per_execution=3)[0] == masked
    # Mirrored: one all-reduce and nothing else.
    assert _compiled_collectives(jstrategy.MirroredStrategy())[0] == {"all-reduce[replica]": 1}


@pytest.mark.slow
def test_megatron_step_communicates_over_model_inside_and_batch_between_replicas():
    counts, specs = _compiled_collectives(_megatron())
    assert specs["Dense_0"]["kernel"] == P(None, "model")
    # Megatron's forward all-reduce of the row-split matmul's partial sums, over "model";
    # over "batch", the gradients' one all-reduce (and for a padded batch the count of real
    # rows, before the backward pass it scales); no reduce-scatter (nothing is split over
    # the data axis).
    assert counts["all-reduce[model]"] >= 1 and counts["all-reduce[batch]"] == 1
    assert _compiled_collectives(_megatron(), padded=True)[0]["all-reduce[batch]"] == 2
    assert not any(k.startswith("reduce-scatter") for k in counts)
    assert all(k.endswith(("[model]", "[batch]")) for k in counts)


def test_collective_counts_reads_every_replica_group_form():
    mesh = jax.make_mesh((2, 4), ("batch", "model"))
    lines = [
        "%a = f32[8] all-reduce(f32[8] %x), replica_groups={{0,4},{1,5},{2,6},{3,7}}",
        "%b = f32[8] all-reduce(f32[8] %x), replica_groups=[2,4]<=[8]",
        "%c = f32[64] all-gather(f32[16] %x), replica_groups=mesh['axis_0'=4,'axis_1'=2], "
        "device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}",
        "%d = f32[2] reduce-scatter-start(f32[8] %x), replica_groups=[4,2]<=[2,4]T(1,0)",
        "%e = f32[2] reduce-scatter-done(f32[2] %d)",
    ]
    assert collective_counts("\n".join(lines), mesh) == {
        "all-gather[model]": 1,
        "all-reduce[batch]": 1,
        "all-reduce[model]": 1,
        "reduce-scatter[batch]": 1,
    }
    assert collective_counts("\n".join(lines)) == {
        "all-gather": 1,
        "all-reduce": 2,
        "reduce-scatter": 1,
    }


@pytest.mark.slow
def test_sharded_step_benchmark_smoke(capsys):
    """`make bench`'s benchmarks/sharded_step.py runs end to end on a tiny transformer."""
    import importlib.util
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "sharded_step", root / "benchmarks/sharded_step.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules["sharded_step"] = bench  # dataclasses resolve annotations through it
    spec.loader.exec_module(bench)
    tiny = ["--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--seq-len", "8"]
    rows = bench.main([*tiny, "--vocab-size", "64", "--batch-size", "16", "--steps", "1",
                       "--repeats", "1"])  # fmt: skip
    out = capsys.readouterr().out
    mirrored, fsdp, fsdp_peer, megatron, megatron_peer = rows
    assert [row.name for row in rows] == [
        "Mirrored",
        "FSDP",
        "FSDP: hand-written jax.jit",
        "ModelParallel (Megatron)",
        "ModelParallel (Megatron): hand-written jax.jit",
    ]
    assert mirrored.peer is None and (fsdp.peer, megatron.peer) == (fsdp_peer, megatron_peer)
    assert (fsdp_peer.peer_of, megatron_peer.peer_of) == ("FSDP", "ModelParallel (Megatron)")
    assert mirrored.collectives == {"all-reduce[replica]": 1} and mirrored.per_device == 1.0
    # Only the (64, 32) embedding reaches 1024 elements: the global-view step gathers it
    # (or, XLA's choice at this size, the activations it meets) and all-reduces the rest.
    assert fsdp.collectives["all-gather[replica]"] >= 1
    assert fsdp.per_device < 1.0
    # One block: Megatron's two forward and two backward all-reduces over "model"; the
    # gradients' over "batch".
    assert megatron.collectives == {"all-reduce[batch]": 1, "all-reduce[model]": 4}
    # Each peer holds the same layouts (the jstrategy state's shardings) and, written as
    # the same global-view step, XLA gives it the same communication: the batch is full,
    # so the train step divides by its static size as the peer does (no count of real rows
    # to all-reduce first).
    assert fsdp_peer.per_device == fsdp.per_device
    assert megatron_peer.per_device == megatron.per_device
    assert megatron_peer.collectives == megatron.collectives
    assert fsdp_peer.collectives == fsdp.collectives
    assert all(row.step_s > 0 and len(row.samples) == 1 for row in rows)
    assert (
        "| FSDP | replica 8 |" in out and "| ModelParallel (Megatron) | batch 2 x model 4 |" in out
    )
    assert "| FSDP: hand-written jax.jit | replica 8 |" in out
    assert "| ModelParallel (Megatron): hand-written jax.jit | batch 2 x model 4 |" in out
    # A sharded strategy's row gives its ratio to its peer; every row its ratio to Mirrored.
    assert "| Mirrored | replica 8 | " in out and " |  | 1.00x (1.00-1.00) | 1.000x |" in out
    assert out.count("x (") == 2 + len(rows)
