"""`HybridStrategy`: replicas x FSDP x tensor on one mesh (issue 37 item 1).

Its mesh keeps each host's devices together (one process over 8 fake devices stands in for
hosts of neighbouring devices), its variables carry the tensor layout and FSDP's split on
another dimension, its trajectory is OneDevice's through the train-step factory and
`Model.fit` on (2, 2, 2) and (1, 4, 2) meshes, `run` works per replica, checkpoints cross
to and from every other sharded strategy, and the compiled step's FSDP all-gathers stay
within a host while the replicas' gradient all-reduce crosses hosts. Two processes x four
devices follow one process in tests/test_multi_worker.py. The parity matrix
(tests/parity_zoo.py) holds every kind of model to one device under ``hybrid_2x2x2``.
"""

from __future__ import annotations

import enum
import functools
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import losses
from jstrategy import training
from jstrategy._src.hlo import collective_groups
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.names import path_names

FEATURES = 8
HybridStrategy = jstrategy.experimental.HybridStrategy


class MLP(nn.Module):
    """A Megatron MLP: the first kernel split by columns over "tensor", the second by
    rows; FSDP splits each on the other dimension."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(16, name="up")(x))
        return nn.Dense(3, name="down")(h)


def _layout_map():
    # Any mesh whose axes the layouts name: only the names are read.
    mesh = jstrategy.experimental.DeviceMesh((1, 8), ("data", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    return layout_map


def _hybrid(replicas, fsdp, tensor, **kwargs):
    return HybridStrategy(
        replicas=replicas,
        fsdp=fsdp,
        tensor=tensor,
        layout_map=_layout_map(),
        min_shard_size=0,
        **kwargs,
    )


MESHES = {
    # Two hosts of four devices, one replica each: FSDP and tensor within a host.
    "2x2x2": lambda: _hybrid(2, 2, 2, dcn_replicas=2),
    # One replica: every device splits the variables, four ways by FSDP.
    "1x4x2": lambda: _hybrid(1, 4, 2),
}


# The mesh and its hosts ----------------------------------------------------------------
def _ids(strategy):
    return np.vectorize(lambda d: d.id)(strategy.mesh.devices).tolist()


def test_each_hosts_devices_are_contiguous_along_the_within_host_axes():
    strategy = MESHES["2x2x2"]()
    assert strategy.mesh.axis_names == ("replica", "fsdp", "tensor")
    assert strategy.hosts == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert _ids(strategy) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # replica r = host r
    assert (strategy.num_replicas_in_sync, strategy.axis_name) == (2, "replica")
    assert strategy.batch_multiple == 4
    assert strategy.dcn_degrees == {"replicas": 2, "fsdp": 1, "tensor": 1}
    # FSDP across the two hosts instead: each host holds one half of every FSDP group.
    across = _hybrid(2, 2, 2, dcn_replicas=1, dcn_fsdp=2)
    assert _ids(across) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    # -1 takes the devices left; one process is one host by default.
    rest = HybridStrategy(fsdp=2, tensor=2)
    assert rest.degrees == {"replicas": 2, "fsdp": 2, "tensor": 2}
    assert rest.hosts == (tuple(range(8)),)
    assert repr(rest).startswith("HybridStrategy(replicas=2, fsdp=2, tensor=2, dcn_replicas=1")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"fsdp": 0}, r"`fsdp` must be a positive int, or -1 .*got 0\. Pass e\.g\. fsdp=2"),
        ({"tensor": 2.0}, r"`tensor` must be a positive int.*got 2\.0"),
        ({"replicas": -1, "fsdp": -1}, r"At most one of `replicas`, `fsdp` and `tensor`"),
        ({"replicas": 2, "fsdp": 2, "tensor": 1}, r"multiply|must be the number of devices, 8"),
        ({"fsdp": 3}, r"`replicas`=-1: 8 devices do not divide by 3"),
        ({"fsdp": 4, "dcn_fsdp": 3}, r"`dcn_fsdp` .* must divide `fsdp`, 4; got dcn_fsdp=3"),
        ({"fsdp": 2, "dcn_tensor": 0}, r"`dcn_tensor` must be a positive int"),
        ({"min_shard_size": -1}, r"`min_shard_size` must be a non-negative int"),
    ],
)
def test_bad_degrees_are_refused_naming_the_argument_and_the_fix(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HybridStrategy(**kwargs)


def test_a_layout_map_naming_another_axis_or_not_a_layout_map_is_refused():
    layout_map = jstrategy.experimental.LayoutMap(
        jstrategy.experimental.DeviceMesh((2, 4), ("stage", "model"))
    )
    layout_map["up/kernel"] = ("stage", None)
    with pytest.raises(ValueError, match=r"key 'up/kernel' names mesh axis 'stage'.*'tensor'"):
        HybridStrategy(fsdp=2, layout_map=layout_map)
    with pytest.raises(TypeError, match=r"`layout_map` must be a jstrategy.experimental.Layout"):
        HybridStrategy(fsdp=2, layout_map={"up/kernel": (None, "model")})


def test_a_layout_key_that_matches_no_variable_is_refused_naming_the_nearest_paths():
    # As ModelParallelStrategy's keys (issue 50 item 6): a typo would leave "up" unsplit.
    layout_map = _layout_map()
    del layout_map["up/kernel"]
    layout_map["upp/kernel"] = (None, "model")
    strategy = HybridStrategy(fsdp=2, tensor=2, layout_map=layout_map, min_shard_size=0)
    typo = r"LayoutMap key 'upp/kernel' matches no variable .* nearest variable paths are \['up/kernel'"
    with pytest.raises(ValueError, match=typo), strategy.scope():
        _make()
    with pytest.raises(ValueError, match=typo), strategy.scope():
        jstrategy.Model(MLP(), input_shape=(FEATURES,), seed=0)
    assert strategy.layout_map is layout_map


def test_the_readme_shows_every_argument_with_its_default():
    # Issue 50 item 7: the strategy table's signature line, all but how a job is joined.
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    line = re.search(r"`experimental\.HybridStrategy\(([^)]*)\)`", readme)
    assert line is not None
    shown = dict(arg.split("=") for arg in line.group(1).split(", "))
    joining = {"devices", "cluster_resolver", "communication_options"}
    parameters = inspect.signature(HybridStrategy).parameters
    # A mode's default as a user writes it (TensorActivations.FEATURES), others as repr.
    written = {
        name: f"{type(p.default).__name__}.{p.default.name}"
        if isinstance(p.default, enum.Enum)
        else repr(p.default)
        for name, p in parameters.items()
        if name not in joining
    }
    assert shown == written


# Where variables live -----------------------------------------------------------------
def _spec(strategy, shape, *path):
    return strategy.variable_sharding(jax.ShapeDtypeStruct(shape, jnp.float32), path).spec


def test_fsdp_splits_the_dimension_the_tensor_layout_leaves_free():
    strategy = MESHES["1x4x2"]()
    assert _spec(strategy, (8, 16), "params", "up", "kernel") == P("fsdp", "tensor")
    assert _spec(strategy, (16, 3), "params", "down", "kernel") == P("tensor", None)  # 3 % 4
    assert _spec(strategy, (16,), "params", "up", "bias") == P("tensor")
    assert _spec(strategy, (8, 16), "opt_state", "0", "mu", "up", "kernel") == P("fsdp", "tensor")
    assert _spec(strategy, (), "step") == P()
    big = HybridStrategy(fsdp=8)  # the default min_shard_size keeps small leaves whole
    assert _spec(big, (8, 16), "params", "up", "kernel") == P()
    assert _spec(big, (64, 32), "params", "up", "kernel") == P("fsdp", None)
    # A layout may place FSDP's split itself, naming it (or another mesh's data axis).
    layout_map = _layout_map()
    del layout_map["down/kernel"]
    layout_map["down/kernel"] = ("model", "data")
    own = HybridStrategy(fsdp=2, tensor=4, layout_map=layout_map, min_shard_size=0)
    assert _spec(own, (16, 4), "params", "down", "kernel") == P("tensor", "fsdp")
    with pytest.raises(ValueError, match=r"'params/up/kernel' of shape \(8, 15\) does not fit"):
        _spec(strategy, (8, 15), "params", "up", "kernel")


def test_flax_annotations_for_a_data_model_mesh_are_read_on_the_hybrid_axes():
    class Annotated(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            h = nn.Dense(16, kernel_init=nn.with_partitioning(init, ("data", "model")))(x)
            return nn.Dense(4, kernel_init=nn.with_partitioning(init, ("model", None)))(h)

    strategy = HybridStrategy(replicas=2, fsdp=2, tensor=2, min_shard_size=0)
    with strategy.scope():
        state = training.create_train_state(Annotated(), optax.adam(0.1), jnp.ones((1, 8)))
    specs = {k: tuple(v["kernel"].sharding.spec) for k, v in state.params.items()}
    assert specs == {"Dense_0": ("fsdp", "tensor"), "Dense_1": ("tensor", "fsdp")}


# Trajectories --------------------------------------------------------------------------
def _make():
    return training.create_train_state(MLP(), optax.adam(0.05), jnp.ones((1, FEATURES)))


def _state(strategy):
    with strategy.scope():
        return _make()


def _batches(steps=4, rows=16):
    x, y = helpers.classification_data(steps * rows, FEATURES, classes=3)
    return x.reshape(steps, rows, FEATURES), y.reshape(steps, rows)


_LOSS = losses.SparseCategoricalCrossentropy(from_logits=True)


@functools.cache
def _one_device_steps():
    x, y = _batches()
    state, logs = helpers.train_steps(jstrategy.OneDeviceStrategy("cpu:0"), _make, _LOSS, x, y)
    return helpers.checkpoint_leaves(state), logs


def _assert_kept(state, strategy):
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    for keypath, leaf in flat:
        want = strategy.variable_sharding(leaf, path_names(keypath))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (keypath, leaf.sharding, want)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_the_train_step_factory_follows_one_device(mesh):
    strategy = MESHES[mesh]()
    x, y = _batches()
    want, want_logs = _one_device_steps()
    state, logs = helpers.train_steps(strategy, _make, _LOSS, x, y)
    _assert_kept(state, strategy)
    got = helpers.checkpoint_leaves(state)
    assert sorted(got) == sorted(want)
    for path, value in got.items():
        np.testing.assert_allclose(value, want[path], rtol=1e-5, atol=1e-5, err_msg=str(path))
    for a, b in zip(logs, want_logs, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, atol=1e-5)


def _model(strategy):
    with strategy.scope():
        model = jstrategy.Model(MLP(), input_shape=(FEATURES,), seed=0)
        model.compile(optax.adam(0.05), loss=_LOSS, metrics=["accuracy"], steps_per_execution=2)
    return model


@functools.cache
def _one_device_fit():
    x, y = helpers.classification_data(50, FEATURES, classes=3)
    model = _model(jstrategy.OneDeviceStrategy("cpu:0"))
    history = model.fit(x, y, batch_size=12, epochs=2, verbose=0).history
    return model.get_weights(), history, model.predict(x, batch_size=16, verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_model_fit_follows_one_device(mesh):
    # 50 rows at batch 12: four full batches and a partial one (2 rows, padded to 12),
    # two steps per execution and a one-step remainder.
    strategy = MESHES[mesh]()
    weights, history, predictions = _one_device_fit()
    x, y = helpers.classification_data(50, FEATURES, classes=3)
    model = _model(strategy)
    got = model.fit(x, y, batch_size=12, epochs=2, verbose=0).history
    _assert_kept(model.state, strategy)
    for a, b in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["loss"], history["loss"], rtol=1e-5, atol=1e-5)
    assert history["loss"][1] < history["loss"][0]
    np.testing.assert_allclose(model.predict(x, batch_size=16, verbose=0), predictions, atol=1e-5)


# Where the rows live ------------------------------------------------------------------
def _argument_bytes(strategy, rows):
    """The compiled train step's arguments on one device (its memory analysis), for a
    global batch of `rows` rows."""
    with strategy.scope():
        state = _make()
        step = training.make_train_step(_LOSS)
    x, y = helpers.classification_data(rows, FEATURES, classes=3)
    return step.lower(state, (x, y)).compile().memory_analysis().argument_size_in_bytes


def test_each_device_holds_batch_over_replicas_x_fsdp_rows_as_under_fsdp():
    # Issue 50 item 5: a replica's rows are split over its FSDP devices where they are
    # placed, so a device holds batch / (replicas x fsdp) rows, FSDP(8)'s share, not its
    # whole replica's (4x as many under (2, 4, 1)).
    hybrid, fsdp = _hybrid(2, 4, 1), jstrategy.experimental.FSDPStrategy(min_shard_size=0)
    row_bytes = FEATURES * 4 + 4  # a float32 row of x and its int32 label
    rows = 128
    for strategy in (hybrid, fsdp):
        grown = _argument_bytes(strategy, 2 * rows) - _argument_bytes(strategy, rows)
        assert grown == rows // 8 * row_bytes, strategy
    assert hybrid.batch_sharding().spec == P(("replica", "fsdp"))
    # A distributed dataset's elements (what a custom loop feeds the step) likewise.
    x, y = helpers.classification_data(rows, FEATURES, classes=3)
    (element,) = hybrid.experimental_distribute_dataset([(x, y)])
    for value in element:
        assert {s.data.shape[0] for s in value.value.addressable_shards} == {rows // 8}
    # Each replica still reads its rows whole.
    local = hybrid.experimental_local_results(element[0])
    np.testing.assert_array_equal(np.concatenate(local), x)


# strategy.run -------------------------------------------------------------------------
def test_run_is_per_replica_with_the_variables_split_inside():
    strategy = MESHES["2x2x2"]()
    state = _state(strategy)
    x, _ = _batches(1, 8)
    dataset = strategy.experimental_distribute_dataset([x[0]])
    (batch,) = list(dataset)

    def replica_fn(params, rows):
        ctx = jstrategy.get_replica_context()
        out = MLP().apply({"params": params}, rows)
        total = ctx.all_reduce("sum", jnp.sum(out))
        return total, ctx.replica_id_in_sync_group + jnp.zeros(()), rows.shape[0]

    total, ids, rows = strategy.run(replica_fn, args=(state.params, batch))
    whole = float(jnp.sum(MLP().apply({"params": jax.device_get(state.params)}, x[0])))
    assert [float(t) for t in strategy.experimental_local_results(total)] == pytest.approx(
        [whole] * 2, rel=1e-5
    )
    assert [int(i) for i in strategy.experimental_local_results(ids)] == [0, 1]
    assert strategy.experimental_local_results(rows) == (4, 4)  # each replica its rows
    assert float(strategy.reduce("SUM", total, axis=None)) == pytest.approx(2 * whole, rel=1e-5)


# Checkpoints --------------------------------------------------------------------------
def _strategies():
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    return [
        jstrategy.OneDeviceStrategy("cpu:0"),
        jstrategy.MirroredStrategy(),
        jstrategy.experimental.FSDPStrategy(min_shard_size=0),
        jstrategy.experimental.ModelParallelStrategy(layout_map),
        MESHES["1x4x2"](),
    ]


@pytest.mark.slow
def test_checkpoints_cross_to_every_other_strategy_and_back(tmp_path):
    # Saved under (2, 2, 2), restored under each other strategy in turn, each saving again
    # for the next; the last restore is into another hybrid mesh. Values exact throughout.
    hybrid = MESHES["2x2x2"]()
    x, y = _batches(2)
    state, _ = helpers.train_steps(hybrid, _make, _LOSS, x, y)
    targets = [(_state(s), s) for s in _strategies()]
    restored = helpers.restore_across(tmp_path, state, targets)
    for (_, strategy), got in zip(targets, restored, strict=True):
        _assert_kept(got, strategy)
    back = helpers.restore_across(tmp_path / "back", restored[-2], [(_state(hybrid), hybrid)])
    _assert_kept(back[0], hybrid)


# The compiled step's collectives ----------------------------------------------------------
def _compiled_step(strategy, rows=48):
    state = _state(strategy)
    x, y = _batches(1, rows)
    lowered = training.make_train_step(_LOSS, strategy=strategy).lower(
        state, distribute_batch(strategy, (x[0], y[0]))
    )
    return lowered.compile().as_text()


def _hosts_spanned(strategy, text):
    """Each collective of a compiled program: ``(kind, hosts its first group spans)``."""
    host_of = {d: h for h, ids in enumerate(strategy.hosts) for d in ids}
    flat = [d.id for d in strategy.mesh.devices.flat]  # positions -> devices
    spans = []
    for kind, group in collective_groups(text):
        assert group is not None, kind
        spans.append((kind, len({host_of[flat[p]] for p in group})))
    return spans


def _dot_rows(text):
    """The first dimension of every matrix product's result in compiled HLO text."""
    return {int(m) for m in re.findall(r"= f32\[(\d+),\d+\][^ ]* dot\(", text)}


