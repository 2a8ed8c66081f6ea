"""PipelineStrategy with Flax NNX models: an `NNXRepeated` block, parity with OneDeviceStrategy.

The NNX twin of test_pipeline.py, tiny (2 stages x 4 replicas): on both schedules a few
steps of `make_train_step` and of `Model.fit` end where OneDeviceStrategy's end within
1e-5, with BatchNorm and dropout before the block; the compiled step hands microbatches
between stages; a pipelined checkpoint restores under OneDeviceStrategy and back; and the
pipeline's refusals hold for NNX blocks as for linen ones.
"""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jstrategy
from jstrategy import training
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.names import path_names
from jstrategy.experimental import NNXRepeated
from jstrategy.experimental import PipelineStrategy

SCHEDULES = ["gpipe", "1f1b"]
FEATURES = 5
HIDDEN = 8
LAYERS = 4
ROWS = 16  # 4 replicas x 2 microbatches x 2 rows


class Block(nnx.Module):
    """A residual MLP layer (no state, no randomness): what NNXRepeated repeats."""

    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.up = nnx.Linear(HIDDEN, 2 * HIDDEN, rngs=rngs)
        self.down = nnx.Linear(2 * HIDDEN, HIDDEN, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(self.norm(x))))


class Net(nnx.Module):
    """Linear, BatchNorm and dropout before an NNXRepeated block, then a head (or, with
    `after`, one of the layers 1F1B cannot run per microbatch after the block)."""

    def __init__(self, rngs, *, layers=LAYERS, block=Block, after=None):
        # No bias before BatchNorm: its gradient is zero up to rounding (test_pipeline.py).
        self.dense = nnx.Linear(FEATURES, HIDDEN, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(HIDDEN, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.blocks = NNXRepeated(block, num_layers=layers, rngs=rngs)
        if after == "dropout":
            self.after = nnx.Dropout(0.5, rngs=rngs)
        elif after == "batch_norm":
            self.after = nnx.BatchNorm(HIDDEN, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, 3, rngs=rngs)

    def __call__(self, x):
        h = self.blocks(self.drop(self.norm(self.dense(x))))
        if hasattr(self, "after"):
            h = self.after(h)
        return self.head(h)


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _data(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, ROWS, FEATURES)).astype(np.float32)
    return x, np.argmax(x[..., :3], axis=-1).astype(np.int32)


def _state(tx=None, **kwargs):
    return training.create_nnx_train_state(Net(nnx.Rngs(0), **kwargs), tx or optax.adam(0.01))


def _floats(tree):
    return {
        path_names(k): np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
        if jnp.issubdtype(v.dtype, jnp.floating)
    }


def _assert_close(got, want, atol=1e-5):
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, atol=atol, rtol=0, err_msg=str(path))


def _assert_stages_hold_their_layers(state, strategy):
    """Every stacked leaf (parameters and Adam's moments) split over the stages."""
    stacked = 0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        path = path_names(keypath)
        if "stacked_layers" in path and leaf.ndim:
            stacked += 1
            assert leaf.sharding.spec[0] == "stage", path
            assert leaf.addressable_shards[0].data.shape[0] == LAYERS // strategy.num_stages
    assert stacked == 3 * 6  # params, mu, nu of LayerNorm and 2 Linear (2 leaves each)


_ORACLES = {}


def _oracle(x, y):
    if "one_device" not in _ORACLES:
        one = jstrategy.OneDeviceStrategy("cpu:0")
        _ORACLES["one_device"] = helpers.train_steps(one, _state, _loss, x, y)
    return _ORACLES["one_device"]


@pytest.mark.parametrize(
    ("schedule", "repeats"),
    [
        pytest.param("gpipe", 1, marks=pytest.mark.slow),
        ("1f1b", 1),
        pytest.param("gpipe", 2, marks=pytest.mark.slow),  # circular
        pytest.param("1f1b", 2, marks=pytest.mark.slow),  # interleaved
    ],
)
def test_nnx_pipelined_train_steps_match_one_device(schedule, repeats):
    x, y = _data(3)
    want, want_history = _oracle(x, y)
    strategy = PipelineStrategy(
        num_stages=2, num_microbatches=2, schedule=schedule, num_repeats=repeats
    )
    got, history = helpers.train_steps(strategy, _state, _loss, x, y)
    _assert_stages_hold_their_layers(got, strategy)
    _assert_close(_floats(got.variables), _floats(want.variables))
    assert want_history[-1]["loss"] != want_history[0]["loss"]  # it moved
    for m, e in zip(history, want_history, strict=True):
        np.testing.assert_allclose(m["loss"], e["loss"], atol=1e-5)
    # The step runs the schedule: microbatches handed between stages, and back.
    with strategy.scope():
        step = training.make_train_step(_loss)
    hlo = step.lower(got, distribute_batch(strategy, (x[0], y[0]))).as_text()
    assert hlo.count("collective_permute") >= 2


