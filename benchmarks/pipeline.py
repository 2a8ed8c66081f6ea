"""PipelineStrategy: the bubble, the step time against FSDP and Mirrored, per-stage memory.

Three measurements on 8 fake CPU devices, side by side in one process:

1. **Bubble.** For S stages and M microbatches, GPipe runs ``M + S - 1`` ticks, each stage
   computing one microbatch per tick; in the lockstep SPMD program the stages that have
   nothing to do during the fill and drain compute on placeholders, which takes the time
   they would idle. The measured bubble is ``1 - T(M ticks) / T(all ticks)``: the
   pipelined forward and backward of the repeated block (`schedules.gpipe`, the train
   step's loop over (tick, layer), or `schedules.one_f_one_b` for 1F1B, whose ``S - 1``
   fill ticks run forward slots only and whose ``S - 1`` drain ticks backward slots
   only), traced in the train step's view (replicas vmapped over the data axis),
   against the same program without fill and drain, the same work per tick (the
   no-bubble limit). Printed beside the formula
   ``(S - 1) / (M + S - 1)``, both schedules'. The two programs differ by ``S - 1`` ticks
   only, and 8 fake devices share the host's cores: one run's figure moves by about 0.04
   from run to run, so compare the formula with the median of a few runs. Circular rows
   (``num_repeats=R``, R = 2 at S = 4, M = 8: the same schedules with virtual stages) run ``R * M + S - 1`` ticks of ``1 / R`` of a
   stage's layers against ``R * M`` such ticks: ``(S - 1) / (R * M + S - 1)``, 0.158.
2. **Step time.** The whole train step (`make_train_step`, Adam) of one model, a residual
   MLP block repeated 8 times between a Dense embedding and head, under PipelineStrategy
   (stages x replicas), FSDPStrategy (8) and MirroredStrategy (8), same global batch,
   timed interleaved; printed as ratios. On fake CPU devices the stages share the host's
   cores, so a pipeline pays its bubble and gains no parallelism: the ratio shows the
   pipeline's overhead, not the speed-up of a real multi-chip pipeline.
3. **Per-stage peak memory.** The compiled train step's ``memory_analysis()`` (arguments +
   temporaries + outputs - aliased, per device) for 1, 2, 4 and 8 stages, the global batch
   fixed, M = 2S and 4S, both schedules: each stage holds ``1 / S`` of the repeated layers
   and their Adam moments, while the activations it keeps (GPipe: ``(M + S - 1) / M`` of a
   replica's rows through its ``L / S`` layers; 1F1B: ``2S - 1`` microbatch inputs and one
   microbatch's layers) stay about the same.
4. **Against a hand-written step.** The same model's train step written by hand (one
   ``jax.jit``, optax's Adam, a GPipe tick loop with ``jax.shard_map`` + ``ppermute``,
   ``NamedSharding`` on the stacked layers, no jstrategy), timed interleaved with
   jstrategy's GPipe and 1F1B steps, and each compiled step's peak, at a batch whose
   activations outweigh the state (2 stages x 4 replicas, M = 8, ``--peer-rows``).
5. **Variables split over the replicas too.** Both schedules' compiled peaks with
   ``shard_over_replicas=True`` (2 stages x 4 replicas, M = 8) at ``--rows``, where the
   state outweighs the activations, and at ``--peer-rows``: 1F1B's weight gradients are
   reduced over the replicas layer by layer, as GPipe's transposed loop reduces them.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/pipeline.py
"""

from __future__ import annotations

import argparse
import itertools
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
from jstrategy._src.input.placement import distribute_batch
from jstrategy._src.pipeline import circular
from jstrategy._src.pipeline import schedules
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


SCHEDULES = [s.value for s in schedules.PipelineSchedule]


