"""Distributed input: layout, padding and masks, prefetch, errors, and a CTL correctness check."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jstrategy
from jstrategy._src.input.datasets import distribute_dataset
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.input.rows import process_local_batch
from jstrategy._src.input.rows import process_row_slices
from jstrategy._src.input.rows import replica_row_slices


def _rows(n, features=3, start=0):
    return np.arange(start, start + n * features, dtype=np.float32).reshape(n, features)


def _batches(sizes, features=3):
    out, start = [], 0
    for size in sizes:
        out.append({"x": _rows(size, features, start), "y": np.arange(size, dtype=np.int32)})
        start += size * features
    return out


def _identity(x):
    return x


def _local(strategy, value):
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


# distribute_batch -------------------------------------------------------------------------
def test_distribute_batch_pads_to_a_multiple_and_masks(strategy):
    n = strategy.num_replicas_in_sync
    rows = 5
    batch = {"x": _rows(rows), "y": np.arange(rows, dtype=np.int32)}
    dist = distribute_batch(strategy, batch)
    static = -(-rows // n) * n
    assert isinstance(dist["x"], jstrategy.PerReplica) and not dist["x"].stacked
    assert dist["x"].value.shape == (static, 3)
    assert dist["x"].value.sharding == strategy.batch_sharding()
    assert dist["x"].mask is dist["y"].mask
    np.testing.assert_array_equal(np.asarray(dist["x"].mask), np.arange(static) < rows)
    padded = np.zeros((static, 3), np.float32)
    padded[:rows] = batch["x"]
    np.testing.assert_array_equal(np.asarray(dist["x"].value), padded)


def test_replica_i_gets_the_ith_contiguous_slice(strategy):
    n = strategy.num_replicas_in_sync
    x = _rows(2 * n)
    dist = distribute_batch(strategy, x)
    seen = strategy.run(_identity, (dist,))
    for i, got in enumerate(_local(strategy, seen)):
        np.testing.assert_array_equal(got, x[2 * i : 2 * i + 2])


def test_row_mask_reaches_the_replica_context(strategy):
    n = strategy.num_replicas_in_sync
    dist = distribute_batch(strategy, _rows(n + 1), global_batch_size=2 * n)

    def fn(x):
        return jstrategy.get_replica_context().row_mask

    masks = np.concatenate(_local(strategy, strategy.run(fn, (dist,))))
    np.testing.assert_array_equal(masks, np.arange(2 * n) < n + 1)


def test_distribute_batch_accepts_jax_arrays(one_device):
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    full = distribute_batch(strategy, jnp.ones((4, 2)))
    assert full.value.sharding == strategy.batch_sharding()
    partial = distribute_batch(strategy, jnp.ones((3, 2)), global_batch_size=4)
    np.testing.assert_array_equal(np.asarray(partial.value)[:, 0], [1, 1, 1, 0])


# Dataset forms ---------------------------------------------------------------------------
class _NumpyIterable:
    """Something like tf.data: iterating it is wrong, as_numpy_iterator is right."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        raise AssertionError("tf.data-like datasets must be read through as_numpy_iterator")

    def as_numpy_iterator(self):
        return iter(self.batches)


