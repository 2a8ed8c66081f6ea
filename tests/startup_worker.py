"""Helper for tests/test_rendezvous.py: one process of a multi-worker job.

It prints ``STARTING`` just before it creates its `MultiWorkerMirroredStrategy`, runs one
all-reduce, prints ``READY <pid>`` and waits ``--hold`` seconds, so that its listeners can
be inspected.

Run with TF_CONFIG set: ``python tests/startup_worker.py [--timeout S] [--hold S]``;
``--timeout`` is `CommunicationOptions.timeout_seconds`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--hold", type=float, default=0.0)
    args = parser.parse_args()

    import numpy as np

    import jstrategy

    options = jstrategy.experimental.CommunicationOptions(timeout_seconds=args.timeout)
    print("STARTING", flush=True)
    strategy = jstrategy.MultiWorkerMirroredStrategy(communication_options=options)
    ones = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2, np.float32))
    total = strategy.reduce("SUM", ones, axis=None)
    print(f"SUM {float(total[0]):g}", flush=True)
    print(f"READY {os.getpid()}", flush=True)
    time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