def _loss(y: Any, logits: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


# 1. The bubble ----------------------------------------------------------------------------
def _block_program(strategy: PipelineStrategy, width: int, rows: int, bubble: bool):
    """The jitted forward and backward of 8 pipelined layers, each replica's rows vmapped
    (`bubble` False: without the fill and drain)."""
    repeats = strategy.num_repeats
    config = strategy.pipeline
    mesh = strategy.mesh
    on_stages = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("stage"))
    rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
    key = jax.random.key(0)
    # The 8 layers as the schedules take them (`circular.stage_layout`): (S, 8 / S, ...),
    # with virtual stages (S, R, 8 / (R * S), ...).
    layers = jax.random.normal(key, (8, width, width)) / np.sqrt(width)
    w = jax.device_put(circular.stage_layout(layers, config), on_stages)
    replicas = strategy.num_replicas_in_sync
    x = jax.device_put(jax.random.normal(key, (replicas, rows // replicas, width)), rows_sharding)

    def layer(wl: Any, h: Any) -> Any:
        return jnp.tanh(h @ wl)

    def stage(w: Any, h: Any) -> Any:
        return jax.lax.scan(lambda h, wl: (layer(wl, h), None), h, w)[0]

    if strategy.schedule is schedules.PipelineSchedule.GPIPE:
        # The train step's loop over (tick, layer); `ticks` counts ticks of K layer steps.
        ticks = None if bubble else repeats * strategy.num_microbatches

        def loss(w: Any, x: Any) -> Any:
            one = lambda xr: schedules.gpipe(layer, w, xr, config, ticks=ticks)  # noqa: E731
            return jnp.sum(jax.vmap(one, spmd_axis_name="replica")(x) ** 2)

        program = jax.jit(jax.grad(loss))
    else:

        def head(_: Any, h: Any, m: Any) -> Any:
            return jnp.sum(h**2), None

        def grads(w: Any, x: Any) -> Any:
            def one(xr: Any) -> Any:
                out = schedules.one_f_one_b(stage, w, xr, head, [], config, fill_and_drain=bubble)
                return out[3]

            return jnp.sum(jax.vmap(one, spmd_axis_name="replica")(x), axis=0)

        program = jax.jit(grads)
    return lambda i: program(w, x)


def bubble(width: int, rows: int, repeats: int, steps: int) -> list[tuple[Any, ...]]:
    results = []
    shapes = [(stages, factor * stages, 1) for stages, factor in itertools.product((2, 4), (2, 4))]
    shapes.append((4, 8, 2))  # circular: two virtual stages per stage
    for schedule, (stages, micro, virtual) in itertools.product(SCHEDULES, shapes):
        strategy = PipelineStrategy(
            num_stages=stages, num_microbatches=micro, schedule=schedule, num_repeats=virtual
        )
        samples = interleaved_samples(
            {
                "pipeline": _block_program(strategy, width, rows, True),
                "no bubble": _block_program(strategy, width, rows, False),
            },
            steps=steps,
            repeats=repeats,
        )
        ratios = [a / b for a, b in zip(samples["no bubble"], samples["pipeline"], strict=True)]
        measured = 1 - statistics.median(ratios)
        formula = (stages - 1) / (virtual * micro + stages - 1)
        results.append((schedule, stages, micro, virtual, measured, formula))
    return results


# 2. Step time ------------------------------------------------------------------------------
def _data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 32)).astype(np.float32)
    return x, rng.integers(0, 10, size=rows).astype(np.int32)


def _train_step(strategy: jstrategy.Strategy, width: int, rows: int):
    x, y = _data(rows)
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
        "1F1B 2x4 (M=4)": PipelineStrategy(num_stages=2, num_microbatches=4, schedule="1f1b"),
        "1F1B 4x2 (M=8)": PipelineStrategy(num_stages=4, num_microbatches=8, schedule="1f1b"),
        "Circular 4x2 (M=8, R=2)": PipelineStrategy(
            num_stages=4, num_microbatches=8, num_repeats=2
        ),
        "Interleaved 1F1B 4x2 (M=8, R=2)": PipelineStrategy(
            num_stages=4, num_microbatches=8, schedule="1f1b", num_repeats=2
        ),
        "FSDP 8": jstrategy.experimental.FSDPStrategy(),
        "Mirrored 8": jstrategy.MirroredStrategy(),
    }
    steps_by_name = {name: _train_step(s, width, rows)[0] for name, s in candidates.items()}
    samples = interleaved_samples(steps_by_name, steps=steps, repeats=repeats)
    out = {}
    for name in list(candidates)[:-2]:
        out[name] = (
            statistics.median(samples[name]),
            paired_ratio(samples[name], samples["FSDP 8"]),
            paired_ratio(samples[name], samples["Mirrored 8"]),
        )
    out["FSDP 8"] = (statistics.median(samples["FSDP 8"]), None, None)
    out["Mirrored 8"] = (statistics.median(samples["Mirrored 8"]), None, None)
    return out


# 3. Per-stage memory --------------------------------------------------------------------
def stage_peaks(
    width: int, rows: int, *, factor: int = 2, schedule: str = "gpipe"
) -> list[tuple[int, float, float]]:
    results = []
    for stages in (1, 2, 4, 8):
        strategy = PipelineStrategy(
            num_stages=stages, num_microbatches=factor * stages, schedule=schedule
        )
        _, step, state, batch = _train_step(strategy, width, rows)
        compiled = step.lower(state, batch).compile()
        stacked = sum(
            leaf.addressable_shards[0].data.nbytes
            for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]
            if schedules.STACKED_KEY in str(path)
        )
        results.append((stages, _peak(compiled) / 2**20, stacked / 2**20))
    return results


