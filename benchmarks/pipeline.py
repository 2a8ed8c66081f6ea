"""PipelineStrategy: the bubble, the step time against FSDP and Mirrored, per-stage memory.

Three measurements on 8 fake CPU devices, side by side in one process:

1. **Bubble.** For S stages and M microbatches, GPipe runs ``M + S - 1`` ticks, each stage
   computing one microbatch per tick; in the lockstep SPMD program the stages that have
   nothing to do during the fill and drain compute on placeholders, which takes the time
   they would idle. The measured bubble is ``1 - T(M ticks) / T(M + S - 1 ticks)``: the
   pipelined forward and backward of the repeated block (`pipelining.gpipe`, traced in the
   train step's view: replicas vmapped over the data axis), against the same program
   stopped after ``M`` ticks, the same work per tick without fill and drain (the
   no-bubble limit). Printed beside the formula ``(S - 1) / (M + S - 1)``.
2. **Step time.** The whole train step (`make_train_step`, Adam) of one model, a residual
   MLP block repeated 8 times between a Dense embedding and head, under PipelineStrategy
   (stages x replicas), FSDPStrategy (8) and MirroredStrategy (8), same global batch,
   timed interleaved; printed as ratios. On fake CPU devices the stages share the host's
   cores, so a pipeline pays its bubble and gains no parallelism: the ratio shows the
   pipeline's overhead, not the speed-up of a real multi-chip pipeline.
3. **Per-stage peak memory.** The compiled train step's ``memory_analysis()`` (arguments +
   temporaries + outputs - aliased, per device) for 1, 2, 4 and 8 stages, the global batch
   fixed, M = 2S: each stage holds ``1 / S`` of the repeated layers and their Adam moments,
   while the activations it keeps, ``(M + S - 1) / M`` of a replica's rows through its
   ``L / S`` layers, stay about the same.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/pipeline.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_samples
from _common import paired_ratio
from largest_model import _peak

import jstrategy
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src import pipelining
from jstrategy._src.input import distribute_batch
from jstrategy.experimental import PipelineStrategy
from jstrategy.experimental import Repeated


class Block(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(2 * x.shape[-1])(x)))


class Net(nn.Module):
    width: int
    layers: int = 8

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        h = nn.Dense(self.width)(x)
        return nn.Dense(10)(Repeated(Block(), num_layers=self.layers)(h))


def _loss(y: Any, logits: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


# 1. The bubble ----------------------------------------------------------------------------
def _block_program(strategy: PipelineStrategy, width: int, rows: int, ticks: int | None):
    """The jitted forward and backward of 8 pipelined layers, each replica's rows vmapped."""
    stages = strategy.num_stages
    config = pipelining.PipelineConfig(
        stages, strategy.num_microbatches, strategy.schedule, strategy.mesh
    )
    mesh = strategy.mesh
    on_stages = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("stage"))
    rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
    per_stage = 8 // stages
    key = jax.random.key(0)
    w = jax.device_put(
        jax.random.normal(key, (stages, per_stage, width, width)) / np.sqrt(width), on_stages
    )
    replicas = strategy.num_replicas_in_sync
    x = jax.device_put(jax.random.normal(key, (replicas, rows // replicas, width)), rows_sharding)

    def stage(w: Any, h: Any) -> Any:
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), h, w)[0]

    def loss(w: Any, x: Any) -> Any:
        one = lambda xr: pipelining.gpipe(stage, w, xr, config, ticks=ticks)  # noqa: E731
        return jnp.sum(jax.vmap(one, spmd_axis_name="replica")(x) ** 2)

    program = jax.jit(jax.grad(loss))
    return lambda i: program(w, x)


def bubble(width: int, rows: int, repeats: int, steps: int) -> list[tuple[Any, ...]]:
    results = []
    for stages in (2, 4):
        for factor in (2, 4):
            micro = factor * stages
            strategy = PipelineStrategy(num_stages=stages, num_microbatches=micro)
            samples = interleaved_samples(
                {
                    "pipeline": _block_program(strategy, width, rows, None),
                    "no bubble": _block_program(strategy, width, rows, micro),
                },
                steps=steps,
                repeats=repeats,
            )
            ratios = [a / b for a, b in zip(samples["no bubble"], samples["pipeline"], strict=True)]
            measured = 1 - statistics.median(ratios)
            formula = (stages - 1) / (micro + stages - 1)
            results.append((stages, micro, measured, formula))
    return results


# 2. Step time ------------------------------------------------------------------------------
def _train_step(strategy: jstrategy.Strategy, width: int, rows: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 32)).astype(np.float32)
    y = rng.integers(0, 10, size=rows).astype(np.int32)
    with strategy.scope():
        state = training.create_train_state(Net(width), optax.adam(1e-3), jnp.ones((1, 32)), rng=0)
        step = training.make_train_step(_loss)
    batch = distribute_batch(strategy, (x, y))
    holder = {"state": state}

    def run(i: int) -> Any:
        holder["state"], metrics = step(holder["state"], batch)
        dispatch.track(metrics)
        return metrics

    return run, step, state, batch


