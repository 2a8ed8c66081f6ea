"""A decoder-only transformer language model trained with jstrategy on a generated language.

The model (`TransformerLM`, Flax linen) is GPT-2's shape: token and position embeddings,
pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP, a final
LayerNorm, and output logits from the token embedding (tied weights). Attention is
`jax.nn.dot_product_attention`, which runs cuDNN's flash attention on GPUs in bfloat16 or
float16. ``dtype`` sets the compute dtype (Flax's own mechanism); left None, the model
computes in the dtype of the parameters it is given, so a precision policy that casts
them (`jstrategy.mixed_precision.cast_to_compute`) decides. Parameters stay float32.

Parameter names are regular so that layouts can be written as regexes over them (FSDP,
a Megatron layout map): ``embed/embedding``, ``pos_embed/embedding``,
``blocks_{i}/ln1/{scale,bias}``, ``blocks_{i}/attn/{query,key,value,out}/kernel`` (each
``(d_model, d_model)``; split ``query|key|value`` on their output dimension and ``out`` on
its input dimension for tensor parallelism), ``blocks_{i}/ln2/...``,
``blocks_{i}/mlp/{up,down}/kernel`` (likewise ``up`` on output, ``down`` on input) and
``ln_f/{scale,bias}``. Dense layers have no biases. With ``scan_layers=True`` the blocks
are one ``nn.scan`` over a block (compiled once, not ``n_layers`` times) and their
parameters ``blocks/...`` carry a leading layer axis: ``blocks/attn/query/kernel`` is
``(n_layers, d_model, d_model)``.

Rematerialization: the model wraps its block class with `jstrategy.training.remat`, so a
train step built with ``remat=`` (``--remat``) recomputes each block's activations in the
backward pass instead of keeping them (the train step's memory then grows with one
block's activations, not all of them); without ``remat`` nothing changes.

The data is a language made up here, deterministic and with structure to learn: each
sequence's first half is a walk on a fixed random Markov chain (every token has a few
likely successors), and its second half repeats the first half (which attention can
learn to copy). Nothing is downloaded.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/transformer_lm.py \
        --strategy mirrored --steps 100

``--strategy fsdp`` shards every parameter and optimizer moment over the devices;
``--strategy megatron`` splits attention and MLP kernels over a ``"model"`` axis of 4
devices (`megatron_strategy`), the batch over the rest. ``--scan-layers`` scans the
blocks; ``--remat full`` (or a policy's name, e.g. ``dots_saveable``) rematerializes them.
``--remat auto``, the default, is ``dots_with_no_batch_dims_saveable`` with
``--scan-layers`` (each scanned block keeps its matmul outputs and recomputes the rest:
`default_remat`) and ``none`` without; ``--remat none`` keeps everything.
"""

from __future__ import annotations

import argparse
import time
from typing import Any
from typing import Literal
from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jstrategy
from jstrategy import training