class _Loader:
    """Something like a grain DataLoader: a re-iterable with no len()."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


@pytest.mark.parametrize("form", ["list", "generator_function", "as_numpy_iterator", "loader"])
def test_dataset_forms_iterate_twice_with_the_same_elements(form):
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    batches = _batches([4, 4, 3])
    dataset = {
        "list": batches,
        "generator_function": lambda: (b for b in batches),
        "as_numpy_iterator": _NumpyIterable(batches),
        "loader": _Loader(batches),
    }[form]
    dist = strategy.experimental_distribute_dataset(dataset)
    for _ in range(2):
        elements = list(dist)
        assert len(elements) == 3
        for element, batch in zip(elements, batches, strict=True):
            rows = len(batch["y"])
            np.testing.assert_array_equal(np.asarray(element["x"].value)[:rows], batch["x"])
            assert int(np.asarray(element["y"].mask).sum()) == rows


def test_one_shot_iterator_iterates_once_then_says_how_to_fix():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    dist = strategy.experimental_distribute_dataset(iter(_batches([2, 2])))
    assert len(list(dist)) == 2
    with pytest.raises(ValueError, match="iterated only once.*generator function"):
        iter(dist)


def test_len_follows_the_source():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    assert len(strategy.experimental_distribute_dataset(_batches([2, 2, 1]))) == 3
    with pytest.raises(TypeError, match="no len"):
        len(strategy.experimental_distribute_dataset(_Loader(_batches([2]))))


def test_element_spec_before_iterating_keeps_the_first_batch():
    strategy = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    pulled = []

    def gen():
        for batch in _batches([6, 6, 1]):
            pulled.append(1)
            yield batch

    dist = strategy.experimental_distribute_dataset(gen())
    spec = dist.element_spec
    assert spec["x"].shape == (8, 3) and spec["x"].dtype == np.float32
    assert spec["y"].shape == (8,) and spec["x"].sharding == strategy.batch_sharding()
    assert dist.global_batch_size == 8
    assert len(pulled) == 1
    assert [int(np.asarray(e["x"].mask).sum()) for e in dist] == [6, 6, 1]


# Padding, masks and compilation ----------------------------------------------------------
def test_partial_and_uneven_batches_reuse_the_compiled_step(strategy):
    n = strategy.num_replicas_in_sync
    sizes = [4 * n, 2 * n - 1, 3, 1]  # full, not divisible, small, smallest
    traces = []

    def step(batch):
        traces.append(1)
        ctx = jstrategy.get_replica_context()
        real = ctx.all_reduce("SUM", jnp.sum(ctx.row_mask.astype(jnp.float32)))
        masked = jnp.sum(batch["x"][:, 0] * ctx.row_mask)
        return ctx.all_reduce("SUM", masked), real

    dist = strategy.experimental_distribute_dataset(_batches(sizes))
    after_first = None
    for _ in range(2):
        for element, batch in zip(dist, _batches(sizes), strict=True):
            total, real = strategy.run(step, (element,))
            after_first = after_first or len(traces)
            assert float(real) == len(batch["y"])
            np.testing.assert_allclose(float(total), batch["x"][:, 0].sum(), rtol=1e-6)
    assert len(traces) == after_first


def test_given_global_batch_size_is_the_static_shape(strategy):
    n = strategy.num_replicas_in_sync
    dist = distribute_dataset(strategy, _batches([n, 2 * n]), global_batch_size=4 * n)
    assert [e["x"].value.shape[0] for e in dist] == [4 * n, 4 * n]


def test_static_size_is_kept_across_epochs():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    epochs = iter([_batches([4, 1]), _batches([3, 3])])
    dist = strategy.experimental_distribute_dataset(lambda: iter(next(epochs)))
    assert [e["x"].value.shape[0] for e in dist] == [4, 4]
    assert [e["x"].value.shape[0] for e in dist] == [4, 4]


# compute_average_loss --------------------------------------------------------------------
def test_compute_average_loss_is_the_mean_over_real_rows(strategy):
    n = strategy.num_replicas_in_sync
    losses = np.arange(1, 2 * n, dtype=np.float32)  # 2n - 1 rows: one padding row
    weights = np.linspace(0.5, 1.5, len(losses)).astype(np.float32)
    dist = distribute_batch(strategy, {"loss": losses, "w": weights})

    def fn(batch):
        plain = jstrategy.compute_average_loss(batch["loss"])
        weighted = jstrategy.compute_average_loss(batch["loss"], sample_weight=batch["w"])
        fixed = jstrategy.compute_average_loss(batch["loss"], global_batch_size=100)
        return plain, weighted, fixed

    plain, weighted, fixed = strategy.reduce("SUM", strategy.run(fn, (dist,)))
    np.testing.assert_allclose(float(plain), losses.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(weighted), (losses * weights).sum() / len(losses), rtol=1e-6)
    np.testing.assert_allclose(float(fixed), losses.sum() / 100, rtol=1e-6)


def test_compute_average_loss_without_a_mask_divides_like_tf(strategy):
    n = strategy.num_replicas_in_sync
    losses = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((3, 2), ctx.replica_id_in_sync_group + 1, np.float32)
    )
    out = strategy.run(jstrategy.compute_average_loss, (losses,))
    # Extra dimensions are summed; the divisor is rows per replica times replicas.
    expected = sum(6.0 * (i + 1) for i in range(n)) / (3 * n)
    np.testing.assert_allclose(float(strategy.reduce("SUM", out)), expected, rtol=1e-6)


def test_compute_average_loss_outside_run_and_its_errors():
    np.testing.assert_allclose(
        float(jstrategy.compute_average_loss(np.array([[1.0], [3.0]]), np.array([1.0, 0.5]))),
        1.25,
    )
    with pytest.raises(ValueError, match="per_example_loss.*scalar"):
        jstrategy.compute_average_loss(jnp.float32(1.0))
    with pytest.raises(ValueError, match="global_batch_size.*positive int.*got 0"):
        jstrategy.compute_average_loss(jnp.ones(2), global_batch_size=0)
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    with strategy.scope(), pytest.raises(RuntimeError, match="cross-replica context"):
        jstrategy.compute_average_loss(jnp.ones(2))
    dist = distribute_batch(strategy, np.ones((4, 1), np.float32))
    with pytest.raises(ValueError, match="per_example_loss` has 2 rows.*has 4"):
        strategy.run(lambda x: jstrategy.compute_average_loss(x[:2, 0]), (dist,))


# Custom training loop correctness (as TF's ctl_correctness_test) --------------------------
def _init_params():
    key1, key2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(key1, (4, 8)) * 0.5,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(key2, (8, 1)) * 0.5,
    }


def _model(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


_TX = optax.sgd(0.1)


def _train_step(params, opt_state, batch):
    ctx = jstrategy.get_replica_context()

    def loss_fn(p):
        per_example = jnp.sum((_model(p, batch["x"]) - batch["y"]) ** 2, axis=-1)
        return jstrategy.compute_average_loss(per_example)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = ctx.all_reduce("SUM", grads)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _ctl_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(66, 4)).astype(np.float32)
    y = (x @ rng.normal(size=(4, 1)) + 0.1).astype(np.float32)
    return [{"x": x[i : i + 32], "y": y[i : i + 32]} for i in range(0, 66, 32)]


def _train(strategy, batches, epochs):
    params = _init_params()
    opt_state = _TX.init(params)
    dist = strategy.experimental_distribute_dataset(batches)
    losses = []
    for _ in range(epochs):
        for element in dist:
            params, opt_state, loss = strategy.run(_train_step, (params, opt_state, element))
            losses.append(float(strategy.reduce("SUM", loss)))
    return jax.tree.map(np.asarray, strategy.experimental_local_results(params)[0]), losses


def _reference(batches, epochs):
    """Plain JAX on the unpadded batches: the mean loss of each real batch."""
    params = _init_params()
    opt_state = _TX.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((_model(p, x) - y) ** 2))(params)
        updates, opt_state = _TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(epochs):
        for batch in batches:
            params, opt_state, loss = step(params, opt_state, batch["x"], batch["y"])
            losses.append(float(loss))
    return jax.tree.map(np.asarray, params), losses


@pytest.mark.slow
def test_ctl_correctness_mirrored_8_matches_one_device_with_a_partial_last_batch(one_device):
    batches = _ctl_data()
    assert [len(b["x"]) for b in batches] == [32, 32, 2]
    epochs = 3
    expected, expected_losses = _reference(batches, epochs)
    for strategy in (one_device, jstrategy.MirroredStrategy()):
        params, losses = _train(strategy, batches, epochs)
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
        for name in expected:
            np.testing.assert_allclose(params[name], expected[name], rtol=1e-5, atol=1e-5)


# distribute_datasets_from_function --------------------------------------------------------
def test_dataset_fn_is_called_once_with_the_input_context(strategy):
    n = strategy.num_replicas_in_sync
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        # Per-replica batches, as TF's tutorials batch them: n + 1 of them, so the second
        # step gets one batch and n - 1 replicas of padding.
        return _batches([2] * n + [1])

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    for _ in range(2):
        elements = list(dist)
        assert [e["x"].value.shape[0] for e in elements] == [2 * n, 2 * n]
        assert [int(np.asarray(e["x"].mask).sum()) for e in elements] == [2 * n, 1]
    assert len(contexts) == 1
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, n)


def test_per_worker_pipeline_gives_each_replica_its_own_batch_as_tf():
    # TF's distribute_datasets_from_function tutorial: the dataset is batched with
    # ctx.get_per_replica_batch_size(GLOBAL) and each local replica takes its own element,
    # so a step trains on GLOBAL rows (it used to take one element and split it, i.e.
    # GLOBAL / num_replicas rows, silently).
    strategy = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    global_batch = 16

    def dataset_fn(ctx):
        per = ctx.get_per_replica_batch_size(global_batch)
        rows = np.arange(64, dtype=np.float32).reshape(64, 1)
        return [rows[i : i + per] for i in range(0, 64, per)]

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    elements = list(dist)
    assert len(elements) == 4
    for step, element in enumerate(elements):
        assert element.value.shape == (global_batch, 1)
        np.testing.assert_array_equal(
            np.asarray(element.value)[:, 0], np.arange(16 * step, 16 * step + 16)
        )
    assert dist.element_spec.shape == (global_batch, 1)
    per_replica = strategy.experimental_local_results(elements[1])
    assert [float(v[0, 0]) for v in per_replica] == [16.0, 20.0, 24.0, 28.0]


def _model_parallel_4x2():
    """Four replicas of two devices each: every device of a replica gets its rows."""
    layout_map = jstrategy.experimental.LayoutMap(
        jstrategy.experimental.DeviceMesh((4, 2), ("batch", "model"))
    )
    return jstrategy.experimental.ModelParallelStrategy(layout_map)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)]),
        _model_parallel_4x2,
    ],
    ids=["mirrored_4", "model_parallel_4x2"],
)
@pytest.mark.parametrize("placement", ["fetch", "host", "place_on_device"])
def test_per_replica_pipelines_feed_their_replica_and_pad_uneven_ends(placement, make):
    strategy = make()
    ids = []

    def dataset_fn(ctx):
        ids.append(ctx.input_pipeline_id)
        per = ctx.get_per_replica_batch_size(8)
        count = 3 if ctx.input_pipeline_id == 0 else 2  # replica 0 has one batch more
        return [np.full((per, 1), ctx.input_pipeline_id, np.float32) for _ in range(count)]

    options = jstrategy.InputOptions(
        experimental_replication_mode=jstrategy.InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=placement == "fetch",
        experimental_place_dataset_on_device=placement == "place_on_device",
    )
    dist = strategy.distribute_datasets_from_function(dataset_fn, options)
    assert ids == [0, 1, 2, 3]
    elements = list(dist)
    assert len(elements) == 3
    first = np.asarray(elements[0].value)[:, 0]
    np.testing.assert_array_equal(first, np.repeat(np.arange(4), 2))
    np.testing.assert_array_equal(np.asarray(elements[2].mask), [1, 1, 0, 0, 0, 0, 0, 0])
    if placement == "host":
        assert isinstance(elements[2].value, np.ndarray)
    else:
        assert elements[2].value.sharding == strategy.batch_sharding()
        seen = strategy.experimental_local_results(strategy.run(lambda x: x, (elements[0],)))
        assert [v[:, 0].tolist() for v in seen] == [[i, i] for i in range(4)]
    assert dist.element_spec.shape == (8, 1)


def test_input_context():
    ctx = jstrategy.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(12) == 3
    assert "input_pipeline_id=1" in repr(ctx)
    default = jstrategy.InputContext()
    assert (default.num_input_pipelines, default.input_pipeline_id) == (1, 0)
    with pytest.raises(ValueError, match="global_batch_size` must be divisible by.*=4; got 10"):
        ctx.get_per_replica_batch_size(10)
    with pytest.raises(ValueError, match="input_pipeline_id` must be an int in"):
        jstrategy.InputContext(num_input_pipelines=2, input_pipeline_id=2)
    with pytest.raises(ValueError, match="num_replicas_in_sync` must be a positive int"):
        jstrategy.InputContext(num_replicas_in_sync=0)


# Options and prefetch --------------------------------------------------------------------
def test_input_options_are_keyword_only_and_validated():
    options = jstrategy.InputOptions()
    assert (
        options.experimental_fetch_to_device and options.experimental_per_replica_buffer_size == 1
    )
    with pytest.raises(TypeError):
        jstrategy.InputOptions(False)
    with pytest.raises(ValueError, match="buffer_size` must be an int >= 0; got -1"):
        jstrategy.InputOptions(experimental_per_replica_buffer_size=-1)
    with pytest.raises(TypeError, match="fetch_to_device` must be a bool"):
        jstrategy.InputOptions(experimental_fetch_to_device="yes")
    with pytest.raises(ValueError, match="replication_mode` must be"):
        jstrategy.InputOptions(experimental_replication_mode="SOMETIMES")
    with pytest.raises(ValueError, match="requires.*PER_REPLICA"):
        jstrategy.InputOptions(
            experimental_place_dataset_on_device=True, experimental_fetch_to_device=False
        )
    with pytest.raises(ValueError, match="cannot both be set"):
        jstrategy.InputOptions(
            experimental_place_dataset_on_device=True,
            experimental_replication_mode=jstrategy.InputReplicationMode.PER_REPLICA,
        )
    per_replica = jstrategy.InputOptions(experimental_replication_mode="per_replica")
    strategy = jstrategy.OneDeviceStrategy("cpu:0")
    with pytest.raises(ValueError, match="only supported by distribute_datasets_from_function"):
        strategy.experimental_distribute_dataset(_batches([2]), per_replica)
    with pytest.raises(TypeError, match="options` must be a jstrategy.InputOptions"):
        strategy.experimental_distribute_dataset(_batches([2]), {"buffer": 1})


@pytest.mark.parametrize("buffer_size", [0, 1, 3])
def test_prefetch_puts_buffer_size_batches_ahead(buffer_size):
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    pulled = []

    def gen():
        for i, batch in enumerate(_batches([2] * 6)):
            pulled.append(i)
            yield batch

    options = jstrategy.InputOptions(experimental_per_replica_buffer_size=buffer_size)
    iterator = iter(strategy.experimental_distribute_dataset(gen, options))
    assert pulled == []  # nothing happens until the first element is asked for
    first = next(iterator)
    assert len(pulled) == 1 + buffer_size
    assert all(isinstance(e["x"].value, jax.Array) for e in iterator._buffer)
    np.testing.assert_array_equal(np.asarray(first["x"].value), _batches([2])[0]["x"])
    assert len(list(iterator)) == 5


def test_source_errors_surface_after_the_batches_before_them():
    strategy = jstrategy.OneDeviceStrategy("cpu:0")

    def gen():
        yield from _batches([2, 2])
        raise OSError("disk gone")

    options = jstrategy.InputOptions(experimental_per_replica_buffer_size=2)
    iterator = iter(strategy.experimental_distribute_dataset(gen, options))
    next(iterator)
    next(iterator)
    with pytest.raises(OSError, match="disk gone"):
        next(iterator)


@pytest.mark.slow
def test_host_elements_stay_numpy_and_still_run(strategy):
    n = strategy.num_replicas_in_sync
    options = jstrategy.InputOptions(experimental_fetch_to_device=False)
    dist = strategy.experimental_distribute_dataset(_batches([n + 1]), options)
    (element,) = list(dist)
    assert isinstance(element["x"].value, np.ndarray) and isinstance(element["x"].mask, np.ndarray)
    assert element["x"].value.shape[0] == 2 * n if n > 1 else 2
    assert dist.element_spec["x"].sharding is None

    def fn(batch):
        return jstrategy.compute_average_loss(batch["x"][:, 0])

    host = float(strategy.reduce("SUM", strategy.run(fn, (element,))))
    device = distribute_batch(strategy, _batches([n + 1])[0])
    np.testing.assert_allclose(host, float(strategy.reduce("SUM", strategy.run(fn, (device,)))))


# Errors ----------------------------------------------------------------------------------
def _first(dataset, **kwargs):
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    return list(distribute_dataset(strategy, dataset, **kwargs))


def test_ragged_batch_names_the_leaves():
    batch = {"x": np.ones((4, 2)), "y": np.ones(3)}
    with pytest.raises(ValueError, match=r"batch 0 is ragged: leaf \['y'\] has 3 rows.*\['x'\]"):
        _first([batch])
    with pytest.raises(ValueError, match=r"`batch` is ragged"):
        distribute_batch(jstrategy.OneDeviceStrategy("cpu:0"), batch)


def test_batch_unlike_the_first_is_rejected():
    with pytest.raises(ValueError, match=r"batch 1: leaf \['x'\] has rows of shape \(4,\).*\(3,\)"):
        _first(_batches([2]) + _batches([2], features=4))
    with pytest.raises(ValueError, match=r"batch 1: leaf \['y'\].*dtype float32.*int32"):
        _first([*_batches([2]), {"x": _rows(2), "y": np.ones(2, np.float32)}])
    with pytest.raises(ValueError, match="batch 1 has structure"):
        _first([*_batches([2]), (_rows(2), np.ones(2))])


def test_non_array_and_scalar_leaves_are_rejected():
    with pytest.raises(TypeError, match=r"leaf \['name'\] is a str.*np.asarray"):
        _first([{"x": _rows(2), "name": "cat"}])
    with pytest.raises(TypeError, match=r"leaf \['t'\] is a float32"):
        _first([{"x": _rows(2), "t": np.float32(1.0)}])
    with pytest.raises(ValueError, match=r"leaf \['t'\] is a scalar.*leading batch dimension"):
        _first([{"x": _rows(2), "t": np.array(1.0)}])
    with pytest.raises(TypeError, match=r"dtype object"):
        _first([{"x": np.array([np.ones(2), np.ones(3)], dtype=object)}])


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="`dataset` yielded no batches.*generator function"):
        _first([])
    with pytest.raises(ValueError, match="yielded no batches"):
        jstrategy.OneDeviceStrategy("cpu:0").experimental_distribute_dataset([]).element_spec  # noqa: B018


def test_batch_larger_than_the_static_size_is_an_error():
    with pytest.raises(ValueError, match=r"batch 1 has 6 rows, more than.*4.*global_batch_size=6"):
        _first(_batches([4, 6]))
    with pytest.raises(ValueError, match=r"batch 0 has 6 rows.*from global_batch_size"):
        _first(_batches([6]), global_batch_size=4)


def test_bad_dataset_and_global_batch_size_arguments():
    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with pytest.raises(TypeError, match=r"`dataset` must be an iterable.*got a dict.*\[batch\]"):
        strategy.experimental_distribute_dataset({"x": _rows(2)})
    with pytest.raises(TypeError, match="`dataset` must be an iterable"):
        strategy.experimental_distribute_dataset(42)
    with pytest.raises(ValueError, match=r"multiple of num_replicas_in_sync=2.*got 3.*=4"):
        distribute_dataset(strategy, _batches([2]), global_batch_size=3)
    with pytest.raises(ValueError, match=r"multiple of num_replicas_in_sync=2.*got 5"):
        distribute_batch(strategy, _rows(2), global_batch_size=5)
    with pytest.raises(TypeError, match="`dataset_fn` must be callable"):
        strategy.distribute_datasets_from_function(_batches([2]))
    with pytest.raises(TypeError, match="`dataset_fn` returned None"):
        strategy.distribute_datasets_from_function(lambda ctx: None)


# Multi-process layout (pure functions, fake process assignments) -------------------------
def test_replica_row_slices():
    assert replica_row_slices(6, 3) == (slice(0, 2), slice(2, 4), slice(4, 6))
    with pytest.raises(ValueError, match="multiple of the number of replicas"):
        replica_row_slices(7, 2)


@pytest.mark.parametrize(
    "owners",
    [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1], [1, 0, 0, 1], [0, 1, 2, 3]],
    ids=["one", "blocks", "interleaved", "split", "one_each"],
)
def test_each_process_feeds_exactly_its_replicas_rows(owners):
    static, real = 8, 5
    x = _rows(real)
    per = static // len(owners)
    rebuilt = np.zeros((static, 3), np.float32)
    rebuilt_mask = np.zeros(static, bool)
    for process in sorted(set(owners)):
        slices = process_row_slices(static, owners, process)
        (local,), mask = process_local_batch([x], real, static, slices)
        assert len(local) == per * owners.count(process) == len(mask)
        # Local rows are the process's replicas' rows in mesh order, as
        # jax.make_array_from_process_local_data expects.
        replicas = [i for i, p in enumerate(owners) if p == process]
        for k, replica in enumerate(replicas):
            rows = slice(replica * per, (replica + 1) * per)
            rebuilt[rows] = local[k * per : (k + 1) * per]
            rebuilt_mask[rows] = mask[k * per : (k + 1) * per]
    expected = np.zeros((static, 3), np.float32)
    expected[:real] = x
    np.testing.assert_array_equal(rebuilt, expected)
    np.testing.assert_array_equal(rebuilt_mask, np.arange(static) < real)
    assert process_row_slices(static, owners, 7) == ()


def test_contiguous_full_rows_are_views_not_copies():
    x = _rows(8)
    slices = process_row_slices(8, [0, 0, 1, 1], 1)
    (local,), mask = process_local_batch([x], 8, 8, slices)
    assert np.shares_memory(local, x) and mask.all()
    (whole,), _ = process_local_batch([x], 8, 8, None)
    assert whole is x


# Multi-process, for real: two processes with two CPU devices each ------------------------
_MULTI_PROCESS_SCRIPT = r"""
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import jax.numpy as jnp
import numpy as np
import jstrategy
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.strategy import Strategy

