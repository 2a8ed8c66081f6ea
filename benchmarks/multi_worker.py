"""Time of the same training as 2 processes x 2 devices against 1 process x 4 devices.

Both run the custom-loop example's MLP for the same global batches: once under
MultiWorkerMirroredStrategy with two workers started by the launcher (gloo collectives over
127.0.0.1), once under MirroredStrategy over four fake devices in one process. It prints
each run's wall time (process start to exit), the training time measured inside the
processes, and the ratios. Both runs end with the same parameters (checked).

    python benchmarks/multi_worker.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """One process of either run: trains and writes its timing and parameters."""
    sys.path.insert(0, str(ROOT / "examples"))
    import custom_training_loop
    import numpy as np

    import jstrategy

    if args.mode == "multi":
        strategy = jstrategy.MultiWorkerMirroredStrategy()
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    else:
        strategy = jstrategy.MirroredStrategy()
        index = 0
    custom_training_loop.train(strategy, 5)  # compile outside the timed part
    start = time.perf_counter()
    losses, params = custom_training_loop.train(strategy, args.steps)
    seconds = time.perf_counter() - start
    leaves = {f"p{i}": v for i, v in enumerate(__import__("jax").tree.leaves(params))}
    np.savez(
        Path(args.out) / f"{args.mode}-{index}.npz", seconds=seconds, loss=losses[-1], **leaves
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="multi", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import numpy as np

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
    with tempfile.TemporaryDirectory() as out:
        common = [__file__, "--worker", "--steps", str(args.steps), "--out", out]
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
             "--devices_per_worker", "2", *common, "--mode", "multi"],
            env=env, check=True, timeout=600, cwd=ROOT, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        multi_wall = time.perf_counter() - start
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, *common, "--mode", "single"],
            env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                 "JAX_PLATFORMS": "cpu"},
            check=True, timeout=600, cwd=ROOT,
        )  # fmt: skip
        single_wall = time.perf_counter() - start
        multi = [np.load(Path(out) / f"multi-{i}.npz") for i in range(2)]
        single = np.load(Path(out) / "single-0.npz")
        for key in single.files:
            if key.startswith("p"):
                np.testing.assert_allclose(multi[0][key], single[key], rtol=1e-4, atol=1e-5)
        multi_train = max(float(m["seconds"]) for m in multi)
        single_train = float(single["seconds"])
    print(f"same training, {args.steps} steps of global batch 64 (custom-loop MLP), CPU:")
    print(f"  2 workers x 2 devices: wall {multi_wall:6.1f} s, training {multi_train:6.2f} s")
    print(f"  1 process x 4 devices: wall {single_wall:6.1f} s, training {single_train:6.2f} s")
    print(
        f"  ratio 2x2 / 1x4: wall {multi_wall / single_wall:.2f}, "
        f"training {multi_train / single_train:.2f} (parameters equal)"
    )


if __name__ == "__main__":
    main()
