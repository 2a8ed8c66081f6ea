"""Before/after check of the training layer: trajectories must not move when code is refactored.

`tests/data/golden_trajectories.npz` holds, per strategy, the parameters (and losses, eval
results, predictions) after a few steps of fixed programs: the step factory (linen with and
without BatchNorm and dropout, NNX), `Model.fit` with ``steps_per_execution`` 1 and 3 over
arrays with a padded partial last batch and over a list of batches, `Model.fit` on an NNX
module, and `Model.fit` under `ParameterServerStrategy`. They were recorded on the code
before the training layer was split (issue 11), and re-recorded when the programs lost the
Dense bias in front of BatchNorm (whose zero gradient Adam turned into rounding noise that
moved evaluation by 0.5% between XLA versions), and again when the multi-replica cases
began to follow one device (dropout masks by global row, BatchNorm over the global batch)
and ``"adam"`` became Keras's update formula (issue 21), and again (all cases, under jax
0.12.1) when the manual region began to differentiate the mean loss as the global view does
(issue 47: one way to differentiate; the step cases moved by float rounding, up to 5e-6
relative). A refactor that changes any bit fails here.

On the CPU model and the JAX, jaxlib, Flax, Optax and NumPy versions the file was recorded
with, the comparison is exact. XLA generates code for the host CPU (vector width, FMA), JAX
versions change fusions, and a Flax or Optax release may reorder a sum (optax 0.2.8 and flax
0.12.8 moved these trajectories by one float32 ulp), so elsewhere the same program may round
differently in the last bits. There the check is ``rtol=1e-6`` under the recorded JAX minor
version and ``rtol=2e-5`` under another one (jax 0.12's fusions move the five-step `fit`
trajectories by up to 4e-6), still far below what any change of the math moves: a wrong
loss scaling or a dropped replica moves them by 1e-2 or more.

Regenerate (only for a change that is meant to change trajectories, and say so in the
commit):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/test_golden_trajectories.py --record

(``--only fit_dataset_spe3 ...`` re-records the cases whose names contain one of those and
keeps the others; it must run where the file was recorded. Run it from the checkout with
``PYTHONPATH=.``: a script's imports can otherwise reach an installed copy of jstrategy.)
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import platform
import warnings

import flax
import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import pytest
from flax import nnx

import jstrategy
from jstrategy import losses
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch
from jstrategy.coordinator import local_cluster_resolver

DATA = pathlib.Path(__file__).parent / "data" / "golden_trajectories.npz"
FEATURES = 5
STEPS = 5
ROWS = 16  # divides among 1 and 8 replicas


def _strategies():
    return {
        "one_device": lambda: jstrategy.OneDeviceStrategy("cpu:0"),
        "mirrored_8": lambda: jstrategy.MirroredStrategy(),
        "mirrored_8_hierarchical": lambda: jstrategy.MirroredStrategy(
            cross_device_ops=jstrategy.HierarchicalCopyAllReduce()
        ),
        "central_storage_8": lambda: jstrategy.CentralStorageStrategy(),
    }


STRATEGIES = _strategies()


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


class BnDropout(nn.Module):
    """Dense, synchronized BatchNorm, dropout, Dense: every mutable and random path."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        # No bias before BatchNorm: its gradient is zero up to rounding, and Adam would turn
        # that rounding noise into full-size steps that differ on every XLA version.
        x = nn.Dense(8, use_bias=False)(x)
        x = nn.BatchNorm(
            use_running_average=not train, axis_name=jstrategy.REPLICA_AXIS, use_fast_variance=False
        )(x)
        x = nn.Dropout(0.25, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


# Dense without a bias before BatchNorm: see BnDropout.
NnxNet = functools.partial(
    helpers.NnxNet,
    features=FEATURES,
    use_bias=False,
    batch_norm={"axis_name": jstrategy.REPLICA_AXIS, "use_fast_variance": False},
    dropout=0.25,
)


def _data(rows, seed=0):
    return helpers.classification_data(rows, FEATURES, seed)


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _tx():
    return optax.sgd(0.1, momentum=0.9)


def _leaves(prefix, tree):
    """``{prefix/i: leaf}`` for the float leaves of `tree`, on the host."""
    out = {}
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            out[f"{prefix}/{i}"] = np.asarray(jax.device_get(leaf))
    return out


def _variables(state):
    if isinstance(state, training.NNXTrainState):
        return (state.params, state.model_state)
    return state.variables


# Programs: each returns {name: array} for one strategy -------------------------------------
def _factory(strategy, make_state, *, padded_step):
    x, y = _data(STEPS * ROWS)
    x, y = x.reshape(STEPS, ROWS, FEATURES), y.reshape(STEPS, ROWS)
    with strategy.scope():
        state = make_state()
        step = training.make_train_step(_loss, metrics=["accuracy"])
        evaluate = training.make_eval_step(_loss, metrics=["accuracy"])
        predict = training.make_predict_step()
    out = {}
    for i in range(STEPS):
        rows = ROWS - 5 if padded_step and i == STEPS - 1 else ROWS
        batch = distribute_batch(strategy, (x[i, :rows], y[i, :rows]), global_batch_size=ROWS)
        state, metrics = step(state, batch)
        dispatch.track(metrics)
        out[f"loss/{i}"] = np.asarray(metrics["loss"])
    out.update(_leaves("variables", _variables(state)))
    eval_batch = distribute_batch(strategy, (x[0, :11], y[0, :11]), global_batch_size=ROWS)
    out.update({f"eval/{k}": np.asarray(v) for k, v in evaluate(state, eval_batch).items()})
    out["predict"] = np.asarray(predict(state, x[1, :8]).value)
    return out


def step_linen(strategy):
    return _factory(
        strategy,
        lambda: training.create_train_state(Mlp(), _tx(), jnp.ones((1, FEATURES)), rng=0),
        padded_step=True,
    )


def step_linen_bn_dropout(strategy):
    return _factory(
        strategy,
        lambda: training.create_train_state(BnDropout(), _tx(), jnp.ones((1, FEATURES)), rng=3),
        padded_step=False,
    )


def step_nnx(strategy):
    return _factory(
        strategy,
        lambda: training.create_nnx_train_state(NnxNet(nnx.Rngs(0)), _tx()),
        padded_step=False,
    )


def _fit_results(model, history, x, y):
    out = {f"history/{k}": np.asarray(v) for k, v in sorted(history.history.items())}
    out.update(_leaves("variables", model.variables))
    # Row counts that leave a padded partial batch.
    evaluated = model.evaluate(x[:45], y[:45], batch_size=ROWS, verbose=0, return_dict=True)
    out.update({f"evaluate/{k}": np.asarray(v) for k, v in sorted(evaluated.items())})
    out["predict"] = np.asarray(model.predict(x[:21], batch_size=ROWS, verbose=0))
    return out


def _fit_arrays(strategy, spe):
    # 100 rows in batches of 16: six full steps and a padded one of 4 rows per epoch; with
    # steps_per_execution=3, two fused executions and the partial step alone.
    x, y = _data(100, seed=1)
    with strategy.scope():
        model = jstrategy.Model(BnDropout(), input_shape=(FEATURES,), seed=5)
        model.compile(
            _tx(),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=spe,
        )
    history = model.fit(
        x, y, batch_size=ROWS, epochs=2, verbose=0, validation_data=(x[:20], y[:20])
    )
    return _fit_results(model, history, x, y)


def fit_spe1(strategy):
    return _fit_arrays(strategy, 1)


def fit_spe3(strategy):
    return _fit_arrays(strategy, 3)


def fit_dataset_spe3(strategy):
    # A list of batches: the executions stack 3 batches (the unstacked program), then the
    # padded last batch runs alone.
    x, y = _data(100, seed=2)
    batches = [(x[i : i + ROWS], y[i : i + ROWS]) for i in range(0, 100, ROWS)]
    with strategy.scope():
        model = jstrategy.Model(Mlp(), input_shape=(FEATURES,), seed=1)
        model.compile("adam", loss="sparse_categorical_crossentropy", steps_per_execution=3)
    # The recorded program keeps a Keras habit: a probability loss (by name) on a model
    # that outputs logits. It trains on as recorded, and warns once, as it must.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", losses.NotProbabilitiesWarning)
        history = model.fit(batches, epochs=2, verbose=0)
    assert [w.category for w in caught] == [losses.NotProbabilitiesWarning]
    return _fit_results(model, history, x, y)


def fit_nnx(strategy):
    x, y = _data(100, seed=3)
    with strategy.scope():
        model = jstrategy.Model(NnxNet(nnx.Rngs(7)), seed=2)
        model.compile(
            optax.adam(1e-2),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=2,
        )
    history = model.fit(x, y, batch_size=ROWS, epochs=2, verbose=0)
    return _fit_results(model, history, x, y)


PROGRAMS = {
    f.__name__: f
    for f in (
        step_linen,
        step_linen_bn_dropout,
        step_nnx,
        fit_spe1,
        fit_spe3,
        fit_dataset_spe3,
        fit_nnx,
    )
}


def parameter_server_fit():
    # One worker: the scheduled steps run one after the other, so the trajectory is
    # deterministic (with several workers the order of pushes is a race).
    strategy = jstrategy.ParameterServerStrategy(
        local_cluster_resolver(num_workers=1, num_ps=2),
        variable_partitioner=jstrategy.experimental.partitioners.FixedShardsPartitioner(2),
    )
    x, y = _data(100, seed=4)
    with strategy.scope():
        model = jstrategy.Model(BnDropout(), input_shape=(FEATURES,), seed=3)
        model.compile(
            _tx(),
            loss=losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    try:
        history = model.fit(x, y, batch_size=ROWS, epochs=2, steps_per_epoch=4, verbose=0)
        return _fit_results(model, history, x, y)
    finally:  # fit started the strategy's coordinator; its worker threads end here
        if strategy._coordinator is not None:
            strategy._coordinator.shutdown()


# Recording and comparing ---------------------------------------------------------------------
def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _platform_key():
    return (
        f"{_cpu_model()} | jax {jax.__version__} | jaxlib {jaxlib.__version__}"
        f" | flax {flax.__version__} | optax {optax.__version__} | numpy {np.__version__}"
    )


def _jax_minor(platform_key):
    """``"0.10"`` from a key's ``jax 0.10.2``."""
    for part in platform_key.split(" | "):
        if part.startswith("jax "):
            return ".".join(part.removeprefix("jax ").split(".")[:2])
    return ""


def _cases():
    cases = [(s, p) for s in STRATEGIES for p in PROGRAMS]
    return [*cases, ("parameter_server", "fit")]


def _run(strategy_name, program_name):
    if strategy_name == "parameter_server":
        return parameter_server_fit()
    return PROGRAMS[program_name](STRATEGIES[strategy_name]())


def _pack(cases):
    """Every case's results as three arrays (labels, float32 values, float64 values).

    Arrays the programs compute are float32; the history's Python floats are float64 (the
    parameter-server history averages on the host). Each value is kept in the narrowest of
    the two that holds it exactly, so the file stays small.
    """
    labels, narrow, wide = [], [], []
    for case, results in cases.items():
        for key in sorted(results):
            value = np.asarray(results[key], np.float64)
            exact32 = np.array_equal(value.astype(np.float32), value)
            shape = ",".join(map(str, value.shape))
            labels.append(f"{case}/{key}:{shape}:{'f4' if exact32 else 'f8'}")
            (narrow if exact32 else wide).append(value.ravel())
    return {
        "labels": np.asarray(labels),
        "f4": np.concatenate([np.zeros(0), *narrow]).astype(np.float32),
        "f8": np.concatenate([np.zeros(0), *wide]),
    }


def _unpack(data):
    """``{case: {key: float64 array}}`` from `_pack`'s arrays."""
    out: dict = {}
    offsets = {"f4": 0, "f8": 0}
    for label in data["labels"]:
        name, shape_text, kind = str(label).rsplit(":", 2)
        strategy_name, program_name, key = name.split("/", 2)
        shape = tuple(int(d) for d in shape_text.split(",") if d)
        size = int(np.prod(shape, dtype=int))
        start = offsets[kind]
        value = data[kind][start : start + size].astype(np.float64).reshape(shape)
        out.setdefault(f"{strategy_name}/{program_name}", {})[key] = value
        offsets[kind] = start + size
    return out


def record(path=DATA, only=()):
    """Runs every case (or those whose ``strategy/program`` name contains one of `only`,
    keeping the file's others) and writes the file."""
    cases = {}
    if only:
        with np.load(path) as data:
            assert str(data["platform"]) == _platform_key(), "record every case elsewhere"
            cases = _unpack(data)
    for s, p in _cases():
        if not only or any(o in f"{s}/{p}" for o in only):
            cases[f"{s}/{p}"] = _run(s, p)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, platform=np.asarray(_platform_key()), **_pack(cases))
    print(f"wrote {len(cases)} cases to {path} ({path.stat().st_size} bytes)")


@pytest.fixture(scope="module")
def golden():
    with np.load(DATA) as data:
        return str(data["platform"]), _unpack(data)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy_name", "program_name"), _cases())
def test_trajectory_is_unchanged(golden, strategy_name, program_name):
    platform_key, cases = golden
    case = f"{strategy_name}/{program_name}"
    expected = cases[case]
    got = _run(strategy_name, program_name)
    assert sorted(got) == sorted(expected)
    exact = platform_key == _platform_key()
    rtol = 1e-6 if _jax_minor(platform_key) == _jax_minor(_platform_key()) else 2e-5
    for key in sorted(expected):
        value = np.asarray(got[key]).astype(np.float64)
        if exact:
            np.testing.assert_array_equal(value, expected[key], err_msg=f"{case}/{key}")
        else:
            # Another CPU model or library version: see the module docstring. (The atol is
            # for values that are about 0, where a relative bound means nothing: 1e-6 is a few
            # float32 ulps of the O(1) logits and losses.)
            np.testing.assert_allclose(
                value, expected[key], rtol=rtol, atol=1e-6, err_msg=f"{case}/{key}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"(re)write {DATA}")
    parser.add_argument("--only", nargs="*", default=(), help="re-record only these cases")
    args = parser.parse_args()
    if args.record:
        record(only=tuple(args.only))
