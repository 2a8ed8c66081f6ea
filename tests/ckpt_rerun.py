"""Helper for tests/test_keras_checkpoints.py: one run of a script that keeps its best model.

Run as ``python tests/ckpt_rerun.py FILEPATH OUT_NPZ --lr LR --epochs N``. Trains a small
`jstrategy.Sequential` under `MirroredStrategy` (every device the process has) with
``ModelCheckpoint(FILEPATH, save_best_only=True)`` on ``val_loss``, as a Keras user's
script does, and writes to OUT_NPZ the weights of its best epoch (``w0``, ``w1``, ...)
and that epoch's ``val_loss``. Running it twice with the same FILEPATH is the case of
issue 49: the second run's best model must be what FILEPATH holds afterwards.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("filepath")
    parser.add_argument("out")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args()

    import numpy as np

    import jstrategy
    from jstrategy.layers import Dense

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 5.0)).astype(np.float32)[:, None]
    with jstrategy.MirroredStrategy().scope():
        model = jstrategy.Sequential([Dense(8, activation="relu", input_shape=(4,)), Dense(1)])
        model.compile(jstrategy.optimizers.SGD(args.lr), loss="mse")
    best: dict = {}

    def record(epoch, logs):
        if not best or logs["val_loss"] < best["val_loss"]:
            best.update(val_loss=logs["val_loss"], weights=model.get_weights())

    model.fit(
        x,
        y,
        batch_size=16,
        epochs=args.epochs,
        validation_split=0.25,
        shuffle=False,
        verbose=0,
        callbacks=[
            jstrategy.callbacks.ModelCheckpoint(args.filepath, save_best_only=True),
            jstrategy.callbacks.LambdaCallback(on_epoch_end=record),
        ],
    )
    weights = {f"w{i}": w for i, w in enumerate(best["weights"])}
    np.savez(args.out, val_loss=best["val_loss"], **weights)
    print(f"BEST {best['val_loss']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
