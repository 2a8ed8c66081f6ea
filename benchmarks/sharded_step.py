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

Printed per strategy: the median step time (interleaved repeats in one process) and its
ratio to Mirrored, the bytes of parameters and optimizer state on the fullest device as a
ratio to one copy, and the collectives of the compiled step read from its HLO
(`jstrategy._src.hlo.collective_counts`), by kind and by the mesh axes they run over.

On fake CPU devices every "device" shares the same cores and memory, so the step times
say what the extra collectives and partitioned programs cost in overhead, not what they
save on hardware with fast links; the collective counts and memory ratios are what the
same programs do anywhere.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/sharded_step.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _common
import transformer_lm

import jstrategy
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.hlo import collective_counts
from jstrategy._src.input import distribute_batch

STRATEGIES: dict[str, Callable[[], jstrategy.Strategy]] = {
    "Mirrored": lambda: jstrategy.MirroredStrategy(),
    "FSDP": lambda: jstrategy.experimental.FSDPStrategy(),
    "ModelParallel (Megatron)": transformer_lm.megatron_strategy,
}


@dataclasses.dataclass
class Row:
    """One strategy's figures."""

    name: str
    mesh: dict[str, int]
    step: Callable[[int], Any]  # runs one step, returns its metrics
    collectives: dict[str, int]
    per_device: float  # bytes of params + optimizer state on the fullest device / one copy
    step_s: float = 0.0


def _most_on_one_device(tree: Any) -> int:
    per: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def prepare(name: str, model: transformer_lm.TransformerLM, batch_size: int) -> Row:
    """The strategy's state, compiled step (its HLO counted) and a closure running it."""
    strategy = STRATEGIES[name]()
    rows = transformer_lm.make_data(batch_size, model.seq_len, model.vocab_size)
    tx = optax.adamw(1e-3, b2=0.98, weight_decay=0.01)
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
    box = [state]

    def step(i: int) -> Any:
        box[0], metrics = train_step(box[0], batch)
        dispatch.track(metrics)
        return metrics

    return Row(
        name,
        dict(strategy.mesh.shape),
        step,
        collective_counts(hlo, strategy.mesh),
        per_device,
    )


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
    rows = [prepare(name, model, args.batch_size) for name in STRATEGIES]
    times = _common.compare(
        {row.name: row.step for row in rows}, steps=args.steps, repeats=args.repeats
    )
    for row in rows:
        row.step_s = times[row.name]
    base = times["Mirrored"]

    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}")
    print(
        f"TransformerLM d_model={args.d_model} layers={args.n_layers} heads={args.n_heads} "
        f"seq={args.seq_len} vocab={args.vocab_size}, AdamW, global batch {args.batch_size}; "
        f"median of {args.repeats} x {args.steps} steps"
    )
    print()
    print("| strategy | mesh | step ms | vs Mirrored | params + opt state per device | "
          "collectives in the compiled step |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in rows:
        mesh = " x ".join(f"{axis} {size}" for axis, size in row.mesh.items())
        collectives = ", ".join(f"{k} {v}" for k, v in row.collectives.items())
        print(
            f"| {row.name} | {mesh} | {1e3 * row.step_s:.1f} | {row.step_s / base:.2f}x | "
            f"{row.per_device:.3f}x | {collectives} |"
        )
    return rows


if __name__ == "__main__":
    main()
