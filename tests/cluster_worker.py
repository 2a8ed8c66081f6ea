"""Helper for tests/test_cluster.py: one process of a 2-process job that a sharded strategy
joins through `jstrategy.cluster_resolver.join`.

Run with TF_CONFIG set (2 workers, 2 fake CPU devices each): ``python
tests/cluster_worker.py``. It creates a `ModelParallelStrategy` over a (2, 2) mesh of both
processes' devices, then prints:

* ``JOINED <process> of <count> chief=<bool> connected=<bool> workers=<n> devices=<n>``;
* ``SAME <bool> <bool> <bool>``: whether `join()` again, the strategy's cluster and an
  `FSDPStrategy`'s cluster are the one `Cluster` the first join returned;
* ``CONTRADICTION <message>``: the error of a join as the other worker;
* ``SUM <total>`` after one all-reduce over the data axis, then ``READY`` and sleeps, to
  receive SIGTERM.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    import jstrategy

    options = jstrategy.experimental.CommunicationOptions(timeout_seconds=30)
    mesh = jstrategy.experimental.DeviceMesh((2, 2), ("batch", "model"))
    strategy = jstrategy.experimental.ModelParallelStrategy(
        jstrategy.experimental.LayoutMap(mesh), communication_options=options
    )
    import jax
    import numpy as np

    from jstrategy.cluster_resolver import SimpleClusterResolver
    from jstrategy.cluster_resolver import join

    cluster = join(timeout_seconds=30)
    print(
        f"JOINED {cluster.process_id} of {cluster.num_processes} chief={cluster.is_chief} "
        f"connected={cluster.connected} workers={strategy.num_workers} "
        f"devices={len(jax.devices())}",
        flush=True,
    )
    fsdp = jstrategy.experimental.FSDPStrategy(communication_options=options)
    print(
        f"SAME {join(timeout_seconds=30) is cluster} {strategy._cluster is cluster} "
        f"{fsdp._cluster is cluster}",
        flush=True,
    )
    config = json.loads(os.environ["TF_CONFIG"])
    other = SimpleClusterResolver(
        config["cluster"], task_type="worker", task_id=1 - config["task"]["index"]
    )
    try:
        join(other, timeout_seconds=30)
    except RuntimeError as e:
        print(f"CONTRADICTION {e}", flush=True)
    ones = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(1))
    print(f"SUM {float(strategy.reduce('SUM', ones, axis=None)[0]):g}", flush=True)
    print("READY", flush=True)
    time.sleep(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