def megatron_strategy(
    model_axis: int = 4, *, scan_layers: bool = False
) -> jstrategy.experimental.ModelParallelStrategy:
    """Megatron-style tensor parallelism over `model_axis` devices, data parallel over the rest.

    Attention's ``query``, ``key`` and ``value`` kernels are split on their output (heads)
    dimension and ``out`` on its input dimension over the ``"model"`` axis; likewise the
    MLP's ``up`` (output) and ``down`` (input). Each block then needs one all-reduce over
    ``"model"`` in attention and one in the MLP; embeddings and norms stay replicated.
    ``n_heads`` must divide by `model_axis`. `scan_layers`: the layouts of a model with
    ``scan_layers=True``, whose kernels have a leading (unsplit) layer axis.
    """
    n = len(jax.devices())
    mesh = jstrategy.experimental.DeviceMesh((n // model_axis, model_axis), ("batch", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layers: tuple[None, ...] = (None,) if scan_layers else ()
    layout_map["attn/(query|key|value)/kernel"] = (*layers, None, "model")
    layout_map["attn/out/kernel"] = (*layers, "model", None)
    layout_map["mlp/up/kernel"] = (*layers, None, "model")
    layout_map["mlp/down/kernel"] = (*layers, "model", None)
    return jstrategy.experimental.ModelParallelStrategy(layout_map)


STRATEGIES = {
    "one_device": lambda: jstrategy.OneDeviceStrategy(jax.devices()[0]),
    "mirrored": lambda: jstrategy.MirroredStrategy(),
    "central_storage": lambda: jstrategy.CentralStorageStrategy(),
    # Parameters and AdamW's moments split over every device (ZeRO-3).
    "fsdp": lambda: jstrategy.experimental.FSDPStrategy(),
    "megatron": megatron_strategy,
}

# Wait on a step's output at least this often: XLA's CPU collectives deadlock when too
# many steps over fake devices are queued (see jstrategy's "Never hangs on fake devices").
WAIT_EVERY = 8


def attention_implementation(dtype: Any, head_dim: int) -> str:
    """``"cudnn"`` (flash attention) where cuDNN supports the call, else ``"xla"``.

    cuDNN's fused attention needs a GPU, half-precision inputs and a head dimension that
    is a multiple of 8 up to 128; `jax.nn.dot_product_attention` does not choose it by
    itself (its default is XLA's).
    """
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    ok_head = head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if jax.default_backend() == "gpu" and half and ok_head else "xla"


def _dense(features: int, name: str, dtype: Any, std: float) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=False,
        dtype=dtype,
        kernel_init=nn.initializers.normal(std),
        name=name,
    )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``query``, ``key``, ``value`` and ``out`` kernels."""

    n_heads: int
    dtype: Any = None
    out_std: float = 0.02
    attention: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, d_model = x.shape
        head_dim = d_model // self.n_heads

        def heads(name: str) -> jax.Array:
            y = _dense(d_model, name, self.dtype, 0.02)(x)
            return y.reshape(batch, length, self.n_heads, head_dim)

        q, k, v = heads("query"), heads("key"), heads("value")
        implementation = self.attention
        if implementation == "auto":
            implementation = attention_implementation(q.dtype, head_dim)
        if implementation not in ("xla", "cudnn"):
            raise ValueError(
                f"`attention` must be 'auto', 'xla' or 'cudnn'; got {self.attention!r}."
            )
        y = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=cast(Literal["xla", "cudnn"], implementation)
        )
        return _dense(d_model, "out", self.dtype, self.out_std)(y.reshape(batch, length, d_model))


class MLP(nn.Module):
    """``up`` to ``mlp_ratio * d_model``, GELU, ``down`` to ``d_model``."""

    mlp_ratio: int = 4
    dtype: Any = None
    out_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        h = _dense(self.mlp_ratio * d_model, "up", self.dtype, 0.02)(x)
        return _dense(d_model, "down", self.dtype, self.out_std)(nn.gelu(h, approximate=True))


class Block(nn.Module):
    """A pre-LayerNorm transformer block.

    ``scanned=True``: called as `nn.scan` calls its body, ``(x, None) -> (x, None)``.
    """

    n_heads: int
    mlp_ratio: int = 4
    dtype: Any = None
    out_std: float = 0.02
    attention: str = "auto"
    scanned: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> Any:
        norm = lambda name: nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name=name)  # noqa: E731
        attn = CausalSelfAttention(
            self.n_heads, self.dtype, self.out_std, self.attention, name="attn"
        )
        x = x + attn(norm("ln1")(x))
        x = x + MLP(self.mlp_ratio, self.dtype, self.out_std, name="mlp")(norm("ln2")(x))
        return (x, None) if self.scanned else x


class TransformerLM(nn.Module):
    """A decoder-only transformer language model with tied input and output embeddings.

    Attributes:
      vocab_size: the number of token ids.
      d_model: the width of the residual stream.
      n_layers: the number of blocks.
      n_heads: attention heads per block (``d_model`` must divide by it).
      seq_len: the longest sequence (the size of the position embedding).
      mlp_ratio: the MLP's hidden width as a multiple of ``d_model``.
      dtype: the compute dtype (e.g. ``jnp.bfloat16``; parameters stay float32), or None
        (the default) to compute in the dtype of the parameters and inputs it is given, as
        a `jstrategy.mixed_precision` policy's casts set it.
      attention: ``"auto"`` (cuDNN flash attention where supported), ``"xla"`` or
        ``"cudnn"``: `jax.nn.dot_product_attention`'s ``implementation``.
      scan_layers: one ``nn.scan`` over the blocks (parameters ``blocks/...`` with a
        leading layer axis) instead of ``n_layers`` blocks ``blocks_{i}``.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> model = TransformerLM(vocab_size=16, d_model=8, n_layers=1, n_heads=2, seq_len=4)
    >>> params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    >>> model.apply({"params": params}, jnp.zeros((2, 4), jnp.int32)).shape
    (2, 4, 16)
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    mlp_ratio: int = 4
    dtype: Any = None
    attention: str = "auto"
    scan_layers: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"`d_model` ({self.d_model}) must divide by `n_heads` ({self.n_heads})."
            )
        length = tokens.shape[-1]
        if length > self.seq_len:
            raise ValueError(
                f"The sequences have {length} tokens, more than `seq_len` ({self.seq_len})."
            )
        embed = nn.Embed(
            self.vocab_size,
            self.d_model,
            dtype=self.dtype,
            embedding_init=nn.initializers.normal(0.02),
            name="embed",
        )
        positions = nn.Embed(
            self.seq_len,
            self.d_model,
            dtype=self.dtype,
            embedding_init=nn.initializers.normal(0.01),
            name="pos_embed",
        )
        x = embed(tokens) + positions(jnp.arange(length))
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers) at initialization.
        out_std = 0.02 / (2 * self.n_layers) ** 0.5
        args = (self.n_heads, self.mlp_ratio, self.dtype, out_std, self.attention)
        # Block itself, or rematerialized under a train step built with remat=.
        if self.scan_layers:
            block = training.remat(Block, prevent_cse=False)
            blocks = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=self.n_layers,
            )
            x, _ = blocks(*args, scanned=True, name="blocks")(x, None)
        else:
            block = training.remat(Block)
            for i in range(self.n_layers):
                x = block(*args, name=f"blocks_{i}")(x)
        x = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_f")(x)
        return embed.attend(x)  # logits in the compute dtype; the loss casts them


