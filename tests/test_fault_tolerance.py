"""Checkpoints of a Model, ModelCheckpoint, BackupAndRestore and preemption (issue 8).

Interruptions are real: an exception from a callback, SIGTERM sent to this process, and for
whole runs SIGKILL and SIGTERM sent to subprocesses (tests/ft_train.py, and tests/ft_mw.py
under the launcher with 2 workers x 2 CPU devices). Every resumed run must end with the
parameters of an uninterrupted one, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jstrategy
from jstrategy.callbacks import BackupAndRestore
from jstrategy.callbacks import LambdaCallback
from jstrategy.callbacks import ModelCheckpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import ft_train  # noqa: E402

STEPS_PER_EPOCH = ft_train.ROWS // ft_train.BATCH + 1  # 8, the last batch partial


def _two():
    return jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])


def _assert_same_weights(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _assert_same_tree(actual, expected):
    actual = jax.tree_util.tree_flatten_with_path(actual)[0]
    expected = jax.tree_util.tree_flatten_with_path(expected)[0]
    assert [p for p, _ in actual] == [p for p, _ in expected]
    for (path, a), (_, e) in zip(actual, expected, strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=str(path))


class _Stop(Exception):
    """Raised by a callback to interrupt `fit` at a chosen step."""


def _stop_at(model_ref, epoch, step):
    def hook(batch, logs):
        progress = model_ref[0].fit_state
        if progress.epoch == epoch and batch + 1 >= step:
            raise _Stop

    return LambdaCallback(on_train_batch_end=hook)


# Model weights -------------------------------------------------------------------------------
@pytest.mark.slow
def test_weights_saved_under_one_strategy_load_under_another(tmp_path):
    x, y = ft_train.data()
    trained = ft_train.make_model(_two())
    trained.fit(x, y, batch_size=8, epochs=1, verbose=0)
    trained.save_weights(tmp_path / "w")
    other = ft_train.make_model(jstrategy.OneDeviceStrategy("cpu:0"))
    other.load_weights(tmp_path / "w")
    _assert_same_weights(other.get_weights(), trained.get_weights())
    leaf = other.state.params["layers_0"]["kernel"]
    assert leaf.sharding.device_set == {jax.devices()[0]}
    with pytest.raises(FileExistsError, match="Pass overwrite=True"):
        trained.save_weights(tmp_path / "w", overwrite=False)


def test_nnx_weights_with_random_streams_round_trip(tmp_path):
    class Net(nnx.Module):
        def __init__(self, seed):
            rngs = nnx.Rngs(seed, dropout=seed + 1)
            self.dense = nnx.Linear(3, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.dense(x))

    with _two().scope():
        saved, loaded = jstrategy.Model(Net(0)), jstrategy.Model(Net(5))
    saved.save_weights(tmp_path / "w")
    loaded.load_weights(tmp_path / "w")
    _assert_same_tree(loaded.state.params, saved.state.params)
    _assert_same_tree(loaded.state.model_state, saved.state.model_state)  # typed keys too


def test_load_weights_errors(tmp_path):
    with pytest.raises(ValueError, match="`load_weights` is not available"):
        jstrategy.Model(nn.Dense(2)).load_weights(tmp_path / "w")
    jstrategy.Model(nn.Dense(3), input_shape=(4,)).save_weights(tmp_path / "w")
    with pytest.raises(ValueError, match="shape"):
        jstrategy.Model(nn.Dense(2), input_shape=(4,)).load_weights(tmp_path / "w")
    with pytest.raises(FileNotFoundError, match="No weights at"):
        jstrategy.Model(nn.Dense(3), input_shape=(4,)).load_weights(tmp_path / "nothing")


# ModelCheckpoint -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["min", "max"])
def test_model_checkpoint_keeps_the_best_epoch(tmp_path, mode):
    x, y = ft_train.data()
    model = ft_train.make_model(_two())
    per_epoch = []
    record = LambdaCallback(on_epoch_end=lambda epoch, logs: per_epoch.append(model.get_weights()))
    cb = ModelCheckpoint(
        tmp_path / "best", monitor="val_loss", save_best_only=True, save_weights_only=True,
        mode=mode,
    )  # fmt: skip
    history = model.fit(
        x, y, batch_size=8, epochs=4, verbose=0, validation_split=0.25, callbacks=[cb, record]
    )
    values = history.history["val_loss"]
    best = int(np.argmin(values) if mode == "min" else np.argmax(values))
    assert sorted(os.listdir(tmp_path / "best")) == [str(best + 1)]
    assert cb.best == values[best]
    fresh = ft_train.make_model(jstrategy.OneDeviceStrategy("cpu:0"))
    fresh.load_weights(tmp_path / "best")
    _assert_same_weights(fresh.get_weights(), per_epoch[best])


@pytest.mark.slow
def test_model_checkpoint_every_n_steps_saves_the_training_state(tmp_path):
    x, y = ft_train.data()
    model = ft_train.make_model(_two())
    cb = ModelCheckpoint(tmp_path / "ckpt", save_freq=4, max_to_keep=None)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    steps = sorted(int(s) for s in os.listdir(tmp_path / "ckpt"))
    assert steps == [4, 8, 12, 16]  # optimizer steps; 8 per epoch
    with jstrategy.CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.restore_metadata(12) == {"epoch": 1}
        assert set(manager.metrics(12)) == {"loss", "mae"}
    # The latest step holds the whole state (optimizer state and step count included).
    fresh = ft_train.make_model(jstrategy.OneDeviceStrategy("cpu:0"))
    fresh.restore_checkpoint(tmp_path / "ckpt")
    assert int(fresh.state.step) == 2 * STEPS_PER_EPOCH
    _assert_same_tree(fresh.state.opt_state, model.state.opt_state)
    _assert_same_weights(fresh.get_weights(), model.get_weights())


def test_model_checkpoint_arguments_and_missing_monitor(tmp_path):
    with pytest.raises(ValueError, match="format fields only when it ends in '.keras'"):
        ModelCheckpoint(str(tmp_path / "w.{epoch:02d}"))
    with pytest.raises(ValueError, match="`save_freq` must be 'epoch' or a positive int"):
        ModelCheckpoint(tmp_path / "c", save_freq=0)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        ModelCheckpoint(tmp_path / "c", mode="up")
    with pytest.raises(ValueError, match="cannot tell whether 'score'"):
        cb = ModelCheckpoint(tmp_path / "c", monitor="score", save_best_only=True)
        cb.set_model(ft_train.make_model(jstrategy.OneDeviceStrategy("cpu:0")))
        cb.on_train_begin()
    x, y = ft_train.data()
    model = ft_train.make_model(jstrategy.OneDeviceStrategy("cpu:0"))
    cb = ModelCheckpoint(tmp_path / "d", monitor="val_loss", save_best_only=True)
    with pytest.warns(RuntimeWarning, match="only when 'val_loss' is in the logs"):
        model.fit(x, y, batch_size=30, epochs=1, verbose=0, callbacks=[cb])
    assert os.listdir(tmp_path / "d") == []


# BackupAndRestore ---------------------------------------------------------------------------
def _dataset(x, y, batches):
    return [(x[i * 6 : (i + 1) * 6], y[i * 6 : (i + 1) * 6]) for i in range(batches)]


_RESUME_CASES = {
    # name: (fit keyword arguments, steps_per_execution, where to stop: epoch, step)
    "arrays": ({}, 1, (1, 5)),
    "arrays_steps_per_execution_2": ({}, 2, (1, 4)),
    "dataset": ({"dataset": 10}, 1, (1, 3)),
    # 3 epochs of 4 steps from one iterator over 10 batches: it restarts in epoch 2.
    "dataset_steps_per_epoch": ({"dataset": 10, "steps_per_epoch": 4}, 1, (2, 2)),
    # Variables split over the replicas; fused steps and the partial batch's remainder.
    "fsdp_steps_per_execution_2": ({"fsdp": True}, 2, (1, 3)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_RESUME_CASES))
def test_backup_resumes_exactly_after_an_interruption(tmp_path, case):
    kwargs, spe, (stop_epoch, stop_step) = _RESUME_CASES[case]
    x, y = ft_train.data()
    batches = kwargs.get("dataset")

    def fit(callbacks):
        strategy = _two()
        if kwargs.get("fsdp"):
            strategy = jstrategy.experimental.FSDPStrategy(["cpu:0", "cpu:1"], min_shard_size=0)
        model = ft_train.make_model(strategy, steps_per_execution=spe)
        ref[0] = model
        if batches is None:
            data = {"x": x, "y": y, "batch_size": ft_train.BATCH}
        else:
            data = {"x": _dataset(x, y, batches)}
        history = model.fit(
            **data, epochs=3, verbose=0, callbacks=callbacks,
            steps_per_epoch=kwargs.get("steps_per_epoch"),
        )  # fmt: skip
        return model, history

    ref: list = [None]
    expected, expected_history = fit([])
    backup_dir = tmp_path / "backup"
    with pytest.raises(_Stop):
        fit([BackupAndRestore(backup_dir, save_freq=2), _stop_at(ref, stop_epoch, stop_step)])
    assert os.listdir(backup_dir), "the backup must survive an interrupted fit"
    with jstrategy.CheckpointManager(backup_dir) as manager:
        saved = manager.restore_metadata()
    assert (saved["epoch"], saved["step"]) != (0, 0) and saved["step"] > 0
    resumed, history = fit([BackupAndRestore(backup_dir, save_freq=2)])
    _assert_same_weights(resumed.get_weights(), expected.get_weights())
    if kwargs.get("fsdp"):  # resumed into the split layout, and trained on in it
        kernel = resumed.state.params["layers_0"]["kernel"]
        assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "replica")
    # The resumed epoch's running sums were restored too: its logs are the uninterrupted ones.
    for key, values in history.history.items():
        assert values == expected_history.history[key][-len(values) :]
    assert not backup_dir.exists(), "a completed fit deletes its backup"


@pytest.mark.slow
def test_sigterm_backs_up_at_the_next_step_and_exits(tmp_path):
    strategy = _two()
    expected = ft_train.train(strategy)
    before = signal.getsignal(signal.SIGTERM)
    backup_dir = tmp_path / "backup"
    sent = []

    def preempt(batch, logs):
        if not sent and model[0].fit_state.epoch == 1 and batch + 1 == 3:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    model = [None]

    class Capture(jstrategy.callbacks.Callback):
        def on_train_begin(self, logs=None):
            model[0] = self.model

    callbacks = [
        Capture(),
        BackupAndRestore(backup_dir),
        LambdaCallback(on_train_batch_end=preempt),
    ]
    with pytest.raises(SystemExit) as exit_info:
        ft_train.train(strategy, callbacks)
    assert exit_info.value.code == jstrategy.experimental.PREEMPTION_EXIT_CODE == 0
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was given back
    with jstrategy.CheckpointManager(backup_dir) as manager:
        saved = manager.restore_metadata()
    # Sent after step 3 of epoch 1: the next boundary is step 4.
    assert (saved["epoch"], saved["step"]) == (1, 4)
    resumed = ft_train.train(strategy, [BackupAndRestore(backup_dir)])
    _assert_same_weights(resumed.get_weights(), expected.get_weights())


def test_backup_and_restore_arguments():
    with pytest.raises(ValueError, match="`save_freq` must be 'epoch' or a positive int"):
        BackupAndRestore("/tmp/b", save_freq="batch")
    with pytest.raises(ValueError, match="`backup_dir` must be a directory path"):
        BackupAndRestore("")
    with pytest.raises(TypeError, match="works with a jstrategy.Model"):
        cb = BackupAndRestore("/tmp/b")
        cb.set_model(object())
        cb.on_train_begin()


# PreemptionCheckpointHandler in a custom loop ----------------------------------------------------
class _Preempted(Exception):
    pass


def _raise_preempted():
    raise _Preempted


@jax.jit
def _noisy_step(state):
    key = jax.random.fold_in(state["key"], state["step"])
    w = state["w"] * 0.9 + jax.random.normal(key, state["w"].shape)
    return {"w": w, "key": state["key"], "step": state["step"] + 1}, jnp.sum(w)


@pytest.mark.slow
def test_handler_saves_on_sigterm_and_the_next_run_resumes(tmp_path):
    strategy = _two()
    init = jax.device_put(
        {"w": jnp.zeros(3), "key": jax.random.key(4), "step": jnp.zeros((), jnp.int32)},
        strategy.replicated_sharding(),
    )
    expected = init
    for _ in range(10):
        expected, _ = _noisy_step(expected)
    before = signal.getsignal(signal.SIGTERM)
    Handler = jstrategy.experimental.PreemptionCheckpointHandler
    with Handler(strategy, tmp_path / "ckpt", exit_fn=_raise_preempted) as handler:
        state = handler.restore(init)
        assert handler.total_run_calls == 0
        with pytest.raises(_Preempted):
            for step in range(10):
                if step == 2:  # during the third step
                    os.kill(os.getpid(), signal.SIGTERM)
                state, _ = handler.run(_noisy_step, state)
        assert handler.total_run_calls == 3
    assert signal.getsignal(signal.SIGTERM) is before
    with Handler(strategy, tmp_path / "ckpt") as handler:
        state = handler.restore(init)
        assert handler.total_run_calls == 3 and int(state["step"]) == 3
        for _ in range(handler.total_run_calls, 10):
            state, _ = handler.run(_noisy_step, state)
    _assert_same_tree(state, expected)


def test_handler_arguments(tmp_path):
    Handler = jstrategy.experimental.PreemptionCheckpointHandler
    with pytest.raises(TypeError, match="`cluster_resolver_or_strategy` must be"):
        Handler("cpu:0", tmp_path)
    with pytest.raises(TypeError, match="`checkpoint_manager_or_dir` must be"):
        Handler(_two(), 3)
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, Handler, _two(), tmp_path / "c"))
    thread.start()
    thread.join(timeout=60)
    assert errors and "must be created in the main thread" in str(errors[0])


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except RuntimeError as e:
        errors.append(e)


# Whole runs in other processes ---------------------------------------------------------------
class _Process:
    """A subprocess whose output lines are collected by a thread; every wait is bounded."""

    def __init__(self, command, env):
        self.popen = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                found = predicate(line)
                if found:
                    return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout}s:\n{self.output[-4000:]}")
            if self.popen.poll() is not None:
                self.reader.join(timeout=10)
                if not any(predicate(line) for line in self.lines):
                    raise AssertionError(f"exited without {what}:\n{self.output[-4000:]}")
            time.sleep(0.02)

    def finish(self, timeout: float) -> int:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"still running after {timeout}s:\n{self.output[-4000:]}"
            ) from None
        self.reader.join(timeout=10)
        return code

    def kill(self):
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=30)
        self.reader.join(timeout=10)
        if not self.reader.is_alive():
            self.popen.stdout.close()


def _env(**extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **extra)
    env.pop("TF_CONFIG", None)
    return env


def _committed_backup(backup_dir: Path):
    """The newest complete backup's (global step, metadata), or None."""
    steps = sorted((int(n) for n in os.listdir(backup_dir) if n.isdigit()), reverse=True)
    for n in steps:
        try:
            record = json.loads((backup_dir / str(n) / "jstrategy" / "metadata").read_text())
        except (OSError, ValueError):
            continue  # removed by max_to_keep meanwhile
        meta = record["metadata"]
        return meta["epoch"] * STEPS_PER_EPOCH + meta["step"], meta
    return None


