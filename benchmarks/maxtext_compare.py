"""jstrategy beside MaxText: the same llama2-style decoder's train step, peak and time.

One process builds both train steps for the same model, batch and layout on 8 fake CPU
devices and times them in paired alternating rounds (`_common.interleaved_samples`):

* **MaxText 0.2.5** through its own Python API, as its trainer does:
  ``pyconfig.initialize`` over its ``configs/decoupled_base_test.yml`` with
  ``hardware=cpu skip_jax_distributed_system=true``, ``train_utils.setup_train_loop`` (the
  mesh, the NNX model, AdamW and the sharded state), ``nnx.split`` and
  ``train_utils.jit_train_and_eval_step`` (its ``jax.jit`` of ``train.train_step``, the state
  donated), called under ``jax.set_mesh`` and its logical axis rules as its loop calls it.
* **jstrategy**: the model written here in Flax linen, mirroring MaxText's llama2 decoder
  (`Decoder`), trained with the public train-step factory
  (``jstrategy.training.create_train_state`` + ``make_train_step(loss, remat=True)``) under
  the strategy of the layout.

The model: token embedding, L pre-norm layers of RMSNorm, causal attention with rotary
position embeddings (q/k/v/out kernels shaped as MaxText's: ``(embed, heads, head_dim)``,
``(heads, head_dim, embed)``), RMSNorm and a SwiGLU MLP (``wi_0``, ``wi_1``, ``wo``), a final
RMSNorm and an untied output projection; no biases, no dropout, float32 everywhere (weights,
activations, logits). d 256, 4 heads of 64, MLP 1024, vocab 1024, sequence 128. Both print
their parameter count (equal by construction; checked). AdamW (b1 0.9, b2 0.95, eps 1e-8,
weight decay 0.1) on both; MaxText's warmup-cosine learning-rate schedule stays (it is its
optimizer), its gradient clipping is off (``gradient_clipping_threshold=0``: jstrategy's step
does not clip). The loss is the mean token cross-entropy over the same synthetic batch.

Rematerialization is the same on both: MaxText's default ``remat_policy=full`` (each
decoder layer under ``jax.checkpoint`` with no saved values) and jstrategy's
``make_train_step(..., remat=True)`` (``jax.checkpoint_policies.nothing_saveable`` on each
layer, which the model marks with `jstrategy.training.remat`).

Layouts (8 devices):

* ``fsdp``: MaxText ``ici_fsdp_parallelism=8``; jstrategy ``FSDPStrategy()``.
* ``tp``: data 2 x tensor 4. MaxText ``ici_data_parallelism=2 ici_tensor_parallelism=4``;
  jstrategy ``ModelParallelStrategy`` over a ``("batch", "model")`` 2 x 4 ``DeviceMesh`` with
  a Megatron ``LayoutMap`` that splits what MaxText's logical rules put on ``tensor``: the
  heads of q/k/v/out, the MLP's hidden dimension, and the vocabulary of the embedding and the
  output projection.
* ``pipeline``: 4 stages x 8 microbatches, the other factor 2 data-parallel. MaxText
  ``ici_pipeline_parallelism=4 ici_data_parallelism=2 num_pipeline_microbatches=8
  num_pipeline_repeats=1`` (and ``num_layers_per_pipeline_stage = L / 4``; without it,
  more layers than stages make MaxText's pipeline circular); jstrategy
  ``PipelineStrategy(num_stages=4, num_microbatches=8)`` with the layers in a ``Repeated``
  block (GPipe), the non-repeated variables replicated over the 2 replicas on both.
* ``moe``, ``moe_ep4``, ``moe_ep8`` (not run unless named): a Mixtral-shaped decoder (the
  MLP a mixture of 8 SwiGLU experts, top-2, capacity factor 1.25) under FSDP 8, expert 4 x
  fsdp 2 and expert 8, with the fraction of tokens each side drops: ``_maxtext_moe``.

Layers ``scanned`` (MaxText ``scan_layers=true``; jstrategy ``nn.scan``) or ``unrolled``
(``scan_layers=false``; L separate layers). jstrategy's ``Repeated`` always scans the
layers of a stage, so the pipeline's jstrategy side is the same program in both rows.
MaxText's unrolled pipeline with one layer per stage fails inside MaxText 0.2.5 (a
``TypeError`` in ``_shift_right``); such rows print the error and go on.

Printed per row: the compiled train step's peak per device (``memory_analysis()``:
arguments + temporaries + outputs - aliased, the fullest device), the median step time
over the rounds, and jstrategy / MaxText for both (time: median, min-max over rounds of the
ratio within a round).

MaxText is not a jstrategy dependency, and neither this script nor the tests need it in
jstrategy's own environment: it has its own virtual environment (Python 3.12+), built with
MaxText's decoupled requirements (no Google Cloud clients)::

    python3.12 -m venv /work/venvs/maxtext
    /work/venvs/maxtext/bin/pip install maxtext==0.2.5
    /work/venvs/maxtext/bin/pip install -r "$(/work/venvs/maxtext/bin/python -c 'import \
maxtext, pathlib; print(pathlib.Path(maxtext.__file__).parents[1])')/dependencies/requirements/\
generated_requirements/decoupled-requirements.txt"
    /work/venvs/maxtext/bin/pip install -e . --no-deps      # jstrategy, from its checkout

    DECOUPLE_GCLOUD=TRUE XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        /work/venvs/maxtext/bin/python benchmarks/maxtext_compare.py \
        --layers 4 --layouts fsdp --scan scanned --steps 2 --rounds 3

(the script sets both environment variables itself when they are unset).

At real size, ``--topology v5p:2x2x4`` (llama2-7B rows on a v5p-32) or ``--topology
v5p:4x4x4`` (70B-shaped rows on a v5p-128) compiles both sides for every chip of a TPU slice
with the TPU compiler, without a TPU and nothing allocated (`maxtext_topology`; it needs
``pip install libtpu==0.0.52`` in this environment besides; ``--lock FILE`` queues each
compile behind other libtpu users of the machine, ``--precision mixed_bfloat16`` the
mixed-precision rows). The model is as
written, without sharding constraints: MaxText's layers pin each layer's input to the
batch's split, and jstrategy's sharded train step does the same by itself for the layers
the model marks with `jstrategy.training.remat` (`Strategy.activation_rows`; see
docs/benchmarks.md for why it matters under FSDP with scanned layers). Without MaxText
installed it says so, with these commands, and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import ClassVar

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

import jstrategy
from jstrategy import training
from jstrategy.experimental import PipelineStrategy
from jstrategy.experimental import Repeated

# One module whether run as a script or imported: `_maxtext_moe` imports it by this name.
sys.modules.setdefault("maxtext_compare", sys.modules[__name__])

INSTALL = """\
    python3.12 -m venv /work/venvs/maxtext
    /work/venvs/maxtext/bin/pip install maxtext==0.2.5
    /work/venvs/maxtext/bin/pip install -r <site-packages>/dependencies/requirements/\
