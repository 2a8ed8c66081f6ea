"""The TPU compiler without a TPU (issue 46, items 3 and 4): every strategy's train step
compiled for a TPU slice's compile-only devices (`topology_devices`, through libtpu).

For a v5e 2x4 slice (8 chips of 16 GiB), `plan` compiles the train step of: the seed's
Keras program under `TPUStrategy` (built over the slice's devices), Mirrored, FSDP,
ModelParallel, Hybrid, the pipelines (GPipe, 1F1B, circular), ring attention over a
context axis, the optimizer offloaded to host memory (the compiled step still takes and
gives those leaves in pinned host memory: host memory is real on TPU), and the Colab
notebooks' programs (their own cells, run against the slice). A model too big for the
chips is reported as not fitting, with the TPU compiler's figures and the advice, never
as its raw ``RESOURCE_EXHAUSTED`` error.

libtpu is not a dependency: without it (the normal lanes) the module is skipped with the
reason. `make test-tpu-compile` installs it in its own environment and runs this file in
one process (libtpu takes a lockfile: one process per machine at a time); there, a missing
libtpu fails the tests instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jstrategy
from jstrategy._src.placement import HOST_MEMORY_KINDS
from jstrategy._src.training.plan import planner
from jstrategy._src.training.step import body as step_lib
from jstrategy.experimental import Fix
from jstrategy.experimental import PipelineStrategy
from jstrategy.experimental import Repeated
from jstrategy.experimental import plan
from jstrategy.experimental import topology_devices

# `make test-tpu-compile` sets it: there a missing libtpu fails every test, never skips.
REQUIRED = os.environ.get("JSTRATEGY_TPU_COMPILE_LANE") == "1"
pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None and not REQUIRED,
        reason="libtpu is not installed: `make test-tpu-compile` installs it (no TPU needed) "
        "and runs these tests",
    ),
]

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]
import context_parallel  # noqa: E402  (benchmarks/: the ring-attention decoder)
import seed_program  # noqa: E402  (examples/: the seed's program)

TOPOLOGY = "v5e:2x4"
CHIPS = 8
HBM = 16 << 30  # a v5e chip's
FEATURES = 32
ROWS = 64


@pytest.fixture(scope="module")
def devices():
    found = topology_devices(TOPOLOGY)
    assert len(found) == CHIPS and found[0].platform == "tpu"
    return found


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(128, name="up")(x))
        return nn.Dense(10, name="down")(h)


def _batch(rows=ROWS, features=FEATURES):
    return (
        jax.ShapeDtypeStruct((rows, features), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
    )


OPTIONS = {"optimizer": optax.adam(1e-3), "loss": "sparse_categorical_crossentropy"}


def _planned(module, strategy, batch=None, **options):
    """`plan` on the slice, checked: it compiled, its figures are the chips' and fit."""
    options = {**OPTIONS, **options}
    planned = plan(
        module,
        strategy,
        _batch() if batch is None else batch,
        device_memory=HBM,
        find_largest_batch=False,
        **options,
    )
    assert planned.compiler_refusal is None and planned.fits
    assert planned.devices == CHIPS
    assert planned.peak > 0 and planned.parameters + planned.host > 0
    assert planned.optimizer_state + planned.host > 0
    return planned


def _layout_map(devices, shape=(2, 4), axes=("batch", "model")):
    mesh = jstrategy.experimental.DeviceMesh(shape, axes, devices=devices)
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    return layout_map


def _hybrid(devices, **kwargs):
    """Two replicas (one per host of the slice) x FSDP 2 x tensor 2."""
    return jstrategy.experimental.HybridStrategy(
        replicas=2,
        fsdp=2,
        tensor=2,
        layout_map=_layout_map(devices),
        min_shard_size=0,
        devices=devices,
        **kwargs,
    )


# The strategies --------------------------------------------------------------------------


def test_tpu_strategy_is_built_over_a_slice_this_process_does_not_have(devices):
    strategy = jstrategy.TPUStrategy(devices=devices)
    assert strategy.num_replicas_in_sync == CHIPS
    # Every core of the slice's two hosts, in the interconnect's order.
    assert sorted(d.id for d in strategy.mesh.devices.flat) == sorted(d.id for d in devices)


def test_the_seeds_keras_program_under_tpu_strategy(devices):
    """examples/seed_program.py's model, built and compiled there, planned (not fit: the
    slice's devices cannot run) under the seed's own strategy over the slice."""
    model = seed_program.build(jstrategy.TPUStrategy(devices=devices))
    model.summary()  # from the shapes: the slice's devices hold nothing
    batch = (
        jax.ShapeDtypeStruct((64, 10), jnp.float32),
        jax.ShapeDtypeStruct((64, 1), jnp.float32),
    )
    planned = plan(model, batch=batch, device_memory=HBM, find_largest_batch=False)
    assert planned.fits and planned.devices == CHIPS
    assert planned.parameters == (10 * 16 + 16 + 16 + 1) * 4  # whole on every chip
    assert planned.peak >= planned.parameters


