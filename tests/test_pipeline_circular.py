"""PipelineStrategy(num_repeats=R): circular GPipe and interleaved 1F1B.

The schedules themselves against plain JAX (the virtual stages applied in order, and
``jax.grad`` of them), then the train step and `Model.fit` against OneDeviceStrategy within
1e-5, checkpoints crossing to every other strategy and back exactly, and the mistakes
refused by name. The model is test_pipeline's (BatchNorm and dropout before a Repeated
block of 8 layers, a head after it).
"""

import re
from pathlib import Path

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_pipeline import FEATURES
from test_pipeline import ROWS
from test_pipeline import Net
from test_pipeline import _data
from test_pipeline import _fit
from test_pipeline import _loss
from test_pipeline import _max_difference
from test_pipeline import _scale
from test_pipeline import _state

import jstrategy
from jstrategy import training
from jstrategy._src import hlo
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.pipeline import circular
from jstrategy._src.pipeline import schedules
from jstrategy.experimental import PipelineStrategy
from jstrategy.experimental import Repeated

SCHEDULES = ["gpipe", "1f1b"]
# (stages, repeats, microbatches): two and four stages, two virtual stages each.
SHAPES = [(2, 2, 4), (4, 2, 8)]


def _circular(schedule, stages, repeats, micro, **options):
    return PipelineStrategy(
        num_stages=stages,
        num_microbatches=micro,
        schedule=schedule,
        num_repeats=repeats,
        **options,
    )


# The schedules against plain JAX --------------------------------------------------------------
def _layer(w, h):
    return jnp.tanh(h @ w) + h


def _stage(w, h):  # one virtual stage: its K layers in order
    return jax.lax.scan(lambda h, wl: (_layer(wl, h), None), h, w)[0]