generated_requirements/decoupled-requirements.txt
    /work/venvs/maxtext/bin/pip install -e . --no-deps
    DECOUPLE_GCLOUD=TRUE /work/venvs/maxtext/bin/python benchmarks/maxtext_compare.py"""

# tp_seq: tp with jstrategy's ``tensor_activations="sequence"`` (MaxText as tp).
LAYOUTS = ("fsdp", "tp", "pipeline", "moe", "moe_ep4", "moe_ep8", "tp_seq")  # moe*: `_maxtext_moe`
SCANS = ("scanned", "unrolled")
STAGES, MICROBATCHES = 4, 8


@dataclasses.dataclass(frozen=True)
class Shape:
    """The decoder's sizes, the same for both sides."""

    layers: int
    d_model: int = 256
    heads: int = 4
    mlp: int = 1024
    vocab: int = 1024
    seq: int = 128

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def parameters(self) -> int:
        """Parameters by the formula: embedding, L layers (two norms, q/k/v/out, the
        three MLP kernels), final norm, output projection."""
        d, m = self.d_model, self.mlp
        layer = 2 * d + 4 * d * d + 3 * d * m
        return 2 * self.vocab * d + self.layers * layer + d


# The jstrategy side: MaxText's llama2 decoder in Flax linen ----------------------------
def rotary(x: jax.Array, max_timescale: float = 10_000.0) -> jax.Array:
    """MaxText's default RoPE on ``(batch, length, heads, head_dim)``: the head dimension's
    first and second halves rotated as pairs, at positions 0..length-1."""
    dim = x.shape[-1]
    timescale = max_timescale ** (2 * jnp.arange(dim // 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] / timescale
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)  # bfloat16 stays bfloat16 (mixed precision), as MaxText's


class Attention(nn.Module):
    """Causal multi-head attention; kernels shaped as MaxText's. `context`: jstrategy's
    attention, ring attention over a context axis (`FSDPStrategy(context=k)`)."""

    heads: int
    context: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        head_dim = x.shape[-1] // self.heads

        def project(name: str) -> jax.Array:
            return nn.DenseGeneral((self.heads, head_dim), use_bias=False, name=name)(x)

        q, k, v = rotary(project("query")), rotary(project("key")), project("value")
        if self.context:
            y = jstrategy.experimental.dot_product_attention(q, k, v, causal=True)
        else:
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, name="out")(y)