@pytest.mark.parametrize(
    "name",
    ["mirrored", "fsdp", "model_parallel", "hybrid"],
)
def test_each_strategys_train_step_compiles_for_the_slice(devices, name):
    make = {
        "mirrored": lambda: jstrategy.MirroredStrategy(devices=devices),
        "fsdp": lambda: jstrategy.experimental.FSDPStrategy(devices=devices, min_shard_size=0),
        "model_parallel": lambda: jstrategy.experimental.ModelParallelStrategy(
            _layout_map(devices)
        ),
        "hybrid": lambda: _hybrid(devices),
    }
    planned = _planned(MLP(), make[name]())
    mirrored = FEATURES * 128 * 4 + 128 * 4 + 128 * 10 * 4 + 10 * 4
    if name == "mirrored":
        assert planned.parameters == mirrored
    else:  # each split the kernels over the chips
        assert planned.parameters < mirrored / 2


class Block(nn.Module):
    """A residual MLP layer: what `Repeated` repeats over the pipeline's stages."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(2 * x.shape[-1])(h)))


class PipelinedNet(nn.Module):
    layers: int = 8

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = Repeated(Block(), num_layers=self.layers)(nn.Dense(64)(x))
        return nn.Dense(10)(h)


@pytest.mark.parametrize(
    "config",
    [
        {"schedule": "gpipe"},
        {"schedule": "1f1b"},
        {"schedule": "gpipe", "num_repeats": 2},  # circular
        {"schedule": "1f1b", "num_repeats": 2},  # interleaved
    ],
    ids=["gpipe", "1f1b", "circular", "interleaved_1f1b"],
)
def test_pipelines_compile_for_the_slice(devices, config):
    strategy = PipelineStrategy(devices, num_stages=4, num_microbatches=8, **config)
    planned = _planned(PipelinedNet(), strategy)
    # Each stage holds its 2 of the 8 layers (the rest is small and replicated).
    whole = _planned(PipelinedNet(), jstrategy.MirroredStrategy(devices=devices))
    assert planned.parameters < whole.parameters / 2


@pytest.mark.parametrize("degree", [2, 4])
def test_ring_attention_over_a_context_axis_compiles_for_the_slice(devices, degree):
    """The decoder of benchmarks/context_parallel.py (its attention is
    `jstrategy.experimental.dot_product_attention`), each sequence split `degree` ways."""
    decoder = context_parallel.Decoder(vocab=64, width=64, heads=4, causal=True)
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    options = {"optimizer": optax.adam(1e-3), "loss": context_parallel.token_loss}
    strategy = jstrategy.experimental.FSDPStrategy(
        devices=devices, context=degree, min_shard_size=0
    )
    planned = _planned(decoder, strategy, (tokens, tokens), **options)
    assert planned.inputs > 0


# Host memory -----------------------------------------------------------------------------


def _compiled(module, strategy, batch, *, optimizer, loss):
    """The train step `plan` compiles, as the compiled program (its shardings), built by
    the planner's own steps."""
    build, spec = planner._from_module(
        module,
        strategy,
        batch,
        optimizer=optimizer,
        loss=loss,
        dtype_policy=None,
        gradient_accumulation_steps=1,
        remat=None,
        sync_batch_norm="global",
        train_arg="auto",
    )
    state = planner._abstract_state(build(), strategy)
    program = step_lib.build_train_program(spec)
    rows = batch[0].shape[0]
    return state, program.lower(state, None, *planner._abstract_batch(batch, rows, strategy))


def _offloaded(devices, name, policy):
    kwargs = {"offload": policy}
    if name == "fsdp":
        return jstrategy.experimental.FSDPStrategy(devices=devices, min_shard_size=0, **kwargs)
    if name == "model_parallel":
        return jstrategy.experimental.ModelParallelStrategy(_layout_map(devices), **kwargs)
    return _hybrid(devices, **kwargs)


@pytest.mark.parametrize("name", ["fsdp", "model_parallel", "hybrid"])
@pytest.mark.parametrize("params", [False, True], ids=["optimizer", "optimizer_and_params"])
def test_offloaded_state_stays_in_host_memory_through_the_tpu_compiler(devices, name, params):
    """The compiled step takes and gives back every offloaded leaf in pinned host memory,
    and the plan counts those leaves in host memory, not in HBM."""
    policy = jstrategy.experimental.OffloadPolicy(params=params)
    strategy = _offloaded(devices, name, policy)
    state, lowered = _compiled(MLP(), strategy, _batch(), **OPTIONS)
    compiled = lowered.compile()
    wanted = {
        path: leaf.sharding.memory_kind
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    offloaded = {path for path, kind in wanted.items() if kind in HOST_MEMORY_KINDS}
    # Adam's two moments of each kernel and bias (and the parameters themselves).
    assert len(offloaded) == (8 if params else 4) + 4
    (state_in, *_), _ = compiled.input_shardings
    state_out = compiled.output_shardings[0]
    for shardings in (state_in, state_out):
        got = dict(jax.tree_util.tree_flatten_with_path(shardings)[0])
        assert {path: s.memory_kind for path, s in got.items()} == wanted
    planned = _planned(MLP(), strategy)
    kept = _planned(MLP(), _offloaded(devices, name, None))
    assert planned.host > 0 and planned.optimizer_state < kept.optimizer_state
    assert (planned.parameters < kept.parameters) == params


# The Colab notebooks ---------------------------------------------------------------------


def _cells(name):
    notebook = json.loads((ROOT / "colab" / f"{name}.ipynb").read_text())
    return ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]