@pytest.mark.slow
def test_fsdp_gathers_stay_within_a_host_and_only_the_gradient_all_reduce_crosses():
    strategy = MESHES["2x2x2"]()
    text = _compiled_step(strategy)
    spans = _hosts_spanned(strategy, text)
    gathers = [n for kind, n in spans if kind == "all-gather"]
    assert gathers and all(n == 1 for n in gathers), spans
    crossing = {kind for kind, n in spans if n > 1}
    assert crossing == {"all-reduce"}, spans  # the replicas' gradients (and the loss sums)
    # Each device computes on its 48 / (2 replicas x 2 fsdp) = 12 rows, never a replica's 24.
    rows = _dot_rows(text)
    assert 12 in rows and not rows & {24, 48}, rows
    # FSDP laid across the hosts instead: its all-gathers cross them (the test can fail).
    across = _hybrid(2, 2, 2, dcn_replicas=1, dcn_fsdp=2)
    spans = _hosts_spanned(across, _compiled_step(across))
    assert any(kind == "all-gather" and n > 1 for kind, n in spans), spans


# Two processes, one per host ----------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
def test_two_workers_one_per_host_follow_one_process_over_eight_devices(tmp_path):
    # Two processes x four devices through the launcher: each process is one host, holding
    # one replica split four ways (FSDP 2 x tensor 2), so each holds a whole copy of the
    # kernel in four pieces. Fit, get_weights, model.save and load_model as one process.
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "4", "--timeout", "240",
        str(ROOT / "tests" / "multi_worker_train.py"), "--out", str(tmp_path), "--fit",
        "--hybrid",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
    # The workers import this checkout's jstrategy, wherever the installed one points.
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", PYTHONPATH=path)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "2 replicas over 2 workers, chief=True" in out
    assert "2 replicas over 2 workers, chief=False" in out
    assert out.count("processes [[[0, 0], [0, 0]], [[1, 1], [1, 1]]]") == 2  # replica = host
    assert out.count("kernel P('fsdp', 'tensor')") == 2
    assert out.count("kernel pieces here: 4 of 160 elements, 40 per device") == 2, out[-3000:]
    assert out.count("saved and loaded") == 2
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    import multi_worker_train

    expected = multi_worker_train.fit_model(
        multi_worker_train.hybrid_strategy(devices=[f"cpu:{i}" for i in range(8)], dcn_replicas=2)
    )
    assert len(workers[0].files) == len(expected) > 0
    for i, w in enumerate(expected):
        np.testing.assert_array_equal(workers[0][f"w{i}"], workers[1][f"w{i}"])
        np.testing.assert_allclose(workers[0][f"w{i}"], w, rtol=1e-5, atol=1e-5)