class Mlp(nn.Module):
    """SwiGLU: ``wo(silu(wi_0 x) * wi_1 x)``."""

    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = nn.Dense(self.hidden, use_bias=False, name="wi_0")(x)
        up = nn.Dense(self.hidden, use_bias=False, name="wi_1")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="wo")(nn.silu(gate) * up)


class Layer(nn.Module):
    """One decoder layer. ``scanned``: called as ``nn.scan`` calls its body."""

    heads: int
    mlp: int
    scanned: bool = False
    context: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> Any:
        norm = lambda name: nn.RMSNorm(epsilon=1e-5, name=name)  # noqa: E731
        attention = Attention(self.heads, self.context, name="self_attention")
        x = x + attention(norm("pre_self_attention_norm")(x))
        x = x + Mlp(self.mlp, name="mlp")(norm("post_self_attention_norm")(x))
        return (x, None) if self.scanned else x


class Decoder(nn.Module):
    """Embedding, `layers` decoder layers (``"scanned"``, ``"unrolled"`` or ``"repeated"``:
    a `Repeated` block, the pipeline's), final RMSNorm, output projection. `context`: ring
    attention over a context axis (`Attention`)."""

    shape: Shape
    layers: str = "scanned"
    context: bool = False

    # What a decoder of other layers changes (`_maxtext_moe`'s): the layer, and the
    # collections its layers fill, each scanned with the parameters.
    layer_class: ClassVar[type[nn.Module]] = Layer
    scanned_collections: ClassVar[tuple[str, ...]] = ("params",)

    def layer(self, block: Any, scanned: bool, **kwargs: Any) -> Any:
        """`block` (the layer class, wrapped) built for this decoder's shape."""
        return block(self.shape.heads, self.shape.mlp, scanned, self.context, **kwargs)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        s = self.shape
        x = nn.Embed(s.vocab, s.d_model, name="token_embedder")(tokens)
        if self.layers == "scanned":
            block = training.remat(self.layer_class, prevent_cse=False)
            axes = dict.fromkeys(self.scanned_collections, 0)
            # An annotated variable (a MoE's experts) gains a leading unnamed axis.
            scan = nn.scan(block, variable_axes=axes, split_rngs={"params": True},
                           length=s.layers, metadata_params={nn.PARTITION_NAME: None})  # fmt: skip
            x, _ = self.layer(scan, True, name="layers")(x, None)
        elif self.layers == "repeated":
            block = training.remat(self.layer_class)
            x = Repeated(self.layer(block, False), num_layers=s.layers)(x)
        else:
            block = training.remat(self.layer_class)
            for i in range(s.layers):
                x = self.layer(block, False, name=f"layers_{i}")(x)
        x = nn.RMSNorm(epsilon=1e-5, name="decoder_norm")(x)
        return nn.Dense(s.vocab, use_bias=False, name="logits_dense")(x)


