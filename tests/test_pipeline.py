"""PipelineStrategy: a Repeated block's layers over stages, parity with OneDeviceStrategy.

The parity suite: for the same global batches, 20 steps of every pipelined configuration
(stages x replicas, microbatches, schedule, variables also split over the replicas) end
where OneDeviceStrategy's 20 steps end, within 1e-5, with dropout and BatchNorm outside
the repeated block; through `make_train_step` and `Model.fit` (several steps per
execution, gradient accumulation, a precision policy). Then: the compiled step really
hands microbatches between stages (collective-permutes in its HLO, each stage holding
its layers only), checkpoints cross between pipelined and other strategies, and every
mistake is refused before any work, by name.
"""

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import parity_zoo
import pytest

import jstrategy
from jstrategy import training
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.names import path_names
from jstrategy.experimental import PipelineSchedule
from jstrategy.experimental import PipelineStrategy
from jstrategy.experimental import Repeated

STEPS = 20
ROWS = 32  # divides into 8 replicas x 4 microbatches, 2 x 16, 4 x 8
FEATURES = 5
HIDDEN = 16
LAYERS = 8


class Block(nn.Module):
    """A residual MLP layer (no state, no randomness): what Repeated repeats."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(2 * x.shape[-1])(h)))


class Net(nn.Module):
    """Dense, BatchNorm and dropout before a Repeated block of LAYERS layers, then a head.

    BatchNorm and dropout run on every stage, outside the pipeline: the strategy keeps
    their global-batch semantics there."""

    axis_name: str = jstrategy.REPLICA_AXIS
    layers: int = LAYERS
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool = False):
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would
        # turn into full-size steps of either sign.
        h = nn.Dense(HIDDEN, use_bias=False)(x)
        h = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(h)
        h = nn.Dropout(self.dropout, deterministic=not train)(h)
        h = Repeated(Block(), num_layers=self.layers)(h)
        return nn.Dense(3)(h)


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _data(steps=STEPS, rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, rows, FEATURES)).astype(np.float32)
    y = np.argmax(x[..., :3], axis=-1).astype(np.int32)
    return x, y


CONFIGS = {
    "stages2x4_m4": dict(num_stages=2, num_microbatches=4),
    "stages4x2_m8": dict(num_stages=4, num_microbatches=8),
    "stages8x1_m16": dict(num_stages=8, num_microbatches=16),
    "stages2x4_m2_fsdp": dict(
        num_stages=2, num_microbatches=2, shard_over_replicas=True, min_shard_size=0
    ),
}
SCHEDULES = [s.value for s in PipelineSchedule]


def _pipeline(name, schedule):
    return PipelineStrategy(**CONFIGS[name], schedule=schedule)


def _state(rng=0):
    net = Net(axis_name=jstrategy.get_strategy().axis_name)
    return training.create_train_state(net, optax.adam(0.01), jnp.ones((1, FEATURES)), rng=rng)


def _train(strategy, steps=STEPS):
    return helpers.train_steps(strategy, _state, _loss, *_data(steps))


def _arrays(state):
    leaves = jax.tree.leaves(jax.device_get(state.variables))
    return [np.asarray(x) for x in leaves if np.issubdtype(np.asarray(x).dtype, np.floating)]


_ORACLES = {}


def _oracle():
    if "one_device" not in _ORACLES:
        state, history = _train(jstrategy.OneDeviceStrategy("cpu:0"))
        _ORACLES["one_device"] = (_arrays(state), history)
    return _ORACLES["one_device"]


def _assert_stages_hold_their_layers(state, strategy):
    """Every stacked leaf (parameters and Adam's moments) split over the stages; every leaf
    where `variable_sharding` keeps it."""
    stacked = 0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        path = path_names(keypath)
        want = strategy.variable_sharding(leaf, path)
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (path, leaf.sharding, want)
        if "stacked_layers" in path:
            stacked += 1
            assert leaf.sharding.spec[0] == "stage", path
            assert leaf.addressable_shards[0].data.shape[0] == LAYERS // strategy.num_stages
    assert stacked == 3 * 6  # params, mu, nu of 2 Dense (kernel, bias) + LayerNorm (2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_pipelined_trajectory_matches_one_device_after_20_steps(config, schedule):
    expected, expected_history = _oracle()
    strategy = _pipeline(config, schedule)
    state, history = _train(strategy)
    _assert_stages_hold_their_layers(state, strategy)
    got = _arrays(state)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert expected_history[-1]["loss"] < expected_history[0]["loss"]  # it moved
    for m, e in zip(history, expected_history, strict=True):
        np.testing.assert_allclose(m["loss"], e["loss"], atol=1e-5)
        np.testing.assert_allclose(m["accuracy"], e["accuracy"], atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_compiled_step_hands_microbatches_between_stages(schedule):
    strategy = PipelineStrategy(num_stages=4, num_microbatches=8, schedule=schedule)
    x, y = _data(1)
    with strategy.scope():
        state = _state()
        step = training.make_train_step(_loss)
    batch = distribute_batch(strategy, (x[0], y[0]))
    hlo = step.lower(state, batch).compile().as_text()
    # The forward's hand-offs and their transposes (the backward's) in the one program.
    assert hlo.count("collective-permute") >= 2, hlo.count("collective-permute")
    # Without the strategy (OneDevice, FSDP) the same model has none.
    fsdp = jstrategy.experimental.FSDPStrategy(min_shard_size=0)
    with fsdp.scope():
        state = _state()
        step = training.make_train_step(_loss)
    hlo = step.lower(state, distribute_batch(fsdp, (x[0], y[0]))).compile().as_text()
    assert "collective-permute" not in hlo


def _fit(strategy, steps_per_execution=1, epochs=2, dtype_policy=None, **compile_kwargs):
    x, y = helpers.classification_data(64, FEATURES)
    with strategy.scope():
        model = jstrategy.Model(
            Net(axis_name=strategy.axis_name),
            input_shape=(FEATURES,),
            seed=0,
            dtype_policy=dtype_policy,
        )
        model.compile(
            optax.adam(0.01),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
            **compile_kwargs,
        )
        history = model.fit(x, y, batch_size=ROWS, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        dict(steps_per_execution=1),
        dict(steps_per_execution=2),
        dict(gradient_accumulation_steps=2),
        dict(dtype_policy="mixed_bfloat16"),
    ],
    ids=["spe1", "spe2", "accumulation2", "mixed_bfloat16"],
)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_model_fit_matches_one_device(options, schedule):
    expected, expected_history = _fit(jstrategy.OneDeviceStrategy("cpu:0"), **options)
    pipelined = PipelineStrategy(num_stages=2, num_microbatches=4, schedule=schedule)
    model, history = _fit(pipelined, **options)
    x, y = helpers.classification_data(64, FEATURES)

    def outcome(model, history):
        return [
            model.get_weights(),
            [np.asarray(history["loss"])],
            [np.asarray(model.evaluate(x, y, batch_size=ROWS, verbose=0))],
            [model.predict(x, batch_size=ROWS, verbose=0)],  # the layers in order
        ]

    got, want = outcome(model, history), outcome(expected, expected_history)
    # 1e-5 of each quantity's scale (the head's weights reach 6 here, where float32's
    # spacing is 5e-7: 1F1B sums each microbatch's gradient, an order of its own).
    tolerances = [1e-5 * max(1.0, _scale(w)) for w in want]
    if "dtype_policy" in options:
        # Under bfloat16 each microbatch's partial weight gradients are rounded before
        # they are summed, as each replica's are, and 1F1B computes the head per
        # microbatch and recomputes the stages: the runs part by a few bfloat16 steps.
        # The yardstick is how far FSDP's run (the same staging without a pipeline) ends
        # from OneDevice's (0.02 measured in the weights), or how far bfloat16 takes
        # OneDevice from float32, whichever is larger, and at least 1e-2 (four bfloat16
        # steps at the loss's 0.66).
        fsdp = outcome(*_fit(jstrategy.experimental.FSDPStrategy(min_shard_size=0), **options))
        plain = {k: v for k, v in options.items() if k != "dtype_policy"}
        f32 = outcome(*_fit(jstrategy.OneDeviceStrategy("cpu:0"), **plain))
        tolerances = [
            max(1.5 * _max_difference(f, w), _max_difference(g32, w), 1e-2)
            for f, g32, w in zip(fsdp, f32, want, strict=True)
        ]
    for g, w, atol in zip(got, want, tolerances, strict=True):
        assert _max_difference(g, w) <= atol


def _scale(arrays):
    return max(float(np.max(np.abs(a))) for a in arrays)


def _max_difference(got, expected):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    "other",
    [
        lambda: jstrategy.OneDeviceStrategy("cpu:0"),
        lambda: jstrategy.MirroredStrategy(),
        lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=0),
    ],
    ids=["one_device", "mirrored", "fsdp"],
)
def test_checkpoints_cross_between_pipelined_and_other_strategies(tmp_path, other):
    pipelined = PipelineStrategy(num_stages=4, num_microbatches=2)
    model, _ = _fit(pipelined, epochs=1)
    # Pipelined -> other: the same values, in the other strategy's layout; other ->
    # pipelined: each stage reads its layers back.
    target_strategy = other()
    target, _ = _fit(target_strategy, epochs=0)
    again_strategy = PipelineStrategy(num_stages=2, num_microbatches=2, schedule="1f1b")
    again, _ = _fit(again_strategy, epochs=0)
    _, back = helpers.restore_across(
        tmp_path, model.state, [(target.state, target_strategy), (again.state, again_strategy)]
    )
    _assert_stages_hold_their_layers(back, again_strategy)


# Mistakes, refused before any work ---------------------------------------------------------
def test_unknown_schedule_and_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"`schedule` must be one of \['gpipe'.*got 'zero_bubble'"):
        PipelineStrategy(num_stages=2, num_microbatches=4, schedule="zero_bubble")
    with pytest.raises(ValueError, match="`num_stages` must be a positive int; got 0"):
        PipelineStrategy(num_stages=0, num_microbatches=4)
    with pytest.raises(ValueError, match="`num_microbatches` must be a positive int; got 2.5"):
        PipelineStrategy(num_stages=2, num_microbatches=2.5)
    with pytest.raises(ValueError, match=r"`num_stages`=3 must divide the number of devices, 8"):
        PipelineStrategy(num_stages=3, num_microbatches=4)


def test_layers_that_do_not_divide_by_the_stages_are_refused_at_creation():
    strategy = PipelineStrategy(num_stages=4, num_microbatches=4)
    with (
        strategy.scope(),
        pytest.raises(
            ValueError, match=r"stacks 6 layers, which cannot be split over num_stages=4"
        ),
    ):
        training.create_train_state(Net(layers=6), optax.adam(0.01), jnp.ones((1, FEATURES)), rng=0)


def test_microbatches_that_do_not_divide_the_batch_are_refused_before_the_step():
    strategy = PipelineStrategy(num_stages=2, num_microbatches=3)
    x, y = _data(1)
    with strategy.scope():
        state = _state()
        step = training.make_train_step(_loss)
        with pytest.raises(
            ValueError,
            match=r"num_microbatches=3 must divide the rows of each replica, 8 \(a global batch "
            r"of 32 over 4 replicas\).*multiple of 12.*distribute_batch",
        ):
            step(state, (x[0], y[0]))  # global arrays, not padded
    assert int(state.step) == 0


def test_batches_are_padded_to_whole_microbatches_as_every_strategy_pads_rows():
    """fit pads a short array, and distribute_batch any batch, to replicas x microbatches
    rows (masked), so the pipeline trains on what every other strategy trains on (its
    Keras BatchNormalization leaving the padding rows out of its statistics)."""
    strategy = PipelineStrategy(num_stages=2, num_microbatches=3)
    assert strategy.batch_multiple == 12
    x, y = parity_zoo.data("repeated")
    x, y = x[:8], y[:8]  # fewer rows than one batch
    assert distribute_batch(strategy, (x, y))[0].value.shape[0] == 12
    losses = {}
    for name, s in (("one", jstrategy.OneDeviceStrategy("cpu:0")), ("pipeline", strategy)):
        with s.scope():
            model = jstrategy.Model(parity_zoo.RepeatedNet(), input_shape=x.shape[1:])
            model.compile(
                "sgd", loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
        losses[name] = model.fit(x, y, batch_size=32, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(losses["pipeline"], losses["one"], rtol=1e-5)


def test_a_model_without_a_repeated_block_is_refused():
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2)
    with strategy.scope():
        model = jstrategy.Model(helpers_mlp(), input_shape=(FEATURES,))
        model.compile("adam", loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True))
        with pytest.raises(
            ValueError,
            match="this model has none: no variable is stacked by jstrategy.experimental.Repeated",
        ):
            model.fit(*helpers.classification_data(32, FEATURES), batch_size=32, verbose=0)
        assert int(model.state.step) == 0


def helpers_mlp():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))

    return MLP()


class _DropoutBlock(nn.Module):
    train: bool = True

    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=not self.train)(nn.Dense(x.shape[-1])(x))


class _BatchNormBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(x)


class _Wrap(nn.Module):
    block: nn.Module

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3)(Repeated(self.block, num_layers=2)(nn.Dense(HIDDEN)(x)))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dropout_and_batch_norm_inside_the_repeated_block_are_refused(schedule):
    with pytest.raises(
        ValueError, match=r"variables other than parameters, in the collections \['batch_stats'\]"
    ):
        _Wrap(_BatchNormBlock()).init(jax.random.key(0), jnp.ones((2, FEATURES)))
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, schedule=schedule)
    x, y = _data(1)
    with strategy.scope():
        state = training.create_train_state(
            _Wrap(_DropoutBlock()), optax.adam(0.01), jnp.ones((1, FEATURES)), rng=0
        )
        step = training.make_train_step(_loss)
        with pytest.raises(
            ValueError,
            match="draws random numbers \\(dropout\\) in training, which PipelineStrategy refuses",
        ):
            step(state, distribute_batch(strategy, (x[0], y[0])))
    # Without a pipeline the same block trains, a dropout key per layer.
    one = jstrategy.OneDeviceStrategy("cpu:0")
    with one.scope():
        state = training.create_train_state(
            _Wrap(_DropoutBlock()), optax.adam(0.01), jnp.ones((1, FEATURES)), rng=0
        )
        state, metrics = training.make_train_step(_loss)(state, distribute_batch(one, (x[0], y[0])))
    assert np.isfinite(float(metrics["loss"]))


class _After(nn.Module):
    """A Repeated block, then `after` (one of the layers 1F1B cannot run per microbatch)."""

    after: str

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(HIDDEN)(x)
        out = Repeated(Block(), num_layers=2)(h)
        if self.after == "skip":
            out = out + h
        elif self.after == "batch_norm":
            out = nn.BatchNorm(use_running_average=not train)(out)
        elif self.after == "dropout":
            out = nn.Dropout(0.5, deterministic=not train)(out)
        elif self.after == "sown":
            if not self.is_initializing():
                self.sow("losses", "activity", 1e-3 * jnp.sum(out**2))
        elif self.after == "two_blocks":
            out = Repeated(Block(), num_layers=2)(out)
        return nn.Dense(3)(out)


@pytest.mark.parametrize(
    ("after", "message"),
    [
        ("skip", "also reads its inputs by another way \\(e.g. a skip connection"),
        ("batch_norm", "BatchNorm \\(BatchNorm_0\\) there applies BatchNorm with batch statistics"),
        ("dropout", "Dropout \\(Dropout_0\\) there applies dropout"),
        ("sown", "add losses \\(sow\\) from their activations"),
        (
            "two_blocks",
            "pipelines exactly one jstrategy.experimental.Repeated block; this model runs 2",
        ),
    ],
)
def test_1f1b_refuses_layers_after_the_block_that_would_see_a_microbatch(after, message):
    x, y = _data(1)
    for schedule in SCHEDULES:
        strategy = PipelineStrategy(num_stages=2, num_microbatches=2, schedule=schedule)
        with strategy.scope():
            state = training.create_train_state(
                _After(after), optax.sgd(0.1), jnp.ones((1, FEATURES)), rng=0
            )
            step = training.make_train_step(_loss)
            batch = distribute_batch(strategy, (x[0], y[0]))
            if schedule == "gpipe":  # the whole batch reaches those layers: it trains
                state, metrics = step(state, batch)
                assert np.isfinite(float(metrics["loss"]))
                continue
            with pytest.raises(ValueError, match=message):
                step(state, batch)
            assert int(state.step) == 0


def test_1f1b_keeps_fewer_activations_than_gpipe():
    # At M = 4S, GPipe keeps every microbatch's activations for its backward pass; 1F1B
    # keeps at most 2S - 1 microbatch inputs per stage and recomputes the rest.
    x, y = _data(1, rows=512)

    def temp_bytes(schedule):
        strategy = PipelineStrategy(num_stages=2, num_microbatches=16, schedule=schedule)
        with strategy.scope():
            state = _state()
            step = training.make_train_step(_loss)
        batch = distribute_batch(strategy, (x[0], y[0]))
        return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    gpipe, one_f_one_b = temp_bytes("gpipe"), temp_bytes("1f1b")
    assert one_f_one_b < 0.5 * gpipe, (one_f_one_b, gpipe)  # 0.37x measured (0.41x on 0.10)


def test_gpipe_backward_adds_each_layers_gradient_to_one_accumulator():
    # A tick's loop over its stage's layers inside the loop over the ticks: JAX's backward
    # pass summed each tick's layer gradients in a zeroed buffer of the stage's whole
    # gradient, then added it to the ticks' sum (two stage gradients live: 6 GiB more a v5p
    # chip at llama2-7B, 4 stages). One loop over (tick, layer) keeps one, the gradient it
    # returns: 0.65 MB of temporaries on the CPU against that loop's 1.46 MB.
    from jstrategy._src.pipeline.schedules import gpipe

    config = PipelineStrategy(num_stages=4, num_microbatches=4).pipeline
    width, depth = 256, 4  # a stage's 4 layers: 1 MiB of weights, 1 MiB of gradients
    weights = jax.random.normal(jax.random.key(0), (4, depth, width, width)) / width
    on_stages = jax.sharding.NamedSharding(config.mesh, jax.sharding.PartitionSpec("stage"))
    weights = jax.device_put(weights, on_stages)
    x = jax.random.normal(jax.random.key(1), (8, width))

    def layer(w, h):
        return h + jnp.tanh(h @ w)

    def in_order(ws, x):  # every layer one after the other, stage 0's first
        return jax.lax.scan(lambda h, w: (layer(w, h), None), x, ws.reshape(-1, width, width))[0]

    def loss(ws, x):
        return jnp.sum(gpipe(layer, ws, x, config) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(weights, x).compile()
    value, grad = compiled(weights, x)
    expected, expected_grad = jax.value_and_grad(lambda ws, x: jnp.sum(in_order(ws, x) ** 2))(
        weights, x
    )
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-5)
    gradient = depth * width * width * 4  # a stage's, on each device
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < gradient, (temp, gradient)


class _Wide(nn.Module):
    """Dense, a Repeated block of four wide layers, a head: the state outweighs the
    activations at a few hundred rows."""

    width: int = 128

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = Repeated(Block(), num_layers=4)(nn.Dense(self.width)(x))
        return nn.Dense(3)(h)


def test_1f1b_over_split_replicas_peaks_about_as_gpipe_does():
    # With the variables split over the replicas too, GPipe's transposed loop reduces each
    # layer's weight gradients over the replicas as it produces them; 1F1B now does the
    # same (each replica gathers a layer from its slices, and the gather's transpose
    # reduces), where each replica summed its stage's gradients in full until the step's
    # reduction (1.5x GPipe's peak on this model then). Since GPipe adds each layer's
    # gradient to one accumulator, 1F1B measures 0.82x its peak on jax 0.12.1 and 1.02x on
    # jax 0.10.2 (whose XLA schedules 1F1B's loop otherwise): within a tenth of it.
    x, y = _data(1, rows=256)

    def peak(schedule):
        strategy = PipelineStrategy(
            num_stages=2,
            num_microbatches=4,
            schedule=schedule,
            shard_over_replicas=True,
            min_shard_size=0,
        )
        with strategy.scope():
            state = training.create_train_state(
                _Wide(), optax.adam(0.01), jnp.ones((1, FEATURES)), rng=0
            )
            step = training.make_train_step(_loss)
        batch = distribute_batch(strategy, (x[0], y[0]))
        m = step.lower(state, batch).compile().memory_analysis()
        return (
            m.argument_size_in_bytes
            + m.temp_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
        )

    gpipe, one_f_one_b = peak("gpipe"), peak("1f1b")
    assert one_f_one_b <= 1.1 * gpipe, (one_f_one_b, gpipe)


def test_repeated_checks_its_block_and_layers():
    with pytest.raises(ValueError, match="`num_layers` must be a positive int; got 0"):
        Repeated(Block(), num_layers=0).init(jax.random.key(0), jnp.ones((2, 4)))

    class Widens(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(x.shape[-1] + 1)(x)

    with pytest.raises(
        ValueError,
        match=r"must return an array of its input's shape and dtype, \(2, 4\) float32; it returned \(2, 5\) float32",
    ):
        Repeated(Widens(), num_layers=2).init(jax.random.key(0), jnp.ones((2, 4)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_benchmark_per_stage_peak_falls_with_the_stages(schedule):
    # benchmarks/pipeline.py's memory measurement on a tiny model: the compiled step's
    # peak per device (memory_analysis) falls as the stages split the layers.
    import importlib.util
    import itertools
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("pipeline_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its Flax modules are dataclasses of this module
    try:
        spec.loader.exec_module(bench)
        peaks = bench.stage_peaks(width=64, rows=64, schedule=schedule)
    finally:
        del sys.modules[spec.name]
    assert [stages for stages, _, _ in peaks] == [1, 2, 4, 8]
    for (_, peak, stacked), (_, next_peak, next_stacked) in itertools.pairwise(peaks):
        assert next_peak < peak and next_stacked < stacked, peaks