@pytest.mark.parametrize(
    ("stages", "repeats", "micro"),
    [
        (2, 3, 2),
        pytest.param(2, 2, 4, marks=pytest.mark.slow),
        pytest.param(4, 2, 8, marks=pytest.mark.slow),
    ],
)
def test_the_schedules_apply_the_virtual_stages_in_layer_order(stages, repeats, micro):
    strategy = _circular("gpipe", stages, repeats, micro)
    config = strategy.pipeline
    per = 2 if stages == 2 else 1  # layers per virtual stage
    layers, width, rows = per * stages * repeats, 3, 2 * micro
    w = jax.random.normal(jax.random.key(0), (layers, width, width)) / 2
    x = jax.random.normal(jax.random.key(1), (rows, width))
    target = jax.random.normal(jax.random.key(2), (rows, width))

    def in_order(w, x):
        return _stage(w, x)  # every layer, one after the other

    def loss(out, t):
        return jnp.sum((out - t) ** 2)

    def piped(w, x):
        return schedules.gpipe(_layer, circular.stage_layout(w, config), x, config)

    np.testing.assert_allclose(jax.jit(piped)(w, x), in_order(w, x), atol=1e-6)
    want_w, want_x = jax.grad(lambda w, x: loss(in_order(w, x), target), argnums=(0, 1))(w, x)
    got_w, got_x = jax.jit(jax.grad(lambda w, x: loss(piped(w, x), target), argnums=(0, 1)))(w, x)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-5)

    # Interleaved 1F1B: the loss of each microbatch at the last repeat, gradients by hand.
    size = rows // micro

    def head(p, h, m):
        t = jax.lax.dynamic_slice_in_dim(target, m * size, size)
        return loss(h * p, t), jnp.sum(h)

    scale = jnp.asarray(1.5)

    def run(w, x, p):
        return schedules.one_f_one_b(_stage, circular.stage_layout(w, config), x, head, p, config)

    value, aux, d_head, d_stages, d_x = jax.jit(run)(w, x, scale)
    ref = lambda w, x, p: loss(in_order(w, x) * p, target)  # noqa: E731
    want = jax.grad(ref, argnums=(0, 1, 2))(w, x, scale)
    np.testing.assert_allclose(value, ref(w, x, scale), rtol=1e-5)
    np.testing.assert_allclose(aux, jnp.sum(in_order(w, x).reshape(micro, -1), 1), rtol=1e-5)
    np.testing.assert_allclose(
        circular.layer_layout(d_stages, config), want[0], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(d_x, want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_head, want[2], rtol=1e-5)


# The train step and Model.fit against one device ----------------------------------------------
STEPS = 3
_ONE_DEVICE = {}


def _one_device_steps():
    if not _ONE_DEVICE:
        one = jstrategy.OneDeviceStrategy("cpu:0")
        _ONE_DEVICE["steps"] = helpers.train_steps(one, _state, _loss, *_data(STEPS))
    return _ONE_DEVICE["steps"]


# The variables also split over the replicas (2 stages x 4 replicas): the 1F1B step then
# gathers each layer from the replicas' slices, in the circular layout.
SPLIT = {"shard_over_replicas": True, "min_shard_size": 0}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stages", "repeats", "micro", "options"),
    [(*shape, {}) for shape in SHAPES] + [(2, 2, 4, SPLIT)],
    ids=[*(f"{s}x{r}-m{m}" for s, r, m in SHAPES), "2x2-m4-split"],
)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_train_step_follows_one_device(schedule, stages, repeats, micro, options):
    x, y = _data(STEPS)
    one, want_history = _one_device_steps()
    strategy = _circular(schedule, stages, repeats, micro, **options)
    state, history = helpers.train_steps(strategy, _state, _loss, x, y)
    got, want = helpers.checkpoint_leaves(state), helpers.checkpoint_leaves(one)
    assert sorted(got) == sorted(want)
    for path, value in got.items():
        np.testing.assert_allclose(value, want[path], atol=1e-5, rtol=0, err_msg=str(path))
    for m, e in zip(history, want_history, strict=True):
        np.testing.assert_allclose(m["loss"], e["loss"], atol=1e-5)
    # The stacked layers stay split over the stages in layer order: a checkpoint's layout.
    kernel = state.params["Repeated_0"]["stacked_layers"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec[0] == "stage"


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "repeats", "micro"), SHAPES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_model_fit_follows_one_device(schedule, stages, repeats, micro):
    expected, expected_history = _fit(jstrategy.OneDeviceStrategy("cpu:0"), epochs=1)
    model, history = _fit(_circular(schedule, stages, repeats, micro), epochs=1)
    x, y = helpers.classification_data(64, FEATURES)

    def outcome(model, history):
        return [
            model.get_weights(),
            [np.asarray(history["loss"])],
            [np.asarray(model.evaluate(x, y, batch_size=ROWS, verbose=0))],
            [model.predict(x, batch_size=ROWS, verbose=0)],
        ]

    got, want = outcome(model, history), outcome(expected, expected_history)
    for g, w in zip(got, want, strict=True):
        assert _max_difference(g, w) <= 1e-5 * max(1.0, _scale(w))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_receives_its_virtual_stages_and_never_the_whole_variable(schedule):
    strategy = _circular(schedule, 4, 2, 8)
    x, y = _data(1)
    with strategy.scope():
        state = _state()
        step = training.make_train_step(_loss)
    hlo = step.lower(state, distribute_batch(strategy, (x[0], y[0]))).compile().as_text()
    # The stacked variables (6 of them) reach their virtual stages, and their gradients
    # come back, by rounds of collective-permutes of one chunk per stage: nothing gathers
    # a whole variable (which would undo the split over the stages).
    assert "all-gather" not in hlo
    assert hlo.count("collective-permute") >= 2 * 6 * 2, hlo.count("collective-permute")


# Memory and traffic of the weights --------------------------------------------------------------
WIDTH, HIDDEN, WIDE_LAYERS = 64, 256, 8


class _WideBlock(nn.Module):
    """Two wide dense layers: 129 KiB of weights against one row's 1 KiB activations."""

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(WIDTH)(jnp.tanh(nn.Dense(HIDDEN)(x)))


class _WideNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = Repeated(_WideBlock(), num_layers=WIDE_LAYERS)(nn.Dense(WIDTH)(x))
        return nn.Dense(3)(h)