def token_loss(targets: jax.Array, logits: jax.Array) -> jax.Array:
    """Per-sequence mean token cross-entropy (every token real: the global mean over
    tokens, MaxText's loss)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=-1)


def megatron_layout(
    mesh: jstrategy.experimental.DeviceMesh, scanned: bool
) -> jstrategy.experimental.LayoutMap:
    """What MaxText's logical rules put on ``tensor``, on `mesh`'s ``"model"`` axis."""
    layout = jstrategy.experimental.LayoutMap(mesh)
    lead: tuple[None, ...] = (None,) if scanned else ()
    layout["self_attention/(query|key|value)/kernel"] = (*lead, None, "model", None)
    layout["self_attention/out/kernel"] = (*lead, "model", None, None)
    layout["mlp/wi_[01]/kernel"] = (*lead, None, "model")
    layout["mlp/wo/kernel"] = (*lead, "model", None)
    layout["token_embedder/embedding"] = ("model", None)
    layout["logits_dense/kernel"] = (None, "model")
    return layout


def megatron_strategy(
    scanned: bool,
    shape: tuple[int, int] = (2, 4),
    devices: Any = None,
    tensor_activations: str = "features",
) -> jstrategy.experimental.ModelParallelStrategy:
    """data x tensor (2 x 4 here), split as MaxText's logical rules split over ``tensor``."""
    mesh = jstrategy.experimental.DeviceMesh(shape, ("batch", "model"), devices=devices)
    return jstrategy.experimental.ModelParallelStrategy(
        megatron_layout(mesh, scanned), tensor_activations=tensor_activations
    )


def jstrategy_strategy(layout: str, scan: str) -> jstrategy.Strategy:
    if layout == "fsdp":
        return jstrategy.experimental.FSDPStrategy()
    if layout in ("tp", "tp_seq"):
        split = "sequence" if layout == "tp_seq" else "features"
        return megatron_strategy(scan == "scanned", tensor_activations=split)
    return PipelineStrategy(num_stages=STAGES, num_microbatches=MICROBATCHES)


