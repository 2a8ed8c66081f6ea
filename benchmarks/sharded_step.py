"""Step time of FSDP and ModelParallel against Mirrored, and what each step communicates.

One transformer LM (`examples/transformer_lm.py`), one global batch, AdamW, trained with
`make_train_step` under three strategies over the same devices:

* `MirroredStrategy`: parameters and optimizer state replicated, one all-reduce of the
  gradients per step;
* `FSDPStrategy`: every variable of at least 1024 elements split over the replicas;
  each step all-gathers the parameters where they are read and reduce-scatters their
  gradients (ZeRO-3);
* `ModelParallelStrategy` with the example's Megatron layout (`megatron_strategy`: q/k/v
  and MLP-up kernels split on their output dimension over a ``"model"`` axis of 4, out and
  MLP-down on their input; the batch over the other axis): all-reduces over ``"model"``
  inside each block, and one over ``"batch"`` for the gradients.

Beside each sharded strategy runs its hand-written peer (`prepare_peer`): the same step as
a JAX user writes it without jstrategy, ``jax.jit(step, in_shardings=...,
out_shardings=..., donate_argnums=...)`` in the global view over the `NamedSharding`s the
jstrategy state's leaves have (the strategy's `variable_sharding`), the batch split over
the data axis: ``value_and_grad`` of the mean of `transformer_lm.lm_loss` over the global
batch, then AdamW's update. It starts from a copy of the jstrategy state's parameters and
optimizer state, so both run the same numbers. The batch is full (its row mask all true),
so the train step runs its program for full batches: it divides the loss sum by the static
batch size, as the peer's mean does (a padded batch would pass its mask, and the step
would all-reduce the count of real rows first); it also counts its steps (``state.step``).

Printed per strategy (and peer): the median step time (interleaved repeats in one process),
its ratio to the strategy's hand-written peer and to Mirrored, the bytes of parameters and
optimizer state on the fullest device as a ratio to one copy, and the collectives of the
compiled step read from its HLO (`jstrategy._src.hlo.collective_counts`), by kind and by
the mesh axes they run over.

On fake CPU devices every "device" shares the same cores and memory, so the step times
say what the extra collectives and partitioned programs cost in overhead, not what they
save on hardware with fast links; the collective counts and memory ratios are what the
same programs do anywhere.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/sharded_step.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _common
import transformer_lm

import jstrategy
from jstrategy import training
from jstrategy._src.hlo import collective_counts
from jstrategy._src.input.placement import distribute_batch

STRATEGIES: dict[str, Callable[[], jstrategy.Strategy]] = {
    "Mirrored": lambda: jstrategy.MirroredStrategy(),
    "FSDP": lambda: jstrategy.experimental.FSDPStrategy(),
    "ModelParallel (Megatron)": transformer_lm.megatron_strategy,
}

#: The strategies timed beside a hand-written peer (`prepare_peer`).
PEERS = ("FSDP", "ModelParallel (Megatron)")


@dataclasses.dataclass
class Row:
    """One strategy's figures."""

    name: str
    mesh: dict[str, int]
    step: Callable[[int], Any]  # runs one step, returns its metrics
    collectives: dict[str, int]
    per_device: float  # bytes of params + optimizer state on the fullest device / one copy
    step_s: float = 0.0  # median over the interleaved rounds
    samples: list[float] = dataclasses.field(default_factory=list)  # one per round
    peer_of: str | None = None  # a hand-written peer: the strategy it mirrors
    peer: Row | None = None  # a strategy's hand-written peer


def _most_on_one_device(tree: Any) -> int:
    per: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def _optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-3, b2=0.98, weight_decay=0.01)


def prepare(
    name: str, model: transformer_lm.TransformerLM, batch_size: int, *, with_peer: bool = False
) -> Row:
    """The strategy's state, compiled step (its HLO counted) and a closure running it; with
    `with_peer`, its hand-written peer (`prepare_peer`) as ``row.peer``."""
    strategy = STRATEGIES[name]()
    rows = transformer_lm.make_data(batch_size, model.seq_len, model.vocab_size)
    tx = _optimizer()
    with strategy.scope():
        state = training.create_train_state(
            model, tx, jnp.zeros((1, model.seq_len), jnp.int32), rng=0
        )
        train_step = training.make_train_step(transformer_lm.lm_loss)
    batch = distribute_batch(strategy, (rows[:, :-1], rows[:, 1:]))
    hlo = train_step.lower(state, batch).compile().as_text()
    variables = (state.params, state.opt_state)
    one_copy = sum(leaf.nbytes for leaf in jax.tree.leaves(variables))
    per_device = _most_on_one_device(variables) / one_copy
    peer = prepare_peer(name, strategy, model, tx, variables, rows) if with_peer else None
    box = [state]

    def step(i: int) -> Any:
        # The train step bounds the steps in flight itself (`dispatch.track`).
        box[0], metrics = train_step(box[0], batch)
        return metrics

    return Row(
        name,
        dict(strategy.mesh.shape),
        step,
        collective_counts(hlo, strategy.mesh),
        per_device,
        peer=peer,
    )


