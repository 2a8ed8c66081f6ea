"""Checkpoints on 2 real workers (processes on 127.0.0.1), as TF's multi-worker tutorials write
them, and every wait on another worker bounded by `CommunicationOptions.timeout_seconds`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_processes import ROOT
from worker_processes import WorkerProcess
from worker_processes import worker_env

SCRIPT = ROOT / "tests" / "mw_checkpoint.py"

# Every test here runs two worker processes.
pytestmark = pytest.mark.multiprocess


def _launch(out: Path, mode: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "2", "--timeout", "150", str(SCRIPT), str(out), mode,
        "--timeout", str(timeout),
    ]  # fmt: skip
    env = worker_env()
    del env["XLA_FLAGS"]  # the launcher sets the device count
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=ROOT)


def _failure(done: subprocess.CompletedProcess, marker: str) -> tuple[float, str]:
    """(seconds, line) of the first line with `marker` followed by the seconds it took."""
    lines = [line for line in done.stdout.splitlines() if marker in line]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return float(lines[0].split(f"{marker} ", 1)[1].split()[0]), lines[0]


@pytest.mark.timeout(240)
def test_tf_tutorial_checkpoints_with_per_worker_temporary_directories(tmp_path):
    # Non-chief workers name their own directories; the chief's holds the checkpoint.
    start = time.monotonic()
    done = _launch(tmp_path, "tutorial", timeout=30)
    print(
        f"tutorial pattern on 2 workers: exit {done.returncode} in {time.monotonic() - start:.1f} s"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DONE 0" in done.stdout and "DONE 1" in done.stdout
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["2"]  # max_to_keep=1, no worker temp
    assert sorted(os.listdir(tmp_path / "model")) == ["weights"]
    for index in (0, 1):
        result = np.load(tmp_path / f"restored-{index}.npz")
        assert int(result["latest"]) == 2
        for name in ("w", "b"):
            np.testing.assert_array_equal(result[f"restored_{name}"], result[f"trained_{name}"])
            np.testing.assert_array_equal(result[f"loaded_{name}"], result[f"trained_{name}"])
        # 6 steps of the mean of 1..4 (4 replicas): w - 6 * 0.1 * 2.5.
        np.testing.assert_allclose(result["trained_w"], np.arange(4.0) - 1.5, rtol=1e-6)


@pytest.mark.timeout(240)
def test_a_save_that_only_the_chief_makes_fails_within_the_timeout(tmp_path):
    seconds, line = _failure(_launch(tmp_path, "chief-only", timeout=8), "SAVE-FAILED")
    print(f"chief saving alone: clear error after {seconds:.1f} s (timeout_seconds=8)")
    assert seconds < 8 + 10  # orbax alone waited 5 to 10 minutes
    assert "Saving step 1 in" in line and "not every worker got there within 8 s" in line
    assert "do not guard them with `if strategy.is_chief`" in line


@pytest.mark.timeout(240)
def test_restoring_without_the_strategy_is_a_clear_error_on_every_worker(tmp_path):
    done = _launch(tmp_path, "no-strategy", timeout=30)
    for index in (0, 1):
        assert f"[worker-{index}] RESTORE-FAILED Restoring" in done.stdout, done.stdout[-3000:]
    assert "pass strategy=<your MultiWorkerMirroredStrategy>" in done.stdout
    assert "Error" not in done.stdout.split("RESTORE-FAILED", 1)[0]  # no raw JAX error first


@pytest.mark.timeout(240)
def test_a_collective_that_a_live_worker_skips_fails_within_the_timeout(tmp_path):
    seconds, line = _failure(_launch(tmp_path, "lonely-reduce", timeout=8), "REDUCE-FAILED")
    print(f"all-reduce the other worker skipped: error after {seconds:.1f} s (timeout_seconds=8)")
    assert seconds < 8 + 10  # it waited until the other worker exited
    assert "Timed out" in line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_sigterm_stops_a_worker_outside_a_preemption_aware_loop(tmp_path):
    # JAX's preemption service kept SIGTERM: workers ignored it and needed SIGKILL.
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    args = (str(tmp_path), "idle", "--timeout", "10")
    procs = [WorkerProcess(SCRIPT, cluster, i, *args) for i in range(2)]
    try:
        for proc in procs:
            proc.wait_for("READY", timeout=120)
        procs[1].popen.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = procs[1].popen.wait(timeout=30)
        seconds = time.monotonic() - sent
    finally:
        for proc in procs:
            proc.popen.kill()
            proc.finish(timeout=30)
    print(f"SIGTERM stopped worker 1 in {seconds:.2f} s")
    assert code == -signal.SIGTERM