ADAMW = {"b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
LEARNING_RATE = 3e-4


@dataclasses.dataclass
class Side:
    """One framework's step for one row: its peak, parameter count and a runner."""

    parameters: int
    memory: dict[str, int]  # the compiled step's memory_analysis (`analysed`)
    step: Callable[[int], Any] | None  # None once timed (its state freed)
    samples: list[float] = dataclasses.field(default_factory=list)
    note: str = ""  # printed in the row's note column

    @property
    def peak(self) -> int:
        """Arguments + temporaries + outputs - aliased, as `_common.compiled_peak`."""
        m = self.memory
        return m["arguments"] + m["temporaries"] + m["outputs"] - m["aliased"]

    def breakdown(self) -> str:
        """The peak's parts in MiB."""
        return ", ".join(f"{k} {v / 2**20:.1f}" for k, v in self.memory.items())


def analysed(compiled: Any) -> dict[str, int]:
    """A compiled program's memory per device, by part."""
    m = compiled.memory_analysis()
    return {
        "arguments": int(m.argument_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
    }


def jstrategy_side(
    shape: Shape, layout: str, scan: str, rows: np.ndarray, *,
    model: nn.Module | None = None, strategy: jstrategy.Strategy | None = None,
) -> Side:  # fmt: skip
    """The layout's step; `model` and `strategy` given replace the layout's (MoE rows)."""
    strategy = strategy or jstrategy_strategy(layout, scan)
    layers = "repeated" if layout == "pipeline" else scan
    model = model or Decoder(shape, layers=layers)
    tx = optax.adamw(LEARNING_RATE, **ADAMW)
    with strategy.scope():
        state = training.create_train_state(model, tx, jnp.zeros((1, shape.seq), jnp.int32))
        train_step = training.make_train_step(token_loss, remat=True)
    batch = next(iter(strategy.experimental_distribute_dataset([(rows[:, :-1], rows[:, 1:])])))
    memory = analysed(train_step.lower(state, batch).compile())
    parameters = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    box = [state]

    def step(i: int) -> Any:
        box[0], metrics = train_step(box[0], batch)
        return metrics

    return Side(parameters, memory, step)


# The MaxText side, through its own API ---------------------------------------------------
def maxtext_overrides(shape: Shape, layout: str, scan: str, batch: int) -> list[str]:
    devices = jax.device_count()
    parallel = {
        "fsdp": {"ici_fsdp_parallelism": devices},
        "tp": {"ici_data_parallelism": 2, "ici_tensor_parallelism": 4, "ici_fsdp_parallelism": 1},
        "tp_seq": {
            "ici_data_parallelism": 2,
            "ici_tensor_parallelism": 4,
            "ici_fsdp_parallelism": 1,
        },
        "pipeline": {
            "ici_pipeline_parallelism": STAGES,
            "ici_data_parallelism": devices // STAGES,
            "ici_fsdp_parallelism": 1,
            "num_pipeline_microbatches": MICROBATCHES,
            "num_layers_per_pipeline_stage": shape.layers // STAGES,
            "num_pipeline_repeats": 1,
        },
    }[layout]
    settings = {**maxtext_settings(shape, scan, batch / devices), **parallel}
    return [f"{key}={value}" for key, value in settings.items()]


def maxtext_settings(shape: Shape, scan: str, per_device_batch: float) -> dict[str, Any]:
    """MaxText's overrides for this decoder, its optimizer and remat, on the CPU; the
    layout's ``ici_*`` degrees go beside them."""
    return {
        "hardware": "cpu",
        "skip_jax_distributed_system": "true",
        "run_name": "maxtext_compare",
        "enable_checkpointing": "false",
        "dataset_type": "synthetic",
        "decoder_block": "llama2",
        "base_emb_dim": shape.d_model,
        "base_num_query_heads": shape.heads,
        "base_num_kv_heads": shape.heads,
        "head_dim": shape.head_dim,
        "base_mlp_dim": shape.mlp,
        "base_num_decoder_layers": shape.layers,
        "vocab_size": shape.vocab,
        "max_target_length": shape.seq,
        "per_device_batch_size": per_device_batch,
        "dtype": "float32",
        "weight_dtype": "float32",
        "logits_dot_in_fp32": "true",
        "logits_via_embedding": "false",
        "dropout_rate": 0.0,
        "enable_dropout": "false",
        "remat_policy": "full",
        "scan_layers": "true" if scan == "scanned" else "false",
        "opt_type": "adamw",
        "adam_b1": ADAMW["b1"],
        "adam_b2": ADAMW["b2"],
        "adam_eps": ADAMW["eps"],
        "adam_weight_decay": ADAMW["weight_decay"],
        "learning_rate": LEARNING_RATE,
        "gradient_clipping_threshold": 0.0,
        "sharding_tolerance": 1.0,
        "steps": 1000,
    }


def maxtext_side(
    shape: Shape, layout: str, scan: str, rows: np.ndarray, *,
    overrides: list[str] | None = None, inspect: Callable[..., None] | None = None,
) -> Side:  # fmt: skip
    """The layout's step; `overrides` given replace the layout's settings (MoE rows), and
    `inspect` is called with MaxText's model, mesh and logical axis rules."""
    import maxtext
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train
    from maxtext.utils import maxtext_utils
    from maxtext.utils import sharding
    from maxtext.utils import train_utils

    config_file = Path(maxtext.__file__).parent / "configs" / "decoupled_base_test.yml"
    overrides = overrides or maxtext_overrides(shape, layout, scan, len(rows))
    argv = ["maxtext_compare", str(config_file), *overrides]
    config = pyconfig.initialize(argv)
    # What train.initialize sets from the config (the partitioner); its PRNG change is for
    # dropout, which is off here.
    jax.config.update("jax_use_shardy_partitioner", config.shardy)
    (_, _, state_shardings, _, mesh, _, _, _, _, _, state) = train_utils.setup_train_loop(
        config, None
    )
    parameters = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(state.model, nnx.Param)))
    if inspect is not None:
        inspect(state.model, mesh, config.logical_axis_rules)
    graphdef, state = nnx.split(state)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings
    )
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, graphdef, mesh, state, state_shardings, train.train_step, train.eval_step,
        None, params_shardings,
    )  # fmt: skip
    rules = config.logical_axis_rules
    with jax.set_mesh(mesh), logical_axis_rules(rules):
        data_sharding = sharding.get_input_data_sharding(config, mesh)
        shaped = maxtext_utils.get_shaped_batch(config, batch_sharding=data_sharding)
        batch = _maxtext_batch(rows, shaped)
        memory = analysed(p_train_step.lower(state, batch).compile())
    box = [state]

    def step(i: int) -> Any:
        with jax.set_mesh(mesh), logical_axis_rules(rules):
            box[0], metrics = p_train_step(box[0], batch)
        return metrics

    return Side(parameters, memory, step)


