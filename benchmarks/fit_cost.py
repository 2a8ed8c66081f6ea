"""`Model.fit`'s host time per step, with each default callback and fit feature on and off.

A cost guard (issue 39): run it before and after a change to `fit` lands, and compare the
rows. It trains `fit_throughput.py`'s model and data (digits MLP 64-256-256-10, SGD with
momentum, global batch 256 over the strategy's replicas) under each configuration and
prints one table: the configuration, the host time per training step in microseconds,
its ratio to the bare loop (the hand-written `jax.jit` loop of `fit_throughput.py`:
gather the rows, `jax.device_put`, one jitted step, `dispatch.track`, the loss read once
an epoch), and the wall time per step for reference.

Host time is the CPU time of the Python thread that calls `fit` (`time.thread_time`),
not wall time: the thread consumes none while it is blocked waiting for the devices (the
in-flight bound's waits, the epoch's reads), and XLA runs the (fake) devices' programs on
its own threads, so what is counted is the work `fit` does on the host per step: Python,
callbacks, logs, input gathering and placement, dispatch. It is also what a loaded machine
disturbs least: a thread that is descheduled consumes no CPU time, where wall time keeps
running. Everything `fit` does outside the training steps (validation, the epoch's end,
callbacks' epoch hooks) is divided among the training steps, since that is what a user
pays for them. Each row is the median over `--repeats` interleaved runs (every run times
every configuration in turn, the order rotating), after one untimed run of each that
compiles its programs. `History` is in every row: `fit` always returns one.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/fit_cost.py

It runs in under a minute with its defaults on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_throughput

import jstrategy
import jstrategy.losses

BARE_LOOP = "bare loop: hand-written jax.jit"


class _Terminal(io.StringIO):
    """Where the progress bar draws: a terminal (so `verbose=1` draws a live bar at its
    redraw interval, reading the logs then, as in a shell), kept in memory."""

    def isatty(self) -> bool:
        return True


class _UserCallback(jstrategy.callbacks.Callback):
    """A user's per-batch hook that does nothing: what the hook machinery itself costs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.calls += 1


def _model(strategy: jstrategy.Strategy, x: np.ndarray, steps_per_execution: int):
    with strategy.scope():
        model = jstrategy.Model(fit_throughput.MLP(), input_shape=(x.shape[1],))
        model.compile(
            fit_throughput._tx(),
            loss=jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    return model


def configurations(
    strategy: jstrategy.Strategy, x: np.ndarray, y: np.ndarray, epochs: int
) -> dict[str, Callable[[], Any]]:
    """Each configuration's run: `epochs` epochs of `fit` (or of the bare loop)."""
    hand, _ = fit_throughput.hand_written(strategy, x, y, shard_map=False)
    models = {n: _model(strategy, x, n) for n in (1, 8)}
    validation = (x[: 2 * fit_throughput.BATCH], y[: 2 * fit_throughput.BATCH])
    class_weight = {c: 1.0 + c / 10 for c in range(10)}
    sample_weight = np.linspace(0.5, 1.5, len(x)).astype(np.float32)

    def fit(spe: int, **kwargs: Any) -> Callable[[], Any]:
        kwargs.setdefault("verbose", 0)

        def run() -> Any:
            # verbose=1 draws to a terminal; verbose=2 prints one line an epoch.
            with contextlib.redirect_stdout(_Terminal()):
                return models[spe].fit(
                    x, y, batch_size=fit_throughput.BATCH, epochs=epochs, **kwargs
                )

        return run

    everything = {
        "verbose": 1,
        "validation_data": validation,
        "class_weight": class_weight,
    }
    return {
        BARE_LOOP: lambda: hand(epochs),
        "fit, everything off (verbose=0)": fit(1),
        "fit, verbose=1 (progress bar, terminal)": fit(1, verbose=1),
        "fit, verbose=2 (a line an epoch)": fit(1, verbose=2),
        "fit, validation_data (2 batches)": fit(1, validation_data=validation),
        "fit, class_weight": fit(1, class_weight=class_weight),
        "fit, sample_weight": fit(1, sample_weight=sample_weight),
        "fit, user callback on_train_batch_end": fit(1, callbacks=[_UserCallback()]),
        "fit, all of the above but sample_weight": fit(
            1, callbacks=[_UserCallback()], **everything
        ),
        "fit, steps_per_execution=8": fit(8),
        "fit, steps_per_execution=8, all of the above": fit(
            8, callbacks=[_UserCallback()], **everything
        ),
    }


def measure(
    runs: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """(host seconds, wall seconds) of each run, `repeats` interleaved rounds each."""
    for run in runs.values():  # compile everything once
        run()
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runs}
    names = list(runs)
    for r in range(repeats):
        # Rotate the order so that no run always follows the same other one.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, host = time.perf_counter(), time.thread_time()
            runs[name]()
            host, wall = time.thread_time() - host, time.perf_counter() - wall
            samples[name][0].append(host)
            samples[name][1].append(wall)
    return samples


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Prints the table; returns each configuration's median host microseconds per step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat-data", type=int, default=8, help="digits copies per epoch")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs")
    args = parser.parse_args(argv)

    strategy = jstrategy.MirroredStrategy()
    x, y = fit_throughput._data(args.repeat_data)
    steps = args.epochs * (len(x) // fit_throughput.BATCH)
    samples = measure(configurations(strategy, x, y, args.epochs), args.repeats)
    host = {name: statistics.median(h) / steps * 1e6 for name, (h, _) in samples.items()}
    wall = {name: statistics.median(w) / steps * 1e6 for name, (_, w) in samples.items()}
    bare = host[BARE_LOOP]
    print(
        f"{len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"{strategy.num_replicas_in_sync} replicas, global batch {fit_throughput.BATCH}, "
        f"{steps} training steps a run, median of {args.repeats} interleaved runs; host = "
        "CPU time of fit's thread per training step"
    )
    width = max(len(name) for name in host) + 2
    print(f"  {'configuration':<{width}} {'host us/step':>12s}  {'vs bare loop':>12s}"
          f"  {'wall us/step':>12s}")  # fmt: skip
    for name, us in host.items():
        print(f"  {name:<{width}} {us:12.0f}  {us / bare:11.2f}x  {wall[name]:12.0f}")
    return host


if __name__ == "__main__":
    main()
