"""`ModelCheckpoint` as Keras's: a path's ending says what it holds, a new run replaces
what an earlier run saved there (issue 49).

``.keras`` holds what `load_model` reads, ``.weights.h5`` what `load_weights` reads, and a
checkpoint directory's numbered steps are replaced by a new run's first save but kept by
a resumed one. The script case runs tests/ckpt_rerun.py twice as real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jstrategy
from jstrategy.callbacks import BackupAndRestore
from jstrategy.callbacks import LambdaCallback
from jstrategy.callbacks import ModelCheckpoint
from jstrategy.layers import Dense

ROOT = Path(__file__).resolve().parents[1]


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 5.0)).astype(np.float32)[:, None]
    return x, y


def _model(lr=0.02, seed=0):
    with jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = jstrategy.Sequential(
            [Dense(8, activation="relu", input_shape=(4,)), Dense(1)], seed=seed
        )
        model.compile(jstrategy.optimizers.SGD(lr), loss="mse")
    return model


def _fit(model, callbacks, epochs=3, **kwargs):
    """Fits `model` and returns the weights it had after each epoch and its history."""
    x, y = _data()
    per_epoch = []
    record = LambdaCallback(on_epoch_end=lambda epoch, logs: per_epoch.append(model.get_weights()))
    history = model.fit(
        x, y, batch_size=16, epochs=epochs, validation_split=0.25, shuffle=False, verbose=0,
        callbacks=[*callbacks, record], **kwargs,
    )  # fmt: skip
    return per_epoch, history.history


def _assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


# .keras and .weights.h5 ------------------------------------------------------------------------
def test_keras_path_holds_the_best_model_that_load_model_reads(tmp_path):
    path = tmp_path / "best.keras"
    model = _model()
    per_epoch, history = _fit(model, [ModelCheckpoint(path, save_best_only=True)])
    best = int(np.argmin(history["val_loss"]))
    loaded = jstrategy.models.load_model(path)
    _assert_same(loaded.get_weights(), per_epoch[best])
    assert int(loaded.state.step) == (best + 1) * 3  # the optimizer state of that epoch
    assert sorted(os.listdir(tmp_path)) == ["best.keras"]  # nothing left beside it


def test_weights_path_with_format_fields_keeps_each_epoch(tmp_path):
    model = _model()
    cb = ModelCheckpoint(tmp_path / "w.{epoch:02d}-{loss:.1f}.weights.h5", save_weights_only=True)
    per_epoch, history = _fit(model, [cb])
    names = [f"w.{e + 1:02d}-{loss:.1f}.weights.h5" for e, loss in enumerate(history["loss"])]
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    for name, weights in zip(names, per_epoch, strict=True):
        fresh = _model(seed=5)
        fresh.load_weights(tmp_path / name)
        _assert_same(fresh.get_weights(), weights)


def test_batch_field_with_an_int_save_freq(tmp_path):
    model = _model()
    cb = ModelCheckpoint(tmp_path / "m-{epoch}-{batch}.keras", save_freq=2)
    _fit(model, [cb], epochs=1)  # 3 steps: saved after the second
    assert os.listdir(tmp_path) == ["m-1-2.keras"]


def test_a_new_run_replaces_the_model_an_earlier_run_saved(tmp_path):
    # In-process, two fresh models: the second run's first epoch is worse than the first
    # run's best, and its best model still replaces it (Keras's `best` is per callback).
    path = tmp_path / "best.keras"
    _, earlier = _fit(_model(lr=0.05), [ModelCheckpoint(path, save_best_only=True)], epochs=4)
    second = _model(lr=0.001, seed=3)
    per_epoch, history = _fit(second, [ModelCheckpoint(path, save_best_only=True)], epochs=2)
    assert min(history["val_loss"]) > min(earlier["val_loss"])
    best = int(np.argmin(history["val_loss"]))
    _assert_same(jstrategy.models.load_model(path).get_weights(), per_epoch[best])


def test_path_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"needs save_weights_only=False.*'\.weights\.h5'"):
        ModelCheckpoint(tmp_path / "m.keras", save_weights_only=True)
    with pytest.raises(ValueError, match=r"needs save_weights_only=True.*'\.keras'"):
        ModelCheckpoint(tmp_path / "m.weights.h5")
    with pytest.raises(ValueError, match="Keras 2 HDF5 model file"):
        ModelCheckpoint(tmp_path / "m.h5")
    with pytest.raises(ValueError, match="unnamed field"):
        ModelCheckpoint(tmp_path / "m{}.keras")
    with pytest.raises(ValueError, match="not a valid format string"):
        ModelCheckpoint(tmp_path / "m{epoch.keras")
    with pytest.raises(ValueError, match="`max_to_keep` counts the steps"):
        ModelCheckpoint(tmp_path / "m.keras", max_to_keep=3)
    model = _model()
    with pytest.raises(KeyError, match=r"no 'val_acc' in epoch, batch or the logs"):
        _fit(model, [ModelCheckpoint(tmp_path / "m-{val_acc:.2f}.keras")], epochs=1)


def test_keras_path_holding_something_else_is_refused_before_training(tmp_path):
    # What the previous ModelCheckpoint wrote at a .keras path: numbered orbax steps.
    path = tmp_path / "best.keras"
    _fit(_model(), [ModelCheckpoint(tmp_path / "steps")], epochs=1)
    os.rename(tmp_path / "steps", path)
    model = _model()
    with pytest.raises(ValueError, match=r"numbered checkpoint steps.*Remove it"):
        _fit(model, [ModelCheckpoint(path)], epochs=1)
    assert int(model.state.step) == 0  # refused before the first step


def test_what_an_interrupted_model_save_leaves_is_named_and_cleared(tmp_path):
    # A save killed between its two renames leaves the new model complete at
    # `<path>.jstrategy-new` and the old one at `<path>.jstrategy-old`, nothing at `path`.
    path = tmp_path / "best.keras"
    model = _model()
    model.save(path)
    os.rename(path, tmp_path / "best.keras.jstrategy-new")
    with pytest.raises(FileNotFoundError, match=r"interrupted model\.save left .*jstrategy-new"):
        jstrategy.models.load_model(path)
    # A half-written staging directory from a killed save is discarded by the next save.
    os.rename(tmp_path / "best.keras.jstrategy-new", path)
    (tmp_path / "best.keras.jstrategy-new" / "state").mkdir(parents=True)
    model.save(path)
    assert sorted(os.listdir(tmp_path)) == ["best.keras"]
    _assert_same(jstrategy.models.load_model(path).get_weights(), model.get_weights())


# A checkpoint directory of steps -----------------------------------------------------------------
def test_a_new_run_replaces_the_steps_an_earlier_run_left(tmp_path):
    # The earlier run saved its best at a later step than the new run's best: before, the
    # new run's saves were skipped with a warning and load_weights read the earlier run's.
    path = tmp_path / "ckpt"
    _, earlier = _fit(_model(lr=0.05), [ModelCheckpoint(path, save_best_only=True)], epochs=4)
    assert int(np.argmin(earlier["val_loss"])) > 1  # a later step than the new run's
    second = _model(lr=0.001, seed=3)
    per_epoch, history = _fit(second, [ModelCheckpoint(path, save_best_only=True)], epochs=2)
    best = int(np.argmin(history["val_loss"]))
    with jstrategy.CheckpointManager(path) as manager:
        assert manager.all_steps() == [best + 1]
    fresh = _model(seed=5)
    fresh.load_weights(path)
    _assert_same(fresh.get_weights(), per_epoch[best])


class _Stop(Exception):
    """Raised by a callback to interrupt `fit`."""


def _stop_in_epoch(model, epoch):
    def hook(batch, logs):
        if model.fit_state.epoch == epoch and batch == 1:
            raise _Stop

    return LambdaCallback(on_train_batch_end=hook)


@pytest.mark.parametrize("resume", ["backup", "initial_epoch"])
def test_a_resumed_run_keeps_the_steps_and_continues_them(tmp_path, resume):
    path, backup = tmp_path / "ckpt", tmp_path / "backup"
    first = _model()
    with pytest.raises(_Stop):
        _fit(
            first,
            [BackupAndRestore(backup), ModelCheckpoint(path, max_to_keep=None),
             _stop_in_epoch(first, 2)],
            epochs=4,
        )  # fmt: skip
    with jstrategy.CheckpointManager(path) as manager:
        assert manager.all_steps() == [1, 2]
    resumed = _model()
    if resume == "backup":
        callbacks = [BackupAndRestore(backup), ModelCheckpoint(path, max_to_keep=None)]
        per_epoch, _ = _fit(resumed, callbacks, epochs=4)
    else:
        resumed.restore_checkpoint(path)
        per_epoch, _ = _fit(resumed, [ModelCheckpoint(path, max_to_keep=None)], epochs=4,
                            initial_epoch=2)  # fmt: skip
    with jstrategy.CheckpointManager(path) as manager:
        assert manager.all_steps() == [1, 2, 3, 4]
        assert manager.restore_metadata(3) == {"epoch": 2}
    fresh = _model(seed=5)
    fresh.load_weights(path)
    _assert_same(fresh.get_weights(), per_epoch[-1])


def test_a_save_replaces_the_steps_from_its_own_on(tmp_path):
    # A resumed run (initial_epoch) over a directory that a longer run filled.
    path = tmp_path / "ckpt"
    _fit(_model(), [ModelCheckpoint(path, max_to_keep=None)], epochs=4)
    resumed = _model(seed=3)
    per_epoch, _ = _fit(resumed, [ModelCheckpoint(path, max_to_keep=None)], epochs=3,
                        initial_epoch=1)  # fmt: skip
    with jstrategy.CheckpointManager(path) as manager:
        assert manager.all_steps() == [1, 2, 3]
    fresh = _model(seed=5)
    fresh.load_weights(path)
    _assert_same(fresh.get_weights(), per_epoch[-1])


# Two runs of a script, as two processes ------------------------------------------------------------
def _run_script(filepath, out, lr, epochs):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("TF_CONFIG", None)
    command = [sys.executable, str(ROOT / "tests" / "ckpt_rerun.py"), str(filepath), str(out),
               "--lr", str(lr), "--epochs", str(epochs)]  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=filepath.parent, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    saved = np.load(out)
    return float(saved["val_loss"]), [saved[f"w{i}"] for i in range(len(saved.files) - 1)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("filepath", ["best.keras", "best_ckpt"])
def test_a_second_run_of_a_script_leaves_its_best_model(tmp_path, filepath):
    path = tmp_path / filepath
    first_loss, first = _run_script(path, tmp_path / "first.npz", lr=0.001, epochs=2)
    second_loss, second = _run_script(path, tmp_path / "second.npz", lr=0.02, epochs=4)
    assert second_loss < first_loss  # the case where the second run's saves were lost
    if filepath.endswith(".keras"):
        loaded = jstrategy.models.load_model(path).get_weights()
    else:
        model = _model(seed=5)
        model.load_weights(path)
        loaded = model.get_weights()
    _assert_same(loaded, second)
    assert not np.array_equal(loaded[0], first[0])