def lm_loss(targets: jax.Array, logits: jax.Array) -> jax.Array:
    """Per-sequence mean next-token cross-entropy, computed in float32.

    The logits may be bfloat16: the cast to float32 happens here, inside the loss, where
    XLA fuses it into the log-softmax instead of materializing float32 logits.

    Args:
      targets: int token ids, shape ``(batch, length)``.
      logits: shape ``(batch, length, vocab_size)``.

    Returns:
      Shape ``(batch,)``: one loss per sequence, as jstrategy's losses are per example.
    """
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return per_token.mean(axis=-1)


def make_data(
    num_sequences: int,
    seq_len: int,
    vocab_size: int,
    *,
    seed: int = 0,
    branching: int = 4,
    language_seed: int = 1234,
) -> np.ndarray:
    """Sequences of a generated language: a Markov walk, then the walk repeated.

    Args:
      num_sequences: how many sequences.
      seq_len: tokens the model reads; each row has ``seq_len + 1`` tokens (inputs are
        ``row[:-1]``, targets ``row[1:]``).
      vocab_size: token ids are in ``[0, vocab_size)``.
      seed: which sequences (the walks' starts and steps).
      branching: successors per token in the Markov chain.
      language_seed: which language (the chain); the same for training and evaluation.

    Returns:
      An int32 array of shape ``(num_sequences, seq_len + 1)``.

    Example:

    >>> rows = make_data(2, 7, 10)
    >>> rows.shape, bool((rows[:, 4:] == rows[:, :4]).all())
    ((2, 8), True)
    """
    language = np.random.default_rng(language_seed)
    successors = language.integers(0, vocab_size, size=(vocab_size, branching))
    weights = language.dirichlet(np.ones(branching), size=vocab_size)
    cumulative = np.cumsum(weights, axis=1)
    rng = np.random.default_rng(seed)
    total = seq_len + 1
    half = (total + 1) // 2
    walk = np.empty((num_sequences, half), np.int64)
    walk[:, 0] = rng.integers(0, vocab_size, size=num_sequences)
    for t in range(1, half):
        u = rng.random(num_sequences)[:, None]
        choice = np.minimum((u > cumulative[walk[:, t - 1]]).sum(axis=1), branching - 1)
        walk[:, t] = successors[walk[:, t - 1], choice]
    return np.concatenate([walk, walk[:, : total - half]], axis=1).astype(np.int32)


