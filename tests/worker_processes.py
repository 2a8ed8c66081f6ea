"""Helpers for the multi-process tests: a worker process of a TF_CONFIG cluster whose output
is collected while it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker_env(tf_config: dict | None = None, devices: int = 2) -> dict[str, str]:
    """This environment without XLA_FLAGS/TF_CONFIG, with `devices` fake CPU devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
    env.update(
        PYTHONUNBUFFERED="1",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


class WorkerProcess:
    """``python SCRIPT *args`` as task ``worker <index>`` of `cluster`.

    `started` is when it printed a line starting with STARTING, `ended` when it exited.
    """

    def __init__(self, script: Path, cluster: dict, index: int, *args: str):
        tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        self.popen = subprocess.Popen(
            [sys.executable, str(script), *args],
            env=worker_env(tf_config),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self.started: float | None = None
        self.ended: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if line.startswith("STARTING") and self.started is None:
                self.started = time.monotonic()
            self.lines.append(line)
        self.popen.wait()
        self.ended = time.monotonic()

    def wait_for(self, text: str, timeout: float) -> None:
        """Waits until a line contains `text`; fails if the process exits first."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.popen.poll() is None, "".join(self.lines)[-3000:]
            assert time.monotonic() < deadline, "".join(self.lines)[-3000:]
            time.sleep(0.05)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Waits for the exit (kills it after `timeout`); returns (exit code, output)."""
        try:
            self.popen.wait(timeout=timeout)
        finally:
            if self.popen.poll() is None:
                self.popen.kill()
                self.popen.wait()
        self._reader.join(timeout=10)
        assert self.popen.stdout is not None
        self.popen.stdout.close()
        return self.popen.returncode, "".join(self.lines)
