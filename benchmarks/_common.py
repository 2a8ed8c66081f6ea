"""Helpers shared by the benchmarks: timing with bounded in-flight steps."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax

from jstrategy._src.training.plan import planner

# XLA's CPU collectives deadlock when too many steps are queued; wait every few steps.
WAIT_EVERY = 8


def time_loop(step: Callable[[int], object], steps: int) -> float:
    """Seconds per step of `step(i)` over `steps` calls, waiting on an output every few."""
    out = step(0)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for i in range(steps):
        out = step(i)
        if i % WAIT_EVERY == 0:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def interleaved_samples(
    candidates: dict[str, Callable[[int], object]], *, steps: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per step of each candidate in each of `repeats` rounds; every round times
    every candidate in turn, so the i-th samples of two candidates were taken close
    together (their ratio is a paired comparison). Odd rounds run the candidates in the
    reverse order, so neither of two neighbours always runs first (after the other's
    caches, threads and allocations)."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates.items())
    for i in range(repeats):
        for name, step in order if i % 2 == 0 else order[::-1]:
            samples[name].append(time_loop(step, steps))
    return samples


def compare(candidates: dict[str, Callable[[int], object]], *, steps: int, repeats: int):
    """Median seconds per step of each candidate, measured interleaved in one process."""
    samples = interleaved_samples(candidates, steps=steps, repeats=repeats)
    return {name: statistics.median(s) for name, s in samples.items()}


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """The median, min and max over rounds of ``a[i] / b[i]`` (`interleaved_samples`)."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def mlp_step_arguments(description: str, argv: list[str] | None) -> argparse.Namespace:
    """The flags of the MLP step benchmarks (overhead.py, tf_custom_loop.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    return parser.parse_args(argv)


def print_step_table(medians: dict[str, float], args: argparse.Namespace, replicas: int) -> None:
    """Prints `compare`'s medians of an MLP step benchmark as ms/step and as ratios to the
    first candidate."""
    base = next(iter(medians.values()))
    print(
        f"MLP 64-{args.width}-{args.width}-10, global batch {args.batch}, {replicas} replicas "
        f"on {jax.devices()[0].platform}, median of {args.repeats} x {args.steps} steps"
    )
    width = max(len(name) for name in medians) + 2
    for name, seconds in medians.items():
        print(f"  {name:<{width}} {seconds * 1e3:8.3f} ms/step   ratio {seconds / base:5.3f}")


# A compiled program's peak per device: the one formula, `plan`'s.
compiled_peak = planner.compiled_peak