def train(
    strategy: jstrategy.Strategy,
    model: TransformerLM,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float = 3e-3,
    seed: int = 0,
    remat: Any = None,
) -> list[float]:
    """Trains `model` on generated sequences under `strategy`; returns every step's loss.

    `remat`: the train step's ``remat`` (None: off; True; a checkpoint policy or its name).

    The same global batches in the same order under every strategy, so the losses of
    different strategies can be compared step by step.
    """
    data = make_data(steps * batch_size, model.seq_len, model.vocab_size, seed=seed)
    tx = optax.adamw(learning_rate, b2=0.98, weight_decay=0.01)
    with strategy.scope():
        state = training.create_train_state(
            model, tx, jnp.zeros((1, model.seq_len), jnp.int32), rng=seed
        )
        train_step = training.make_train_step(lm_loss, remat=remat)
    losses = []
    for i in range(steps):
        rows = data[i * batch_size : (i + 1) * batch_size]
        state, metrics = train_step(state, (rows[:, :-1], rows[:, 1:]))
        losses.append(metrics["loss"])
        if i % WAIT_EVERY == 0:
            jax.block_until_ready(metrics)
    return [float(v) for v in losses]  # one host sync, after the loop


def default_remat(scan_layers: bool) -> str:
    """``--remat auto``: what each block keeps for the backward pass by default.

    Scanned blocks (``--scan-layers``, the layout for models larger than one device) keep
    only their matmul outputs (``dots_with_no_batch_dims_saveable``, MaxText's "minimal"
    policy; MaxText rematerializes scanned layers by default, fully) and recompute the
    rest, which includes any parameters gathered inside the block: under FSDP the step's
    peak per device is then its share of the state plus about a layer. Unrolled blocks
    keep everything (``none``), as a plain Flax step does.

    >>> default_remat(True), default_remat(False)
    ('dots_with_no_batch_dims_saveable', 'none')
    """
    return "dots_with_no_batch_dims_saveable" if scan_layers else "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="mirrored")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--mlp-ratio", type=int, default=4)
    parser.add_argument("--scan-layers", action="store_true", help="one nn.scan over the blocks")
    parser.add_argument(
        "--remat",
        choices=["auto", "none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"],
        default="auto",
        help="rematerialize each block: full (nothing saved) or a checkpoint policy's name; "
        "auto (the default): dots_with_no_batch_dims_saveable with --scan-layers, else none",
    )
    args = parser.parse_args(argv)

    if args.strategy == "megatron":
        strategy = megatron_strategy(scan_layers=args.scan_layers)
    else:
        strategy = STRATEGIES[args.strategy]()
    model = TransformerLM(
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        seq_len=args.seq_len,
        mlp_ratio=args.mlp_ratio,
        dtype=jnp.dtype(args.dtype),
        scan_layers=args.scan_layers,
    )
    remat_name = default_remat(args.scan_layers) if args.remat == "auto" else args.remat
    remat = {"none": None, "full": True}.get(remat_name, remat_name)
    print(
        f"jax {jax.__version__}: {type(strategy).__name__} over "
        f"{strategy.num_replicas_in_sync} {jax.devices()[0].platform} replica(s), "
        f"compute dtype {args.dtype}, {'scanned' if args.scan_layers else 'unrolled'} "
        f"blocks, remat {remat_name}"
    )
    start = time.perf_counter()
    losses = train(strategy, model, steps=args.steps, batch_size=args.batch_size, remat=remat)
    for i in range(0, args.steps, max(1, args.steps // 10)):
        print(f"  step {i:4d}: loss {losses[i]:.4f}")
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps "
        f"({time.perf_counter() - start:.1f}s; uniform guessing: {np.log(args.vocab_size):.4f})"
    )
    if not losses[-1] < 0.8 * losses[0]:
        print("The loss did not fall.")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
