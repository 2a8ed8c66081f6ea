"""A worker of the parity matrix's multi-process cells (`tests/test_parity_matrix.py`).

Run through the launcher (``python -m jstrategy.launch --num_workers 2 ...
tests/parity_worker.py OUT MODEL``): trains `parity_zoo`'s MODEL under
MultiWorkerMirroredStrategy from ``TF_CONFIG`` through `Model.fit`, and writes the losses and
final variables to ``OUT/worker-<index>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    out, model = Path(sys.argv[1]), sys.argv[2]
    import jax
    import parity_zoo

    import jstrategy

    strategy = jstrategy.MultiWorkerMirroredStrategy()
    result = parity_zoo.train(model, strategy, "inside", "fit_1")
    record = {"losses": result.losses, "weights": [w.tolist() for w in result.weights]}
    (out / f"worker-{jax.process_index()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
