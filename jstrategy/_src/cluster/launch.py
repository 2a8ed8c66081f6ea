"""Local launcher: runs a multi-worker job as several processes on this machine.

``python -m jstrategy.launch --num_workers 2 train.py --epochs 3`` starts two copies of
``train.py``, each with a ``TF_CONFIG`` that names its task in a cluster of ``127.0.0.1``
addresses, so `MultiWorkerMirroredStrategy` code runs unchanged from a laptop to a cluster.
Each worker's output is prefixed with its task (``[worker-1] ...``); the job stops as soon as
one worker fails. This module does not import JAX.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import IO

from jstrategy._src.validation import check_number
from jstrategy._src.validation import check_positive_float
from jstrategy._src.validation import check_positive_int

__all__ = ["free_ports", "launch", "main"]

# How long workers get to exit after SIGTERM before SIGKILL.
_GRACE_PERIOD_S = 5.0
_POLL_INTERVAL_S = 0.05
# As GNU timeout(1).
TIMEOUT_EXIT_CODE = 124
_HOST = "127.0.0.1"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on ``127.0.0.1`` that were free a moment ago.

    All sockets stay bound until every port is chosen, so the ports are distinct; another
    program could still take one before a worker binds it, as with any such scheme.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((_HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class _Worker:
    """One worker process and the threads that copy its output."""

    def __init__(self, name: str, command: Sequence[str], env: Mapping[str, str], lock):
        self.name = name
        self.popen = subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Its own process group, so stopping a worker also stops what it started.
            start_new_session=os.name == "posix",
        )
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self.threads = [
            threading.Thread(
                target=_copy_lines,
                args=(self.popen.stdout, f"[{name}] ", "stdout", lock),
                name=f"launch-{name}-stdout",
                daemon=True,
            ),
            threading.Thread(
                target=_copy_lines,
                args=(self.popen.stderr, f"[{name}] ", "stderr", lock),
                name=f"launch-{name}-stderr",
                daemon=True,
            ),
        ]
        for thread in self.threads:
            thread.start()

    def signal(self, signum: int) -> None:
        try:
            if os.name == "posix":
                os.killpg(self.popen.pid, signum)
            elif signum == signal.SIGTERM:
                self.popen.terminate()
            else:
                self.popen.kill()
        except (ProcessLookupError, PermissionError):
            pass  # Already gone.

    def join_output(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _copy_lines(stream: IO[bytes], prefix: str, target: str, lock: threading.Lock) -> None:
    # Looked up per line, not bound once, so a redirected sys.stdout (pytest's capture) works.
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with lock:
                out = sys.stdout if target == "stdout" else sys.stderr
                try:
                    out.write(prefix + line + "\n")
                    out.flush()
                except (OSError, ValueError):
                    pass  # Our own output is gone (closed pipe); keep draining the worker's.


def _say(message: str, lock: threading.Lock) -> None:
    with lock:
        try:
            sys.stderr.write(f"[launch] {message}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _worker_env(
    base: Mapping[str, str], tf_config: dict, devices_per_worker: int | None
) -> dict[str, str]:
    env = dict(base)
    env["TF_CONFIG"] = json.dumps(tf_config)
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_worker is not None:
        # Drop an inherited device count: XLA would see two and the earlier one could win.
        flags = [
            flag
            for flag in env.get("XLA_FLAGS", "").split()
            if not flag.startswith(_DEVICE_COUNT_FLAG)
        ]
        flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_worker}")
        env["XLA_FLAGS"] = " ".join(flags)
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    num_workers: int,
    devices_per_worker: int | None = None,
    chief: bool = False,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Runs ``sys.executable script *args`` as a local multi-worker job and waits for it.

    Each process gets a ``TF_CONFIG`` naming its task in a cluster of ``127.0.0.1`` addresses
    on free ports (``"chief"`` task 0 first if `chief`, then ``"worker"`` tasks
    ``0..num_workers-1``) and ``PYTHONUNBUFFERED=1``. Their output lines are copied to this
    process's stdout and stderr, prefixed with ``[worker-<i>]`` or ``[chief-0]``.

    When a worker fails, the others get SIGTERM (to their whole process group), then SIGKILL
    after a grace period. SIGINT (Ctrl-C) or SIGTERM to this process, or `timeout`, stop
    every worker the same way.

    Args:
      script: the Python script every worker runs.
      args: the script's command-line arguments.
      num_workers: the number of ``"worker"`` tasks.
      devices_per_worker: if set, each worker runs JAX on CPU (``JAX_PLATFORMS=cpu``) with
        this many fake devices (``--xla_force_host_platform_device_count``, added to
        ``XLA_FLAGS`` in place of any inherited count).
      chief: also start a ``"chief"`` task, which is process 0 of the job.
      timeout: stop everything after this many seconds; None waits as long as it takes.
      env: environment variables for every worker, over this process's environment.

    Returns:
      0 if every worker exited with 0; else the first failed worker's exit code (1 if it
      was killed by a signal), `TIMEOUT_EXIT_CODE` (124) on timeout, or 128 + the signal
      number when this process was interrupted.

    Raises:
      ValueError: if an argument is invalid.
      FileNotFoundError: if `script` does not exist.
    """
    check_positive_int(num_workers, "num_workers", "Pass the number of worker processes, e.g. 2.")
    if devices_per_worker is not None:
        check_positive_int(
            devices_per_worker, "devices_per_worker", "Pass None for the default devices."
        )
    if timeout is not None:
        check_positive_float(timeout, "timeout", "Pass seconds, or None for no limit.")
    if not os.path.isfile(script):
        raise FileNotFoundError(
            f"`script` {script!r} is not a file (working directory {os.getcwd()!r}). Pass the "
            f"path of the Python script each worker runs."
        )
    if isinstance(args, str):
        raise ValueError(f"`args` must be a sequence of strings; got the string {args!r}.")

    tasks = ([("chief", 0)] if chief else []) + [("worker", i) for i in range(num_workers)]
    ports = free_ports(len(tasks))
    cluster: dict[str, list[str]] = {}
    for (task_type, _), port in zip(tasks, ports, strict=True):
        cluster.setdefault(task_type, []).append(f"{_HOST}:{port}")
    base_env = dict(os.environ)
    base_env.update(env or {})
    command = [sys.executable, script, *args]

    lock = threading.Lock()
    received: list[int] = []
    previous_handlers = _install_signal_handlers(received.append)
    workers: list[_Worker] = []
    code: int | None = None
    try:
        for task_type, index in tasks:
            tf_config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
            worker_env = _worker_env(base_env, tf_config, devices_per_worker)
            workers.append(_Worker(f"{task_type}-{index}", command, worker_env, lock))
        code = _supervise(workers, timeout, received, lock)
    finally:
        if code is None:  # An exception (e.g. a worker could not start): leave nothing behind.
            _stop(workers, received)
        for worker in workers:
            worker.join_output(timeout=2.0)
        _restore_signal_handlers(previous_handlers)
    return code