def _wide_step(micro, repeats, stages=4):
    """The compiled train step of `_WideNet`, one-row microbatches, and its strategy."""
    strategy = PipelineStrategy(num_stages=stages, num_microbatches=micro, num_repeats=repeats)
    rows = micro * strategy.num_replicas_in_sync
    x = np.random.default_rng(0).normal(size=(rows, FEATURES)).astype(np.float32)
    y = np.zeros((rows,), np.int32)
    with strategy.scope():
        state = training.create_train_state(
            _WideNet(), optax.sgd(0.1), jnp.ones((1, FEATURES)), rng=0
        )
        step = training.make_train_step(_loss)
    compiled = step.lower(state, distribute_batch(strategy, (x, y))).compile()
    stacked = state.params["Repeated_0"]["stacked_layers"]
    stacked_bytes = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(stacked))
    return compiled, stacked_bytes


@pytest.mark.slow
def test_circular_gpipe_adds_each_layers_gradient_to_one_accumulator():
    # As GPipe's (test_pipeline): one loop over (tick, layer), where a virtual stage's
    # layers inside the loop over the ticks summed each tick's virtual stage's gradient in
    # a buffer of its own: 0.72 MB of temporaries on the CPU against that loop's 2.60 MB.
    config = PipelineStrategy(num_stages=4, num_microbatches=4, num_repeats=2).pipeline
    width, depth = 256, 4  # a virtual stage's 4 layers: 1 MiB of gradients
    weights = jax.random.normal(jax.random.key(0), (4, 2, depth, width, width)) / width
    on_stages = jax.sharding.NamedSharding(config.mesh, jax.sharding.PartitionSpec("stage"))
    weights = jax.device_put(weights, on_stages)
    x = jax.random.normal(jax.random.key(1), (8, width))

    def loss(ws, x):
        return jnp.sum(schedules.gpipe(_layer, ws, x, config) ** 2)

    def in_order(ws, x):  # virtual stage r * S + s is stage s's repeat r
        return jnp.sum(_stage(jnp.swapaxes(ws, 0, 1).reshape(-1, width, width), x) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(weights, x).compile()
    value, grad = compiled(weights, x)
    expected, expected_grad = jax.value_and_grad(in_order)(weights, x)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-5)
    gradient = depth * width * width * 4  # a virtual stage's, on each device
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < gradient, (temp, gradient)


def test_circular_gpipe_keeps_no_copy_of_the_weights_per_tick():
    # The forward tick loop used to save every tick's selected virtual stage for the
    # backward pass (R * M + S - 1 copies): 4,811 KiB of temporaries at M = 8 and 7,935 KiB
    # at M = 16, where plain GPipe grows by its activations only (836 -> 876 KiB). The
    # backward pass selects them again: 827 and 870 KiB measured.
    def temp(micro, repeats):
        compiled, stacked = _wide_step(micro, repeats)
        return compiled.memory_analysis().temp_size_in_bytes, stacked

    (m8, stacked), (m16, _) = temp(8, 2), temp(16, 2)
    plain16, _ = temp(16, 1)
    stage = stacked // 4  # one stage's layers, per device
    assert m16 <= 1.1 * m8, (m8, m16)
    assert m16 <= plain16 + stage, (m16, plain16, stage)


@pytest.mark.slow
def test_the_weights_relayout_moves_what_the_guide_says():
    # Held in layer order, the stacked weights reach their virtual stages by ppermute and
    # their gradients come back the same way in every step (MaxText holds them at rest and
    # moves none): per device, its stage's share less the chunks that stay, twice. These
    # are the collective-permutes outside the tick loops (the entry computation).
    compiled, stacked = _wide_step(8, 2)
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    devices = 8
    sent = sum(size * sum(a != b for a, b in pairs) for size, pairs in hlo.permute_bytes(entry))
    ratio = sent / devices / stacked
    # S = 4, R = 2: of the 8 chunk moves, stage 0's first and stage 3's last stay put.
    assert ratio == pytest.approx(2 * (6 / 8) / 4), ratio
    guide = Path(__file__).resolve().parents[1] / "docs" / "guides" / "pipeline-parallelism.md"
    prose = " ".join(guide.read_text().split())
    stated = re.search(r"that is ([\d.]+) of the stacked parameters' bytes per device", prose)
    assert stated is not None and float(stated.group(1)) == pytest.approx(ratio), ratio


