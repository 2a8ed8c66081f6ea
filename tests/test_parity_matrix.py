"""One program, every mesh: the parity matrix (`parity_zoo`), models x strategies x ways.

Every cell trains one of the zoo's models (Keras-style layers, linen, linen annotated for a
``("data", "model")`` mesh, NNX annotated likewise, a `Repeated` block) under one strategy,
created inside the scope or outside it, through `Model.fit` (``steps_per_execution`` 1 and
4) or the train-step factory, and ends within `parity_zoo.TOLERANCE` of
`OneDeviceStrategy`'s losses and final variables; or it is one of the declared refusals
(`parity_zoo.REFUSED`), refused before any step with its error. A layer that went back to
per-replica statistics or masks, or an annotation that a strategy could not read, fails the
cells of every strategy with more than one replica.

``python tests/parity_zoo.py`` prints the matrix with each cell's measured deviation.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import parity_zoo
import pytest

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _oracle(model: str, path: str) -> parity_zoo.Result:
    return parity_zoo.train(model, parity_zoo.STRATEGIES["one_device"](), "inside", path)


def _assert_follows(got: parity_zoo.Result, want: parity_zoo.Result) -> None:
    tol = parity_zoo.TOLERANCE
    np.testing.assert_allclose(got.losses, want.losses, rtol=tol, atol=tol)
    assert len(got.weights) == len(want.weights)
    for a, b in zip(got.weights, want.weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


CELLS = [pytest.param(*cell, id="-".join(cell)) for cell in parity_zoo.cells(None)]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "strategy", "where", "path"), CELLS)
def test_every_model_follows_one_device_under_every_strategy(model, strategy, where, path):
    got = parity_zoo.train(model, parity_zoo.STRATEGIES[strategy](), where, path)
    _assert_follows(got, _oracle(model, path))


REFUSALS = [
    pytest.param(model, strategy, pattern, id=f"{model}-{strategy}")
    for (model, strategy), (pattern, _) in parity_zoo.REFUSED.items()
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "strategy", "pattern"), REFUSALS)
@pytest.mark.parametrize("path", ["fit_1", "factory"])
def test_refused_cells_are_refused_before_any_step(model, strategy, pattern, path):
    with pytest.raises(ValueError, match=pattern):
        parity_zoo.train(model, parity_zoo.STRATEGIES[strategy](), "inside", path)


@pytest.mark.slow
def test_the_oracles_see_every_kind_of_layer_at_work():
    """The matrix means something: dropout and batch statistics change the numbers (a
    model evaluated in inference mode differs), and every model learns."""
    for model in parity_zoo.MODELS:
        losses = _oracle(model, "fit_1").losses
        assert losses[-1] < losses[0], (model, losses)


def test_a_keras_model_made_outside_the_scope_is_refused_with_the_fix():
    import optax

    import jstrategy

    model = jstrategy.Sequential(parity_zoo.keras_layers())
    with (
        pytest.raises(ValueError, match=r"created under DefaultStrategy.*create it inside"),
        jstrategy.MirroredStrategy().scope(),
    ):
        model.compile(optax.sgd(0.1), loss="sparse_categorical_crossentropy")


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", ["keras", "nnx", "keras3"])
def test_two_workers_follow_one_device(tmp_path, model):
    """MultiWorkerMirroredStrategy over two processes of four devices, through `fit`."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "4", "--timeout", "300",
        str(ROOT / "tests" / "parity_worker.py"), str(tmp_path), model,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    want = _oracle(model, "fit_1")
    for worker in range(2):
        saved = json.loads((tmp_path / f"worker-{worker}.json").read_text())
        got = parity_zoo.Result(saved["losses"], [np.asarray(w) for w in saved["weights"]])
        _assert_follows(got, want)