def _fit(strategy, epochs=2):
    x, y = helpers.classification_data(64, FEATURES)
    with strategy.scope():
        model = jstrategy.Model(Net(nnx.Rngs(0)), input_shape=(FEATURES,))
        model.compile(
            optax.adam(0.01),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        history = model.fit(x, y, batch_size=ROWS * 2, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history.get("loss")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_nnx_model_fit_matches_one_device(schedule):
    want, want_loss = _fit(jstrategy.OneDeviceStrategy("cpu:0"))
    got, loss = _fit(PipelineStrategy(num_stages=2, num_microbatches=2, schedule=schedule))
    np.testing.assert_allclose(loss, want_loss, atol=1e-5)
    for a, b in zip(got.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    x, _ = helpers.classification_data(64, FEATURES)
    np.testing.assert_allclose(  # evaluation and prediction: the layers in order
        got.predict(x, batch_size=32, verbose=0),
        want.predict(x, batch_size=32, verbose=0),
        atol=1e-5,
    )


@pytest.mark.slow
def test_nnx_pipelined_checkpoint_restores_under_one_device_and_back(tmp_path):
    model, _ = _fit(PipelineStrategy(num_stages=2, num_microbatches=2), epochs=1)
    # Pipelined -> OneDevice: the same values on the one device; OneDevice -> pipelined
    # (the other schedule): each stage reads its layers back.
    one = jstrategy.OneDeviceStrategy("cpu:0")
    target, _ = _fit(one, epochs=0)
    again_strategy = PipelineStrategy(num_stages=2, num_microbatches=2, schedule="1f1b")
    again, _ = _fit(again_strategy, epochs=0)
    restored, back = helpers.restore_across(
        tmp_path, model.state, [(target.state, one), (again.state, again_strategy)]
    )
    assert {d for leaf in jax.tree.leaves(restored) for d in leaf.devices()} == {one.devices[0]}
    _assert_stages_hold_their_layers(back, again_strategy)


# Mistakes, refused before any work ---------------------------------------------------------
def test_nnx_layers_that_do_not_divide_by_the_stages_are_refused_at_creation():
    strategy = PipelineStrategy(num_stages=4, num_microbatches=2)
    with (
        strategy.scope(),
        pytest.raises(
            ValueError, match=r"stacks 6 layers, which cannot be split over num_stages=4"
        ),
    ):
        _state(layers=6)


class _DropoutBlock(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.dense(x))


class _BatchNormBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.BatchNorm(HIDDEN, rngs=rngs)
        self.dense = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.dense(self.norm(x)))


def _first_step(strategy, **kwargs):
    x, y = _data(1)
    with strategy.scope():
        state = _state(**kwargs)
        step = training.make_train_step(_loss)
    return step(state, distribute_batch(strategy, (x[0], y[0])))


def test_nnx_dropout_and_batch_norm_inside_the_block_are_refused_by_a_pipeline():
    for schedule in SCHEDULES:
        strategy = PipelineStrategy(num_stages=2, num_microbatches=2, schedule=schedule)
        with pytest.raises(
            ValueError,
            match=r"repeated by NNXRepeated \(_DropoutBlock\) draws random numbers \(dropout\) "
            "in training, which PipelineStrategy refuses",
        ):
            _first_step(strategy, block=_DropoutBlock)
        with pytest.raises(
            ValueError,
            match=r"\(_BatchNormBlock\) holds variables other than parameters, "
            r"\['norm/mean \(BatchStat\)', 'norm/var \(BatchStat\)'\]",
        ):
            _first_step(strategy, block=_BatchNormBlock)


@pytest.mark.slow
def test_nnx_dropout_and_batch_norm_inside_the_block_train_without_a_pipeline():
    # nnx.scan carries each layer's streams and statistics; Mirrored follows OneDevice.
    # (SGD: Adam's first step turns the rounding-level gradient of a bias before a
    # BatchNorm into a full-size step of either sign.)
    for block in (_DropoutBlock, _BatchNormBlock):
        (one, _), (mirrored, _) = (
            _first_step(s, block=block, tx=optax.sgd(0.1))
            for s in (jstrategy.OneDeviceStrategy("cpu:0"), jstrategy.MirroredStrategy())
        )
        _assert_close(_floats(mirrored.variables), _floats(one.variables))


@pytest.mark.parametrize(
    ("after", "message"),
    [
        ("dropout", "an nnx.Dropout there applies dropout, which would see a microbatch"),
        ("batch_norm", "there they update the model's state or add losses"),
    ],
)
def test_nnx_1f1b_refuses_layers_after_the_block_that_would_see_a_microbatch(after, message):
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match=message):
        _first_step(strategy, after=after)


def test_nnx_1f1b_refuses_a_block_trained_in_part():
    # 1F1B differentiates the block's stacked parameters as a whole (GPipe's schedule is
    # differentiated by the step, which holds the untrained ones constant).
    x, y = _data(1)
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, schedule="1f1b")
    with strategy.scope():
        state = training.create_nnx_train_state(
            Net(nnx.Rngs(0)),
            optax.sgd(0.1),
            wrt=nnx.All(nnx.Param, nnx.Not(nnx.PathContains("up"))),
        )
        step = training.make_train_step(_loss)
    with pytest.raises(
        ValueError, match=r"the train state trains only some of them \(its `wrt` filter\)"
    ):
        step(state, distribute_batch(strategy, (x[0], y[0])))


def test_nnx_repeated_checks_its_arguments_and_block():
    with pytest.raises(ValueError, match="`num_layers` must be a positive int; got 0"):
        NNXRepeated(Block, num_layers=0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="`block` must be a function of an nnx.Rngs"):
        NNXRepeated(Block(nnx.Rngs(0)), num_layers=2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="`rngs` must be an nnx.Rngs .*got int"):
        NNXRepeated(Block, num_layers=2, rngs=0)
    with pytest.raises(TypeError, match="`block` must create an nnx.Module; it returned Array"):
        NNXRepeated(lambda rngs: jnp.ones(2), num_layers=2, rngs=nnx.Rngs(0))

    class Widens(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 5, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    layers = NNXRepeated(Widens, num_layers=2, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"repeated by NNXRepeated \(Widens\) must return an array of its input's shape "
        r"and dtype, \(2, 4\) float32; it returned \(2, 5\) float32",
    ):
        layers(jnp.ones((2, 4)))
