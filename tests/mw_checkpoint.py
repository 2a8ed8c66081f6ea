"""Helper for tests/test_multi_worker_checkpoints.py: checkpoints as TF's multi-worker tutorials
write them, on 2 workers.

Run under the launcher: ``python -m jstrategy.launch --num_workers 2 --devices_per_worker 2
tests/mw_checkpoint.py OUT MODE [--timeout S]`` (``--timeout`` is
`CommunicationOptions.timeout_seconds`). Modes:

* ``tutorial``: the custom-training-loop tutorial's pattern, line for line: the chief writes
  into ``OUT/ckpt`` and ``OUT/model``, every other worker into its own
  ``.../workertemp_<index>`` (TF's ``write_filepath``), which it deletes afterwards; three
  epochs of `strategy.run` with a `CheckpointManager(max_to_keep=1)` and a final
  `save_weights`. Then every worker restores from the chief's directories and writes
  ``OUT/restored-<index>.npz`` (the trained and the restored parameters).
* ``chief-only``: only the chief saves (``if strategy.is_chief``), the others go on; the
  chief prints ``SAVE-FAILED <seconds> <message>`` when its save fails.
* ``no-strategy``: every worker restores without ``strategy=``; prints ``RESTORE-FAILED
  <message>``.
* ``lonely-reduce``: after one all-reduce together, only the chief runs another; it prints
  ``REDUCE-FAILED <seconds> <error>`` when that fails.
* ``idle``: prints ``READY`` after one all-reduce and sleeps, to receive SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path


def _is_chief(task_type: str, task_id: int) -> bool:
    return task_type == "chief" or (task_type == "worker" and task_id == 0)


def _write_dir(dirpath: str, task_type: str, task_id: int) -> str:
    # TF's tutorial: `write_filepath`, with `_get_temp_dir` for the non-chief workers.
    if _is_chief(task_type, task_id):
        return dirpath
    temp = os.path.join(dirpath, f"workertemp_{task_id}")
    os.makedirs(temp, exist_ok=True)
    return temp


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode")
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args()

    import jstrategy

    options = jstrategy.experimental.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = jstrategy.MultiWorkerMirroredStrategy(communication_options=options)
    import jax
    import jax.numpy as jnp
    import numpy as np

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    task_type, task_id = task["type"], task["index"]
    out = Path(args.out)

    if args.mode == "lonely-reduce":
        ones = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(1))
        strategy.reduce("SUM", ones, axis=None)  # once together
        if not strategy.is_chief:
            time.sleep(120)  # skips the next one
            return 0
        start = time.monotonic()
        try:
            float(strategy.reduce("SUM", ones, axis=None)[0])
        except Exception as e:  # what the program sees
            print(f"REDUCE-FAILED {time.monotonic() - start:.1f} {type(e).__name__}: {e}")
            sys.stdout.flush()
            os._exit(1)  # the runtime's own shutdown would wait for the sleeping worker
        return 0

    if args.mode == "idle":
        ones = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(1))
        strategy.reduce("SUM", ones, axis=None)
        print("READY", flush=True)
        time.sleep(120)
        return 0

    params = jax.device_put(
        {"w": jnp.arange(4.0), "b": jnp.zeros(2)}, strategy.replicated_sharding()
    )

    def train_step(params):
        ctx = jstrategy.get_replica_context()
        grad = ctx.all_reduce("MEAN", jnp.full(4, 1.0 + ctx.replica_id_in_sync_group))
        return {"w": params["w"] - 0.1 * grad, "b": params["b"] + 1.0}

    checkpoint_dir = str(out / "ckpt")
    if args.mode == "chief-only":
        manager = jstrategy.CheckpointManager(checkpoint_dir)
        if strategy.is_chief:
            start = time.monotonic()
            try:
                manager.save(1, params)
            except TimeoutError as e:
                print(f"SAVE-FAILED {time.monotonic() - start:.1f} {e}", flush=True)
                return 1
            return 0
        time.sleep(120)  # "training on"
        return 0

    if args.mode == "no-strategy":
        with jstrategy.CheckpointManager(checkpoint_dir) as manager:
            manager.save(1, params)
            try:
                manager.restore()
            except ValueError as e:
                print(f"RESTORE-FAILED {e}", flush=True)
                return 1
        return 0

    # The tutorial ------------------------------------------------------------------------
    write_checkpoint_dir = _write_dir(checkpoint_dir, task_type, task_id)
    manager = jstrategy.CheckpointManager(write_checkpoint_dir, max_to_keep=1)
    for epoch in range(3):
        for _ in range(2):
            params = strategy.run(train_step, (params,))
        manager.save(epoch, params)
    manager.close()
    model_path = str(out / "model" / "weights")
    write_model_path = os.path.join(
        _write_dir(os.path.dirname(model_path), task_type, task_id), "weights"
    )
    jstrategy.save_weights(write_model_path, jax.tree.map(jnp.zeros_like, params))
    jstrategy.save_weights(write_model_path, params)  # overwrites: swapped on the chief
    if not _is_chief(task_type, task_id):
        # As the tutorial: `tf.io.gfile.rmtree(write_checkpoint_dir)`, and the model's.
        shutil.rmtree(write_checkpoint_dir)
        shutil.rmtree(os.path.dirname(write_model_path))

    with jstrategy.CheckpointManager(checkpoint_dir) as manager:
        latest = manager.latest_step()
        restored = manager.restore(strategy=strategy)
    loaded = jstrategy.load_weights(model_path, strategy=strategy)
    trained = strategy.experimental_local_results(params)[0]
    np.savez(
        out / f"restored-{task_id}.npz",
        latest=latest,
        **{f"trained_{k}": np.asarray(v) for k, v in trained.items()},
        **{f"restored_{k}": np.asarray(v) for k, v in restored.items()},
        **{f"loaded_{k}": np.asarray(v) for k, v in loaded.items()},
    )
    print(f"DONE {task_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