devices = jax.devices()
if sys.argv[3] == "interleaved":
    devices = [devices[0], devices[2], devices[1], devices[3]]
strategy = Strategy(devices)
x = np.arange(12, dtype=np.float32).reshape(6, 2)

def fn(batch):
    ctx = jstrategy.get_replica_context()
    total = ctx.all_reduce("SUM", jnp.sum(batch[:, 0] * ctx.row_mask))
    return total, jstrategy.compute_average_loss(batch[:, 0])

def check(element, rows):
    total, loss = strategy.run(fn, (element,))
    assert element.value.shape == (8, 2), element.value.shape
    assert float(total.addressable_data(0)) == x[:rows, 0].sum()
    mean = float(strategy.reduce("SUM", loss).addressable_data(0))
    assert abs(mean - x[:rows, 0].mean()) < 1e-6, mean

check(distribute_batch(strategy, x), 6)
for element, rows in zip(strategy.experimental_distribute_dataset([x, x[:3]]), [6, 3]):
    check(element, rows)
contexts = []

def dataset_fn(ctx):
    # One batch per local replica, as TF: rows [0:2], [2:3] for process 0; [3:5], [5:6] for 1.
    contexts.append(ctx)
    start = 3 * ctx.input_pipeline_id
    return [x[start : start + 2], x[start + 2 : start + 3]]

for element in strategy.distribute_datasets_from_function(dataset_fn):
    check(element, 6)
(ctx,) = contexts
assert (ctx.num_input_pipelines, ctx.input_pipeline_id) == (2, jax.process_index()), ctx
print("OK", jax.process_index(), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="gloo CPU collectives are Linux-only")
@pytest.mark.parametrize("layout", ["blocks", "interleaved"])
def test_two_processes_each_feed_their_own_rows(layout):
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MULTI_PROCESS_SCRIPT, f"localhost:{port}", str(i), layout],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0 and f"OK {i}" in out, out[-3000:]


def test_rows_reach_the_mesh_by_one_route():
    # Datasets, per-replica pipelines, distribute_batch, per-replica values and fit's
    # arrays all place host rows with `input/placement.py`'s `put_rows`: no other module
    # builds a global array from per-process or per-device pieces.
    package = pathlib.Path(jstrategy.__file__).parent
    builders = ("make_array_from_process_local_data(", "make_array_from_single_device_arrays(")
    callers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if any(b in path.read_text(encoding="utf-8") for b in builders)
    )
    assert callers == ["_src/input/placement.py"]
