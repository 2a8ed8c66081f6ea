"""Helper for tests/test_fault_tolerance.py: a multi-worker `Model.fit` to preempt and resume.

Run under the launcher:
``python -m jstrategy.launch --num_workers 2 --devices_per_worker 2 tests/ft_mw.py OUT [--sleep S]``.
Every worker trains `ft_train`'s model for ``--epochs`` epochs under
`MultiWorkerMirroredStrategy` with ``BackupAndRestore(OUT/backup)`` (backups at preemption
only), printing ``worker <i> pid <pid>`` first and ``worker <i> STEP <epoch> <step>`` after
every step (sleeping S seconds there). Files, per worker index i:

* ``OUT/begin-<i>.npz``: the weights when training starts (after a restore, if any);
* ``OUT/preempted-<i>.npz``: on a preemption, the weights saved, with ``epoch``/``step``;
* ``OUT/final-<i>.npz``: the weights when training completes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()

    import jstrategy

    strategy = jstrategy.MultiWorkerMirroredStrategy()
    import ft_train
    import numpy as np

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    out = Path(args.out)
    print(f"worker {index} pid {os.getpid()}", flush=True)

    def dump(name: str, model, **extra) -> None:
        weights = {f"w{i}": w for i, w in enumerate(model.get_weights())}
        np.savez(out / f"{name}-{index}.npz", **weights, **extra)

    class Begin(jstrategy.callbacks.Callback):  # after BackupAndRestore: sees the restore
        def on_train_begin(self, logs=None):
            dump("begin", self.model)

    class Steps(jstrategy.callbacks.Callback):  # before it: sees the step it backs up
        def on_train_batch_end(self, batch, logs=None):
            self.where = (self.model.fit_state.epoch, batch + 1)
            print(f"worker {index} STEP {self.where[0]} {self.where[1]}", flush=True)
            time.sleep(args.sleep)

    steps = Steps()
    backup = jstrategy.callbacks.BackupAndRestore(out / "backup")
    x, y = ft_train.data()
    model = ft_train.make_model(strategy)
    try:
        model.fit(
            x,
            y,
            batch_size=ft_train.BATCH,
            epochs=args.epochs,
            verbose=0,
            callbacks=[steps, backup, Begin()],
        )
    except SystemExit:
        epoch, step = steps.where
        dump("preempted", model, epoch=epoch, step=step)
        print(f"worker {index} preempted at epoch {epoch} step {step}", flush=True)
        raise
    dump("final", model)
    print(f"worker {index} DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
