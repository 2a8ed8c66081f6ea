"""A worker of `tests/test_keras3_models.py`'s two-process test: Keras's own ``fit`` of a
``keras.Model`` under MultiWorkerMirroredStrategy.

Run through the launcher (``python -m jstrategy.launch --num_workers 2 ...
tests/keras3_worker.py OUT``): each process feeds its half of every global batch of 16 rows,
as Keras's multi-process data parallelism takes per-process batches, and writes the losses
and final weights to ``OUT/worker-<index>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")


def main() -> int:
    out = Path(sys.argv[1])
    import jax
    import keras
    import numpy as np

    import jstrategy

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_keras3_models import _data
    from test_keras3_models import bn_dropout_model

    strategy = jstrategy.MultiWorkerMirroredStrategy()
    x, y = _data()
    p, n = jax.process_index(), jax.process_count()
    # Rows of each global batch of 16: this process's contiguous share, in order.
    x_local = x.reshape(4, n, 16 // n, 6)[:, p].reshape(-1, 6)
    y_local = y.reshape(4, n, 16 // n)[:, p].reshape(-1)
    with strategy.scope():
        model = bn_dropout_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(x_local, y_local, batch_size=16 // n, epochs=2, shuffle=False, verbose=0)
    # Replicated: each process's first shard is the whole variable.
    weights = [np.asarray(w.value.addressable_shards[0].data).tolist() for w in model.weights]
    record = {"losses": history.history["loss"], "weights": weights}
    (out / f"worker-{p}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