def _maxtext_batch(rows: np.ndarray, shaped: dict[str, Any]) -> dict[str, jax.Array]:
    """MaxText's batch of the same tokens: inputs, targets, positions, segment ids (one
    segment a row, every token real), placed as its data sharding says."""
    tokens, targets = rows[:, :-1], rows[:, 1:]
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    ones = np.ones_like(tokens)
    values = {
        "inputs": tokens,
        "targets": targets,
        "inputs_position": positions,
        "targets_position": positions,
        "inputs_segmentation": ones,
        "targets_segmentation": ones,
    }
    batch = {}
    for key, spec in shaped.items():
        if key not in values:
            raise KeyError(f"MaxText's batch has a key this script does not fill: {key!r}")
        value = values[key].astype(spec.dtype)
        if value.shape != spec.shape:
            raise ValueError(f"{key}: MaxText expects {spec.shape}, the batch has {value.shape}")
        batch[key] = jax.device_put(value, spec.sharding)
    return batch


# The table ------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    layout: str
    layers: int
    scan: str
    jstrategy: Side | None = None
    maxtext: Side | None = None
    error: str = ""


def measure(shape: Shape, layout: str, scan: str, args: argparse.Namespace) -> Row:
    batch, steps, rounds = args.batch, args.steps, args.rounds
    row = Row(layout, shape.layers, scan)
    maxtext_fn, jstrategy_fn = maxtext_side, jstrategy_side
    if layout.startswith("moe"):
        import _maxtext_moe

        maxtext_fn, jstrategy_fn = _maxtext_moe.maxtext_side, _maxtext_moe.jstrategy_side
    rows = np.random.default_rng(0).integers(0, shape.vocab, size=(batch, shape.seq + 1))
    rows = rows.astype(np.int32)
    try:
        row.maxtext = maxtext_fn(shape, layout, scan, rows)
    except Exception as error:  # MaxText's own failures: printed, the row goes on
        row.error = f"MaxText: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
        traceback.print_exc()
    row.jstrategy = jstrategy_fn(shape, layout, scan, rows)
    expected = shape.parameters()
    for name, side in (("jstrategy", row.jstrategy), ("MaxText", row.maxtext)):
        if side is not None:
            print(
                f"  {name}: {side.parameters:,} parameters (formula {expected:,}); peak MiB: "
                f"{side.breakdown()}",
                flush=True,
            )
            if side.parameters != expected:
                raise AssertionError(f"{name}'s model has {side.parameters:,} parameters, "
                                     f"not {expected:,}: the two models differ")  # fmt: skip
    candidates = {
        name: side.step
        for name, side in (("jstrategy", row.jstrategy), ("MaxText", row.maxtext))
        if side is not None and side.step is not None
    }
    samples = _common.interleaved_samples(candidates, steps=steps, repeats=rounds)
    for name, side in (("jstrategy", row.jstrategy), ("MaxText", row.maxtext)):
        if side is not None:
            side.samples, side.step = samples[name], None
    return row


