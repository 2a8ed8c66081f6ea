"""Helper for tests/test_checkpoint.py: a process that stops while writing a checkpoint.

Run as ``python tests/checkpoint_writer.py DIRECTORY MODE``. Saves step 1 (every leaf 1.0)
and waits for it, then starts the asynchronous save of step 2 (random leaves, tens of MB in
hundreds of arrays, so its write takes a while), and then:

* ``kill``: waits until part of step 2 is on disk in orbax's temporary directory and kills
  itself with SIGKILL before the commit. Exit codes: killed by SIGKILL (-9 as the parent
  sees it) when it worked; 3 if step 2 was committed before the kill (the write was too
  fast to interrupt); 4 if no partial write appeared within the time limit.
* ``exit``: returns from main at once, without closing the manager: the interpreter exits
  with the write in flight.

Step 2's leaf ``wNNN`` is row NNN of ``noise()``.

``python tests/checkpoint_writer.py DIRECTORY rounds SEED`` instead saves steps
asynchronously with ``max_to_keep=3``, continuing after the latest step, every leaf of step
``s`` equal to ``s``, until it kills itself with SIGKILL: at the first moment it sees a
listed step directory without orbax's ``commit_success.txt`` (a step half written or half
deleted: the worst moment to die), or else after a random time drawn from SEED.
"""

import contextlib
import glob
import os
import signal
import sys
import time

_LEAVES = 400
_SIZE = 16384  # float32 elements per leaf: 26 MB in all


def _partial_files(directory: str) -> list[str]:
    found = []
    for tmp in glob.glob(os.path.join(directory, "2.orbax-checkpoint-tmp*")):
        for root, _, files in os.walk(tmp):
            found += [os.path.join(root, f) for f in files if "/d" in root]
    return found


def noise():
    import numpy as np

    # Random bits do not compress, so step 2 really writes all its bytes.
    return np.random.default_rng(0).standard_normal((_LEAVES, _SIZE), dtype=np.float32)


def main(directory: str, mode: str) -> int:
    import jax
    import numpy as np

    import jstrategy

    strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    sharding = strategy.replicated_sharding()
    ones = np.ones(_SIZE, np.float32)
    first = {f"w{i:03d}": jax.device_put(ones, sharding) for i in range(_LEAVES)}
    second = {name: jax.device_put(r, sharding) for name, r in zip(first, noise(), strict=True)}
    jax.block_until_ready(second)
    manager = jstrategy.CheckpointManager(directory, async_save=True)
    manager.save(1, first)
    manager.wait_until_finished()
    print("SAVED 1", flush=True)
    manager.save(2, second)
    if mode == "exit":
        # Committed already only if the write outran this line; the parent checks.
        print("EXITING", "DONE" if os.path.exists(os.path.join(directory, "2")) else "IN-FLIGHT")
        return 0
    deadline = time.monotonic() + 30
    while not _partial_files(directory):
        if time.monotonic() > deadline:
            return 4
        time.sleep(0.0005)
    if os.path.exists(os.path.join(directory, "2")):
        return 3
    print("KILLING", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return 0  # unreachable


def damaged_steps(directory: str) -> list[str]:
    """Listed step directories that orbax did not mark committed."""
    names = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.isdigit() and not os.path.exists(os.path.join(path, "commit_success.txt")):
            names.append(name)
    return names


def rounds(directory: str, seed: int) -> int:
    import random
    import threading

    import jax
    import numpy as np

    import jstrategy

    manager = jstrategy.CheckpointManager(directory, max_to_keep=3, async_save=True)
    print("STEPS", *manager.all_steps(), flush=True)
    start = (manager.latest_step() or 0) + 1

    def watch() -> None:
        while True:
            with contextlib.suppress(OSError):
                if damaged_steps(directory):
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0001)

    threading.Thread(target=watch, daemon=True).start()
    delay = random.Random(seed).uniform(0.2, 1.5)
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    sharding = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).replicated_sharding()
    for step in range(start, start + 100_000):
        state = {f"w{i:02d}": jax.device_put(np.full(8192, step, np.float32), sharding)
                 for i in range(40)}  # fmt: skip
        manager.save(step, state)
    return 5  # never reached: killed before


if __name__ == "__main__":
    if sys.argv[2] == "rounds":
        sys.exit(rounds(sys.argv[1], int(sys.argv[3])))
    sys.exit(main(sys.argv[1], sys.argv[2]))
