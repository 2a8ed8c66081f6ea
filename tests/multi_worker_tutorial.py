"""A worker of test_custom_training_tutorial.py: TF's custom-training tutorial under
MultiWorkerMirroredStrategy (TF_CONFIG set by the launcher); writes each epoch's losses and
accuracies (the metrics' global values) to ``OUT/worker-<index>.npz``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import custom_training_tutorial
    import numpy as np

    import jstrategy

    strategy = jstrategy.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    # The chief's checkpoint directory is the one every worker names (as TF's tutorials
    # say, the others' writes are discarded; here every worker writes its own shards).
    result = custom_training_tutorial.main(
        strategy,
        epochs=2,
        batch_size_per_replica=16,
        num_train=200,
        num_test=100,
        checkpoint_dir=str(Path(args.out) / "checkpoints"),
        verbose=False,
    )
    np.savez(Path(args.out) / f"worker-{task['index']}.npz", **result)
    print(f"worker {task['index']}: done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
