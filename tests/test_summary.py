"""Keras-like summaries of linen and NNX modules."""

import functools
import re

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jstrategy
from jstrategy._src.training.summary import summarize


def _rows(text):
    """(layer, output shape, params) per table row, parsed from the text."""
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"="}]
    assert len(rules) == 2, text
    rows = []
    for line in lines[rules[0] + 1 : rules[1]]:
        match = re.match(r"^ (\s*)(.+?\))\s{2,}(\S.*?)\s{2,}([\d,]+)$", line)
        assert match, line
        indent, layer, shape, count = match.groups()
        rows.append((len(indent) // 2, layer, shape, int(count.replace(",", ""))))
    return rows


def _totals(text):
    found = {}
    for kind in ("Total", "Trainable", "Non-trainable"):
        m = re.search(rf"^{kind} params: ([\d,]+) \((\S+ \S+)\)$", text, re.M)
        assert m, kind
        found[kind] = (int(m.group(1).replace(",", "")), m.group(2))
    return found


def _size(tree):
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def test_sequential_mlp_matches_keras_counts():
    mlp = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(1)])
    x = jnp.ones((5, 10))
    variables = mlp.init(jax.random.key(0), x)
    text = summarize(mlp, variables, x)
    assert text.splitlines()[0] == 'Model: "sequential"'
    assert text.splitlines()[2].split() == ["Layer", "(type)", "Output", "Shape", "Param", "#"]
    assert _rows(text) == [
        (0, "layers_0 (Dense)", "(5, 16)", 10 * 16 + 16),
        (0, "layers_2 (Dense)", "(5, 1)", 16 * 1 + 1),
    ]
    total = 10 * 16 + 16 + 16 * 1 + 1
    assert total == _size(variables) == 193
    assert _totals(text) == {
        "Total": (total, f"{total * 4:.2f} B"),
        "Trainable": (total, f"{total * 4:.2f} B"),
        "Non-trainable": (0, "0.00 B"),
    }