def prepare_peer(
    name: str,
    strategy: jstrategy.Strategy,
    model: transformer_lm.TransformerLM,
    tx: optax.GradientTransformation,
    variables: Any,
    rows: Any,
) -> Row:
    """The hand-written global-view peer of `strategy`'s step: no jstrategy in the step.

    ``jax.jit`` of value_and_grad of the mean `lm_loss` over the global batch and AdamW's
    update, with ``in_shardings`` and ``out_shardings`` the `NamedSharding`s of the jstrategy
    state's `variables` (``(params, opt_state)``, placed by `Strategy.variable_sharding`),
    the batch split over the data axis, the parameters and optimizer state donated. It
    starts from a copy of `variables` and returns the loss, as the train step returns its
    metrics.
    """
    shardings = jax.tree.map(lambda leaf: leaf.sharding, variables)
    rows_sharding = NamedSharding(strategy.mesh, P(strategy.axis_name))
    replicated = NamedSharding(strategy.mesh, P())

    def train_step(params: Any, opt_state: Any, tokens: Any, targets: Any) -> Any:
        def loss_fn(params: Any) -> jax.Array:
            logits = model.apply({"params": params}, tokens)
            return transformer_lm.lm_loss(targets, logits).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(
        train_step,
        in_shardings=(*shardings, rows_sharding, rows_sharding),
        out_shardings=(*shardings, replicated),
        donate_argnums=(0, 1),
    )
    tokens, targets = (jax.device_put(v, rows_sharding) for v in (rows[:, :-1], rows[:, 1:]))
    box = [
        jax.tree.map(lambda leaf: jax.device_put(leaf, leaf.sharding, may_alias=False), variables)
    ]
    hlo = jitted.lower(*box[0], tokens, targets).compile().as_text()
    assert hlo is not None
    one_copy = sum(leaf.nbytes for leaf in jax.tree.leaves(variables))

    def step(i: int) -> Any:
        params, opt_state, loss = jitted(*box[0], tokens, targets)
        box[0] = (params, opt_state)
        return loss

    return Row(
        f"{name}: hand-written jax.jit",
        dict(strategy.mesh.shape),
        step,
        collective_counts(hlo, strategy.mesh),
        _most_on_one_device(box[0]) / one_copy,
        peer_of=name,
    )


def _ratio(row: Row, to: Row) -> str:
    """``median (min-max)`` over rounds of `row`'s step time over `to`'s in the same round."""
    median, low, high = _common.paired_ratio(row.samples, to.samples)
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timings")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args(argv)

    model = transformer_lm.TransformerLM(
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        seq_len=args.seq_len,
    )
    rows = []
    for name in STRATEGIES:
        row = prepare(name, model, args.batch_size, with_peer=name in PEERS)
        rows += [row] if row.peer is None else [row, row.peer]
    # Interleaved: each round times every strategy and peer in turn; ratios are the
    # median over rounds of the ratio within a round.
    samples = _common.interleaved_samples(
        {row.name: row.step for row in rows}, steps=args.steps, repeats=args.repeats
    )
    for row in rows:
        row.samples = samples[row.name]
        row.step_s = statistics.median(row.samples)
    mirrored = rows[0]

    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}")
    print(
        f"TransformerLM d_model={args.d_model} layers={args.n_layers} heads={args.n_heads} "
        f"seq={args.seq_len} vocab={args.vocab_size}, AdamW, global batch {args.batch_size}; "
        f"median of {args.repeats} interleaved rounds of {args.steps} steps (ratios: "
        "median (min-max) over rounds of the ratio within a round)"
    )
    print()
    print("| strategy | mesh | step ms | vs hand-written jit | vs Mirrored | "
          "params + opt state per device | collectives in the compiled step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        mesh = " x ".join(f"{axis} {size}" for axis, size in row.mesh.items())
        collectives = ", ".join(f"{k} {v}" for k, v in row.collectives.items())
        vs_peer = "" if row.peer is None else _ratio(row, row.peer)
        print(
            f"| {row.name} | {mesh} | {1e3 * row.step_s:.1f} | {vs_peer} | "
            f"{_ratio(row, mirrored)} | {row.per_device:.3f}x | {collectives} |"
        )
    return rows


if __name__ == "__main__":
    main()