def _mib(side: Side | None) -> str:
    return "-" if side is None else f"{side.peak / 2**20:.1f}"


def _ms(side: Side | None) -> str:
    return "-" if side is None else f"{1e3 * statistics.median(side.samples):.0f}"


def format_row(row: Row) -> str:
    j, m = row.jstrategy, row.maxtext
    assert j is not None
    if m is None:
        peak_ratio = time_ratio = "-"
    else:
        peak_ratio = f"{j.peak / m.peak:.2f}x"
        median, low, high = _common.paired_ratio(j.samples, m.samples)
        time_ratio = f"{median:.2f}x ({low:.2f}-{high:.2f})"
    layout = {"fsdp": "FSDP 8", "tp": "data 2 x tensor 4", "pipeline": "pipeline 4 x M 8"}
    layout["tp_seq"] = "data 2 x tensor 4, sequence-split"
    if row.layout.startswith("moe"):
        import _maxtext_moe

        layout.update(_maxtext_moe.LABELS)
    note = "; ".join(n for n in (row.error, *(s.note for s in (j, m) if s is not None)) if n)
    cells = [layout[row.layout], str(row.layers), row.scan, _mib(j), _mib(m), peak_ratio,
             _ms(j), _ms(m), time_ratio, note]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| layout | layers | layers as | jstrategy peak MiB | MaxText peak MiB | peak ratio | "
    "jstrategy ms/step | MaxText ms/step | time ratio (min-max) | note |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _shape(layers: int, layout: str) -> Shape:
    if layout.startswith("moe"):
        import _maxtext_moe

        return _maxtext_moe.MoEShape(layers)
    return Shape(layers)


def main(argv: list[str] | None = None) -> list[Row]:
    argv = sys.argv[1:] if argv is None else argv
    if any(arg.split("=")[0] in ("--topology", "--rows") for arg in argv):
        import maxtext_topology  # the real-size rows, compiled for a TPU topology

        maxtext_topology.main(argv)
        return []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS[:3]))
    parser.add_argument("--scan", nargs="+", choices=SCANS, default=list(SCANS))
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=2, help="steps per timing")
    parser.add_argument("--rounds", type=int, default=3, help="paired alternating rounds")
    args = parser.parse_args(argv)
    try:
        import maxtext  # noqa: F401
    except ImportError:
        print(
            "benchmarks/maxtext_compare.py needs MaxText 0.2.5 in its own virtual environment "
            "(Python 3.12+), with jstrategy installed there too:\n" + INSTALL,
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    if jax.device_count() != 8:
        raise SystemExit(f"Needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)"
                         f"; found {jax.device_count()}.")  # fmt: skip
    for layers in args.layers:
        if layers % STAGES:
            raise SystemExit(f"--layers must divide by the {STAGES} stages; got {layers}.")
    if args.batch % (MICROBATCHES * 2):
        raise SystemExit(f"--batch must divide by {MICROBATCHES * 2}; got {args.batch}.")
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}; "
          f"global batch {args.batch} x {Shape(4).seq} tokens; {args.rounds} paired rounds of "
          f"{args.steps} steps", flush=True)  # fmt: skip
    results = []
    for layers in args.layers:
        for layout in args.layouts:
            for scan in args.scan:
                print(f"{layout}, {layers} layers, {scan}:", flush=True)
                row = measure(_shape(layers, layout), layout, scan, args)
                print(format_row(row), flush=True)
                results.append(row)
                gc.collect()
    print()
    print(HEADER)
    for row in results:
        print(format_row(row))
    return results


if __name__ == "__main__":
    main()
