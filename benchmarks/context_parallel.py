"""Context parallelism: per-device peak memory and step time against the sequence length.

A small causal decoder (width 64, 4 heads, 1 layer, sinusoidal positions, batch 1) whose
attention is `jstrategy.experimental.dot_product_attention`, trained with Adam under
``FSDPStrategy(devices=<the first k devices>, context=k)`` for context degrees k = 1, 2,
4, 8 (one replica: the one sequence split into k shards; k = 1 is plain attention on one
device) and sequence lengths 1k to 16k.

"peak MiB" is the compiled train step's peak per device from XLA's memory analysis:
arguments + temporaries + outputs - aliased (donated) bytes, as `benchmarks/largest_model.py`
and `tests/test_sharded_memory.py` read it, lowered from abstract inputs, so nothing is
allocated and every row is printed. "ms/step" is the median of a few real steps of the
same compiled program, measured only where the step's peak per device is small enough to
run on this machine (``--time-limit-mib``, default 600 MiB) and the sequence at most
``--max-time-seq``; other rows print "-". The 8 fake devices share this machine's cores,
so the times show the work per step (ring attention skips the blocks a causal mask
hides), not a speed-up.

    python benchmarks/context_parallel.py     # 8 minutes on 2 cores shared with other jobs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jstrategy
from jstrategy import training
from jstrategy._src.context_parallel.axis import batch_shardings
from jstrategy._src.placement import variable_shardings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads this file
from _common import compiled_peak as peak_bytes

MIB = 1 << 20
SEQUENCES = (1024, 2048, 4096, 8192, 16384)
DEGREES = (1, 2, 4, 8)


class Block(nn.Module):
    """Pre-norm attention (`jstrategy.experimental.dot_product_attention`) and MLP."""

    heads: int
    causal: bool = True

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        h = nn.LayerNorm()(x)
        q = nn.DenseGeneral((self.heads, width // self.heads), name="query")(h)
        # No key bias: it shifts a query's scores by a constant, so its gradient is zero.
        k = nn.DenseGeneral((self.heads, width // self.heads), use_bias=False, name="key")(h)
        v = nn.DenseGeneral((self.heads, width // self.heads), name="value")(h)
        y = jstrategy.experimental.dot_product_attention(q, k, v, causal=self.causal)
        x = x + nn.DenseGeneral(width, axis=(-2, -1), name="out")(y)
        return x + nn.Dense(width)(nn.gelu(nn.Dense(2 * width)(nn.LayerNorm()(x))))


class Decoder(nn.Module):
    """Tokens to next-token logits; its parameters do not depend on the sequence length."""

    vocab: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 1
    causal: bool = True

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens) + _sinusoids(tokens.shape[1], self.width)
        for _ in range(self.layers):
            x = Block(self.heads, self.causal)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _sinusoids(length: int, width: int) -> jax.Array:
    """The transformer's fixed positional encodings, ``(length, width)``."""
    positions = jnp.arange(length, dtype=jnp.float32)[:, None]
    rates = jnp.exp(-jnp.log(10000.0) * jnp.arange(0, width, 2, dtype=jnp.float32) / width)
    angles = positions * rates
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def token_loss(labels: jax.Array, logits: jax.Array) -> jax.Array:
    """Each row's mean next-token cross-entropy (equal lengths: the step's mean over rows
    is the mean over every token)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(axis=-1)


def context_strategy(degree: int) -> jstrategy.experimental.FSDPStrategy:
    """One replica over the first `degree` devices, its sequence split `degree` ways."""
    return jstrategy.experimental.FSDPStrategy(
        devices=jax.devices()[:degree], context=degree, min_shard_size=0
    )


def compile_step(
    strategy: jstrategy.Strategy, template: Any, seq: int, *, rows: int = 1
) -> tuple[Any, Any]:
    """The train step of `template`'s model under `strategy`, compiled for `rows` sequences
    of `seq` tokens from abstract inputs; returns ``(compiled, step)``."""
    with strategy.scope():
        step = training.make_train_step(token_loss)
    shardings = variable_shardings(template, strategy)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), template, shardings
    )
    # The batch where jstrategy's input places it: rows over the replicas, the sequence
    # over the context axis.
    shape = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    along, _ = batch_shardings(strategy, (shape, shape))
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=along)
    mask = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=strategy.batch_sharding())
    return step._program.lower(state, None, (tokens, tokens), mask).compile(), step


def template_state(model: nn.Module) -> Any:
    """A train state of `model` (Adam), created once; each strategy gets it placed."""
    with jstrategy.OneDeviceStrategy(jax.devices()[0]).scope():
        return training.create_train_state(model, optax.adam(1e-3), jnp.zeros((1, 8), jnp.int32))


def time_step(
    compiled: Any, strategy: jstrategy.Strategy, template: Any, seq: int, steps: int
) -> float:
    """Median milliseconds of `steps` runs of `compiled` on real arrays (after one)."""
    # From host copies: the step donates its state, and the template must outlive it.
    state = jax.device_put(jax.device_get(template), variable_shardings(template, strategy))
    host = np.random.default_rng(0).integers(0, 64, (1, seq), np.int32)
    along, _ = batch_shardings(strategy, (host, host))
    tokens = jax.device_put(host, along)
    mask = jax.device_put(np.ones((1,), bool), strategy.batch_sharding())
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        state, _, logs = compiled(state, None, (tokens, tokens), mask)
        jax.block_until_ready(logs)  # one step in flight at a time
        if i:
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=SEQUENCES)
    parser.add_argument("--degrees", type=int, nargs="+", default=DEGREES)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per row")
    parser.add_argument("--time-limit-mib", type=float, default=600.0)
    parser.add_argument("--max-time-seq", type=int, default=8192)
    args = parser.parse_args()
    model = Decoder()
    template = template_state(model)
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    print(
        f"decoder: width {model.width}, {model.heads} heads, {model.layers} layer, "
        "causal, batch 1, Adam"
    )
    print(f"\n{'seq':>6} {'context':>7} {'peak MiB':>9} {'vs k=1':>7} {'ms/step':>8}")
    for seq in args.sequences:
        base = None
        for degree in args.degrees:
            strategy = context_strategy(degree)
            compiled, _ = compile_step(strategy, template, seq)
            peak = peak_bytes(compiled)
            base = peak if degree == 1 else base
            ratio = f"{base / peak:6.1f}x" if base else "-"
            timed = "-"
            if peak / MIB <= args.time_limit_mib and seq <= args.max_time_seq:
                timed = f"{time_step(compiled, strategy, template, seq, args.steps):8.0f}"
            print(f"{seq:>6} {degree:>7} {peak / MIB:>9.1f} {ratio:>7} {timed:>8}", flush=True)


if __name__ == "__main__":
    main()
