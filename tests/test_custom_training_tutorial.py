"""TF's custom-training tutorial, as ported in ``examples/custom_training_tutorial.py``:
under MirroredStrategy over 8 devices it follows OneDeviceStrategy epoch by epoch (the same
global batch), and it learns."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jstrategy

pytestmark = pytest.mark.timeout(300)


def _load_example():
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_training_tutorial.py"
    spec = importlib.util.spec_from_file_location("custom_training_tutorial", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tutorial = _load_example()


@pytest.mark.slow
def test_mirrored_follows_one_device_epoch_by_epoch(tmp_path, capsys):
    # 200 training rows in global batches of 64: the last batch has 8 real rows of 64, and
    # the test set's 100 rows end in a padded batch too.
    common = dict(epochs=3, num_train=200, num_test=100)
    one = tutorial.main(
        jstrategy.OneDeviceStrategy("cpu:0"),
        batch_size_per_replica=64,
        checkpoint_dir=str(tmp_path / "one"),
        **common,
    )
    mirrored = tutorial.main(
        jstrategy.MirroredStrategy(),
        batch_size_per_replica=8,
        checkpoint_dir=str(tmp_path / "mirrored"),
        **common,
    )
    out = capsys.readouterr().out
    assert "Epoch 3, Loss: " in out and "Test Accuracy: " in out
    for key in ("loss", "accuracy", "test_loss", "test_accuracy"):
        np.testing.assert_allclose(mirrored[key], one[key], rtol=2e-4, atol=1e-5, err_msg=key)
    assert mirrored["test_accuracy"][-1] > 0.9 and mirrored["loss"][-1] < mirrored["loss"][0]
    assert mirrored["restored_accuracy"] == pytest.approx(mirrored["test_accuracy"][-1])


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
def test_two_workers_match_one_process_over_four_devices(tmp_path):
    """Metrics and updates are global: 2 workers x 2 devices log what 4 devices do."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "2", "--timeout", "240",
        str(root / "tests" / "multi_worker_tutorial.py"), "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers = [dict(np.load(tmp_path / f"worker-{i}.npz")) for i in range(2)]
    expected = tutorial.main(
        jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)]),
        epochs=2,
        batch_size_per_replica=16,
        num_train=200,
        num_test=100,
        checkpoint_dir=str(tmp_path / "one_process"),
        verbose=False,
    )
    for key in ("loss", "accuracy", "test_loss", "test_accuracy", "restored_accuracy"):
        np.testing.assert_array_equal(workers[0][key], workers[1][key], err_msg=key)
        np.testing.assert_allclose(workers[0][key], expected[key], rtol=1e-4, err_msg=key)