def _cell(name, marker):
    (found,) = [c for c in _cells(name) if marker in c]
    return found


def test_the_tpu_quickstart_notebooks_model_compiles_for_the_slice(devices, capsys):
    """colab/tpu_quickstart.ipynb's model cell, run as written under `TPUStrategy` over
    the slice (the model declared with its input shape, compiled with a metric and
    several steps per execution, summarized from its shapes), then its fit's step planned."""
    namespace = {"jstrategy": jstrategy, "strategy": jstrategy.TPUStrategy(devices=devices)}
    exec(_cell("tpu_quickstart", "class MLP"), namespace)
    parameters = 64 * 128 + 128 + 128 * 10 + 10
    assert f"Total params: {parameters:,}" in capsys.readouterr().out
    model = namespace["model"]
    batch = (
        jax.ShapeDtypeStruct((128, 64), jnp.float32),
        jax.ShapeDtypeStruct((128,), jnp.int32),
    )
    planned = plan(model, batch=batch, device_memory=HBM, find_largest_batch=False)
    assert planned.fits and planned.devices == CHIPS
    assert planned.parameters == parameters * 4


def test_the_custom_training_loop_notebooks_step_compiles_for_the_slice(devices):
    """colab/custom_training_loop.ipynb's model and its train-step factory's options
    (``make_train_step("mse")``, Adam) under `TPUStrategy` over the slice."""
    cell = _cell("custom_training_loop", "class MLP")
    definition = cell[: cell.index("model, tx =")]
    namespace = {"jax": jax, "jstrategy": jstrategy}
    exec(definition, namespace)
    batch = (
        jax.ShapeDtypeStruct((64, 8), jnp.float32),
        jax.ShapeDtypeStruct((64, 1), jnp.float32),
    )
    planned = _planned(
        namespace["MLP"](),
        jstrategy.TPUStrategy(devices=devices),
        batch,
        optimizer=optax.adam(1e-2),
        loss="mse",
    )
    assert planned.parameters == (8 * 32 + 32 + 32 + 1) * 4


# The compiler's refusal ------------------------------------------------------------------


class Big(nn.Module):
    """About 4.3 G parameters: with Adam, more than a v5e chip holds whole."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(32768, name="up")(x))
        h = nn.relu(nn.Dense(32768, name="mid")(h))
        return nn.Dense(10, name="down")(h)


def test_a_step_the_tpu_compiler_refuses_for_memory_is_planned_as_not_fitting(devices):
    big_batch = _batch(64, 1024)
    # A budget over the chip's: the compiler's own is the one checked against.
    planned = plan(
        Big(),
        jstrategy.MirroredStrategy(devices=devices),
        big_batch,
        device_memory=4 * HBM,
        **OPTIONS,
    )
    refusal = planned.compiler_refusal
    assert refusal is not None and not planned.fits
    assert "RESOURCE_EXHAUSTED" in refusal.message
    # The compiler's figures: more than a chip has, and the chip's HBM as the budget.
    assert refusal.required > refusal.available
    assert planned.peak == refusal.required
    assert planned.device_memory == refusal.available
    assert 14 << 30 < refusal.available <= HBM
    # The state's own figures (Adam: two moments per parameter), and what to change.
    assert planned.optimizer_state >= 2 * planned.parameters > 0
    # The search for a batch that fits counts the sizes the compiler refuses as not
    # fitting: the state alone is more than a chip holds, so none does.
    assert planned.searched and planned.largest_batch is None
    assert planned.fixes[:2] == (Fix.FSDP, Fix.OFFLOAD_OPTIMIZER)
    text = str(planned)
    assert "DOES NOT FIT" in text and "the compiler refused it" in text
    assert "FSDPStrategy" in text
    # The advice followed: split over the eight chips, the same step compiles and fits.
    split = plan(
        Big(),
        jstrategy.experimental.FSDPStrategy(devices=devices),
        big_batch,
        device_memory=HBM,
        find_largest_batch=False,
        **OPTIONS,
    )
    assert split.compiler_refusal is None and split.fits