def step_times(width: int, rows: int, repeats: int, steps: int) -> dict[str, tuple]:
    candidates = {
        "Pipeline 2x4 (M=4)": PipelineStrategy(num_stages=2, num_microbatches=4),
        "Pipeline 4x2 (M=8)": PipelineStrategy(num_stages=4, num_microbatches=8),
        "FSDP 8": jstrategy.experimental.FSDPStrategy(),
        "Mirrored 8": jstrategy.MirroredStrategy(),
    }
    steps_by_name = {name: _train_step(s, width, rows)[0] for name, s in candidates.items()}
    samples = interleaved_samples(steps_by_name, steps=steps, repeats=repeats)
    out = {}
    for name in list(candidates)[:2]:
        out[name] = (
            statistics.median(samples[name]),
            paired_ratio(samples[name], samples["FSDP 8"]),
            paired_ratio(samples[name], samples["Mirrored 8"]),
        )
    out["FSDP 8"] = (statistics.median(samples["FSDP 8"]), None, None)
    out["Mirrored 8"] = (statistics.median(samples["Mirrored 8"]), None, None)
    return out


# 3. Per-stage memory --------------------------------------------------------------------
def stage_peaks(width: int, rows: int) -> list[tuple[int, float, float]]:
    results = []
    for stages in (1, 2, 4, 8):
        strategy = PipelineStrategy(num_stages=stages, num_microbatches=2 * stages)
        _, step, state, batch = _train_step(strategy, width, rows)
        compiled = step.lower(state, batch).compile()
        stacked = sum(
            leaf.addressable_shards[0].data.nbytes
            for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]
            if pipelining.STACKED_KEY in str(path)
        )
        results.append((stages, _peak(compiled) / 2**20, stacked / 2**20))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512, help="global batch of the train step")
    parser.add_argument(
        "--bubble-rows", type=int, default=2048, help="global batch of the bubble's programs"
    )
    parser.add_argument("--parts", default="123", help="which measurements, e.g. 13")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")

    if "1" in args.parts:
        _print_bubble(args)
    if "2" in args.parts:
        _print_step_times(args)
    if "3" in args.parts:
        _print_peaks(args)


def _print_bubble(args: argparse.Namespace) -> None:
    print("\n1. GPipe's bubble: measured 1 - T(M ticks) / T(M + S - 1 ticks), and the formula")
    print(f"{'stages':>6} {'M':>4} {'measured':>9} {'(S-1)/(M+S-1)':>14} {'measured/formula':>17}")
    for stages, micro, measured, formula in bubble(
        args.width, args.bubble_rows, args.repeats, args.steps
    ):
        print(
            f"{stages:>6} {micro:>4} {measured:>9.3f} {formula:>14.3f} {measured / formula:>17.2f}"
        )


def _print_step_times(args: argparse.Namespace) -> None:
    print("\n2. Train step time (median s/step; paired ratios median [min, max])")
    for name, (seconds, vs_fsdp, vs_mirrored) in step_times(
        args.width, args.rows, args.repeats, args.steps
    ).items():
        line = f"{name:<20} {seconds * 1e3:8.2f} ms"
        if vs_fsdp is not None:
            line += f"   vs FSDP {vs_fsdp[0]:.2f} [{vs_fsdp[1]:.2f}, {vs_fsdp[2]:.2f}]"
            line += (
                f"   vs Mirrored {vs_mirrored[0]:.2f} [{vs_mirrored[1]:.2f}, {vs_mirrored[2]:.2f}]"
            )
        print(line)


def _print_peaks(args: argparse.Namespace) -> None:
    print("\n3. Per-stage peak of the compiled train step (memory_analysis, per device)")
    print(f"{'stages':>6} {'peak MiB':>9} {'stacked layers MiB':>19} {'peak / 1 stage':>15}")
    peaks = stage_peaks(args.width, args.rows)
    for stages, peak, stacked in peaks:
        print(f"{stages:>6} {peak:>9.2f} {stacked:>19.2f} {peak / peaks[0][1]:>15.2f}")


if __name__ == "__main__":
    main()