class ConvBN(nn.Module):
    """Conv, BatchNorm (synchronized over the replica axis), Dropout, Dense."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=jstrategy.REPLICA_AXIS)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(2)(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("train", [False, True])
def test_batch_stats_are_non_trainable_in_both_modes(train):
    model = ConvBN(name="conv_bn")
    x = jnp.ones((2, 6, 6, 1))
    variables = model.init(jax.random.key(0), x)
    text = summarize(model, variables, x, train=train)
    assert text.splitlines()[0] == 'Model: "conv_bn"'
    conv, bn, dense = 3 * 3 * 1 * 4 + 4, 2 * 4, 6 * 6 * 4 * 2 + 2
    assert _rows(text) == [
        (0, "Conv_0 (Conv)", "(2, 6, 6, 4)", conv),
        (0, "BatchNorm_0 (BatchNorm)", "(2, 6, 6, 4)", bn + 2 * 4),
        (0, "Dropout_0 (Dropout)", "(2, 6, 6, 4)", 0),
        (0, "Dense_0 (Dense)", "(2, 2)", dense),
    ]
    totals = _totals(text)
    assert totals["Trainable"][0] == conv + bn + dense == _size(variables["params"])
    assert totals["Non-trainable"][0] == 2 * 4 == _size(variables["batch_stats"])
    assert totals["Total"][0] == _size(variables)


class Block(nn.Module):
    features: int

    def setup(self):
        self.inner = nn.Dense(self.features)
        self.unused = nn.Dense(3)

    def __call__(self, x):
        return nn.relu(self.inner(x))


class Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(4, name="shared")
        x = Block(4, name="block")(shared(x))
        x = shared(x)
        scale = self.param("scale", nn.initializers.ones, (4,))
        return x * scale, jnp.sum(x)


def test_nested_shared_own_and_uncalled_variables_are_accounted_for():
    model = Nested()
    x = jnp.ones((3, 4))
    # `unused` has no variables, since setup submodules are created lazily on use.
    variables = model.init(jax.random.key(0), x)
    text = summarize(model, variables, x)
    rows = _rows(text)
    assert rows == [
        (0, "shared (Dense)", "(3, 4)", 4 * 4 + 4),
        (0, "block (Block)", "(3, 4)", 4 * 4 + 4),
        (1, "inner (Dense)", "(3, 4)", 4 * 4 + 4),
        (0, "(own variables) (Nested)", "[(3, 4), ()]", 4),
    ]
    # Top-level rows add up to the total, as in Keras.
    assert sum(r[3] for r in rows if r[0] == 0) == _totals(text)["Total"][0] == _size(variables)


def test_submodules_with_variables_but_no_call_get_a_row():
    model = nn.Sequential([nn.Dense(3), nn.Dense(2)])
    x = jnp.ones((1, 2))
    variables = model.init(jax.random.key(0), x)
    variables = {"params": {**variables["params"], "extra": {"kernel": jnp.zeros((7,))}}}
    text = summarize(model, variables, x)
    assert _rows(text)[-1] == (0, "extra (not called)", "-", 7)
    assert _totals(text)["Total"][0] == 2 * 3 + 3 + 3 * 2 + 2 + 7


def test_abstract_variables_and_inputs_and_sizes_in_larger_units():
    model = nn.Dense(1000)
    x = jax.ShapeDtypeStruct((8, 300), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    text = summarize(model, variables, x)
    n = 300 * 1000 + 1000
    assert _totals(text)["Total"] == (n, f"{n * 4 / 1024**2:.2f} MB")
    assert "301,000" in text
    # A lone layer has no submodules: its own variables make the one row.
    assert _rows(text) == [(0, "(own variables) (Dense)", "(8, 1000)", n)]


def test_missing_params_fail_instead_of_being_created():
    mlp = nn.Sequential([nn.Dense(2), nn.Dense(2)])
    x = jnp.ones((1, 3))
    variables = mlp.init(jax.random.key(0), x)
    del variables["params"]["layers_1"]
    with pytest.raises(Exception, match="layers_1"):
        summarize(mlp, variables, x)


def test_rejects_non_modules_and_bad_variables():
    with pytest.raises(ValueError, match="flax.linen.Module or a flax.nnx.Module"):
        summarize(lambda x: x, {}, jnp.ones(2))
    with pytest.raises(ValueError, match="`variables` must be the collections dict"):
        summarize(nn.Dense(2), [1, 2], jnp.ones((1, 2)))


NnxNet = functools.partial(
    helpers.NnxNet, features=5, batch_norm={"axis_name": jstrategy.REPLICA_AXIS}, dropout=0.5
)


def test_nnx_module_in_training_mode_leaves_the_module_untouched():
    model = NnxNet(nnx.Rngs(0))
    weights = lambda: nnx.state(model, nnx.Not(nnx.RngState))  # noqa: E731
    before = jax.tree.map(np.asarray, weights())
    text = summarize(model, None, jnp.ones((4, 5)))
    assert text.splitlines()[0] == 'Model: "nnx_net"'
    assert _rows(text) == [
        (0, "dense1 (Linear)", "(4, 8)", 5 * 8 + 8),
        (0, "norm (BatchNorm)", "(4, 8)", 4 * 8),
        (0, "drop (Dropout)", "(4, 8)", 0),
        (0, "dense2 (Linear)", "(4, 3)", 8 * 3 + 3),
    ]
    totals = _totals(text)
    assert totals["Trainable"][0] == _size(nnx.state(model, nnx.Param)) == 48 + 16 + 27
    assert totals["Non-trainable"][0] == _size(nnx.state(model, nnx.BatchStat)) == 16
    # The summary traced a copy: same classes, same (unchanged) state.
    assert type(model.dense1) is nnx.Linear
    after = jax.tree.map(np.asarray, weights())
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_nnx_state_argument_is_summarized_instead_of_the_modules_own():
    small = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    text = summarize(small, state, jnp.ones((1, 2)))
    assert _totals(text)["Total"][0] == 2 * 3 + 3
