"""Compiled programs and memory when `predict` sees many different row counts.

`jax.jit` compiles one program per input shape and keeps it. A loop that calls a jitted
predict function on arrays of 1, 2, ..., N rows therefore compiles N programs, as
`Model.predict` did before it padded arrays smaller than a batch (issue 15, finding 8:
400 row counts grew memory by 91 MB). Side by side, in one process, over the same row
counts and the same MLP: a hand-written `jax.jit` predict on each array as it is, and
`Model.predict` (`OneDeviceStrategy`), which pads to a power of two and masks. Counted:
XLA compilations (JAX's ``/jax/core/compile/backend_compile_duration`` events) and the
growth of the process's resident memory.

A serving loop also calls ``predict(x, batch_size=len(x))``: each request its own batch
size, which compiled one program per size until `evaluate` and `predict` padded batches
to a bucket too (issue 21, finding 10). It is measured the same way.

Expected: the plain jit compiles once per row count; `Model.predict` at most
``log2(batch_size) + 1`` times with a fixed batch size and ``2 * log2(rows) + 1`` times
with ``batch_size=len(x)``, and its memory does not grow with the row counts.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/row_counts.py
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable

import flax.linen as nn
import jax
import numpy as np
import optax

import jstrategy

FEATURES, HIDDEN, CLASSES = 32, 256, 10


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _measure(predict: Callable[[np.ndarray], object], x: np.ndarray) -> tuple[int, float]:
    """(compilations, resident memory growth in MB) of `predict` on 1..len(x) rows."""
    compiles: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.block_until_ready(predict(x[:1]))  # the first program is no one's extra
    gc.collect()
    before = _rss_mb()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for rows in range(1, len(x) + 1):
            jax.block_until_ready(predict(x[:rows]))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    gc.collect()
    return len(compiles), _rss_mb() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400, help="row counts 1..rows")
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args()

    module = nn.Sequential(
        [nn.Dense(HIDDEN), nn.relu, nn.Dense(HIDDEN), nn.relu, nn.Dense(CLASSES)]
    )
    with jstrategy.OneDeviceStrategy("cpu:0").scope():
        model = jstrategy.Model(module, input_shape=(FEATURES,))
        model.compile(optax.sgd(0.1), loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(args.rows, FEATURES)).astype(np.float32)
    variables = model.variables
    plain = jax.jit(lambda v, x: module.apply(v, x))

    results = {
        "jax.jit on each array": _measure(lambda x: plain(variables, x), x),
        "Model.predict": _measure(
            lambda x: model.predict(x, batch_size=args.batch_size, verbose=0), x
        ),
        "Model.predict, bs=len(x)": _measure(
            lambda x: model.predict(x, batch_size=len(x), verbose=0), x
        ),
    }
    print(f"predict on row counts 1..{args.rows} (batch_size={args.batch_size}):")
    for name, (compiles, grown) in results.items():
        print(f"  {name:24s} {compiles:4d} compilations, resident memory +{grown:6.1f} MB")
    (jit_compiles, jit_mb), (model_compiles, model_mb), _ = results.values()
    print(
        f"  ratio (jit / Model.predict): {jit_compiles / max(model_compiles, 1):.0f}x "
        f"compilations, memory growth {jit_mb:.0f} MB vs {model_mb:.0f} MB"
    )


if __name__ == "__main__":
    main()
