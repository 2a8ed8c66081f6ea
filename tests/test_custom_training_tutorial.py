"""TF's custom-training tutorial, as ported in ``examples/custom_training_tutorial.py``:
under MirroredStrategy over 8 devices it follows OneDeviceStrategy epoch by epoch (the same
global batch), and it learns."""

from __future__ import annotations

import importlib.util
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