# 4. Against a hand-written step ------------------------------------------------------------
def _handwritten_gpipe_step(strategy: PipelineStrategy, state: Any):
    """The same train step written by hand, without jstrategy: one ``jax.jit`` of optax's
    Adam on the gradient of the mean loss, the replicas a ``vmap`` over the data axis, the
    block's layers a GPipe tick loop (``lax.scan``, ``jax.shard_map`` + ``ppermute``
    between ticks), the stacked layers split over ``"stage"`` with ``NamedSharding``."""
    mesh, stages, micro = strategy.mesh, strategy.num_stages, strategy.num_microbatches
    replicas = strategy.num_replicas_in_sync
    P = jax.sharding.PartitionSpec
    on_stages = jax.sharding.NamedSharding(mesh, P("stage"))

    def sharding(path: Any, leaf: Any) -> Any:
        spec = P("stage") if schedules.STACKED_KEY in str(path) else P()
        return jax.sharding.NamedSharding(mesh, spec)

    params = jax.device_get(state.params)
    shardings = jax.tree_util.tree_map_with_path(sharding, params)
    params = jax.device_put(params, shardings)
    tx = optax.adam(1e-3)
    opt_state = jax.jit(tx.init)(params)
    perm = [(i, (i + 1) % stages) for i in range(stages)]
    shift = jax.shard_map(
        lambda v: jax.lax.ppermute(v, "stage", perm), mesh=mesh, in_specs=P("stage"),
        out_specs=P("stage"),
    )  # fmt: skip

    def dense(p: Any, h: Any) -> Any:
        return h @ p["kernel"] + p["bias"]

    def layer(h: Any, p: Any) -> Any:
        wide, narrow = sorted(("Dense_0", "Dense_1"), key=lambda k: -p[k]["kernel"].shape[1])
        return h + dense(p[narrow], jnp.tanh(dense(p[wide], h))), None

    def pipeline(stacked: Any, h: Any) -> Any:
        per_stage = jax.tree.map(lambda v: v.reshape(stages, -1, *v.shape[1:]), stacked)
        xs = h.reshape(micro, -1, *h.shape[1:])
        run = jax.vmap(lambda p, h: jax.lax.scan(layer, h, p)[0])

        def tick(carry: Any, t: Any) -> Any:
            buffer, outputs = carry
            feed = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, micro - 1), keepdims=False)
            buffer = jax.lax.with_sharding_constraint(buffer.at[0].set(feed), on_stages)
            out = jax.lax.with_sharding_constraint(run(per_stage, buffer), on_stages)
            done = jnp.maximum(t - (stages - 1), 0)
            outputs = jax.lax.dynamic_update_index_in_dim(outputs, out[stages - 1], done, 0)
            return (shift(out), outputs), None

        init = (jnp.zeros((stages, *xs.shape[1:]), h.dtype), jnp.zeros_like(xs))
        (_, outputs), _ = jax.lax.scan(tick, init, jnp.arange(micro + stages - 1))
        return outputs.reshape(h.shape)

    def loss(params: Any, x: Any, y: Any) -> Any:
        def one(xr: Any, yr: Any) -> Any:
            h = dense(params["Dense_0"], xr)
            h = pipeline(params["Repeated_0"][schedules.STACKED_KEY], h)
            logits = dense(params["Dense_1"], h)
            return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, yr))

        xr = x.reshape(replicas, -1, *x.shape[1:])
        yr = y.reshape(replicas, -1)
        return jnp.sum(jax.vmap(one, spmd_axis_name="replica")(xr, yr)) / x.shape[0]

    def step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1)), params, opt_state


def against_handwritten(width: int, rows: int, repeats: int, steps: int) -> dict[str, Any]:
    """jstrategy's pipelined step against the hand-written GPipe step: time and peak."""
    results: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    for schedule in SCHEDULES:
        strategy = PipelineStrategy(num_stages=2, num_microbatches=8, schedule=schedule)
        run, step, state, batch = _train_step(strategy, width, rows)
        results[f"jstrategy {schedule}"] = _peak(step.lower(state, batch).compile())
        runs[f"jstrategy {schedule}"] = run
    strategy = PipelineStrategy(num_stages=2, num_microbatches=8)
    _, _, state, batch = _train_step(strategy, width, rows)
    program, params, opt_state = _handwritten_gpipe_step(strategy, state)
    on_rows = jax.sharding.NamedSharding(strategy.mesh, jax.sharding.PartitionSpec("replica"))
    x, y = (jax.device_put(v, on_rows) for v in _data(rows))
    results["hand-written gpipe"] = _peak(program.lower(params, opt_state, x, y).compile())
    holder = {"params": params, "opt_state": opt_state}

    def handwritten(i: int) -> Any:
        holder["params"], holder["opt_state"], value = program(
            holder["params"], holder["opt_state"], x, y
        )
        dispatch.track(value)
        return value

    runs["hand-written gpipe"] = handwritten
    samples = interleaved_samples(runs, steps=steps, repeats=repeats)
    times = {
        name: (statistics.median(s), paired_ratio(s, samples["hand-written gpipe"]))
        for name, s in samples.items()
    }
    return {"peaks": results, "times": times}


