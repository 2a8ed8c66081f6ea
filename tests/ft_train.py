"""Helper for tests/test_fault_tolerance.py: a `Model.fit` with `BackupAndRestore` to interrupt.

Run as ``python tests/ft_train.py BACKUP_DIR OUT_NPZ [--sleep S] [--save_freq N]``. Trains
a small MLP on fixed data (shuffled every epoch, with a partial last batch) under
``MirroredStrategy(["cpu:0", "cpu:1"])`` with ``BackupAndRestore(BACKUP_DIR, save_freq=N)``,
printing ``STEP <epoch> <step>`` after every step and sleeping S seconds there, so that a
test can interrupt it (SIGKILL, SIGTERM) at a point it chooses. When training completes, the
final weights go to OUT_NPZ (``w0``, ``w1``, ...). Started again after an interruption, the
same command resumes from the backup. `train` is the same run in-process, uninterrupted.
"""

from __future__ import annotations

import argparse
import sys
import time

EPOCHS = 3
ROWS = 60
BATCH = 8  # 8 steps per epoch, the last one partial


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 5.0) + 0.1 * rng.normal(size=ROWS)).astype(np.float32)[:, None]
    return x, y


def make_model(strategy, steps_per_execution: int = 1):
    import flax.linen as nn
    import optax

    import jstrategy

    with strategy.scope():
        model = jstrategy.Model(
            nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(1)]), input_shape=(4,), seed=7
        )
        model.compile(
            optax.adam(0.01),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
    return model


def train(strategy, callbacks=(), epochs: int = EPOCHS):
    """The run: returns the model after `fit` (uninterrupted unless the callbacks say so)."""
    x, y = data()
    model = make_model(strategy)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=list(callbacks))
    return model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("out")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--save_freq", type=int, default=2)
    args = parser.parse_args()

    import numpy as np

    import jstrategy

    class Report(jstrategy.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print(f"STEP {self.model.fit_state.epoch} {batch + 1}", flush=True)
            time.sleep(args.sleep)

    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    backup = jstrategy.callbacks.BackupAndRestore(args.backup_dir, save_freq=args.save_freq)
    model = train(strategy, [backup, Report()])
    np.savez(args.out, **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