# Checkpoints ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "other",
    [
        lambda: jstrategy.OneDeviceStrategy("cpu:0"),
        lambda: jstrategy.MirroredStrategy(),
        lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=0),
        lambda: PipelineStrategy(num_stages=4, num_microbatches=4, schedule="1f1b"),
    ],
    ids=["one_device", "mirrored", "fsdp", "pipeline"],
)
def test_circular_checkpoints_cross_to_every_strategy_and_back(tmp_path, other):
    pipelined = _circular("1f1b", 2, 2, 4)
    model, _ = _fit(pipelined, epochs=1)
    # Layer order: the stacked kernel's layer l is what one device applies l-th. Restored
    # under the other strategy, then back into another circular pipeline, leaf by leaf.
    target_strategy = other()
    target, _ = _fit(target_strategy, epochs=0)
    again_strategy = _circular("gpipe", 4, 2, 8)
    again, _ = _fit(again_strategy, epochs=0)
    helpers.restore_across(
        tmp_path, model.state, [(target.state, target_strategy), (again.state, again_strategy)]
    )


# Mistakes, refused before any work ------------------------------------------------------------
def test_an_interleaved_schedule_name_points_to_num_repeats():
    with pytest.raises(ValueError, match=r"got 'interleaved'.*schedule='1f1b', num_repeats=2"):
        PipelineStrategy(num_stages=2, num_microbatches=4, schedule="interleaved")


def test_bad_repeats_are_refused_by_name():
    with pytest.raises(ValueError, match="`num_repeats` must be a positive int; got 0"):
        PipelineStrategy(num_stages=2, num_microbatches=4, num_repeats=0)
    with pytest.raises(ValueError, match="`num_repeats` must be a positive int; got 1.5"):
        PipelineStrategy(num_stages=2, num_microbatches=4, num_repeats=1.5)
    with pytest.raises(
        ValueError,
        match=r"With num_repeats=2, `num_microbatches` must be a multiple of num_stages=4 .*"
        r"got num_microbatches=6. Pass e.g. num_microbatches=8",
    ):
        PipelineStrategy(num_stages=4, num_microbatches=6, num_repeats=2)
    # num_repeats=1 is the non-circular pipeline, whatever the microbatches.
    plain = PipelineStrategy(num_stages=4, num_microbatches=6)
    assert plain.num_repeats == 1 and plain.pipeline.num_repeats == 1
    strategy = PipelineStrategy(num_stages=4, num_microbatches=4, num_repeats=2)
    with (
        strategy.scope(),
        pytest.raises(
            ValueError,
            match=r"stacks 4 layers, which cannot be split over num_stages=4 pipeline stages "
            r"x num_repeats=2 virtual stages each: 4 does not divide by 8",
        ),
    ):
        training.create_train_state(Net(layers=4), optax.adam(0.01), jnp.ones((1, FEATURES)), rng=0)


class _WideBlock(nn.Module):
    """A residual block whose wide intermediate is what remat recomputes."""

    @nn.compact
    def __call__(self, h):
        return h + nn.Dense(h.shape[-1])(jnp.tanh(nn.Dense(32 * h.shape[-1])(h)))


class _RematNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = Repeated(training.remat(_WideBlock)(), num_layers=8)(nn.Dense(32)(x))
        return nn.Dense(1)(h)


@pytest.mark.slow
@pytest.mark.parametrize("repeats", [1, 2], ids=["gpipe", "circular"])
def test_the_steps_remat_applies_under_the_circular_schedule(repeats):
    # The tick's checkpoint saved every value but the weights' selection, the layers' own
    # remat's included: under 2 repeats remat=True left the temporaries as they were
    # (the benchmark decoder on 8 CPU devices: 32.9 MiB without, 33.7 with; GPipe 45.1 and
    # 7.2); now a value is saved only where the step's policy saves it too.
    x, y = np.ones((256, 16), np.float32), np.ones((256, 1), np.float32)

    def temporaries(remat):
        strategy = PipelineStrategy(num_stages=4, num_microbatches=4, num_repeats=repeats)
        with strategy.scope():
            state = training.create_train_state(_RematNet(), optax.sgd(0.1), x[:1])
            step = training.make_train_step(lambda t, p: jnp.mean((t - p) ** 2, -1), remat=remat)
        compiled = step.lower(state, distribute_batch(strategy, (x, y))).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    without, remat = temporaries(None), temporaries(True)
    assert remat < 0.6 * without, (remat, without)