# 5. Variables split over the replicas too ----------------------------------------------
def split_peaks(width: int, rows: int) -> dict[str, float]:
    """Each schedule's compiled peak (MiB per device) with ``shard_over_replicas=True``."""
    peaks = {}
    for schedule in SCHEDULES:
        strategy = PipelineStrategy(
            num_stages=2, num_microbatches=8, schedule=schedule, shard_over_replicas=True
        )
        _, step, state, batch = _train_step(strategy, width, rows)
        peaks[schedule] = _peak(step.lower(state, batch).compile()) / 2**20
    return peaks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512, help="global batch of the train step")
    parser.add_argument(
        "--bubble-rows", type=int, default=2048, help="global batch of the bubble's programs"
    )
    parser.add_argument(
        "--peer-rows", type=int, default=4096, help="global batch against the hand-written step"
    )
    parser.add_argument("--parts", default="12345", help="which measurements, e.g. 13")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--bubble-steps",
        type=int,
        default=20,
        help="steps per round of the bubble's programs (their difference is S - 1 ticks)",
    )
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")

    if "1" in args.parts:
        _print_bubble(args)
    if "2" in args.parts:
        _print_step_times(args)
    if "3" in args.parts:
        _print_peaks(args)
    if "4" in args.parts:
        _print_handwritten(args)
    if "5" in args.parts:
        _print_split(args)


def _print_bubble(args: argparse.Namespace) -> None:
    print(
        "\n1. The bubble: measured 1 - T(M ticks) / T(all ticks) (median of paired rounds), "
        "and (S-1)/(R*M+S-1) (R: num_repeats, the virtual stages per stage)"
    )
    print(
        f"{'schedule':>8} {'stages':>6} {'M':>4} {'R':>2} {'measured':>9} "
        f"{'(S-1)/(R*M+S-1)':>16} {'measured/formula':>17}"
    )
    for schedule, stages, micro, virtual, measured, formula in bubble(
        args.width, args.bubble_rows, args.repeats, args.bubble_steps
    ):
        print(
            f"{schedule:>8} {stages:>6} {micro:>4} {virtual:>2} {measured:>9.3f} "
            f"{formula:>16.3f} {measured / formula:>17.2f}"
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
    print("\n3. Per-stage peak of the compiled train step (memory_analysis, per device, MiB)")
    print(
        f"{'schedule':>8} {'M':>5} {'stages':>6} {'peak':>8} {'stacked layers':>15} {'/ 1 stage':>10}"
    )
    for schedule, factor in itertools.product(SCHEDULES, (2, 4)):
        peaks = stage_peaks(args.width, args.rows, factor=factor, schedule=schedule)
        for stages, peak, stacked in peaks:
            print(
                f"{schedule:>8} {f'{factor}S':>5} {stages:>6} {peak:>8.2f} {stacked:>15.2f} "
                f"{peak / peaks[0][1]:>10.2f}"
            )


def _print_handwritten(args: argparse.Namespace) -> None:
    print(
        f"\n4. Against the hand-written GPipe step (2 stages x 4 replicas, M = 8, global "
        f"batch {args.peer_rows}): median step, paired ratio [min, max], compiled peak"
    )
    out = against_handwritten(args.width, args.peer_rows, args.repeats, args.steps)
    base = out["peaks"]["hand-written gpipe"]
    for name, (seconds, ratio) in out["times"].items():
        peak = out["peaks"][name]
        print(
            f"{name:<20} {seconds * 1e3:8.2f} ms  x{ratio[0]:.3f} [{ratio[1]:.3f}, "
            f"{ratio[2]:.3f}]   peak {peak / 2**20:7.2f} MiB  x{peak / base:.3f}"
        )


def _print_split(args: argparse.Namespace) -> None:
    print(
        "\n5. With shard_over_replicas=True (2 stages x 4 replicas, M = 8): compiled peak "
        "per device"
    )
    for rows in (args.rows, args.peer_rows):
        peaks = split_peaks(args.width, rows)
        print(
            f"batch {rows:>5}: gpipe {peaks['gpipe']:7.2f} MiB   1f1b {peaks['1f1b']:7.2f} MiB"
            f"  (x{peaks['1f1b'] / peaks['gpipe']:.2f})"
        )


if __name__ == "__main__":
    main()