_STEP = re.compile(r"^STEP (\d+) (\d+)$")


def _global_step(line: str) -> int | None:
    match = _STEP.match(line)
    return None if match is None else int(match[1]) * STEPS_PER_EPOCH + int(match[2])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_killed_then_preempted_run_resumes_to_the_uninterrupted_parameters(tmp_path):
    expected = ft_train.train(_two()).get_weights()
    backup_dir, out = tmp_path / "backup", tmp_path / "final.npz"
    command = [sys.executable, str(ROOT / "tests" / "ft_train.py"), str(backup_dir), str(out),
               "--sleep", "0.2", "--save_freq", "2"]  # fmt: skip
    runs = []
    try:
        # 1. SIGKILL once a backup from the middle of an epoch is complete on disk.
        runs.append(_Process(command, _env()))
        first = runs[-1]
        deadline = time.monotonic() + 120
        while True:
            found = backup_dir.exists() and _committed_backup(backup_dir)
            if found and found[0] >= 5:
                break
            assert first.popen.poll() is None, f"run 1 ended early:\n{first.output[-4000:]}"
            assert time.monotonic() < deadline, f"no backup:\n{first.output[-4000:]}"
            time.sleep(0.02)
        first.popen.send_signal(signal.SIGKILL)
        assert first.finish(60) == -signal.SIGKILL
        step, meta = _committed_backup(backup_dir)
        assert 5 <= step < ft_train.EPOCHS * STEPS_PER_EPOCH

        # 2. The same command resumes from that backup; SIGTERM a few steps later.
        runs.append(_Process(command, _env()))
        second = runs[-1]
        resumed = f"at epoch {meta['epoch'] + 1}, step {meta['step']}."
        second.wait_for(lambda line: resumed in line, 120, f"'resuming ... {resumed}'")
        signalled_at = second.wait_for(
            lambda line: (_global_step(line) or 0) >= step + 3 and _global_step(line),
            60,
            "3 more steps",
        )
        second.popen.send_signal(signal.SIGTERM)
        assert second.finish(60) == 0, second.output[-4000:]
        match = re.search(r"backed up epoch (\d+), step (\d+)", second.output)
        assert match, second.output[-4000:]
        saved_at = (int(match[1]) - 1) * STEPS_PER_EPOCH + int(match[2])
        # At each boundary the backup callback runs before the one printing STEP lines, so
        # the boundary it saved at is the one after the last STEP line: the first boundary
        # after the signal.
        last_step = max(_global_step(line) or 0 for line in second.lines)
        assert saved_at == last_step + 1 and saved_at > signalled_at
        assert not out.exists() and "DONE" not in second.output

        # 3. Again: resumes from the preemption backup and completes.
        runs.append(_Process(command, _env()))
        third = runs[-1]
        assert third.finish(120) == 0, third.output[-4000:]
        assert f"at epoch {match[1]}, step {match[2]}." in third.output
        assert "DONE" in third.output and not backup_dir.exists()
    finally:
        for run in runs:
            run.kill()
    final = np.load(out)
    _assert_same_weights([final[f"w{i}"] for i in range(len(expected))], expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_workers_preempted_by_sigterm_to_one_save_the_same_step_and_resume(tmp_path):
    command = [sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
               "--devices_per_worker", "2", "--timeout", "150", str(ROOT / "tests" / "ft_mw.py"),
               str(tmp_path), "--sleep", "0.25"]  # fmt: skip
    env = _env()
    env.pop("XLA_FLAGS", None)
    runs = []
    try:
        runs.append(_Process(command, env))
        first = runs[-1]
        pid = first.wait_for(lambda line: re.search(r"worker 1 pid (\d+)", line), 120, "pid")
        first.wait_for(lambda line: "worker 1 STEP 0 3" in line, 120, "3 steps")
        os.kill(int(pid[1]), signal.SIGTERM)
        assert first.finish(150) == 0, first.output[-4000:]
        stops = sorted(set(re.findall(r"worker (\d) preempted at epoch (\d+) step (\d+)",
                                      first.output)))  # fmt: skip
        assert len(stops) == 2 and stops[0][1:] == stops[1][1:], first.output[-4000:]
        epoch, step = int(stops[0][1]), int(stops[0][2])
        assert f"backed up epoch {epoch + 1}, step {step} " in first.output

        runs.append(_Process(command, env))
        second = runs[-1]
        assert second.finish(150) == 0, second.output[-4000:]
        assert f"resuming from the backup in {tmp_path}/backup at epoch {epoch + 1}, " \
               f"step {step}." in second.output  # fmt: skip
        assert not (tmp_path / "backup").exists()
    finally:
        for run in runs:
            run.kill()
    load = [
        {
            name: dict(np.load(tmp_path / f"{name}-{i}.npz"))
            for name in ("preempted", "begin", "final")
        }
        for i in range(2)
    ]
    saved = load[0]["preempted"]
    assert int(saved["epoch"]) == epoch and int(saved["step"]) == step
    for i in range(2):
        for key in (k for k in saved if k.startswith("w")):
            np.testing.assert_array_equal(load[i]["preempted"][key], saved[key])  # both saved it
            np.testing.assert_array_equal(load[i]["begin"][key], saved[key])  # both restored it
            np.testing.assert_array_equal(load[i]["final"][key], load[0]["final"][key])
    # The resumed job ends where one process over 4 devices does (up to collective rounding).
    reference = ft_train.train(
        jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)]), epochs=4
    ).get_weights()
    for i, w in enumerate(reference):
        np.testing.assert_allclose(load[0]["final"][f"w{i}"], w, rtol=1e-5, atol=1e-6)