def _supervise(
    workers: list[_Worker], timeout: float | None, received: list[int], lock: threading.Lock
) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if received:
            name = signal.Signals(received[0]).name
            _say(f"received {name}; stopping all workers.", lock)
            _stop(workers, received)
            return 128 + received[0]
        running = []
        for worker in workers:
            code = worker.popen.poll()
            if code is None:
                running.append(worker)
            elif code != 0:
                # Let its last lines (often the traceback) print before our verdict.
                worker.join_output(timeout=1.0)
                others = [w.name for w in workers if w is not worker and w.popen.poll() is None]
                stopping = f"; stopping {', '.join(others)}" if others else ""
                _say(f"{worker.name} {_describe_exit(code)}{stopping}.", lock)
                _stop(workers, received)
                _say(f"job failed: {worker.name} {_describe_exit(code)}.", lock)
                return code if code > 0 else 1
        if not running:
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            names = ", ".join(w.name for w in running)
            _say(f"timed out after {timeout:g} s; stopping {names}.", lock)
            _stop(workers, received)
            return TIMEOUT_EXIT_CODE
        time.sleep(_POLL_INTERVAL_S)


def _stop(workers: list[_Worker], received: list[int]) -> None:
    """SIGTERM to every worker still running, SIGKILL to those left after the grace period."""
    alive = [w for w in workers if w.popen.poll() is None]
    if not alive:
        return
    for worker in alive:
        worker.signal(signal.SIGTERM)
    signals_before = len(received)
    deadline = time.monotonic() + _GRACE_PERIOD_S
    # A further Ctrl-C means "now": skip the rest of the grace period.
    while (
        time.monotonic() < deadline
        and len(received) == signals_before
        and any(w.popen.poll() is None for w in alive)
    ):
        time.sleep(_POLL_INTERVAL_S)
    for worker in alive:
        if worker.popen.poll() is None:
            worker.signal(signal.SIGKILL)
    for worker in alive:
        # A process stuck in the kernel can outlive SIGKILL; nothing more can be done.
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.popen.wait(timeout=10.0)


def _install_signal_handlers(record) -> dict[int, object]:
    # Python only lets the main thread set handlers; elsewhere the caller's handling applies.
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, object] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda received, _frame: record(received))
    return previous


def _restore_signal_handlers(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)  # type: ignore[arg-type]


def _positive_arg(kind: type):
    """An argparse type: the text as a `kind` > 0 (`validation.check_number`'s check)."""

    def parse(text: str):
        try:
            return check_number(kind(text), "value", integer=kind is int, low=0, low_open=True)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a positive {kind.__name__}; got {text!r}"
            ) from None

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jstrategy.launch",
        description=(
            "Run a multi-worker job on this machine: start SCRIPT once per task, each with a "
            "TF_CONFIG naming its task in a cluster of 127.0.0.1 addresses. Exits with 0 only "
            "if every worker does."
        ),
    )
    parser.add_argument(
        "--num_workers",
        "--num-workers",
        type=_positive_arg(int),
        required=True,
        help="number of worker tasks",
    )
    parser.add_argument(
        "--devices_per_worker",
        "--devices-per-worker",
        type=_positive_arg(int),
        default=None,
        help="run each worker on CPU with this many fake JAX devices",
    )
    parser.add_argument(
        "--chief", action="store_true", help="also start a chief task (process 0 of the job)"
    )
    parser.add_argument(
        "--timeout",
        type=_positive_arg(float),
        default=None,
        help="stop every worker after this many seconds and exit with 124",
    )
    parser.add_argument("script", help="the Python script each worker runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for SCRIPT")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m jstrategy.launch`` command line; returns the exit code.

    Usage: ``python -m jstrategy.launch --num_workers N [--devices_per_worker D] [--chief]
    [--timeout SECONDS] script.py [script args]``. See `launch`.
    """
    parser = _parser()
    options = parser.parse_args(argv)
    try:
        return launch(
            options.script,
            options.script_args,
            num_workers=options.num_workers,
            devices_per_worker=options.devices_per_worker,
            chief=options.chief,
            timeout=options.timeout,
        )
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
